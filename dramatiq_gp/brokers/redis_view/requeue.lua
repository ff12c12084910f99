-- Moves dead letters back to the end of their queue, as they are (same ids, same messages).
-- KEYS: the dead-letter set, its messages, the queue (list), its messages.
-- ARGV: the Redis message ids to move; one no longer dead is left alone.
local moved = 0
for _, id in ipairs(ARGV) do
    local data = redis.call("hget", KEYS[2], id)
    redis.call("zrem", KEYS[1], id)
    if data then
        redis.call("hdel", KEYS[2], id)
        redis.call("hset", KEYS[4], id, data)
        redis.call("rpush", KEYS[3], id)
        moved = moved + 1
    end
end
return moved
