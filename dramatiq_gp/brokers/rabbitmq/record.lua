-- Records the idempotency outcomes of a batch of messages before they are settled on RabbitMQ.
-- KEYS: the idempotency claims.
-- ARGV: the done marks' prefix, then for each claim in turn: the outcome ("done" frees the
--       claim and marks the id completed, "release" only frees it), the claim's token, the
--       id's digest in its done mark, and the retention in ms.
local marks = ARGV[1]
local now = nil
for i, key in ipairs(KEYS) do
    local at = 4 * i - 2
    if ARGV[at] == "done" then
        now = now or marks_time()
        mark_done(marks, ARGV[at + 3], now, ARGV[at + 2])
    end
    -- A claim another copy took over after this one's lease lapsed stays that copy's.
    if redis.call("get", key) == ARGV[at + 1] then
        redis.call("del", key)
    end
end
marks_flush(marks)
return #KEYS
