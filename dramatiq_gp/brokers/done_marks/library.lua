-- Done marks, prepended to each script that writes or reads them; dramatiq_gp.brokers.done_marks
-- says why they are laid out so. Under the prefix (<ns>:gp:marks:):
--   slices                                 "<slice_ms>:<slice>" -> "<first shard count>:<levels>" of each
--                                          slice still remembered, and "<slice_ms>:<slice>:marks" -> its marks
--   <slice_ms>:<slice>:<shards>:<shard>    digest -> 1, for the digests of one shard of one level
-- One read of the small slices hash tells a look-up every key a mark could be in, whatever
-- the slice lengths in use (a change of WORKER_DEDUP_RETENTION leaves the old marks readable).
-- Writes take the time from the server (TIME), so every worker agrees on the slice whatever
-- its clock; a look-up needs none.
local marks_counted = {}

-- The n strings joined by "\n" in s (the batches' packing, see the scripts); a single one is s
-- itself, whatever bytes it holds.
local function marks_split(s, n)
    if n == 1 then
        return { s }
    end
    local parts, from = {}, 1
    for i = 1, n - 1 do
        local at = string.find(s, "\n", from, true)
        parts[i] = string.sub(s, from, at - 1)
        from = at + 1
    end
    parts[n] = string.sub(s, from)
    return parts
end

-- The i-th of the digests concatenated in s.
local function marks_digest(s, i)
    return string.sub(s, (i - 1) * MARKS_DIGEST_BYTES + 1, i * MARKS_DIGEST_BYTES)
end

local function marks_time()
    local t = redis.call("time")
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function marks_shard(digest, shards)
    local a, b, c, d = string.byte(digest, 1, 4)
    return (((a * 256 + b) * 256 + c) * 256 + d) % shards
end

-- Forgets the slices whose keys have expired, of every slice length listed.
local function marks_forget(slices, now)
    local gone = {}
    for _, field in ipairs(redis.call("hkeys", slices)) do
        local slice_ms, slice = string.match(field, "^(%d+):(%d+)")
        if tonumber(slice) + MARKS_SLICES < math.floor(now / tonumber(slice_ms)) then
            gone[#gone + 1] = field
        end
    end
    if #gone > 0 then
        redis.call("hdel", slices, unpack(gone))
    end
end

-- Marks digest done, remembered for at least retention_ms from now.
local function mark_done(prefix, retention_ms, now, digest)
    local slices = prefix .. "slices"
    local slice_ms = math.max(1, math.floor(tonumber(retention_ms) / MARKS_SLICES))
    local slice = math.floor(now / slice_ms)
    local name = slice_ms .. ":" .. slice
    local shape = redis.call("hget", slices, name)
    local n, levels
    if shape then
        local colon = string.find(shape, ":", 1, true)
        n, levels = tonumber(string.sub(shape, 1, colon - 1)), tonumber(string.sub(shape, colon + 1))
    else
        -- Sized from the slice before, so its shards stay small enough for the compact encoding.
        local before = tonumber(redis.call("hget", slices, slice_ms .. ":" .. (slice - 1) .. ":marks")) or 0
        n, levels = math.max(MARKS_MIN_SHARDS, math.ceil(before / MARKS_FILL)), 1
        redis.call("hset", slices, name, n .. ":1")
        marks_forget(slices, now)
    end
    local shards = n * 2 ^ (levels - 1)
    local key = prefix .. name .. ":" .. shards .. ":" .. marks_shard(digest, shards)
    if redis.call("hset", key, digest, 1) == 0 then
        return
    end
    local size = redis.call("hlen", key)
    if size == 1 then
        -- Kept until no look-up reads its slice any more: MARKS_SLICES slices after it ends.
        redis.call("pexpireat", key, (slice + MARKS_SLICES + 1) * slice_ms)
    elseif size >= MARKS_GROW_AT then
        -- More traffic than the slice before: later marks go to a level with twice the shards.
        redis.call("hset", slices, name, n .. ":" .. (levels + 1))
    end
    marks_counted[name] = (marks_counted[name] or 0) + 1
end

-- Adds the marks this call made to their slices' counts, one write per slice.
local function marks_flush(prefix)
    for name, count in pairs(marks_counted) do
        redis.call("hincrby", prefix .. "slices", name .. ":marks", count)
    end
end

-- Where a mark could be: each level of each slice listed, whose keys are still kept (the
-- writer forgets a slice as it starts the one whose start expires it).
local function marks_places(prefix)
    local places = {}
    local all = redis.call("hgetall", prefix .. "slices")
    for j = 1, #all, 2 do
        local n, levels = string.match(all[j + 1], "^(%d+):(%d+)$")
        if n then
            local base = prefix .. all[j] .. ":"
            n = tonumber(n)
            for level = 1, tonumber(levels) do
                places[#places + 1] = { base .. n .. ":", n }
                n = n * 2
            end
        end
    end
    return places
end

local function marked_done(places, digest)
    for _, place in ipairs(places) do
        if redis.call("hexists", place[1] .. marks_shard(digest, place[2]), digest) == 1 then
            return true
        end
    end
    return false
end

