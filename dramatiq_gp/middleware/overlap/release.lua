-- Free an entry for its next run, unless the lease lapsed and another run holds it now.
-- KEYS[1]: the entry's running key. ARGV[1]: the message id of the run that ended.
if redis.call("get", KEYS[1]) == ARGV[1] then
    return redis.call("del", KEYS[1])
end
return 0
