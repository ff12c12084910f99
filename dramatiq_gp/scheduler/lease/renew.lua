if redis.call("get", KEYS[1]) == ARGV[1] then
    redis.call("pexpire", KEYS[1], ARGV[2])
    redis.call("pexpire", KEYS[2], ARGV[2])
    return 1
end
return 0
