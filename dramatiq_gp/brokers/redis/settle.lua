-- Settles a batch of fetched messages (ack, nack or requeue), each with its settle plan:
-- the idempotency outcome (its claim freed, its done mark made) and a delayed copy. docs/life-of-a-message.md says where this
-- call stands in a message's life.
--
-- Each message settled here is counted in this minute's throughput hash, under
-- "<queue>:done", "<queue>:retried" (acked with a copy to run later) or
-- "<queue>:dead", for the dashboard.
--
-- The layout of KEYS and ARGV is dramatiq_gp.brokers.redis.SETTLE_KEYS and SETTLE_ARGV,
-- by which RedisBroker._write_settles packs them; tests/test_settle_layout.py holds the
-- lines below, and the slot each field is read from here, to those tables.
--
-- KEYS head:  heartbeats, throughput
-- KEYS queue: acks, msgs, queue, xq, xq_msgs, dq, dq_msgs
-- ARGV head:  now, worker_id, queue_count, marks
-- ARGV queue: first_key, queue_name
-- ARGV plain: tag, first_key, redis_id
-- ARGV full:  tag, first_key, redis_id, key_index, outcome, token, mark, retention_ms, copy_id, data
--
-- KEYS: the head, then, in the order the batch first needs them, each queue's keys and the
-- idempotency key of each message whose plan has one. ARGV: the head, then queue_count
-- queue entries, then one entry per message: plain with the tag "a", "n" or "r", full with
-- "A", "N" or "R". marks is the done marks' prefix; first_key is the index of the queue's
-- first key, key_index that of the idempotency claim (0: none), mark the id's digest in
-- its done mark; data is the copy's (copy_id "": no copy), or for "N" the dead letter to keep.
local heartbeats, throughput = KEYS[1], KEYS[2]
local now = ARGV[1]
local worker_id = ARGV[2]
local queue_count = tonumber(ARGV[3])
local marks = ARGV[4]
local marks_now = nil
redis.call("zadd", heartbeats, now, worker_id)
local names = {}
for j = 0, queue_count - 1 do
    local first_key = tonumber(ARGV[5 + 2 * j])
    local queue_name = ARGV[6 + 2 * j]
    names[first_key] = queue_name
end
local counts = {}
local function count(q, kind)
    local field = names[q] .. kind
    counts[field] = (counts[field] or 0) + 1
end
local i = 5 + 2 * queue_count
while i <= #ARGV do
    local tag = ARGV[i]
    local first_key = tonumber(ARGV[i + 1])
    local redis_id = ARGV[i + 2]
    local command = string.lower(tag)
    local full = tag ~= command
    local key_index, outcome, token, mark, retention_ms, copy_id, data
    if full then
        key_index = tonumber(ARGV[i + 3])
        outcome = ARGV[i + 4]
        token = ARGV[i + 5]
        mark = ARGV[i + 6]
        retention_ms = ARGV[i + 7]
        copy_id = ARGV[i + 8]
        data = ARGV[i + 9]
    end
    local acks, msgs, queue, xq, xq_msgs, dq, dq_msgs = KEYS[first_key], KEYS[first_key + 1],
        KEYS[first_key + 2], KEYS[first_key + 3], KEYS[first_key + 4], KEYS[first_key + 5], KEYS[first_key + 6]
    local held = redis.call("srem", acks, redis_id) > 0
    if held then
        if command == "a" then
            redis.call("hdel", msgs, redis_id)
        elseif command == "r" then
            redis.call("rpush", queue, redis_id)
        else
            local kept = redis.call("hget", msgs, redis_id)
            -- A full nack carries the message as its last attempt left it: that is what is kept.
            if kept and tag == "N" then
                kept = data
            end
            if kept then
                redis.call("zadd", xq, now, redis_id)
                redis.call("hset", xq_msgs, redis_id, kept)
                redis.call("hdel", msgs, redis_id)
            end
        end
    end
    if not full then
        if held and command ~= "r" then
            count(first_key, command == "a" and ":done" or ":dead")
        end
        i = i + 3
    else
        -- A message put back as it was (requeue) runs again itself: no copy.
        if held and copy_id ~= "" and command ~= "r" then
            redis.call("hset", dq_msgs, copy_id, data)
            redis.call("rpush", dq, copy_id)
        end
        if held and command ~= "r" then
            count(first_key, command == "n" and ":dead" or (copy_id ~= "" and ":retried" or ":done"))
        end
        if key_index > 0 then
            local key = KEYS[key_index]
            if outcome == "done" then
                marks_now = marks_now or marks_time()
                mark_done(marks, retention_ms, marks_now, mark)
            end
            -- A claim another copy took over after this one's lease lapsed stays that copy's.
            if redis.call("get", key) == token then
                redis.call("del", key)
            end
        end
        i = i + 10
    end
end
marks_flush(marks)
if next(counts) then
    for field, n in pairs(counts) do
        redis.call("hincrby", throughput, field, n)
    end
    redis.call("pexpire", throughput, 7200000)
end
