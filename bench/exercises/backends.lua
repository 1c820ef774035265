-- dlua experiment backends: all-reduce bus bandwidth and DDP step time over gloo TCP, shared memory, MPI and NCCL.
-- Each backend runs in its own 2-rank job (bench/exercises/ddp_worker.lua); one this build lacks is named, not measured.
local dlua = require 'dlua'

return function(ctx, E)
  local o = ctx.opts
  local ranks = tonumber(o.ranks) or 2
  local sizes = ctx.tiny and { 65536, 1048576 } or { 65536, 1048576, 16777216, 67108864 }
  local model, image, batch = o.model or (ctx.tiny and 'resnet18' or 'resnet18'), tonumber(o.image) or (ctx.tiny and 8 or 32),
    tonumber(o.batch) or (ctx.tiny and 2 or 16)
  local steps = ctx.tiny and 1 or 3
  local repeats = ctx.tiny and 3 or 10
  local size_list = {}
  for i, s in ipairs(sizes) do size_list[i] = tostring(s) end
  -- label, backend, environment: gloo's TCP transport with shared memory off, then dlua's default
  -- (shared memory among the ranks of one host), MPI (#26), NCCL (one GPU per rank)
  local backends = {
    { label = 'gloo TCP', backend = 'gloo', env = { DLUA_SHM = '0' } },
    { label = 'shared memory', backend = 'gloo', env = {} },
    { label = 'MPI', backend = 'mpi', env = {}, mpirun = true },
  }
  if dlua.cuda.is_available() and dlua.cuda.device_count() >= ranks then
    backends[#backends + 1] = { label = 'NCCL', backend = 'nccl', env = {} }
  end
  local rows, notes, bw_series = {}, {}, {}
  for _, b in ipairs(backends) do
    ctx:log('- %s', b.label)
    if b.mpirun and os.execute('command -v mpirun >/dev/null 2>&1') ~= 0 and os.execute('command -v mpirun >/dev/null 2>&1') ~= true then
      b.mpirun = nil  -- no mpirun: the launcher's run says why MPI cannot start
    end
    local ok, out = ctx:run({ nproc = ranks, ranks_output = '0', env = b.env, mpirun = b.mpirun, args = { 'bench/exercises/ddp_worker.lua',
      '--backend', b.backend, '--sizes', table.concat(size_list, ','), '--repeats', tostring(repeats), '--model', model,
      '--image', tostring(image), '--batch', tostring(batch), '--steps', tostring(steps), '--plans', '25:1',
      -- mpirun does not share the cores out among its ranks as dlua --nproc does
      '--threads', tostring(b.mpirun and math.max(1, math.floor(dlua.get_num_threads() / ranks)) or 0) } })
    local row = { backend = b.label }
    local bw = {}
    if ok then
      for line in out:gmatch('[^\n]+') do
        local f = {}
        for c in line:gsub('^%[0%] ', ''):gmatch('[^\t]+') do f[#f + 1] = c end
        if f[1] == 'missing' then row.missing = f[3]
        elseif f[1] == 'backend' then row.transport = f[3]
        elseif f[1] == 'allreduce' then bw[tonumber(f[2])] = tonumber(f[4])
        elseif f[1] == 'ddp' then row.ddp_ms = tonumber(f[5]) * 1e3
        elseif f[1] == 'gradients' then row.grad_mb = tonumber(f[2]) end
      end
    else
      row.missing = 'the run failed (see above)'
    end
    if row.missing then
      local why = row.missing
      if b.backend == 'mpi' and why:find('unknown backend', 1, true) then why = ctx:missing('needs #26 (the MPI backend)') end
      row.transport = why
      notes[#notes + 1] = ('%s: %s'):format(b.label, why)
    else
      for _, s in ipairs(sizes) do row['bw_' .. s] = bw[s] end
      local ys = {}
      for i, s in ipairs(sizes) do ys[i] = bw[s] end
      bw_series[#bw_series + 1] = { label = b.label, x = sizes, y = ys }
    end
    rows[#rows + 1] = row
  end
  if not (dlua.cuda.is_available() and dlua.cuda.device_count() >= ranks) then
    notes[#notes + 1] = ('NCCL: needs %d GPUs (%s)'):format(ranks, dlua.cuda.is_available() and
      (dlua.cuda.device_count() .. ' here') or tostring(dlua.cuda.unavailable_reason()))
  end
  local cols = { { 'backend', 'backend' }, { 'transport', 'transport' } }
  for _, s in ipairs(sizes) do
    cols[#cols + 1] = { 'bw_' .. s, ('%s GB/s'):format(s >= 2 ^ 20 and (s / 2 ^ 20 .. ' MB') or (s / 1024 .. ' KB')), '%.3f' }
  end
  cols[#cols + 1] = { 'ddp_ms', ('DDP step ms (%s %dpx, batch %d)'):format(model, image, batch), '%.1f' }
  ctx:table({ title = ('all-reduce bus bandwidth (GB/s, median) and DDP step time, %d ranks on one host'):format(ranks),
    columns = cols, rows = rows, notes = notes })
  local mbs = {}
  for i, s in ipairs(sizes) do mbs[i] = s / 2 ^ 20 end
  for _, s in ipairs(bw_series) do s.x = mbs end
  local names, steps_ms = {}, { label = 'DDP step (ms)', y = {} }
  for _, r in ipairs(rows) do
    if r.ddp_ms then
      names[#names + 1] = r.backend
      steps_ms.y[#steps_ms.y + 1] = r.ddp_ms
    end
  end
  local panels = { { title = 'all-reduce bus bandwidth', xlabel = 'MB', ylabel = 'GB/s', logx = true, kind = 'linespoints',
    series = bw_series, key = 'top left' } }
  if #names > 0 then
    panels[2] = { title = ('DDP step time, %s %dpx batch %d'):format(model, image, batch), ylabel = 'ms', kind = 'bars',
      categories = names, series = { steps_ms } }
  end
  if #bw_series == 0 then error('experiment backends: no backend ran (see above)', 0) end
  ctx:figure({ title = ('backends, %d ranks'):format(ranks), panels = panels })
end
