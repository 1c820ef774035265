-- SyncBatchNorm in one process: convert() keeps everything but the class, no job means plain BatchNorm2d, and the
-- C halves (stats, apply, backward reduce/apply) over slices of a batch equal the fused kernels on the whole batch.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local K = require 'bindings.nn'
local resnet = require 'models.resnet'

local function max_diff(a, b) return (a:double() - b:double()):abs():max():item() end
local function channels_last(x) return x:contiguous('channels_last') end

describe('SyncBatchNorm', function()
  it('is BatchNorm2d with sync = true, by option or by class', function()
    local a = nn.SyncBatchNorm(4, { relu = true, eps = 1e-3 })
    assert.is_true(a.sync)
    assert.is_true(a.relu)
    assert.equals(1e-3, a.eps)
    assert.equals('SyncBatchNorm', a.__name)
    assert.truthy(tostring(a):find('SyncBatchNorm(4, relu, sync)', 1, true))
    local b = nn.BatchNorm2d(4, { sync = true })
    assert.is_true(b.sync)
    assert.is_false(nn.BatchNorm2d(4).sync)
    assert.has_error(function() nn.BatchNorm2d(4, { sync = true, group = 3 }) end)
  end)

  it('convert() switches every BatchNorm2d in place, keeping parameters, buffers, names and options', function()
    dlua.manual_seed(1)
    local m = resnet.resnet20({ in_channels = 1, num_classes = 10 })
    m:walk(function(_, mod) if mod.running_mean then mod.running_mean:uniform_(-1, 1) end end)
    m:flatten()
    local before, tensors, bns = {}, {}, {}
    local sd = m:state_dict()
    for _, k in ipairs(sd:keys()) do before[k] = sd[k]:clone(); tensors[k] = sd[k] end
    m:walk(function(name, mod)
      if mod.running_mean then bns[#bns + 1] = { name = name, m = mod, relu = mod.relu, w = mod.weight:clone() } end
    end)
    assert.is_true(#bns >= 7)
    local g = { size = function() return 2 end, is_member = function() return true end }  -- a stand-in group
    assert.equals(m, nn.SyncBatchNorm.convert(m, { group = g }))
    local after = m:state_dict()
    assert.same(sd:keys(), after:keys())
    for _, k in ipairs(after:keys()) do
      assert.equals(tensors[k], after[k])  -- the same tensors (views into the flat arena stay)
      assert.equals(0, max_diff(before[k], after[k]))
    end
    local seen = 0
    m:walk(function(name, mod)
      if mod.running_mean then
        seen = seen + 1
        local e = bns[seen]
        assert.equals(e.m, mod)  -- the same module object, under the same name
        assert.equals(e.name, name)
        assert.equals('SyncBatchNorm', mod.__name)
        assert.is_true(mod.sync)
        assert.equals(g, mod.process_group)
        assert.equals(e.relu, mod.relu)
      end
    end)
    assert.equals(#bns, seen)
    assert.equals(m:flatten().params.float32:numel(), m:num_parameters())
    assert.has_error(function() nn.SyncBatchNorm.convert(m, { groups = g }) end,
      "SyncBatchNorm.convert: unknown option 'groups' (expected group)")
    assert.has_error(function() nn.SyncBatchNorm.convert(42) end)
  end)

  it('keeps zero_init and the other options through convert()', function()
    local m = nn.Sequential(nn.BatchNorm2d(3, { zero_init = true, momentum = 0.3, eps = 1e-4 }), nn.ReLU())
    nn.SyncBatchNorm.convert(m)
    local bn = m:get(1)
    assert.equals(0, bn.weight:abs():sum():item())
    assert.equals(0.3, bn.momentum)
    assert.equals(1e-4, bn.eps)
    assert.is_true(bn.sync)
    assert.is_nil(bn.process_group)
  end)

  it('without dlua.dist initialised it is exactly BatchNorm2d (training and evaluation)', function()
    assert.is_false(dlua.dist.is_initialized())
    for _, dtype in ipairs({ 'float32', 'float64' }) do
      dlua.manual_seed(2)
      local x = dlua.randn({ 4, 3, 5, 5 }, { dtype = dtype })
      local skip = dlua.randn({ 4, 3, 5, 5 }, { dtype = dtype })
      local gy = dlua.randn({ 4, 3, 5, 5 }, { dtype = dtype })
      local a = nn.BatchNorm2d(3, { relu = true, dtype = dtype })
      local b = nn.SyncBatchNorm(3, { relu = true, dtype = dtype })
      a.weight:fill_(0.7); b.weight:fill_(0.7)
      for _ = 1, 2 do
        assert.equals(0, max_diff(a:forward(x, skip), b:forward(x, skip)))
        local ga, gsa = a:backward(x, gy)
        local gb, gsb = b:backward(x, gy)
        assert.equals(0, max_diff(ga, gb))
        assert.equals(0, max_diff(gsa, gsb))
      end
      assert.equals(0, max_diff(a.grad_weight, b.grad_weight))
      assert.equals(0, max_diff(a.grad_bias, b.grad_bias))
      assert.equals(0, max_diff(a.running_var, b.running_var))
      a:evaluate(); b:evaluate()
      assert.equals(0, max_diff(a:forward(x), b:forward(x)))
    end
  end)

  -- The halves summed over slices of a batch ("ranks") give the fused kernel's results on the whole batch.
  local function split_check(dtype, cl, relu, with_skip, parts)
    local N, C, H, W = 0, 3, 4, 3
    for _, p in ipairs(parts) do N = N + p end
    local lay = cl and channels_last or function(t) return t end
    local x = lay(dlua.randn({ N, C, H, W }, { dtype = dtype }) * 2 + 5)
    local skip = with_skip and lay(dlua.randn({ N, C, H, W }, { dtype = dtype })) or nil
    local dy = lay(dlua.randn({ N, C, H, W }, { dtype = dtype }))
    local g, b = dlua.rand({ C }, { dtype = dtype }) + 0.5, dlua.randn({ C }, { dtype = dtype })
    local rm, rv = dlua.zeros(C, { dtype = dtype }), dlua.ones(C, { dtype = dtype })
    local out, sm, si = K.batch_norm(x, g, b, skip, rm, rv, true, 0.1, 1e-5, relu, true)
    local gg, gb = dlua.zeros(C, { dtype = dtype }), dlua.zeros(C, { dtype = dtype })
    local gi, gs = K.batch_norm_backward(dy, x, relu and out or nil, g, nil, sm, si, gg, gb, true, relu, with_skip)

    local rows, start = {}, 1
    for i, p in ipairs(parts) do rows[i] = { start, p }; start = start + p end
    local function slice(t, i) return t:narrow(1, rows[i][1], rows[i][2]) end
    local stats = dlua.zeros(2 * C + 1, { dtype = 'float64' })
    for i = 1, #parts do stats:add_(K.batch_norm_stats(slice(x, i))) end
    assert.equals(N * H * W, stats[2 * C + 1])
    local rm2, rv2 = dlua.zeros(C, { dtype = dtype }), dlua.ones(C, { dtype = dtype })
    local outs, saves = {}, {}
    local gg2, gb2 = dlua.zeros(C, { dtype = dtype }), dlua.zeros(C, { dtype = dtype })
    local sums = dlua.zeros(2 * C + 1, { dtype = 'float64' })
    local tol = dtype == 'float64' and 1e-12 or 1e-5
    for i = 1, #parts do
      local rmi, rvi = rm:clone():zero_(), rv:clone():fill_(1)
      local o, m_, s_ = K.batch_norm_apply(slice(x, i), g, b, skip and slice(skip, i), stats, rmi, rvi, 0.1, 1e-5, relu)
      outs[i], saves[i] = o, { m_, s_ }
      if rows[i][2] > 0 then assert.is_true(max_diff(o, slice(out, i)) < tol * 10) end
      assert.is_true(max_diff(m_, sm) < tol)
      assert.is_true(max_diff(s_, si) < tol)
      if i == 1 then rm2, rv2 = rmi, rvi end
      sums:add_(K.batch_norm_backward_reduce(slice(dy, i), slice(x, i), relu and o or nil, nil, nil, m_, s_, gg2, gb2, relu))
    end
    assert.is_true(max_diff(rm2, rm) < tol)
    assert.is_true(max_diff(rv2, rv) < tol)
    assert.is_true(max_diff(gg2, gg) < tol * 10)  -- the sum over slices of the local grad_weight
    assert.is_true(max_diff(gb2, gb) < tol * 10)
    for i = 1, #parts do
      local a, s = K.batch_norm_backward_apply(slice(dy, i), slice(x, i), relu and outs[i] or nil, g, nil, saves[i][1],
        saves[i][2], sums, relu, with_skip)
      if rows[i][2] > 0 then
        assert.is_true(max_diff(a, slice(gi, i)) < tol * 10)
        if with_skip then assert.is_true(max_diff(s, slice(gs, i)) < tol) end
        assert.equals(cl, a:stride(2) == 1 and a:stride(1) ~= 1)  -- the layout follows the input's
      end
    end
  end

  it('splits into halves that, summed over slices, equal the fused kernels (both layouts, f32/f64)', function()
    dlua.manual_seed(4)
    for _, dtype in ipairs({ 'float64', 'float32' }) do
      for _, cl in ipairs({ false, true }) do
        split_check(dtype, cl, false, false, { 2, 3 })
        split_check(dtype, cl, true, true, { 1, 3, 2 })
      end
    end
  end)

  it('lets a slice be empty or a single sample', function()
    dlua.manual_seed(5)
    split_check('float64', false, true, true, { 0, 4 })
    split_check('float64', true, false, false, { 3, 1, 0 })
  end)

  it('keeps the mean accurate when it is far from zero (float64 sums)', function()
    local x = dlua.randn({ 8, 2, 6, 6 }, { dtype = 'float64' }) + 1e4
    local st = K.batch_norm_stats(x)
    local _, sm, si = K.batch_norm_apply(x, nil, nil, nil, st, nil, nil, 0.1, 0, false)
    local _, rsm, rsi = K.batch_norm(x, nil, nil, nil, nil, nil, true, 0.1, 0, false, true)
    assert.is_true(max_diff(sm, rsm) < 1e-9)
    assert.is_true(max_diff(si, rsi) / rsi:abs():max():item() < 1e-6)
  end)

  it('rejects bad sums with a clear error', function()
    local x = dlua.randn({ 2, 3, 2, 2 })
    assert.has_error(function() K.batch_norm_apply(x, nil, nil, nil, dlua.zeros(6, { dtype = 'float64' }), nil, nil, 0.1, 1e-5, false) end)
    local ok, err = pcall(K.batch_norm_apply, x, nil, nil, nil, dlua.zeros(7), nil, nil, 0.1, 1e-5, false)
    assert.is_false(ok)
    assert.matches('float64 tensor of shape %(7%)', err)
    local bad = dlua.zeros(7, { dtype = 'float64' })
    bad[7] = 1  -- one value per channel in training is an error, as in BatchNorm2d
    ok, err = pcall(K.batch_norm_apply, x, nil, nil, nil, bad, nil, nil, 0.1, 1e-5, false)
    assert.is_false(ok)
    assert.matches('more than 1 value per channel', err)
    local into = dlua.zeros(7, { dtype = 'float64' })
    assert.equals(into, K.batch_norm_stats(x, into))
    assert.equals(8, into[7])
  end)
end)
