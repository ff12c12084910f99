-- Moves stored entries on to their next tick once the leader fired the due ones, each only if
-- its due time is still the one the leader read: an entry replaced or removed meanwhile keeps
-- what its writer set (a removed one is not brought back).
-- KEYS: due index (sorted set)
-- ARGV: triples of name, the due ms the leader read, the next due ms ("" if it fires no more)
local moved = 0
for i = 1, #ARGV, 3 do
    local due = redis.call("zscore", KEYS[1], ARGV[i])
    if due and tonumber(due) == tonumber(ARGV[i + 1]) then
        if ARGV[i + 2] == "" then
            redis.call("zrem", KEYS[1], ARGV[i])
        else
            redis.call("zadd", KEYS[1], ARGV[i + 2], ARGV[i])
        end
        moved = moved + 1
    end
end
return moved
