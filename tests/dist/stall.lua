-- A rank stalled in a compute loop (test_hang.sh, test_mpi.sh): rank 1 loops at line 8, rank 0's third all_reduce times out.
local dist = require('dlua').dist
dist.init({ timeout = 3 })
local t = require('dlua').ones({ 4 })
for _ = 1, 2 do dist.all_reduce(t) end
if dist.rank() == 1 then
  local x = 0
  while true do x = x + 1 end
end
dist.all_reduce(t)
