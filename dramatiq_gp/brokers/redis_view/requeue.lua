-- Moves dead letters back to the end of their queue, as they are (same ids, same messages).
-- KEYS: the dead-letter set, its messages, the reasons kept beside them, the queue (list), its messages.
-- ARGV: the Redis message ids to move; one no longer dead is left alone.
-- Refused before any write unless the queue is a list and its messages a hash (or not there yet): a
-- script that fails half-way keeps what it wrote, and a dead letter taken off its set would be lost.
local queue_type = redis.call("type", KEYS[4])["ok"]
local messages_type = redis.call("type", KEYS[5])["ok"]
if (queue_type ~= "list" and queue_type ~= "none") or (messages_type ~= "hash" and messages_type ~= "none") then
    return redis.error_reply("not a queue: " .. KEYS[4] .. " is a " .. queue_type .. ", " .. KEYS[5] .. " a " .. messages_type)
end
local moved = 0
for _, id in ipairs(ARGV) do
    local data = redis.call("hget", KEYS[2], id)
    redis.call("zrem", KEYS[1], id)
    if data then
        redis.call("hdel", KEYS[2], id)
        redis.call("hdel", KEYS[3], id)
        redis.call("hset", KEYS[5], id, data)
        redis.call("rpush", KEYS[4], id)
        moved = moved + 1
    end
end
return moved
