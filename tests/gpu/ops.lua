-- Every op that runs on CUDA against the CPU backend: random inputs at odd shapes (1, primes, empty),
-- non-contiguous views, broadcasting, special values; error norms per op and dtype; then the error paths
-- (mixed devices) and a GEMM / bandwidth benchmark. Run by tests/gpu/run.sh:
--   dlua tests/gpu/ops.lua [device]        device: 'cuda' (default), 'cuda:N', or 'cpu'
-- With 'cpu' the same comparisons run CPU against CPU: that checks the script itself where no GPU is.
local dlua = require 'dlua'
local H = require 'tests.gpu.harness'
local dev, on_gpu, want_device = H.device(arg)
local t_start = os.clock()

dlua.manual_seed(1234)

local FLOATS = H.FLOATS
local INTS = { 'int32', 'int64', 'uint8', 'bool' }
local ALL = H.ALL
local is_float = H.is_float
local TOL = H.TOL
local shape_str, rel_error = H.shape_str, H.rel_error

local results, failures, checks, both_failed = {}, {}, 0, {}

local function fail(name, msg)
  failures[#failures + 1] = name .. ': ' .. msg
end

-- Compares one result: got on the device against ref from the CPU. tol nil: exact.
local function compare(name, ref, got, tol)
  checks = checks + 1
  local rec = { name = name, dtype = ref.dtype, shape = shape_str(ref), err = 0, tol = tol or 0, ok = true }
  results[#results + 1] = rec
  if got.device ~= (on_gpu and (dev == 'cuda' and 'cuda:0' or dev) or 'cpu') then
    rec.ok = false
    fail(name, 'result on ' .. got.device)
    return
  end
  got = got:cpu()
  if shape_str(got) ~= shape_str(ref) or got.dtype ~= ref.dtype then
    rec.ok = false
    fail(name, string.format('got %s %s, expected %s %s', shape_str(got), got.dtype, shape_str(ref), ref.dtype))
    return
  end
  local err
  if is_float[ref.dtype] then
    err = rel_error(ref, got)
  else
    err = ref:numel() == 0 and 0 or (ref:long():ne(got:long()):any():item() and math.huge or 0)
  end
  rec.err = err
  if not (err <= (tol or 0)) then
    rec.ok = false
    fail(name, string.format('%s %s: error %.3g > tolerance %.3g', ref.dtype, shape_str(ref), err, tol or 0))
  end
end

-- Runs fn on CPU inputs and on their device copies; both must succeed (and agree) or both fail.
local function check(name, dtype_tol, fn, ...)
  local cpu_in, dev_in = { ... }, {}
  for i, x in ipairs(cpu_in) do dev_in[i] = (type(x) == 'table' or type(x) == 'number') and x or x:to(dev) end
  local ok1, r1 = pcall(fn, unpack(cpu_in))
  local ok2, r2 = pcall(fn, unpack(dev_in))
  if not H.both_ran(name, ok1, r1, ok2, r2, failures, both_failed) then
    checks = checks + 1
    return
  end
  compare(name, r1, r2, dtype_tol and TOL[r1.dtype] and dtype_tol * TOL[r1.dtype] / TOL.float32 or nil)
end

local rand = H.rand

local SHAPES = { {}, { 1 }, { 7 }, { 0 }, { 13, 17 }, { 3, 1, 5 }, { 1031 }, { 4099 }, { 2, 3, 5, 7 }, { 64, 33 } }
-- Views that are not contiguous: each maps a fresh tensor of `base` sizes to a view.
local VIEWS = {
  { base = { 17, 13 }, name = 't', f = function(t) return t:t() end },
  { base = { 5, 40 }, name = 'narrow', f = function(t) return t:narrow(2, 3, 31) end },
  { base = { 2, 3, 5, 7 }, name = 'permute', f = function(t) return t:permute(4, 2, 1, 3) end },
  { base = { 1, 29 }, name = 'expand', f = function(t) return t:expand(6, 29) end },
}

local function for_inputs(dtypes, positive, body)
  for _, dt in ipairs(dtypes) do
    for _, s in ipairs(SHAPES) do body(dt, rand(dt, s, positive), shape_str(rand(dt, s))) end
    for _, v in ipairs(VIEWS) do body(dt, v.f(rand(dt, v.base, positive)), v.name) end
  end
end

-- Special values for the float predicates and NaN rules.
local function specials(dtype)
  return dlua.tensor({ 0 / 0, 1 / 0, -1 / 0, -0.0, 0, 1, -1, 0.5, -2.5, 1e-30, 65504, 3.5 }):to(dtype)
end

------------------------------------------------------------------------------------------------
-- element-wise

local UNARY_F = { 'neg', 'abs', 'sqrt', 'rsqrt', 'exp', 'log', 'tanh', 'sigmoid', 'relu', 'sign', 'reciprocal',
  'square', 'floor', 'ceil', 'round', 'sin', 'cos', 'log1p', 'expm1', 'isfinite', 'isnan', 'isinf', 'logical_not' }
local UNARY_I = { 'abs', 'relu', 'sign', 'square', 'floor', 'ceil', 'round', 'logical_not', 'isfinite', 'sqrt', 'exp' }

for_inputs(FLOATS, false, function(dt, x, tag)
  for _, op in ipairs(UNARY_F) do check(op .. ' ' .. tag, 4, function(t) return t[op](t) end, x) end
  check('clamp ' .. tag, 1, function(t) return t:clamp(-0.5, 0.5) end, x)
end)
for _, dt in ipairs(FLOATS) do
  local sx = specials(dt)
  for _, op in ipairs(UNARY_F) do check(op .. ' specials', 4, function(t) return t[op](t) end, sx) end
end
for_inputs(INTS, false, function(dt, x, tag)
  for _, op in ipairs(UNARY_I) do check(op .. ' ' .. tag, 4, function(t) return t[op](t) end, x) end
  if dt ~= 'bool' then check('neg ' .. tag, nil, function(t) return -t end, x) end
  check('clamp ' .. tag, nil, function(t) return t:clamp(-3, 7) end, x)
end)

local BINARY = { 'add', 'sub', 'mul', 'div', 'maximum', 'minimum', 'fmod', 'remainder', 'atan2', 'eq', 'ne', 'lt', 'le',
  'gt', 'ge', 'logical_and', 'logical_or', 'logical_xor' }
local BSHAPES = { { {}, {} }, { { 1 }, { 1 } }, { { 7 }, { 7 } }, { { 0 }, { 0 } }, { { 1031 }, { 1031 } },
  { { 13, 17 }, { 17 } }, { { 13, 1 }, { 1, 17 } }, { { 4099 }, {} }, { { 3, 1, 5 }, { 4, 1 } }, { { 2, 3, 5, 7 }, { 3, 1, 7 } } }
for _, dt in ipairs(ALL) do
  for _, sh in ipairs(BSHAPES) do
    local a, b = rand(dt, sh[1]), rand(dt, sh[2], true)  -- positive b: integer fmod/remainder need no zero
    local tag = shape_str(a) .. 'x' .. shape_str(b)
    for _, op in ipairs(BINARY) do check(op .. ' ' .. dt .. ' ' .. tag, 4, function(p, q) return p[op](p, q) end, a, b) end
    check('add alpha ' .. tag, 1, function(p, q) return p:add(q, 3) end, a, b)
    if is_float[dt] then
      check('pow ' .. tag, 4, function(p, q) return p:abs():pow(q) end, a, b)
      check('lerp_ ' .. tag, 1, function(p, q) return p:expand_as(p + q):clone():lerp_(q:expand_as(p + q), 0.3) end, a, b)
    end
  end
  local a = rand(dt, { 64, 33 })
  local at = rand(dt, { 33, 64 }, true):t()  -- positive: integer fmod/remainder need no zero
  for _, op in ipairs(BINARY) do check(op .. ' ' .. dt .. ' strided', 4, function(p, q) return p[op](p, q) end, a, at) end
  if dt ~= 'bool' then
    check('scalar add ' .. dt, 1, function(p) return p + 2 end, a)
    check('scalar rsub ' .. dt, 1, function(p) return 3 - p end, a)
    check('scalar mul frac ' .. dt, 1, function(p) return p * 0.5 end, a)
    check('scalar div ' .. dt, 1, function(p) return p / 3 end, a)
    check('scalar pow ' .. dt, 4, function(p) return p:pow(2) end, a)
    check('scalar remainder ' .. dt, 1, function(p) return p:remainder(3) end, a)
    check('scalar gt ' .. dt, nil, function(p) return p:gt(0) end, a)
    check('scalar strided ' .. dt, 1, function(p) return p * 2 end, at)
  end
end
for _, dt in ipairs(FLOATS) do
  local sx = specials(dt)
  local sy = dlua.tensor({ 1, 0 / 0, 1 / 0, 0, -0.0, 2, -1 / 0, 3, 0.5, -1, 1e30, 2 }):to(dt)
  for _, op in ipairs(BINARY) do check(op .. ' specials ' .. dt, 4, function(p, q) return p[op](p, q) end, sx, sy) end
  check('pow specials ' .. dt, 4, function(p, q) return p:pow(q) end, sx, sy)
end

-- where, masked_fill, addcmul/addcdiv, fill, copies, casts
for _, dt in ipairs(ALL) do
  local c = dlua.randint(0, 2, { 13, 17 }):bool()
  local a, b = rand(dt, { 13, 17 }), rand(dt, { 17 })
  check('where ' .. dt, nil, function(cc, p, q) return dlua.where(cc, p, q) end, c, a, b)
  check('where broadcast cond ' .. dt, nil, function(cc, p, q) return dlua.where(cc, p, q) end, c:narrow(1, 1, 1), a, b)
  check('where strided ' .. dt, nil, function(cc, p, q) return dlua.where(cc:t(), p:t(), q) end, c, a, rand(dt, { 13 }))
  check('masked_fill ' .. dt, nil, function(p, cc) return p:clone():masked_fill_(cc, 1) end, a, c)
  check('masked_fill broadcast ' .. dt, nil, function(p, cc) return p:clone():masked_fill_(cc, 0) end, a, c:narrow(1, 2, 1))
  check('fill_ ' .. dt, nil, function(p) return p:clone():fill_(2.75) end, a)
  check('fill_ strided ' .. dt, nil, function(p) local q = p:clone(); q:t():narrow(1, 2, 5):fill_(1); return q end, a)
  check('zeros ' .. dt, nil, function(p) return dlua.zeros({ 5, 3 }, { dtype = dt, device = p.device }) end, a)
  check('contiguous of t ' .. dt, nil, function(p) return p:t():contiguous() end, a)
  check('clone of permute ' .. dt, nil, function(p) return p:view(13, 17, 1):permute(3, 2, 1):clone() end, a)
  check('copy_ broadcast ' .. dt, nil, function(p, q) return p:clone():copy_(q) end, a, b)
  check('copy_ strided ' .. dt, nil, function(p) local q = p:clone(); q:narrow(2, 1, 13):copy_(p:narrow(2, 1, 13):t()); return q end, a)
  check('copy_ overlapping ' .. dt, nil, function(p) local q = p:clone(); q:narrow(2, 2, 16):copy_(q:narrow(2, 1, 16)); return q end, a)
  check('copy_ from cpu ' .. dt, nil, function(p, q) return p:clone():copy_(q:cpu()) end, a, b)
  for _, dt2 in ipairs(ALL) do
    check('cast ' .. dt .. '->' .. dt2, nil, function(p) return p:to(dt2) end, a)
    check('cast strided ' .. dt .. '->' .. dt2, nil, function(p) return p:t():to(dt2) end, a)
  end
  if is_float[dt] then
    check('cast specials ' .. dt, nil, function(p) return p:to('int32') end, specials(dt))
    local x = rand(dt, { 13, 17 })
    check('addcmul_ ' .. dt, 2, function(p, q, r) return p:clone():addcmul_(q, r, 0.5) end, x, a, b)
    check('addcdiv_ ' .. dt, 2, function(p, q, r) return p:clone():addcdiv_(q, r:abs() + 1, -2) end, x, a, b)
  elseif dt ~= 'bool' then
    check('addcmul_ ' .. dt, nil, function(p, q, r) return p:clone():addcmul_(q, r, 2) end, rand(dt, { 13, 17 }), a, b)
  end
end

------------------------------------------------------------------------------------------------
-- reductions

local RSHAPES = { { 1 }, { 7 }, { 0 }, { 13, 17 }, { 3, 0, 5 }, { 2, 3, 5, 7 }, { 100003 }, { 3, 70001 }, { 4099, 3 },
  { 2000, 31 } }
for _, dt in ipairs(ALL) do
  for _, s in ipairs(RSHAPES) do
    local x = rand(dt, s)
    local tag = dt .. ' ' .. shape_str(x)
    local red_tol = is_float[dt] and 1 or nil
    check('sum ' .. tag, red_tol, function(t) return t:sum() end, x)
    check('any ' .. tag, nil, function(t) return t:any() end, x)
    check('all ' .. tag, nil, function(t) return t:all() end, x)
    if is_float[dt] then check('mean ' .. tag, 1, function(t) return t:mean() end, x) end
    if dt ~= 'bool' and x:numel() > 0 then
      check('max ' .. tag, nil, function(t) return t:max() end, x)
      check('min ' .. tag, nil, function(t) return t:min() end, x)
      check('argmax ' .. tag, nil, function(t) return t:argmax() end, x)
      check('argmin ' .. tag, nil, function(t) return t:argmin() end, x)
    end
    for d = 1, #s do
      check('sum dim ' .. d .. ' ' .. tag, red_tol, function(t) return t:sum(d) end, x)
      check('sum keepdim ' .. d .. ' ' .. tag, red_tol, function(t) return t:sum(d, true) end, x)
      if is_float[dt] then check('mean dim ' .. d .. ' ' .. tag, 1, function(t) return t:mean(d) end, x) end
      if dt ~= 'bool' then
        check('max values dim ' .. d .. ' ' .. tag, nil, function(t) return (t:max(d)) end, x)
        check('max indices dim ' .. d .. ' ' .. tag, nil, function(t) local _, i = t:max(d); return i end, x)
        check('min indices dim ' .. d .. ' ' .. tag, nil, function(t) local _, i = t:min(d); return i end, x)
        check('argmax dim ' .. d .. ' ' .. tag, nil, function(t) return t:argmax(d) end, x)
      end
    end
  end
  local v = rand(dt, { 2, 3, 5, 7 }):permute(3, 1, 4, 2)
  check('sum strided dims ' .. dt, is_float[dt] and 1 or nil, function(t) return t:sum({ 1, 3 }) end, v)
  if dt ~= 'bool' then check('argmax strided ' .. dt, nil, function(t) return t:argmax(2) end, v) end
end
for _, dt in ipairs(FLOATS) do  -- NaN rules: the first NaN wins max/argmax; ties take the first position
  local sx = dlua.tensor({ 1, 3, 0 / 0, 3, 0 / 0, -1 }):to(dt)
  check('max nan ' .. dt, nil, function(t) return t:max() end, sx)
  check('argmax nan ' .. dt, nil, function(t) return t:argmax() end, sx)
  local ties = dlua.tensor({ { 1, 5, 5, 2 }, { 7, 7, 7, 7 } }):to(dt)
  check('argmax ties ' .. dt, nil, function(t) return t:argmax(2) end, ties)
  check('argmin ties ' .. dt, nil, function(t) return t:argmin(2) end, ties)
end

------------------------------------------------------------------------------------------------
-- matrix products

local MM = { { 1, 1, 1 }, { 7, 1, 5 }, { 1, 13, 1 }, { 33, 17, 65 }, { 129, 64, 31 }, { 256, 255, 257 }, { 5, 0, 3 } }
for _, dt in ipairs(FLOATS) do
  local tol = dt == 'float32' and 1 or (dt == 'float64' and 1 or 1)
  for _, mkn in ipairs(MM) do
    local m, k, n = mkn[1], mkn[2], mkn[3]
    local a, b = rand(dt, { m, k }), rand(dt, { k, n })
    local tag = dt .. ' ' .. m .. 'x' .. k .. 'x' .. n
    -- The error scale of a product is sqrt(k) ulps of |a||b|: normalise by the largest |ref| plus k.
    local ptol = TOL[dt] * 4 * math.sqrt(k + 1)
    local function pcheck(name, fn, ...)
      local args = { ... }
      local cpu_r = fn(unpack(args))
      local dargs = {}
      for i, x in ipairs(args) do dargs[i] = x:to(dev) end
      local ok, got = pcall(fn, unpack(dargs))
      checks = checks + 1
      if not ok then return fail(name, 'device failed: ' .. tostring(got)) end
      local scale = math.max(cpu_r:numel() > 0 and cpu_r:double():abs():max():item() or 0, 1)
      local err = cpu_r:numel() > 0 and ((cpu_r:double() - got:cpu():double()):abs():max():item() / scale) or 0
      local ok2 = err <= ptol and shape_str(cpu_r) == shape_str(got) and cpu_r.dtype == got.dtype
      results[#results + 1] = { name = name, dtype = dt, shape = shape_str(cpu_r), err = err, tol = ptol, ok = ok2 }
      if not ok2 then fail(name, string.format('error %.3g > %.3g (or shape/dtype differ)', err, ptol)) end
    end
    pcheck('mm ' .. tag, function(p, q) return dlua.mm(p, q) end, a, b)
    pcheck('mm a^T ' .. tag, function(p, q) return dlua.mm(p:t(), q) end, rand(dt, { k, m }), b)
    pcheck('mm b^T ' .. tag, function(p, q) return dlua.mm(p, q:t()) end, a, rand(dt, { n, k }))
    pcheck('mm sliced ' .. tag, function(p, q) return dlua.mm(p:narrow(2, 1, k), q) end, rand(dt, { m, k + 3 }), b)
    pcheck('addmm ' .. tag, function(c, p, q) return dlua.addmm(c, p, q, { beta = 0.5, alpha = 2 }) end,
      rand(dt, { n }), a, b)
    pcheck('bmm ' .. tag, function(p, q) return dlua.bmm(p, q) end, rand(dt, { 3, m, k }), rand(dt, { 3, k, n }))
    pcheck('matmul bcast ' .. tag, function(p, q) return dlua.matmul(p, q) end, rand(dt, { 2, 1, m, k }),
      rand(dt, { 3, k, n }))
    pcheck('matmul vec ' .. tag, function(p, q) return dlua.matmul(p, q) end, a, rand(dt, { k }))
  end
end

------------------------------------------------------------------------------------------------
-- fused optimizer steps and AMP unscaling over a flat arena range

local nnb = require 'bindings.nn'
local function joined(list) return dlua.cat(list) end
for _, dt in ipairs({ 'float32', 'float64' }) do
  for _, n in ipairs({ 1, 7, 1031, 100003 }) do
    local P, G = rand(dt, { n + 5 }), rand(dt, { n + 5 })
    local M1, V1 = rand(dt, { n + 5 }), rand(dt, { n + 5 }):abs()
    local tag = dt .. ' ' .. n
    -- Each returns the updated buffers, concatenated, so one comparison covers them all.
    check('sgd momentum ' .. tag, 2, function(p, g, b)
      p, b = p:clone(), b:clone()
      nnb.sgd_step(p, g, b, 2, n, 0.1, 0.9, 0.1, 1e-4, false, false, false, 1)
      return joined({ p, b })
    end, P, G, M1)
    check('sgd nesterov first ' .. tag, 2, function(p, g, b)
      p, b = p:clone(), b:clone()
      nnb.sgd_step(p, g, b, 0, n, 0.05, 0.9, 0, 0, true, true, true, 0.5)
      return joined({ p, b })
    end, P, G, M1)
    check('adamw ' .. tag, 2, function(p, g, m, v)
      p, m, v = p:clone(), m:clone(), v:clone()
      nnb.adamw_step(p, g, m, v, nil, 3, n, 1e-3, 0.9, 0.999, 1e-8, 0.01, 7, false, false, 1)
      return joined({ p, m, v })
    end, P, G, M1, V1)
    check('adamw amsgrad ' .. tag, 2, function(p, g, m, v, vm)
      p, m, v, vm = p:clone(), m:clone(), v:clone(), vm:clone()
      nnb.adamw_step(p, g, m, v, vm, 0, n, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1, true, false, 0.25)
      return joined({ p, m, v, vm })
    end, P, G, M1, V1, V1 * 0.5)
    check('adam l2 ' .. tag, 2, function(p, g, m, v)
      p, m, v = p:clone(), m:clone(), v:clone()
      nnb.adam_step(p, g, m, v, nil, 3, n, 1e-3, 0.9, 0.999, 1e-8, 0.05, 7, false, false, 1)
      return joined({ p, m, v })
    end, P, G, M1, V1)
    check('adam amsgrad maximize ' .. tag, 2, function(p, g, m, v, vm)
      p, m, v, vm = p:clone(), m:clone(), v:clone(), vm:clone()
      nnb.adam_step(p, g, m, v, vm, 0, n, 1e-3, 0.9, 0.999, 1e-8, 0.1, 1, true, true, 0.25)
      return joined({ p, m, v, vm })
    end, P, G, M1, V1, V1 * 0.5)
  end
end
for _, dt in ipairs(FLOATS) do
  local g = dlua.cat({ rand(dt, { 1031 }), specials(dt), rand(dt, { 4099 }) })
  check('unscale ' .. dt, 1, function(t)
    t = t:clone()
    local bad = nnb.unscale(t, 3, t:numel() - 3, 1 / 1024)
    return joined({ t:to('float64'), dlua.tensor({ bad }, { dtype = 'float64', device = t.device }) })
  end, g)
end

-- clip_grad_norm_'s pieces: partial norms over several chunks (and with Inf/NaN), then the scale
for _, dt in ipairs(FLOATS) do
  local g = dlua.cat({ rand(dt, { 1031 }), rand(dt, { 20011 }) })
  for _, p in ipairs({ 2, 1, 3.5, math.huge }) do
    check(('grad_norm_partial p %g %s'):format(p, dt), 1, function(t)
      return dlua.tensor({ nnb.grad_norm_partial(t, 3, t:numel() - 3, p) }, { dtype = 'float64', device = t.device })
    end, g)
    check(('grad_norm_partial specials p %g %s'):format(p, dt), 1, function(t)
      return dlua.tensor({ nnb.grad_norm_partial(t, 0, t:numel(), p), nnb.grad_norm_partial(t, 1, 2, p),
        nnb.grad_norm_partial(t, 3, t:numel() - 3, p) },
        { dtype = 'float64', device = t.device })
    end, specials(dt))
  end
  check('grad_scale ' .. dt, 1, function(t)
    t = t:clone()
    nnb.grad_scale(t, 3, t:numel() - 3, 0.37)
    return t
  end, g)
end

------------------------------------------------------------------------------------------------
-- errors, determinism, benchmarks (GPU only)

local notes = {}
if on_gpu then
  local x, xd = dlua.randn(5, 3), dlua.randn(5, 3):to(dev)
  local ok, e = pcall(function() return x + xd end)
  checks = checks + 1
  if ok or not tostring(e):find('cpu') or not tostring(e):find('cuda') then
    fail('mixed devices', 'expected an error naming both devices, got ' .. tostring(e))
  end
  -- Determinism: the same sum twice gives the same bits.
  local big = dlua.randn(3, 1000003):to(dev)
  local s1, s2 = big:sum(2):cpu(), big:sum(2):cpu()
  checks = checks + 1
  if s1:ne(s2):any():item() then fail('sum determinism', 'two runs differ') end

  if H.timed(notes) then
    local cuda = dlua.cuda
    local time_ms = H.time_ms
    for _, dt in ipairs({ 'bfloat16', 'float16', 'float32' }) do
      local N = 8192
      local a, b = dlua.randn(N, N):to { device = dev, dtype = dt }, dlua.randn(N, N):to { device = dev, dtype = dt }
      local out = dlua.mm(a, b)
      local ms = time_ms(function() out = dlua.mm(a, b) end, 10)
      notes[#notes + 1] = string.format('GEMM %d^3 %-8s %8.3f ms  %7.1f TFLOP/s', N, dt, ms, 2 * N ^ 3 / ms / 1e9)
      a:free(); b:free(); out:free()
    end
    cuda.set_allow_tf32(true)
    do
      local N = 8192
      local a, b = dlua.randn(N, N):to(dev), dlua.randn(N, N):to(dev)
      local ms = time_ms(function() dlua.mm(a, b):free() end, 10)
      notes[#notes + 1] = string.format('GEMM %d^3 tf32     %8.3f ms  %7.1f TFLOP/s', N, ms, 2 * N ^ 3 / ms / 1e9)
    end
    cuda.set_allow_tf32(false)
    local n = 64 * 1024 * 1024
    local a, b = dlua.randn(n):to(dev), dlua.randn(n):to(dev)
    local ms = time_ms(function() (a + b):free() end, 20)
    notes[#notes + 1] = string.format('add f32 %dM elements %.3f ms  %.0f GB/s', n / 1048576, ms, 3 * 4 * n / ms / 1e6)
    ms = time_ms(function() a:sum() end, 20)
    notes[#notes + 1] = string.format('sum f32 %dM elements %.3f ms  %.0f GB/s', n / 1048576, ms, 4 * n / ms / 1e6)
    ms = time_ms(function() a:view(8192, 8192):t():contiguous():free() end, 10)
    notes[#notes + 1] = string.format('transpose copy 8192^2 f32 %.3f ms  %.0f GB/s', ms, 2 * 4 * n / ms / 1e6)
  end
end

------------------------------------------------------------------------------------------------
-- report

H.report({ title = 'device ' .. dev, checks = checks, results = results, failures = failures, both_failed = both_failed, notes = notes, t_start = t_start })
