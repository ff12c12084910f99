-- KEYS: queue, queue msgs, for each queue of the batch
-- ARGV: for each message: the index of its queue's pair in KEYS (1, 3, 5...), redis message id, data
-- Dramatiq's dispatch.lua "enqueue" for a whole batch in one call: the data in the
-- queue's hash, the id at the tail of its list.
for i = 1, #ARGV, 3 do
    local queue = tonumber(ARGV[i])
    redis.call("hset", KEYS[queue + 1], ARGV[i + 1], ARGV[i + 2])
    redis.call("rpush", KEYS[queue], ARGV[i + 1])
end
