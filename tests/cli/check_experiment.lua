-- Checks what `dlua experiment NAME --tiny --out DIR` wrote: NAME.json's table (rows, numbers where measured), NAME.md.
-- usage: dlua tests/cli/check_experiment.lua NAME DIR   (exits 1 naming the first problem)
local json = require 'dlua.json'
local name, dir = assert(arg[1]), assert(arg[2])
local function fail(fmt, ...) io.stderr:write(('%s: '):format(name), fmt:format(...), '\n'); os.exit(1) end
local f = io.open(dir .. '/' .. name .. '.json') or fail('no %s/%s.json', dir, name)
local t = json.decode(f:read('*a'))
f:close()
if t.name ~= name or t.tiny ~= true then fail('the table is not the tiny %s one', name) end
local rows = t.rows
local function positive(r, k, what)
  if type(r[k]) ~= 'number' or not (r[k] > 0) then fail('%s: %s is %s, expected a positive number', what, k, tostring(r[k])) end
end
if name == 'accumulation' then
  if #rows ~= 4 then fail('%d rows, expected accumulate 1, 2, 4, 8', #rows) end
  for i, r in ipairs(rows) do
    if r.accumulate ~= 2 ^ (i - 1) then fail('row %d is accumulate %s', i, tostring(r.accumulate)) end
    positive(r, 'img_s', 'accumulate ' .. r.accumulate)
    positive(r, 'peak_mb', 'accumulate ' .. r.accumulate)
  end
  -- (at this size the activations are a few MB under 130 MB of model state: no memory ordering to check)
elseif name == 'backends' then
  local by = {}
  for _, r in ipairs(rows) do by[r.backend] = r end
  if not by['gloo TCP'] or by['gloo TCP'].transport ~= 'tcp' then fail('no gloo TCP row on transport tcp') end
  if not by['shared memory'] or by['shared memory'].transport ~= 'shm' then fail('no shared-memory row on transport shm') end
  for _, k in ipairs({ 'gloo TCP', 'shared memory' }) do
    positive(by[k], 'bw_1048576', k)
    positive(by[k], 'ddp_ms', k)
  end
  if not by.MPI then fail('no MPI row (measured, or named as missing)') end
  if not (type(by.MPI.bw_1048576) == 'number' or tostring(by.MPI.transport):find('not on this build', 1, true)) then
    fail('MPI neither measured nor named as missing: %s', tostring(by.MPI.transport))
  end
elseif name == 'amp' then
  if #rows ~= 3 or rows[1].precision ~= 'float32' then fail('expected float32, bfloat16, float16 rows') end
  positive(rows[1], 'img_s', 'float32')
  positive(rows[1], 'peak_mb', 'float32')
  if not (rows[1].accuracy >= 0 and rows[1].accuracy <= 1) then fail('float32 accuracy %s', tostring(rows[1].accuracy)) end
  for i = 2, 3 do
    local r = rows[i]
    if not (type(r.img_s) == 'number' or tostring(r.status):find('not on this build', 1, true)) then
      fail('%s neither measured nor named as missing: %s', r.precision, tostring(r.status))
    end
  end
elseif name == 'activation-checkpointing' then
  if #rows ~= 3 then fail('%d rows, expected none, blocks, stages', #rows) end
  for _, r in ipairs(rows) do positive(r, 'peak_mb', r.policy); positive(r, 'step_ms', r.policy) end
  if not (rows[2].peak_mb < rows[1].peak_mb) then fail('blocks peaks at %g MB, not below none (%g MB)', rows[2].peak_mb, rows[1].peak_mb) end
elseif name == 'buckets' then
  local fixed, auto = {}, nil
  for _, r in ipairs(rows) do
    if r.plan:find('^fixed') then fixed[#fixed + 1] = r elseif r.plan:find('auto', 1, true) then auto = r end
  end
  if #fixed ~= 3 then fail('%d fixed plans, expected 3', #fixed) end
  for i, r in ipairs(fixed) do
    positive(r, 'step_ms', r.bucket_mb .. ' MB')
    if i > 1 and r.buckets > fixed[i - 1].buckets then fail('%g MB buckets give more buckets than %g MB', r.bucket_mb, fixed[i - 1].bucket_mb) end
  end
  if not (fixed[1].buckets > fixed[3].buckets) then fail('1 MB and 256 MB buckets cut alike') end
  if not auto then fail('no bucket_mb = auto row: %s', table.concat(t.notes, ' ')) end
  positive(auto, 'step_ms', 'auto')
  positive(auto, 'bucket_mb', 'auto')
else
  fail('unknown experiment')
end
f = io.open(dir .. '/' .. name .. '.md') or fail('no %s.md', name)
local md = f:read('*a')
f:close()
if not md:find('\n|%-%-%-|') then fail('%s.md has no markdown table', name) end
print(('%s: table ok (%d rows)'):format(name, #rows))
