-- Records the idempotency outcomes of a batch of messages before they are settled on RabbitMQ.
-- A batch comes in six arguments, not five per message: redis-py packs each argument in Python.
-- ARGV: the done marks' prefix; the outcomes, one letter per claim ("d" frees the claim and
--       marks the id completed, "r" only frees it); the claim keys joined by "\n" (a single
--       one may hold any byte); the claims' tokens, the retentions in ms, each joined by "\n";
--       and the ids' digests in their done marks, concatenated.
local marks, outcomes, digests = ARGV[1], ARGV[2], ARGV[6]
local n = #outcomes
local tokens, retentions = marks_split(ARGV[4], n), marks_split(ARGV[5], n)
local now = nil
for i, key in ipairs(marks_split(ARGV[3], n)) do
    if string.byte(outcomes, i) == 100 then -- "d"
        now = now or marks_time()
        mark_done(marks, retentions[i], now, marks_digest(digests, i))
    end
    -- A claim another copy took over after this one's lease lapsed stays that copy's.
    if redis.call("get", key) == tokens[i] then
        redis.call("del", key)
    end
end
marks_flush(marks)
return n
