-- Extend the leases of the runs still going in one process; a lapsed one free again is taken back.
-- KEYS: the entries' running keys. ARGV: the lease in ms, then each key's message id.
-- Returns the 1-based indexes of the leases another run holds now (it started: they overlap).
local lost = {}
for i, key in ipairs(KEYS) do
    local held = redis.call("get", key)
    if held == ARGV[i + 1] then
        redis.call("pexpire", key, ARGV[1])
    elseif not held then
        redis.call("set", key, ARGV[i + 1], "PX", ARGV[1])
    else
        lost[#lost + 1] = i
    end
end
return lost
