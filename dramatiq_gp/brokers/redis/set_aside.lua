-- KEYS: acks, msgs, xq, xq msgs; ARGV: data, now
-- The fetch moved the message's id to the acks set; find it by its data.
local moved = 0
for _, id in ipairs(redis.call("smembers", KEYS[1])) do
    if redis.call("hget", KEYS[2], id) == ARGV[1] then
        redis.call("srem", KEYS[1], id)
        redis.call("hdel", KEYS[2], id)
        redis.call("zadd", KEYS[3], ARGV[2], id)
        redis.call("hset", KEYS[4], id, ARGV[1])
        moved = moved + 1
    end
end
return moved
