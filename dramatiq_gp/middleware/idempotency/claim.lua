-- For each key: claim it (state 1), or report it done (2) or held by a running copy (3, with its TTL).
local result = {}
for i, key in ipairs(KEYS) do
    local v = redis.call("get", key)
    if not v then
        redis.call("set", key, ARGV[i + 1], "PX", ARGV[1])
        result[#result + 1] = 1
        result[#result + 1] = 0
    elseif v == "done" then
        result[#result + 1] = 2
        result[#result + 1] = 0
    else
        result[#result + 1] = 3
        result[#result + 1] = redis.call("pttl", key)
    end
end
return result
