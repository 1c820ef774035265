-- GradScaler on several ranks, DDP and ZeRO-2: a forced overflow (a gradient scaled to inf, or one non-finite value on one rank's shard) skips exactly that step on every rank, halves the scale, and leaves parameters, momentum and the step count as a run without that step has them, bit for bit.
--   dlua --nproc 2 tests/dist/amp.lua
local dlua = require 'dlua'
local nn, optim, amp = dlua.nn, dlua.optim, dlua.amp
local dist = dlua.dist

dist.init({ timeout = 60 })
local rank, world = dist.rank(), dist.world_size()
local checks = 0
local function fail(fmt, ...) error(string.format('rank %d of %d: ' .. fmt, rank, world, ...), 2) end
local function check(ok, fmt, ...)
  if not ok then fail(fmt, ...) end
  checks = checks + 1
end

local function mlp()
  dlua.manual_seed(7)
  return nn.Sequential{ nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 3) }
end
local B = 4
local function batch(s)
  local g = dlua.Generator(500 + s)
  local x = dlua.randn({ B * world, 7 }, { generator = g })
  local y = dlua.randint(1, 4, { B * world }, { generator = g, dtype = 'int64' })
  return x:narrow(1, rank * B + 1, B):contiguous(), y:narrow(1, rank * B + 1, B):contiguous()
end
local function flat(model)
  local sd = model:state_dict()
  local parts = {}
  for _, k in ipairs(sd:keys()) do parts[#parts + 1] = sd[k]:contiguous():view(sd[k]:numel()):double() end
  return dlua.cat(parts, 1)
end
local function same(a, b) return (a - b):abs():max():item() == 0 end
local small = { bucket_mb = 0.0002, first_bucket_mb = 0.0001 }

-- 5 batches; `poison` on batch 3: 'loss' (rank 0's scaled loss gradient gets an inf: every gradient
-- downstream of it overflows), 'shard' (one value of the last rank's own gradient range set to NaN after
-- backward: only that rank sees it), nil (batch 3 left out: the reference).
local function run(stage, poison)
  local net = mlp()
  local opts = { bucket_mb = small.bucket_mb, first_bucket_mb = small.first_bucket_mb }
  local model
  if stage == 0 then model = dist.DDP(net, opts) else opts.stage = stage; model = dist.ZeRO(net, opts) end
  local opt = optim.SGD(model, { lr = 0.1, momentum = 0.9 })
  local crit = nn.CrossEntropyLoss()
  local sc = amp.GradScaler({ init_scale = 1024, growth_interval = 100 })
  local outcomes = {}
  for s = 1, 5 do
    if s == 3 and poison == nil then goto continue end
    do
      local x, y = batch(s)
      opt:zero_grad()
      local out = model:forward(x)
      crit:forward(out, y)
      local g = sc:scale(crit:backward(out, y))
      if s == 3 and poison == 'loss' and rank == 0 then g[1][1] = math.huge end
      model:backward(x, g)
      if s == 3 and poison == 'shard' and rank == world - 1 then
        local sync = opt.model._grad_sync
        local r = opt.ranges.float32[1]
        if sync then sync:wait_range('float32', r.offset, r.length) end
        opt.arena.grads.float32[r.offset + 1] = 0 / 0
      end
      local before = s == 3 and flat(model) or nil
      local steps_before = opt.steps
      local outcome, why = sc:step(opt)
      outcomes[#outcomes + 1] = outcome
      if s == 3 and poison then
        check(outcome == 'skipped', 'stage %d, %s: step 3 was %s, expected skipped', stage, poison, tostring(outcome))
        check(why == 'overflow: scale 1024 -> 512', "stage %d: reason '%s'", stage, tostring(why))
        check(same(flat(model), before), 'stage %d, %s: a skipped step changed the parameters', stage, poison)
        check(opt.steps == steps_before, 'stage %d: a skipped step advanced the step count', stage)
        check(sc:get_scale() == 512, 'stage %d: scale %g after the overflow, expected 512', stage, sc:get_scale())
      else
        check(outcome == 'applied', 'stage %d, %s: step %d was %s', stage, tostring(poison), s, tostring(outcome))
      end
    end
    ::continue::
  end
  local mom = opt.state.float32.momentum
  return flat(model), outcomes, opt.steps, mom and mom:clone(), sc
end

for _, stage in ipairs({ 0, 2 }) do
  local ref, _, ref_steps, ref_mom = run(stage, nil)
  for _, poison in ipairs({ 'loss', 'shard' }) do
    local p, outcomes, steps, mom, sc = run(stage, poison)
    -- scaling by a power of two is exact: without the skipped step's batch the run is the reference's, bit for bit
    check(same(p, ref), 'stage %d, %s: parameters differ from the run without step 3 by %g', stage, poison,
      (p - ref):abs():max():item())
    check(same(mom, ref_mom), 'stage %d, %s: momentum differs from the run without step 3', stage, poison)
    check(steps == ref_steps and steps == 4, 'stage %d, %s: %d steps applied, expected 4', stage, poison, steps)
    check(sc.skipped == 1 and sc.consecutive == 0, 'stage %d: skipped %d, consecutive %d', stage, sc.skipped, sc.consecutive)
    -- every rank saw the same outcomes
    local t = dlua.tensor({ outcomes[3] == 'skipped' and 1 or 0 }, { dtype = 'float64' })
    dist.all_reduce(t, 'sum')
    check(t[1] == world, 'stage %d, %s: %d of %d ranks skipped step 3', stage, poison, t[1], world)
    -- and the same parameters
    local c = p:clone()
    dist.broadcast(c, 0)
    check(same(c, p), 'stage %d, %s: ranks disagree on the parameters', stage, poison)
  end
end

print(('amp checks passed (%d checks, rank %d of %d)'):format(checks, rank, world))
dist.destroy()
