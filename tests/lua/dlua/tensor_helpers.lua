-- Helpers shared by the tensor specs: nested-table references built by plain Lua loops, comparisons, error checks.
local dlua = require 'dlua'

local H = {}

-- A nested table of `shape` whose element at 1-based position (i1, i2, ...) is f(i1, i2, ...).
function H.build(shape, f)
  local idx = {}
  local function rec(d)
    if d > #shape then return f(unpack(idx, 1, #shape)) end
    local r = {}
    for k = 1, shape[d] do
      idx[d] = k
      r[k] = rec(d + 1)
    end
    return r
  end
  return rec(1)
end

-- Element (i1, i2, ...) of a nested table.
function H.at(t, ...)
  for _, i in ipairs({ ... }) do t = t[i] end
  return t
end

-- The shape of a nested table (following first elements).
function H.shape_of(t)
  local s = {}
  while type(t) == 'table' do
    s[#s + 1] = #t
    t = t[1]
  end
  return s
end

-- Row-major leaves of a nested table.
function H.flat(t, out)
  out = out or {}
  if type(t) ~= 'table' then out[#out + 1] = t; return out end
  for k = 1, #t do H.flat(t[k], out) end
  return out
end

-- f applied to every leaf (or pairwise to the leaves of two same-shaped tables).
function H.map(t, f, u)
  if type(t) ~= 'table' then return f(t, u) end
  local r = {}
  for k = 1, #t do r[k] = H.map(t[k], f, u ~= nil and u[k] or nil) end
  return r
end

-- Deterministic, varied test values without the library's RNG: a small LCG.
function H.values(n, lo, hi, seed)
  local x = seed or 12345
  local r = {}
  lo, hi = lo or -2, hi or 2
  for k = 1, n do
    x = (1103515245 * x + 12345) % 2147483648
    r[k] = lo + (hi - lo) * (x / 2147483648)
  end
  return r
end

-- A nested table of `shape` filled with H.values.
function H.random(shape, lo, hi, seed)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  local v = H.values(n, lo, hi, seed)
  local k = 0
  return H.build(shape, function() k = k + 1; return v[k] end)
end

-- float32 rounding of a double, so references match what a float32 tensor stores.
local ffi = require 'ffi'
local f32 = ffi.new('float[1]')
function H.f32(x) f32[0] = x; return f32[0] end

local function same(a, b, tol)
  if type(a) == 'boolean' or type(b) == 'boolean' then return a == b end
  if a ~= a then return b ~= b end
  if a == b then return true end
  if type(a) ~= 'number' or type(b) ~= 'number' then return false end
  return math.abs(a - b) <= tol * math.max(1, math.abs(a), math.abs(b))
end

-- Asserts that tensor (or table) `actual` has the shape and values of nested table
-- `expected`, within relative tolerance tol (default 1e-6; 0 for exact).
function H.close(expected, actual, tol, what)
  tol = tol or 1e-6
  if dlua.is_tensor(actual) then
    local es = type(expected) == 'table' and H.shape_of(expected) or {}
    local as = actual:size()
    -- an empty nested table cannot say the sizes after a zero: compare what it says
    local n = math.min(#es, #as)
    if #es ~= #as and not (H.flat(expected)[1] == nil) then
      error(string.format('%sshape (%s) expected, got (%s)', what and what .. ': ' or '',
        table.concat(es, ', '), table.concat(as, ', ')), 2)
    end
    for k = 1, n do
      if es[k] ~= as[k] then
        error(string.format('%sshape (%s) expected, got (%s)', what and what .. ': ' or '',
          table.concat(es, ', '), table.concat(as, ', ')), 2)
      end
    end
    actual = actual:totable()
  end
  local e, a = H.flat(expected), H.flat(actual)
  if #e ~= #a then
    error(string.format('%s%d elements expected, got %d', what and what .. ': ' or '', #e, #a), 2)
  end
  for k = 1, #e do
    if not same(e[k], a[k], tol) then
      error(string.format('%selement %d: expected %s, got %s', what and what .. ': ' or '', k,
        tostring(e[k]), tostring(a[k])), 2)
    end
  end
  return true
end

-- Asserts that fn raises an error matching `pattern` (a Lua pattern; plain when `plain`)
-- reported at a line of fn itself in the calling spec file, i.e. at the user's line.
function H.raises(fn, pattern, plain)
  local ok, err = pcall(fn)
  if ok then error('expected an error matching ' .. pattern .. ', got none', 2) end
  err = tostring(err)
  if not err:find(pattern, 1, plain) then
    error(string.format('error %q does not match %q', err, pattern), 2)
  end
  local info = debug.getinfo(fn, 'S')
  local file = info.short_src:match('[^/]+$')
  local line = tonumber(err:match('^[^:]*' .. file:gsub('%p', '%%%0') .. ':(%d+):'))
  if not line or line < info.linedefined or line > info.lastlinedefined then
    error(string.format('error %q is not reported at the caller (%s:%d-%d)', err, file,
      info.linedefined, info.lastlinedefined), 2)
  end
  return err
end

-- The non-contiguous ways to hold the same values as nested table `ref` (2-D or more):
-- a transposed copy transposed back, a narrowed window of a larger tensor, and (for a
-- reference whose first dim is 1) an expansion. Each entry: {name, tensor}.
function H.layouts(ref, dtype)
  local opts = { dtype = dtype or 'float32' }
  local shape = H.shape_of(ref)
  local r = { { 'contiguous', dlua.tensor(ref, opts) } }
  if #shape >= 2 then
    -- transpose(1, 2) of a tensor holding the transposed values
    local tr = H.build({ shape[2], shape[1], unpack(shape, 3) }, function(i, j, ...)
      return H.at(ref, j, i, ...)
    end)
    r[#r + 1] = { 'transposed', dlua.tensor(tr, opts):transpose(1, 2) }
  end
  -- a window two elements in along dim 1 of a larger tensor
  local big_shape = { shape[1] + 3, unpack(shape, 2) }
  local big = H.build(big_shape, function(i, ...)
    if i >= 3 and i < 3 + shape[1] then return H.at(ref, i - 2, ...) end
    return -77
  end)
  r[#r + 1] = { 'narrowed', dlua.tensor(big, opts):narrow(1, 3, shape[1]) }
  return r
end

return H
