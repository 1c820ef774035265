-- What only a real GPU can tell (tests/gpu/run.sh, after tests/backend/run.lua cuda): TF32 convolution accuracy, and timings of GEMM, bandwidth, convolution, batch-norm, pooling, sort and indexing.
--   dlua tests/gpu/timings.lua [device]      device: 'cuda' (default) or 'cuda:N'
-- On the emulator or without a GPU it says so and exits 0.
local dlua = require 'dlua'
local K = require 'bindings.nn'
local dev = arg[1] or 'cuda'
if not dlua.cuda.is_available() or dlua.cuda.is_emulated() then
  print('timings: skipped (' .. (dlua.cuda.is_available() and 'the CUDA device is the CPU emulator' or 'no CUDA device available') .. ')')
  os.exit(0)
end
local cuda = dlua.cuda
local failures = 0

-- Milliseconds per call of fn on the current stream (one warm-up call, then reps timed by events).
local function time_ms(fn, reps)
  fn()
  cuda.synchronize()
  local e0, e1 = cuda.Event { enable_timing = true }, cuda.Event { enable_timing = true }
  e0:record()
  for _ = 1, reps do fn() end
  e1:record()
  e1:synchronize()
  return e0:elapsed_time(e1) / reps
end
local function note(fmt, ...) print(string.format(fmt, ...)) end

-- TF32 on request: looser, but still a convolution of the same values (10 bits of mantissa: 5e-3 of the scale).
do
  cuda.set_allow_tf32(true)
  local ok, err = pcall(function()
    local xx, ww = dlua.randn(8, 32, 14, 14), dlua.randn(64, 32, 3, 3)
    local cc = { 1, 1, 1, 1, 1, 1, 1 }
    local ref = K.conv2d(xx, ww, nil, cc):double()
    local got = K.conv2d(xx:to(dev):contiguous('channels_last'), ww:to(dev), nil, cc):cpu():double()
    local e = (ref - got):abs():max():item() / ref:abs():max():item()
    note('conv forward tf32: error %.3g of the scale (allowed 5e-3)', e)
    if not (e <= 5e-3) then failures = failures + 1; print('FAIL conv forward tf32') end
  end)
  cuda.set_allow_tf32(false)
  if not ok then failures = failures + 1; print('FAIL conv forward tf32: ' .. tostring(err)) end
end

for _, dt in ipairs({ 'bfloat16', 'float16', 'float32' }) do
  local N = 8192
  local a, b = dlua.randn(N, N):to { device = dev, dtype = dt }, dlua.randn(N, N):to { device = dev, dtype = dt }
  local ms = time_ms(function() dlua.mm(a, b):free() end, 10)
  note('GEMM %d^3 %-8s %8.3f ms  %7.1f TFLOP/s', N, dt, ms, 2 * N ^ 3 / ms / 1e9)
  a:free(); b:free()
end
cuda.set_allow_tf32(true)
do
  local N = 8192
  local a, b = dlua.randn(N, N):to(dev), dlua.randn(N, N):to(dev)
  local ms = time_ms(function() dlua.mm(a, b):free() end, 10)
  note('GEMM %d^3 tf32     %8.3f ms  %7.1f TFLOP/s', N, ms, 2 * N ^ 3 / ms / 1e9)
  a:free(); b:free()
end
cuda.set_allow_tf32(false)
do
  local n = 64 * 1024 * 1024
  local a, b = dlua.randn(n):to(dev), dlua.randn(n):to(dev)
  local ms = time_ms(function() (a + b):free() end, 20)
  note('add f32 %dM elements %.3f ms  %.0f GB/s', n / 1048576, ms, 3 * 4 * n / ms / 1e6)
  ms = time_ms(function() a:sum() end, 20)
  note('sum f32 %dM elements %.3f ms  %.0f GB/s', n / 1048576, ms, 4 * n / ms / 1e6)
  ms = time_ms(function() a:view(8192, 8192):t():contiguous():free() end, 10)
  note('transpose copy 8192^2 f32 %.3f ms  %.0f GB/s', ms, 2 * 4 * n / ms / 1e6)
  a:free(); b:free()
end

-- ResNet-50's 3x3 convolution of stage 3 (256 -> 256 at 14x14), batch 128, bf16 channels-last
do
  local N, C, H = 128, 256, 14
  local cc = { 1, 1, 1, 1, 1, 1, 1 }
  local xx = dlua.randn(N, C, H, H):to { device = dev, dtype = 'bfloat16' }:contiguous('channels_last')
  local gg = dlua.randn(N, C, H, H):to { device = dev, dtype = 'bfloat16' }:contiguous('channels_last')
  for _, wl in ipairs({ 'nchw', 'nhwc' }) do
    local ww = dlua.randn(C, C, 3, 3):to { device = dev, dtype = 'bfloat16' }
    if wl == 'nhwc' then ww = ww:contiguous('channels_last') end
    local gw = ww:clone()
    local f = time_ms(function() K.conv2d(xx, ww, nil, cc):free() end, 20)
    local bd = time_ms(function() K.conv2d_backward_data(gg, ww, xx, cc):free() end, 20)
    local bw = time_ms(function() K.conv2d_backward_weights(gw, nil, xx, gg, cc) end, 20)
    local flop = 2 * N * C * H * H * C * 9
    note('conv 3x3 256->256 14x14 N=128 bf16 NHWC, %s weights: fwd %.3f ms, bwd-data %.3f ms, bwd-weights %.3f ms, '
      .. 'fwd+bwd %.3f ms (%.0f TFLOP/s)', wl == 'nchw' and 'OIHW' or 'OHWI', f, bd, bw, f + bd + bw, 3 * flop / (f + bd + bw) / 1e9)
  end
end

-- ResNet-50's widest batch-norm, bf16 channels-last, training forward + backward with ReLU; its first max-pool
do
  local N, C, H = 128, 256, 56
  local xb = dlua.randn(N, C, H, H):to { device = dev, dtype = 'bfloat16' }:contiguous('channels_last')
  local dyb = (xb * 0.5):contiguous('channels_last')
  local gm, bt = dlua.ones(C, { device = dev }), dlua.zeros(C, { device = dev })
  local rmb, rvb = dlua.zeros(C, { device = dev }), dlua.ones(C, { device = dev })
  local ggb, gbb = dlua.zeros(C, { device = dev }), dlua.zeros(C, { device = dev })
  local ms = time_ms(function()
    local yb, smb, sib = K.batch_norm(xb, gm, bt, nil, rmb, rvb, true, 0.1, 1e-5, true, true)
    local gi = K.batch_norm_backward(dyb, xb, yb, gm, nil, smb, sib, ggb, gbb, true, true, false)
    yb:free(); gi:free()
  end, 20)
  -- bytes moved: forward reads x twice and writes y; backward reads x, dy, y twice and writes dx
  note('BN fwd+bwd %dx%dx%dx%d bf16 NHWC relu: %.3f ms  %.0f GB/s', N, C, H, H, ms, 10 * N * C * H * H * 2 / ms / 1e6)
  xb:free(); dyb:free()
  local xp = dlua.randn(N, 64, 112, 112):to { device = dev, dtype = 'bfloat16' }:contiguous('channels_last')
  local mc = { 3, 3, 2, 2, 1, 1, 1, 1, false }
  ms = time_ms(function()
    local yp, ip = K.max_pool2d(xp, mc, true)
    K.max_pool2d_backward(yp, ip, xp):free()
    yp:free(); ip:free()
  end, 10)
  note('max_pool 3x3/2 fwd+bwd %dx64x112x112 bf16 NHWC: %.3f ms', N, ms)
end

-- sort, top-k, indexing
do
  local big = dlua.randn(16 * 1024 * 1024):to(dev)
  note('sort f32 16M (one row)        %8.3f ms', time_ms(function() local v, i = big:sort(); v:free(); i:free() end, 5))
  local rows = big:view(16384, 1024)
  note('sort f32 16384 rows x 1024    %8.3f ms', time_ms(function() local v, i = rows:sort(2); v:free(); i:free() end, 5))
  note('topk f32 16M k=16384          %8.3f ms', time_ms(function() local v, i = big:topk(16384); v:free(); i:free() end, 5))
  local ix = dlua.randint(1, 16385, { 4096 }):to(dev)
  note('index_select 4096 of 16384 rows x 1024 f32 %8.3f ms', time_ms(function() rows:index_select(1, ix):free() end, 10))
  local bins = dlua.randint(1, 1001, { 16 * 1024 * 1024 }):to(dev)
  local acc = dlua.zeros(1000):to(dev)
  note('scatter_add_ 16M into 1000 bins %8.3f ms', time_ms(function() acc:scatter_add_(1, bins, big) end, 5))
  note('var f32 16M                   %8.3f ms', time_ms(function() big:var() end, 10))
end

print(failures == 0 and 'timings: done' or ('timings: ' .. failures .. ' failed'))
os.exit(failures == 0 and 0 or 1)
