-- DDP end to end: N ranks equal one process on the N-times batch; accumulation, no_sync, unused parameters,
-- bucket plans, hooks, overlap, model mismatch. Run: dlua --nproc N tests/dist/ddp.lua [cpu|cuda] [auto|gloo]
-- (cuda: models and batches on this rank's GPU; tests/gpu/nccl.sh runs it with NCCL and with gloo staging)
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local dist = dlua.dist
local device, backend = arg[1] or 'cpu', arg[2] or 'auto'
dist.init{ timeout = 60, backend = backend }
if device == 'cuda' then device = dist.device() ~= 'cpu' and dist.device() or 'cuda' end
local rank, world = dist.rank(), dist.world_size()
local checks = 0
local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end

local function mlp(seed)
  dlua.manual_seed(seed)
  return nn.Sequential{ nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5) }:to(device)
end

-- The global batch of step s: rows 1..B*world; rank r takes its own slice.
local B = 6
local function global_batch(s)
  local g = dlua.Generator(1000 + s)
  local x = dlua.randn({ B * world, 12 }, { generator = g })
  local y = dlua.randint(1, 6, { B * world }, { generator = g, dtype = 'int64' })
  return x:to(device), y:to(device)
end
local function my_slice(t) return t:narrow(1, rank * B + 1, B):contiguous() end

local function max_diff(a, b) return (a:cpu():double() - b:cpu():double()):abs():max():item() end

local function train(model, opt, steps, batch_of, micro)
  local crit = nn.CrossEntropyLoss()
  for s = 1, steps do
    opt:zero_grad()
    for k = 1, micro or 1 do
      local x, y = batch_of(s, k)
      local out = model:forward(x)
      crit:forward(out, y)
      model:backward(x, crit:backward(out, y))
    end
    opt:step()
  end
end

-- 1. N ranks with DDP = one process on the whole batch (SGD with momentum and weight decay)
do
  local ref = mlp(7)  -- rank 0's initial weights everywhere: DDP broadcasts them
  local ref_opt = optim.SGD(ref, { lr = 0.1, momentum = 0.9, weight_decay = 1e-3 })
  train(ref, ref_opt, 5, function(s) return global_batch(s) end)

  -- buckets of 25 MB and 1 GB (the whole arena in one, first bucket included), then 1 KB (several:
  -- the plan checks below look at this one)
  local net, ddp
  for _, mb in ipairs({ 25, 1024, 0.001 }) do
    net = mlp(rank == 0 and 7 or 100 + rank)  -- other ranks start different: broadcast fixes it
    ddp = dist.DDP(net, { bucket_mb = mb, first_bucket_mb = mb < 1 and 0.0005 or mb })
    local nb = #ddp:bucket_plan()
    if (mb < 1 and nb < 3) or (mb >= 1 and nb ~= 1) then fail('bucket_mb %g: %d buckets', mb, nb) end
    local opt = optim.SGD(ddp, { lr = 0.1, momentum = 0.9, weight_decay = 1e-3 })
    train(ddp, opt, 5, function(s) local x, y = global_batch(s); return my_slice(x), my_slice(y) end)
    local d = max_diff(net:flatten().params.float32, ref:flatten().params.float32)
    if d > 1e-5 then
      fail('DDP on %d ranks (buckets of %g MB) differs from one process on the %d-times batch by %g', world, mb, world, d)
    end
    checks = checks + 1
  end

  -- CPU ranks on one host keep the gradient arena in memory they all map (all-reduced in place)
  local want_shared = device == 'cpu' and dist.transport() == 'shm'
  if (ddp.shared_grads == true) ~= want_shared then
    fail('shared gradient arena: %s (%s) with transport %s', tostring(ddp.shared_grads), tostring(ddp.shared_why),
         dist.transport())
  end
  -- the plan covers the arena in order, buckets are ranges of it
  local plan = ddp:bucket_plan()
  local expect_off = 0
  for i, b in ipairs(plan) do
    if b.offset ~= expect_off then fail('bucket %d starts at %d, expected %d', i, b.offset, expect_off) end
    expect_off = b.offset + b.numel
  end
  if expect_off ~= net:flatten().params.float32:numel() then fail('buckets cover %d of %d', expect_off, net:flatten().params.float32:numel()) end
  -- the first bucket holds the last layer (reverse order of use)
  if plan[1].names[1] ~= '4.bias' then fail('first bucket starts with %s, expected 4.bias', plan[1].names[1]) end
  checks = checks + 1
end

-- 2. accumulate = 3: three micro-batches per rank = one step on the 3*N-times batch
do
  local K = 3
  local function micro_batch(s, k)  -- the global batch of (s, k), so the reference can rebuild it
    return global_batch(s * 10 + k)
  end
  local ref = mlp(11)
  local ref_opt = optim.SGD(ref, { lr = 0.05, momentum = 0.9 })
  train(ref, ref_opt, 3, function(s)
    local xs, ys = {}, {}
    for k = 1, K do xs[k], ys[k] = micro_batch(s, k) end
    return dlua.cat(xs, 1), dlua.cat(ys, 1)
  end)
  local net = mlp(11)
  local ddp = dist.DDP(net, { accumulate = K })
  local opt = optim.SGD(ddp, { lr = 0.05, momentum = 0.9 })
  train(ddp, opt, 3, function(s, k) local x, y = micro_batch(s, k); return my_slice(x), my_slice(y) end, K)
  local d = max_diff(net:flatten().params.float32, ref:flatten().params.float32)
  if d > 1e-5 then fail('accumulate=%d differs from the big batch by %g', K, d) end
  checks = checks + 1
end

-- 3. no_sync: gradients of the micro-batches inside it are summed, reduced at the next backward
do
  local net = mlp(21)
  local ddp = dist.DDP(net)
  local crit = nn.CrossEntropyLoss()
  ddp:zero_grad()
  local calls = 0
  ddp:register_comm_hook({ n = 0 }, function(state, bucket)
    state.n = state.n + 1
    calls = calls + 1
    return dist.all_reduce(bucket.tensor, 'avg', { async = true })
  end)
  local function step(s)
    local x, y = global_batch(s)
    x, y = my_slice(x), my_slice(y)
    local out = ddp:forward(x)
    crit:forward(out, y)
    ddp:backward(x, crit:backward(out, y))
  end
  ddp:no_sync(function() step(1); step(2) end)
  if calls ~= 0 then fail('no_sync communicated (%d hook calls)', calls) end
  step(3)
  ddp:wait()
  if calls ~= #ddp:bucket_plan() then fail('expected %d hook calls after no_sync, got %d', #ddp:bucket_plan(), calls) end
  -- reference: the sum over the three global batches of the mean gradient
  local ref = mlp(21)
  ref:flatten()
  ref:zero_grad()
  for s = 1, 3 do
    local x, y = global_batch(s)
    local out = ref:forward(x)
    crit:forward(out, y)
    ref:backward(x, crit:backward(out, y))
  end
  local d = max_diff(net:flatten().grads.float32, ref:flatten().grads.float32)
  if d > 1e-5 then fail('no_sync gradients differ from the reference by %g', d) end
  local cs = ddp:comm_state_dict()
  if cs.hook_state.n ~= calls then fail('hook state not saved: %s', tostring(cs.hook_state.n)) end
  checks = checks + 1
end

-- 4. a parameter unused on some ranks: no hang, its gradient is the average with zeros
do
  dlua.manual_seed(5)
  local Branchy = nn.Module:extend('Branchy')
  function Branchy:__init()
    self.a = self:add_module('a', nn.Linear(4, 3))
    self.b = self:add_module('b', nn.Linear(4, 3))
  end
  function Branchy:forward(x)
    self.use_b = rank % 2 == 1
    self.output = (self.use_b and self.b or self.a):forward(x)
    return self.output
  end
  function Branchy:backward(x, g)
    self.grad_input = (self.use_b and self.b or self.a):backward(x, g)
    return self.grad_input
  end
  local net = Branchy():to(device)
  local ddp = dist.DDP(net, { first_bucket_mb = 1e-5, bucket_mb = 1e-5 })  -- one bucket per parameter
  ddp:zero_grad()
  local x = dlua.ones({ 2, 4 }, { device = device })
  ddp:forward(x)
  ddp:backward(x, dlua.ones({ 2, 3 }, { device = device }))
  ddp:wait()
  -- the weight gradient of a used Linear on ones is 2 (batch of 2) in every entry
  local users_a, users_b = 0, 0
  for r = 0, world - 1 do if r % 2 == 1 then users_b = users_b + 1 else users_a = users_a + 1 end end
  local ga, gb = net.a.grad_weight:cpu()[1][1], net.b.grad_weight:cpu()[1][1]
  if math.abs(ga - 2 * users_a / world) > 1e-6 or math.abs(gb - 2 * users_b / world) > 1e-6 then
    fail('unused-parameter gradients %g, %g; expected %g, %g', ga, gb, 2 * users_a / world, 2 * users_b / world)
  end
  checks = checks + 1
end

-- 5. communication overlaps backward: the first bucket starts before backward ends
do
  local net = mlp(31)
  local ddp = dist.DDP(net, { first_bucket_mb = 0.0001, bucket_mb = 0.002 })
  local during = 0
  ddp:register_comm_hook(nil, function(_, bucket)
    if ddp._in_backward then during = during + 1 end
    return dist.all_reduce(bucket.tensor, 'avg', { async = true })
  end)
  local x = dlua.randn({ 4, 12 }):to(device)
  local out = ddp:forward(x)
  ddp:backward(x, dlua.ones(out:size(), { device = device }))
  ddp:wait()
  if during < 1 then fail('no bucket started during backward') end
  -- a one-bucket plan gives the same gradients
  local g1 = net:flatten().grads.float32:clone()
  ddp:set_buckets({ { dtype = 'float32', offset = 0, numel = g1:numel() } })
  ddp:zero_grad()
  out = ddp:forward(x)
  ddp:backward(x, dlua.ones(out:size(), { device = device }))
  ddp:wait()
  if max_diff(net:flatten().grads.float32, g1) > 1e-6 then fail('one-bucket plan changed the gradients') end
  local ok, err = pcall(ddp.set_buckets, ddp, { { dtype = 'float32', offset = 0, numel = 10 } })
  if ok or not tostring(err):find('is in no bucket', 1, true) then fail('bad plan accepted: %s', tostring(err)) end
  checks = checks + 1
end

-- 6. ranks with different models: a clear error naming the difference
do
  local net = rank == 1 and nn.Sequential{ nn.Linear(4, 6) } or nn.Sequential{ nn.Linear(4, 5) }
  local ok, err = pcall(dist.DDP, net)
  if world > 1 and (ok or not tostring(err):find('different models', 1, true)) then
    fail('different models accepted: %s', tostring(err))
  end
  checks = checks + 1
end

dist.barrier()
print(string.format('rank %d of %d: %d DDP checks passed (%s, %s)', rank, world, checks, device, dist.backend()))
dist.destroy()
