-- KEYS: a queue's msgs, its delay queue's msgs. Counts what is stored in either (ready,
-- in flight or delayed) except the messages held for an unknown task type.
local n = 0
for _, key in ipairs(KEYS) do
    for _, data in ipairs(redis.call("hvals", key)) do
        local ok, message = pcall(cjson.decode, data)
        local held = ok and type(message) == "table" and type(message.options) == "table"
            and message.options.gp_unknown_since ~= nil
        if not held then
            n = n + 1
        end
    end
end
return n
