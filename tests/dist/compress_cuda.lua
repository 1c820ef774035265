-- Gradient compression hooks on CUDA buckets (the emulator in CI; a GPU under tests/gpu/nccl.sh): each hook gives a
-- model on this rank's CUDA device the gradients the same hook gives the same model on the CPU, over 3 steps with
-- error feedback carried: fp16/bf16 and top-k bit for bit (the same casts, selection and rank-ordered sums), PowerSGD
-- within float32 rounding of the products; top-k sends one all_gather of 2k words per bucket (two past 2^24 elements);
-- top-k residuals hold exactly what was not sent.
--   dlua --nproc 2 tests/dist/compress_cuda.lua
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local dist = dlua.dist
local compress = dist.compress
dist.init{ timeout = 60, backend = 'gloo' }
local rank, world = dist.rank(), dist.world_size()
if not dlua.cuda.is_available() then
  if rank == 0 then print('compress_cuda: skipped: no CUDA device available (' .. tostring(dlua.cuda.unavailable_reason()) .. ')') end
  dist.destroy()
  os.exit(0)
end
local device = dist.device() ~= 'cpu' and dist.device() or 'cuda'
local checks = 0
local function check(cond, fmt, ...)
  if not cond then error(string.format('rank %d: ' .. fmt, rank, ...), 2) end
  checks = checks + 1
end

local function net()
  dlua.manual_seed(3)
  return nn.Sequential(nn.Conv2d(3, 8, 3, { padding = 1 }), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32), nn.ReLU(),
    nn.Linear(32, 10)):input_grad(false)
end
local B = 4
local crit = nn.CrossEntropyLoss()
-- Runs the hook over DDP's own buckets as backward would, on gradients set by hand: step s gives every rank its own
-- seeded normal values, the same on both devices, so the two hooks see identical inputs.
-- (spec: a from_spec string, or a function making the hook; ready(ddp) runs before the first step)
local function grads_after(dev, spec, steps, ready)
  local hook = type(spec) == 'function' and spec() or compress.from_spec(spec)
  local ddp = dist.DDP(net():to(dev), { hook = hook, first_bucket_mb = 0.01 })
  if ready then ready(ddp) end
  local arena = ddp.arena.grads.float32
  local out = {}
  for s = 1, steps do
    arena:copy_(dlua.randn({ arena:numel() }, { generator = dlua.Generator(1000 * s + rank) }) * 0.01)
    local works = {}
    for i, b in ipairs(ddp.buckets) do works[i] = ddp.hook(ddp.hook_state, b) end
    for _, w in ipairs(works) do w:wait() end
    out[s] = arena:to('cpu'):clone()
  end
  return out, ddp
end
local function max_rel(a, b) return (a - b):abs():max():item() / math.max(b:abs():max():item(), 1e-30) end

for _, c in ipairs({ { 'fp16', 0 }, { 'bf16', 0 }, { 'topk:0.05', 0 }, { 'topk:1', 0 }, { 'topk:0.1:mc=0.9', 0 },
  { 'powersgd:1', 1e-5 }, { 'powersgd:4', 1e-5 } }) do
  local spec, tol = c[1], c[2]
  local gc = grads_after('cpu', spec, 3)
  local gd, ddp = grads_after(device, spec, 3)
  local worst = 0
  for s = 1, 3 do worst = math.max(worst, max_rel(gd[s], gc[s])) end
  check(worst <= tol, '%s: %s gradients differ from the CPU\'s by %.3g relative (allowed %g)', spec, device, worst, tol)
  local st = ddp:comm_stats()
  check(st.hook == ddp.hook_state.spec, '%s: comm_stats names %s', spec, tostring(st.hook))
  if rank == 0 then
    print(string.format('compress_cuda %-16s on %s: 3 steps (error feedback carried) within %.2g of the CPU hook', spec,
      device, worst))
  end
end

-- top-k's exchange is one all_gather per bucket of 2k 32-bit words, as on the CPU (the indices as exact float32
-- values); a bucket past packed_index_limit (2^24 elements) sends values and int32 indices in two, and both give
-- the CPU hook's gradients bit for bit
do
  local calls, words = 0, 0
  local orig = dist.all_gather
  dist.all_gather = function(outs, t, opts)
    calls, words = calls + 1, words + t:numel()
    return orig(outs, t, opts)
  end
  for _, limit in ipairs({ 2 ^ 24, 0 }) do  -- the default (compress.PACKED_INDEX_LIMIT), and every bucket past it
    local make = function()
      local h = compress.topk{ ratio = 0.05 }
      h.packed_index_limit = limit
      return h
    end
    local gd, ddp = grads_after(device, make, 3, function() calls, words = 0, 0 end)
    local c, w = calls, words
    local gc = grads_after('cpu', 'topk:0.05', 3)
    local worst = 0
    for s = 1, 3 do worst = math.max(worst, max_rel(gd[s], gc[s])) end
    local k_total = 0
    for _, b in ipairs(ddp.buckets) do k_total = k_total + math.max(1, math.ceil(0.05 * b.numel)) end
    local per = limit > 0 and 1 or 2
    check(c == per * 3 * #ddp.buckets and w == 3 * 2 * k_total, 'top-k on %s (index limit %g): %d all_gathers of %d words '
      .. 'in 3 steps, expected %d of %d', device, limit, c, w, per * 3 * #ddp.buckets, 3 * 2 * k_total)
    check(worst == 0, 'top-k on %s (index limit %g): gradients differ from the CPU hook\'s by %.3g relative', device, limit, worst)
    if rank == 0 then
      print(string.format('compress_cuda top-k on %s, %s: %d all_gather(s) per bucket, %d words per step, bit-identical to the CPU hook',
        device, limit > 0 and 'indices packed with the values' or 'past the index limit', per, 2 * k_total))
    end
  end
  dist.all_gather = orig
end

-- top-k residuals on the device: residual after + sent = residual before + gradient, exactly
do
  local h = compress.topk{ ratio = 0.05 }
  local ddp = dist.DDP(net():to(device), { hook = h, first_bucket_mb = 0.01 })
  local g = dlua.Generator(7)
  local x = dlua.randn({ B, 3, 6, 6 }, { generator = g }):to(device)
  local y = dlua.randint(1, 11, { B }, { generator = g, dtype = 'int64' }):to(device)
  local o = ddp:forward(x)
  crit:forward(o, y)
  -- the local gradient, before the hook: a second model without communication
  local m = net():to(device)
  m:flatten()
  local o2 = m:forward(x)
  crit:forward(o2, y)
  m:backward(x, crit:backward(o2, y))
  local local_g = m._arena.grads.float32:to('cpu')
  ddp:backward(x, crit:backward(o, y))
  ddp:wait()
  local res = h.residual.float32:to('cpu')
  -- what this rank sent: local_g - residual, nonzero in exactly k places per bucket (or fewer where the gradient is 0)
  local sent = local_g - res
  local nz = sent:ne(0):sum():item()
  local k_total = 0
  for _, b in ipairs(ddp.buckets) do k_total = k_total + math.max(1, math.ceil(0.05 * b.numel)) end
  check(nz <= k_total, 'top-k sent %d entries, more than the %d of its buckets', nz, k_total)
  check((res:eq(0):logical_not():logical_and(sent:ne(0))):sum():item() == 0,
    'an entry was both sent and kept in the residual')
  if rank == 0 then print(string.format('compress_cuda top-k residuals on %s: %d of %d entries sent, the rest kept exactly', device, nz, res:numel())) end
end
if rank == 0 then print(string.format('compress_cuda: %d checks passed', checks)) end
dist.destroy()
