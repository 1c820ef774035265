-- The backend test runner: every case of tests/backend/cases.lua in one mode, a table of error/tolerance per op, exit 1 on any failure.
--   dlua tests/backend/run.lua MODE [device] [--filter LUA_PATTERN] [--verbose]
--   MODE  cpu   the CPU backend against a float64 (integers: int64) computation of the same op on the CPU
--         emu   the CUDA backend on the CPU emulator (a -DDLUA_CUDA=EMU build) against the CPU backend
--         cuda  the CUDA backend on a real GPU against the CPU backend (tests/gpu/run.sh)
--   device (emu, cuda): 'cuda' (default) or 'cuda:N'
-- How to write a case, and the tolerance: docs/testing.md.
local dlua = require 'dlua'
local cases = require 'tests.backend.cases'

local mode, device, filter, verbose = nil, 'cuda', nil, false
do
  local i = 1
  while arg[i] do
    local a = arg[i]
    if a == '--filter' then i = i + 1; filter = arg[i]
    elseif a == '--verbose' then verbose = true
    elseif not mode then mode = a
    else device = a end
    i = i + 1
  end
end
if mode ~= 'cpu' and mode ~= 'emu' and mode ~= 'cuda' then
  io.stderr:write("usage: dlua tests/backend/run.lua cpu|emu|cuda [cuda:N] [--filter PATTERN] [--verbose]\n")
  os.exit(2)
end
if mode ~= 'cpu' then
  if not dlua.cuda.is_available() then
    print('backend ' .. mode .. ': skipped: no CUDA device available')
    os.exit(0)
  end
  local emulated = dlua.cuda.is_emulated()
  if (mode == 'emu') ~= emulated then
    io.stderr:write(string.format('backend %s: the CUDA device here is %s (use mode %s)\n', mode,
      emulated and 'the CPU emulator' or 'a real GPU', emulated and 'emu' or 'cuda'))
    os.exit(2)
  end
end
local want_device = mode == 'cpu' and 'cpu' or (device == 'cuda' and 'cuda:0' or device)
local t0 = dlua.perf_counter()

---------------------------------------------------------------------------------------------
-- Tolerance: one formula. A result element r (the reference) and g (under test) differ by
--   err = |g - r| / max(|r|, floor)
-- where floor is the result's own scale max|r| when the op reduces (K > 1 terms per element: sums
-- cancel, so an element's error follows the terms' size, not its own) and the dtype's smallest
-- normal otherwise. Allowed:
--   tol = ulps * eps(result dtype) + c * sqrt(K) * eps(accumulation dtype)
-- eps: 2^-52 float64, 2^-23 float32, 2^-10 float16, 2^-7 bfloat16; 16-bit ops accumulate in float32.
-- ulps (default 2) is the final rounding plus the op's own error in units of the result's last place
-- (a few for transcendental functions); c (default 2) the random-walk growth of summation error over
-- K terms in two different summation orders. The reference is rounded to the result's dtype first,
-- so overflow to infinity is compared as infinity. Integer and bool results, and cases marked exact
-- (indices, copies, random streams), must be equal. NaN must be where the reference has NaN.
local EPS = { float64 = 2 ^ -52, float32 = 2 ^ -23, float16 = 2 ^ -10, bfloat16 = 2 ^ -7 }
local ACC = { float64 = 'float64', float32 = 'float32', float16 = 'float32', bfloat16 = 'float32' }
local TINY = { float64 = 2.2250738585072014e-308, float32 = 1.1754943508222875e-38, float16 = 6.103515625e-05,
  bfloat16 = 1.1754943508222875e-38 }

local function tolerance(dt, K, case, case_dt)
  if case.exact or not EPS[dt] then return 0 end
  if case.eps_of_input and EPS[case_dt] then dt = case_dt end -- a wide result (float64 sums) of narrower math
  return (case.ulps or 2) * EPS[dt] + (case.c or 2) * math.sqrt(math.max(K, 1)) * EPS[ACC[dt]]
end

local function layout(t)
  if t:dim() == 4 and t:numel() > 0 and t:is_contiguous('channels_last') and not t:is_contiguous() then return 'channels-last' end
  return t:is_contiguous() and 'contiguous' or 'strided'
end

local function shape_str(t)
  local s = t:size()
  local p = {}
  for i = 1, #s do p[i] = tostring(s[i]) end
  return '(' .. table.concat(p, ',') .. ')'
end

-- -> err (math.huge when NaN/Inf positions differ), or nil and a message when shapes or dtypes differ
local function error_of(ref, got, K)
  if shape_str(ref) ~= shape_str(got) then return nil, 'shape ' .. shape_str(got) .. ', expected ' .. shape_str(ref) end
  if ref:numel() == 0 then return 0 end
  if not EPS[got.dtype] then
    if not EPS[ref.dtype] and ref.dtype ~= got.dtype then ref = ref:to(got.dtype) end
    return ref:double():ne(got:double()):any():item() and math.huge or 0
  end
  local r, g = ref:to(got.dtype):double(), got:double()
  local rnan, gnan = r:isnan(), g:isnan()
  if rnan:ne(gnan):any():item() then return math.huge end
  local fin = r:isfinite()
  if dlua.where(fin, 0.0, r):ne(dlua.where(fin, 0.0, g)):logical_and(rnan:logical_not()):any():item() then
    return math.huge -- an infinity on one side only, or of the other sign
  end
  local rr, gg = dlua.where(fin, r, 0.0), dlua.where(fin, g, 0.0)
  local floor = K > 1 and rr:abs():max():item() or TINY[got.dtype]
  if floor == 0 then floor = TINY[got.dtype] end
  local denom = dlua.where(rr:abs():gt(floor), rr:abs(), floor)
  return ((gg - rr):abs() / denom):max():item()
end

---------------------------------------------------------------------------------------------
-- Inputs: a case gives specs {shape, dtype = (default: the case's), gen = 'normal'|'positive'|'int'|
-- 'index', lo, hi, view = fn}; they are drawn once on the CPU (in the case's dtype) and placed on
-- each side: converted, moved, then viewed, so both sides see the same values in the same layout.

local function draw(spec, dt)
  local t
  local kind = spec.gen or 'normal'
  if spec.values then return dlua.tensor(spec.values):to(dt) end
  if kind == 'index' or kind == 'int' or not EPS[dt] then
    local lo, hi = spec.lo or -40, spec.hi or 40
    if dt == 'bool' then lo, hi = 0, 2 elseif dt == 'uint8' then lo = math.max(lo, 0) end
    t = dlua.randint(lo, hi, spec.shape, { dtype = dt == 'bool' and 'int64' or dt })
    if dt == 'bool' then t = t:bool() end
    if kind == 'positive' and dt ~= 'bool' then t = t:abs() + 1 end
  else
    t = dlua.randn(spec.shape, { dtype = 'float32' }) * (spec.scale or 3)
    if kind == 'positive' then t = t:abs() + 0.05 end
    t = t:to(dt)
  end
  return t
end

local function ref_dtype(dt)
  if EPS[dt] then return 'float64' end
  if dt == 'bool' then return 'bool' end
  return 'int64'
end

local function place(base, spec, dtype, dev)
  local t = base:to({ dtype = dtype, device = dev })
  if rawequal(t, base) then t = t:clone() end -- in-place ops must not reach the other side's input
  if spec.view then t = spec.view(t) end
  return t
end

---------------------------------------------------------------------------------------------

local results, failures, both_failed, nchecks = {}, {}, {}, 0
local function fail(name, msg) failures[#failures + 1] = name .. ': ' .. msg end

local function as_list(r)
  if type(r) == 'table' and getmetatable(r) == nil then return r end
  return { r }
end

local function run_one(case, dt, inst)
  local name = case.op .. ' ' .. dt .. ' ' .. inst.tag
  if filter and not name:find(filter) then return end
  local specs = inst.inputs
  local bases = {}
  for i, s in ipairs(specs) do bases[i] = draw(s, s.dtype or dt) end
  local function side(dtype_of, dev)
    local xs = {}
    for i, s in ipairs(specs) do xs[i] = place(bases[i], s, s.dtype or dtype_of(dt), dev) end
    return xs
  end
  local saved_threads
  if inst.threads then
    saved_threads = dlua.get_num_threads()
    dlua.set_num_threads(inst.threads)
  end
  local ok1, r1, ok2, r2
  if case.rejects then -- it must fail, naming both devices
    local ok, e = pcall(case.fn, inst, side(function(d) return d end, 'cpu'), side(function(d) return d end, want_device))
    if saved_threads then dlua.set_num_threads(saved_threads) end
    nchecks = nchecks + 1
    e = tostring(e)
    local good = not ok and e:find('cpu', 1, true) and e:find('cuda', 1, true)
    results[#results + 1] = { op = case.op, dtype = dt, err = good and 0 or math.huge, tol = 0, ok = good and true or false }
    if not good then fail(name, ok and 'accepted tensors on two devices' or ('the error does not name both devices: ' .. e)) end
    return
  end
  if mode == 'cpu' then
    local a, b = side(ref_dtype, 'cpu'), side(function(d) return d end, 'cpu')
    dlua.manual_seed(99)
    ok1, r1 = pcall(case.fn, inst, unpack(a))
    dlua.manual_seed(99)
    ok2, r2 = pcall(case.fn, inst, unpack(b))
  else
    local a, b = side(function(d) return d end, 'cpu'), side(function(d) return d end, want_device)
    dlua.manual_seed(99) -- the same default generator state for both (random streams)
    ok1, r1 = pcall(case.fn, inst, unpack(a))
    dlua.manual_seed(99)
    ok2, r2 = pcall(case.fn, inst, unpack(b))
  end
  -- deterministic: the backend under test gives the same bits twice (device modes)
  local again
  if case.deterministic and mode ~= 'cpu' and ok2 then
    dlua.manual_seed(99)
    local ok3, r3 = pcall(case.fn, inst, unpack(side(function(d) return d end, want_device)))
    again = ok3 and as_list(r3) or false
  end
  if saved_threads then dlua.set_num_threads(saved_threads) end
  nchecks = nchecks + 1
  if case.must_fail then -- bad input: both sides refuse it
    if ok1 or ok2 then
      fail(name, string.format('accepted: the reference %s, the backend under test %s', ok1 and 'accepted' or 'refused',
        ok2 and 'accepted' or 'refused'))
    else
      both_failed[#both_failed + 1] = name .. ': ' .. tostring(r2):gsub('\n.*', '')
      results[#results + 1] = { op = case.op, dtype = dt, err = 0, tol = 0, ok = true }
    end
    return
  end
  if again == false then fail(name, 'failed when run again') return end
  if not (ok1 and ok2) then
    if ok1 ~= ok2 then
      fail(name, ok1 and ('failed under test: ' .. tostring(r2)) or ('the reference failed (' .. tostring(r1) .. ') but not the backend under test'))
    elseif case.refused and case.refused(dt, inst) then
      both_failed[#both_failed + 1] = name .. ': ' .. tostring(r1):gsub('\n.*', '')
    else -- a case that fails on both sides tests nothing: a broken case, or a lost feature
      fail(name, 'failed on both sides: ' .. tostring(r1):gsub('\n.*', ''))
    end
    return
  end
  local refs, gots = as_list(r1), as_list(r2)
  for j, ref in ipairs(refs) do
    local got = gots[j]
    local oname = #refs > 1 and (name .. ' [' .. (case.outputs and case.outputs[j] or j) .. ']') or name
    if got == nil then fail(oname, 'no result') goto continue end
    if again then
      nchecks = nchecks + 1
      local e = error_of(got:cpu(), again[j]:cpu(), 1)
      if e ~= 0 then fail(oname, 'two runs differ (not deterministic)') end
    end
    if got.device ~= want_device then fail(oname, 'result on ' .. got.device .. ', expected ' .. want_device) goto continue end
    if mode ~= 'cpu' then
      if got.dtype ~= ref.dtype then fail(oname, 'dtype ' .. got.dtype .. ', the CPU gives ' .. ref.dtype) goto continue end
      if ref:numel() > 0 and layout(got) ~= layout(ref) then
        fail(oname, 'layout ' .. layout(got) .. ', the CPU gives ' .. layout(ref))
        goto continue
      end
    end
    do
      local K = inst.K or 1
      local tol = tolerance(got.dtype, K, case, dt)
      local err, msg = error_of(ref:cpu(), got:cpu(), K)
      if err == nil then fail(oname, msg) goto continue end
      results[#results + 1] = { op = case.op, dtype = dt, err = err, tol = tol, ok = err <= tol }
      if not (err <= tol) then
        fail(oname, string.format('%s %s: error %.3g > tolerance %.3g (K = %d)', got.dtype, shape_str(got), err, tol, K))
      elseif verbose then
        print(string.format('ok %s: %.3g <= %.3g', oname, err, tol))
      end
    end
    ::continue::
  end
end

for _, case in ipairs(cases) do
  if not case.modes or case.modes[mode] then
    for _, dt in ipairs(case.dtypes) do
      dlua.manual_seed(case.seed or 1234)
      for _, inst in ipairs(case.instances(dt)) do run_one(case, dt, inst) end
    end
  end
end

---------------------------------------------------------------------------------------------
-- report: per op and the case's dtype (the inputs'), the checks, failures and the worst err/tol

local rows, width = {}, 10
for _, r in ipairs(results) do
  local key = r.op .. ' ' .. r.dtype
  width = math.max(width, #key)
  local e = rows[key] or { n = 0, bad = 0, worst = 0 }
  e.n, e.bad = e.n + 1, e.bad + (r.ok and 0 or 1)
  local ratio = r.tol > 0 and r.err / r.tol or (r.err > 0 and math.huge or 0)
  if ratio > e.worst then e.worst = ratio end
  rows[key] = e
end
local keys = {}
for k in pairs(rows) do keys[#keys + 1] = k end
table.sort(keys)
print(string.format('backend %s on %s: %d checks, %d failures (%.1f s)', mode, want_device, nchecks, #failures,
  dlua.perf_counter() - t0))
print(string.format('%-' .. width .. 's %7s %7s %13s', 'op dtype', 'checks', 'failed', 'worst err/tol'))
for _, k in ipairs(keys) do
  local e = rows[k]
  print(string.format('%-' .. width .. 's %7d %7d %13.3g', k, e.n, e.bad, e.worst))
end
print(string.format('%d checks of bad input, refused on both sides as they must be:', #both_failed))
for i, f in ipairs(both_failed) do
  if i > 40 then print(string.format('  ... and %d more', #both_failed - 40)) break end
  print('  ' .. f)
end
for i, f in ipairs(failures) do
  if i > 100 then print(string.format('... and %d more', #failures - 100)) break end
  print('FAIL ' .. f)
end
os.exit(#failures == 0 and 0 or 1)
