-- Records the idempotency outcomes of a batch of messages before they are settled on RabbitMQ.
-- KEYS: the idempotency keys.
-- ARGV: for each key in turn, the outcome ("done" marks the id completed, "release" frees
--       this attempt's claim), the claim's token, and the retention in ms.
for i, key in ipairs(KEYS) do
    local outcome, token = ARGV[3 * i - 2], ARGV[3 * i - 1]
    if outcome == "done" then
        redis.call("set", key, "done", "PX", ARGV[3 * i])
    elseif outcome == "release" and redis.call("get", key) == token then
        redis.call("del", key)
    end
end
return #KEYS
