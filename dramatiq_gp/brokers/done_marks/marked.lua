-- For each digest ARGV[2..]: 1 if it has a done mark under the prefix ARGV[1], else 0 (in order).
local places = marks_places(ARGV[1])
local found = {}
for i = 2, #ARGV do
    found[i - 1] = marked_done(places, ARGV[i]) and 1 or 0
end
return found
