-- KEYS: a queue's msgs, its delay queue's msgs.
-- 1 if either stores a message (ready, in flight or delayed) that is not held for an
-- unknown task type, else 0. It stops at the first such message: a backlog costs one
-- short scan, not a decode of every message on each poll of broker.join (that blocked
-- Redis for 230 ms per poll with 16,000 stored). Only held messages are decoded whole.
for _, key in ipairs(KEYS) do
    local cursor = "0"
    repeat
        local page = redis.call("hscan", key, cursor, "COUNT", 100)
        cursor = page[1]
        local entries = page[2]
        for i = 2, #entries, 2 do
            local data = entries[i]
            if not string.find(data, "gp_unknown_since", 1, true) then
                return 1
            end
            local ok, message = pcall(cjson.decode, data)
            local held = ok and type(message) == "table" and type(message.options) == "table"
                and message.options.gp_unknown_since ~= nil
            if not held then
                return 1
            end
        end
    until cursor == "0"
end
return 0
