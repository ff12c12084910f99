-- 1 if the digest ARGV[2] has a done mark under the prefix ARGV[1], else 0.
return marked_done(marks_places(ARGV[1]), ARGV[2]) and 1 or 0
