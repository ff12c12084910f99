-- Enqueues a claimed tick kept in <ns>:scheduler:unpublished onto its Redis queue, once:
-- the field is taken out in the same call, so of a firing leader and a recovering one
-- (or two recovering ones) only the first pushes it.
-- KEYS: unpublished (hash), the queue's messages (hash), the queue (list)
-- ARGV: the tick's field ("<entry>:<tick ms>"), the message's redis id, the message with
--       that redis id in its options (the caller's: the id pushed and the id in the data agree)
-- Returns 1 if pushed, 0 if the field was gone (sent already).
if redis.call("hdel", KEYS[1], ARGV[1]) == 0 then
    return 0
end
redis.call("hset", KEYS[2], ARGV[2], ARGV[3])
redis.call("rpush", KEYS[3], ARGV[2])
return 1
