-- Tensor arithmetic from Lua: element-wise ops, broadcasting, in-place forms, metamethods, reductions.
local dlua = require 'dlua'
local H = require 'tests.lua.dlua.tensor_helpers'

local f32 = H.f32

-- The reference of an element-wise op on float32 inputs, computed in double then rounded.
local function ref_unary(ref, f) return H.map(ref, function(x) return f32(f(x)) end) end

describe('unary ops', function()
  local ref = H.random({ 3, 7 }, 0.05, 3, 7) -- positive: log and sqrt are defined
  local sref = H.random({ 3, 7 }, -3, 3, 11)
  local cases = {
    neg = function(x) return -x end,
    abs = math.abs,
    sqrt = math.sqrt,
    rsqrt = function(x) return 1 / math.sqrt(x) end,
    exp = math.exp,
    log = math.log,
    tanh = function(x) return (math.exp(2 * x) - 1) / (math.exp(2 * x) + 1) end,
    sigmoid = function(x) return 1 / (1 + math.exp(-x)) end,
    relu = function(x) return x > 0 and x or 0 end,
    sign = function(x) return x > 0 and 1 or (x < 0 and -1 or 0) end,
    reciprocal = function(x) return 1 / x end,
    square = function(x) return x * x end,
    floor = math.floor,
    ceil = math.ceil,
    sin = math.sin,
    cos = math.cos,
    log1p = function(x) return math.log(1 + x) end,
    expm1 = function(x) return math.exp(x) - 1 end,
  }

  it('match plain Lua on contiguous, transposed and narrowed inputs', function()
    for name, f in pairs(cases) do
      local input = (name == 'sqrt' or name == 'rsqrt' or name == 'log' or name == 'log1p') and ref or sref
      local expected = ref_unary(H.map(input, f32), f)
      for _, case in ipairs(H.layouts(input)) do
        H.close(expected, case[2][name](case[2]), 2e-6, name .. ' ' .. case[1])
        H.close(expected, dlua.tensor(input)[name](dlua.tensor(input)), 2e-6, name)
      end
    end
  end)

  it('have in-place forms that return the same tensor, also through a view', function()
    local t = dlua.tensor({ { -1, 4 }, { 9, -16 } })
    local r = t:abs_()
    assert.is_true(r == t)
    H.close({ { 1, 4 }, { 9, 16 } }, t, 0)
    t:t():sqrt_()
    H.close({ { 1, 2 }, { 3, 4 } }, t, 0)
    local col = t:select(2, 1)
    col:neg_()
    H.close({ { -1, 2 }, { -3, 4 } }, t, 0)
  end)

  it('predicates give bool tensors', function()
    local t = dlua.tensor({ 1, 0 / 0, math.huge, -math.huge, 0 })
    H.close({ true, false, false, false, true }, t:isfinite(), 0)
    H.close({ false, true, false, false, false }, t:isnan(), 0)
    H.close({ false, false, true, true, false }, t:isinf(), 0)
    H.close({ false, false, false, false, true }, t:logical_not(), 0)
    assert.equals('bool', t:isnan().dtype)
  end)

  it('work on empty, size-1 and 0-d tensors', function()
    for name, f in pairs(cases) do
      assert.same({ 0, 3 }, dlua.zeros(0, 3)[name](dlua.zeros(0, 3)):size(), name)
      local x = (name == 'log' or name == 'sqrt' or name == 'rsqrt') and 0.75 or -0.75
      H.close({ { f32(f(x)) } }, dlua.tensor({ { x } })[name](dlua.tensor({ { x } })), 2e-6, name)
      local s = dlua.tensor(x)[name](dlua.tensor(x))
      assert.equals(0, s:dim(), name)
      H.close(f32(f(x)), s:item(), 2e-6, name)
    end
  end)

  it('round half to even like PyTorch', function()
    H.close({ 0, 2, 2, -0, -2 }, dlua.tensor({ 0.5, 1.5, 2.5, -0.5, -1.5 }):round(), 0)
  end)
end)

describe('binary ops', function()
  local a_ref = H.random({ 4, 3 }, -2, 2, 3)
  local b_ref = H.random({ 4, 3 }, 0.5, 2, 5)
  local function pairwise(f) return H.map(H.map(a_ref, f32), function(x, y) return f32(f(x, f32(y))) end, b_ref) end

  it('add/sub/mul/div/pow/maximum/minimum match plain Lua on every layout', function()
    local cases = {
      add = function(x, y) return x + y end, sub = function(x, y) return x - y end,
      mul = function(x, y) return x * y end, div = function(x, y) return x / y end,
      pow = function(x, y) return math.abs(x) ^ y end,
      maximum = math.max, minimum = math.min,
      atan2 = function(x, y) return math.atan2(x, y) end,
    }
    for name, f in pairs(cases) do
      local expected = pairwise(f)
      local a_in = name == 'pow' and H.map(a_ref, math.abs) or a_ref
      for _, la in ipairs(H.layouts(a_in)) do
        for _, lb in ipairs(H.layouts(b_ref)) do
          H.close(expected, la[2][name](la[2], lb[2]), 4e-6, name .. ' ' .. la[1] .. '/' .. lb[1])
        end
      end
    end
  end)

  it('work on empty, size-1 and 0-d operands', function()
    for _, name in ipairs({ 'add', 'sub', 'mul', 'div', 'pow', 'maximum', 'minimum', 'eq', 'lt' }) do
      local e = dlua.zeros(0, 3)
      assert.same({ 0, 3 }, e[name](e, dlua.ones(3)):size(), name)
      assert.same({ 0, 3 }, e[name](e, 2):size(), name)
      local one = dlua.tensor({ 3 })
      assert.same({ 1 }, one[name](one, dlua.tensor({ 2 })):size(), name)
      -- a 0-d tensor broadcasts like a number
      local r = dlua.tensor({ { 1, 2 }, { 3, 4 } })[name](dlua.tensor({ { 1, 2 }, { 3, 4 } }), dlua.tensor(2))
      local n = dlua.tensor({ { 1, 2 }, { 3, 4 } })[name](dlua.tensor({ { 1, 2 }, { 3, 4 } }), 2)
      H.close(n:totable(), r, 0, name)
    end
  end)

  it('fmod keeps the sign of the dividend, remainder the sign of the divisor', function()
    local a, b = dlua.tensor({ 5, -5, 5, -5 }), dlua.tensor({ 3, 3, -3, -3 })
    H.close({ 2, -2, 2, -2 }, a:fmod(b), 0)
    H.close({ 2, 1, -1, -2 }, a:remainder(b), 0)
    H.close({ 2, 1, -1, -2 }, a % b, 0)
  end)

  it('broadcast numpy-style, including size-1 and empty dims', function()
    local col = dlua.tensor({ { 1 }, { 2 }, { 3 } }) -- (3, 1)
    local row = dlua.tensor({ 10, 20, 30, 40, 50 })  -- (5)
    H.close(H.build({ 3, 5 }, function(i, j) return i + 10 * j end), col + row, 0)
    H.close(H.build({ 3, 5 }, function(i, j) return 10 * j - i end), row - col, 0)
    assert.same({ 2, 0, 5 }, (dlua.zeros(2, 1, 5) + dlua.zeros(0, 1)):size())
    local err = H.raises(function() local _ = dlua.zeros(2, 3) + dlua.zeros(4) end, 'add: ')
    assert.truthy(err:find('(2, 3)', 1, true) and err:find('(4)', 1, true), err)
  end)

  it('take numbers on either side, with alpha for add and sub', function()
    local t = dlua.tensor({ 1, 2, 4 })
    H.close({ 3, 4, 6 }, t + 2, 0)
    H.close({ 3, 4, 6 }, 2 + t, 0)
    H.close({ 1, 0, -2 }, 2 - t, 0)
    H.close({ 2, 1, 0.5 }, 2 / t, 0)
    H.close({ 2, 4, 16 }, 2 ^ t, 0)
    H.close({ 1, 4, 16 }, t ^ 2, 0)
    H.close({ -1, -2, -4 }, -t, 0)
    H.close({ 0.5, 1, 2 }, t * 0.5, 0)
    H.close({ 7, 11, 22 }, t:add(dlua.tensor({ 2, 3, 6 }), 3), 0)
    H.close({ -5, -7, -14 }, t:sub(dlua.tensor({ 2, 3, 6 }), 3), 0)
    H.close({ 7, 8, 10 }, t:add(2, 3), 0)
    H.close({ true, false, false }, t:lt(2), 0)
    H.close({ false, true, true }, t:ge(2), 0)
    H.raises(function() local _ = t + 'x' end, 'add: expected a tensor or a number as the other operand, got string', true)
    H.raises(function() local _ = t + {} end, 'add: expected a tensor or a number as the other operand, got table', true)
  end)

  it('promote dtypes as PyTorch: int with float gives float, comparisons give bool', function()
    local i = dlua.tensor({ 1, 2, 3 }, { dtype = 'int32' })
    local f = dlua.tensor({ 0.5, 0.5, 0.5 })
    assert.equals('float32', (i + f).dtype)
    assert.equals('int32', (i + 1).dtype)
    assert.equals('float32', (i * 0.5).dtype)
    H.close({ 0.5, 1, 1.5 }, i * 0.5, 0)
    assert.equals('float64', (f + f:double()).dtype)
    assert.equals('bool', i:eq(2).dtype)
    H.close({ false, true, false }, i:eq(2), 0)
    H.close({ true, false, true }, i:ne(dlua.tensor({ 0, 2, 0 }, { dtype = 'int64' })), 0)
  end)

  it('in-place forms write into the first operand, with broadcasting of the second', function()
    local t = dlua.ones(2, 3)
    local r = t:add_(dlua.tensor({ 1, 2, 3 }))
    assert.is_true(r == t)
    H.close({ { 2, 3, 4 }, { 2, 3, 4 } }, t, 0)
    t:mul_(2):sub_(1, 2)
    H.close({ { 2, 4, 6 }, { 2, 4, 6 } }, t, 0)
    t:div_(dlua.tensor({ { 2 }, { 1 } }))
    H.close({ { 1, 2, 3 }, { 2, 4, 6 } }, t, 0)
    -- an in-place op whose result would need a bigger shape is an error
    H.raises(function() dlua.ones(3):add_(dlua.ones(2, 3)) end, 'add_: ')
    -- in-place through a transposed view
    local m = dlua.zeros(2, 3)
    m:t():add_(dlua.tensor({ 1, 2 }))
    H.close({ { 1, 1, 1 }, { 2, 2, 2 } }, m, 0)
  end)

  it('logical ops on bool tensors', function()
    local a, b = dlua.tensor({ true, true, false, false }), dlua.tensor({ true, false, true, false })
    H.close({ true, false, false, false }, a:logical_and(b), 0)
    H.close({ true, true, true, false }, a:logical_or(b), 0)
    H.close({ false, true, true, false }, a:logical_xor(b), 0)
  end)
end)

describe('clamp, where, masked_fill, fills and fused updates', function()
  it('clamp with both bounds, one bound, in place', function()
    local t = dlua.tensor({ -3, -1, 0, 2, 5 })
    H.close({ -1, -1, 0, 2, 2 }, t:clamp(-1, 2), 0)
    H.close({ 0, 0, 0, 2, 5 }, t:clamp(0), 0)
    H.close({ -3, -1, 0, 1, 1 }, t:clamp(nil, 1), 0)
    t:clamp_(-2, 3)
    H.close({ -2, -1, 0, 2, 3 }, t, 0)
    H.raises(function() t:clamp() end, 'clamp: expected at least one of min and max', true)
  end)

  it('where picks from tensors or numbers, broadcasting', function()
    local cond = dlua.tensor({ { true, false, true } })
    local a = dlua.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    H.close({ { 1, 0, 3 }, { 4, 0, 6 } }, dlua.where(cond, a, 0), 0)
    H.close({ { -1, 2, -1 }, { -1, 5, -1 } }, dlua.where(cond, -1, a), 0)
    H.close({ { 1, 20, 3 }, { 4, 20, 6 } }, a:where(cond, dlua.tensor({ 10, 20, 30 })), 0)
    H.close({ { 1, 2, 3 }, { 4, 5, 6 } }, dlua.where(a:gt(0), a, a:neg()), 0)
    H.raises(function() dlua.where(cond, 'x', a) end, 'where: expected a tensor or a number as argument 2, got string', true)
  end)

  it('masked_fill and masked_fill_', function()
    local t = dlua.tensor({ { 1, -2 }, { -3, 4 } })
    local m = t:lt(0)
    H.close({ { 1, 0 }, { 0, 4 } }, t:masked_fill(m, 0), 0)
    H.close({ { 1, -2 }, { -3, 4 } }, t, 0)
    t:masked_fill_(dlua.tensor({ true, false }), 9) -- broadcast mask over rows
    H.close({ { 9, -2 }, { 9, 4 } }, t, 0)
  end)

  it('fill_, zero_, copy_ across dtypes and with broadcasting', function()
    local t = dlua.empty(2, 3)
    t:fill_(2.5)
    H.close({ { 2.5, 2.5, 2.5 }, { 2.5, 2.5, 2.5 } }, t, 0)
    t:zero_()
    H.close({ { 0, 0, 0 }, { 0, 0, 0 } }, t, 0)
    t:copy_(dlua.tensor({ 1, 2, 3 }, { dtype = 'int64' }))
    H.close({ { 1, 2, 3 }, { 1, 2, 3 } }, t, 0)
    local i = dlua.zeros(3, { dtype = 'int32' })
    i:copy_(dlua.tensor({ 1.7, -1.7, 2 }))
    H.close({ 1, -1, 2 }, i, 0)
    local tr = dlua.zeros(3, 2)
    tr:copy_(dlua.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }):t())
    H.close({ { 1, 4 }, { 2, 5 }, { 3, 6 } }, tr, 0)
    H.raises(function() t:copy_(dlua.zeros(4)) end, 'copy_: ')
  end)

  it('addcmul_, addcdiv_, lerp_ against plain Lua', function()
    local t_ref, a_ref, b_ref = H.random({ 5 }, -1, 1, 1), H.random({ 5 }, -1, 1, 2), H.random({ 5 }, 0.5, 2, 3)
    local function fresh() return dlua.tensor(t_ref, { dtype = 'float64' }) end
    local a, b = dlua.tensor(a_ref, { dtype = 'float64' }), dlua.tensor(b_ref, { dtype = 'float64' })
    H.close(H.map(t_ref, function(x, k) return x + 0.5 * a_ref[k] * b_ref[k] end, { 1, 2, 3, 4, 5 }),
      fresh():addcmul_(a, b, 0.5), 1e-12)
    H.close(H.map(t_ref, function(x, k) return x - 2 * a_ref[k] / b_ref[k] end, { 1, 2, 3, 4, 5 }),
      fresh():addcdiv_(a, b, { value = -2 }), 1e-12)
    H.close(H.map(t_ref, function(x, k) return x + 0.25 * (a_ref[k] - x) end, { 1, 2, 3, 4, 5 }),
      fresh():lerp_(a, 0.25), 1e-12)
    H.close(H.map(t_ref, function(x, k) return x + a_ref[k] * b_ref[k] end, { 1, 2, 3, 4, 5 }),
      fresh():addcmul(a, b), 1e-12)
    H.raises(function() fresh():lerp_(a, 'x') end, 'lerp_: weight must be a number, got string', true)
  end)
end)

describe('reductions', function()
  local shape = { 3, 5, 2 }
  local ref = H.random(shape, -2, 2, 17)
  local ref32 = H.map(ref, f32)

  -- Reduces ref32 over the dims in `dims` (1-based) with f(list) -> value, keeping them as 1.
  local function reduce_ref(dims, f)
    local keep = {}
    for d = 1, #shape do keep[d] = shape[d] end
    for _, d in ipairs(dims) do keep[d] = 1 end
    return H.build(keep, function(...)
      local idx = { ... }
      local list = {}
      local function rec(d)
        if d > #shape then list[#list + 1] = H.at(ref32, unpack(idx)); return end
        local reduced = false
        for _, r in ipairs(dims) do if r == d then reduced = true end end
        if reduced then
          local saved = idx[d]
          for k = 1, shape[d] do idx[d] = k; rec(d + 1) end
          idx[d] = saved
        else
          rec(d + 1)
        end
      end
      rec(1)
      return f(list)
    end), keep
  end

  local function sum(l) local s = 0 for _, v in ipairs(l) do s = s + v end return s end
  local function mean(l) return sum(l) / #l end
  local function prod(l) local s = 1 for _, v in ipairs(l) do s = s * v end return s end
  local function var(l, c) local m, s = mean(l), 0 for _, v in ipairs(l) do s = s + (v - m) ^ 2 end return s / (#l - c) end

  -- drop the kept size-1 dims of a reference
  local function squeeze(t, dims)
    local x = dlua.tensor(t, { dtype = 'float64' })
    table.sort(dims, function(p, q) return p > q end)
    for _, d in ipairs(dims) do x = x:squeeze(d) end
    return x:totable()
  end

  it('sum, mean, prod over all, one, several and negative dims, with keepdim', function()
    local t = dlua.tensor(ref)
    local fns = { sum = sum, mean = mean, prod = prod }
    for name, f in pairs(fns) do
      H.close(f(H.flat(ref32)), t[name](t):item(), 1e-5, name)
      assert.equals(0, t[name](t):dim())
      for _, dims in ipairs({ { 1 }, { 2 }, { 3 }, { 1, 3 }, { 2, 3 } }) do
        local expected = reduce_ref(dims, f)
        H.close(expected, t[name](t, dims, true), 1e-5, name .. ' keepdim')
        H.close(squeeze(expected, { unpack(dims) }), t[name](t, #dims == 1 and dims[1] or dims), 1e-5, name)
      end
      H.close(squeeze(reduce_ref({ 3 }, f), { 3 }), t[name](t, -1), 1e-5, name .. ' -1')
    end
  end)

  it('reduce non-contiguous inputs', function()
    local ref2 = H.random({ 4, 7 }, -1, 1, 5)
    for _, case in ipairs(H.layouts(ref2)) do
      local rows = {}
      for i = 1, 4 do rows[i] = 0 for j = 1, 7 do rows[i] = rows[i] + f32(ref2[i][j]) end end
      H.close(rows, case[2]:sum(2), 1e-5, case[1])
    end
    local e = dlua.tensor({ 1, 2, 3 }):expand(4, 3)
    H.close({ 4, 8, 12 }, e:sum(1), 0)
  end)

  it('sum of empty is 0, prod of empty is 1, mean of empty is nan', function()
    assert.equals(0, dlua.zeros(0):sum():item())
    assert.equals(1, dlua.zeros(0):prod():item())
    local m = dlua.zeros(0):mean():item()
    assert.is_true(m ~= m)
    H.close({ 0, 0, 0 }, dlua.zeros(0, 3):sum(1), 0)
  end)

  it('max/min: no dim gives a 0-d value; a dim gives values and 1-based indices', function()
    local t = dlua.tensor({ { 3, 9, 1 }, { 7, 2, 7 } })
    assert.equals(9, t:max():item())
    assert.equals(0, t:max():dim())
    assert.equals(1, t:min():item())
    local v, i = t:max(2)
    H.close({ 9, 7 }, v, 0)
    H.close({ 2, 1 }, i, 0) -- ties: the first
    assert.equals('int64', i.dtype)
    v, i = t:min(1, true)
    H.close({ { 3, 2, 1 } }, v, 0)
    H.close({ { 1, 2, 1 } }, i, 0)
    H.close({ { 3, 9, 7 }, { 7, 9, 7 } }, t:max(dlua.tensor({ 3, 9, 7 })), 0) -- element-wise
    -- prime-sized against a loop
    local r = H.random({ 7, 11 }, -5, 5, 23)
    local mv, mi = dlua.tensor(r):max(-1)
    for row = 1, 7 do
      local best, at = -math.huge, 0
      for c = 1, 11 do if f32(r[row][c]) > best then best, at = f32(r[row][c]), c end end
      assert.equals(best, mv[row])
      assert.equals(at, mi[row])
    end
  end)

  it('argmax/argmin count from 1, over the flattened tensor without a dim', function()
    local t = dlua.tensor({ { 3, 9, 1 }, { 7, 2, 10 } })
    assert.equals(6, t:argmax():item())
    assert.equals(3, t:argmin():item())
    H.close({ 2, 3 }, t:argmax(2), 0)
    H.close({ 2, 1, 2 }, t:argmax(1), 0)
    H.close({ { 3 }, { 2 } }, t:argmin(-1, true), 0)
    H.close({ 2, 3 }, t:t():argmax(1), 0) -- through a transpose
  end)

  it('norm with p = 1, 2, inf', function()
    local r = H.random({ 2, 13 }, -3, 3, 29)
    local t = dlua.tensor(r)
    local l1, l2, linf = 0, 0, 0
    for _, v in ipairs(H.flat(H.map(r, f32))) do
      l1, l2, linf = l1 + math.abs(v), l2 + v * v, math.max(linf, math.abs(v))
    end
    H.close(l1, t:norm(1):item(), 1e-5)
    H.close(math.sqrt(l2), t:norm():item(), 1e-5)
    H.close(math.sqrt(l2), t:norm('fro'):item(), 1e-5)
    H.close(linf, t:norm(math.huge):item(), 0)
    H.close(linf, t:norm('inf'):item(), 0)
    local rows = {}
    for i = 1, 2 do rows[i] = 0 for j = 1, 13 do rows[i] = rows[i] + f32(r[i][j]) ^ 2 end rows[i] = math.sqrt(rows[i]) end
    H.close(rows, t:norm(2, 2), 1e-5)
    H.raises(function() t:norm(3) end, 'norm: p must be 1, 2 or math.huge (inf), got 3', true)
  end)

  it('var and std with correction, unbiased and keepdim', function()
    local t = dlua.tensor(ref)
    local flat = H.flat(ref32)
    H.close(var(flat, 1), t:var():item(), 1e-5)
    H.close(var(flat, 0), t:var({ correction = 0 }):item(), 1e-5)
    H.close(var(flat, 0), t:var(nil, { unbiased = false }):item(), 1e-5)
    H.close(math.sqrt(var(flat, 1)), t:std():item(), 1e-5)
    local expected = reduce_ref({ 2 }, function(l) return var(l, 1) end)
    H.close(expected, t:var(2, { keepdim = true }), 1e-5)
    H.close(squeeze(expected, { 2 }), t:var(2), 1e-5)
    H.close(H.map(squeeze(expected, { 2 }), math.sqrt), t:std(2, { correction = 1 }), 1e-5)
    H.raises(function() t:var(2, { corection = 0 }) end, "var: unknown option 'corection'", true)
  end)

  it('any, all, count_nonfinite', function()
    local b = dlua.tensor({ { true, false }, { false, false } })
    assert.is_true(b:any():item())
    assert.is_false(b:all():item())
    H.close({ true, false }, b:any(2), 0)
    H.close({ false, false }, b:all(1), 0)
    assert.is_true(dlua.zeros(0, { dtype = 'bool' }):all():item())
    assert.is_false(dlua.zeros(0, { dtype = 'bool' }):any():item())
    local f = dlua.tensor({ { 1, 0 / 0, math.huge }, { -math.huge, 2, 3 } })
    assert.equals(3, f:count_nonfinite():item())
    H.close({ 2, 1 }, f:count_nonfinite(2), 0)
    assert.equals('int64', f:count_nonfinite().dtype)
  end)

  it('reject bad dims 1-based and a bad keepdim', function()
    local t = dlua.zeros(2, 3)
    H.raises(function() t:sum(3) end, 'sum: dimension 3 out of range for (2, 3) float32 cpu (expected 1..2 or -2..-1)', true)
    H.raises(function() t:sum({ 1, -2 }) end, 'sum: dimension 1 repeated', true)
    H.raises(function() t:mean(1, 'yes') end, 'mean: keepdim must be a boolean, got string', true)
    H.raises(function() t:max({ 1, 2 }) end, 'max: takes one dimension', true)
  end)
end)
