-- Records a consumer starting, for the dashboard: its queue among the queues
-- consumed, and its worker process. Drops the records of processes that started
-- over an hour ago and have no heartbeat (on Redis, Dramatiq's maintenance removes
-- a dead worker's; on RabbitMQ, where no maintenance runs, heartbeats older than
-- the given time are removed here), so the hash holds the live processes and a few
-- just gone; their health records (written every few seconds while they ran) go with them.
--
-- KEYS: queues (a set), workers (a hash), heartbeats, health (a hash)
-- ARGV: queue name, broker id, the worker as JSON, now (ms), remove heartbeats
--       older than this (ms; 0: none)
redis.call("sadd", KEYS[1], ARGV[1])
redis.call("hset", KEYS[2], ARGV[2], ARGV[3])
local now = tonumber(ARGV[4])
if tonumber(ARGV[5]) > 0 then
    redis.call("zremrangebyscore", KEYS[3], "-inf", "(" .. ARGV[5])
end
for _, id in ipairs(redis.call("hkeys", KEYS[2])) do
    if id ~= ARGV[2] and not redis.call("zscore", KEYS[3], id) then
        local ok, worker = pcall(cjson.decode, redis.call("hget", KEYS[2], id))
        if not ok or now - (tonumber(worker.started_ms) or 0) > 3600000 then
            redis.call("hdel", KEYS[2], id)
            redis.call("hdel", KEYS[4], id)
        end
    end
end
