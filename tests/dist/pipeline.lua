-- dist.Pipeline end to end on 4 ranks: gradients equal the unsplit model (float64, both schedules, chunks 1/3/8, uneven batches), 2 pipelines x 2 replicas equal one rank, activation counts, errors.
-- Run: dlua --nproc 4 tests/dist/pipeline.lua
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local dist = dlua.dist
dist.init{ timeout = 60 }
local rank, world = dist.rank(), dist.world_size()
local Pipeline = dist.Pipeline
local checks = 0
local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end
local f64 = { dtype = 'float64' }

local function mlp(seed, dtype)
  dlua.manual_seed(seed)
  local o = { dtype = dtype or 'float64' }
  return nn.Sequential{ nn.Linear(6, 16, o), nn.ReLU(), nn.Linear(16, 16, o), nn.ReLU(), nn.Linear(16, 12, o), nn.ReLU(),
                        nn.Linear(12, 5, o) }
end

local function batch(seed, n)
  local g = dlua.Generator(seed)
  return dlua.randn({ n, 6 }, { generator = g, dtype = 'float64' }), dlua.randint(1, 6, { n }, { generator = g, dtype = 'int64' })
end

local function grads_by_name(m)
  local r = {}
  for _, e in ipairs(m:named_parameters()) do r[e.name] = e.grad end
  return r
end

local function max_diff(a, b) return (a:double() - b:double()):abs():max():item() end

-- the reference: the whole batch through the unsplit model on this rank
local function reference(seed, x, y)
  local ref = mlp(seed)
  ref:zero_grad()
  local crit = nn.CrossEntropyLoss()
  local out = ref:forward(x)
  local loss = crit:forward(out, y):item()
  ref:backward(x, crit:backward(out, y))
  return ref, loss
end

-- micro-batches that stage s (1-based) of p holds at most
local function expected_live(schedule, p, s, n)
  if schedule == 'gpipe' then return n end
  return math.min(p - s + 1, n)
end

---------------------------------------------------------------------------------------------
-- 1. Schedules, partition and split on one rank (pure functions; rank 0 only)
if rank == 0 then
  -- every schedule is a valid order (each micro-batch forward once, then backward once, both in order)
  -- and, simulated with unit-time forwards and backwards, finishes in 2 (n + p - 1) steps: the
  -- bubble (p - 1)/(n + p - 1) of the papers; no stage waits forever
  for _, kind in ipairs({ 'gpipe', '1f1b' }) do
    for p = 1, 5 do
      for n = 1, 9 do
        local lists, peak = {}, {}
        for s = 1, p do
          local ops = Pipeline.schedule(kind, p, s, n)
          local fdone, bdone, live = 0, 0, 0
          peak[s] = 0
          for _, op in ipairs(ops) do
            if op.kind == 'F' then
              if op.micro ~= fdone + 1 then fail('%s p=%d n=%d stage %d: forward %d out of order', kind, p, n, s, op.micro) end
              fdone, live = fdone + 1, live + 1
            else
              if op.micro ~= bdone + 1 or op.micro > fdone then fail('%s p=%d n=%d stage %d: backward %d out of order', kind, p, n, s, op.micro) end
              bdone, live = bdone + 1, live - 1
            end
            peak[s] = math.max(peak[s], live)
          end
          if fdone ~= n or bdone ~= n then fail('%s p=%d n=%d stage %d: %d forwards, %d backwards', kind, p, n, s, fdone, bdone) end
          if peak[s] ~= expected_live(kind, p, s, n) then fail('%s p=%d n=%d stage %d holds %d', kind, p, n, s, peak[s]) end
          lists[s] = ops
        end
        -- event simulation: F(s, i) needs F(s-1, i); B(s, i) needs B(s+1, i) (the last stage: its own F)
        local fend, bend, pos, clock = {}, {}, {}, {}
        for s = 1, p do fend[s], bend[s], pos[s], clock[s] = {}, {}, 1, 0 end
        local progress = true
        while progress do
          progress = false
          for s = 1, p do
            local op = lists[s][pos[s]]
            if op then
              local i, ready = op.micro, nil
              if op.kind == 'F' then ready = s == 1 and 0 or fend[s - 1][i]
              else ready = s == p and fend[s][i] or bend[s + 1][i] end
              if ready then
                local t = math.max(clock[s], ready) + 1
                if op.kind == 'F' then fend[s][i] = t else bend[s][i] = t end
                clock[s], pos[s], progress = t, pos[s] + 1, true
              end
            end
          end
        end
        for s = 1, p do
          if pos[s] <= #lists[s] then fail('%s p=%d n=%d: stage %d is stuck at op %d', kind, p, n, s, pos[s]) end
        end
        if bend[1][n] ~= 2 * (n + p - 1) then fail('%s p=%d n=%d: makespan %d, expected %d', kind, p, n, bend[1][n], 2 * (n + p - 1)) end
      end
    end
  end
  checks = checks + 1

  local sz = Pipeline.split_sizes(10, 3)
  if table.concat(sz, ',') ~= '4,3,3' then fail('split_sizes(10, 3) = %s', table.concat(sz, ',')) end
  sz = Pipeline.split_sizes(3, 8)
  if table.concat(sz, ',') ~= '1,1,1' then fail('split_sizes(3, 8) = %s', table.concat(sz, ',')) end

  -- partition against every possible cut
  local g = dlua.Generator(5)
  for trial = 1, 30 do
    local k, n = 2 + trial % 7, 1 + trial % 4
    if n > k then n = k end
    local costs = {}
    for i = 1, k do costs[i] = dlua.randint(0, 20, { 1 }, { generator = g }):item() end
    local bounds = Pipeline.partition(costs, n)
    local worst = 0
    for j, b in ipairs(bounds) do
      if b[1] > b[2] or (j > 1 and b[1] ~= bounds[j - 1][2] + 1) then fail('partition: bad bounds') end
      local s = 0
      for i = b[1], b[2] do s = s + costs[i] end
      worst = math.max(worst, s)
    end
    if bounds[1][1] ~= 1 or bounds[n][2] ~= k then fail('partition does not cover 1..%d', k) end
    local best = math.huge
    local function search(start, parts, cur)
      if parts == 0 then
        if start > k then best = math.min(best, cur) end
        return
      end
      local s = 0
      for e = start, k - parts + 1 do
        s = s + costs[e]
        search(e + 1, parts - 1, math.max(cur, s))
      end
    end
    search(1, n, 0)
    if worst ~= best then fail('partition of {%s} into %d: largest part %g, best %g', table.concat(costs, ','), n, worst, best) end
  end

  -- split keeps the model's names and modules; by time it checks the chain against the model
  local m = mlp(3)
  local stages, info = Pipeline.split(m, 3, { input = dlua.randn({ 4, 6 }, f64) })
  if #stages ~= 3 or info.by ~= 'time' or #info.units ~= 7 then fail('split by time: %d stages, %s', #stages, info.by) end
  local names = {}
  for _, st in ipairs(stages) do
    for _, e in ipairs(st:named_parameters()) do names[#names + 1] = e.name end
  end
  local want = {}
  for _, e in ipairs(m:named_parameters()) do want[#want + 1] = e.name end
  if table.concat(names, ' ') ~= table.concat(want, ' ') then fail('split renamed parameters: %s', table.concat(names, ' ')) end
  if stages[1]:get(1) ~= m:get(1) then fail('split copied modules') end
  local Odd = nn.Module:extend('Odd')
  function Odd:__init() self:add_module('a', nn.Linear(2, 2)) end
  local ok, err = pcall(Pipeline.split, Odd(), 2)
  if ok or not tostring(err):find('not a chain of children', 1, true) then fail('split of a non-chain: %s', tostring(err)) end
  ok, err = pcall(Pipeline.split, m, 9)
  if ok or not tostring(err):find('7 pieces to cut, fewer than 9 stages', 1, true) then fail('split into too many: %s', tostring(err)) end
  -- a model whose forward is not its children in turn is caught when a sample is given
  local Twice = nn.Sequential:extend('Twice')
  function Twice:forward(x) self.output = nn.Sequential.forward(self, x) * 2; return self.output end
  ok, err = pcall(Pipeline.split, Twice{ nn.Linear(2, 2), nn.ReLU() }, 2, { input = dlua.randn({ 3, 2 }) })
  if ok or not tostring(err):find('does not give its output', 1, true) then fail('split of a non-chain forward: %s', tostring(err)) end
  checks = checks + 1
end

---------------------------------------------------------------------------------------------
-- 2. 4 stages on 4 ranks = the unsplit model, float64: both schedules, chunks 1, 3, 8, uneven
-- batches, fewer micro-batches than stages; the step after the first uses the learnt shapes, a
-- new batch size sends them again
local crit = nn.CrossEntropyLoss()
local cases = {}
for _, schedule in ipairs({ 'gpipe', '1f1b' }) do
  for _, chunks in ipairs({ 1, 3, 8 }) do cases[#cases + 1] = { schedule, chunks } end
end
for ci, case in ipairs(cases) do
  local schedule, chunks = case[1], case[2]
  local seed = 100 + ci
  local stages = Pipeline.split(mlp(seed), world)
  local pipe = Pipeline(stages, { chunks = chunks, schedule = schedule, loss = crit })
  for k, N in ipairs({ 10, 10, 3, 10 }) do
    local x, y = batch(1000 * ci + k, N)
    pipe:zero_grad()
    local loss = pipe:step(rank == 0 and x or nil, rank == world - 1 and y or nil)
    local ref, ref_loss = reference(seed, x, y)
    local rg = grads_by_name(ref)
    local n_checked = 0
    for _, e in ipairs(pipe:named_parameters()) do
      local d = max_diff(e.grad, rg[e.name])
      if d > 1e-12 then fail('%s chunks %d batch %d step %d: gradient of %s differs from the unsplit model by %g', schedule, chunks, N, k, e.name, d) end
      n_checked = n_checked + 1
    end
    if n_checked == 0 and #pipe.module._children > 0 and pipe.module:num_parameters() > 0 then fail('no gradient checked') end
    if math.abs(loss:item() - ref_loss) > 1e-12 then fail('%s chunks %d: loss %.17g, unsplit %.17g', schedule, chunks, loss:item(), ref_loss) end
    local n = math.min(chunks, N)
    local held = pipe.stats.last_peak_live
    if held ~= expected_live(schedule, world, rank + 1, n) then
      fail('%s chunks %d batch %d: stage %d held %d micro-batches, expected %d', schedule, chunks, N, rank + 1, held,
           expected_live(schedule, world, rank + 1, n))
    end
  end
  -- evaluation: forward only, the output on the last stage
  local x = batch(7, 9)
  local out = pipe:forward(rank == 0 and x or nil)
  local ref = reference(seed, x, dlua.ones({ 9 }, { dtype = 'int64' }))
  if rank == world - 1 then
    local d = max_diff(out, ref:forward(x))
    if d > 1e-12 then fail('%s chunks %d: forward differs by %g', schedule, chunks, d) end
  elseif out ~= nil then
    fail('forward returned an output on stage %d', rank + 1)
  end
  checks = checks + 1
end

-- 1F1B holds at most `stages` micro-batches, GPipe all of them (chunks 8, batch 10)
do
  local peaks = {}
  for _, schedule in ipairs({ 'gpipe', '1f1b' }) do
    local pipe = Pipeline(Pipeline.split(mlp(9), world), { chunks = 8, schedule = schedule, loss = crit })
    local x, y = batch(77, 10)
    pipe:step(x, y)
    pipe:step(x, y)
    peaks[schedule] = pipe.stats.peak_live
    local r = pipe:report({ print = rank == 0 and schedule == '1f1b' })
    for s, e in ipairs(r.per_stage) do
      if e.peak_live ~= expected_live(schedule, world, s, 8) then fail('report: stage %d held %d', s, e.peak_live) end
      if not (e.bubble >= 0 and e.bubble < 1) or e.forward <= 0 or e.backward <= 0 then fail('report: stage %d times', s) end
    end
    if math.abs(r.ideal_bubble - (world - 1) / (8 + world - 1)) > 1e-12 then fail('report: ideal bubble %g', r.ideal_bubble) end
  end
  if peaks.gpipe ~= 8 or peaks['1f1b'] > world then fail('held: gpipe %d (want 8), 1f1b %d (want <= %d)', peaks.gpipe, peaks['1f1b'], world) end
  if dlua.memory_stats == nil then
    if rank == 0 then print('pipeline: peak memory not checked (no dlua.memory_stats in this tree): live micro-batches counted instead') end
  end
  checks = checks + 1
end

-- a stage of convolutions and batch-norm in channels-last memory: activations travel as their
-- (N, H, W, C) memory; batch-norm normalises each micro-batch, as GPipe (the reference runs the
-- micro-batches one after the other on the unsplit model)
do
  local function convnet(seed)
    dlua.manual_seed(seed)
    return nn.Sequential{ nn.Conv2d(2, 4, 3, { padding = 1 }), nn.BatchNorm2d(4, { relu = true }),
      nn.Conv2d(4, 4, 3, { padding = 1 }), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 3, 3, { stride = 2, padding = 1 }),
      nn.ReLU(), nn.Flatten(), nn.Linear(3 * 3 * 3, 5) }
  end
  local g = dlua.Generator(31)
  local x = dlua.randn({ 7, 2, 6, 6 }, { generator = g }):contiguous('channels_last')
  local y = dlua.randint(1, 6, { 7 }, { generator = g, dtype = 'int64' })
  local ref = convnet(41)
  ref:zero_grad()
  local sizes, off = Pipeline.split_sizes(7, 3), 0
  for _, b in ipairs(sizes) do
    local xi, yi = x:narrow(1, off + 1, b), y:narrow(1, off + 1, b)
    local out = ref:forward(xi)
    crit:forward(out, yi)
    ref:backward(xi, crit:backward(out, yi):mul_(b / 7))
    off = off + b
  end
  local stages = Pipeline.split(convnet(41), world)
  local pipe = Pipeline(stages, { chunks = 3, schedule = '1f1b', loss = crit })
  pipe:zero_grad()
  pipe:step(x, y)
  local rg = grads_by_name(ref)
  for _, e in ipairs(pipe:named_parameters()) do
    local d = max_diff(e.grad, rg[e.name])
    if d > 1e-4 then fail('conv/batch-norm pipeline: gradient of %s differs by %g', e.name, d) end
  end
  local rb = {}
  for _, e in ipairs(ref:named_buffers()) do rb[e.name] = e.buffer end
  for _, e in ipairs(pipe.module:named_buffers()) do
    if max_diff(e.buffer, rb[e.name]) > 1e-5 then fail('batch-norm statistics %s differ', e.name) end
  end
  checks = checks + 1
end

---------------------------------------------------------------------------------------------
-- 3. 2 pipelines x 2 replicas on 4 ranks = one rank on the whole batch (SGD, three steps): DDP across
-- the replicas of each stage, then ZeRO-1 through the data_parallel hook
local g = Pipeline.groups(2)
if g.stage ~= rank % 2 + 1 or g.replica ~= math.floor(rank / 2) + 1 or g.replicas ~= 2 then fail('groups: %d %d', g.stage, g.replica) end
for _, wrapper in ipairs({ 'ddp', 'zero1' }) do
  local hook
  if wrapper == 'zero1' then hook = function(m, grp) return dist.ZeRO(m, { stage = 1, group = grp }) end end
  local pipe = Pipeline(Pipeline.split(mlp(55), 2), { group = g.pipe, data_group = g.data, chunks = 4, loss = crit,
                                                      data_parallel = hook })
  if pipe.ddp == nil then fail('no data parallelism across the replicas of stage %d', g.stage) end
  local opt = optim.SGD(pipe, { lr = 0.1, momentum = 0.9, weight_decay = 1e-3 })
  local ref = mlp(55)
  local ref_opt = optim.SGD(ref, { lr = 0.1, momentum = 0.9, weight_decay = 1e-3 })
  local B = 6  -- rows per replica: micro-batches of 2, 2, 1, 1
  for step = 1, 3 do
    local x, y = batch(500 + step, 2 * B)
    ref_opt:zero_grad()
    local out = ref:forward(x)
    crit:forward(out, y)
    ref:backward(x, crit:backward(out, y))
    ref_opt:step()
    opt:zero_grad()
    local lo = (g.replica - 1) * B
    pipe:step(x:narrow(1, lo + 1, B), y:narrow(1, lo + 1, B))
    opt:step()
  end
  if wrapper == 'zero1' then pipe.ddp:_wait_params() end  -- the stepped shards gathered back (else at the next forward)
  local rp = {}
  for _, e in ipairs(ref:named_parameters()) do rp[e.name] = e.param end
  for _, e in ipairs(pipe.module:named_parameters()) do
    local d = max_diff(e.param, rp[e.name])
    if d > 1e-12 then fail('2x2 (%s): parameter %s differs from one rank on the whole batch by %g', wrapper, e.name, d) end
  end
  if pipe.ddp.steps_synced ~= 3 then fail('%s reduced %d times in 3 steps', wrapper, pipe.ddp.steps_synced) end
  checks = checks + 1
end

---------------------------------------------------------------------------------------------
-- 4. errors every rank sees alike
do
  local ok, err = pcall(Pipeline, { nn.Linear(2, 2), nn.Linear(2, 2) }, { loss = crit })
  if ok or not tostring(err):find('2 stages for a pipeline group of 4 ranks', 1, true) then fail('stage count: %s', tostring(err)) end
  ok, err = pcall(Pipeline, Pipeline.split(mlp(1), world), { chunks = rank == 2 and 3 or 4 })
  if ok or not tostring(err):find('disagree on chunks: 4 on rank 0, 3 on rank 2', 1, true) then fail('chunks mismatch: %s', tostring(err)) end
  ok, err = pcall(Pipeline, Pipeline.split(mlp(1), world), { schedule = 'zigzag' })
  if ok or not tostring(err):find("unknown schedule 'zigzag'", 1, true) then fail('schedule name: %s', tostring(err)) end
  local pipe = Pipeline(Pipeline.split(mlp(1), world), { chunks = 2 })
  ok, err = pcall(pipe.step, pipe, dlua.randn({ 4, 6 }, f64), dlua.ones({ 4 }, { dtype = 'int64' }))
  if ok or not tostring(err):find('step needs a loss on the last stage', 1, true) then
    fail('no loss: %s', tostring(err))
  end
  checks = checks + 1
end

dist.barrier()
print(string.format('rank %d of %d: %d pipeline checks passed', rank, world, checks))
dist.destroy()
