-- For each claim key: report its id done (2) if a done mark holds its digest (or the claim
-- key holds "done": a mark of the kit before issue 30, which kept them there), or held by
-- a running copy (3, with the claim's TTL), or claim it (1).
-- KEYS: the claims. ARGV: the lease in ms, the done marks' prefix, then a token and a
-- digest for each claim in turn.
local lease_ms, marks = ARGV[1], ARGV[2]
local places = marks_places(marks)
local result = {}
for i, key in ipairs(KEYS) do
    local token, digest = ARGV[2 * i + 1], ARGV[2 * i + 2]
    local held = redis.call("get", key)
    if held == "done" or marked_done(places, digest) then
        result[#result + 1] = 2
        result[#result + 1] = 0
    elseif not held and redis.call("set", key, token, "NX", "PX", lease_ms) then
        result[#result + 1] = 1
        result[#result + 1] = 0
    else
        result[#result + 1] = 3
        result[#result + 1] = redis.call("pttl", key)
    end
end
return result
