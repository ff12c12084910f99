-- KEYS: lease, holder info, released channel; ARGV: lease value
-- Frees the lease if it still holds our value, and tells the contenders at once.
if redis.call("get", KEYS[1]) == ARGV[1] then
    redis.call("del", KEYS[1], KEYS[2])
    redis.call("publish", KEYS[3], ARGV[1])
    return 1
end
return 0
