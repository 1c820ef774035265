-- Losses, activation gradients, random fills and the LARS and LAMB steps on a device against the CPU backend:
-- softmax/log-softmax forward and backward along every dim, cross-entropy (reductions, class weights, label
-- smoothing, ignore_index, spatial targets) forward and backward, MSE, threshold/ReLU backward, dropout; random
-- fills (uniform_, normal_, bernoulli_, randint/random_, randperm, dropout masks) bit-identical to the CPU for
-- the same generator state; LARS steps over several parameters; then mixed-device errors and determinism
-- (GPU only). Run by tests/gpu/run.sh or alone:
--   dlua tests/gpu/ops_loss_rand.lua [device]     device: 'cuda' (default), 'cuda:N', or 'cpu'
-- With 'cpu' the same comparisons run CPU against CPU: that checks the script itself where no GPU is.
local dlua = require 'dlua'
local H = require 'tests.gpu.harness'
local K = require 'bindings.nn'
local core = require 'bindings.tensor_core'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local dev, on_gpu, want_device = H.device(arg)
local t_start = os.clock()

dlua.manual_seed(2718)

local FLOATS = H.FLOATS
local ALL = H.ALL
local is_float = H.is_float
local TOL = H.TOL
local shape_str, rel_error = H.shape_str, H.rel_error

local results, failures, checks, both_failed = {}, {}, 0, {}
local want_dev = want_device

local function fail(name, msg) failures[#failures + 1] = name .. ': ' .. msg end

-- Exact: the same values (NaN where NaN), compared as int64 for integers and as float64 (which holds every
-- value of the narrower float dtypes) otherwise.
local function differs(ref, got)
  if ref:numel() == 0 then return false end
  if not is_float[ref.dtype] then return ref:long():ne(got:long()):any():item() end
  local r, g = ref:double(), got:double()
  return not r:eq(g):logical_or(r:isnan():logical_and(g:isnan())):all():item()
end

-- One result: got (on the device) against ref (CPU). tol nil: exact, else relative.
local function compare(name, ref, got, tol)
  checks = checks + 1
  local rec = { name = name, dtype = ref.dtype, shape = shape_str(ref), err = 0, tol = tol or 0, ok = true }
  results[#results + 1] = rec
  if got.device ~= want_dev then
    rec.ok = false
    return fail(name, 'result on ' .. got.device .. ', expected ' .. want_dev)
  end
  got = got:cpu()
  if shape_str(got) ~= shape_str(ref) or got.dtype ~= ref.dtype then
    rec.ok = false
    return fail(name, string.format('got %s %s, expected %s %s', shape_str(got), got.dtype, shape_str(ref), ref.dtype))
  end
  if tol == nil then
    if differs(ref, got) then
      rec.ok, rec.err = false, math.huge
      fail(name, string.format('%s %s: values differ (expected identical)', ref.dtype, shape_str(ref)))
    end
    return
  end
  local err = rel_error(ref, got)
  rec.err = err
  if not (err <= tol) then
    rec.ok = false
    fail(name, string.format('%s %s: error %.3g > tolerance %.3g', ref.dtype, shape_str(ref), err, tol))
  end
end

local function as_list(r) return (type(r) == 'table' and not core.is_tensor(r)) and r or { r } end

-- Runs fn on CPU inputs and on their device copies; both must succeed (and agree) or both fail. fn returns a
-- tensor or a list of tensors. tol_factor scales the per-dtype tolerance (nil: exact).
local function check(name, tol_factor, fn, ...)
  local cpu_in, dev_in = { ... }, {}
  for i, x in ipairs(cpu_in) do dev_in[i] = x:to(dev) end
  local ok1, r1 = pcall(fn, unpack(cpu_in))
  local ok2, r2 = pcall(fn, unpack(dev_in))
  if not H.both_ran(name, ok1, r1, ok2, r2, failures, both_failed) then
    checks = checks + 1
    return
  end
  local l1, l2 = as_list(r1), as_list(r2)
  for i, ref in ipairs(l1) do
    local tol = tol_factor and TOL[ref.dtype] and tol_factor * TOL[ref.dtype] / TOL.float32 or nil
    compare(#l1 > 1 and (name .. ' #' .. i) or name, ref, l2[i], tol)
  end
end

local function rand(dtype, sizes, scale)
  return (dlua.randn(sizes, { dtype = 'float32' }) * (scale or 3)):to(dtype)
end

------------------------------------------------------------------------------------------------
-- softmax / log-softmax along every dim, forward and backward

local SHAPES = { {}, { 1 }, { 7 }, { 0 }, { 13, 17 }, { 3, 1, 5 }, { 4099 }, { 2, 3, 5, 7 }, { 64, 33 }, { 5, 1500 },
  { 3, 0, 4 }, { 9, 40 } }
local VIEWS = {
  { base = { 17, 13 }, name = 't', f = function(t) return t:t() end },
  { base = { 5, 40 }, name = 'narrow', f = function(t) return t:narrow(2, 3, 31) end },
  { base = { 2, 3, 5, 7 }, name = 'permute', f = function(t) return t:permute(4, 2, 1, 3) end },
  { base = { 1, 29 }, name = 'expand', f = function(t) return t:expand(6, 29) end },
}

local function softmax_cases(dt, x, tag)
  local nd = math.max(x:dim(), 1)
  for d = 0, nd - 1 do
    for _, lg in ipairs({ false, true }) do
      local what = (lg and 'log_softmax' or 'softmax') .. ' dim ' .. d .. ' ' .. dt .. ' ' .. tag
      check(what, 4, function(t) return K.softmax(t, d, lg) end, x)
      local gy = rand(dt, x:size(), 1)
      check(what .. ' backward', 8, function(t, g)
        local y = K.softmax(t, d, lg)
        return K.softmax_backward(g, y, d, lg)
      end, x, gy)
    end
  end
end

for _, dt in ipairs(FLOATS) do
  for _, s in ipairs(SHAPES) do
    local x = rand(dt, s)
    softmax_cases(dt, x, shape_str(x))
  end
  for _, v in ipairs(VIEWS) do softmax_cases(dt, v.f(rand(dt, v.base)), v.name) end
  -- -inf entries, a row of -inf (NaN, as on the CPU), a NaN, and large values
  local sp = dlua.tensor({ { 1, -1 / 0, 3, 2 }, { -1 / 0, -1 / 0, -1 / 0, -1 / 0 }, { 0 / 0, 1, 2, 3 },
    { 60000, 59990, -60000, 0 } }):to(dt)
  softmax_cases(dt, sp, 'specials')
end
check('softmax mixed dtypes backward', 4, function(g, y) return K.softmax_backward(g, y, 1, false) end,
  rand('float16', { 13, 17 }), K.softmax(rand('float32', { 13, 17 }), 1, false))

------------------------------------------------------------------------------------------------
-- cross-entropy: reductions, weights, smoothing, ignore_index, spatial targets, forward and backward

-- Labels 1..Kc (1-based, as Lua sees them) with every `every`-th one set to `ignore`.
local function labels_for(sizes, Kc, ignore, every, dtype)
  local l = dlua.randint(1, Kc + 1, sizes, { dtype = dtype or 'int64' })
  if ignore and every and l:numel() > 0 then
    local flat = l:view(-1)
    for i = 1, flat:numel(), every do flat[i] = ignore end
  end
  return l
end

local CE = {  -- {logits sizes, labels sizes}
  { { 1, 1 }, { 1 } }, { { 7, 5 }, { 7 } }, { { 64, 10 }, { 64 } }, { { 13, 1031 }, { 13 } }, { { 3, 2000 }, { 3 } },
  { { 2, 5, 3, 4 }, { 2, 3, 4 } }, { { 4, 3, 17 }, { 4, 17 } }, { { 11 }, {} }, { { 0, 5 }, { 0 } },
}
for _, dt in ipairs(FLOATS) do
  for _, c in ipairs(CE) do
    local Kc = #c[1] >= 2 and c[1][2] or c[1][1]
    local x = rand(dt, c[1])
    local w = dlua.rand(Kc):add(0.5)
    for _, red in ipairs({ 'mean', 'sum', 'none' }) do
      for _, opt in ipairs({ { eps = 0 }, { eps = 0.1 }, { eps = 0, weight = true }, { eps = 0.2, weight = true, ignore = -100 },
        { eps = 0, ignore = 2 } }) do
        local tag = string.format('%s %s %s eps %g%s%s', dt, shape_str(x), red, opt.eps, opt.weight and ' weighted' or '',
          opt.ignore and (' ignore ' .. opt.ignore) or '')
        local lab = labels_for(c[2], Kc, opt.ignore, 3)
        local function fwd(t, l, wt)
          local loss, lp = K.cross_entropy(t, l, opt.weight and wt or nil, red, opt.eps, opt.ignore)
          return { loss, lp }
        end
        check('cross_entropy ' .. tag, 2, fwd, x, lab, w)
        local go = red == 'none' and rand(dt, c[2], 1) or dlua.tensor({ 0.75 }):to(dt)
        check('cross_entropy backward ' .. tag, 2, function(t, l, wt, g)
          local _, lp = K.cross_entropy(t, l, opt.weight and wt or nil, red, opt.eps, opt.ignore)
          return { K.cross_entropy_backward(g, lp, l, opt.weight and wt or nil, red, opt.eps, opt.ignore),
            K.cross_entropy_backward(nil, lp, l, opt.weight and wt or nil, red, opt.eps, opt.ignore) }
        end, x, lab, w, go)
      end
    end
  end
  -- non-contiguous logits, int32 labels, labels that are out of range (both backends reject them)
  local xt = rand(dt, { 10, 37 }):t()
  check('cross_entropy transposed ' .. dt, 2, function(t, l)
    local loss, lp = K.cross_entropy(t, l, nil, 'mean', 0.1)
    return { loss, lp, K.cross_entropy_backward(nil, lp, l, nil, 'mean', 0.1) }
  end, xt, labels_for({ 37 }, 10, nil, nil, 'int32'))
  check('cross_entropy bad label ' .. dt, 2, function(t, l) return (K.cross_entropy(t, l)) end,
    rand(dt, { 4, 6 }), dlua.tensor({ 1, 7, 2, 3 }, { dtype = 'int64' }))
  check('cross_entropy all ignored mean ' .. dt, 2, function(t, l) return (K.cross_entropy(t, l, nil, 'mean', 0, 1)) end,
    rand(dt, { 3, 4 }), dlua.tensor({ 1, 1, 1 }, { dtype = 'int64' }))
end

------------------------------------------------------------------------------------------------
-- MSE, threshold / ReLU and their gradients

local EW = { {}, { 1 }, { 7 }, { 0 }, { 13, 17 }, { 4099 }, { 100003 }, { 2, 3, 5, 7 } }
local function threshold(x, th, v) return core.new('threshold', core.C.dlua_nn_threshold, 3, x, th, v) end
local function threshold_backward(g, x, th)
  return core.new('threshold_backward', core.C.dlua_nn_threshold_backward, 3, g, x, th)
end
for _, dt in ipairs(FLOATS) do
  local function cases(x, t, gy, tag)
    for _, red in ipairs({ 'mean', 'sum', 'none' }) do
      check('mse_loss ' .. red .. ' ' .. tag, 2, function(a, b) return K.mse_loss(a, b, red) end, x, t)
      local go = red == 'none' and gy or dlua.tensor({ -1.5 }):to(dt)
      check('mse_loss backward ' .. red .. ' ' .. tag, 2, function(a, b, g)
        return { K.mse_loss_backward(g, a, b, red), K.mse_loss_backward(nil, a, b, red) }
      end, x, t, go)
    end
    check('relu ' .. tag, nil, function(a) return K.relu(a) end, x)
    check('relu_backward ' .. tag, nil, function(a, g) return K.relu_backward(g, K.relu(a)) end, x, gy)
    check('threshold ' .. tag, nil, function(a) return threshold(a, 0.5, -2) end, x)
    check('threshold_backward ' .. tag, nil, function(a, g) return threshold_backward(g, a, -0.25) end, x, gy)
  end
  for _, s in ipairs(EW) do
    local x = rand(dt, s)
    cases(x, rand(dt, s), rand(dt, s, 1), dt .. ' ' .. shape_str(x))
  end
  for _, v in ipairs(VIEWS) do
    local x = v.f(rand(dt, v.base))
    cases(x, v.f(rand(dt, v.base)), v.f(rand(dt, v.base, 1)), dt .. ' ' .. v.name)
  end
  local sp = dlua.tensor({ 0 / 0, 1 / 0, -1 / 0, -0.0, 0, 1, -1, 0.5 }):to(dt)
  cases(sp, sp * 0.5, sp, dt .. " specials")
end
check('mse_loss mixed dtypes', 2, function(a, b) return K.mse_loss(a, b, 'mean') end, rand('float16', { 33 }),
  rand('float64', { 33 }))

------------------------------------------------------------------------------------------------
-- random fills: the same bits as the CPU for the same generator state (and the same offsets after)

local SEED = 987654321
local function check_fill(name, fn)
  local function run(d)
    dlua.manual_seed(SEED)
    local g = dlua.Generator(SEED + 1)
    local t = fn(d, g)
    return t, dlua.default_generator():get_offset(), g:get_offset()
  end
  local ok1, r1, o1, p1 = pcall(run, 'cpu')
  local ok2, r2, o2, p2 = pcall(run, dev)
  if not H.both_ran(name, ok1, r1, ok2, r2, failures, both_failed) then
    checks = checks + 1
    return
  end
  compare(name, r1, r2, nil)
  checks = checks + 1
  if o1 ~= o2 or p1 ~= p2 then fail(name, string.format('generator offsets differ: %s/%s vs %s/%s', o1, p1, o2, p2)) end
end

local FILL_SHAPES = { { 0 }, { 1 }, { 3 }, { 4 }, { 5 }, { 13, 17 }, { 1031 }, { 100003 } }
for _, s in ipairs(FILL_SHAPES) do
  local tag = shape_str(dlua.empty(s))
  for _, dt in ipairs(FLOATS) do
    check_fill('rand ' .. dt .. ' ' .. tag, function(d) return dlua.rand(s, { dtype = dt, device = d }) end)
    check_fill('randn ' .. dt .. ' ' .. tag, function(d) return dlua.randn(s, { dtype = dt, device = d }) end)
    check_fill('uniform_ ' .. dt .. ' ' .. tag, function(d, g)
      return dlua.empty(s, { dtype = dt, device = d }):uniform_(-2.5, 7, { generator = g })
    end)
    check_fill('normal_ ' .. dt .. ' ' .. tag, function(d, g)
      return dlua.empty(s, { dtype = dt, device = d }):normal_(3, 0.25, { generator = g })
    end)
  end
  for _, dt in ipairs(ALL) do
    check_fill('bernoulli_ ' .. dt .. ' ' .. tag, function(d) return dlua.empty(s, { dtype = dt, device = d }):bernoulli_(0.3) end)
  end
  for _, dt in ipairs({ 'int64', 'int32', 'uint8', 'float32', 'float16', 'bfloat16', 'float64' }) do
    local hi = ({ uint8 = 200, float16 = 2000, bfloat16 = 250 })[dt] or 1000
    check_fill('randint ' .. dt .. ' ' .. tag, function(d)
      return dlua.randint(-3 * (dt == 'uint8' and 0 or 1), hi, s, { dtype = dt, device = d })
    end)
  end
  check_fill('randint bool ' .. tag, function(d) return dlua.randint(0, 2, s, { dtype = 'bool', device = d }) end)
  -- Ranges that reject often (3 * 2^30: a quarter of the words are redrawn) and ranges above 2^32 (two words).
  check_fill('randint rejecting ' .. tag, function(d) return dlua.randint(0, 3 * 2 ^ 30, s, { device = d }) end)
  check_fill('randint wide ' .. tag, function(d, g)
    return dlua.randint(-2 ^ 40, 2 ^ 41 + 12345, s, { device = d, generator = g })
  end)
  check_fill('random_ ' .. tag, function(d) return dlua.empty(s, { dtype = 'int64', device = d }):random_(5, 17) end)
end
-- Non-contiguous targets are filled in row-major order of the view, as on the CPU.
check_fill('normal_ transposed view', function(d)
  local base = dlua.zeros(17, 13, { device = d })
  base:t():normal_()
  return base
end)
check_fill('uniform_ narrowed view', function(d, g)
  local base = dlua.zeros(9, 40, { dtype = 'float64', device = d })
  base:narrow(2, 5, 31):uniform_(0, 1, { generator = g })
  return base
end)
check_fill('bernoulli_ strided bool', function(d)
  local base = dlua.zeros(30, 7, { dtype = 'bool', device = d })
  base:t():bernoulli_(0.6)
  return base
end)
check_fill('randperm', function(d) return dlua.randperm(1031, { device = d }) end)
check_fill('consecutive fills', function(d, g)
  local a = dlua.randn(1031, { device = d, generator = g })
  local b = dlua.rand(77, { device = d, generator = g })
  local c = dlua.randn(5, { device = d })
  return dlua.cat({ a:cpu(), b:cpu(), c:cpu() }):to(d)
end)
check_fill('fill after set_offset', function(d, g)
  g:set_offset(123456789)
  return dlua.randn(4099, { device = d, generator = g })
end)
check_fill('uniform_ rejects ints', function(d) return dlua.empty(5, { dtype = 'int32', device = d }):uniform_() end)
check_fill('randint out of range', function(d) return dlua.randint(0, 300, { 5 }, { dtype = 'uint8', device = d }) end)

-- dropout: masks identical to the CPU's, outputs and gradients
for _, dt in ipairs(FLOATS) do
  for _, s in ipairs({ { 0 }, { 7 }, { 13, 17 }, { 100003 } }) do
    for _, p in ipairs({ 0, 0.1, 0.5, 1 }) do
      local tag = string.format('%s %s p %g', dt, shape_str(dlua.empty(s)), p)
      local x, gy = rand(dt, s), rand(dt, s, 1)
      check_fill('dropout mask ' .. tag, function(d, g)
        local _, mask = K.dropout(x:to(d), p, true, g)
        return mask
      end)
      check_fill('dropout ' .. tag, function(d, g)
        local out, mask = K.dropout(x:to(d), p, true, g)
        return dlua.cat({ out:cpu():double(), K.dropout_backward(gy:to(d), mask, p):cpu():double() }):to(d)
      end)
    end
  end
  check_fill('dropout strided ' .. dt, function(d)
    local x = rand(dt, { 17, 13 }):to(d):t()
    local out, mask = K.dropout(x, 0.3, true)
    return dlua.cat({ out:cpu():double():view(-1), mask:cpu():double():view(-1) }):to(d)
  end)
  check_fill('dropout eval ' .. dt, function(d)
    local out = K.dropout(rand(dt, { 5, 3 }):to(d), 0.5, false)
    return out
  end)
end
check_fill('nn.Dropout module', function(d)
  local m = nn.Dropout(0.25)
  local x = dlua.ones(64, 33, { device = d })
  local y = m:forward(x)
  return dlua.cat({ y:cpu():view(-1), m:backward(x, x):cpu():view(-1) }):to(d)
end)

------------------------------------------------------------------------------------------------
-- LARS and LAMB: several parameters in one arena (one excluded, one with a zero gradient, one empty, one long enough
-- for several norm chunks), first and later steps, grad_scale; then an nn model stepped by optim.LARS, LAMB, Adam

for _, dt in ipairs({ 'float32', 'float64' }) do
  local ranges = { { 0, 37, false }, { 37, 5, true }, { 42, 0, false }, { 42, 100003, false }, { 100045, 64, false },
    { 100109, 1031, false } }
  local n = 100109 + 1031 + 3
  local P, G, B = rand(dt, { n }, 1), rand(dt, { n }, 0.01), rand(dt, { n }, 0.1)
  G:narrow(1, 100046, 64):zero_()  -- the fifth parameter has a zero gradient: plain momentum SGD
  for _, cfg in ipairs({ { first = true, wd = 0, scale = 1 }, { first = false, wd = 5e-4, scale = 0.5 },
    { first = false, wd = 1e-2, scale = 1, momentum = 0 } }) do
    local tag = string.format('%s first %s wd %g scale %g momentum %g', dt, tostring(cfg.first), cfg.wd, cfg.scale,
      cfg.momentum or 0.9)
    check('lars ' .. tag, 4, function(p, g, b)
      p, b = p:clone(), b:clone()
      K.lars_step(p, g, b, ranges, 0.1, cfg.momentum or 0.9, cfg.wd, 0.001, 1e-8, cfg.first, cfg.scale)
      return { p, b }
    end, P, G, B)
  end
  check('lars overlapping ranges ' .. dt, 4, function(p, g, b)
    p, b = p:clone(), b:clone()
    K.lars_step(p, g, b, { { 0, 10, false }, { 5, 10, false } }, 0.1, 0.9, 0, 0.001, 1e-8, true, 1)
    return p
  end, P, G, B)
  -- LAMB on the same table: moments from a later step's state, with and without bias correction
  local M, V = rand(dt, { n }, 0.01), rand(dt, { n }, 1e-4):abs()
  P:narrow(1, 38, 5):zero_()  -- the excluded second parameter also has |p| = 0
  for _, cfg in ipairs({ { step = 1, wd = 0.01, scale = 1, bc = true }, { step = 9, wd = 0, scale = 0.5, bc = true },
    { step = 3, wd = 0.1, scale = 1, bc = false } }) do
    local tag = string.format('%s step %d wd %g scale %g bias_correction %s', dt, cfg.step, cfg.wd, cfg.scale,
      tostring(cfg.bc))
    check('lamb ' .. tag, 4, function(p, g, m, v)
      p, m, v = p:clone(), m:clone(), v:clone()
      K.lamb_step(p, g, m, v, ranges, 0.01, 0.9, 0.999, 1e-6, cfg.wd, cfg.step, cfg.bc, cfg.scale)
      return { p, m, v }
    end, P, G, M, V)
  end
  check('lamb overlapping ranges ' .. dt, 4, function(p, g, m, v)
    p, m, v = p:clone(), m:clone(), v:clone()
    K.lamb_step(p, g, m, v, { { 0, 10, false }, { 5, 10, false } }, 0.01, 0.9, 0.999, 1e-6, 0, 1, true, 1)
    return p
  end, P, G, M, V)
end
-- optim.LARS, LAMB and Adam (after clip_grad_norm_) stepping an nn model, on the device against the CPU
for _, which in ipairs({ 'LARS', 'LAMB', 'Adam+clip' }) do
  local function model_steps(d)
    dlua.manual_seed(77)
    local m = nn.Sequential(nn.Linear(23, 17), nn.ReLU(), nn.Dropout(0.2), nn.Linear(17, 5)):to(d)
    local crit = nn.CrossEntropyLoss { label_smoothing = 0.1, weight = dlua.rand(5):add(0.5) }:to(d)
    local opt = which == 'LARS' and optim.LARS(m, { lr = 0.5, momentum = 0.9, weight_decay = 1e-4 })
      or which == 'LAMB' and optim.LAMB(m, { lr = 0.05, weight_decay = 0.01,
        exclude = function(name) return name == '0.bias' end })
      or optim.Adam(m, { lr = 0.01, weight_decay = 1e-3 })
    local x, y = dlua.randn(31, 23):to(d), dlua.randint(1, 6, { 31 }):to(d)
    local losses, norms = {}, {}
    for i = 1, 3 do
      opt:zero_grad()
      local out = m:forward(x)
      losses[i] = crit:forward(out, y):cpu():double()
      m:backward(x, crit:backward(out, y))
      if which == 'Adam+clip' then norms[i] = nn.utils.clip_grad_norm_(m, 0.05) end
      opt:step()
    end
    local parts = {}
    for _, e in ipairs(m:named_parameters()) do parts[#parts + 1] = e.param:cpu():double():view(-1) end
    for i = 1, 3 do parts[#parts + 1] = losses[i]:view(1) end
    if #norms > 0 then parts[#parts + 1] = dlua.tensor(norms, { dtype = 'float64' }) end
    return dlua.cat(parts)
  end
  local name = 'optim.' .. which .. ' nn model 3 steps'
  local ok1, r1 = pcall(model_steps, 'cpu')
  local ok2, r2 = pcall(model_steps, dev)
  if ok1 and ok2 then
    compare(name, r1, r2:to(dev), 100 * TOL.float32)
  else
    checks = checks + 1
    fail(name, tostring(ok1 and r2 or r1))
  end
end

------------------------------------------------------------------------------------------------
-- errors and determinism (GPU only)

if on_gpu then
  local function expect_both(name, fn)
    local ok, e = pcall(fn)
    checks = checks + 1
    if ok or not tostring(e):find('cpu') or not tostring(e):find('cuda') then
      fail(name, 'expected an error naming both devices, got ' .. tostring(e))
    end
  end
  local xc, xd = dlua.randn(6, 5), dlua.randn(6, 5):to(dev)
  local lc, ld = dlua.randint(1, 6, { 6 }), dlua.randint(1, 6, { 6 }):to(dev)
  expect_both('mixed cross_entropy', function() return K.cross_entropy(xd, lc) end)
  expect_both('mixed cross_entropy weight', function() return K.cross_entropy(xd, ld, dlua.ones(5)) end)
  expect_both('mixed mse_loss', function() return K.mse_loss(xd, xc) end)
  expect_both('mixed softmax_backward', function() return K.softmax_backward(xc, xd, 1, false) end)
  expect_both('mixed relu_backward', function() return K.relu_backward(xd, xc) end)
  expect_both('mixed dropout_backward', function() return K.dropout_backward(xd, dlua.ones(6, 5, { dtype = 'bool' }), 0.5) end)
  expect_both('mixed lars', function()
    K.lars_step(xd:view(-1), xc:view(-1), xd:view(-1):clone(), { { 0, 30, false } }, 0.1, 0.9, 0, 0.001, 1e-8, true, 1)
  end)
  -- Determinism: the same reduced losses twice give the same bits.
  local big, lab = dlua.randn(4096, 1000):to(dev), dlua.randint(1, 1001, { 4096 }):to(dev)
  local a = K.cross_entropy(big, lab, nil, 'mean', 0.1):cpu()
  local b = K.cross_entropy(big, lab, nil, 'mean', 0.1):cpu()
  local m1, m2 = K.mse_loss(big, big * 0.5, 'sum'):cpu(), K.mse_loss(big, big * 0.5, 'sum'):cpu()
  checks = checks + 1
  if a:ne(b):any():item() or m1:ne(m2):any():item() then fail('loss determinism', 'two runs differ') end
end

------------------------------------------------------------------------------------------------
-- report

H.report({ title = 'ops_loss_rand on ' .. dev, checks = checks, results = results, failures = failures, both_failed = both_failed, t_start = t_start })
