-- For each claim key: report its id done (2) if a done mark holds its digest (or the claim
-- key holds "done": a mark of the kit before issue 30, which kept them there), or held by
-- a running copy (3, with the claim's TTL), or claim it (1).
-- A batch comes in five arguments, not three per message: redis-py packs each argument in
-- Python, which cost the consumer thread more than the rest of the claim.
-- ARGV: the lease in ms, the done marks' prefix, the claim keys joined by "\n" (a single one
-- may hold any byte), the tokens' prefix (the i-th claim's token is it and i - 1 in hex), and
-- the ids' digests, concatenated: as many as there are keys.
-- Returns: the states, one digit per key, in one string; then the TTL of each 3, in order.
local lease_ms, marks, prefix, digests = ARGV[1], ARGV[2], ARGV[4], ARGV[5]
local places = marks_places(marks)
local states, ttls = {}, {}
for i, key in ipairs(marks_split(ARGV[3], #digests / MARKS_DIGEST_BYTES)) do
    local held = redis.call("get", key)
    if held == "done" or marked_done(places, marks_digest(digests, i)) then
        states[i] = "2"
    elseif not held and redis.call("set", key, prefix .. string.format("%x", i - 1), "NX", "PX", lease_ms) then
        states[i] = "1"
    else
        states[i] = "3"
        ttls[#ttls + 1] = redis.call("pttl", key)
    end
end
return { table.concat(states), unpack(ttls) }
