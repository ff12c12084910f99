-- KEYS: acks, msgs, xq, xq msgs; ARGV: the redis message id it is stored under, now
-- Moves a fetched message to the dead-letter set as it came, under the id it is stored under.
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
return 1
