-- 2-D convolution on CUDA (cuDNN) against the CPU backend: forward, backward-data, backward-weights and bias, NCHW
-- and channels-last (with OIHW or OHWI weights), float32/float64/float16/bfloat16, odd sizes, stride, padding,
-- dilation, groups (depthwise too), 1x1 and 7x7/2, empty batches, views, accumulation, nn.Conv2d, mixed-device
-- errors; then (GPU only) a ResNet-50-like timing line. Run by tests/gpu/run.sh:
--   dlua tests/gpu/ops_conv.lua [device]        device: 'cuda' (default), 'cuda:N', or 'cpu'
-- With 'cpu' the same comparisons run CPU against CPU: that checks the script itself where no GPU is.
-- float16/bfloat16 results are compared with the CPU's float32 convolution of the same rounded inputs.
local dlua = require 'dlua'
local H = require 'tests.gpu.harness'
local nnb = require 'bindings.nn'
local core = require 'bindings.tensor_core'
local dev, on_gpu, want_device = H.device(arg)
local t_start = os.clock()

dlua.manual_seed(4321)

local FLOATS = H.FLOATS
local shape_str = H.shape_str
local HALF = { float16 = true, bfloat16 = true }
-- Error = max |ref - got| / max |ref| (the tensor's scale: cuDNN's FFT and Winograd algorithms err relative to it,
-- not per element). Allowed: floor + per_term * sqrt(reduction length). The floor is the output's rounding (16-bit
-- results are rounded once from float32 math); the sqrt term covers summation order and transform algorithms.
local FLOOR = { float64 = 1e-13, float32 = 1e-6, float16 = 1.5e-3, bfloat16 = 1e-2 }
local PER_TERM = { float64 = 1e-14, float32 = 5e-6, float16 = 2e-4, bfloat16 = 1.5e-3 }

local results, failures, checks, both_failed, notes = {}, {}, 0, {}, {}

local function fail(name, msg) failures[#failures + 1] = name .. ': ' .. msg end

local function tolerance(dt, k) return FLOOR[dt] + PER_TERM[dt] * math.sqrt(math.max(k, 1)) end

-- ref (CPU, float32 for 16-bit cases) against got (on the device, in dt); k: the reduction length.
local function compare(name, dt, ref, got, k)
  checks = checks + 1
  local tol = tolerance(dt, k)
  local rec = { name = name, dtype = dt, shape = shape_str(ref), err = 0, tol = tol, ok = true }
  results[#results + 1] = rec
  if got.device ~= want_device then
    rec.ok = false
    fail(name, 'result on ' .. got.device .. ', expected ' .. want_device)
    return
  end
  got = got:cpu()
  if shape_str(got) ~= shape_str(ref) then
    rec.ok = false
    fail(name, string.format('got %s, expected %s', shape_str(got), shape_str(ref)))
    return
  end
  if ref:numel() == 0 then return end
  local r, g = ref:double(), got:double()
  local scale = r:abs():max():item()
  local err = (r - g):abs():max():item() / (scale > 0 and scale or 1)
  rec.err = err
  if not (err <= tol) then  -- NaN fails too
    rec.ok = false
    fail(name, string.format('%s %s: error %.3g > tolerance %.3g', dt, shape_str(ref), err, tol))
  end
end

local function expect(name, cond, msg)
  checks = checks + 1
  if not cond then fail(name, msg) end
end

local function rand(dt, sizes) return dlua.randn(sizes, { dtype = 'float32' }):to(dt) end

-- t moved to the device in a layout: 'nchw' (contiguous), 'nhwc' (channels-last), 'offset' (contiguous, one
-- element past an aligned start: cuDNN must not get it as is), 'strided' (a channel slice: neither format).
local function place(t, layout, where)
  local u = t:to(where)
  if layout == 'nhwc' then return u:contiguous('channels_last') end
  if layout == 'offset' then
    local s = t:size()
    local flat = dlua.empty(t:numel() + 1, { dtype = t.dtype, device = where })
    local v = flat:narrow(1, 2, t:numel()):view(s[1], s[2], s[3], s[4])
    v:copy_(u)
    return v
  end
  if layout == 'strided' then
    local s = t:size()
    local wide = dlua.zeros(s[1], s[2] + 3, s[3], s[4], { dtype = t.dtype, device = where })
    local v = wide:narrow(2, 2, s[2])
    v:copy_(u)
    return v
  end
  return u:contiguous()
end

local function out_size(i, k, s, p, d) return math.max(0, math.floor((i + 2 * p - d * (k - 1) - 1) / s) + 1) end

-- C's dlua_conv2d_backward_weights with accumulate 0 or 1 (the binding always accumulates).
local function backward_weights(gw, gb, x, gy, c, acc)
  local op = 'conv2d_backward_weights'
  local st = core.C.dlua_conv2d_backward_weights(core.handle(op, gw), gb and core.handle(op, gb) or nil,
    core.handle(op, x), core.handle(op, gy), c[1], c[2], c[3], c[4], c[5], c[6], c[7], acc)
  if st ~= 0 then core.check(st, op) end
end

------------------------------------------------------------------------------------------------
-- the comparisons

-- n, c, h, w; o, kh, kw; stride, padding, dilation (pairs or numbers); groups; bias
local GEOMS = {
  { 'basic 3x3', 2, 3, 11, 13, 5, 3, 3, 1, 1, 1, 1, true },
  { 'stride 2', 3, 4, 9, 7, 6, 3, 3, 2, 0, 1, 1, false },
  { 'dilation 2', 2, 5, 12, 10, 4, 3, 3, 1, 2, 2, 1, true },
  { 'groups 2', 2, 6, 8, 9, 4, 3, 3, 1, 1, 1, 2, true },
  { 'depthwise', 2, 8, 10, 10, 8, 3, 3, 1, 1, 1, 8, false },
  { 'depthwise x2 stride 2', 3, 4, 11, 9, 8, 5, 5, 2, 2, 1, 4, true },
  { '1x1', 4, 16, 7, 7, 32, 1, 1, 1, 0, 1, 1, false },
  { '1x1 stride 2', 2, 8, 9, 9, 16, 1, 1, 2, 0, 1, 1, true },
  { '7x7 stride 2', 2, 3, 32, 29, 16, 7, 7, 2, 3, 1, 1, false },
  { '1x5 stride (2,1)', 2, 3, 8, 11, 4, 1, 5, { 2, 1 }, { 0, 2 }, 1, 1, true },
  { '16ch 3x3', 8, 16, 14, 14, 32, 3, 3, 1, 1, 1, 1, false },
  { 'one channel', 2, 1, 9, 9, 4, 3, 3, 1, 0, 1, 1, true },
  { 'one output channel', 2, 4, 6, 5, 1, 3, 3, 1, 1, 1, 1, true },
  { '1x1 image', 5, 8, 1, 1, 6, 1, 1, 1, 0, 1, 1, true },
  { 'kernel = image', 3, 4, 5, 5, 7, 5, 5, 1, 0, 1, 1, true },
  { 'empty batch', 0, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1, true },
  { 'empty image, padded', 2, 3, 0, 4, 2, 1, 1, 1, 1, 1, 1, true },
}

local function pair(v) if type(v) == 'table' then return v[1], v[2] end return v, v end

local LAYOUTS = {
  { name = 'nchw', x = 'nchw', w = 'nchw' },
  { name = 'nhwc', x = 'nhwc', w = 'nchw' },     -- channels-last activations, OIHW weights (dlua's nn)
  { name = 'nhwc/ohwi', x = 'nhwc', w = 'nhwc' }, -- weights channels-last too (PyTorch's channels_last model)
}

local function run_case(G, lay, dt)
  local label, n, cin, h, w, o, kh, kw = G[1], G[2], G[3], G[4], G[5], G[6], G[7], G[8]
  local sh, sw = pair(G[9])
  local ph, pw = pair(G[10])
  local dh, dw = pair(G[11])
  local groups, has_bias = G[12], G[13]
  local c = { sh, sw, ph, pw, dh, dw, groups }
  local oh, ow = out_size(h, kh, sh, ph, dh), out_size(w, kw, sw, pw, dw)
  local tag = string.format('%s %s %s', label, lay.name, dt)
  local rdt = HALF[dt] and 'float32' or dt

  local x, wt = rand(dt, { n, cin, h, w }), rand(dt, { o, cin / groups, kh, kw })
  local b = has_bias and rand(dt, { o }) or nil
  local gy = rand(dt, { n, o, oh, ow })
  local gw0, gb0 = rand(dt, { o, cin / groups, kh, kw }), has_bias and rand(dt, { o }) or nil

  -- The reference: the CPU in rdt on the same (rounded) values.
  local rx, rw, rgy = place(x:to(rdt), lay.x, 'cpu'), place(wt:to(rdt), lay.w, 'cpu'), place(gy:to(rdt), lay.x, 'cpu')
  local ry = nnb.conv2d(rx, rw, b and b:to(rdt), c)
  local rgx = nnb.conv2d_backward_data(rgy, rw, rx, c)
  -- (clones: to() may return the tensor itself, and these are written in place)
  local rgw, rgb = gw0:to(rdt):clone(), gb0 and gb0:to(rdt):clone()
  nnb.conv2d_backward_weights(rgw, rgb, rx, rgy, c)  -- accumulates
  local rgw0 = gw0:to(rdt):clone()
  backward_weights(rgw0, nil, rx, rgy, c, 0)          -- overwrites

  -- The device, in dt.
  local dx, dwt, dgy = place(x, lay.x, dev), place(wt, lay.w, dev), place(gy, lay.x, dev)
  local db = b and b:to(dev)
  local ok, err = pcall(function()
    local y = nnb.conv2d(dx, dwt, db, c)
    compare('forward ' .. tag, dt, ry, y, (cin / groups) * kh * kw)
    -- (an empty input has no format: the output is then contiguous, as on the CPU)
    if lay.x == 'nhwc' and y:numel() > 0 and x:numel() > 0 then
      expect('forward layout ' .. tag, y:is_contiguous('channels_last'), 'output not channels-last like its input')
    elseif y:numel() > 0 then
      expect('forward layout ' .. tag, y:is_contiguous(), 'output not contiguous like its input')
    end
    expect('forward dtype ' .. tag, y.dtype == dt, 'output dtype ' .. y.dtype)

    local gx = nnb.conv2d_backward_data(dgy, dwt, dx, c)
    compare('backward_data ' .. tag, dt, rgx, gx, (o / groups) * kh * kw)
    if lay.x == 'nhwc' and gx:numel() > 0 and gy:numel() > 0 then
      expect('backward_data layout ' .. tag, gx:is_contiguous('channels_last'), 'grad_input not channels-last')
    end

    local gw, gb = gw0:to(dev):clone(), gb0 and gb0:to(dev):clone()
    if lay.w == 'nhwc' then gw = gw:contiguous('channels_last') end
    nnb.conv2d_backward_weights(gw, gb, dx, dgy, c)
    compare('backward_weights ' .. tag, dt, rgw, gw, n * oh * ow)
    if gb then compare('backward_bias ' .. tag, dt, rgb, gb, n * oh * ow) end
    local gwz = gw0:to(dev):clone()
    backward_weights(gwz, nil, dx, dgy, c, 0)
    compare('backward_weights overwrite ' .. tag, dt, rgw0, gwz, n * oh * ow)
  end)
  if not ok then
    checks = checks + 1
    fail(tag, 'device failed: ' .. tostring(err))
  end
end

for _, dt in ipairs(FLOATS) do
  for _, G in ipairs(GEOMS) do
    for _, lay in ipairs(LAYOUTS) do run_case(G, lay, dt) end
  end
  -- Inputs in neither format, or misaligned: copied before cuDNN sees them.
  run_case(GEOMS[1], { name = 'offset', x = 'offset', w = 'offset' }, dt)
  run_case(GEOMS[4], { name = 'strided', x = 'strided', w = 'nchw' }, dt)
end

-- A float32 gradient arena behind 16-bit activations: grad_weight/grad_bias in float32, accumulated.
for _, dt in ipairs({ 'bfloat16', 'float16' }) do
  local x, wt, gy = rand(dt, { 4, 8, 9, 9 }), rand(dt, { 12, 8, 3, 3 }), rand(dt, { 4, 12, 9, 9 })
  local c = { 1, 1, 1, 1, 1, 1, 1 }
  local gw0, gb0 = rand('float32', { 12, 8, 3, 3 }), rand('float32', { 12 })
  local rgw, rgb = gw0:clone(), gb0:clone()
  local xf, gyf = x:float():contiguous('channels_last'), gy:float():contiguous('channels_last')
  nnb.conv2d_backward_weights(rgw, rgb, xf, gyf, c)
  local ok, err = pcall(function()
    local gw, gb = gw0:to(dev):clone(), gb0:to(dev):clone()
    nnb.conv2d_backward_weights(gw, gb, place(x, 'nhwc', dev), place(gy, 'nhwc', dev), c)
    expect('f32 arena dtype ' .. dt, gw.dtype == 'float32' and gb.dtype == 'float32', 'gradient dtype changed')
    compare('backward_weights f32 arena ' .. dt, dt, rgw, gw, 4 * 81)
    compare('backward_bias f32 arena ' .. dt, dt, rgb, gb, 4 * 81)
  end)
  if not ok then checks = checks + 1; fail('f32 arena ' .. dt, 'device failed: ' .. tostring(err)) end
end

-- nn.Conv2d forward/backward with its parameters on the device (channels-last input, float32).
do
  local m = dlua.nn.Conv2d(6, 10, 3, { stride = 2, padding = 1 })
  local md = dlua.nn.Conv2d(6, 10, 3, { stride = 2, padding = 1 })
  for _, f in ipairs({ 'weight', 'bias' }) do
    md[f] = m[f]:to(dev):clone()
    md['grad_' .. f] = m['grad_' .. f]:to(dev):clone()
  end
  local x, g = rand('float32', { 3, 6, 15, 15 }):contiguous('channels_last'), rand('float32', { 3, 10, 8, 8 })
  local ok, err = pcall(function()
    local y, yd = m:forward(x), md:forward(place(x, 'nhwc', dev))
    compare('nn.Conv2d forward', 'float32', y, yd, 54)
    local gx = m:backward(x, g:contiguous('channels_last'))
    local gxd = md:backward(place(x, 'nhwc', dev), place(g, 'nhwc', dev))
    compare('nn.Conv2d grad_input', 'float32', gx, gxd, 90)
    compare('nn.Conv2d grad_weight', 'float32', m.grad_weight, md.grad_weight, 3 * 64)
    compare('nn.Conv2d grad_bias', 'float32', m.grad_bias, md.grad_bias, 3 * 64)
  end)
  if not ok then checks = checks + 1; fail('nn.Conv2d', 'device failed: ' .. tostring(err)) end
end

-- Invalid arguments: both backends must reject them (listed below with the CPU's message).
do
  local bad = {
    { 'channels mismatch', { 2, 4, 8, 8 }, { 5, 3, 3, 3 }, { 1, 1, 0, 0, 1, 1, 1 } },
    { 'kernel larger than padded input', { 2, 3, 4, 4 }, { 5, 3, 7, 7 }, { 1, 1, 1, 1, 1, 1, 1 } },
    { 'groups not dividing', { 2, 6, 8, 8 }, { 5, 2, 3, 3 }, { 1, 1, 0, 0, 1, 1, 3 } },
    { 'zero stride', { 2, 3, 8, 8 }, { 5, 3, 3, 3 }, { 0, 1, 0, 0, 1, 1, 1 } },
  }
  for _, B in ipairs(bad) do
    local x, wt = rand('float32', B[2]), rand('float32', B[3])
    local ok1, e1 = pcall(nnb.conv2d, x, wt, nil, B[4])
    local ok2, e2 = pcall(nnb.conv2d, x:to(dev), wt:to(dev), nil, B[4])
    checks = checks + 1
    if ok1 or ok2 then
      fail('rejects ' .. B[1], string.format('CPU %s, device %s', ok1 and 'accepted' or 'rejected',
        ok2 and 'accepted' or 'rejected'))
    else
      both_failed[#both_failed + 1] = B[1] .. ': ' .. tostring(e1):gsub('\n.*', '')
      if on_gpu and tostring(e2):gsub('cuda:%d', 'cpu') ~= tostring(e1) then
        notes[#notes + 1] = 'device message differs: ' .. tostring(e2):gsub('\n.*', '')
      end
    end
  end
end

------------------------------------------------------------------------------------------------
-- errors that need a device, and the timing line (GPU only)

if on_gpu then
  local x, wt, b = rand('float32', { 2, 3, 8, 8 }), rand('float32', { 4, 3, 3, 3 }), rand('float32', { 4 })
  local gy = rand('float32', { 2, 4, 6, 6 })
  local c = { 1, 1, 0, 0, 1, 1, 1 }
  local function mixed(name, fn)
    local ok, e = pcall(fn)
    expect('mixed devices ' .. name, not ok and tostring(e):find('cpu') and tostring(e):find('cuda'),
      'expected an error naming both devices, got ' .. tostring(e))
  end
  mixed('forward input', function() return nnb.conv2d(x, wt:to(dev), nil, c) end)
  mixed('forward weight', function() return nnb.conv2d(x:to(dev), wt, nil, c) end)
  mixed('forward bias', function() return nnb.conv2d(x:to(dev), wt:to(dev), b, c) end)
  mixed('backward_data', function() return nnb.conv2d_backward_data(gy:to(dev), wt, x, c) end)
  mixed('backward_weights', function() nnb.conv2d_backward_weights(wt:clone(), nil, x:to(dev), gy:to(dev), c) end)
  mixed('backward_bias', function() nnb.conv2d_backward_weights(wt:to(dev), b, x:to(dev), gy:to(dev), c) end)

  -- TF32 on request: looser, but still a convolution of the same values.
  local cuda = dlua.cuda
  cuda.set_allow_tf32(true)
  local ok, err = pcall(function()
    local xx, ww = rand('float32', { 8, 32, 14, 14 }), rand('float32', { 64, 32, 3, 3 })
    local cc = { 1, 1, 1, 1, 1, 1, 1 }
    local ref = nnb.conv2d(xx, ww, nil, cc)
    local got = nnb.conv2d(place(xx, 'nhwc', dev), place(ww, 'nchw', dev), nil, cc)
    checks = checks + 1
    local r = ref:double()
    local e = (r - got:cpu():double()):abs():max():item() / r:abs():max():item()
    results[#results + 1] = { name = 'forward tf32', err = e, tol = 5e-3, ok = e <= 5e-3 }
    if not (e <= 5e-3) then fail('forward tf32', string.format('error %.3g > 5e-3', e)) end
  end)
  cuda.set_allow_tf32(false)
  if not ok then checks = checks + 1; fail('forward tf32', 'device failed: ' .. tostring(err)) end

  if H.timed(notes) then
    -- ResNet-50's 3x3 convolution of stage 3 (256 -> 256 at 14x14), batch 128, bfloat16 channels-last.
    local time_ms = H.time_ms
    ok, err = pcall(function()
      local N, C, H = 128, 256, 14
      local cc = { 1, 1, 1, 1, 1, 1, 1 }
      local xx = dlua.randn(N, C, H, H):to { device = dev, dtype = 'bfloat16' }:contiguous('channels_last')
      local gg = dlua.randn(N, C, H, H):to { device = dev, dtype = 'bfloat16' }:contiguous('channels_last')
      for _, wl in ipairs({ 'nchw', 'nhwc' }) do
        local ww = place(dlua.randn(C, C, 3, 3):to('bfloat16'), wl, dev)
        local gw = ww:clone()
        local f = time_ms(function() nnb.conv2d(xx, ww, nil, cc):free() end, 20)
        local bd = time_ms(function() nnb.conv2d_backward_data(gg, ww, xx, cc):free() end, 20)
        local bw = time_ms(function() nnb.conv2d_backward_weights(gw, nil, xx, gg, cc) end, 20)
        local flop = 2 * N * C * H * H * C * 9
        notes[#notes + 1] = string.format('conv 3x3 256->256 14x14 N=128 bf16 NHWC, %s weights: fwd %.3f ms, '
          .. 'bwd-data %.3f ms, bwd-weights %.3f ms, fwd+bwd %.3f ms (%.0f TFLOP/s)', wl == 'nchw' and 'OIHW' or 'OHWI', f, bd, bw,
          f + bd + bw, 3 * flop / (f + bd + bw) / 1e9)
      end
    end)
    if not ok then checks = checks + 1; fail('timing', 'device failed: ' .. tostring(err)) end
  end
else
  notes[#notes + 1] = 'mixed-device errors, TF32 and timing: skipped (no device; run with cuda)'
end

------------------------------------------------------------------------------------------------
-- report

H.report({ title = 'conv on ' .. dev, checks = checks, results = results, failures = failures, both_failed = both_failed, notes = notes, by_dtype = true, t_start = t_start })
