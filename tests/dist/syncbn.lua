-- SyncBatchNorm end to end: N ranks under DDP, each on its slice of a global batch, equal one process with plain
-- BatchNorm2d on the whole batch (outputs, running statistics, gradients after DDP, input gradients), f64 and f32,
-- NCHW and channels-last, fused ReLU and residual input; evaluation without communication; sub-groups.
-- Run: dlua --nproc N tests/dist/syncbn.lua [device]
-- device 'cuda': the DDP + SyncBatchNorm model runs on each rank's CUDA device (CUDA tensors through the process
-- group), the one-process reference stays on the CPU; parts 3 and 4 (groups) use CPU tensors either way.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local resnet = require 'models.resnet'
local dist = dlua.dist
dist.init{ timeout = 60 }
local rank, world = dist.rank(), dist.world_size()
local dev = arg[1] or 'cpu'
local function host(t) return t:cpu() end
local checks = 0
local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end

-- conv, BN+ReLU, a BasicBlock (BN+ReLU, then BN + residual + ReLU, its shortcut a conv and a plain BN), pool, linear
local function net(seed, dtype)
  dlua.manual_seed(seed)
  local m = nn.Sequential{
    nn.Conv2d(3, 6, 3, { padding = 1, bias = false }), nn.BatchNorm2d(6, { relu = true }),
    resnet.BasicBlock(6, 8, 2, nn.Sequential(nn.Conv2d(6, 8, 1, { stride = 2, bias = false }), nn.BatchNorm2d(8))),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5) }
  m:to(dtype)
  -- gamma and beta away from 1 and 0, so their gradients and their use in backward count
  m:walk(function(_, mod)
    if mod.running_mean then
      mod.weight:uniform_(0.5, 1.5)
      mod.bias:uniform_(-0.3, 0.3)
    end
  end)
  return m
end

local B = 3  -- per rank; 7x7 images, so the BN of the 4x4 stage sees 3 * 16 values per channel on each rank
local function global_batch(s, dtype)
  local g = dlua.Generator(500 + s)
  local x = (dlua.randn({ B * world, 3, 7, 7 }, { generator = g }) * 1.5 + 0.7):to(dtype)
  local y = dlua.randint(1, 6, { B * world }, { generator = g, dtype = 'int64' })
  return x, y
end
local function channels_last(x) return x:contiguous('channels_last') end
local function my_rows(t) return t:narrow(1, rank * B + 1, B) end

local function max_rel(a, b)  -- max |a - b| / max(1, max |b|)
  local d = (a:double() - b:double()):abs():max():item()
  return d / math.max(1, b:double():abs():max():item())
end

local function bn_modules(m)
  local r = {}
  m:walk(function(name, mod) if mod.running_mean then r[#r + 1] = { name = name, m = mod } end end)
  return r
end

-- 1. DDP + SyncBatchNorm on N ranks = one process with BatchNorm2d on the N-times batch, 3 SGD steps
-- (float32 channels-last: the layers on a group of their own, beside DDP's, as docs/ddp.md suggests)
local own_group = dist.new_group()
for _, dtype in ipairs({ 'float64', 'float32' }) do
  for _, cl in ipairs({ false, true }) do
    local tol = dtype == 'float64' and 1e-10 or 1e-5
    local what = string.format('%s %s', dtype, cl and 'channels-last' or 'NCHW')
    local layout = cl and channels_last or function(x) return x end
    local ref = net(3, dtype)
    local ref_opt = optim.SGD(ref, { lr = 0.1, momentum = 0.9 })
    local model = nn.SyncBatchNorm.convert(net(3, dtype), { group = (dtype == 'float32' and cl) and own_group or nil })
    model:to(dev)
    local on = model:flatten().params[dtype].device
    if on:sub(1, #dev) ~= dev then fail('the model is on %s, not %s', on, dev) end
    local ddp = dist.DDP(model, { bucket_mb = 0.0005, first_bucket_mb = 0.0002 })
    local opt = optim.SGD(ddp, { lr = 0.1, momentum = 0.9 })
    local crit, ref_crit = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    for s = 1, 3 do
      local x, y = global_batch(s, dtype)
      x = layout(x)
      ref_opt:zero_grad()
      local rout = ref:forward(x)
      ref_crit:forward(rout, y)
      local rgx = ref:backward(x, ref_crit:backward(rout, y))

      opt:zero_grad()
      local xs, ys = layout(my_rows(x):contiguous():to(dev)), my_rows(y):contiguous():to(dev)
      local out = ddp:forward(xs)
      local d = max_rel(host(out), my_rows(rout))
      if d > tol then fail('%s step %d: output differs from one process by %g', what, s, d) end
      crit:forward(out, ys)
      local gx = ddp:backward(xs, crit:backward(out, ys))
      ddp:wait()
      -- each rank's loss is the mean over its B rows, the reference's over world * B: the input
      -- gradient is world times the reference's slice (DDP divides the parameter gradients back)
      d = max_rel(host(gx), my_rows(rgx) * world)
      if d > tol then fail('%s step %d: input gradient differs by %g', what, s, d) end
      d = max_rel(host(model:flatten().grads[dtype]), ref:flatten().grads[dtype])
      if d > tol then fail('%s step %d: gradients after DDP differ from one process by %g', what, s, d) end
      local mine, theirs = bn_modules(model), bn_modules(ref)
      for i, e in ipairs(mine) do
        for _, f in ipairs({ 'running_mean', 'running_var' }) do
          d = max_rel(host(e.m[f]), theirs[i].m[f])
          if d > tol then fail('%s step %d: %s.%s differs by %g', what, s, e.name, f, d) end
        end
        if e.m.num_batches_tracked:item() ~= s then fail('%s: num_batches_tracked %d', e.name, e.m.num_batches_tracked:item()) end
      end
      opt:step()
      ref_opt:step()
    end
    local d = max_rel(host(model:flatten().params[dtype]), ref:flatten().params[dtype])
    if d > tol then fail('%s: parameters after 3 steps differ by %g', what, d) end
    checks = checks + 1

    -- 2. evaluation uses the running statistics and does not communicate: only rank 0 runs it
    if dtype == 'float64' then
      ref:evaluate(); model:evaluate()
      local x = layout(global_batch(9, dtype))
      if rank == 0 then
        local dd = max_rel(host(model:forward(x:to(dev))), ref:forward(x))
        if dd > tol then fail('evaluation differs from BatchNorm2d by %g', dd) end
      end
      dist.barrier()
      checks = checks + 1
    end
  end
end

-- 3. groups: ranks {0, 1} synchronise together, every other rank alone (a group of one is plain BatchNorm2d)
do
  local groups = { dist.new_group({ 0, 1 }) }
  for r = 2, world - 1 do groups[#groups + 1] = dist.new_group({ r }) end
  local mine = rank < 2 and groups[1] or groups[rank]
  local x = global_batch(11, 'float64')
  dlua.manual_seed(5)
  local bn = nn.BatchNorm2d(3, { sync = true, group = mine, relu = true, dtype = 'float64' })
  dlua.manual_seed(5)
  local ref = nn.BatchNorm2d(3, { relu = true, dtype = 'float64' })
  local out = bn:forward(my_rows(x))
  local rows = rank < 2 and x:narrow(1, 1, math.min(2, world) * B) or my_rows(x)
  local rout = ref:forward(rows)
  local off = rank < 2 and rank * B or 0
  local d = max_rel(out, rout:narrow(1, off + 1, B))
  if d > 1e-10 then fail('group of %d: output differs from BatchNorm2d over its ranks by %g', mine:size(), d) end
  d = max_rel(bn.running_var, ref.running_var)
  if d > 1e-10 then fail('group of %d: running_var differs by %g', mine:size(), d) end
  -- backward with no DDP: grad_input against the reference on the group's rows (summed loss)
  local gy = dlua.ones(out:size(), { dtype = 'float64' })
  local gx = bn:backward(my_rows(x), gy)
  local rgx = ref:backward(rows, dlua.ones(rout:size(), { dtype = 'float64' }))
  d = max_rel(gx, rgx:narrow(1, off + 1, B))
  if d > 1e-10 then fail('group of %d: input gradient differs by %g', mine:size(), d) end
  checks = checks + 1
end

-- 4. not in the group: a clear error
if world >= 3 then
  local g = dist.new_group({ 0, 1 })
  local bn = nn.SyncBatchNorm(3, { group = g, dtype = 'float64' })
  if rank == 2 then
    local ok, err = pcall(bn.forward, bn, dlua.randn({ 2, 3, 2, 2 }, { dtype = 'float64' }))
    if ok or not tostring(err):find('not a member', 1, true) then fail('outside the group: expected an error, got %s', tostring(err)) end
  end
  checks = checks + 1
end

dist.barrier()
print(string.format('rank %d: %d SyncBatchNorm checks passed', rank, checks))
dist.destroy()
