-- Tensors from Lua: creation, properties, conversion, printing, raw memory, freeing, and bad input.
local dlua = require 'dlua'
local H = require 'tests.lua.dlua.tensor_helpers'

describe('dlua.tensor', function()
  it('builds from nested tables, inferring the shape, float32 for numbers and bool for booleans', function()
    local ref = H.build({ 3, 5 }, function(i, j) return i * 10 + j + 0.5 end)
    local t = dlua.tensor(ref)
    assert.same({ 3, 5 }, t:size())
    assert.equals('float32', t.dtype)
    assert.equals('cpu', t.device)
    H.close(ref, t, 0)
    local b = dlua.tensor({ { true, false }, { false, true } })
    assert.equals('bool', b.dtype)
    assert.same({ { true, false }, { false, true } }, b:totable())
  end)

  it('makes 0-d tensors from numbers, 1-element and empty ones from tables', function()
    local s = dlua.tensor(2.5)
    assert.equals(0, s:dim())
    assert.same({}, s:size())
    assert.equals(1, s:numel())
    assert.equals(2.5, s:item())
    local one = dlua.tensor({ 7 })
    assert.same({ 1 }, one:size())
    assert.equals(7, one:item())
    local e = dlua.tensor({})
    assert.same({ 0 }, e:size())
    assert.equals(0, e:numel())
    local e2 = dlua.tensor({ {}, {} })
    assert.same({ 2, 0 }, e2:size())
  end)

  it('takes a dtype: integers truncate, booleans become 0/1, float16 rounds', function()
    local v = { -2.75, -1, 0, 1.5, 3.25, 1000 }
    local cases = {
      float64 = v,
      int32 = { -2, -1, 0, 1, 3, 1000 },
      int64 = { -2, -1, 0, 1, 3, 1000 },
      float16 = v,
      bfloat16 = { -2.75, -1, 0, 1.5, 3.25, 1000 },
    }
    for dtype, expected in pairs(cases) do
      local t = dlua.tensor(v, { dtype = dtype })
      assert.equals(dtype, t.dtype)
      H.close(expected, t, 0, dtype)
    end
    H.close({ 0, 7, 255 }, dlua.tensor({ 0, 7.9, 255 }, { dtype = 'uint8' }), 0)
    H.close({ 1, 0, 1 }, dlua.tensor({ true, false, true }, { dtype = 'float32' }), 0)
    H.close({ true, false, true }, dlua.tensor({ 2, 0, -1 }, { dtype = 'bool' }), 0)
    -- 1/3 is not a float16: the nearest one is 0x3555 = 0.333251953125
    assert.equals(0.333251953125, dlua.tensor({ 1 / 3 }, { dtype = 'half' })[1])
    -- and the nearest bfloat16 is 0x3eab = 0.333984375
    assert.equals(0.333984375, dlua.tensor({ 1 / 3 }, { dtype = 'bf16' })[1])
  end)

  it('copies a tensor given in place of a table', function()
    local a = dlua.tensor({ 1, 2, 3 })
    local b = dlua.tensor(a)
    b[1] = 10
    H.close({ 1, 2, 3 }, a, 0)
    H.close({ 10, 2, 3 }, b, 0)
    assert.equals('float64', dlua.tensor(a, { dtype = 'float64' }).dtype)
  end)

  it('names the position of a ragged or mistyped entry', function()
    H.raises(function() dlua.tensor({ { 1, 2 }, { 3 } }) end, 'tensor: ragged nested table: [2] has 1 entries, expected 2', true)
    H.raises(function() dlua.tensor({ { 1, 2 }, 3 }) end, 'tensor: ragged nested table: expected a table of 2 at [2]', true)
    H.raises(function() dlua.tensor({ { 1, 'x' } }) end, 'tensor: expected a number at [1][2]', true)
    H.raises(function() dlua.tensor({ 1, true }) end, 'tensor: mixed booleans and numbers: [2] is a boolean, [1] a number', true)
    H.raises(function() dlua.tensor({ dlua.zeros(2) }) end, 'tensor: expected a number at [1] (the shape is (1)), got a tensor (dlua.stack joins tensors)', true)
    H.raises(function() dlua.tensor('abc') end, 'tensor: expected a number, a boolean or a nested table', true)
  end)
end)

describe('creation functions', function()
  it('zeros/ones/empty/full take sizes as varargs or a list, options last', function()
    for _, t in ipairs({ dlua.zeros(2, 3), dlua.zeros({ 2, 3 }) }) do
      assert.same({ 2, 3 }, t:size())
      H.close(H.build({ 2, 3 }, function() return 0 end), t, 0)
    end
    local o = dlua.ones(5, { dtype = 'float64' })
    assert.equals('float64', o.dtype)
    H.close({ 1, 1, 1, 1, 1 }, o, 0)
    local e = dlua.empty({ 7, 1 }, { dtype = 'int32' })
    assert.same({ 7, 1 }, e:size())
    assert.equals('int32', e.dtype)
    local f = dlua.full({ 3, 1, 2 }, -1.25)
    H.close(H.build({ 3, 1, 2 }, function() return -1.25 end), f, 0)
    assert.equals('bool', dlua.full({ 2 }, true).dtype)
    H.close({ 7, 7 }, dlua.full(2, 7, { dtype = 'int64' }), 0)
    -- empty, size-1 and 0-d shapes
    assert.equals(0, dlua.zeros(0):numel())
    assert.same({ 3, 0, 2 }, dlua.ones(3, 0, 2):size())
    assert.same({}, dlua.zeros({}):size())
    assert.equals(1, dlua.ones({}):item())
  end)

  it('*_like copy the shape and dtype unless told otherwise', function()
    local a = dlua.tensor({ { 1, 2, 3 } }, { dtype = 'float64' }):t() -- (3, 1), non-contiguous
    local z = dlua.zeros_like(a)
    assert.same({ 3, 1 }, z:size())
    assert.equals('float64', z.dtype)
    H.close({ { 0 }, { 0 }, { 0 } }, z, 0)
    H.close({ { 1 }, { 1 }, { 1 } }, dlua.ones_like(a, { dtype = 'int32' }), 0)
    assert.equals('int32', dlua.ones_like(a, { dtype = 'int32' }).dtype)
    H.close({ { 4 }, { 4 }, { 4 } }, dlua.full_like(a, 4), 0)
    assert.same({ 3, 1 }, dlua.empty_like(a):size())
    local r = dlua.rand_like(a)
    assert.equals('float64', r.dtype)
    for _, v in ipairs(H.flat(r:totable())) do assert.is_true(v >= 0 and v < 1) end
    assert.same({ 3, 1 }, dlua.randn_like(a):size())
  end)

  it('arange follows PyTorch: [start, end), int64 for integer bounds', function()
    local a = dlua.arange(5)
    assert.equals('int64', a.dtype)
    H.close({ 0, 1, 2, 3, 4 }, a, 0)
    H.close({ 2, 5, 8 }, dlua.arange(2, 11, 3), 0)
    H.close({ 3, 2, 1 }, dlua.arange(3, 0, -1), 0)
    local f = dlua.arange(0, 1, 0.25)
    assert.equals('float32', f.dtype)
    H.close({ 0, 0.25, 0.5, 0.75 }, f, 0)
    H.close({ 1, 2 }, dlua.arange(1, 3, { dtype = 'float64' }), 0)
    assert.equals('float64', dlua.arange(1, 3, { dtype = 'float64' }).dtype)
    assert.equals(0, dlua.arange(0):numel())
    -- prime length, reference by a loop
    local ref = {}
    for k = 0, 12 do ref[#ref + 1] = -6 + k * 0.5 end
    H.close(ref, dlua.arange(-6, 0.5, 0.5), 1e-7)
  end)

  it('linspace includes both ends; eye has ones on the diagonal', function()
    local ref = {}
    for k = 0, 6 do ref[k + 1] = -1 + k * (2 / 6) end
    H.close(ref, dlua.linspace(-1, 1, 7), 1e-6)
    H.close({ 3 }, dlua.linspace(3, 5, 1), 0)
    assert.equals(0, dlua.linspace(0, 1, 0):numel())
    H.close(H.build({ 3, 5 }, function(i, j) return i == j and 1 or 0 end), dlua.eye(3, 5), 0)
    H.close(H.build({ 4, 4 }, function(i, j) return i == j and 1 or 0 end), dlua.eye(4, { dtype = 'int32' }), 0)
    assert.equals('int32', dlua.eye(2, { dtype = 'int32' }).dtype)
    assert.same({ 0, 0 }, dlua.eye(0):size())
  end)

  it('rejects bad sizes, dtypes, devices and options with the caller\'s line', function()
    H.raises(function() dlua.zeros(2, -3) end, 'zeros: size 2 must be a non-negative integer, got -3', true)
    H.raises(function() dlua.ones(1.5) end, 'ones: size 1 must be a non-negative integer, got 1.5', true)
    H.raises(function() dlua.zeros(1, 1, 1, 1, 1, 1, 1, 1, 1) end, 'zeros: at most 8 dimensions, got 9', true)
    H.raises(function() dlua.zeros(2, { dtype = 'float8' }) end, "zeros: unknown dtype 'float8'", true)
    H.raises(function() dlua.zeros(2, { dtyp = 'float32' }) end, "zeros: unknown option 'dtyp' (expected device, dtype)", true)
    -- a CUDA device this machine lacks (every one, without a GPU)
    local missing = 'cuda:' .. dlua.cuda.device_count()
    local err = H.raises(function() dlua.zeros(2, { device = missing }) end, 'zeros: ')
    assert.truthy(err:find(dlua.cuda.is_available() and ("no device '" .. missing .. "'") or 'no CUDA device available', 1, true), err)
    H.raises(function() dlua.tensor({ 1 }, { device = 'tpu' }) end, "tensor: unknown device 'tpu'", true)
    H.raises(function() dlua.linspace(0, 1, -2) end, 'linspace: steps must be a non-negative integer', true)
    H.raises(function() dlua.eye(-1) end, 'eye: sizes must be non-negative integers', true)
    H.raises(function() dlua.full({ 2 }, 'x') end, 'full: the fill value must be a number', true)
  end)

  it('reports the bytes asked for when an allocation fails', function()
    local err = H.raises(function() dlua.empty(2 ^ 40, 2 ^ 10) end, 'empty: ')
    assert.truthy(err:find('4503599627370496', 1, true) or err:find('too large', 1, true), err)
  end)
end)

describe('tensor properties', function()
  it('size, dim, numel, stride, #, dtype, device, shape, is_contiguous', function()
    local t = dlua.zeros(2, 3, 5)
    assert.same({ 2, 3, 5 }, t:size())
    assert.same({ 2, 3, 5 }, t.shape)
    assert.equals(3, t:size(2))
    assert.equals(5, t:size(-1))
    assert.equals(2, t:size(-3))
    assert.equals(3, t:dim())
    assert.equals(3, t.ndim)
    assert.equals(30, t:numel())
    assert.same({ 15, 5, 1 }, t:stride())
    assert.equals(5, t:stride(2))
    assert.equals(2, #t)
    assert.is_true(t:is_contiguous())
    assert.is_false(t:transpose(1, 3):is_contiguous())
    assert.same({ 1, 5, 15 }, t:transpose(1, 3):stride())
    assert.equals(4, t:element_size())
    assert.equals(120, t:nbytes())
    assert.is_true(t:is_floating_point())
    assert.is_false(dlua.zeros(2, { dtype = 'int64' }):is_floating_point())
    assert.is_true(dlua.is_tensor(t))
    assert.is_false(dlua.is_tensor({}))
  end)

  it('== is identity; eq() compares elements', function()
    local a = dlua.tensor({ 1, 2 })
    local b = dlua.tensor({ 1, 2 })
    assert.is_true(a == a)
    assert.is_false(a == b)
    H.close({ true, true }, a:eq(b), 0)
  end)

  it('rejects bad dimensions 1-based, naming the tensor', function()
    local t = dlua.zeros(2, 3)
    H.raises(function() local _ = t:size(3) end, 'size: dimension 3 out of range for (2, 3) float32 cpu (expected 1..2 or -2..-1)', true)
    H.raises(function() local _ = t:size(0) end, 'size: dimension 0 is not valid for (2, 3) float32 cpu: dimensions count from 1', true)
    H.raises(function() local _ = #dlua.tensor(1) end, 'len: a 0-d tensor has no length', true)
  end)
end)

describe('conversion', function()
  it('to() a dtype converts, and returns the same tensor when nothing changes', function()
    local t = dlua.tensor({ { 1.5, -2.5 }, { 3.25, 255 } })
    local d = t:to('float64')
    assert.equals('float64', d.dtype)
    H.close({ { 1.5, -2.5 }, { 3.25, 255 } }, d, 0)
    assert.is_true(t:to('float32') == t)
    assert.is_true(t:float() == t)
    assert.is_true(t:to('cpu') == t)
    local c = t:to({ dtype = 'float32', copy = true })
    assert.is_false(c == t)
    assert.is_false(c:same_storage(t))
    H.close({ { 1, -2 }, { 3, 255 } }, t:int(), 0)
    assert.equals('int32', t:int().dtype)
    assert.equals('int64', t:long().dtype)
    assert.equals('float64', t:double().dtype)
    assert.equals('float16', t:half().dtype)
    assert.equals('bfloat16', t:bfloat16().dtype)
    assert.equals('uint8', t:byte().dtype)
    H.close({ { true, true }, { true, true } }, t:bool(), 0)
    H.close({ 0, 1, 1 }, dlua.tensor({ 0, 0.5, -3 }):bool():float(), 0)
    local other = dlua.zeros(1, { dtype = 'int64' })
    assert.equals('int64', t:to(other).dtype)
    assert.equals('int64', t:type_as(other).dtype)
  end)

  it('half and bfloat16 round to nearest even, keep NaN and Inf', function()
    -- 2049 lies halfway between float16 2048 and 2050: even mantissa wins (2048);
    -- 2051 lies between 2050 and 2052: 2052
    H.close({ 2048, 2052, 65504 }, dlua.tensor({ 2049, 2051, 65504 }):half():float(), 0)
    -- bfloat16 keeps 8 bits of mantissa: 257 -> 256, 259 -> 260
    H.close({ 256, 260 }, dlua.tensor({ 257, 259 }):bfloat16():float(), 0)
    local special = dlua.tensor({ 0 / 0, math.huge, -math.huge }):half():totable()
    assert.is_true(special[1] ~= special[1])
    assert.equals(math.huge, special[2])
    assert.equals(-math.huge, special[3])
    assert.equals(math.huge, dlua.tensor({ 1e6 }):half()[1]) -- overflows to Inf
  end)

  it('to() a CUDA device this machine lacks is a clear error', function()
    local t = dlua.zeros(2)
    local missing = 'cuda:' .. dlua.cuda.device_count()
    local err = H.raises(function() t:to(missing) end, 'to: ')
    assert.truthy(err:find(missing, 1, true), err)
  end)

  it('item() reads one element of any dtype; more than one is an error', function()
    assert.equals(-3.5, dlua.tensor({ { -3.5 } }):item())
    assert.equals(7, dlua.tensor({ 7 }, { dtype = 'int64' }):item())
    assert.equals(2 ^ 40 + 1, dlua.tensor({ 2 ^ 40 + 1 }, { dtype = 'int64' }):item())
    assert.equals(true, dlua.tensor({ true }):item())
    assert.equals(200, dlua.tensor({ 200 }, { dtype = 'uint8' }):item())
    assert.equals(0.5, dlua.tensor({ 0.5 }, { dtype = 'bfloat16' }):item())
    local t = dlua.zeros(2, 3)
    H.raises(function() t:item() end, 'item: expected a tensor with one element, got (2, 3) float32 cpu', true)
    H.raises(function() dlua.zeros(0):item() end, 'item: expected a tensor with one element', true)
  end)

  it('totable() nests like the shape, reading views through their strides', function()
    local ref = H.random({ 3, 4, 2 })
    for _, case in ipairs(H.layouts(ref)) do
      H.close(H.map(ref, H.f32), case[2]:totable(), 0, case[1])
    end
    assert.same({}, dlua.zeros(0):totable())
    assert.equals(5, dlua.tensor(5):totable())
    local ex = dlua.tensor({ { 1 }, { 2 } }):expand(2, 3)
    assert.same({ { 1, 1, 1 }, { 2, 2, 2 } }, ex:totable())
  end)
end)

describe('raw memory', function()
  local ffi = require 'ffi' -- the spec plays the loader's role: it owns C memory

  it('from_pointer copies by default, wraps with copy = false, honours strides', function()
    local buf = ffi.new('float[6]', { 1, 2, 3, 4, 5, 6 })
    local c = dlua.from_pointer(buf, { 2, 3 })
    H.close({ { 1, 2, 3 }, { 4, 5, 6 } }, c, 0)
    local w = dlua.from_pointer(buf, { 2, 3 }, { copy = false })
    buf[0] = 100
    assert.equals(1, c[1][1])
    assert.equals(100, w[1][1])
    w[{ 2, 3 }] = -6
    assert.equals(-6, buf[5])
    -- column-major view of the same memory
    local cm = dlua.from_pointer(buf, { 3, 2 }, { strides = { 1, 3 } })
    H.close({ { 100, 4 }, { 2, 5 }, { 3, -6 } }, cm, 0)
    local d = ffi.new('int64_t[3]', { 5, -6, 7 })
    H.close({ 5, -6, 7 }, dlua.from_pointer(d, { 3 }, { dtype = 'int64' }), 0)
    w:free()
  end)

  it('from_string, to_bytes, copy_to_pointer and data_ptr round-trip bytes', function()
    local s = string.char(1, 2, 3, 250, 0, 7)
    local t = dlua.from_string(s, { 2, 3 })
    assert.equals('uint8', t.dtype)
    H.close({ { 1, 2, 3 }, { 250, 0, 7 } }, t, 0)
    assert.equals(s, t:to_bytes())
    -- a transposed view writes its elements row-major
    assert.equals(string.char(1, 250, 2, 0, 3, 7), t:t():to_bytes())
    local f = dlua.tensor({ 1.5, -2 })
    local out = ffi.new('float[2]')
    f:copy_to_pointer(out, 8)
    assert.equals(1.5, out[0])
    assert.equals(-2, out[1])
    local p = ffi.cast('float *', f:data_ptr())
    assert.equals(1.5, p[0])
    p[1] = 9
    assert.equals(9, f[2])
    H.raises(function() dlua.from_string('abc', { 2 }, { dtype = 'int32' }) end,
      'from_string: 3 bytes do not hold (2) int32 (8 bytes)', true)
    H.raises(function() f:copy_to_pointer(out, 4) end, 'copy_to_pointer: (2) float32 cpu needs 8 bytes, got a buffer of 4', true)
  end)
end)

describe('freeing', function()
  it('free() releases at once; a later use names the op', function()
    local before = dlua.memory_allocated()
    local t = dlua.zeros(1000, 1000)
    assert.is_true(dlua.memory_allocated() >= before + 4e6)
    t:free()
    assert.is_true(dlua.memory_allocated() < before + 4e6)
    assert.is_true(t:is_freed())
    H.raises(function() t:add(1) end, 'add: tensor was freed', true)
    H.raises(function() local _ = t:size() end, 'size: tensor was freed', true)
    H.raises(function() local _ = t + 1 end, 'add: tensor was freed', true)
    H.raises(function() dlua.zeros(2):add(t) end, 'add: tensor was freed', true)
    assert.equals('tensor(<freed>)', tostring(t))
    t:free() -- twice is harmless
  end)

  it('a view keeps its storage after the base is freed', function()
    local base = dlua.tensor({ 1, 2, 3, 4 })
    local v = base:narrow(1, 2, 2)
    base:free()
    H.close({ 2, 3 }, v, 0)
  end)

  it('collects garbage tensors as their storage grows, without an explicit collect', function()
    collectgarbage('collect')
    local start = dlua.memory_allocated()
    local peak = 0
    for _ = 1, 200 do
      local t = dlua.empty(256, 1024) -- 1 MiB, dropped at once
      local _ = t
      peak = math.max(peak, dlua.memory_allocated() - start)
    end
    -- without pacing this would reach 200 MiB of garbage
    assert.is_true(peak < 150 * 2 ^ 20, 'peak ' .. peak)
  end)

  it('collects nothing while collectgarbage(\'stop\') holds, and catches up at the first allocation after restart', function()
    collectgarbage('collect')
    local start = dlua.memory_allocated()
    collectgarbage('stop')
    local ok, err = pcall(function()
      for _ = 1, 100 do
        local t = dlua.empty(256, 1024) -- 1 MiB, dropped at once: past the 64 MiB pacing threshold
        local _ = t
      end
    end)
    local held = dlua.memory_allocated() - start
    collectgarbage('restart')
    assert(ok, err)
    assert.equals(100 * 2 ^ 20, held)
    local t = dlua.empty(1)
    local after = dlua.memory_allocated() - start
    t:free()
    assert.is_true(after < 90 * 2 ^ 20, 'after restart ' .. after)
  end)
end)

describe('out of memory', function()
  it('collects garbage and retries once before reporting it', function()
    -- A child dlua under a 1.5 GB address-space limit, with pacing off: six dropped 400 MB
    -- tensors fit only if the failed allocation collects the earlier ones and retries;
    -- six kept ones cannot fit, and the error gives the bytes asked for.
    local script = os.tmpname()
    local f = assert(io.open(script, 'w'))
    f:write([[
      local dlua = require 'dlua'
      require('bindings.tensor_core').gc_threshold = math.huge
      for _ = 1, 6 do local t = dlua.empty(100, 1024, 1024); t = nil end
      print('dropped ok')
      local keep = {}
      local ok, err = pcall(function() for k = 1, 6 do keep[k] = dlua.empty(100, 1024, 1024) end end)
      print(ok, err)
    ]])
    f:close()
    local exe = require('dlua.host').exe
    local p = io.popen("ulimit -v 1500000 && '" .. exe .. "' '" .. script .. "' 2>&1")
    local out = p:read('*a')
    p:close()
    os.remove(script)
    assert.truthy(out:find('dropped ok', 1, true), out)
    assert.truthy(out:find('false\t.*empty: out of memory allocating 419430400 bytes'), out)
  end)
end)

describe('tostring', function()
  it('prints like PyTorch', function()
    assert.equals('tensor([[1., 2.],\n        [3., 4.]])', tostring(dlua.tensor({ { 1, 2 }, { 3, 4 } })))
    assert.equals('tensor([0.1000, 0.2500])', tostring(dlua.tensor({ 0.1, 0.25 })))
    assert.equals('tensor([-1.5000,  2.0000])', tostring(dlua.tensor({ -1.5, 2 })))
    assert.equals('tensor([1.0000e-05, 1.0000e+00])', tostring(dlua.tensor({ 1e-5, 1 })))
    assert.equals('tensor([0, 1, 2, 3, 4, 5])', tostring(dlua.arange(6)))
    assert.equals('tensor([1, 2], dtype=dlua.int32)', tostring(dlua.tensor({ 1, 2 }, { dtype = 'int32' })))
    assert.equals('tensor([ True, False])', tostring(dlua.tensor({ true, false })))
    assert.equals('tensor(3.5000)', tostring(dlua.tensor(3.5)))
    assert.equals('tensor(3.)', tostring(dlua.tensor(3)))
    assert.equals('tensor([])', tostring(dlua.zeros(0)))
    assert.equals('tensor([], size=(2, 0))', tostring(dlua.zeros(2, 0)))
    assert.equals('tensor([], dtype=dlua.int64)', tostring(dlua.zeros(0, { dtype = 'int64' })))
    assert.equals('tensor([nan, 1., inf])', tostring(dlua.tensor({ 0 / 0, 1, math.huge })))
    assert.equals('tensor([0., 0.])', tostring(dlua.zeros(2)))
    assert.equals('tensor([1., 1., 1.], dtype=dlua.float64)', tostring(dlua.ones(3, { dtype = 'float64' })))
    assert.equals('tensor([[[0, 1],\n         [2, 3]],\n\n        [[4, 5],\n         [6, 7]]])',
      tostring(dlua.arange(8):view(2, 2, 2)))
    -- a transposed view prints its logical order
    assert.equals('tensor([[1., 3.],\n        [2., 4.]])', tostring(dlua.tensor({ { 1, 2 }, { 3, 4 } }):t()))
  end)

  it('wraps long rows at 80 columns', function()
    assert.equals(
      'tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n' ..
      '        14., 15., 16., 17., 18., 19., 20., 21., 22., 23., 24., 25., 26., 27.,\n' ..
      '        28., 29.])', tostring(dlua.arange(30, { dtype = 'float32' })))
  end)

  it('summarises more than 1000 elements with the first and last 3 per dim', function()
    assert.equals('tensor([   0,    1,    2,  ..., 1998, 1999, 2000])', tostring(dlua.arange(2001)))
    local expected = table.concat({
      'tensor([[   0,    1,    2,  ...,    8,    9,   10],',
      '        [  11,   12,   13,  ...,   19,   20,   21],',
      '        [  22,   23,   24,  ...,   30,   31,   32],',
      '        ...,',
      '        [1067, 1068, 1069,  ..., 1075, 1076, 1077],',
      '        [1078, 1079, 1080,  ..., 1086, 1087, 1088],',
      '        [1089, 1090, 1091,  ..., 1097, 1098, 1099]])' }, '\n')
    assert.equals(expected, tostring(dlua.arange(1100):view(100, 11)))
  end)

  it('concatenates with strings', function()
    assert.equals('x = tensor([1.])', 'x = ' .. dlua.ones(1))
  end)
end)

describe('the dlua module', function()
  it('exposes dtypes as their names', function()
    assert.equals('float32', dlua.float32)
    assert.equals('float32', dlua.float)
    assert.equals('float64', dlua.double)
    assert.equals('float16', dlua.half)
    assert.equals('bfloat16', dlua.bfloat16)
    assert.equals('int64', dlua.long)
    assert.equals('uint8', dlua.uint8)
    assert.equals('bool', dlua.bool)
    assert.equals('int32', dlua.dtypes.int)
    assert.equals(dlua.float64, dlua.zeros(1, { dtype = dlua.double }).dtype)
    assert.equals('tensor([1.], dtype=dlua.float16)', tostring(dlua.ones(1, { dtype = dlua.half })))
  end)

  it('offers methods as functions, as torch.exp(t)', function()
    local t = dlua.tensor({ { 1, 2 }, { 3, 4 } })
    H.close({ { H.f32(math.exp(1)), H.f32(math.exp(2)) }, { H.f32(math.exp(3)), H.f32(math.exp(4)) } },
      dlua.exp(t), 1e-7)
    H.close({ 4, 6 }, dlua.sum(t, 1), 0)
    H.close({ { 3, 4 }, { 5, 6 } }, dlua.add(t, 2), 0)
    H.close({ { 1, 3 }, { 2, 4 } }, dlua.transpose(t, 1, 2), 0)
    assert.equals(4, dlua.numel(t))
    local v, i = dlua.max(t, 2)
    H.close({ 2, 4 }, v, 0)
    H.close({ 2, 2 }, i, 0)
  end)

  it('refuses unknown fields and reports memory', function()
    local t = dlua.zeros(2)
    H.raises(function() t.foo = 1 end, "tensor: cannot set field 'foo' of a tensor", true)
    assert.is_nil(t.no_such_method)
    local before = dlua.memory_allocated('cpu')
    local big = dlua.zeros(1024, 1024)
    assert.is_true(dlua.memory_allocated() - before >= 4 * 2 ^ 20)
    assert.is_true(dlua.memory_peak() >= dlua.memory_allocated())
    big:free()
  end)
end)

describe('size lists', function()
  local dlua = require 'dlua'
  it('print as a shape and still work as plain lists', function()
    local s = dlua.zeros(2, 1, 5):size()
    assert.equals('dlua.Size(2, 1, 5)', tostring(s))
    assert.same({ 2, 1, 5 }, { s[1], s[2], s[3] })
    assert.equals(3, #s)
    assert.same({ 2, 1, 5 }, dlua.empty(s):size())
  end)
end)
