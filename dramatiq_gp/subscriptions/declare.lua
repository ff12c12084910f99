-- Declares one worker process's listeners, and retires those no worker has declared for a while.
-- KEYS: specs (hash: task type -> JSON), last declared (sorted set: task type -> ms), version (counter)
-- ARGV: now ms, retire before ms, then task type and spec pairs
-- Returns the version, incremented when the set or a spec changed, and 1 if it did (else 0).
local changed = false
for i = 3, #ARGV, 2 do
    if redis.call("hget", KEYS[1], ARGV[i]) ~= ARGV[i + 1] then
        redis.call("hset", KEYS[1], ARGV[i], ARGV[i + 1])
        changed = true
    end
    redis.call("zadd", KEYS[2], ARGV[1], ARGV[i])
end
local stale = redis.call("zrangebyscore", KEYS[2], "-inf", "(" .. ARGV[2])
for _, name in ipairs(stale) do
    redis.call("zrem", KEYS[2], name)
    redis.call("hdel", KEYS[1], name)
    changed = true
end
if changed then
    return {redis.call("incr", KEYS[3]), 1}
end
return {tonumber(redis.call("get", KEYS[3]) or "0"), 0}
