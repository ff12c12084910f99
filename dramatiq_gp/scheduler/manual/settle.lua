-- Settles the claims a backfill made on ticks (KEYS: the ticks' claim keys), those still holding its
-- token ARGV[1]: kept for ARGV[2] ms once their messages were sent, deleted when ARGV[2] is 0 (not sent).
-- A claim that lapsed meanwhile and was taken by the leader or another backfill is theirs: left alone.
local keep = tonumber(ARGV[2])
for _, key in ipairs(KEYS) do
    if redis.call("get", key) == ARGV[1] then
        if keep > 0 then
            redis.call("pexpire", key, keep)
        else
            redis.call("del", key)
        end
    end
end
return 0
