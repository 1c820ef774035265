-- Mixed precision on the CUDA backend (the emulator in CI, a GPU under tests/gpu/run.sh): autocast bf16 and f16 (f16
-- with a GradScaler) train a conv + batch-norm + linear net for 6 steps on cuda as on the CPU: convolutions and the
-- linear layer compute in 16 bits through cuDNN / cuBLASLt, the statistics, loss and optimizer stay float32, and the
-- losses and final parameters agree with the CPU's within the 16-bit dtype's rounding. Then master weights: SGD and
-- Adam(W) write the 16-bit copy of the arena on the device, so no weight is cast after the first step.
--   dlua tests/emu/amp.lua
local dlua = require 'dlua'
local nn, optim, amp = dlua.nn, dlua.optim, dlua.amp
if not dlua.cuda.is_available() then
  print('emu/amp: skipped: no CUDA device available (' .. tostring(dlua.cuda.unavailable_reason()) .. ')')
  os.exit(0)
end
local checks = 0
local function check(ok, fmt, ...)
  if not ok then error(string.format(fmt, ...), 2) end
  checks = checks + 1
end

local function net()
  dlua.manual_seed(7)
  return nn.Sequential{ nn.Conv2d(3, 8, 3, { padding = 1 }), nn.BatchNorm2d(8, { relu = true }), nn.AdaptiveAvgPool2d(1),
    nn.Flatten(), nn.Linear(8, 5) }
end

-- -> the 6 losses, the final parameters (float64, on the CPU), the dtypes the conv and linear outputs had
local function run(device, dtype, scaler)
  local m = net():to(device)
  local opt = optim.SGD(m, { lr = 0.05, momentum = 0.9 })
  local crit = nn.CrossEntropyLoss()
  local sc = scaler and amp.GradScaler({ init_scale = 1024 }) or nil
  local losses, seen = {}, {}
  for s = 1, 6 do
    local g = dlua.Generator(10 + s)
    local x = dlua.randn({ 4, 3, 8, 8 }, { generator = g }):to(device):contiguous('channels_last')
    local y = dlua.randint(1, 6, { 4 }, { generator = g, dtype = 'int64' }):to(device)
    opt:zero_grad()
    local loss
    local function step()
      local out = m:forward(x)
      seen.conv, seen.linear = m:get(1).output.dtype, out.dtype
      loss = crit:forward(out, y)
      local gy = crit:backward(out, y)
      m:backward(x, sc and sc:scale(gy) or gy)
    end
    if dtype == 'float32' then step() else amp.autocast(dtype, step) end
    local outcome = sc and sc:step(opt) or opt:step()
    if sc then
      check(outcome == 'applied', '%s on %s step %d: the scaler said %s', dtype, device, s, tostring(outcome))
      sc:update()
    end
    losses[s] = loss:item()
  end
  local ps = {}
  for i, p in ipairs((m:parameters())) do ps[i] = p:to('cpu'):double():view(-1) end
  return losses, dlua.cat(ps, 1), seen
end

local ref32 = run('cpu', 'float32')
for _, c in ipairs({ { 'bfloat16', false, 2 ^ -7 }, { 'float16', true, 2 ^ -10 } }) do
  local dt, eps = c[1], c[3]
  local lc, pc = run('cpu', dt, c[2])
  local lg, pg, seen = run('cuda', dt, c[2])
  check(seen.conv == dt and seen.linear == dt, '%s: conv and linear on cuda gave %s and %s', dt, seen.conv, seen.linear)
  local worst, off32 = 0, 0
  for s = 1, 6 do
    worst = math.max(worst, math.abs(lg[s] - lc[s]) / math.abs(lc[s]))
    off32 = math.max(off32, math.abs(lg[s] - ref32[s]) / math.abs(ref32[s]))
  end
  -- the two backends round the same 16-bit products in other orders: a few units of the dtype's eps
  check(worst <= 2 * eps, '%s: cuda losses differ from the CPU\'s by %.3g relative (allowed %.3g)', dt, worst, 2 * eps)
  local dp = (pg - pc):abs():max():item() / pc:abs():max():item()
  check(dp <= 4 * eps, '%s: cuda parameters after 6 steps differ from the CPU\'s by %.3g relative (allowed %.3g)', dt, dp, 4 * eps)
  print(string.format('emu/amp %s: 6 steps on cuda, conv/linear in %s; losses within %.2g of the CPU (float32 run: %.2g away),'
    .. ' parameters within %.2g', dt, seen.conv, worst, off32, dp))
end

-- Master weights on cuda: the fused SGD / Adam(W) kernel writes the arena's 16-bit twin on the device in the same pass
-- as the update, so after the first region's one cast of the arena no weight is cast again, and the twin holds exactly
-- the bits of the CPU's conversion of the updated float32 arena (core/dtype.h, round to nearest even). The same run on
-- the CPU (whose kernel writes the twin chunk by chunk) gives the reference trajectory.
local optimizers = {
  { 'SGD momentum + nesterov + weight decay', function(m)
      return optim.SGD(m, { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 1e-3 }) end },
  { 'SGD momentum + dampening', function(m) return optim.SGD(m, { lr = 0.05, momentum = 0.9, dampening = 0.1 }) end },
  { 'AdamW', function(m) return optim.AdamW(m, { lr = 0.01, weight_decay = 0.05 }) end },
  { 'Adam (L2)', function(m) return optim.Adam(m, { lr = 0.01, weight_decay = 0.01 }) end },
}
-- -> the 5 losses and the final parameters (float64, on the CPU)
local function master(device, dtype, name, mk, scaler)
  dlua.manual_seed(8)
  local m = nn.Sequential{ nn.Linear(6, 700), nn.ReLU(), nn.Linear(700, 4) }:to(device)  -- 7704 weights: many blocks
  local opt = mk(m)
  local crit = nn.CrossEntropyLoss()
  local sc = scaler and amp.GradScaler({ init_scale = 1024 }) or nil
  local a0, c0 = amp.arena_cast_count(), amp.cast_count()
  local losses = {}
  for s = 1, 5 do
    local g = dlua.Generator(30 + s)
    local x = dlua.randn({ 8, 6 }, { generator = g }):to(device)
    local y = dlua.randint(1, 5, { 8 }, { generator = g, dtype = 'int64' }):to(device)
    opt:zero_grad()
    local out = amp.autocast(dtype, function() return m:forward(x) end)
    check(out.dtype == dtype, '%s %s on %s: the linear gave %s', name, dtype, device, out.dtype)
    local loss = crit:forward(out, y)
    local gy = crit:backward(out, y)
    m:backward(x, sc and sc:scale(gy) or gy)
    if sc then
      local outcome = sc:step(opt)
      check(outcome == 'applied', '%s %s on %s step %d: the scaler said %s', name, dtype, device, s, tostring(outcome))
      sc:update()
    else
      opt:step()
    end
    losses[s] = loss:item()
    -- one pass over the arena in the first region, then the steps wrote the twin: no cast at all
    check(amp.arena_cast_count() - a0 == 1 and amp.cast_count() - c0 == 0,
      '%s %s on %s step %d: %d arena casts and %d weight casts (want 1 and 0)', name, dtype, device, s,
      amp.arena_cast_count() - a0, amp.cast_count() - c0)
    local twin = opt._lowp and opt._lowp.float32 and opt._lowp.float32.tensor
    check(twin ~= nil, '%s %s on %s: the optimizer has no 16-bit twin', name, dtype, device)
    check(twin.dtype == dtype and twin.device == m:get(1).weight.device, '%s %s on %s: the twin is %s on %s', name,
      dtype, device, twin.dtype, twin.device)
    -- the reference: the float32 arena brought to the CPU and converted there
    local want = opt.arena.params.float32:to('cpu'):to(dtype):float()
    local got = twin:to('cpu'):float()
    local diff = (got - want):abs():max():item()
    check(diff == 0, '%s %s on %s step %d: the twin differs from param:to(%s) by %g', name, dtype, device, s, dtype, diff)
  end
  local ps = {}
  for i, p in ipairs((m:parameters())) do ps[i] = p:to('cpu'):double():view(-1) end
  return losses, dlua.cat(ps, 1)
end

for _, c in ipairs({ { 'bfloat16', false, 2 ^ -7 }, { 'float16', true, 2 ^ -10 } }) do
  local dt, eps = c[1], c[3]
  for _, o in ipairs(optimizers) do
    local lc, pc = master('cpu', dt, o[1], o[2], c[2])
    local lg, pg = master('cuda', dt, o[1], o[2], c[2])
    local worst = 0
    for s = 1, 5 do worst = math.max(worst, math.abs(lg[s] - lc[s]) / math.abs(lc[s])) end
    check(worst <= 2 * eps, '%s %s: cuda losses differ from the CPU\'s by %.3g relative (allowed %.3g)', o[1], dt, worst,
      2 * eps)
    local dp = (pg - pc):abs():max():item() / pc:abs():max():item()
    check(dp <= 4 * eps, '%s %s: cuda parameters after 5 steps differ from the CPU\'s by %.3g relative (allowed %.3g)',
      o[1], dt, dp, 4 * eps)
    print(string.format('emu/amp master weights %s, %s: 5 steps on cuda with no weight cast after the first region, '
      .. 'twin = param:to(%s) bit for bit; losses within %.2g of the CPU, parameters within %.2g', dt, o[1], dt, worst, dp))
  end
end
-- the front door checks the copy: on param's device, 16 bits, param's element count
do
  local K = require 'bindings.nn'
  local p, g = dlua.zeros(10):to('cuda'), dlua.zeros(10):to('cuda')
  for _, c in ipairs({ { dlua.zeros(10):bfloat16(), "must be on param's device" },
                       { dlua.zeros(9):bfloat16():to('cuda'), 'must be a contiguous bfloat16 or float16 tensor' },
                       { dlua.zeros(10):to('cuda'), 'must be a contiguous bfloat16 or float16 tensor' } }) do
    local ok, e = pcall(K.sgd_step, p, g, nil, 0, 10, 0.1, 0, 0, 0, false, false, true, 1, c[1])
    check(not ok and tostring(e):find(c[2], 1, true), 'sgd_step with a bad 16-bit copy: %s', tostring(e))
  end
end
print(string.format('emu/amp: %d checks passed', checks))
