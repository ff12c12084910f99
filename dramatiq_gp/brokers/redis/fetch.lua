-- KEYS: heartbeats, queue, queue msgs, acks; ARGV: now, worker id, how many at most
-- Dramatiq's dispatch.lua "fetch" (its heartbeat, ids from the head of the queue into
-- this worker's acks set), returning the ids with their data: {ids, data}. A message
-- is settled by the id it is stored under, so the consumer must know that id, not
-- trust the one written in the data.
redis.call("zadd", KEYS[1], ARGV[1], ARGV[2])
local ids = {}
for i = 1, tonumber(ARGV[3]) do
    local id = redis.call("lpop", KEYS[2])
    if not id then
        break
    end
    ids[i] = id
end
if #ids == 0 then
    return {{}, {}}
end
redis.call("sadd", KEYS[4], unpack(ids))
return {ids, redis.call("hmget", KEYS[3], unpack(ids))}
