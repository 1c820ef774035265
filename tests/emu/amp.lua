-- Mixed precision on the CUDA backend (the emulator in CI, a GPU under tests/gpu/run.sh): autocast bf16 and f16 (f16
-- with a GradScaler) train a conv + batch-norm + linear net for 6 steps on cuda as on the CPU: convolutions and the
-- linear layer compute in 16 bits through cuDNN / cuBLASLt, the statistics, loss and optimizer stay float32, and the
-- losses and final parameters agree with the CPU's within the 16-bit dtype's rounding.
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
print(string.format('emu/amp: %d checks passed', checks))
