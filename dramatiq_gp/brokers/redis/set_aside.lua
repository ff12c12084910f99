-- KEYS: acks, msgs, xq, xq msgs, xq why; ARGV: the redis message id it is stored under, now, why, ttl ms
-- Moves a fetched message to the dead-letter set as it came, under the id it is stored under, and
-- keeps why beside it (it may have no options to write it in); the reasons expire with the last
-- dead letter set aside, which outlives every earlier one.
if redis.call("srem", KEYS[1], ARGV[1]) == 0 then
    return 0
end
local data = redis.call("hget", KEYS[2], ARGV[1])
if not data then
    return 0
end
redis.call("hdel", KEYS[2], ARGV[1])
redis.call("zadd", KEYS[3], ARGV[2], ARGV[1])
redis.call("hset", KEYS[4], ARGV[1], data)
redis.call("hset", KEYS[5], ARGV[1], ARGV[3])
redis.call("pexpire", KEYS[5], ARGV[4])
return 1
