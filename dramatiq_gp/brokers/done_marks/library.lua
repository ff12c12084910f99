-- Done marks, prepended to each script that writes or reads them; dramatiq_gp.brokers.done_marks
-- says why they are laid out so. Under the prefix (<ns>:gp:done:):
--   grids                                  slice length (ms) -> when a slice of that length last began (ms)
--   <slice_ms>:<slice>                     the slice's first shard count "n", its "levels" and its "marks"
--   <slice_ms>:<slice>:<shards>:<shard>    digest -> 1, for the digests of one shard of one level
-- Times are the server's (TIME), so every worker agrees on the slice whatever its clock.
local marks_counted = {}

local function marks_time()
    local t = redis.call("time")
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function marks_shard(digest, shards)
    local a, b, c, d = string.byte(digest, 1, 4)
    return (((a * 256 + b) * 256 + c) * 256 + d) % shards
end

local function marks_meta(base)
    local meta = redis.call("hmget", base, "n", "levels")
    return tonumber(meta[1]), tonumber(meta[2])
end

-- Marks digest done, remembered for at least retention_ms from now.
local function mark_done(prefix, retention_ms, now, digest)
    local slice_ms = math.max(1, math.floor(tonumber(retention_ms) / MARKS_SLICES))
    local slice = math.floor(now / slice_ms)
    local base = prefix .. slice_ms .. ":" .. slice
    local expire_at = (slice + MARKS_SLICES + 1) * slice_ms
    local n, levels = marks_meta(base)
    if not n then
        -- Sized from the slice before, so its shards stay small enough for the compact encoding.
        local before = tonumber(redis.call("hget", prefix .. slice_ms .. ":" .. (slice - 1), "marks")) or 0
        n, levels = math.max(MARKS_MIN_SHARDS, math.ceil(before / MARKS_FILL)), 1
        redis.call("hset", base, "n", n, "levels", levels)
        redis.call("pexpireat", base, expire_at)
        redis.call("hset", prefix .. "grids", slice_ms, now)
    end
    local shards = n * 2 ^ (levels - 1)
    local key = base .. ":" .. shards .. ":" .. marks_shard(digest, shards)
    if redis.call("hset", key, digest, 1) == 0 then
        return
    end
    local size = redis.call("hlen", key)
    if size == 1 then
        redis.call("pexpireat", key, expire_at)
    elseif size >= MARKS_GROW_AT then
        -- More traffic than the slice before: later marks go to a level with twice the shards.
        redis.call("hset", base, "levels", levels + 1)
    end
    marks_counted[base] = (marks_counted[base] or 0) + 1
end

local function marks_flush()
    for base, count in pairs(marks_counted) do
        redis.call("hincrby", base, "marks", count)
    end
end

-- Where a mark made now could be: each level of each slice still remembered, of every
-- slice length in use (a change of WORKER_DEDUP_RETENTION leaves the old marks readable).
local function marks_places(prefix, now)
    local places = {}
    local grids = redis.call("hgetall", prefix .. "grids")
    for j = 1, #grids, 2 do
        local slice_ms, last = tonumber(grids[j]), tonumber(grids[j + 1])
        if last + (MARKS_SLICES + 1) * slice_ms < now then
            redis.call("hdel", prefix .. "grids", grids[j])
        else
            local current = math.floor(now / slice_ms)
            for slice = current - MARKS_SLICES, current do
                local base = prefix .. slice_ms .. ":" .. slice
                local n, levels = marks_meta(base)
                for level = 1, levels or 0 do
                    local shards = n * 2 ^ (level - 1)
                    places[#places + 1] = { base .. ":" .. shards .. ":", shards }
                end
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

