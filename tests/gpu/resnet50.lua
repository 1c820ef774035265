-- ResNet-50 on CUDA (tests/gpu/run.sh): training steps checked against the CPU backend, then the
-- training throughput that bench/gpu_resnet50.py sets beside PyTorch's.
--   dlua tests/gpu/resnet50.lua check [device]      f32 step vs the CPU; f32/bf16/f16 NHWC steps with memory stats
--   dlua tests/gpu/resnet50.lua bench [device] [dtype] [batch] [steps] [amp|o2]   prints `img/s<TAB>value`
--   dlua tests/gpu/resnet50.lua gemm [device]        prints `tflops<TAB>value` (8192^3 bf16)
-- device defaults to 'cuda'; 'cpu' runs the same code CPU against CPU at a tiny size (checks the script).
--
-- 16-bit training here is what DeepSpeed's bf16 optimizer and PyTorch AMP's O2 do: weights, activations and
-- gradients in bf16/f16 (convolutions accumulate in f32, batch-norm keeps f32 statistics), an f32 master
-- copy of the weights that SGD updates, cast back after each step. f16 scales the loss by 128. 'amp' (the
-- bench's default, what PyTorch AMP does and bench/gpu_resnet50.py runs): a float32 model under
-- dlua.amp.autocast(dtype), convolutions and GEMMs in 16 bits, the optimizer's fused step writing the 16-bit
-- weight copy, and f16 with dlua.amp.GradScaler.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local resnet = require 'models.resnet'
local amp = require 'dlua.amp'

local mode = arg[1] or 'check'
local dev = arg[2] or 'cuda'
local on_gpu = dev ~= 'cpu'
if on_gpu and not dlua.cuda.is_available() then
  print('resnet50: no CUDA device: skipped')
  os.exit(0)
end
local function sync() if on_gpu then dlua.cuda.synchronize() end end

-- A ResNet-50 training setup on `device` in `dtype` (channels-last), with f32 master weights when 16-bit.
local function setup(device, dtype, image, seed, lr)
  dlua.manual_seed(seed or 0)
  local model = resnet.resnet50({ num_classes = 1000 }):input_grad(false)
  local master
  if dtype ~= 'float32' then
    master = resnet.resnet50({ num_classes = 1000 })
    master:load_state_dict(model:state_dict())
    master:to(device)
  end
  model:to({ device = device, dtype = dtype })
  local opt = optim.SGD(master or model, { lr = lr or 0.1, momentum = 0.9, weight_decay = 1e-4 })
  return { model = model, master = master, opt = opt, crit = nn.CrossEntropyLoss(), dtype = dtype,
    scale = dtype == 'float16' and 128 or 1, image = image }
end

-- The same under dlua.amp: a float32 model (the arena is the master copy), autocast to `dtype`.
local function setup_amp(device, dtype, image, seed, lr, init_scale)
  dlua.manual_seed(seed or 0)
  local model = resnet.resnet50({ num_classes = 1000 }):input_grad(false)
  model:to(device)
  local opt = optim.SGD(model, { lr = lr or 0.1, momentum = 0.9, weight_decay = 1e-4 })
  return { model = model, opt = opt, crit = nn.CrossEntropyLoss(), dtype = dtype, image = image, amp = true,
    scaler = dtype == 'float16' and amp.GradScaler({ init_scale = init_scale or 2 ^ 16 }) or nil }
end

-- One training step on (x, y); returns the loss (a host number when `read`, else nil: no sync).
local function step(s, x, y, read)
  if s.amp then
    s.opt:zero_grad()
    local out, loss = amp.autocast(s.dtype, function()
      local o = s.model:forward(x)
      return o, s.crit:forward(o, y)
    end)
    local g = s.crit:backward(out, y)
    if s.scaler then g = s.scaler:scale(g) end
    s.model:backward(x, g)
    if s.scaler then s.scaler:step(s.opt) else s.opt:step() end
    return read and loss:float():item() or nil
  end
  local m = s.model
  s.opt:zero_grad()
  if s.master then m:zero_grad() end
  local out = m:forward(x)
  local loss = s.crit:forward(out, y)
  local g = s.crit:backward(out, y)
  if s.scale ~= 1 then g = g * s.scale end
  m:backward(x, g)
  if s.master then
    -- both arenas list the same parameters in the same order: one cast each way
    local ma, mm = s.master:flatten(), m:flatten()
    ma.grads.float32:copy_(mm.grads[s.dtype])
    if s.scale ~= 1 then ma.grads.float32:mul_(1 / s.scale) end
    s.opt:step()
    mm.params[s.dtype]:copy_(ma.params.float32)
  else
    s.opt:step()
  end
  return read and loss:float():item() or nil
end

local function batch_on(device, dtype, n, image, seed)
  dlua.manual_seed(seed)
  local x = dlua.randn(n, 3, image, image):contiguous('channels_last')
  local y = dlua.randint(1, 1001, n)
  return x:to({ device = device, dtype = dtype }):contiguous('channels_last'), y:to(device)
end

local function rel(a, b)
  local d = (a:cpu():double() - b:cpu():double()):norm():item()
  local r = b:cpu():double():norm():item()
  return d / math.max(r, 1e-30)
end

if mode == 'check' then
  local failures = 0
  local function expect(name, ok, detail)
    print(string.format('%-48s %s  %s', name, ok and 'ok  ' or 'FAIL', detail))
    if not ok then failures = failures + 1 end
  end
  -- f32 against the CPU: the same weights and batch, one step, then outputs, gradients and weights.
  local image, n = 64, on_gpu and 8 or 4
  local ref = setup('cpu', 'float32', image, 1)
  local got = setup(dev, 'float32', image, 1)
  local xc, yc = batch_on('cpu', 'float32', n, image, 7)
  local xd, yd = batch_on(dev, 'float32', n, image, 7)
  local lr_ = step(ref, xc, yc, true)
  local lg = step(got, xd, yd, true)
  expect('f32 step: loss vs CPU', math.abs(lr_ - lg) <= 1e-4 * math.abs(lr_), string.format('%.6f vs %.6f', lg, lr_))
  expect('f32 step: logits vs CPU', rel(got.model.output, ref.model.output) < 1e-4,
    string.format('rel err %.2e', rel(got.model.output, ref.model.output)))
  -- How far the CPU moves from itself when the input changes by one part in 10^6 (a few f32 roundings): at
  -- 64x64 and batch 8, layer4 is 2x2 and batch-norm's statistics come from 32 values, so ResNet-50 at
  -- initialisation turns that into about 1e-2 in some batch-norm gradients. A device sums every convolution
  -- in another order, a change of the same kind and size, so its gradients may differ from the CPU's by a
  -- few times this spread, and no more (a fixed 1e-3 failed on the emulator, and would on any GPU).
  local pert = setup('cpu', 'float32', image, 1)
  step(pert, xc * (1 + 1e-6), yc, true)
  local function worst_of(field, a, b)
    local w, wn = 0, ''
    local pa, pb = a.model:named_parameters(), b.model:named_parameters()
    for i, e in ipairs(pb) do
      local r = rel(pa[i][field], e[field])
      if r > w then w, wn = r, e.name end
    end
    return w, wn
  end
  for _, field in ipairs({ 'grad', 'param' }) do
    local spread = worst_of(field, pert, ref)
    local worst, wname = worst_of(field, got, ref)
    local what = field == 'grad' and 'every gradient' or 'weights after SGD'
    expect(string.format('f32 step: %s vs CPU (worst)', what), worst <= 4 * spread + 1e-5,
      string.format('rel err %.2e (%s); the CPU with its input moved by 1e-6: %.2e', worst, wname, spread))
  end
  local rb, gb = ref.model.bn1.running_var, got.model.bn1.running_var
  expect('f32 step: bn1 running_var vs CPU', rel(gb, rb) < 1e-4, string.format('rel err %.2e', rel(gb, rb)))

  -- 16-bit steps: the loss must fall on a fixed batch, and stay near the f32 loss at the first step. On the
  -- emulator (the CUDA code run by the CPU, docs/cuda.md#emulator) over 3 steps, not 5: these 15 steps were most
  -- of the check's work there, which ran past CTest's 900 s under load. (Measured 2026-12-02 and rejected: the
  -- whole check at 32x32 and batch 4, a quarter of the work per step, fails it: logits 8.5e-4 from the CPU's,
  -- gradients 4x the CPU's own spread, float16 NaN by step 3.)
  local falling_steps = (on_gpu and dlua.cuda.is_emulated()) and 3 or 5
  -- The dlua.amp runs (float32 model, autocast) on a GPU and in the CPU self-check; the emulator has them in
  -- tests/emu/amp.lua, and here they would add a third to the check's time. The scaler starts at 2^12: at the
  -- default 2^16 a fresh ResNet-50's float16 gradients overflow, and 3-5 steps would only measure the backoff.
  local runs = { { 'float32' }, { 'bfloat16' }, { 'float16' } }
  if not (on_gpu and dlua.cuda.is_emulated()) then
    runs[#runs + 1], runs[#runs + 2] = { 'bfloat16', true }, { 'float16', true }
  end
  for _, run in ipairs(runs) do
    local dt, under_amp = run[1], run[2]
    if on_gpu then dlua.cuda.reset_peak_memory_stats() end
    local s = under_amp and setup_amp(dev, dt, image, 1, 0.01, 2 ^ 12) or setup(dev, dt, image, 1, 0.01)
    local x, y = batch_on(dev, under_amp and 'float32' or dt, n, image, 7)
    local l1 = step(s, x, y, true)
    local l = l1
    for _ = 2, falling_steps do l = step(s, x, y, true) end
    local tol = dt == 'float32' and 1e-4 or 0.1
    local what = dt .. (under_amp and ' dlua.amp' or '') .. ' NHWC'
    expect(what .. ': first loss vs CPU f32', math.abs(l1 - lr_) <= tol * lr_, string.format('%.4f vs %.4f', l1, lr_))
    expect(what .. ': loss falls over ' .. falling_steps .. ' steps on one batch', l < l1, string.format('%.4f -> %.4f', l1, l))
    if s.scaler then expect(what .. ': the scaler applied steps', s.scaler.applied >= 2, s.scaler:summary()) end
    if on_gpu then
      local st = dlua.cuda.memory_stats()
      print(string.format('   memory: allocated %.0f MiB, peak %.0f MiB, reserved %.0f MiB, %d allocations', st.allocated / 2 ^ 20,
        st.peak_allocated / 2 ^ 20, st.reserved / 2 ^ 20, st.num_allocs))
    end
    s = nil
    collectgarbage()
  end
  print(failures == 0 and 'resnet50 check: all passed' or ('resnet50 check: ' .. failures .. ' failed'))
  os.exit(failures == 0 and 0 or 1)
elseif mode == 'bench' then
  local dt = arg[3] or 'bfloat16'
  local n = tonumber(arg[4]) or (on_gpu and 128 or 2)
  local steps = tonumber(arg[5]) or (on_gpu and 50 or 2)
  local image = on_gpu and 224 or 64
  local how = arg[6] or 'amp'
  if how ~= 'amp' and how ~= 'o2' then error("resnet50.lua bench: the 6th argument is 'amp' or 'o2', got " .. how) end
  local s = how == 'amp' and setup_amp(dev, dt, image, 0) or setup(dev, dt, image, 0)
  local x, y = batch_on(dev, how == 'amp' and 'float32' or dt, n, image, 3)
  for _ = 1, 5 do step(s, x, y) end -- warm-up: algorithm search, allocator
  sync()
  local t0 = dlua.perf_counter()
  for _ = 1, steps do step(s, x, y) end
  sync()
  local dt_s = dlua.perf_counter() - t0
  print(string.format('img/s\t%.1f', steps * n / dt_s))
  if on_gpu then
    local st = dlua.cuda.memory_stats()
    print(string.format('peak_mib\t%.0f', st.peak_allocated / 2 ^ 20))
  end
elseif mode == 'gemm' then -- the table's GEMM row: 8192^3 bf16 through cuBLASLt (f32 accumulation)
  local N = on_gpu and 8192 or 256
  local a = dlua.randn(N, N):to({ device = dev, dtype = 'bfloat16' })
  local b = dlua.randn(N, N):to({ device = dev, dtype = 'bfloat16' })
  for _ = 1, 3 do dlua.matmul(a, b):free() end
  sync()
  local reps = on_gpu and 20 or 2
  local t0 = dlua.perf_counter()
  for _ = 1, reps do dlua.matmul(a, b):free() end
  sync()
  print(string.format('tflops\t%.1f', 2 * N ^ 3 / ((dlua.perf_counter() - t0) / reps) / 1e12))
else
  error("resnet50.lua: mode must be 'check', 'bench' or 'gemm', got " .. tostring(mode))
end
