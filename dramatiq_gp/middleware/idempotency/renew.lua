for i, key in ipairs(KEYS) do
    if redis.call("get", key) == ARGV[i + 1] then
        redis.call("pexpire", key, ARGV[1])
    end
end
