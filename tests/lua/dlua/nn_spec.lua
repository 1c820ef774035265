-- dlua.nn's module system: names, flat arenas, state dicts, backward against finite differences.
local dlua = require 'dlua'
local nn = require 'dlua.nn'

local f64 = { dtype = 'float64' }

local function mlp()
  return nn.Sequential(nn.Linear(5, 7, f64), nn.ReLU(), nn.Linear(7, 3, f64))
end

-- Loss of the model at its current parameters, as a Lua number.
local function loss_of(model, crit, x, y) return crit:forward(model:forward(x), y):item() end

describe('dlua.nn modules', function()
  it('name parameters as PyTorch does and print a tree with counts', function()
    local m = mlp()
    local names = {}
    for _, e in ipairs(m:named_parameters()) do names[#names + 1] = e.name end
    assert.same({ '0.weight', '0.bias', '2.weight', '2.bias' }, names)
    assert.equals(5 * 7 + 7 + 7 * 3 + 3, m:num_parameters())
    local s = tostring(m)
    assert.truthy(s:find('(0): Linear(5 -> 7)  [42 params]', 1, true))
    assert.truthy(s:find('(1): ReLU', 1, true))
    assert.equals(m:children()[3], m['2'])
    assert.equals(m:get(3), m['2'])
    assert.equals(m:get(-1), m['2'])
  end)

  it('backward matches central finite differences (float64)', function()
    dlua.manual_seed(3)
    local m, crit = mlp(), nn.MSELoss()
    local x, y = dlua.randn(4, 5, f64), dlua.randn(4, 3, f64)
    m:zero_grad()
    local out = m:forward(x)
    crit:forward(out, y)
    local gx = m:backward(x, crit:backward(out, y))
    local h = 1e-6
    for _, e in ipairs(m:named_parameters()) do
      local p, g = e.param:view(-1), e.grad:view(-1)
      for i = 1, p:numel(), 3 do
        local v = p[i]
        p[i] = v + h; local lp = loss_of(m, crit, x, y)
        p[i] = v - h; local lm = loss_of(m, crit, x, y)
        p[i] = v
        assert.near((lp - lm) / (2 * h), g[i], 1e-6, e.name .. '[' .. i .. ']')
      end
    end
    local xv = x:view(-1)
    for i = 1, xv:numel(), 2 do
      local v = xv[i]
      xv[i] = v + h; local lp = loss_of(m, crit, x, y)
      xv[i] = v - h; local lm = loss_of(m, crit, x, y)
      xv[i] = v
      assert.near((lp - lm) / (2 * h), gx:view(-1)[i], 1e-6)
    end
  end)

  it('accumulate parameter gradients across backwards until zero_grad', function()
    local m, crit = mlp(), nn.MSELoss()
    local x, y = dlua.randn(3, 5, f64), dlua.randn(3, 3, f64)
    local function step()
      local out = m:forward(x)
      crit:forward(out, y)
      m:backward(x, crit:backward(out, y))
    end
    m:zero_grad(); step()
    local once = m['0'].grad_weight:clone()
    step()
    assert.near(0, (m['0'].grad_weight - once * 2):abs():max():item(), 1e-12)
    m:zero_grad()
    assert.equals(0, m['0'].grad_weight:abs():sum():item())
  end)

  it('flatten into one arena in reverse order, keeping values, covering each parameter once', function()
    local m = mlp()
    local before = {}
    for _, e in ipairs(m:named_parameters()) do before[e.name] = e.param:clone() end
    local arena = m:flatten()
    local layout = m:layout()
    assert.same({ '2.bias', '2.weight', '0.bias', '0.weight' },
      { layout[1].name, layout[2].name, layout[3].name, layout[4].name })
    local covered = 0
    for i, e in ipairs(layout) do
      assert.equals(covered, e.offset, e.name)
      covered = covered + e.numel
      if i > 1 then assert.equals(layout[i - 1].offset + layout[i - 1].numel, e.offset) end
    end
    assert.equals(arena.params.float64:numel(), covered)
    for _, e in ipairs(m:named_parameters()) do
      assert.is_true(e.param:same_storage(arena.params.float64), e.name)
      assert.is_true(e.grad:same_storage(arena.grads.float64), e.name)
      assert.equals(0, (e.param - before[e.name]):abs():max():item())
    end
    -- a step on the arena is a step on every parameter
    arena.params.float64:add_(1)
    assert.near(before['0.bias'][1] + 1, m['0'].bias[1], 1e-12)
  end)

  it('round-trip state dicts and report every mismatch in strict loads', function()
    local a, b = mlp(), mlp()
    b:load_state_dict(a:state_dict())
    for _, e in ipairs(b:named_parameters()) do
      assert.equals(0, (e.param - a:state_dict()[e.name]):abs():max():item())
    end
    local sd = a:state_dict()
    local partial = { ['0.weight'] = sd['0.weight'], ['2.bias'] = dlua.zeros(4, f64), extra = dlua.zeros(1) }
    local ok, err = pcall(function() b:load_state_dict(partial) end)
    assert.is_false(ok)
    assert.matches('nn_spec.lua:%d+: Sequential.load_state_dict:', err)
    assert.truthy(err:find('2.bias: expected dlua.Size(3), got dlua.Size(4)', 1, true))
    assert.truthy(err:find('missing keys: 0.bias, 2.weight', 1, true))
    assert.truthy(err:find('unexpected keys: extra', 1, true))
    -- non-strict loads what matches and still refuses wrong shapes
    local res = b:load_state_dict({ ['0.weight'] = sd['0.weight'] }, false)
    assert.same({ '0.bias', '2.bias', '2.weight' }, res.missing)
  end)

  it('move with to(dtype), to(device), to{device, dtype}, and reject bad specs by name', function()
    local m = mlp():to('float32')
    assert.equals('float32', m:named_parameters()[1].param.dtype)
    assert.equals(m, m:to('cpu'))
    assert.equals(m, m:to('auto')) -- no GPU here, or the same device: nothing to do
    m:to({ device = 'cpu', dtype = 'double' })
    for _, e in ipairs(m:named_parameters()) do
      assert.equals('float64', e.param.dtype)
      assert.equals('float64', e.grad.dtype)
    end
    assert.equals('cpu', m:device())
    assert.equals('cpu', m:flatten().device)
    local bn = nn.BatchNorm2d(3):to('float32')
    assert.equals('int64', bn.num_batches_tracked.dtype) -- integer buffers keep their dtype
    local ok, err = pcall(function() mlp():to('gpu') end)
    assert.is_false(ok)
    assert.matches("nn_spec.lua:%d+: Sequential:to: expected a floating dtype or a device %('cpu', 'cuda', 'cuda:N', 'auto'%), got gpu", err)
    ok, err = pcall(function() mlp():to({ dtype = 'int32' }) end)
    assert.matches('Sequential:to: expected a floating dtype, got int32', err)
    if not dlua.cuda.is_available() then
      ok, err = pcall(function() mlp():to('cuda') end)
      assert.is_false(ok)
      assert.matches('Sequential:to%(cuda%): no CUDA device available', err)
    end
    local f = mlp()
    f:flatten()
    ok, err = pcall(function() f:to('float32') end)
    assert.matches('already in a flat arena', err)
  end)

  it('name the module and the shape when the input is wrong', function()
    local m = nn.Linear(4, 2)
    local line = debug.getinfo(1, 'l').currentline + 1
    local ok, err = pcall(function() m:forward(dlua.zeros(3, 5)) end)
    assert.is_false(ok)
    assert.matches('nn_spec.lua:' .. line .. ': Linear forward: expected %(N, 4%), got input of shape dlua.Size%(3, 5%)', err)
  end)

  -- the error names the failing child by its state-dict path and the line that called the model,
  -- not the container's line inside dlua.nn
  it('name the failing child by its path and the caller\'s line, in forward and backward', function()
    local resnet = require 'models.resnet'
    local net = resnet.resnet18({ num_classes = 10 })
    net.layer3['1'].conv2.weight = dlua.randn(256, 7, 3, 3)  -- wrong input channels, deep in the tree
    local line = debug.getinfo(1, 'l').currentline + 1
    local ok, err = pcall(function() return net:forward(dlua.randn(2, 3, 32, 32)) end)
    assert.is_false(ok)
    assert.matches('^[^\n]*nn_spec.lua:' .. line .. ': layer3.1.conv2 %(Conv2d%) forward: conv2d: ', err)
    assert.is_nil(err:find('nn/init.lua', 1, true), err)

    local seq = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3), nn.Linear(5, 2)))
    line = debug.getinfo(1, 'l').currentline + 1
    ok, err = pcall(seq.forward, seq, dlua.randn(2, 4))
    assert.matches('nn_spec.lua:' .. line .. ': 2.1 %(Linear%) forward: expected %(N, 5%)', err)

    local good = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    local x = dlua.randn(2, 4)
    good:forward(x)
    line = debug.getinfo(1, 'l').currentline + 1
    ok, err = pcall(function() good:backward(x, dlua.randn(2, 7)) end)
    assert.is_false(ok)
    assert.matches('nn_spec.lua:' .. line .. ': 2 %(Linear%) backward: ', err)
    -- the model still works after an error (no state left behind by the failed call)
    assert.equals(2, good:forward(x):size(2))
    assert.equals(4, good:backward(x, dlua.ones(2, 2)):size(2))
  end)

  it('keep the line of a bug in a user module, and let a user module\'s own errors through', function()
    local Bad = nn.Module:extend('Bad')
    local bug_line = debug.getinfo(1, 'l').currentline + 1
    function Bad:forward(x) local t = nil; return t.field end
    local m = nn.Sequential(nn.Identity(), Bad())
    local line = debug.getinfo(1, 'l').currentline + 1
    local ok, err = pcall(function() return m:forward(dlua.zeros(1)) end)
    assert.is_false(ok)
    assert.matches('nn_spec.lua:' .. line .. ': 1 %(Bad%) forward: attempt to index', err)
    assert.matches('%[raised at [^%]]*nn_spec.lua:' .. bug_line .. '%]', err)
    -- non-string errors pass through untouched
    local Thrower = nn.Module:extend('Thrower')
    function Thrower:forward() error({ code = 7 }) end
    ok, err = pcall(function() return nn.Sequential(Thrower()):forward(dlua.zeros(1)) end)
    assert.same({ code = 7 }, err)
  end)

  it('train a small model: the loss goes down', function()
    dlua.manual_seed(0)
    local m, crit = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)), nn.MSELoss()
    local x = dlua.randn(64, 4)
    local y = (x:sum(2, true) * 0.5):relu()
    local arena = m:flatten()
    local first, last
    for step = 1, 300 do
      m:zero_grad()
      local out = m:forward(x)
      local loss = crit:forward(out, y):item()
      first = first or loss
      last = loss
      m:backward(x, crit:backward(out, y))
      arena.params.float32:add_(arena.grads.float32, -0.05)
    end
    assert.is_true(last < first * 0.2, ('loss %g -> %g'):format(first, last))
  end)

  it('cross-entropy: 1-based labels, smoothing, and a gradient matching finite differences', function()
    local ce = nn.CrossEntropyLoss()
    local logits = dlua.tensor({ { 1, 2, 3 }, { 0.5, -1, 0 } }, f64)
    local labels = dlua.tensor({ 3, 1 }, { dtype = 'int64' })
    local l1 = math.log(math.exp(1) + math.exp(2) + math.exp(3)) - 3
    local l2 = math.log(math.exp(0.5) + math.exp(-1) + 1) - 0.5
    assert.near((l1 + l2) / 2, ce:forward(logits, labels):item(), 1e-12)
    local smooth = nn.CrossEntropyLoss({ label_smoothing = 0.3 })
    -- PyTorch's definition: (1 - e) * nll + e * mean over classes of -log p
    local function logp(row, k) return logits[row][k] - math.log(math.exp(logits[row][1]) + math.exp(logits[row][2]) + math.exp(logits[row][3])) end
    local want = 0
    for row, lab in ipairs({ 3, 1 }) do
      local uniform = -(logp(row, 1) + logp(row, 2) + logp(row, 3)) / 3
      want = want + 0.7 * -logp(row, lab) + 0.3 * uniform
    end
    assert.near(want / 2, smooth:forward(logits, labels):item(), 1e-12)
    -- the model's gradient through the loss, against central differences
    dlua.manual_seed(5)
    local m = mlp()
    local x = dlua.randn(6, 5, f64)
    local y = dlua.tensor({ 1, 2, 3, 3, 2, 1 }, { dtype = 'int64' })
    m:zero_grad()
    local out = m:forward(x)
    smooth:forward(out, y)
    m:backward(x, smooth:backward(out, y))
    local p, g = m['0'].weight:view(-1), m['0'].grad_weight:view(-1)
    for i = 1, p:numel(), 4 do
      local v, h = p[i], 1e-6
      p[i] = v + h; local lp1 = smooth:forward(m:forward(x), y):item()
      p[i] = v - h; local lm1 = smooth:forward(m:forward(x), y):item()
      p[i] = v
      assert.near((lp1 - lm1) / (2 * h), g[i], 1e-7)
    end
    local ok, err = pcall(function() ce:forward(logits, dlua.tensor({ 4, 1 }, { dtype = 'int64' })) end)
    assert.is_false(ok)
    assert.truthy(err:find('4', 1, true), err)
  end)

  it('dropout: scaled mask in training, reproducible by seed, identity in evaluation', function()
    local d = nn.Dropout(0.25)
    local x = dlua.ones(10000)
    dlua.manual_seed(7)
    local y1 = d:forward(x):clone()
    dlua.manual_seed(7)
    local y2 = d:forward(x)
    assert.equals(0, (y1 - y2):abs():max():item())
    local kept = y1:gt(0):sum():item()
    assert.is_true(math.abs(kept / 10000 - 0.75) < 0.03, 'kept fraction ' .. kept / 10000)
    assert.near(1 / 0.75, y1:max():item(), 1e-6)
    local g = d:backward(x, dlua.ones(10000))
    assert.equals(0, (g - y1):abs():max():item())
    d:evaluate()
    assert.equals(0, (d:forward(x) - x):abs():max():item())
  end)
end)

describe('a ResNet built from dlua.nn', function()
  local resnet = require 'models.resnet'

  -- One forward and backward of m on (x, y) from zeroed gradients: the output, the input
  -- gradient and a copy of every parameter's gradient by name.
  local function step(m, crit, x, y)
    m:zero_grad()
    local out = m:forward(x)
    crit:forward(out, y)
    local gx = m:backward(x, crit:backward(out, y))
    local grads = {}
    for _, e in ipairs(m:named_parameters()) do grads[e.name] = e.grad:clone() end
    return out:clone(), gx, grads
  end

  -- A 3-class ResNet-20 on a batch of four random 1-channel hw x hw images (dtype float32 unless
  -- given), from seed: the model, its criterion, x and the labels.
  local function small_problem(seed, hw, dtype)
    dlua.manual_seed(seed)
    local m = resnet.resnet20({ in_channels = 1, num_classes = 3 })
    if dtype then m:to(dtype) end
    local x = dlua.randn(4, 1, hw, hw, { dtype = dtype })
    return m, nn.CrossEntropyLoss(), x, dlua.tensor({ 1, 2, 3, 1 }, { dtype = 'int64' })
  end

  it('uses torchvision parameter names', function()
    local m = resnet.resnet18({ num_classes = 7 })
    local sd = m:state_dict()
    for _, k in ipairs({ 'conv1.weight', 'bn1.running_mean', 'layer1.0.conv1.weight', 'layer1.0.bn1.running_var',
      'layer2.0.downsample.0.weight', 'layer2.0.downsample.1.weight', 'layer4.1.bn2.num_batches_tracked',
      'fc.weight', 'fc.bias' }) do
      assert.is_truthy(sd[k], k)
    end
    assert.same({ 7, 512 }, sd['fc.weight']:size())
    assert.equals(11689512 - 1000 * 513 + 7 * 513, m:num_parameters()) -- torchvision's resnet18, 7 classes
  end)

  it('ResNet-20 backward matches finite differences in float64 (conv, fused batch-norm, residuals, pooling)', function()
    local m, crit, x, y = small_problem(4, 8, 'float64')
    m:zero_grad()
    local out = m:forward(x)
    crit:forward(out, y)
    m:backward(x, crit:backward(out, y))
    local named = {}
    for _, e in ipairs(m:named_parameters()) do named[e.name] = e end
    for _, name in ipairs({ 'conv1.weight', 'layer1.0.bn2.weight', 'layer2.0.downsample.0.weight', 'layer3.2.conv2.weight',
      'fc.bias' }) do
      local p, g = named[name].param:view(-1), named[name].grad:view(-1)
      for i = 1, p:numel(), math.max(1, math.floor(p:numel() / 3)) do
        local v, h = p[i], 1e-5
        p[i] = v + h; local lp = crit:forward(m:forward(x), y):item()
        p[i] = v - h; local lm = crit:forward(m:forward(x), y):item()
        p[i] = v
        assert.near((lp - lm) / (2 * h), g[i], 1e-6, name .. '[' .. i .. ']')
      end
    end
  end)

  it('input_grad(false) skips the first layer\'s input gradient and leaves the parameter gradients as they were', function()
    local m, crit, x, y = small_problem(6, 8)
    local function grads()
      local _, gx, g = step(m, crit, x, y)
      return gx, g
    end
    local gx1, g1 = grads()
    assert.is_not_nil(gx1)
    assert.equals(m, m:input_grad(false))
    local gx2, g2 = grads()
    assert.is_nil(gx2)
    for k, g in pairs(g1) do assert.equals(0, (g - g2[k]):abs():max():item(), k) end
    m:input_grad(true)
    assert.is_not_nil((grads()))
    -- a Sequential passes it to its first child only
    local seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)):input_grad(false)
    local xs = dlua.randn(5, 3)
    seq:forward(xs)
    assert.is_nil(seq:backward(xs, dlua.ones(5, 2)))
    assert.is_true(seq:get(3).needs_input_grad ~= false)
  end)

  it('Conv2d:backward(x, grad, add_to) adds the input gradient into add_to (fused channels-last and not)', function()
    dlua.manual_seed(6)
    for _, case in ipairs({ { 'channels_last', 1 }, { 'contiguous', 1 }, { 'channels_last', 2 } }) do
      local fmt, stride = case[1], case[2]
      local conv = nn.Conv2d(8, 16, 3, { padding = 1, stride = stride, bias = false })
      local x = dlua.randn(3, 8, 9, 9):contiguous(fmt)
      local y = conv:forward(x)
      local g = dlua.randn(y:size()):contiguous(fmt)
      local plain = conv:backward(x, g):clone()
      local base = dlua.randn(x:size()):contiguous(fmt)
      local acc = base:clone():contiguous(fmt)
      local ret = conv:backward(x, g, acc)
      assert.equals(acc, ret)
      local err = (acc - (base + plain)):abs():max():item()
      assert.is_true(err < 1e-5, fmt .. ' stride ' .. stride .. ': ' .. err)
    end
  end)

  it('BatchNorm2d:backward(x, grad, true) writes over grad: the same gradients, in grad\'s own memory', function()
    dlua.manual_seed(8)
    for _, case in ipairs({ { 'channels_last', false }, { 'contiguous', false }, { 'channels_last', true } }) do
      local fmt, with_skip = case[1], case[2]
      local bn = nn.BatchNorm2d(5, { relu = true })
      local x = dlua.randn(3, 5, 4, 6):contiguous(fmt)
      local skip = with_skip and dlua.randn(x:size()):contiguous(fmt) or nil
      bn:forward(x, skip)
      local g = dlua.randn(x:size()):contiguous(fmt)
      local gi, gs = bn:backward(x, g:clone())
      local gw = bn.grad_weight:clone()
      bn:zero_grad()
      local given = g:clone()
      local gi2, gs2 = bn:backward(x, given, true)
      -- with a skip, grad_skip (the masked grad) takes grad's memory; without, grad_input does
      assert.is_true((with_skip and gs2 or gi2):same_storage(given), fmt)
      if with_skip then assert.is_false(gi2:same_storage(given)) end
      assert.equals(0, (gi2 - gi):abs():max():item(), fmt)
      if with_skip then assert.equals(0, (gs2 - gs):abs():max():item()) end
      assert.equals(0, (bn.grad_weight - gw):abs():max():item())
    end
  end)

  it('a float32 ResNet-20 step is the same channels-last (fused residual gradients) as NCHW', function()
    local m, crit, x, y = small_problem(7, 12)
    local _, gx1, g1 = step(m, crit, x, y)
    local _, gx2, g2 = step(m, crit, x:contiguous('channels_last'), y)
    local function rel(a, b) return (a - b):abs():max():item() / (b:abs():max():item() + 1e-30) end
    assert.is_true(rel(gx2, gx1) < 1e-4, 'input gradient ' .. rel(gx2, gx1))
    for k, g in pairs(g1) do assert.is_true(rel(g2[k], g) < 1e-4, k .. ' ' .. rel(g2[k], g)) end
  end)

  it('a channels-last input keeps every activation and every input gradient channels-last, same numbers', function()
    local m, crit, x, y = small_problem(5, 8, 'float64')
    local out1, gx1, g1 = step(m, crit, x, y)
    local out2, gx2, g2 = step(m, crit, x:contiguous('channels_last'), y)
    assert.is_true(gx2:is_contiguous('channels_last'))
    m:walk(function(name, mod)
      for _, f in ipairs({ 'output', 'grad_input' }) do
        local t = rawget(mod, f)
        if t and t:dim() == 4 and t:size(2) > 1 and t:size(3) > 1 then
          assert.is_true(t:is_contiguous('channels_last'), name .. '.' .. f .. ' is not channels-last')
        end
      end
    end)
    assert.is_true((out1 - out2):abs():max():item() < 1e-12)
    assert.is_true((gx1 - gx2):abs():max():item() < 1e-12)
    for k, g in pairs(g1) do assert.is_true((g - g2[k]):abs():max():item() < 1e-12, k) end
  end)
end)
