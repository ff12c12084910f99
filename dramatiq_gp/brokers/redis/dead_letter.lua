-- KEYS: acks, msgs, xq, xq msgs, skipped counts
-- ARGV: redis message id, data to keep, now, task type, counts ttl ms
if redis.call("srem", KEYS[1], ARGV[1]) == 0 then
    return 0
end
redis.call("hdel", KEYS[2], ARGV[1])
redis.call("zadd", KEYS[3], ARGV[3], ARGV[1])
redis.call("hset", KEYS[4], ARGV[1], ARGV[2])
redis.call("hincrby", KEYS[5], ARGV[4], 1)
redis.call("pexpire", KEYS[5], ARGV[5])
return 1
