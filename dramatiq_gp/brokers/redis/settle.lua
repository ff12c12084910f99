-- Settles a batch of fetched messages (ack, nack or requeue), each with what the
-- kit records alongside it: the idempotency outcome and a delayed copy.
--
-- Each message settled here is counted in this minute's throughput hash, under
-- "<queue>:done", "<queue>:retried" (acked with a copy to run later) or
-- "<queue>:dead", for the dashboard.
--
-- KEYS: heartbeats, this minute's throughput, then seven keys per queue in the
--       batch (acks, msgs, queue, xq, xq msgs, delay queue, delay msgs), then
--       the idempotency keys.
-- ARGV: now, worker id, how many queues, each queue's first key and name, then
--       one entry per message:
--       plain: "a"|"n"|"r", first key of its queue, redis message id
--       full:  "A"|"N"|"R", first key of its queue, redis message id, key index
--              of its idempotency key (0: none), outcome, token, retention ms,
--              copy id ("": none), copy data (for "N": the dead letter to keep)
local now = ARGV[1]
redis.call("zadd", KEYS[1], now, ARGV[2])
local names = {}
local queues = tonumber(ARGV[3])
for j = 0, queues - 1 do
    names[tonumber(ARGV[4 + 2 * j])] = ARGV[5 + 2 * j]
end
local counts = {}
local function count(q, kind)
    local field = names[q] .. kind
    counts[field] = (counts[field] or 0) + 1
end
local i = 4 + 2 * queues
while i <= #ARGV do
    local tag = ARGV[i]
    local command = string.lower(tag)
    local q = tonumber(ARGV[i + 1])
    local id = ARGV[i + 2]
    local acks, msgs, queue, xq, xq_msgs, dq, dq_msgs =
        KEYS[q], KEYS[q + 1], KEYS[q + 2], KEYS[q + 3], KEYS[q + 4], KEYS[q + 5], KEYS[q + 6]
    local held = redis.call("srem", acks, id) > 0
    if held then
        if command == "a" then
            redis.call("hdel", msgs, id)
        elseif command == "r" then
            redis.call("rpush", queue, id)
        else
            local data = redis.call("hget", msgs, id)
            -- A full nack carries the message as its last attempt left it: that is what is kept.
            if data and tag == "N" then
                data = ARGV[i + 8]
            end
            if data then
                redis.call("zadd", xq, now, id)
                redis.call("hset", xq_msgs, id, data)
                redis.call("hdel", msgs, id)
            end
        end
    end
    if tag == command then
        if held and command ~= "r" then
            count(q, command == "a" and ":done" or ":dead")
        end
        i = i + 3
    else
        local key_index, outcome, token, retention = tonumber(ARGV[i + 3]), ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
        local copy_id, copy_data = ARGV[i + 7], ARGV[i + 8]
        -- A message put back as it was (requeue) runs again itself: no copy.
        if held and copy_id ~= "" and command ~= "r" then
            redis.call("hset", dq_msgs, copy_id, copy_data)
            redis.call("rpush", dq, copy_id)
        end
        if held and command ~= "r" then
            count(q, command == "n" and ":dead" or (copy_id ~= "" and ":retried" or ":done"))
        end
        if key_index > 0 then
            local key = KEYS[key_index]
            if outcome == "done" then
                redis.call("set", key, "done", "PX", retention)
            elseif outcome == "release" and redis.call("get", key) == token then
                redis.call("del", key)
            end
        end
        i = i + 9
    end
end
if next(counts) then
    for field, n in pairs(counts) do
        redis.call("hincrby", KEYS[2], field, n)
    end
    redis.call("pexpire", KEYS[2], 7200000)
end
