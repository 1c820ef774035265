-- Tensor views from Lua: view/reshape/narrow/select/transpose/permute/expand/squeeze/flatten, slicing, split/chunk/cat/stack.
local dlua = require 'dlua'
local H = require 'tests.lua.dlua.tensor_helpers'

-- 0..n-1 as float32, shaped: element values name their row-major position.
local function seq(...)
  local sizes = { ... }
  local n = 1
  for _, s in ipairs(sizes) do n = n * s end
  return dlua.arange(n, { dtype = 'float32' }):view(sizes)
end

-- Row-major position (0-based) of a 1-based index in a contiguous shape.
local function pos(shape, ...)
  local idx, p = { ... }, 0
  for d = 1, #shape do p = p * shape[d] + (idx[d] - 1) end
  return p
end

describe('view and reshape', function()
  it('share storage and accept one -1', function()
    local t = seq(2, 3, 5)
    local v = t:view(6, -1)
    assert.same({ 6, 5 }, v:size())
    assert.is_true(v:same_storage(t))
    H.close(H.build({ 6, 5 }, function(i, j) return (i - 1) * 5 + j - 1 end), v, 0)
    assert.same({ 30 }, t:view(30):size())
    assert.same({ 5, 6 }, t:view({ 5, 6 }):size())
    v[{ 1, 1 }] = 100
    assert.equals(100, t[1][1][1])
    assert.same({ 2, 15 }, t:reshape(2, -1):size())
    assert.same({ 1 }, dlua.tensor(4):view(1):size())
    assert.same({}, dlua.tensor({ 4 }):view({}):size())
    assert.same({ 0, 3 }, dlua.zeros(0):view(0, 3):size())
  end)

  it('reshape copies a non-contiguous tensor that view cannot take', function()
    local t = seq(3, 4):t() -- (4, 3)
    H.raises(function() t:view(12) end, 'view: ')
    local r = t:reshape(12)
    local ref = {}
    for i = 1, 4 do for j = 1, 3 do ref[#ref + 1] = pos({ 3, 4 }, j, i) end end
    H.close(ref, r, 0)
    assert.is_false(r:same_storage(t))
  end)

  it('rejects impossible shapes', function()
    local t = seq(2, 3)
    H.raises(function() t:view(4, 2) end, 'view: ')
    H.raises(function() t:view(-1, -1) end, 'view: ')
    H.raises(function() t:view(-2, 3) end, 'view: size 1 must be a non-negative integer or -1, got -2', true)
    H.raises(function() t:view_as(dlua.zeros(5)) end, 'view: ')
  end)
end)

describe('narrow and select', function()
  it('narrow(dim, start, length) counts from 1, negative starts from the end', function()
    local t = seq(7, 5) -- prime sizes
    local n = t:narrow(1, 3, 4)
    H.close(H.build({ 4, 5 }, function(i, j) return pos({ 7, 5 }, i + 2, j) end), n, 0)
    assert.is_true(n:same_storage(t))
    H.close(H.build({ 7, 2 }, function(i, j) return pos({ 7, 5 }, i, j + 3) end), t:narrow(2, -2, 2), 0)
    H.close(H.build({ 7, 1 }, function(i) return pos({ 7, 5 }, i, 5) end), t:narrow(-1, 5, 1), 0)
    assert.same({ 0, 5 }, t:narrow(1, 8, 0):size()) -- an empty window after the last row
    assert.same({ 7, 0 }, t:narrow(2, 1, 0):size())
  end)

  it('narrow rejects windows outside the tensor, 1-based', function()
    local t = seq(7, 5)
    H.raises(function() t:narrow(1, 0, 2) end, 'narrow: start 0 out of range for dimension 1 of size 7 in (7, 5) float32 cpu (expected 1..7 or -7..-1)', true)
    H.raises(function() t:narrow(2, 4, 3) end, 'narrow: length 3 from start 4 exceeds dimension 2 of size 5', true)
    H.raises(function() t:narrow(3, 1, 1) end, 'narrow: dimension 3 out of range for (7, 5) float32 cpu', true)
    H.raises(function() t:narrow(1, 8, 1) end, 'narrow: start 8 out of range', true)
  end)

  it('select(dim, i) drops the dim', function()
    local t = seq(3, 5, 2)
    H.close(H.build({ 3, 2 }, function(i, k) return pos({ 3, 5, 2 }, i, 4, k) end), t:select(2, 4), 0)
    H.close(H.build({ 5, 2 }, function(j, k) return pos({ 3, 5, 2 }, 3, j, k) end), t:select(1, -1), 0)
    assert.equals(0, seq(4):select(1, 2):dim())
    assert.equals(1, seq(4):select(1, 2):item())
    H.raises(function() t:select(2, 6) end, 'select: index 6 out of range for dimension 2 of size 5', true)
    H.raises(function() t:select(2, -6) end, 'select: index -6 out of range', true)
  end)
end)

describe('transpose, t, permute', function()
  it('swap strides without copying', function()
    local t = seq(2, 3, 5)
    local tr = t:transpose(1, 3)
    assert.same({ 5, 3, 2 }, tr:size())
    assert.is_true(tr:same_storage(t))
    H.close(H.build({ 5, 3, 2 }, function(i, j, k) return pos({ 2, 3, 5 }, k, j, i) end), tr, 0)
    H.close(H.build({ 2, 5, 3 }, function(i, j, k) return pos({ 2, 3, 5 }, i, k, j) end), t:transpose(-1, -2), 0)
    local m = seq(3, 7)
    H.close(H.build({ 7, 3 }, function(i, j) return pos({ 3, 7 }, j, i) end), m:t(), 0)
    H.close({ 0, 1, 2 }, seq(3):t(), 0)
    H.raises(function() t:t() end, 't: expects a tensor with at most 2 dimensions, got (2, 3, 5) float32 cpu', true)
  end)

  it('permute takes dims as varargs or a list', function()
    local t = seq(2, 3, 5)
    local ref = H.build({ 5, 2, 3 }, function(i, j, k) return pos({ 2, 3, 5 }, j, k, i) end)
    H.close(ref, t:permute(3, 1, 2), 0)
    H.close(ref, t:permute({ -1, 1, 2 }), 0)
    H.raises(function() t:permute(1, 2) end, 'permute: expected 3 dimensions for (2, 3, 5) float32 cpu, got 2', true)
    H.raises(function() t:permute(1, 1, 2) end, 'permute: dimension 1 repeated in (1, 1, 2)', true)
    H.raises(function() t:permute(1, 2, 4) end, 'permute: dimension 4 out of range', true)
  end)
end)

describe('expand, squeeze, unsqueeze, flatten', function()
  it('expand broadcasts size-1 dims with stride 0', function()
    local col = dlua.tensor({ { 1 }, { 2 }, { 3 } })
    local e = col:expand(3, 4)
    assert.same({ 3, 4 }, e:size())
    assert.same({ 1, 0 }, e:stride())
    H.close(H.build({ 3, 4 }, function(i) return i end), e, 0)
    H.close(H.build({ 2, 3, 4 }, function(_, i) return i end), col:expand(2, -1, 4), 0)
    assert.same({ 3, 4 }, col:expand_as(dlua.zeros(3, 4)):size())
    H.raises(function() col:expand(2, 4) end, 'expand: ')
  end)

  it('squeeze and unsqueeze add and drop size-1 dims', function()
    local t = dlua.zeros(1, 3, 1, 2)
    assert.same({ 3, 2 }, t:squeeze():size())
    assert.same({ 3, 1, 2 }, t:squeeze(1):size())
    assert.same({ 1, 3, 2 }, t:squeeze(-2):size())
    assert.same({ 1, 3, 1, 2 }, t:squeeze(2):size()) -- size 3: unchanged, as PyTorch
    local v = seq(3, 2)
    assert.same({ 1, 3, 2 }, v:unsqueeze(1):size())
    assert.same({ 3, 1, 2 }, v:unsqueeze(2):size())
    assert.same({ 3, 2, 1 }, v:unsqueeze(3):size())
    assert.same({ 3, 2, 1 }, v:unsqueeze(-1):size())
    assert.same({ 3, 1, 2 }, v:unsqueeze(-2):size())
    H.close({ { { 0, 1 } }, { { 2, 3 } }, { { 4, 5 } } }, v:unsqueeze(2), 0)
    H.raises(function() v:unsqueeze(4) end, 'unsqueeze: dimension 4 out of range for (3, 2) float32 cpu (expected 1..3 or -3..-1)', true)
  end)

  it('flatten joins a run of dims', function()
    local t = seq(2, 3, 5)
    assert.same({ 30 }, t:flatten():size())
    assert.same({ 2, 15 }, t:flatten(2):size())
    assert.same({ 6, 5 }, t:flatten(1, 2):size())
    H.close(H.build({ 2, 15 }, function(i, j) return (i - 1) * 15 + j - 1 end), t:flatten(2, -1), 0)
    -- a transposed tensor flattens in its logical order (a copy)
    local f = seq(3, 2):t():flatten()
    H.close({ 0, 2, 4, 1, 3, 5 }, f, 0)
    assert.same({ 1 }, dlua.tensor(3):flatten():size())
  end)

  it('contiguous returns the tensor itself when it already is, else a packed copy', function()
    local t = seq(3, 4)
    assert.is_true(t:contiguous() == t)
    local tr = t:t()
    local c = tr:contiguous()
    assert.is_true(c:is_contiguous())
    assert.same({ 3, 1 }, c:stride())
    H.close(tr:totable(), c, 0)
    local k = t:clone()
    assert.is_false(k:same_storage(t))
    k[1][1] = 99
    assert.equals(0, t[1][1])
  end)

  it("contiguous('channels_last') lays (N, C, H, W) out as (N, H, W, C) memory, one channel included", function()
    local x = seq(2, 3, 2, 2)
    assert.is_false(x:is_contiguous('channels_last'))
    local y = x:contiguous('channels_last')
    assert.same({ 12, 1, 6, 3 }, y:stride())
    assert.is_true(y:is_contiguous('channels_last'))
    H.close(x:totable(), y, 0)
    assert.is_true(y:contiguous('channels_last') == y)
    assert.is_true(y:contiguous('contiguous'):is_contiguous())
    -- one channel: row-major strides are not taken for channels-last (the layers would read NCHW)
    local g = seq(2, 1, 3, 3)
    assert.is_true(g:is_contiguous())
    assert.is_false(g:is_contiguous('channels_last'))
    assert.same({ 9, 1, 3, 1 }, g:contiguous('channels_last'):stride())
    H.raises(function() seq(2, 3):contiguous("channels_last") end,
      "contiguous: memory_format 'channels_last' needs a 4-D (N, C, H, W) tensor, got (2, 3)", true)
    H.raises(function() x:is_contiguous("nhwc") end,
      "is_contiguous: memory_format must be 'contiguous' or 'channels_last', got nhwc", true)
  end)
end)

describe('indexing with t[i] and t[{...}]', function()
  it('t[i] selects along dim 1: a view, or a number for 1-D', function()
    local t = seq(4, 3)
    local row = t[2]
    assert.same({ 3 }, row:size())
    H.close({ 3, 4, 5 }, row, 0)
    assert.equals(5, t[2][3])
    assert.equals(11, t[-1][-1])
    assert.equals(true, dlua.tensor({ false, true })[2])
    assert.equals(3, dlua.arange(5)[4])
    H.raises(function() local _ = t[5] end, 'index: index 5 out of range for dimension 1 of size 4', true)
    H.raises(function() local _ = t[0] end, 'index: index 0 out of range', true)
    H.raises(function() local _ = dlua.tensor(1)[1] end, 'index: cannot index a 0-d tensor', true)
  end)

  it('t[i] = v fills or copies into the selection', function()
    local t = dlua.zeros(3, 4)
    t[2] = 5
    t[3] = dlua.tensor({ 1, 2, 3, 4 })
    t[1][-1] = 7
    H.close({ { 0, 0, 0, 7 }, { 5, 5, 5, 5 }, { 1, 2, 3, 4 } }, t, 0)
    local v = dlua.zeros(5, { dtype = 'int32' })
    v[5] = 9
    v[1] = true
    H.close({ 1, 0, 0, 0, 9 }, v, 0)
  end)

  it('t[{...}] takes numbers, {i, j} inclusive ranges, {i}, {} or ":" and steps', function()
    local shape = { 5, 7, 3 }
    local t = seq(5, 7, 3)
    -- t[{2, {3, 6}}] -> (4, 3): rows 3..6 of slice 2
    H.close(H.build({ 4, 3 }, function(j, k) return pos(shape, 2, j + 2, k) end), t[{ 2, { 3, 6 } }], 0)
    -- t[{{}, {2, -1}, 3}] -> (5, 6)
    H.close(H.build({ 5, 6 }, function(i, j) return pos(shape, i, j + 1, 3) end), t[{ {}, { 2, -1 }, 3 }], 0)
    H.close(H.build({ 5, 6 }, function(i, j) return pos(shape, i, j + 1, 3) end), t[{ ':', { 2, -1 }, 3 }], 0)
    -- {i} keeps the dim
    H.close(H.build({ 1, 7, 3 }, function(_, j, k) return pos(shape, 4, j, k) end), t[{ { 4 } }], 0)
    -- steps: rows 1, 3, 5 and columns 2, 5
    H.close(H.build({ 3, 2, 3 }, function(i, j, k) return pos(shape, 2 * i - 1, 3 * j - 1, k) end),
      t[{ { 1, 5, 2 }, { 2, 7, 3 } }], 0)
    -- every dim a number: a number
    assert.equals(pos(shape, 3, 4, 2), t[{ 3, 4, 2 }])
    assert.equals(pos(shape, 5, 7, 3), t[{ -1, -1, -1 }])
    -- an empty range, and the whole tensor
    assert.same({ 0, 7, 3 }, t[{ { 3, 2 } }]:size())
    assert.same({ 5, 7, 3 }, t[{}]:size())
    assert.is_true(t[{ 2, { 3, 6 } }]:same_storage(t))
  end)

  it('slices of non-contiguous tensors', function()
    local t = seq(5, 7):t() -- (7, 5)
    H.close(H.build({ 3, 2 }, function(i, j) return pos({ 5, 7 }, j + 1, i + 4) end), t[{ { 5, 7 }, { 2, 3 } }], 0)
    local e = dlua.tensor({ { 1 }, { 2 } }):expand(2, 6)
    H.close({ { 1, 1 }, { 2, 2 } }, e[{ {}, { 1, 6, 5 } }], 0)
  end)

  it('t[{...}] = v assigns numbers and broadcast tensors', function()
    local t = dlua.zeros(4, 5)
    t[{ { 2, 3 }, { 2, -2 } }] = 1
    t[{ 4, {} }] = dlua.tensor({ 1, 2, 3, 4, 5 })
    t[{ {}, 1 }] = dlua.tensor({ 9 }) -- broadcasts to the column
    t[{ 1, { 2, 5, 2 } }] = -1
    H.close({
      { 9, -1, 0, -1, 0 },
      { 9, 1, 1, 1, 0 },
      { 9, 1, 1, 1, 0 },
      { 9, 2, 3, 4, 5 },
    }, t, 0)
    t[{ 2, 3 }] = 42
    assert.equals(42, t[2][3])
  end)

  it('bad slices name the problem and the caller', function()
    local t = seq(4, 5)
    H.raises(function() local _ = t[{ 1, 2, 3 }] end, 'index: too many indices (3) for (4, 5) float32 cpu', true)
    H.raises(function() local _ = t[{ { 2, 6 } }] end, 'index: range end 6 out of range for dimension 1 of size 4', true)
    H.raises(function() local _ = t[{ { 3, 1 } }] end, 'index: range {3, 1} runs backwards in dimension 1 of size 4', true)
    H.raises(function() local _ = t[{ { 1, 4, 0 } }] end, 'index: range step must be a positive integer, got 0', true)
    H.raises(function() local _ = t[{ 'x' }] end, 'index: index 1 must be a number, a range table', true)
    H.raises(function() t[{ 1 }] = 'x' end, 'index: can assign a number or a tensor, got string', true)
    H.raises(function() t[1] = dlua.zeros(3) end, 'index: ')
  end)

  it('an integer tensor index selects rows; a bool mask assigns', function()
    local t = seq(4, 2)
    H.close({ { 6, 7 }, { 0, 1 }, { 6, 7 } }, t[dlua.tensor({ 4, 1, 4 }, { dtype = 'int64' })], 0)
    local v = dlua.tensor({ 1, -2, 3, -4 })
    v[v:lt(0)] = 0
    H.close({ 1, 0, 3, 0 }, v, 0)
  end)
end)

describe('split, chunk, unbind, cat, stack', function()
  it('split in equal pieces (the last smaller) or given sizes, as views', function()
    local t = seq(7, 2)
    local parts = t:split(3)
    assert.equals(3, #parts)
    assert.same({ 3, 2 }, parts[1]:size())
    assert.same({ 1, 2 }, parts[3]:size())
    H.close({ { 12, 13 } }, parts[3], 0)
    assert.is_true(parts[2]:same_storage(t))
    local cols = t:split(1, 2)
    assert.equals(2, #cols)
    H.close(H.build({ 7, 1 }, function(i) return pos({ 7, 2 }, i, 2) end), cols[2], 0)
    local sized = t:split({ 2, 0, 5 })
    assert.same({ 0, 2 }, sized[2]:size())
    H.close(H.build({ 5, 2 }, function(i, j) return pos({ 7, 2 }, i + 2, j) end), sized[3], 0)
    H.raises(function() t:split({ 2, 2 }) end, 'split: sizes (2, 2) add up to 4, but dimension 1 of (7, 2) float32 cpu has size 7', true)
    H.raises(function() t:split(0) end, 'split: piece size must be a positive integer, got 0', true)
  end)

  it('chunk in at most n pieces of ceil(size / n)', function()
    local t = seq(11)
    local c = t:chunk(4)
    assert.equals(4, #c)
    assert.same({ 3 }, c[1]:size())
    assert.same({ 2 }, c[4]:size())
    H.close({ 9, 10 }, c[4], 0)
    assert.equals(3, #seq(6):chunk(4)) -- pieces of 2: three of them, as PyTorch
    local rows = seq(2, 5):chunk(2, -1)
    assert.same({ 2, 3 }, rows[1]:size())
    assert.same({ 2, 2 }, rows[2]:size())
    local u = seq(3, 2):unbind(2)
    assert.equals(2, #u)
    H.close({ 1, 3, 5 }, u[2], 0)
  end)

  it('cat along an existing dim, stack along a new one', function()
    local a, b = seq(2, 3), seq(1, 3):add(100)
    H.close({ { 0, 1, 2 }, { 3, 4, 5 }, { 100, 101, 102 } }, dlua.cat({ a, b }), 0)
    H.close({ { 0, 1, 2, 0, 1 }, { 3, 4, 5, 3, 4 } }, dlua.cat({ a, a:narrow(2, 1, 2) }, 2), 0)
    H.close({ { 0, 1, 2, 0 }, { 3, 4, 5, 1 } }, dlua.cat({ a, seq(1, 2):t() }, -1), 0) -- non-contiguous
    H.close({ { { 0, 1, 2 }, { 3, 4, 5 } }, { { 0, 1, 2 }, { 3, 4, 5 } } }, dlua.stack({ a, a }), 0)
    local s = dlua.stack({ a, a:add(10) }, 3)
    assert.same({ 2, 3, 2 }, s:size())
    H.close(H.build({ 2, 3, 2 }, function(i, j, k) return pos({ 2, 3 }, i, j) + (k - 1) * 10 end), s, 0)
    assert.same({ 3 }, dlua.cat({ seq(3) }):size())
    assert.same({ 3 }, dlua.cat({ seq(3), dlua.zeros(0) }):size())
    H.raises(function() dlua.cat({}) end, 'cat: expected a non-empty list of tensors', true)
    H.raises(function() dlua.cat({ a, 'x' }) end, 'cat: expected a tensor as element 2, got string', true)
    H.raises(function() dlua.cat({ a, seq(2, 2) }) end, 'cat: ')
    H.raises(function() dlua.stack({ a, b }) end, 'stack: ')
    H.raises(function() dlua.stack({ a }, 4) end, 'stack: dimension 4 out of range', true)
  end)
end)
