-- KEYS: heartbeats, acks, msgs, queue, xq, xq msgs, idempotency key, delay queue, delay msgs
-- ARGV: command, now, worker id, redis message id, outcome, token, retention ms, copy id, copy data
redis.call("zadd", KEYS[1], ARGV[2], ARGV[3])
local id = ARGV[4]
if redis.call("srem", KEYS[2], id) > 0 then
    if ARGV[1] == "ack" then
        redis.call("hdel", KEYS[3], id)
    elseif ARGV[1] == "requeue" then
        redis.call("rpush", KEYS[4], id)
    else
        local data = redis.call("hget", KEYS[3], id)
        if data then
            redis.call("zadd", KEYS[5], ARGV[2], id)
            redis.call("hset", KEYS[6], id, data)
            redis.call("hdel", KEYS[3], id)
        end
    end
    -- A message put back as it was (requeue) runs again itself: no copy.
    if ARGV[8] ~= "" and ARGV[1] ~= "requeue" then
        redis.call("hset", KEYS[9], ARGV[8], ARGV[9])
        redis.call("rpush", KEYS[8], ARGV[8])
    end
end
if ARGV[5] == "done" then
    redis.call("set", KEYS[7], "done", "PX", ARGV[7])
elseif ARGV[5] == "release" and redis.call("get", KEYS[7]) == ARGV[6] then
    redis.call("del", KEYS[7])
end
