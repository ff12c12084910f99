-- KEYS: lease, epoch counter, holder info; ARGV: token, ttl ms, host, pid, now ms
if redis.call("exists", KEYS[1]) == 1 then
    return 0
end
local epoch = redis.call("incr", KEYS[2])
redis.call("set", KEYS[1], epoch .. "/" .. ARGV[1], "NX", "PX", ARGV[2])
redis.call("hset", KEYS[3], "epoch", epoch, "host", ARGV[3], "pid", ARGV[4], "acquired_at", ARGV[5])
redis.call("pexpire", KEYS[3], ARGV[2])
return epoch
