-- ZeRO stages 1-3 against DDP: same parameters after 10 steps (SGD, AdamW, accumulation, no_sync, clipping, offload on CPU), skipped and reused modules, errors, memory, and checkpoints across world sizes and stages.
--   dlua --nproc N tests/dist/zero.lua                      the equivalence checks
--   dlua --nproc N tests/dist/zero.lua save DIR STAGE full|sharded
--   dlua --nproc M tests/dist/zero.lua load DIR STAGE       (STAGE 0: DDP)
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local ckpt = require 'dlua.ckpt'
local dist = dlua.dist

local mode = arg[1] or 'train'
dist.init({ timeout = 60 })
local rank, world = dist.rank(), dist.world_size()
local checks = 0
local function fail(fmt, ...) error(string.format('rank %d of %d: ' .. fmt, rank, world, ...), 2) end

-- 7 -> 11 -> 6 -> 3: 181 parameters (a prime: no world size divides the arena)
local function mlp(seed)
  dlua.manual_seed(seed)
  return nn.Sequential{ nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 6), nn.ReLU(), nn.Linear(6, 3) }
end

local B = 5  -- rows per rank per micro-batch
local function batch(s, k, din, classes)
  local g = dlua.Generator(1000 + 17 * s + k)
  local x = dlua.randn({ B * world, din or 7 }, { generator = g })
  local y = dlua.randint(1, (classes or 3) + 1, { B * world }, { generator = g, dtype = 'int64' })
  return x:narrow(1, rank * B + 1, B):contiguous(), y:narrow(1, rank * B + 1, B):contiguous()
end

-- Whole parameters (gathered under stage 3) as one float64 vector, state-dict order.
local function flat_params(model)
  local sd = model:state_dict()
  local parts = {}
  for _, k in ipairs(sd:keys()) do
    if not k:find('running_') and not k:find('num_batches') then parts[#parts + 1] = sd[k]:contiguous():view(sd[k]:numel()):double() end
  end
  return dlua.cat(parts, 1)
end
local function max_diff(a, b) return (a - b):abs():max():item() end

-- Buckets of ~200 bytes: several per arena, straddling the shard boundaries.
local small = { bucket_mb = 0.0002, first_bucket_mb = 0.0001 }

local function wrap(net, stage, o)
  o = o or {}
  local opts = { bucket_mb = small.bucket_mb, first_bucket_mb = small.first_bucket_mb, accumulate = o.accumulate }
  if stage == 0 then return dist.DDP(net, opts) end
  opts.stage, opts.offload, opts.gather_group = stage, o.offload, o.gather_group
  return dist.ZeRO(net, opts)
end

local function make_opt(model, name)
  if name == 'sgd' then return optim.SGD(model, { lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 1e-3 }) end
  return optim.AdamW(model, { lr = 0.01, weight_decay = 0.01 })
end

-- 10 steps; accum: 'none', 'accumulate' (accumulate = 3: three micro-batches averaged), 'no_sync'
-- (two micro-batches in no_sync, one outside: summed). Returns the gradient norms when clipping.
local function train(model, opt, stage, accum, clip)
  local crit = nn.CrossEntropyLoss()
  local norms = {}
  local function micro(s, k)
    local x, y = batch(s, k)
    local out = model:forward(x)
    crit:forward(out, y)
    model:backward(x, crit:backward(out, y))
  end
  for s = 1, 10 do
    opt:zero_grad()
    if accum == 'accumulate' then
      for k = 1, 3 do micro(s, k) end
    elseif accum == 'no_sync' then
      model:no_sync(function() micro(s, 1); micro(s, 2) end)
      micro(s, 3)
    else
      micro(s, 1)
    end
    if clip then
      norms[s] = stage == 0 and nn.utils.clip_grad_norm_(model, clip) or model:clip_grad_norm_(clip)
    end
    opt:step()
  end
  return norms
end

if mode == 'train' then
  local shm = dist.transport() == 'shm'
  local gg = dist.new_group()  -- one gather group for the stage-3 models below
  local TOL = 1e-5
  local worst = {}

  -- 1. Stages 1, 2, 3 = DDP, for SGD and AdamW, with and without accumulation. Exact where the
  -- reduction order is DDP's: shared-memory reductions sum in rank order, whichever collective, so
  -- stage 1 (local sums, one reduce-scatter) is bit-identical in every mode, stages 2 and 3 without
  -- accumulation; with accumulation they reduce each micro-batch and sum the averages (DDP averages
  -- the sum): within TOL. Over TCP (DLUA_SHM=0) every case is held to TOL.
  for _, oname in ipairs({ 'sgd', 'adamw' }) do
    for _, accum in ipairs({ 'none', 'accumulate', 'no_sync' }) do
      local ref = wrap(mlp(7), 0, { accumulate = accum == 'accumulate' and 3 or nil })
      local ref_opt = make_opt(ref, oname)
      train(ref, ref_opt, 0, accum)
      local want = flat_params(ref)
      for stage = 1, 3 do
        local z = wrap(mlp(rank == 0 and 7 or 50 + rank), stage, { accumulate = accum == 'accumulate' and 3 or nil, gather_group = gg })
        local opt = make_opt(z, oname)
        train(z, opt, stage, accum)
        local d = max_diff(flat_params(z), want)
        local exact = shm and (stage == 1 or accum == 'none')
        if (exact and d ~= 0) or d > TOL then
          fail('stage %d, %s, %s: parameters differ from DDP by %g (%s)', stage, oname, accum, d, exact and 'expected bit-identical' or 'tolerance ' .. TOL)
        end
        local key = exact and 'exact' or 'tolerance'
        worst[key] = math.max(worst[key] or 0, d)
        checks = checks + 1
      end
    end
  end

  -- 2. Clipping by the global norm: the same norms and parameters as DDP's clip_grad_norm_
  do
    local ref = wrap(mlp(9), 0)
    local ref_opt = make_opt(ref, 'sgd')
    local ref_norms = train(ref, ref_opt, 0, 'none', 0.05)
    local clipped = 0
    for s = 1, 10 do if ref_norms[s] > 0.05 then clipped = clipped + 1 end end
    if clipped < 5 then fail('clipping test: only %d of 10 steps clip', clipped) end
    for stage = 1, 3 do
      local z = wrap(mlp(9), stage, { gather_group = gg })
      local norms = train(z, make_opt(z, 'sgd'), stage, 'none', 0.05)
      for s = 1, 10 do
        if math.abs(norms[s] - ref_norms[s]) > 1e-6 * ref_norms[s] then
          fail('stage %d clipping: step %d norm %.9g, DDP %.9g', stage, s, norms[s], ref_norms[s])
        end
      end
      local d = max_diff(flat_params(z), flat_params(ref))
      if d > TOL then fail('stage %d with clipping: parameters differ from DDP by %g', stage, d) end
      worst.clip = math.max(worst.clip or 0, d)
      checks = checks + 1
    end
  end

  -- 3. offload = true on CPU: a no-op that says so (stderr, once: checked by zero.sh); at every
  -- stage the same parameters as DDP
  do
    local ref = wrap(mlp(3), 0)
    train(ref, make_opt(ref, 'adamw'), 0, 'none')
    local want = flat_params(ref)
    for stage = 1, 3 do
      local z = wrap(mlp(3), stage, { offload = true, gather_group = gg })
      if z.offload_active ~= false or not tostring(z.offload_why):find('CPU') then fail('offload on CPU: active %s', tostring(z.offload_active)) end
      if not z:memory_line():find('offload: no%-op') then fail('memory line does not say offload is a no-op: %s', z:memory_line()) end
      train(z, make_opt(z, 'adamw'), stage, 'none')
      local d = max_diff(flat_params(z), want)
      if (shm and d ~= 0) or d > TOL then fail('stage %d with offload (CPU): differs from DDP by %g', stage, d) end
      checks = checks + 1
    end
  end

  -- 4. A module that some ranks skip (b on odd ranks, the last one, c, on rank 0): no hang, and
  -- the same parameters as DDP (where a skipped module's gradient counts as zeros)
  do
    local Branchy = nn.Module:extend('Branchy')
    function Branchy:__init()
      self:add_module('a', nn.Linear(7, 9))
      self:add_module('b', nn.Linear(9, 9))
      self:add_module('c', nn.Linear(9, 9))
    end
    function Branchy:forward(x)
      self.use_b, self.use_c = rank % 2 == 1, rank ~= 0
      self.h = self.a:forward(x)
      self.h2 = self.use_b and self.b:forward(self.h) or self.h
      self.output = self.use_c and self.c:forward(self.h2) or self.h2
      return self.output
    end
    function Branchy:backward(x, g)
      local g2 = self.use_c and self.c:backward(self.h2, g) or g
      local g1 = self.use_b and self.b:backward(self.h, g2) or g2
      self.grad_input = self.a:backward(x, g1)
      return self.grad_input
    end
    local function branchy() dlua.manual_seed(5); return Branchy() end
    local crit = nn.CrossEntropyLoss()
    local function run(model, opt)
      for s = 1, 4 do
        opt:zero_grad()
        local x, y = batch(s, 1, 7, 9)
        local out = model:forward(x)
        crit:forward(out, y)
        model:backward(x, crit:backward(out, y))
        opt:step()
      end
    end
    local ref = wrap(branchy(), 0)
    run(ref, make_opt(ref, 'sgd'))
    for stage = 2, 3 do
      local z = wrap(branchy(), stage, { gather_group = gg })
      run(z, make_opt(z, 'sgd'))
      local d = max_diff(flat_params(z), flat_params(ref))
      if (shm and d ~= 0) or d > TOL then fail('stage %d with skipped modules: differs from DDP by %g', stage, d) end
      checks = checks + 1
    end
  end

  -- 5. Stage 3: a module used twice in one forward fails naming it; a module run outside the ZeRO
  -- model fails naming it; LARS and whole-arena clipping say what to use instead
  do
    local Twice = nn.Module:extend('Twice')
    function Twice:__init() self:add_module('inner', nn.Linear(4, 4)) end
    function Twice:forward(x) self.output = self.inner:forward(self.inner:forward(x)); return self.output end
    local z = wrap(Twice(), 3, { gather_group = gg })
    local ok, err = pcall(z.forward, z, dlua.randn(2, 4))
    if ok or not tostring(err):find('inner %(Linear%) ran forward twice') then fail('module used twice: %s', tostring(err)) end
    local net = mlp(1)
    local z3 = wrap(net, 3, { gather_group = gg })
    ok, err = pcall(net.forward, net, dlua.randn(2, 7))
    if ok or not tostring(err):find("outside the ZeRO model's forward") or not tostring(err):find('0 %(Linear%)') then
      fail('forward outside ZeRO: %s', tostring(err))
    end
    ok, err = pcall(optim.LARS, z3, { lr = 0.1 })
    if ok or not tostring(err):find('not available over ZeRO') then fail('LARS over ZeRO: %s', tostring(err)) end
    ok, err = pcall(nn.utils.clip_grad_norm_, z3, 1)
    if ok or not tostring(err):find('clip_grad_norm_%(max_norm%)') then fail('nn.utils.clip_grad_norm_ on ZeRO: %s', tostring(err)) end
    -- an optimizer built on the module before ZeRO took its arenas refuses to step
    local early_net = mlp(1)
    local early = optim.SGD(early_net, { lr = 0.1 })
    wrap(early_net, 1)
    ok, err = pcall(early.step, early)
    if ok or not tostring(err):find('built before dist.ZeRO') then fail('optimizer built before ZeRO: %s', tostring(err)) end
    -- gathered(fn): the whole parameters, equal to a gathered state dict
    local w = z3:gathered(function() return net:state_dict()['0.weight']:clone() end)
    if max_diff(w:double(), z3:state_dict()['0.weight']:double()) ~= 0 then fail('gathered() differs from state_dict()') end
    checks = checks + 1
  end

  -- 6. The overflow check: one verdict on every rank, from one rank's inf
  for stage = 1, 3 do
    local z = wrap(mlp(2), stage, { gather_group = gg })
    local crit = nn.CrossEntropyLoss()
    local x, y = batch(1, 1)
    local out = z:forward(x)
    crit:forward(out, y)
    z:backward(x, crit:backward(out, y))
    if z:found_inf() then fail('stage %d: found_inf with finite gradients', stage) end
    if rank == world - 1 then z:optim_arena().grads.float32:narrow(1, 1, 1):fill_(1 / 0) end
    if not z:found_inf() then fail('stage %d: found_inf missed rank %d\'s inf', stage, world - 1) end
    checks = checks + 1
  end

  -- 7. memory(): bytes per rank by hand. P = 181 float32, m = ceil(181 / N); AdamW keeps 2 buffers.
  do
    local P = 181
    local m = math.ceil(P / world)
    local len = math.max(0, math.min(m, P - rank * m))
    for stage = 1, 3 do
      local z = wrap(mlp(4), stage, { gather_group = gg })
      make_opt(z, 'adamw')
      local mem = z:memory()
      local want = { parameters = 4 * (stage == 3 and len or P), gradients = 4 * (stage == 1 and m * world or len), optimizer = 8 * len }
      for k, v in pairs(want) do
        if mem[k] ~= v then fail('stage %d memory.%s = %d, expected %d', stage, k, mem[k], v) end
      end
      if mem.model_states ~= want.parameters + want.gradients + want.optimizer then fail('stage %d model_states %d', stage, mem.model_states) end
      -- after a step no bucket or gathered module is held; during it some were (stages 2, 3)
      local opt = z._optimizers[1]
      train(z, opt, stage, 'none')
      mem = z:memory()
      if mem.buffers ~= 0 then fail('stage %d: %d bytes of buffers held after the step', stage, mem.buffers) end
      if stage > 1 and not (mem.peak > mem.model_states) then fail('stage %d: peak %d, model states %d', stage, mem.peak, mem.model_states) end
      checks = checks + 1
    end
  end

  if rank == 0 then
    io.write(string.format('zero: worst differences from DDP: exact cases %g, accumulation %g (tolerance %g), clipping %g\n',
      worst.exact or 0, worst.tolerance or 0, TOL, worst.clip or 0))
  end
  print(string.format('rank %d: %d zero checks passed', rank, checks))

else
  -- Checkpoints: a model with batch-norm buffers, AdamW, 3 steps, saved; loaded elsewhere.
  local dir, stage = arg[2], tonumber(arg[3])
  local function model()
    dlua.manual_seed(11)
    local net = nn.Sequential({ nn.Linear(7, 13), nn.BatchNorm2d(13), nn.ReLU(), nn.Linear(13, 3) })
    return wrap(net, stage)
  end
  local function crcs(m, opt)
    local sd = m:state_dict()
    local ps = {}
    for _, k in ipairs(sd:keys()) do if not k:find('running_') and not k:find('num_batches') then ps[#ps + 1] = sd[k] end end
    local b = opt:state_dict()
    return ckpt.crc32(ps), ckpt.crc32({ b.buffers.float32.exp_avg, b.buffers.float32.exp_avg_sq }), ckpt.crc32(m), b.steps
  end
  local m = model()
  local opt = make_opt(m, 'adamw')
  local state = { model = m, optimizer = opt }
  if mode == 'save' then
    train(m, opt, stage, 'none')
    local p, o, all, steps = crcs(m, opt)
    ckpt.save(dir, state, { step = 10, sharded = arg[4] == 'sharded' })
    if rank == 0 then
      local f = assert(io.open(dir .. '/expect.txt', 'w'))
      f:write(string.format('%s %s %s %d\n', p, o, all, steps))
      f:close()
    end
    print(string.format('rank %d: saved stage %d on %d ranks', rank, stage, world))
  else
    ckpt.load(dir, state)
    local f = assert(io.open(dir .. '/expect.txt'))
    local wp, wo, wall, wsteps = f:read('*l'):match('^(%S+) (%S+) (%S+) (%d+)$')
    f:close()
    local p, o, all, steps = crcs(m, opt)
    if p ~= wp then fail('parameters crc %s, saved %s', p, wp) end
    if o ~= wo then fail('optimizer state crc %s, saved %s', o, wo) end
    if steps ~= tonumber(wsteps) then fail('optimizer steps %d, saved %s', steps, wsteps) end
    if rank == 0 and all ~= wall then fail('rank 0 state (with buffers) crc %s, saved %s', all, wall) end
    -- and it trains on from there
    train(m, opt, stage, 'none')
    print(string.format('rank %d: loaded on %d ranks at stage %d: parameters and optimizer state agree', rank, world, stage))
  end
end
dist.destroy()
