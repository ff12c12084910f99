-- Take the lease of an entry's run for one message, or say which message holds it.
-- KEYS[1]: the entry's running key. ARGV: the message id, the lease in ms.
-- Returns nil once the lease is this message's: it was free, or already this message's (a copy of
-- a run that crashed, delivered again: it is that same run), else the holder's message id.
local held = redis.call("get", KEYS[1])
if held and held ~= ARGV[1] then
    return held
end
redis.call("set", KEYS[1], ARGV[1], "PX", ARGV[2])
return false
