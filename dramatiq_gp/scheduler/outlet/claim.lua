-- Fires one tick of one schedule entry: checks the lease, claims the tick and stores
-- its message, atomically, so no tick is claimed twice or claimed without its message.
-- KEYS: lease, tick, last fired (hash), paused entries (hash), the hash the message is
--       stored in, and the queue (list) its field is pushed onto, if any
-- ARGV: lease value, tick ttl ms, entry, tick ms, the message's field, message data
-- With the queues in this Redis and no replica to wait for, the hash is the queue's
-- messages and the field the message's redis id, pushed onto the queue: the tick is
-- enqueued. Otherwise (queues on RabbitMQ, or a claim that must reach a replica before
-- its message may run) the hash is <ns>:scheduler:unpublished, the field
-- "<entry>:<tick ms>" and no queue is given: the outlet sends the message next.
-- Returns "fired"; "deduplicated" (fired already); "paused" (the entry is paused: the
-- tick counts as passed over, so resuming it does not catch up the pause);
-- "lease_lost" (the lease holds another leader's value, or none).
if redis.call("get", KEYS[1]) ~= ARGV[1] then
    return "lease_lost"
end
-- This leader's own claim, still unsent, sent again (redis-py retries a call whose reply was
-- lost): fired, its message stored anew, so that the call is a write the WAIT after it covers.
if not KEYS[6] and redis.call("get", KEYS[2]) == ARGV[1] and redis.call("hexists", KEYS[5], ARGV[5]) == 1 then
    redis.call("hset", KEYS[5], ARGV[5], ARGV[6])
    return "fired"
end
local last = tonumber(redis.call("hget", KEYS[3], ARGV[3]) or "-1")
if last >= tonumber(ARGV[4]) then
    return "deduplicated"
end
if redis.call("hexists", KEYS[4], ARGV[3]) == 1 then
    redis.call("hset", KEYS[3], ARGV[3], ARGV[4])
    return "paused"
end
if not redis.call("set", KEYS[2], ARGV[1], "NX", "PX", ARGV[2]) then
    return "deduplicated"
end
redis.call("hset", KEYS[3], ARGV[3], ARGV[4])
redis.call("hset", KEYS[5], ARGV[5], ARGV[6])
if KEYS[6] then
    redis.call("rpush", KEYS[6], ARGV[5])
end
return "fired"
