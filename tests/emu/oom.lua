-- Out of device memory on the emulator with a small device (CUEMU_MEMORY=64 MiB, set by ctest): a request that
-- fits only once the cache is returned succeeds after emptying it; one that never fits fails naming the
-- request, the op and the allocator's statistics; the device works on afterwards.
local dlua = require 'dlua'
local cuda = dlua.cuda
assert(cuda.is_emulated(), 'oom.lua: needs the CUDA emulator (a -DDLUA_CUDA=EMU build)')
local MiB = 2 ^ 20
local failures = 0
local function expect(name, ok, detail)
  print(string.format('%-60s %s  %s', name, ok and 'ok  ' or 'FAIL', detail or ''))
  if not ok then failures = failures + 1 end
end

local a = dlua.empty(40 * MiB, { dtype = 'uint8', device = 'cuda' })
a:fill_(1)
a:free()
local before = cuda.memory_stats()
expect('a freed 40 MiB block stays cached', before.reserved >= 40 * MiB, before.reserved .. ' bytes reserved')
local ok, b = pcall(dlua.empty, 50 * MiB, { dtype = 'uint8', device = 'cuda' })
local after = cuda.memory_stats()
expect('50 MiB fits once the cache is emptied', ok, not ok and tostring(b) or nil)
expect('... by returning the cached segment', after.num_raw_frees > before.num_raw_frees,
  string.format('raw frees %d -> %d', before.num_raw_frees, after.num_raw_frees))
if ok then b:fill_(2); b:free() end

local ok2, err = pcall(dlua.empty, 100, MiB, { dtype = 'uint8', device = 'cuda' })
err = tostring(err)
expect('100 MiB on a 64 MiB device fails', not ok2)
expect('... naming the op and the request', err:find('empty', 1, true) ~= nil and err:find('(100, 1048576)', 1, true) ~= nil, err)
expect('... saying out of memory', err:find('out of memory', 1, true) ~= nil)
expect('... with the statistics', err:find('reserved', 1, true) ~= nil)
expect('... after emptying the cache', err:find('after emptying the cache', 1, true) ~= nil)
expect("... and what the device has", err:find('cuda:0 has 64.00 MiB in all', 1, true) ~= nil)
expect('the OOM is counted', cuda.memory_stats().num_ooms >= 1)
local c = dlua.ones(1000, { device = 'cuda' })
expect('the device works on after the failure', c:sum():item() == 1000)
print(failures == 0 and 'oom: all passed' or ('oom: ' .. failures .. ' failed'))
os.exit(failures == 0 and 0 or 1)
