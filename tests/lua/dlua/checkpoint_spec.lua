-- Activation checkpointing (nn.Checkpoint, model:checkpoint): bit-identical gradients, dropout replayed, policies, memory statistics.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local resnet = require 'models.resnet'
local H = require 'tests.lua.dlua.tensor_helpers'

local function identical(a, b, what)
  assert(a ~= nil and b ~= nil, (what or '?') .. ': missing tensor')
  assert.same(a:size(), b:size(), what)
  if not a:eq(b):all():item() then
    error(string.format('%s: not bit-identical (max |diff| %g)', what or '?', (a:double() - b:double()):abs():max():item()), 2)
  end
end

local function mlp(seed)
  dlua.manual_seed(seed)
  return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.5),
    nn.Linear(32, 4))
end

-- One training step's loss, input gradient and parameter gradients (cloned), and where the default
-- generator stands after it.
local function step(model, x, y, crit)
  crit = crit or nn.CrossEntropyLoss()
  model:zero_grad()
  local out = model:forward(x)
  local loss = crit:forward(out, y):item()
  local gx = model:backward(x, crit:backward(out, y))
  local grads = {}
  for _, e in ipairs(model:named_parameters()) do grads[e.name] = e.grad:clone() end
  return { loss = loss, gx = gx and gx:clone(), grads = grads, rng = dlua.default_generator():get_offset() }
end

local function same_step(a, b, what)
  assert.equal(a.loss, b.loss, what .. ': loss')
  if a.gx or b.gx then identical(a.gx, b.gx, what .. ': input gradient') end
  local n = 0
  for name, g in pairs(a.grads) do
    identical(g, b.grads[name], what .. ': ' .. name)
    n = n + 1
  end
  assert.is_true(n > 0)
  assert.equal(a.rng, b.rng, what .. ': generator position after the step')
end

local function names(model)
  local r = {}
  for _, e in ipairs(model:named_parameters()) do r[#r + 1] = e.name end
  for _, e in ipairs(model:named_buffers()) do r[#r + 1] = e.name end
  return r
end

local function small_resnet18(seed)
  dlua.manual_seed(seed)
  local m = resnet.resnet18({ num_classes = 10 })
  -- batch-norm gammas and betas away from 1 and 0, so the blocks' fused paths all count
  m:walk(function(_, mod)
    if mod.running_mean then
      mod.weight:uniform_(0.5, 1.5)
      mod.bias:uniform_(-0.2, 0.2)
    end
  end)
  return m
end

describe('nn.Checkpoint', function()
  it('gives bit-identical gradients with dropout, masks replayed from the same generator positions', function()
    local x, y = dlua.randn(16, 6), dlua.randint(1, 5, 16)
    local ref = mlp(7)
    dlua.manual_seed(100)
    local r1, r2 = step(ref, x, y), step(ref, x, y)
    assert.is_true(r1.grads['0.weight']:ne(r2.grads['0.weight']):any():item(), 'two steps draw different masks')

    -- the middle of the network in one Checkpoint, built by hand
    dlua.manual_seed(7)
    local l1, r, d1, l2, r2_, d2, l3 = nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(),
      nn.Dropout(0.5), nn.Linear(32, 4)
    local inner = nn.Sequential(l2, r2_, d2)
    local model = nn.Sequential(l1, r, nn.Checkpoint(nn.Sequential(d1)), nn.Checkpoint(inner), l3)
    -- names as without checkpointing (the second Checkpoint's Sequential gives "3.0", "3.1"... : a different tree)
    assert.same({ '0.weight', '0.bias', '3.0.weight', '3.0.bias', '4.weight', '4.bias' }, names(model))
    -- the recompute draws d2's mask again: record every mask d2 makes
    local masks = {}
    local fwd = d2.forward
    d2.forward = function(self, t)
      local o = fwd(self, t)
      masks[#masks + 1] = self.mask:clone()
      return o
    end
    dlua.manual_seed(100)
    local c1 = step(model, x, y)
    assert.equal(2, #masks, 'forward and its recompute in backward')
    identical(masks[1], masks[2], 'dropout mask of the recompute')
    assert.is_true(masks[1]:float():sum():item() < masks[1]:numel(), 'the mask drops something')
    local c2 = step(model, x, y)
    assert.equal(4, #masks)
    assert.is_true(masks[3]:ne(masks[1]):any():item(), 'the next step draws a new mask')
    -- same tree, same kernels: compare with an unwrapped copy of this very structure
    dlua.manual_seed(7)
    local plain = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Sequential(nn.Dropout(0.3)),
      nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.5)), nn.Linear(32, 4))
    dlua.manual_seed(100)
    same_step(step(plain, x, y), c1, 'step 1')
    same_step(step(plain, x, y), c2, 'step 2')
    -- and the flat MLP agrees numerically too (same layers, same draws)
    assert.equal(r1.loss, c1.loss)
  end)

  it('gives bit-identical ResNet-18 gradients and running statistics for none, blocks and stages', function()
    local x = dlua.randn({ 2, 3, 32, 32 }, { generator = dlua.Generator(5) })
    local y = dlua.tensor({ 3, 7 }, { dtype = 'int64' })
    local ref = small_resnet18(11)
    local want = { step(ref, x, y), step(ref, x, y) }
    local bufs = {} -- after two steps
    for _, e in ipairs(ref:named_buffers()) do bufs[e.name] = e.buffer:clone() end
    for _, policy in ipairs({ 'blocks', 'stages', { 'conv1', 'layer1', 'layer3.1', 'fc' } }) do
      local m = small_resnet18(11)
      local plan = m:checkpoint(policy)
      local what = type(policy) == 'string' and policy or 'paths'
      assert.is_true(#plan.segments > 0)
      same_step(want[1], step(m, x, y), what .. ' step 1')
      if policy == 'blocks' then
        same_step(want[2], step(m, x, y), what .. ' step 2')
        for _, e in ipairs(m:named_buffers()) do identical(bufs[e.name], e.buffer, what .. ': ' .. e.name) end
      end
    end
  end)

  it('gives bit-identical gradients through channels-last blocks with the fused shortcut add', function()
    local x = dlua.randn({ 4, 1, 12, 12 }, { generator = dlua.Generator(9) }):contiguous('channels_last')
    local y = dlua.tensor({ 1, 2, 3, 4 }, { dtype = 'int64' })
    dlua.manual_seed(3)
    local ref = resnet.resnet20({ in_channels = 1, num_classes = 10 }):input_grad(false)
    dlua.manual_seed(3)
    local m = resnet.resnet20({ in_channels = 1, num_classes = 10 }):input_grad(false)
    assert.equal(9, #m:checkpoint('blocks').segments)
    same_step(step(ref, x, y), step(m, x, y), 'channels-last step 1')
    same_step(step(ref, x, y), step(m, x, y), 'channels-last step 2')
  end)

  it('gives parameter gradients when the segment input needs none (PyTorch #7617)', function()
    local x, y = dlua.randn(8, 6), dlua.randint(1, 5, 8)
    dlua.manual_seed(4)
    local ref = nn.Sequential(nn.Sequential(nn.Linear(6, 12), nn.ReLU()), nn.Linear(12, 4)):input_grad(false)
    dlua.manual_seed(4)
    local model = nn.Sequential(nn.Checkpoint(nn.Sequential(nn.Linear(6, 12), nn.ReLU())), nn.Linear(12, 4)):input_grad(false)
    local a, b = step(ref, x, y), step(model, x, y)
    assert.is_nil(b.gx, 'no input gradient was asked for')
    assert.is_true(b.grads['0.0.weight']:abs():sum():item() > 0, 'the checkpointed layer got a gradient')
    same_step(a, b, 'input without gradient')
  end)

  it('frees what the segment made in forward and keeps only its input and output', function()
    local x = dlua.randn(4, 6)
    local seg = nn.Sequential(nn.Linear(6, 500), nn.ReLU(), nn.Linear(500, 3))
    local ck = nn.Checkpoint(seg)
    local out = ck:forward(x)
    assert.is_nil(seg:get(1).output, 'the hidden activation is gone')
    assert.is_nil(seg:get(2).output)
    assert.equal(out, seg:get(3).output)
    assert.equal(out, ck.output)
    assert.equal(x, seg._inputs[1])
    assert.is_nil(seg._inputs[2])
    assert.equal(seg:get(1), ck:get(1), 'fields read through to the module')
    assert.truthy(tostring(ck):find('Checkpoint(Sequential)', 1, true))
    -- backward's recompute is freed too; the output goes at the next forward once its backward has run
    -- (as Torch7's buffers are overwritten), the input and the gradients passed in and out never
    local g = dlua.ones(4, 3)
    local out2 = ck:forward(x)
    assert.is_true(pcall(function() return out:sum() end), 'no backward yet: the previous output stays')
    local gx = ck:backward(x, g)
    assert.is_nil(seg:get(1).output)
    local out3 = ck:forward(x)
    assert.is_false(pcall(function() return out2:sum() end), 'the previous output was released')
    assert.equal(0, x:sub(x):abs():sum():item())
    ck:backward(x, g)
    assert.equal(4 * 6, gx:numel())
    assert.equal(3 * 4, g:sum():item())
    assert.equal(out3, ck.output)
  end)

  it('reports misuse clearly', function()
    H.raises(function() nn.Checkpoint(42) end, 'nn.Checkpoint: expected a dlua.nn module, got number', true)
    H.raises(function() nn.Checkpoint(nn.Linear(2, 2)):backward(dlua.ones(1, 2), dlua.ones(1, 2)) end,
      'Checkpoint backward: backward before forward', true)
    local m = resnet.resnet18()
    H.raises(function() m:checkpoint('layers') end, "policy must be 'none', 'blocks', 'stages'", true)
    H.raises(function() m:checkpoint({ 'layer1', 'layer9', 'fc.x' }) end,
      'no module at "layer9", "fc.x" (the model\'s children: conv1, bn1, maxpool, layer1', true)
    H.raises(function() m:checkpoint({ 'layer1', 'layer1.0' }) end, '"layer1.0" is inside "layer1"', true)
    H.raises(function() m:checkpoint({ '' }) end, 'the root cannot be wrapped in place; use nn.Checkpoint(model)', true)
    H.raises(function() nn.Sequential(nn.Linear(2, 2)):checkpoint('blocks') end, 'Sequential has no residual blocks', true)
    H.raises(function() m:checkpoint({ budget_mb = 10 }) end, 'a sample input batch x is needed', true)
    H.raises(function() m:checkpoint({ budget_mb = -1, input = dlua.ones(1) }) end, 'must be a positive number of MiB', true)
  end)
end)

describe('model:checkpoint', function()
  it('wraps blocks, stages or paths in place, keeps every name, and undoes itself', function()
    local m = resnet.resnet18()
    local before = names(m)
    local plan = m:checkpoint('blocks')
    assert.same({ 'layer1.0', 'layer1.1', 'layer2.0', 'layer2.1', 'layer3.0', 'layer3.1', 'layer4.0', 'layer4.1' }, plan.segments)
    assert.equal('Checkpoint', m.layer2['1'].__name)
    assert.equal(m.layer2['1'], m.layer2:get(2))
    assert.truthy(tostring(m):find('(1): Checkpoint(BasicBlock)', 1, true))
    assert.truthy(tostring(plan):find('activation checkpointing (blocks): 8 segments (layer1.0, layer1.1', 1, true))
    assert.same(before, names(m))
    assert.equal(m:num_parameters(), resnet.resnet18():num_parameters())
    assert.same({ 'layer1', 'layer2', 'layer3', 'layer4' }, m:checkpoint('stages').segments)
    assert.equal('BasicBlock', m.layer2['1'].__name, 'the previous policy was removed')
    assert.equal('Checkpoint', m.layer2.__name)
    assert.same({ 'layer2.0.downsample', 'fc' }, m:checkpoint({ 'layer2.0.downsample', 'fc' }).segments)
    assert.equal('Checkpoint', m.fc.__name)
    assert.equal('Sequential', m.layer2.__name)
    assert.same({}, m:checkpoint('none').segments)
    local count = 0
    m:walk(function(_, mod) if mod.__name == 'Checkpoint' then count = count + 1 end end)
    assert.equal(0, count)
    assert.same(before, names(m))
    -- a block the user wrapped is left alone by a policy
    local cifar = resnet.resnet20()
    local mine = nn.Checkpoint(cifar.layer1['0'])
    cifar.layer1._children[1].module, cifar.layer1['0'] = mine, mine
    assert.equal(8, #cifar:checkpoint('blocks').segments)
    cifar:checkpoint('none')
    assert.equal(mine, cifar.layer1:get(1))
  end)

  it('releases what backward has used: a block\'s output, a gradient given up, never the model\'s output', function()
    local x, y = dlua.randn(2, 3, 16, 16), dlua.tensor({ 1, 2 }, { dtype = 'int64' })
    local crit = nn.CrossEntropyLoss()
    for _, policy in ipairs({ 'blocks', { 'layer1', 'fc' } }) do
      local m = resnet.resnet18({ num_classes = 4 })
      m:checkpoint(policy)
      local out = m:forward(x)
      crit:forward(out, y)
      local block_out = m.layer1.output
      assert.is_true(pcall(function() return block_out:sum() end))
      m:backward(x, crit:backward(out, y))
      assert.is_false(pcall(function() return block_out:sum() end), 'layer1\'s output is spent after its backward')
      assert.equal(2, out:argmax(2):numel(), 'the model\'s output stays (here the output of a checkpointed fc)')
      assert.is_true(x:sum():item() == x:sum():item(), 'and its input')
    end
  end)

  it('plans for a memory budget from one measured forward, largest blocks first', function()
    local x = dlua.randn({ 4, 3, 32, 32 }, { generator = dlua.Generator(2) })
    local m = small_resnet18(1)
    local rng = dlua.default_generator():get_offset()
    local rm = m.layer1['0'].bn1.running_mean:clone()
    local all = m:checkpoint({ budget_mb = 1e-3, input = x })
    assert.equal(8, #all.segments)
    assert.is_false(all.fits)
    identical(rm, m.layer1['0'].bn1.running_mean, 'the probe leaves the running statistics')
    assert.equal(rng, dlua.default_generator():get_offset(), 'and the generator')
    local none = m:checkpoint({ budget_mb = 1e4, input = x })
    assert.same({}, none.segments)
    assert.is_true(none.fits)
    assert.near(all.baseline_mb, none.baseline_mb, 1e-9)
    -- halfway: the plan fits, takes the largest savers, and says what forward will keep
    local mid = m:checkpoint({ budget_mb = (all.planned_mb + all.baseline_mb) / 2, input = x })
    assert.is_true(mid.fits)
    assert.is_true(#mid.segments > 1 and #mid.segments < 8, tostring(mid))
    assert.is_true(mid.planned_mb <= mid.budget_mb)
    local smallest_kept = math.huge
    for _, mb in pairs(mid.saved_mb) do smallest_kept = math.min(smallest_kept, mb) end
    for _, p in ipairs(all.segments) do
      if not mid.saved_mb[p] then assert.is_true(all.saved_mb[p] <= smallest_kept, p .. ' saves more than a chosen block') end
    end
    assert.truthy(tostring(mid):find('MiB planned', 1, true))
    -- what the forward keeps, measured, is the plan's (planned - the largest segment); the probe left
    -- the model holding no activations
    collectgarbage('collect'); collectgarbage('collect')
    local m0 = dlua.memory_allocated()
    local out = m:forward(x)
    collectgarbage('collect'); collectgarbage('collect')
    local kept = (dlua.memory_allocated() - m0) / 2 ^ 20
    local biggest = 0
    for _, mb in pairs(mid.saved_mb) do biggest = math.max(biggest, mb) end
    assert.is_true(out ~= nil and math.abs(kept - (mid.planned_mb - biggest)) < 0.01 * mid.baseline_mb,
      string.format('kept %.3f MiB, plan %s', kept, tostring(mid)))
  end)
end)

describe('memory statistics', function()
  it('report current and peak bytes, and reset the peak', function()
    collectgarbage('collect')
    dlua.reset_peak_memory_stats()
    local s0 = dlua.memory_stats()
    assert.equal(s0.allocated, s0.peak_allocated)
    assert.equal(s0.allocated, dlua.memory_allocated())
    assert.equal(s0.allocated + s0.cached, s0.reserved)
    local t = dlua.empty(1000000)
    local s1 = dlua.memory_stats()
    assert.equal(s0.allocated + 4000000, s1.allocated)
    assert.equal(s1.allocated, s1.peak_allocated)
    t:free()
    local s2 = dlua.memory_stats()
    assert.equal(s0.allocated, s2.allocated)
    assert.equal(s1.peak_allocated, s2.peak_allocated, 'the peak stays')
    assert.equal(s1.peak_allocated, dlua.memory_peak())
    dlua.reset_peak_memory_stats('cpu')
    assert.equal(s2.allocated, dlua.memory_stats().peak_allocated)
    H.raises(function() dlua.memory_stats('tpu') end, "memory_stats: unknown device 'tpu'", true)
  end)

  it('show a lower training-step peak with blocks checkpointed than without', function()
    local x = dlua.randn({ 16, 3, 32, 32 }, { generator = dlua.Generator(3) })
    local y = dlua.randint(1, 11, 16, { generator = dlua.Generator(4) })
    local crit = nn.CrossEntropyLoss()
    local peaks = {}
    for _, policy in ipairs({ 'none', 'blocks' }) do
      dlua.manual_seed(2)
      local m = resnet.resnet20():input_grad(false)
      m:checkpoint(policy)
      -- a fresh model's first step: above the parameters and gradients, only what the step makes
      collectgarbage('collect'); collectgarbage('collect')
      local state = dlua.memory_allocated()
      dlua.reset_peak_memory_stats()
      local out = m:forward(x)
      crit:forward(out, y)
      m:backward(x, crit:backward(out, y))
      peaks[policy] = dlua.memory_stats().peak_allocated - state
      m, out = nil, nil -- luacheck: ignore
    end
    -- ResNet-20, batch 16, 32x32: forward keeps 24.5 MiB without checkpointing, 7.25 MiB with blocks
    assert.is_true(peaks.blocks * 1.5 < peaks.none, string.format('step peak: none %.2f MiB, blocks %.2f MiB',
      peaks.none / 2 ^ 20, peaks.blocks / 2 ^ 20))
  end)
end)
