-- Declares one worker process's listeners, retires those no worker has declared for a while,
-- and forgets the retired ones after a longer while.
-- KEYS: specs (hash: task type -> JSON), last declared (sorted set: task type -> ms), version (counter),
--       retired (hash: task type -> "<ms retired> <JSON>")
-- ARGV: now ms, retire before ms, forget before ms, then task type and spec pairs
-- Returns the version, incremented when the set or a spec changed, and 1 if it did (else 0).
local changed = false
for i = 4, #ARGV, 2 do
    if redis.call("hget", KEYS[1], ARGV[i]) ~= ARGV[i + 1] then
        redis.call("hset", KEYS[1], ARGV[i], ARGV[i + 1])
        changed = true
    end
    redis.call("zadd", KEYS[2], ARGV[1], ARGV[i])
    if redis.call("hdel", KEYS[4], ARGV[i]) == 1 then
        changed = true
    end
end
local stale = redis.call("zrangebyscore", KEYS[2], "-inf", "(" .. ARGV[2])
for _, name in ipairs(stale) do
    local spec = redis.call("hget", KEYS[1], name)
    redis.call("zrem", KEYS[2], name)
    redis.call("hdel", KEYS[1], name)
    if spec then
        redis.call("hset", KEYS[4], name, ARGV[1] .. " " .. spec)
    end
    changed = true
end
local retired = redis.call("hgetall", KEYS[4])
for i = 1, #retired, 2 do
    local at = tonumber(string.match(retired[i + 1], "^(%d+) "))
    if at == nil or at < tonumber(ARGV[3]) then
        redis.call("hdel", KEYS[4], retired[i])
        changed = true
    end
end
if changed then
    return {redis.call("incr", KEYS[3]), 1}
end
return {tonumber(redis.call("get", KEYS[3]) or "0"), 0}
