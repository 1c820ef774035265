-- Batch-norm and pooling on a device against the CPU backend: every entry point (forward train/eval, fused
-- ReLU and residual add, running statistics, backward with grad_skip, SyncBatchNorm's stats/apply/
-- backward_reduce/backward_apply; max/avg/adaptive pooling forward and backward), all four float dtypes,
-- NCHW, channels-last and other layouts, odd and empty shapes; then mixed-device errors, determinism and a
-- timing line (GPU only). Run by tests/gpu/run.sh or alone:
--   dlua tests/gpu/ops_bn_pool.lua [device]     device: 'cuda' (default), 'cuda:N', or 'cpu'
-- With 'cpu' the same comparisons run CPU against CPU: that checks the script itself where no GPU is.
local dlua = require 'dlua'
local H = require 'tests.gpu.harness'
local K = require 'bindings.nn'
local dev, on_gpu, want_device = H.device(arg)
local t_start = os.clock()

dlua.manual_seed(4321)

local FLOATS = H.FLOATS
local is_float = H.is_float
local TOL = H.TOL
local shape_str, rel_error = H.shape_str, H.rel_error
local SUMS_TOL = 1e-9 -- SyncBatchNorm's float64 sums: the same terms added in another order

local results, failures, checks, both_failed, skipped = {}, {}, 0, {}, {}
local want_dev = want_device

local function fail(name, msg) failures[#failures + 1] = name .. ': ' .. msg end

local function layout(t)
  if t:dim() == 4 and t:numel() > 0 and t:is_contiguous('channels_last') and not t:is_contiguous() then return 'cl' end
  return t:is_contiguous() and 'contig' or 'strided'
end

-- One result: got (on the device) against ref (CPU). tol nil: per-dtype; 0: exact.
local function compare(name, ref, got, tol)
  checks = checks + 1
  tol = tol or TOL[ref.dtype] or 0
  local rec = { name = name, dtype = ref.dtype, shape = shape_str(ref), err = 0, tol = tol, ok = true }
  results[#results + 1] = rec
  if got.device ~= want_dev then
    rec.ok = false
    return fail(name, 'result on ' .. got.device .. ', expected ' .. want_dev)
  end
  if layout(ref) ~= layout(got) then
    rec.ok = false
    return fail(name, 'result layout ' .. layout(got) .. ', the CPU gives ' .. layout(ref))
  end
  got = got:cpu()
  if shape_str(got) ~= shape_str(ref) or got.dtype ~= ref.dtype then
    rec.ok = false
    return fail(name, string.format('got %s %s, expected %s %s', shape_str(got), got.dtype, shape_str(ref), ref.dtype))
  end
  local err
  if is_float[ref.dtype] then err = rel_error(ref, got)
  else err = ref:numel() == 0 and 0 or (ref:long():ne(got:long()):any():item() and math.huge or 0) end
  rec.err = err
  if not (err <= tol) then
    rec.ok = false
    fail(name, string.format('%s %s: error %.3g > tolerance %.3g', ref.dtype, shape_str(ref), err, tol))
  end
end

-- A copy of x on `device` with x's memory layout (to() and clone() give contiguous copies).
local function dup(x, device)
  local t = x:to(device)
  if rawequal(t, x) then t = x:clone() end
  local lay = layout(x)
  if lay == 'cl' then return t:contiguous('channels_last') end
  if lay == 'strided' and t:dim() == 4 then return t:transpose(3, 4):contiguous():transpose(3, 4) end
  return t
end

-- Runs fn on CPU inputs and on device copies (clones, so in-place updates stay apart); fn returns a table
-- {name = tensor or {tensor, tol}}. Both must succeed and agree, or both fail.
local function check(name, fn, ...)
  local n = select('#', ...)
  local cpu_in, dev_in = { ... }, {}
  for i = 1, n do
    local x = cpu_in[i]
    if dlua.is_tensor(x) then
      cpu_in[i] = dup(x, 'cpu')
      dev_in[i] = dup(x, dev)
    else
      dev_in[i] = x
    end
  end
  local ok1, r1 = pcall(fn, unpack(cpu_in, 1, n))
  local ok2, r2 = pcall(fn, unpack(dev_in, 1, n))
  if not H.both_ran(name, ok1, r1, ok2, r2, failures, both_failed) then
    checks = checks + 1
    return
  end
  local keys = {}
  for k in pairs(r1) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local a, b = r1[k], r2[k]
    local tol
    if type(a) == 'table' and a.dtype == nil then a, tol, b = a[1], a[2], b[1] end
    if (a == nil) ~= (b == nil) then
      checks = checks + 1
      fail(name .. ' ' .. k, 'one backend returned nothing')
    elseif a ~= nil then
      compare(name .. ' ' .. k, a, b, tol)
    end
  end
end

local function randt(dtype, sizes, scale, shift)
  local t = dlua.randn(sizes, { dtype = 'float32' }) * (scale or 1) + (shift or 0)
  return t:to(dtype)
end

local function with_layout(t, lay)
  if lay == 'cl' then return t:contiguous('channels_last') end
  if lay == 'strided' then return t:transpose(3, 4):contiguous():transpose(3, 4) end -- same values, (N, C, W, H) memory
  return t
end

------------------------------------------------------------------------------------------------
-- batch-norm

local BN_SHAPES = {
  { 2, 3, 7, 7 }, { 1, 5, 3, 3 }, { 4, 16, 5, 5 }, { 3, 13, 1, 1 }, { 2, 64, 11, 13 }, { 8, 64, 28, 28 },
  { 2, 2048, 7, 7 }, { 0, 5, 3, 3 }, { 7, 13 }, { 3, 8, 17 }, { 1, 3, 1, 1 },
}

local function tag_of(sizes, lay, dt) return string.format('%s %s %s', shape_str(dlua.empty(sizes)), lay, dt) end

for _, dt in ipairs(FLOATS) do
  local pdt = dt == 'bfloat16' and 'bfloat16' or 'float32' -- parameters: bf16 as after Module:to('bfloat16')
  for si, sizes in ipairs(BN_SHAPES) do
    local lays = #sizes == 4 and { 'contig', 'cl', 'strided' } or { 'contig' }
    if dt ~= 'float32' and dt ~= 'bfloat16' and si > 5 then lays = { 'contig' } end
    local C = sizes[2]
    for _, lay in ipairs(lays) do
      local tag = tag_of(sizes, lay, dt)
      local x = with_layout(randt(dt, sizes, 2, 0.5), lay)
      local skip = with_layout(randt(dt, sizes), lay)
      local gamma, beta = randt(pdt, { C }, 0.5, 1), randt(pdt, { C }, 0.3)
      local rm, rv = randt(pdt, { C }, 0.1), randt(pdt, { C }, 0.1, 1):abs()
      -- forward, training: output, saves, running statistics
      check('bn_fwd train ' .. tag, function(x_, g_, b_, rm_, rv_)
        local y, sm, si_ = K.batch_norm(x_, g_, b_, nil, rm_, rv_, true, 0.1, 1e-5, false, true)
        return { y = y, save_mean = sm, save_invstd = si_, running_mean = rm_, running_var = rv_ }
      end, x, gamma, beta, rm, rv)
      check('bn_fwd train relu skip ' .. tag, function(x_, s_, g_, b_)
        local y = K.batch_norm(x_, g_, b_, s_, nil, nil, true, 0.1, 1e-5, true, false)
        return { y = y }
      end, x, skip, gamma, beta)
      check('bn_fwd eval relu ' .. tag, function(x_, g_, b_, rm_, rv_)
        local y = K.batch_norm(x_, g_, b_, nil, rm_, rv_, false, 0.1, 1e-5, true, false)
        return { y = y }
      end, x, gamma, beta, rm, rv)
      check('bn_fwd noaffine ' .. tag, function(x_)
        local y, sm, si_ = K.batch_norm(x_, nil, nil, nil, nil, nil, true, 0.1, 1e-3, false, true)
        return { y = y, save_mean = sm, save_invstd = si_ }
      end, x)
      -- backward from the CPU's forward results, so both backends see the same ReLU mask
      local train_ok, y, sm, sinv = pcall(K.batch_norm, x, gamma, beta, skip, nil, nil, true, 0.1, 1e-5, true, true)
      if train_ok then
        local dy = with_layout(randt(dt, sizes), lay == 'cl' and 'contig' or lay)
        for _, train in ipairs({ true, false }) do
          check(string.format('bn_bwd %s relu skip %s', train and 'train' or 'eval', tag),
            function(dy_, x_, y_, g_, sm_, si_)
              local gg, gb = dlua.ones(C, { dtype = pdt, device = x_.device }), dlua.zeros(C, { dtype = pdt, device = x_.device })
              local gi, gs = K.batch_norm_backward(dy_, x_, y_, g_, nil, sm_, si_, gg, gb, train, true, true)
              return { grad_input = gi, grad_skip = gs, grad_gamma = gg, grad_beta = gb }
            end, dy, x, y, gamma, sm, sinv)
        end
        check('bn_bwd plain ' .. tag, function(dy_, x_, g_, sm_, si_)
          local gg = dlua.zeros(C, { dtype = 'float32', device = x_.device })
          local gi = K.batch_norm_backward(dy_, x_, nil, g_, nil, sm_, si_, gg, nil, true, false, false)
          return { grad_input = gi, grad_gamma = gg }
        end, dy, x, gamma, sm, sinv)
        -- SyncBatchNorm's halves, one rank: stats -> apply, backward_reduce -> backward_apply
        check('bn_stats ' .. tag, function(x_) return { sums = { K.batch_norm_stats(x_), SUMS_TOL } } end, x)
        local stats = K.batch_norm_stats(x)
        check('bn_apply relu skip ' .. tag, function(x_, s_, g_, b_, st_, rm_, rv_)
          local yy, m_, i_ = K.batch_norm_apply(x_, g_, b_, s_, st_, rm_, rv_, 0.1, 1e-5, true)
          return { y = yy, save_mean = m_, save_invstd = i_, running_mean = rm_, running_var = rv_ }
        end, x, skip, gamma, beta, stats, rm, rv)
        check('bn_bwd_reduce relu ' .. tag, function(dy_, x_, y_, sm_, si_)
          local gg, gb = dlua.zeros(C, { dtype = pdt, device = x_.device }), dlua.ones(C, { dtype = pdt, device = x_.device })
          local sums = K.batch_norm_backward_reduce(dy_, x_, y_, nil, nil, sm_, si_, gg, gb, true)
          return { sums = { sums, SUMS_TOL }, grad_gamma = gg, grad_beta = gb }
        end, dy, x, y, sm, sinv)
        local sums = K.batch_norm_backward_reduce(dy, x, y, nil, nil, sm, sinv, nil, nil, true)
        check('bn_bwd_apply relu skip ' .. tag, function(dy_, x_, y_, g_, sm_, si_, su_)
          local gi, gs = K.batch_norm_backward_apply(dy_, x_, y_, g_, nil, sm_, si_, su_, true, true)
          return { grad_input = gi, grad_skip = gs }
        end, dy, x, y, gamma, sm, sinv, sums)
      else
        both_failed[#both_failed + 1] = 'bn backward ' .. tag .. ' (no training forward): ' .. tostring(y):gsub('\n.*', '')
      end
    end
  end
end

-- Mixed dtypes (an f32 skip on bf16 activations, an f32 gradient): the CPU's compute dtype throughout.
do
  local x, s = randt('bfloat16', { 2, 8, 5, 5 }):contiguous('channels_last'), randt('float32', { 2, 8, 5, 5 })
  check('bn_fwd mixed skip', function(x_, s_)
    return { y = K.batch_norm(x_, nil, nil, s_, nil, nil, true, 0.1, 1e-5, true, false) }
  end, x, s)
  local y, sm, si = K.batch_norm(x, nil, nil, nil, nil, nil, true, 0.1, 1e-5, false, true)
  check('bn_bwd mixed grad', function(dy_, x_, sm_, si_)
    return { grad_input = K.batch_norm_backward(dy_, x_, nil, nil, nil, sm_, si_, nil, nil, true, false, false) }
  end, randt('float32', { 2, 8, 5, 5 }), x, sm, si)
end

------------------------------------------------------------------------------------------------
-- pooling

local POOL_SHAPES = { { 2, 3, 7, 7 }, { 1, 5, 13, 11 }, { 3, 16, 8, 8 }, { 2, 64, 14, 14 }, { 0, 3, 7, 7 } }
local MAXC = { -- kh, kw, sh, sw, ph, pw, dh, dw, ceil_mode
  { 3, 3, 2, 2, 1, 1, 1, 1, false }, { 2, 2, 2, 2, 0, 0, 1, 1, false }, { 3, 3, 2, 2, 1, 1, 1, 1, true },
  { 3, 2, 1, 2, 1, 0, 2, 1, false }, { 5, 5, 3, 3, 2, 2, 1, 1, true },
}
local AVGC = { -- kh, kw, sh, sw, ph, pw, ceil_mode, count_include_pad, divisor_override
  { 3, 3, 2, 2, 1, 1, false, true, 0 }, { 3, 3, 2, 2, 1, 1, true, false, 0 }, { 2, 2, 2, 2, 0, 0, false, true, 0 },
  { 3, 3, 1, 1, 1, 1, false, true, 5 }, { 4, 3, 3, 2, 2, 1, true, true, 0 },
}
local ADAPT = { { 1, 1 }, { 3, 2 }, { 5, 7 } }

for _, dt in ipairs(FLOATS) do
  for _, sizes in ipairs(POOL_SHAPES) do
    for _, lay in ipairs({ 'contig', 'cl', 'strided' }) do
      local tag = tag_of(sizes, lay, dt)
      local x = with_layout(randt(dt, sizes, 3), lay)
      for ci, c in ipairs(MAXC) do
        local ok, y, ind = pcall(K.max_pool2d, x, c, true)
        check('max_pool_fwd ' .. ci .. ' ' .. tag, function(x_)
          local yy, ii = K.max_pool2d(x_, c, true)
          return { y = { yy, 0 }, indices = ii }
        end, x)
        if ok then
          local dy = randt(dt, y:size())
          check('max_pool_bwd ' .. ci .. ' ' .. tag, function(dy_, i_, x_)
            return { grad_input = K.max_pool2d_backward(dy_, i_, x_) }
          end, dy, ind, x)
        end
      end
      for ci, c in ipairs(AVGC) do
        check('avg_pool_fwd ' .. ci .. ' ' .. tag, function(x_) return { y = K.avg_pool2d(x_, c) } end, x)
        local ok, y = pcall(K.avg_pool2d, x, c)
        if ok then
          check('avg_pool_bwd ' .. ci .. ' ' .. tag, function(dy_, x_)
            return { grad_input = K.avg_pool2d_backward(dy_, x_, c) }
          end, randt(dt, y:size()), x)
        end
      end
      for ci, o in ipairs(ADAPT) do
        check('adaptive_fwd ' .. ci .. ' ' .. tag, function(x_) return { y = K.adaptive_avg_pool2d(x_, o[1], o[2]) } end, x)
        local ok, y = pcall(K.adaptive_avg_pool2d, x, o[1], o[2])
        if ok then
          check('adaptive_bwd ' .. ci .. ' ' .. tag, function(dy_, x_)
            return { grad_input = K.adaptive_avg_pool2d_backward(dy_, x_) }
          end, randt(dt, y:size()), x)
        end
      end
    end
  end
end

-- NaN and -Inf rules of max pooling (the last NaN wins; an all -Inf window reports its first position).
for _, dt in ipairs(FLOATS) do
  local v = {}
  for i = 1, 2 * 36 do v[i] = (i % 7) - 3 end
  v[5], v[9], v[20] = 0 / 0, 0 / 0, -1 / 0
  for i = 37, 45 do v[i] = -1 / 0 end
  local x = dlua.tensor(v):view(1, 2, 6, 6):to(dt)
  check('max_pool_fwd specials ' .. dt, function(x_)
    local y, i = K.max_pool2d(x_, { 3, 3, 2, 2, 1, 1, 1, 1, true }, true)
    return { y = { y, 0 }, indices = i }
  end, x)
end

-- A position outside its plane is reported by both backends.
check('max_pool_bwd bad index', function(dy_, i_, x_)
  return { grad_input = K.max_pool2d_backward(dy_, i_, x_) }
end, dlua.ones(1, 1, 2, 2), dlua.tensor({ 0, 1, 2, 99 }, { dtype = 'int64' }):view(1, 1, 2, 2), dlua.zeros(1, 1, 4, 4))

------------------------------------------------------------------------------------------------
-- nn modules on the device (parameters and buffers moved field by field)

do
  local nn = dlua.nn
  local function move(m)
    for _, f in ipairs(m._params) do
      m[f] = m[f]:to(dev)
      m['grad_' .. f] = m['grad_' .. f]:to(dev)
    end
    for _, f in ipairs(m._buffers) do m[f] = m[f]:to(dev) end
    return m
  end
  local x = randt('float32', { 4, 8, 9, 9 }):contiguous('channels_last')
  local mods = {
    { 'BatchNorm2d', function() return nn.BatchNorm2d(8, { relu = true }) end },
    { 'MaxPool2d', function() return nn.MaxPool2d(3, { stride = 2, padding = 1 }) end },
    { 'AvgPool2d', function() return nn.AvgPool2d(3, { stride = 2, padding = 1, ceil_mode = true }) end },
    { 'AdaptiveAvgPool2d', function() return nn.AdaptiveAvgPool2d(1) end },
    { 'ReLU', function() return nn.ReLU() end },
  }
  for _, e in ipairs(mods) do
    local ok, err = pcall(check, 'module ' .. e[1], function(x_)
      local m = e[2]()
      if x_.device ~= 'cpu' then move(m) end
      local y = m:forward(x_)
      local g = m:backward(x_, (y * 0.5 + 0.25):contiguous())
      local r = { y = y, grad_input = g }
      if m.running_mean then r.running_mean, r.grad_weight = m.running_mean, m.grad_weight end
      return r
    end, x)
    if not ok then fail('module ' .. e[1], tostring(err)) end
  end
  -- ReLU's kernels live elsewhere (host/cpu/loss.c): if they are not on CUDA yet, list that instead of failing.
  for i = #failures, 1, -1 do
    if failures[i]:find('^module ReLU') and failures[i]:find('not implemented on cuda') then
      skipped[#skipped + 1] = table.remove(failures, i)
    end
  end
end

------------------------------------------------------------------------------------------------
-- errors, determinism, timing (GPU only)

local notes = {}
if on_gpu then
  local function expect_mixed(name, fn)
    checks = checks + 1
    local ok, e = pcall(fn)
    e = tostring(e)
    if ok or not e:find('cpu') or not e:find('cuda') or not e:find('one device') then
      fail(name, 'expected an error naming both devices, got ' .. (ok and 'success' or e))
    end
  end
  local x, g = randt('float32', { 2, 4, 5, 5 }):to(dev), dlua.ones(4)
  expect_mixed('mixed bn gamma', function() return K.batch_norm(x, g, nil, nil, nil, nil, true, 0.1, 1e-5, false, true) end)
  expect_mixed('mixed bn skip', function()
    return K.batch_norm(x, nil, nil, dlua.zeros(2, 4, 5, 5), nil, nil, true, 0.1, 1e-5, false, true)
  end)
  local y, sm, si = K.batch_norm(x, nil, nil, nil, nil, nil, true, 0.1, 1e-5, false, true)
  expect_mixed('mixed bn backward', function()
    return K.batch_norm_backward(dlua.ones(2, 4, 5, 5), x, nil, nil, nil, sm, si, nil, nil, true, false, false)
  end)
  expect_mixed('mixed bn apply stats', function()
    return K.batch_norm_apply(x, nil, nil, nil, K.batch_norm_stats(x:cpu()), nil, nil, 0.1, 1e-5, false)
  end)
  local py, pi = K.max_pool2d(x, { 2, 2, 2, 2, 0, 0, 1, 1, false }, true)
  expect_mixed('mixed max_pool indices', function() return K.max_pool2d_backward(py, pi:cpu(), x) end)
  checks = checks + 1
  local okr, er = pcall(K.batch_norm, x, nil, nil, nil, dlua.zeros(4), dlua.ones(4), false, 0.1, 1e-5, false, false)
  if okr or not tostring(er):find('one device') then fail('mixed bn running', 'expected a mixed-device error, got ' .. tostring(er)) end

  -- Determinism: the same statistics twice give the same bits.
  local big = randt('float32', { 32, 64, 33, 33 }):to(dev):contiguous('channels_last')
  local _, m1, i1 = K.batch_norm(big, nil, nil, nil, nil, nil, true, 0.1, 1e-5, false, true)
  local _, m2, i2 = K.batch_norm(big, nil, nil, nil, nil, nil, true, 0.1, 1e-5, false, true)
  checks = checks + 1
  if m1:cpu():ne(m2:cpu()):any():item() or i1:cpu():ne(i2:cpu()):any():item() then
    fail('bn determinism', 'two runs differ')
  end

  if H.timed(notes) then
    -- Timing: ResNet-50's widest batch-norm, bf16 channels-last, training forward + backward with ReLU.
    local cuda = dlua.cuda
    local N, C, H = 128, 256, 56
    local xb = dlua.randn(N, C, H, H):to { device = dev, dtype = 'bfloat16' }:contiguous('channels_last')
    local dyb = (xb * 0.5):contiguous('channels_last')
    local gm, bt = dlua.ones(C, { device = dev }), dlua.zeros(C, { device = dev })
    local rmb, rvb = dlua.zeros(C, { device = dev }), dlua.ones(C, { device = dev })
    local ggb, gbb = dlua.zeros(C, { device = dev }), dlua.zeros(C, { device = dev })
    local function step()
      local yb, smb, sib = K.batch_norm(xb, gm, bt, nil, rmb, rvb, true, 0.1, 1e-5, true, true)
      local gi = K.batch_norm_backward(dyb, xb, yb, gm, nil, smb, sib, ggb, gbb, true, true, false)
      yb:free(); gi:free()
    end
    step()
    cuda.synchronize()
    local e0, e1 = cuda.Event { enable_timing = true }, cuda.Event { enable_timing = true }
    local reps = 20
    e0:record()
    for _ = 1, reps do step() end
    e1:record()
    e1:synchronize()
    local ms = e0:elapsed_time(e1) / reps
    -- bytes moved: forward reads x twice and writes y; backward reads x, dy, y twice and writes dx
    local bytes = 10 * N * C * H * H * 2
    notes[#notes + 1] = string.format('BN fwd+bwd %dx%dx%dx%d bf16 NHWC relu: %.3f ms  %.0f GB/s', N, C, H, H, ms, bytes / ms / 1e6)
    local xp = dlua.randn(N, 64, 112, 112):to { device = dev, dtype = 'bfloat16' }:contiguous('channels_last')
    local mc = { 3, 3, 2, 2, 1, 1, 1, 1, false }
    local function pstep()
      local yp, ip = K.max_pool2d(xp, mc, true)
      K.max_pool2d_backward(yp, ip, xp):free()
      yp:free(); ip:free()
    end
    pstep()
    e0:record()
    for _ = 1, 10 do pstep() end
    e1:record()
    e1:synchronize()
    notes[#notes + 1] = string.format('max_pool 3x3/2 fwd+bwd %dx64x112x112 bf16 NHWC: %.3f ms', N, e0:elapsed_time(e1) / 10)
  end
end

------------------------------------------------------------------------------------------------
-- report

H.report({ title = 'device ' .. dev, checks = checks, results = results, failures = failures, both_failed = both_failed, notes = notes, skipped = skipped, t_start = t_start })
