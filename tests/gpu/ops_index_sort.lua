-- Indexing, sorting and the remaining reductions on CUDA against the CPU backend: index_select, gather,
-- scatter_add_, cat, stack, one_hot, sort, topk, prod, norm, var, std, count_nonfinite. Every dtype, every dim,
-- sizes 1, primes and 0, non-contiguous views, duplicates and NaN, k = 0 and k = n, long rows; then the error
-- paths (out-of-range indices give the CPU's message; mixed devices name both tensors), bit-for-bit determinism
-- of scatter_add_ and a few GPU timings. Run by tests/gpu/run.sh:
--   dlua tests/gpu/ops_index_sort.lua [device]        device: 'cuda' (default), 'cuda:N', or 'cpu'
-- With 'cpu' the same comparisons run CPU against CPU: that checks the script itself where no GPU is.
local dlua = require 'dlua'
local H = require 'tests.gpu.harness'
local dev, on_gpu, want_device = H.device(arg)
local t_start = os.clock()

dlua.manual_seed(2718)

local FLOATS = H.FLOATS
local ALL = H.ALL
local is_float = H.is_float
local TOL = H.TOL
local shape_str, rel_error = H.shape_str, H.rel_error

local results, failures, checks, both_failed, notes = {}, {}, 0, {}, {}

local function fail(name, msg) failures[#failures + 1] = name .. ': ' .. msg end

-- Exact comparison that treats NaN as equal to NaN (floats) and compares the bits' meaning otherwise.
local function exact_error(ref, got)
  if ref:numel() == 0 then return 0 end
  if is_float[ref.dtype] then
    local r, g = ref:double(), got:double()
    local same = r:eq(g):logical_or(r:isnan():logical_and(g:isnan()))
    -- -0 and +0 compare equal: their signs must agree too (sort and gather move elements, not values).
    same = same:logical_and(r:sign():eq(g:sign()):logical_or(r:isnan()))
    same = same:logical_and((r:reciprocal():lt(0)):eq(g:reciprocal():lt(0)))
    return same:all():item() and 0 or math.huge
  end
  return ref:long():ne(got:long()):any():item() and math.huge or 0
end

-- One comparison: a result on the device against the CPU's. tol nil: exact.
local function compare(name, ref, got, tol)
  checks = checks + 1
  local rec = { name = name, dtype = ref.dtype, shape = shape_str(ref), err = 0, tol = tol or 0, ok = true }
  results[#results + 1] = rec
  if got.device ~= want_device then
    rec.ok = false
    fail(name, 'result on ' .. got.device .. ', expected ' .. want_device)
    return
  end
  got = got:cpu()
  if shape_str(got) ~= shape_str(ref) or got.dtype ~= ref.dtype then
    rec.ok = false
    fail(name, string.format('got %s %s, expected %s %s', shape_str(got), got.dtype, shape_str(ref), ref.dtype))
    return
  end
  local err = tol and is_float[ref.dtype] and rel_error(ref, got) or exact_error(ref, got)
  rec.err = err
  if not (err <= (tol or 0)) then
    rec.ok = false
    fail(name, string.format('%s %s: error %.3g > tolerance %.3g', ref.dtype, shape_str(ref), err, tol or 0))
  end
end

-- A tensor, or a Lua list of tensors, on the device under test.
local function to_dev(x)
  if dlua.is_tensor(x) then return x:to(dev) end
  local l = {}
  for i, t in ipairs(x) do l[i] = t:to(dev) end
  return l
end

-- Runs fn on CPU inputs and on their device copies (lists of tensors are moved element by element); both must
-- succeed and agree (every result, when fn returns several), or both fail (listed). tol: relative tolerance
-- scale for float results (nil: exact).
local function check(name, tol, fn, ...)
  local cpu_in, dev_in = { ... }, {}
  for i, x in ipairs(cpu_in) do dev_in[i] = type(x) == 'number' and x or to_dev(x) end
  local r1 = { pcall(fn, unpack(cpu_in)) }
  local r2 = { pcall(fn, unpack(dev_in)) }
  if r1[1] ~= r2[1] then
    checks = checks + 1
    fail(name, r1[1] and ('device failed: ' .. tostring(r2[2])) or ('CPU failed (' .. tostring(r1[2]) .. ') but device succeeded'))
    return
  end
  if not r1[1] then
    checks = checks + 1
    both_failed[#both_failed + 1] = name .. ': ' .. tostring(r1[2]):gsub('\n.*', '')
    return
  end
  for i = 2, #r1 do
    local ref = r1[i]
    compare(#r1 > 2 and (name .. ' #' .. (i - 1)) or name, ref, r2[i],
      tol and TOL[ref.dtype] and tol * TOL[ref.dtype] / TOL.float32 or nil)
  end
end

-- Both backends must reject fn's input with the same message (device names aside).
local function same_error(name, fn, ...)
  local cpu_in, dev_in = { ... }, {}
  for i, x in ipairs(cpu_in) do dev_in[i] = type(x) == 'number' and x or to_dev(x) end
  local ok1, e1 = pcall(fn, unpack(cpu_in))
  local ok2, e2 = pcall(fn, unpack(dev_in))
  checks = checks + 1
  -- First lines, without the caller's position (the two calls sit on different lines).
  e1 = tostring(e1):gsub('\n.*', ''):gsub('^[^:]*:%d+: ', '')
  e2 = tostring(e2):gsub('\n.*', ''):gsub('^[^:]*:%d+: ', ''):gsub('cuda:%d+', 'cpu')
  if ok1 or ok2 then
    fail(name, 'expected both backends to fail, got ' .. tostring(ok1) .. ' / ' .. tostring(ok2))
  elseif e1 ~= e2 then
    fail(name, 'messages differ: CPU "' .. e1 .. '", device "' .. e2 .. '"')
  end
end

local rand = H.rand

-- Few distinct values: ties everywhere (stability, first-position rules).
local function dups(dtype, sizes)
  return dlua.randint(-2, 3, sizes, { dtype = 'int64' }):to(dtype == 'bool' and 'bool' or dtype)
end

-- NaN, infinities, signed zeros and duplicates, repeated to n elements.
local function specials(dtype, n)
  local base = { 0 / 0, 1 / 0, -1 / 0, -0.0, 0, 1, -1, 0.5, -2.5, 1, 0 / 0, 3.5, -0.0, 1 / 0, 2 }
  local v = {}
  for i = 1, n do v[i] = base[(i - 1) % #base + 1] end
  return dlua.tensor(v):to(dtype)
end

local function idx(n, sizes, dtype) return dlua.randint(1, n + 1, sizes, { dtype = dtype or 'int64' }) end

local SHAPES = { {}, { 1 }, { 7 }, { 0 }, { 13, 17 }, { 3, 1, 5 }, { 2, 3, 5, 7 }, { 4, 0, 3 }, { 1031 } }
local VIEWS = {
  { base = { 17, 13 }, name = 't', f = function(t) return t:t() end },
  { base = { 5, 40 }, name = 'narrow', f = function(t) return t:narrow(2, 3, 31) end },
  { base = { 2, 3, 5, 7 }, name = 'permute', f = function(t) return t:permute(4, 2, 1, 3) end },
  { base = { 1, 29 }, name = 'expand', f = function(t) return t:expand(6, 29) end },
}
local function for_inputs(dtypes, body)
  for _, dt in ipairs(dtypes) do
    for _, s in ipairs(SHAPES) do
      local x = rand(dt, s)
      body(dt, x, dt .. ' ' .. shape_str(x))
    end
    for _, v in ipairs(VIEWS) do body(dt, v.f(rand(dt, v.base)), dt .. ' ' .. v.name) end
  end
end

------------------------------------------------------------------------------------------------
-- index_select, gather, scatter_add_

for_inputs(ALL, function(dt, x, tag)
  for d = 1, x:dim() do  -- (0-d inputs take no dim from Lua)
    local size = x:size(d)
    for _, ni in ipairs({ 0, 1, 5, 23 }) do
      if size > 0 or ni == 0 then
        local ix = idx(math.max(size, 1), { ni })
        check('index_select dim ' .. d .. ' n ' .. ni .. ' ' .. tag, nil, function(t, i) return t:index_select(d, i) end, x, ix)
      end
    end
    if size > 0 then
      local ix32 = idx(size, { 9 }, 'int32')
      check('index_select int32 dim ' .. d .. ' ' .. tag, nil, function(t, i) return t:index_select(d, i) end, x, ix32)
      local strided = idx(size, { 11, 4 }):t():select(1, 2)  -- a strided 1-D index (stride 4)
      check('index_select strided index dim ' .. d .. ' ' .. tag, nil, function(t, i) return t:index_select(d, i) end, x, strided)
      -- gather: index of x's shape, 1..size along d, smaller elsewhere where x allows.
      local gs = x:size()
      local gsz = {}
      for k = 1, #gs do gsz[k] = k == d and 6 or math.max(gs[k] - (k % 2), 0) end
      local gi = idx(size, gsz)
      check('gather dim ' .. d .. ' ' .. tag, nil, function(t, i) return t:gather(d, i) end, x, gi)
      if dt ~= 'bool' then
        -- scatter_add_ into a contiguous target of x's shape, src of gi's shape plus one along d.
        local ssz = {}
        for k = 1, #gsz do ssz[k] = gsz[k] + (k == d and 1 or 0) end
        local src = rand(dt, ssz)
        check('scatter_add_ dim ' .. d .. ' ' .. tag, nil,
          function(t, i, s) return t:contiguous():clone():scatter_add_(d, i, s) end, x, gi, src)
        check('scatter_add_ into view dim ' .. d .. ' ' .. tag, nil, function(t, i, s)
          local base = t:clone()
          base:scatter_add_(d, i, s)
          return base
        end, x:dim() == 2 and rand(dt, { x:size(2), x:size(1) }):t() or x:contiguous(), gi, src)
      end
    end
  end
end)

-- scatter_add_: both device paths (a thread per fiber; a stable sort of long fibers), duplicates everywhere,
-- other dtypes of src, non-contiguous src; the CPU's order of adds makes f16/bf16 results exact too.
for _, dt in ipairs({ 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64', 'uint8' }) do
  local cases = {
    { t = { 37 }, i = { 100003 }, d = 1, name = 'one long fiber' },
    { t = { 50, 8 }, i = { 5000, 8 }, d = 1, name = 'few long fibers' },
    { t = { 20000, 3 }, i = { 20000, 100 }, d = 2, name = 'many fibers' },
    { t = { 6, 9, 4 }, i = { 5, 200, 3 }, d = 2, name = 'middle dim' },
    { t = { 13, 17 }, i = { 13, 17 }, d = 2, name = 'short fibers' },
  }
  for _, c in ipairs(cases) do
    local tt = rand(dt, c.t, true)
    local ix = idx(c.t[c.d], c.i)
    local src = rand(dt, c.i, true)
    check('scatter_add_ ' .. c.name .. ' ' .. dt, nil, function(t, i, s) return t:clone():scatter_add_(c.d, i, s) end,
      tt, ix, src)
  end
  local tt = rand(dt, { 11, 7 })
  local src = rand(dt, { 9, 11 }):t()       -- (11, 9) strided
  local ix = idx(7, { 11, 9 }, 'int32')
  check('scatter_add_ strided src int32 index ' .. dt, nil, function(t, i, s) return t:clone():scatter_add_(2, i, s) end,
    tt, ix, src)
  check('scatter_add_ src float64 ' .. dt, nil, function(t, i, s) return t:clone():scatter_add_(2, i, s) end,
    tt, ix, rand('float64', { 11, 9 }))
  check('scatter_add_ aliasing src ' .. dt, nil, function(t, i) local u = t:clone(); return u:scatter_add_(2, i, u) end,
    tt, idx(7, { 11, 7 }))
end

------------------------------------------------------------------------------------------------
-- cat, stack, one_hot

for _, dt in ipairs(ALL) do
  for _, s in ipairs({ { 7 }, { 13, 17 }, { 3, 1, 5 }, { 2, 3, 5, 7 }, { 4, 0, 3 } }) do
    for d = 1, #s do
      local a, b = rand(dt, s), rand(dt, s)
      local s3 = {}
      for k = 1, #s do s3[k] = s[k] end
      s3[d] = 3
      local c = rand(dt, s3)
      local tag = dt .. ' ' .. shape_str(a) .. ' dim ' .. d
      check('cat ' .. tag, nil, function(l) return dlua.cat(l, d) end, { a, c, b })
      check('stack ' .. tag, nil, function(l) return dlua.stack(l, d) end, { a, b, a })
      check('stack last ' .. tag, nil, function(l) return dlua.stack(l, #s + 1) end, { b, a })
    end
  end
  local x = rand(dt, { 17, 13 })
  check('cat views ' .. dt, nil, function(l) return dlua.cat(l, 2) end, { x:t():narrow(2, 2, 5), rand(dt, { 13, 4 }), x:t() })
  check('cat promote ' .. dt, nil, function(l) return dlua.cat(l, 1) end, { rand(dt, { 3, 4 }), rand('float64', { 2, 4 }) })
  check('cat empty 1-d skipped ' .. dt, nil, function(l) return dlua.cat(l, 2) end, { x, rand(dt, { 0 }), x })
  check('stack views ' .. dt, nil, function(l) return dlua.stack(l, 2) end, { x:t(), x:t():contiguous() })
  check('one_hot ' .. dt, nil, function(l) return dlua.one_hot(l, 7, { dtype = dt }) end, idx(7, { 5, 3 }))
end
for _, it in ipairs({ 'int64', 'int32' }) do
  check('one_hot inferred ' .. it, nil, function(l) return dlua.one_hot(l) end, idx(11, { 101 }, it))
  check('one_hot 0-d ' .. it, nil, function(l) return dlua.one_hot(l, 4) end, dlua.tensor(3, { dtype = it }))
  check('one_hot empty ' .. it, nil, function(l) return dlua.one_hot(l, 4) end, idx(4, { 0, 3 }, it))
  check('one_hot strided ' .. it, nil, function(l) return dlua.one_hot(l, 9) end, idx(9, { 6, 5 }, it):t())
end

------------------------------------------------------------------------------------------------
-- sort and topk

for_inputs(ALL, function(dt, x, tag)
  for d = 1, x:dim() do
    for _, desc in ipairs({ false, true }) do
      check('sort dim ' .. d .. (desc and ' desc ' or ' ') .. tag, nil, function(t) return t:sort(d, desc) end, x)
    end
    local n = x:size(d)
    for _, k in ipairs({ 0, 1, 3, n }) do
      if k <= n then
        for _, o in ipairs({ { largest = true, sorted = true }, { largest = false, sorted = true },
          { largest = true, sorted = false }, { largest = false, sorted = false, by_magnitude = true },
          { largest = true, sorted = true, by_magnitude = true } }) do
          local otag = (o.largest and 'largest' or 'smallest') .. (o.sorted and ' sorted' or ' unsorted') ..
              (o.by_magnitude and ' |x|' or '')
          check('topk k ' .. k .. ' dim ' .. d .. ' ' .. otag .. ' ' .. tag, nil, function(t) return t:topk(k, d, o) end, x)
        end
      end
    end
  end
end)
for _, dt in ipairs(ALL) do  -- ties (stability; the lowest positions win top-k ties)
  local x = dups(dt, { 9, 301 })
  for d = 1, 2 do
    check('sort dups dim ' .. d .. ' ' .. dt, nil, function(t) return t:sort(d) end, x)
    check('sort dups desc dim ' .. d .. ' ' .. dt, nil, function(t) return t:sort(d, true) end, x)
    check('topk dups dim ' .. d .. ' ' .. dt, nil, function(t) return t:topk(4, d) end, x)
    check('topk dups unsorted dim ' .. d .. ' ' .. dt, nil, function(t) return t:topk(5, d, { sorted = false }) end, x)
    check('topk dups smallest |x| dim ' .. d .. ' ' .. dt, nil,
      function(t) return t:topk(5, d, { largest = false, by_magnitude = true }) end, x)
  end
end
for _, dt in ipairs(FLOATS) do  -- NaN sorts as the largest value; -0 and +0 tie
  for _, n in ipairs({ 15, 97 }) do
    local x = specials(dt, n)
    local x2 = dlua.stack({ x, x:neg(), specials(dt, n):abs() }, 2)
    check('sort specials ' .. n .. ' ' .. dt, nil, function(t) return t:sort() end, x)
    check('sort specials desc ' .. n .. ' ' .. dt, nil, function(t) return t:sort(1, true) end, x)
    check('sort specials 2-d dim 1 ' .. dt, nil, function(t) return t:sort(1) end, x2)
    check('topk specials 2-d dim 1 ' .. dt, nil, function(t) return t:topk(3, 1, { largest = false }) end, x2)
    check('topk specials ' .. n .. ' ' .. dt, nil, function(t) return t:topk(4) end, x)
    check('topk specials smallest ' .. n .. ' ' .. dt, nil, function(t) return t:topk(6, 1, { largest = false }) end, x)
    check('topk specials |x| unsorted ' .. n .. ' ' .. dt, nil,
      function(t) return t:topk(5, 1, { by_magnitude = true, sorted = false }) end, x)
  end
end
for _, dt in ipairs(ALL) do  -- long rows; several long rows (64-bit keys there take two sorting passes)
  local x = rand(dt, { 100003 })
  check('sort long ' .. dt, nil, function(t) return t:sort() end, x)
  check('sort long desc ' .. dt, nil, function(t) return t:sort(1, true) end, x)
  check('topk long k 1000 ' .. dt, nil, function(t) return t:topk(1000) end, x)
  check('topk long unsorted ' .. dt, nil, function(t) return t:topk(777, 1, { sorted = false }) end, x)
  local y = rand(dt, { 3, 40009 })
  check('sort rows ' .. dt, nil, function(t) return t:sort(2) end, y)
  check('sort columns ' .. dt, nil, function(t) return t:sort(1, true) end, y)
  check('topk rows ' .. dt, nil, function(t) return t:topk(100, 2, { largest = false }) end, y)
  local z = rand(dt, { 4099, 5 })
  check('sort many rows ' .. dt, nil, function(t) return t:sort(2) end, z)
  check('argsort many rows ' .. dt, nil, function(t) return t:argsort(1) end, z)
end

------------------------------------------------------------------------------------------------
-- prod, norm, var, std, count_nonfinite

local RSHAPES = { {}, { 1 }, { 7 }, { 0 }, { 13, 17 }, { 3, 0, 5 }, { 2, 3, 5, 7 }, { 100003 }, { 3, 70001 },
  { 4099, 3 }, { 2000, 31 } }
for _, dt in ipairs(ALL) do
  for _, s in ipairs(RSHAPES) do
    local x = rand(dt, s)
    -- Products stay finite: floats near 1, integers mostly 1 (integer products wrap alike in any order).
    local px = is_float[dt] and (dlua.randn(s) * 0.01 + 1):to(dt) or dups(dt, s):abs():clamp(0, 1):to(dt)
    if dt == 'int64' or dt == 'int32' then px = dlua.randint(-3, 4, s, { dtype = dt }) end
    local tag = dt .. ' ' .. shape_str(x)
    local tol = is_float[dt] and 1 or nil
    check('prod ' .. tag, tol, function(t) return t:prod() end, px)
    check('count_nonfinite ' .. tag, nil, function(t) return t:count_nonfinite() end, x)
    if is_float[dt] then
      for _, p in ipairs({ 1, 2, math.huge }) do check('norm p ' .. p .. ' ' .. tag, 1, function(t) return t:norm(p) end, x) end
      check('var ' .. tag, 1, function(t) return t:var() end, x)
      check('std ' .. tag, 1, function(t) return t:std() end, x)
      check('var correction 0 ' .. tag, 1, function(t) return t:var({ correction = 0 }) end, x)
      check('std correction 3 ' .. tag, 1, function(t) return t:std({ correction = 3 }) end, x)
    end
    for d = 1, #s do
      check('prod dim ' .. d .. ' ' .. tag, tol, function(t) return t:prod(d) end, px)
      check('prod keepdim ' .. d .. ' ' .. tag, tol, function(t) return t:prod(d, true) end, px)
      check('count_nonfinite dim ' .. d .. ' ' .. tag, nil, function(t) return t:count_nonfinite(d) end, x)
      if is_float[dt] then
        for _, p in ipairs({ 1, 2, math.huge }) do
          check('norm p ' .. p .. ' dim ' .. d .. ' ' .. tag, 1, function(t) return t:norm(p, d) end, x)
        end
        check('var dim ' .. d .. ' ' .. tag, 1, function(t) return t:var(d) end, x)
        check('std keepdim ' .. d .. ' ' .. tag, 1, function(t) return t:std(d, { keepdim = true, unbiased = false }) end, x)
      end
    end
  end
  local v = rand(dt, { 2, 3, 5, 7 }):permute(3, 1, 4, 2)
  check('prod strided dims ' .. dt, is_float[dt] and 1 or nil, function(t) return t:prod({ 1, 3 }) end,
    is_float[dt] and (v * 0.01 + 1):to(dt) or v)
  check('count_nonfinite strided ' .. dt, nil, function(t) return t:count_nonfinite({ 2, 4 }) end, v)
  if is_float[dt] then
    check('norm strided dims ' .. dt, 1, function(t) return t:norm(2, { 1, 3 }) end, v)
    check('var strided dims ' .. dt, 1, function(t) return t:var({ 2, 3 }) end, v)
    local sx = specials(dt, 15)
    check('count_nonfinite specials ' .. dt, nil, function(t) return t:count_nonfinite() end, sx)
    check('norm inf specials ' .. dt, 1, function(t) return t:norm(math.huge) end, sx)
    check('norm 2 specials ' .. dt, 1, function(t) return t:norm(2) end, sx)
    check('prod specials ' .. dt, 1, function(t) return t:prod() end, sx)
    check('var specials ' .. dt, 1, function(t) return t:var() end, sx)
    check('norm inf nan rows ' .. dt, 1, function(t) return t:view(3, 5):norm(math.huge, 2) end, sx)
  end
end

------------------------------------------------------------------------------------------------
-- errors (both backends), determinism and timings (GPU only)

do
  local x = rand('float32', { 5, 4 })
  same_error('index_select out of range', function(t, i) return t:index_select(1, i) end, x,
    dlua.tensor({ 1, 2, 6, 0 }, { dtype = 'int64' }))
  same_error('index_select zero', function(t, i) return t:index_select(2, i) end, x, dlua.tensor({ 0 }, { dtype = 'int32' }))
  same_error('index_select negative', function(t, i) return t:index_select(2, i) end, x,
    dlua.tensor({ 2, -7 }, { dtype = 'int64' }))
  same_error('gather out of range', function(t, i) return t:gather(2, i) end, x,
    dlua.tensor({ { 1 }, { 2 }, { 5 }, { 9 }, { 1 } }, { dtype = 'int64' }))
  same_error('scatter_add_ out of range', function(t, i, s) return t:clone():scatter_add_(1, i, s) end, x,
    idx(5, { 3, 4 }) * 3, rand('float32', { 3, 4 }))
  same_error('one_hot out of range', function(l) return dlua.one_hot(l, 3) end, dlua.tensor({ 1, 2, 4, 0 }, { dtype = 'int64' }))
  same_error('one_hot zero label', function(l) return dlua.one_hot(l, 3) end, dlua.tensor({ 0 }, { dtype = 'int64' }))
  same_error('index_select float index', function(t, i) return t:index_select(1, i) end, x, dlua.tensor({ 1.0 }))
  same_error('cat shapes', function(a, b) return dlua.cat({ a, b }, 1) end, x, rand('float32', { 5, 3 }))
  same_error('topk k too large', function(t) return t:topk(6, 1) end, x)
  same_error('var of ints', function(t) return t:var() end, rand('int32', { 5 }))
  -- The first bad position names the error, wherever it lies in a long index.
  local long = idx(7, { 200003 })
  long[150001] = 9
  long[190001] = 0
  same_error('index_select first bad of a long index', function(t, i) return t:index_select(1, i) end,
    rand('float32', { 7 }), long)
end

if on_gpu then
  local function mixed(name, fn)
    local ok, e = pcall(fn)
    checks = checks + 1
    e = tostring(e)
    if ok or not e:find('one device') or not e:find('cpu') or not e:find('cuda') then
      fail(name, 'expected an error naming both devices, got ' .. e)
    end
  end
  local xc, xd = rand('float32', { 5, 4 }), rand('float32', { 5, 4 }):to(dev)
  local ic = dlua.tensor({ 1, 3 }, { dtype = 'int64' })
  mixed('index_select mixed devices', function() return xd:index_select(1, ic) end)
  mixed('index_select mixed devices (cpu input)', function() return xc:index_select(1, ic:to(dev)) end)
  mixed('gather mixed devices', function() return xd:gather(1, idx(5, { 2, 4 })) end)
  mixed('scatter_add_ mixed src', function() return xd:clone():scatter_add_(1, idx(5, { 2, 4 }):to(dev), xc) end)
  mixed('scatter_add_ mixed index', function() return xd:clone():scatter_add_(1, idx(5, { 2, 4 }), xd) end)
  mixed('cat mixed devices', function() return dlua.cat({ xd, xc }) end)
  mixed('stack mixed devices', function() return dlua.stack({ xc, xd }) end)

  -- scatter_add_ is deterministic: the same bits twice (sorted path and per-fiber path).
  for _, c in ipairs({ { { 37 }, { 1000003 }, 1 }, { { 50, 8 }, { 50000, 8 }, 1 }, { { 20000, 3 }, { 20000, 200 }, 2 } }) do
    local t = dlua.zeros(c[1]):to(dev)
    local i, s = idx(c[1][c[3]], c[2]):to(dev), dlua.randn(c[2]):to(dev)
    local r1 = t:clone():scatter_add_(c[3], i, s):cpu()
    local r2 = t:clone():scatter_add_(c[3], i, s):cpu()
    checks = checks + 1
    if r1:ne(r2):any():item() then fail('scatter_add_ determinism ' .. shape_str(s), 'two runs differ') end
  end

  if H.timed(notes) then
    local cuda = dlua.cuda
    local time_ms = H.time_ms
    local function note(fmt, ...) notes[#notes + 1] = string.format(fmt, ...) end
    local big = dlua.randn(16 * 1024 * 1024):to(dev)
    note('sort f32 16M (one row)        %8.3f ms', time_ms(function() local v, i = big:sort(); v:free(); i:free() end, 5))
    local rows = big:view(16384, 1024)
    note('sort f32 16384 rows x 1024    %8.3f ms', time_ms(function() local v, i = rows:sort(2); v:free(); i:free() end, 5))
    note('topk f32 16M k=16384          %8.3f ms', time_ms(function() local v, i = big:topk(16384); v:free(); i:free() end, 5))
    local ix = idx(16384, { 4096 }):to(dev)
    note('index_select 4096 of 16384 rows x 1024 f32 %8.3f ms', time_ms(function() rows:index_select(1, ix):free() end, 10))
    local bins = idx(1000, { 16 * 1024 * 1024 }):to(dev)
    local acc = dlua.zeros(1000):to(dev)
    note('scatter_add_ 16M into 1000 bins %8.3f ms', time_ms(function() acc:scatter_add_(1, bins, big) end, 5))
    note('var f32 16M                   %8.3f ms', time_ms(function() big:var() end, 10))
    big:free(); bins:free()
  end
end

------------------------------------------------------------------------------------------------
-- report

H.report({ title = 'device ' .. dev, checks = checks, results = results, failures = failures, both_failed = both_failed, notes = notes, t_start = t_start })
