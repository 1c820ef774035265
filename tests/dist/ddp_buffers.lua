-- DDP's broadcast_buffers (PyTorch's default, broadcast_buffers=True): before each training forward every rank takes
-- rank 0's buffers, so batch-norm's running statistics are rank 0's updated with this rank's batch. Checked by hand
-- against the batch statistics of each rank's own data, with the option off as the control; and which forwards
-- broadcast (one per buffer dtype; none without buffers, in evaluate() mode, under no_sync, between accumulated
-- micro-batches). Run: dlua --nproc N tests/dist/ddp_buffers.lua
local dlua = require 'dlua'
local nn, optim, dist = dlua.nn, dlua.optim, dlua.dist
dist.init{ timeout = 60 }
local rank, world = dist.rank(), dist.world_size()
local checks = 0
local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end

local broadcasts = 0
local real_broadcast = dist.broadcast
dist.broadcast = function(...) broadcasts = broadcasts + 1; return real_broadcast(...) end

local function cnn()
  dlua.manual_seed(3)
  return nn.Sequential{ nn.Conv2d(2, 4, 3, { padding = 1 }), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3) }
end
local gen = dlua.Generator(100 + rank)  -- every rank its own data
local function batch()
  return dlua.randn({ 6, 2, 5, 5 }, { generator = gen }) * (1 + rank), dlua.randint(1, 4, { 6 }, { generator = gen, dtype = 'int64' })
end
local function stats(bn) return bn.running_mean:clone(), bn.running_var:clone(), bn.num_batches_tracked:item() end
-- every rank's (C) tensor (of the group), as a (world, C) one
local function gathered(t, group) return dlua.stack(dist.all_gather(nil, t, { group = group })) end
local function max_diff(a, b) return (a:double() - b:double()):abs():max():item() end

-- steps of training; returns the largest gap between each rank's running statistics and the hand-computed ones
local function train(broadcast_buffers, steps, group)
  local net = cnn()
  local model = dist.DDP(net, { broadcast_buffers = broadcast_buffers, group = group })
  local opt = optim.SGD(model, { lr = 0.1 })
  local crit = nn.CrossEntropyLoss()
  local conv, bn = net:children()[1], net:children()[2]
  local worst = 0
  for s = 1, steps do
    local mean0, var0, count0 = stats(bn)
    local from_mean = broadcast_buffers and gathered(mean0, group)[1] or mean0  -- what this forward starts from
    local from_var = broadcast_buffers and gathered(var0, group)[1] or var0
    local x, y = batch()
    opt:zero_grad()
    local before = broadcasts
    local out = model:forward(x)
    if broadcasts - before ~= (broadcast_buffers and 2 or 0) then  -- float32 statistics, int64 counter
      fail('a training forward issued %d broadcasts', broadcasts - before)
    end
    -- batch-norm by hand: (1 - 0.1) * start + 0.1 * this batch's mean and unbiased variance, per channel
    local a = conv.output:double():permute(2, 1, 3, 4):reshape(4, -1)
    local n = a:size(2)
    local m = a:mean(2):view(4)
    local v = (a - m:view(4, 1)):pow(2):sum(2):view(4) / (n - 1)
    worst = math.max(worst, max_diff(bn.running_mean, from_mean:double() * 0.9 + m * 0.1),
      max_diff(bn.running_var, from_var:double() * 0.9 + v * 0.1))
    local want_count = broadcast_buffers and s or count0 + 1
    if bn.num_batches_tracked:item() ~= want_count then fail('num_batches_tracked %d, expected %d', bn.num_batches_tracked:item(), want_count) end
    crit:forward(out, y)
    model:backward(x, crit:backward(out, y))
    opt:step()
  end
  return worst, model, net
end

-- with broadcast_buffers (the default): each step's statistics are rank 0's, updated with this rank's batch
local worst, model, net = train(true, 4)
if worst > 1e-5 then fail('running statistics %.3g from rank 0\'s updated with this rank\'s batch', worst) end
checks = checks + 1
-- after a last forward on the same batch everywhere, every rank holds the same buffers, bit for bit
local bn = net:children()[2]
dlua.manual_seed(9)
model:forward(dlua.randn({ 6, 2, 5, 5 }))
local all = gathered(bn.running_mean)
local allv = gathered(bn.running_var)
for r = 2, world do
  if max_diff(all[r], all[1]) ~= 0 or max_diff(allv[r], allv[1]) ~= 0 then fail('rank %d has other buffers than rank 0', r - 1) end
end
checks = checks + 1

-- which forwards broadcast: none in evaluate() mode (ranks may then run different numbers of batches), none
-- under no_sync, one sync per accumulation window
model:evaluate()
local before = broadcasts
for _ = 1, rank + 1 do model:forward(batch()) end
if broadcasts ~= before then fail('evaluate() forwards broadcast %d times', broadcasts - before) end
model:train()
before = broadcasts
model:no_sync(function()
  local x, y = batch()
  local out = model:forward(x)
  local crit = nn.CrossEntropyLoss()
  crit:forward(out, y)
  model:backward(x, crit:backward(out, y))
end)
if broadcasts ~= before then fail('a forward under no_sync broadcast %d times', broadcasts - before) end
local acc = dist.DDP(cnn(), { accumulate = 2 })
before = broadcasts
for _ = 1, 4 do
  local x, y = batch()
  local out = acc:forward(x)
  local crit = nn.CrossEntropyLoss()
  crit:forward(out, y)
  acc:backward(x, crit:backward(out, y))
end
acc:wait()
if broadcasts - before ~= 4 then fail('accumulate = 2: 4 micro-batches broadcast %d times, expected 2 syncs of 2', broadcasts - before) end
-- a model without buffers: no broadcast at all
dlua.manual_seed(4)
local mlp = dist.DDP(nn.Sequential{ nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2) })
before = broadcasts
mlp:forward(dlua.randn({ 5, 3 }))
if broadcasts ~= before then fail('a model without buffers broadcast %d times', broadcasts - before) end
checks = checks + 1

-- in a group of ranks 1.. (3 ranks or more), the group's first rank is the one whose buffers go out
if world >= 3 then
  local others = {}
  for r = 1, world - 1 do others[#others + 1] = r end
  local g = dist.new_group(others)
  if rank >= 1 then
    local gworst = train(true, 3, g)
    if gworst > 1e-5 then fail('in a group: running statistics %.3g from rank 1\'s updated with this rank\'s batch', gworst) end
    checks = checks + 1
  end
end

-- the control: with broadcast_buffers = false each rank keeps its own statistics, which then differ
local own, _, own_net = train(false, 3)
if own > 1e-5 then fail('running statistics %.3g from this rank\'s own', own) end
local theirs = gathered(own_net:children()[2].running_mean)
for r = 2, world do
  if max_diff(theirs[r], theirs[1]) == 0 then fail('broadcast_buffers = false: rank %d has rank 0\'s statistics', r - 1) end
end
checks = checks + 1
print(string.format('rank %d: DDP buffer checks passed (%d)', rank, checks))
dist.destroy()
