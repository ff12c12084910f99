-- Records an idempotency outcome before the message is settled on RabbitMQ.
-- KEYS: the idempotency key.
-- ARGV: outcome ("done" marks the id completed, "release" frees this attempt's claim),
--       the claim's token, retention ms.
if ARGV[1] == "done" then
    redis.call("set", KEYS[1], "done", "PX", ARGV[3])
elseif ARGV[1] == "release" and redis.call("get", KEYS[1]) == ARGV[2] then
    redis.call("del", KEYS[1])
end
return 1
