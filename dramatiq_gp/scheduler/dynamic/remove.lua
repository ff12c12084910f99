-- Removes one stored schedule entry, its due time, its name from the index, its last fired tick
-- and its pause, in one call.
-- KEYS: stored entries (hash), due index (sorted set), last fired (hash), paused entries (hash),
--       the name index (sorted set)
-- ARGV: name
-- Returns 1 if there was such an entry, else 0.
if redis.call("hdel", KEYS[1], ARGV[1]) == 0 then
    return 0
end
redis.call("zrem", KEYS[2], ARGV[1])
redis.call("zrem", KEYS[5], ARGV[1])
redis.call("hdel", KEYS[3], ARGV[1])
redis.call("hdel", KEYS[4], ARGV[1])
return 1
