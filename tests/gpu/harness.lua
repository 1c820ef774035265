-- What the GPU comparison scripts (tests/gpu/ops*.lua) share: the device argument, dtype lists and
-- tolerances, shapes as text, the relative error of a device result against the CPU's, CUDA event
-- timing, random inputs, and the closing report (a table per op, notes, errors both backends raised, failures; exit
-- status 1 on any failure).
local dlua = require 'dlua'

local H = {}

H.FLOATS = { 'float32', 'float64', 'float16', 'bfloat16' }
H.ALL = { 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64', 'uint8', 'bool' }
H.is_float = { float32 = true, float64 = true, float16 = true, bfloat16 = true }
-- Relative error allowed per element: |ref - got| / max(|ref|, 1). f16/bf16 results are rounded once
-- from f32 on both sides, so a one-ulp difference in the f32 math shows as at most one 16-bit ulp.
H.TOL = { float64 = 1e-12, float32 = 1e-5, float16 = 2e-3, bfloat16 = 1.6e-2 }

-- The outcomes of one op run on the CPU (ok1, r1) and on the device (ok2, r2), pcall's results:
-- true when both succeeded (the caller compares r1 and r2); otherwise records the check and returns
-- false: one side failing goes into failures, both failing (the same behaviour) into both_failed, so
-- that a check broken on both sides still shows in the report.
function H.both_ran(name, ok1, r1, ok2, r2, failures, both_failed)
  if ok1 and ok2 then return true end
  if ok1 ~= ok2 then
    failures[#failures + 1] = name .. ': ' ..
      (ok1 and ('device failed: ' .. tostring(r2)) or ('CPU failed (' .. tostring(r1) .. ') but device succeeded'))
  else
    both_failed[#both_failed + 1] = name .. ': ' .. tostring(r1):gsub('\n.*', '')
  end
  return false
end

-- Random inputs of a dtype and shape (a table of sizes, possibly empty for 0-d), drawn on the CPU
-- from dlua's generator: floats N(0, 9) (positive: |x| + 0.05), bool 0/1, uint8 0..199 (positive
-- 1..199), other integers -40..39 (positive 1..39).
function H.rand(dtype, sizes, positive)
  local t
  if H.is_float[dtype] then
    t = dlua.randn(sizes, { dtype = 'float32' }) * 3
    if positive then t = t:abs() + 0.05 end
    t = t:to(dtype)
  elseif dtype == 'bool' then
    t = dlua.randint(0, 2, sizes):bool()
  elseif dtype == 'uint8' then
    t = dlua.randint(positive and 1 or 0, 200, sizes, { dtype = 'uint8' })
  else
    t = dlua.randint(positive and 1 or -40, 40, sizes, { dtype = dtype })
  end
  return t
end

-- dev ('cuda', 'cuda:N' or 'cpu', from the script's first argument), whether it is a GPU, and the
-- device name results must carry.
function H.device(argv)
  local dev = (argv and argv[1]) or 'cuda'
  local on_gpu = dev ~= 'cpu'
  return dev, on_gpu, on_gpu and (dev == 'cuda' and 'cuda:0' or dev) or 'cpu'
end

function H.shape_str(t)
  local s = t:size()
  local parts = {}
  for i = 1, #s do parts[i] = tostring(s[i]) end
  return '(' .. table.concat(parts, ',') .. ')'
end

-- Largest relative element error between CPU tensors ref and got (same shape); NaN positions must agree
-- and infinities must be equal.
function H.rel_error(ref, got)
  if ref:numel() == 0 then return 0 end
  local r, g = ref:double(), got:double()
  local same = r:eq(g):logical_or(r:isnan():logical_and(g:isnan()))
  local diff = dlua.where(same, 0.0, (r - g):abs())         -- NaN where exactly one side is NaN
  if diff:isnan():any():item() then return math.huge end
  local denom = dlua.where(r:abs():gt(1), r:abs(), 1.0)
  denom = dlua.where(r:isfinite(), denom, 1.0)
  return (diff / denom):max():item()
end

-- Whether the CUDA devices are the CPU emulator (a -DDLUA_CUDA=EMU build, docs/cuda.md#emulator): the
-- comparisons run as on a GPU; the timings are skipped (H.timed).
H.emulated = dlua.cuda.is_emulated()

-- Whether to run a script's timing section: not on the emulator, where it says so in the notes.
function H.timed(notes)
  if not H.emulated then return true end
  notes[#notes + 1] = 'timings: skipped (the CUDA device is the CPU emulator)'
  return false
end

-- Milliseconds per call of fn on the current CUDA stream (one warm-up call, then reps timed by events).
function H.time_ms(fn, reps)
  local cuda = dlua.cuda
  fn()
  cuda.synchronize()
  local e0, e1 = cuda.Event { enable_timing = true }, cuda.Event { enable_timing = true }
  e0:record()
  for _ = 1, reps do fn() end
  e1:record()
  e1:synchronize()
  return e0:elapsed_time(e1) / reps
end

-- Prints the report and exits. r: title, checks, results ({name, dtype, ok, err, tol}), failures,
-- both_failed, and optionally notes, skipped, by_dtype (one row per op and dtype), t_start (os.clock()).
function H.report(r)
  local by_op, width = {}, 18
  for _, x in ipairs(r.results) do
    local op = x.name:match('^(%S+)')
    if r.by_dtype and x.dtype then op = op .. ' ' .. x.dtype end
    width = math.max(width, #op)
    local e = by_op[op] or { n = 0, bad = 0, worst = 0 }
    e.n = e.n + 1
    if not x.ok then e.bad = e.bad + 1 end
    if x.tol > 0 and x.err / x.tol > e.worst then e.worst = x.err / x.tol end
    if x.tol == 0 and x.err > 0 then e.worst = math.huge end
    by_op[op] = e
  end
  local ops = {}
  for op in pairs(by_op) do ops[#ops + 1] = op end
  table.sort(ops)
  print(string.format('%s: %d checks, %d failures (%.1f s)', r.title, r.checks, #r.failures,
    os.clock() - (r.t_start or 0)))
  print(string.format('%-' .. width .. 's %7s %7s %12s', 'op', 'checks', 'failed', 'worst err/tol'))
  for _, op in ipairs(ops) do
    local e = by_op[op]
    print(string.format('%-' .. width .. 's %7d %7d %12.3g', op, e.n, e.bad, e.worst))
  end
  for _, n in ipairs(r.notes or {}) do print(n) end
  print(string.format('%d checks raised the same error on both backends (expected for invalid inputs):', #r.both_failed))
  for i, f in ipairs(r.both_failed) do
    if i > 200 then print(string.format('  ... and %d more', #r.both_failed - 200)) break end
    print('  ' .. f)
  end
  for _, f in ipairs(r.skipped or {}) do print('SKIP ' .. f) end
  for i, f in ipairs(r.failures) do
    if i > 200 then print(string.format('... and %d more', #r.failures - 200)) break end
    print('FAIL ' .. f)
  end
  os.exit(#r.failures == 0 and 0 or 1)
end

return H
