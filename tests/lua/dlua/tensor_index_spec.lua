-- Tensor indexing, sorting, linear algebra and random numbers from Lua: 1-based positions in and out.
local dlua = require 'dlua'
local H = require 'tests.lua.dlua.tensor_helpers'

local f32 = H.f32

describe('index_select, gather, scatter_add_', function()
  it('index_select takes 1-based positions (tensor or list)', function()
    local t = dlua.tensor({ { 1, 2, 3 }, { 4, 5, 6 }, { 7, 8, 9 } })
    H.close({ { 7, 8, 9 }, { 1, 2, 3 }, { 7, 8, 9 } }, t:index_select(1, { 3, 1, 3 }), 0)
    H.close({ { 3, 2 }, { 6, 5 }, { 9, 8 } }, t:index_select(2, dlua.tensor({ 3, 2 }, { dtype = 'int32' })), 0)
    H.close({ { 2 }, { 5 }, { 8 } }, t:index_select(-1, dlua.tensor({ 2 }, { dtype = 'int64' })), 0)
    assert.same({ 0, 3 }, t:index_select(1, dlua.zeros(0, { dtype = 'int64' })):size())
    H.close({ { 3, 6, 9 }, { 2, 5, 8 } }, t:t():index_select(1, { 3, 2 }), 0) -- non-contiguous source
    H.raises(function() t:index_select(1, { 4 }) end, 'index_select: ')
    H.raises(function() t:index_select(1, { 0 }) end, 'index_select: ')
    H.raises(function() t:index_select(3, { 1 }) end, 'index_select: dimension 3 out of range', true)
    H.raises(function() t:index_select(1, 'x') end, 'index_select: expected an index tensor or a list of positions, got string', true)
  end)

  it('gather picks along a dim with 1-based indices', function()
    local t = dlua.tensor({ { 1, 2 }, { 3, 4 } })
    local idx = dlua.tensor({ { 1, 1 }, { 2, 1 } }, { dtype = 'int64' })
    H.close({ { 1, 1 }, { 4, 3 } }, t:gather(2, idx), 0)
    H.close({ { 1, 2 }, { 3, 2 } }, t:gather(1, idx), 0)
    -- prime-sized against a loop
    local r = H.random({ 5, 7 }, -1, 1, 3)
    local ix = H.build({ 5, 3 }, function(i, j) return (i * 3 + j * 5) % 7 + 1 end)
    local expected = H.build({ 5, 3 }, function(i, j) return f32(r[i][ix[i][j]]) end)
    H.close(expected, dlua.tensor(r):gather(2, dlua.tensor(ix, { dtype = 'int64' })), 0)
    H.raises(function() t:gather(2, dlua.tensor({ { 3, 1 }, { 1, 1 } }, { dtype = 'int64' })) end, 'gather: ')
  end)

  it('scatter_add_ accumulates at 1-based indices, repeated ones add up', function()
    local t = dlua.zeros(2, 4)
    local idx = dlua.tensor({ { 1, 4, 1 }, { 2, 2, 3 } }, { dtype = 'int64' })
    local src = dlua.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    local r = t:scatter_add_(2, idx, src)
    assert.is_true(r == t)
    H.close({ { 4, 0, 0, 2 }, { 0, 9, 6, 0 } }, t, 0)
    local fresh = dlua.ones(2, 4)
    H.close({ { 5, 1, 1, 3 }, { 1, 10, 7, 1 } }, fresh:scatter_add(2, idx, src), 0)
    H.close({ { 1, 1, 1, 1 }, { 1, 1, 1, 1 } }, fresh, 0)
    H.raises(function() t:scatter_add_(2, idx, 'x') end, 'scatter_add_: expected a tensor as src, got string', true)
  end)

  it('one_hot maps labels 1..C to rows of an identity', function()
    local labels = dlua.tensor({ 3, 1, 2, 3 }, { dtype = 'int64' })
    local oh = dlua.one_hot(labels, 4)
    assert.equals('int64', oh.dtype)
    H.close({ { 0, 0, 1, 0 }, { 1, 0, 0, 0 }, { 0, 1, 0, 0 }, { 0, 0, 1, 0 } }, oh, 0)
    assert.same({ 4, 3 }, dlua.one_hot(labels):size()) -- the largest label
    local f = dlua.one_hot(dlua.tensor({ { 2 }, { 1 } }, { dtype = 'int64' }), 2, { dtype = 'float32' })
    assert.equals('float32', f.dtype)
    H.close({ { { 0, 1 } }, { { 1, 0 } } }, f, 0)
    H.raises(function() dlua.one_hot(dlua.tensor({ 0 }, { dtype = 'int64' }), 3) end, 'one_hot: ')
    H.raises(function() dlua.one_hot(dlua.tensor({ 4 }, { dtype = 'int64' }), 3) end, 'one_hot: ')
  end)
end)

describe('sort and topk', function()
  it('sort is stable, ascending or descending, indices 1-based, NaN last', function()
    local t = dlua.tensor({ 3, 1, 2, 1, 0 / 0, -5 })
    local v, i = t:sort()
    local vt = v:totable()
    assert.same({ -5, 1, 1, 2, 3 }, { unpack(vt, 1, 5) })
    assert.is_true(vt[6] ~= vt[6])
    H.close({ 6, 2, 4, 3, 1, 5 }, i, 0)
    v, i = dlua.tensor({ 3, 1, 2, 1 }):sort(1, true)
    H.close({ 3, 2, 1, 1 }, v, 0)
    H.close({ 1, 3, 2, 4 }, i, 0)
    local m = dlua.tensor({ { 3, 1, 2 }, { 9, 8, 7 } })
    v, i = m:sort(1, true)
    H.close({ { 9, 8, 7 }, { 3, 1, 2 } }, v, 0)
    H.close({ { 2, 2, 2 }, { 1, 1, 1 } }, i, 0)
    v = m:sort({ dim = 2, descending = true })
    H.close({ { 3, 2, 1 }, { 9, 8, 7 } }, v, 0)
    H.close({ { 2, 3, 1 }, { 3, 2, 1 } }, m:argsort(), 0)
    -- prime-sized, transposed input against a Lua sort
    local r = H.random({ 13 }, -1, 1, 41)
    local col = dlua.tensor({ r }):t():select(2, 1)
    local sorted = H.map(r, f32)
    table.sort(sorted)
    H.close(sorted, (col:sort()), 0)
    assert.same({ 0 }, dlua.zeros(0):sort():size())
  end)

  it('topk returns the k largest or smallest, by value or magnitude, 1-based', function()
    local t = dlua.tensor({ 1, -7, 3, 5, -2 })
    local v, i = t:topk(2)
    H.close({ 5, 3 }, v, 0)
    H.close({ 4, 3 }, i, 0)
    v, i = t:topk(2, { largest = false })
    H.close({ -7, -2 }, v, 0)
    H.close({ 2, 5 }, i, 0)
    v, i = t:topk(3, 1, { by_magnitude = true })
    H.close({ -7, 5, 3 }, v, 0) -- signs kept
    H.close({ 2, 4, 3 }, i, 0)
    local m = dlua.tensor({ { 1, 9, 4 }, { 8, 2, 6 } })
    v, i = m:topk(1, 1)
    H.close({ { 8, 9, 6 } }, v, 0)
    H.close({ { 2, 1, 2 } }, i, 0)
    v, i = m:topk(2, -1, { sorted = true })
    H.close({ { 9, 4 }, { 8, 6 } }, v, 0)
    H.close({ { 2, 3 }, { 1, 3 } }, i, 0)
    -- unsorted: the same set
    v = m:topk(2, 2, { sorted = false })
    local s = v:sort(2, true)
    H.close({ { 9, 4 }, { 8, 6 } }, s, 0)
    assert.same({ 2, 0 }, m:topk(0):size())
    H.raises(function() m:topk(4) end, 'topk: k = 4 exceeds the size 3 of dimension 2 in (2, 3) float32 cpu', true)
    H.raises(function() m:topk(1, { biggest = true }) end, "topk: unknown option 'biggest'", true)
  end)
end)

describe('matmul, mm, bmm, addmm', function()
  local function ref_mm(a, b)
    return H.build({ #a, #b[1] }, function(i, j)
      local s = 0
      for k = 1, #b do s = s + f32(a[i][k]) * f32(b[k][j]) end
      return s
    end)
  end

  it('mm on prime shapes and transposed operands', function()
    local a, b = H.random({ 5, 7 }, -1, 1, 1), H.random({ 7, 3 }, -1, 1, 2)
    local expected = ref_mm(a, b)
    for _, la in ipairs(H.layouts(a)) do
      for _, lb in ipairs(H.layouts(b)) do
        H.close(expected, dlua.mm(la[2], lb[2]), 1e-5, la[1] .. '/' .. lb[1])
      end
    end
    H.close(expected, dlua.tensor(a):mm(dlua.tensor(b)), 1e-5)
    H.close(expected, dlua.tensor(a):matmul(dlua.tensor(b)), 1e-5)
    assert.same({ 5, 3 }, dlua.mm(dlua.zeros(5, 0), dlua.zeros(0, 3)):size())
    H.close(H.build({ 5, 3 }, function() return 0 end), dlua.mm(dlua.zeros(5, 0), dlua.zeros(0, 3)), 0)
    H.close({ { 6 } }, dlua.mm(dlua.tensor({ { 2 } }), dlua.tensor({ { 3 } })), 0)
    H.raises(function() dlua.mm(dlua.zeros(2, 3), dlua.zeros(4, 2)) end, 'mm: ')
    H.raises(function() dlua.mm(dlua.zeros(2, 3), 5) end, 'mm: expected a tensor as argument 2, got number', true)
  end)

  it('matmul handles vectors and broadcast batches; bmm batches', function()
    local a, b = H.random({ 3, 4 }, -1, 1, 5), H.random({ 4, 2 }, -1, 1, 6)
    local v = { 1, 2, 3, 4 }
    local mv = {}
    for i = 1, 3 do mv[i] = 0 for k = 1, 4 do mv[i] = mv[i] + f32(a[i][k]) * v[k] end end
    H.close(mv, dlua.matmul(dlua.tensor(a), dlua.tensor(v)), 1e-5)
    H.close(30, dlua.matmul(dlua.tensor(v), dlua.tensor(v)):item(), 0)
    local batch = dlua.stack({ dlua.tensor(a), dlua.tensor(a):mul(2) })
    local expected = ref_mm(a, b)
    local r = dlua.matmul(batch, dlua.tensor(b))
    assert.same({ 2, 3, 2 }, r:size())
    H.close(expected, r:select(1, 1), 1e-5)
    H.close(H.map(expected, function(x) return 2 * x end), r[2], 1e-5)
    local bb = dlua.bmm(batch, dlua.stack({ dlua.tensor(b), dlua.tensor(b) }))
    H.close(r:totable(), bb, 1e-6)
    H.raises(function() dlua.bmm(dlua.zeros(2, 3), dlua.zeros(3, 2)) end, 'bmm: ')
  end)

  it('addmm = beta * c + alpha * a @ b, c broadcast', function()
    local a, b = H.random({ 3, 5 }, -1, 1, 7), H.random({ 5, 2 }, -1, 1, 8)
    local p = ref_mm(a, b)
    local c = dlua.tensor({ 1, -1 })
    local expected = H.build({ 3, 2 }, function(i, j) return 0.5 * (j == 1 and 1 or -1) + 2 * p[i][j] end)
    H.close(expected, dlua.addmm(c, dlua.tensor(a), dlua.tensor(b), { beta = 0.5, alpha = 2 }), 1e-5)
    H.close(H.build({ 3, 2 }, function(i, j) return (j == 1 and 1 or -1) + p[i][j] end),
      c:addmm(dlua.tensor(a), dlua.tensor(b)), 1e-5)
    H.raises(function() dlua.addmm(c, dlua.tensor(a), dlua.tensor(b), { gamma = 1 }) end, "addmm: unknown option 'gamma'", true)
  end)
end)

describe('random numbers', function()
  it('manual_seed makes rand/randn/randint/randperm repeat', function()
    dlua.manual_seed(1234)
    local a, b, c, d = dlua.rand(5), dlua.randn(2, 3), dlua.randint(0, 10, { 6 }), dlua.randperm(7)
    dlua.manual_seed(1234)
    H.close(a:totable(), dlua.rand(5), 0)
    H.close(b:totable(), dlua.randn(2, 3), 0)
    H.close(c:totable(), dlua.randint(0, 10, { 6 }), 0)
    H.close(d:totable(), dlua.randperm(7), 0)
    assert.equals(1234, dlua.initial_seed())
  end)

  it('rand in [0, 1), randint in [low, high) as int64, randperm a permutation of 1..n', function()
    local u = dlua.rand(1000):totable()
    local mean = 0
    for _, v in ipairs(u) do
      assert.is_true(v >= 0 and v < 1)
      mean = mean + v / 1000
    end
    assert.is_true(math.abs(mean - 0.5) < 0.05, 'mean ' .. mean)
    local n = dlua.randn(2000):totable()
    local m, s = 0, 0
    for _, v in ipairs(n) do m = m + v / 2000 end
    for _, v in ipairs(n) do s = s + (v - m) ^ 2 / 1999 end
    assert.is_true(math.abs(m) < 0.1 and math.abs(s - 1) < 0.15, m .. ' ' .. s)
    local r = dlua.randint(3, 7, 500)
    assert.equals('int64', r.dtype)
    local seen = {}
    for _, v in ipairs(r:totable()) do
      assert.is_true(v >= 3 and v < 7 and v == math.floor(v))
      seen[v] = true
    end
    assert.is_true(seen[3] and seen[6])
    assert.same({ 2, 3 }, dlua.randint(5, { 2, 3 }):size())
    local p = dlua.randperm(13):totable()
    table.sort(p)
    for k = 1, 13 do assert.equals(k, p[k]) end
    assert.equals(0, dlua.randperm(0):numel())
    assert.same({ 1 }, dlua.randperm(1):totable())
    assert.equals('float64', dlua.rand(3, { dtype = 'float64' }).dtype)
  end)

  it('Generator objects are independent streams with seed and offset state', function()
    local g1, g2 = dlua.Generator(42), dlua.Generator(42)
    assert.equals(42, g1:initial_seed())
    assert.equals(0, g1:get_offset())
    local a = dlua.rand(10, { generator = g1 })
    assert.is_true(g1:get_offset() > 0)
    dlua.rand(3) -- the default generator does not disturb g2
    H.close(a:totable(), dlua.rand(10, { generator = g2 }), 0)
    local state = g1:get_state()
    local x = dlua.randn(4, { generator = g1 })
    g1:set_state(state)
    H.close(x:totable(), dlua.randn(4, { generator = g1 }), 0)
    g1:manual_seed(7)
    assert.equals(0, g1:get_offset())
    local y = dlua.rand(4, { generator = g1 })
    g1:set_offset(0)
    H.close(y:totable(), dlua.rand(4, { generator = g1 }), 0)
    assert.is_false(y:eq(a:narrow(1, 1, 4)):all():item())
    local t = dlua.empty(6)
    t:uniform_(-2, -1, { generator = dlua.Generator(1) })
    for _, v in ipairs(t:totable()) do assert.is_true(v >= -2 and v < -1) end
    t:normal_(5, 0.001)
    for _, v in ipairs(t:totable()) do assert.is_true(math.abs(v - 5) < 0.01) end
    t:bernoulli_(1)
    H.close({ 1, 1, 1, 1, 1, 1 }, t, 0)
    assert.truthy(tostring(dlua.Generator(3)):find('Generator(seed=3, offset=0)', 1, true))
    H.raises(function() dlua.rand(2, { generator = 5 }) end, 'rand: expected a dlua.Generator, got number', true)
    H.raises(function() dlua.Generator(-1) end, 'Generator: seed must be an integer in 0..2^64-1, got -1', true)
  end)

  it('does not depend on the thread count', function()
    local before = dlua.get_num_threads()
    dlua.set_num_threads(1)
    local one = dlua.randn(5003, { generator = dlua.Generator(9) }):totable()
    dlua.set_num_threads(2)
    local two = dlua.randn(5003, { generator = dlua.Generator(9) })
    dlua.set_num_threads(before)
    H.close(one, two, 0)
  end)
end)
