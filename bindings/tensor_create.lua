-- Making tensors from Lua: nested tables, fills, ranges, random numbers and generators, dtype conversion, raw memory.
local core = require 'bindings.tensor_core'
local ffi, C = core.ffi, core.C
local methods, getters = core.methods, core.getters
local raise, handle, new, call = core.raise, core.handle, core.new, core.call
local format, floor = string.format, math.floor
local istype = ffi.istype
local F32, F64, F16, BF16, I32, I64, U8, BOOL =
  core.F32, core.F64, core.F16, core.BF16, core.I32, core.I64, core.U8, core.BOOL
local CPU = C.DLUA_CPU

local M = {}

local creation_opts = { dtype = true, device = true }
local random_opts = { dtype = true, device = true, generator = true }

---------------------------------------------------------------------------------------------
-- Reading and writing single elements of host memory

-- Element i (0-based) of a typed pointer of dtype `code`, as a Lua value (bool as boolean).
local function read(code, tp, i)
  if code == I64 then return tonumber(tp[i]) end
  if code == F16 then return C.dlua_f16_to_f32(tp[i]) end
  if code == BF16 then return C.dlua_bf16_to_f32(tp[i]) end
  if code == BOOL then return tp[i] ~= 0 end
  return tp[i]
end
M.read = read

local function write(code, tp, i, v)
  if type(v) == 'boolean' then v = v and 1 or 0 end
  if code == F16 then tp[i] = C.dlua_f32_to_f16(v)
  elseif code == BF16 then tp[i] = C.dlua_f32_to_bf16(v)
  elseif code == BOOL then tp[i] = (v ~= 0) and 1 or 0
  else tp[i] = v end
end

---------------------------------------------------------------------------------------------
-- Generators

local gen_methods = {}
local Generator = ffi.metatype('struct dlua_generator_ref', {
  __index = gen_methods,
  __gc = function(g)
    if g.p ~= nil and g.owned ~= 0 then C.dlua_generator_free(g.p) end
    g.p = nil
  end,
  __tostring = function(g)
    if g.p == nil then return 'Generator(freed)' end
    return format('Generator(seed=%s, offset=%s)', tostring(gen_methods.initial_seed(g)),
      tostring(gen_methods.get_offset(g)))
  end,
})

-- A seed or offset from Lua (number or 64-bit cdata) for a uint64_t parameter.
local function u64(op, v, what)
  if type(v) == 'number' then
    if v < 0 or v ~= floor(v) or v >= 2 ^ 64 then
      raise(format('%s: %s must be an integer in 0..2^64-1, got %s', op, what, tostring(v)))
    end
    return v
  end
  if type(v) == 'cdata' and (istype('uint64_t', v) or istype('int64_t', v)) then
    if istype('int64_t', v) and v < 0 then raise(format('%s: %s must not be negative, got %s', op, what, tostring(v))) end
    return v
  end
  raise(format('%s: %s must be an integer, got %s', op, what, type(v)))
end

-- A uint64 back to Lua: a number when exact, else the 64-bit cdata.
local function from_u64(v)
  if v < 2ULL ^ 53 then return tonumber(v) end
  return v
end

local function gen_handle(op, g)
  if not istype(Generator, g) then raise(format('%s: expected a dlua.Generator, got %s', op, type(g))) end
  if g.p == nil then raise(op .. ': generator was freed') end
  return g.p
end

-- PyTorch's default seed, so that dlua.Generator() is reproducible as torch.Generator() is.
local DEFAULT_SEED = 67280421310721

function M.Generator(seed)
  local s = u64('Generator', seed == nil and DEFAULT_SEED or seed, 'seed')
  local out = ffi.new('dlua_generator_t *[1]')
  core.check(C.dlua_generator_new(out, s), 'Generator')
  return Generator(out[0], 1)
end

local default_gen
function M.default_generator()
  if default_gen == nil then default_gen = Generator(C.dlua_generator_default(), 0) end
  return default_gen
end

function gen_methods.manual_seed(g, seed)
  C.dlua_generator_manual_seed(gen_handle('manual_seed', g), u64('manual_seed', seed, 'seed'))
  return g
end
function gen_methods.initial_seed(g) return from_u64(C.dlua_generator_seed(gen_handle('initial_seed', g))) end
function gen_methods.get_offset(g) return from_u64(C.dlua_generator_offset(gen_handle('get_offset', g))) end
function gen_methods.set_offset(g, offset)
  C.dlua_generator_set_offset(gen_handle('set_offset', g), u64('set_offset', offset, 'offset'))
  return g
end
-- The whole state is (seed, offset): saving it resumes the stream bit for bit.
function gen_methods.get_state(g)
  return { seed = gen_methods.initial_seed(g), offset = gen_methods.get_offset(g) }
end
function gen_methods.set_state(g, st)
  if type(st) ~= 'table' or st.seed == nil or st.offset == nil then
    raise('set_state: expected a table {seed=, offset=} from get_state()')
  end
  C.dlua_generator_manual_seed(gen_handle('set_state', g), u64('set_state', st.seed, 'seed'))
  C.dlua_generator_set_offset(g.p, u64('set_state', st.offset, 'offset'))
  return g
end
-- As every checkpointable object: {seed =, offset =} (64-bit cdata past 2^53), for dlua.ckpt.
gen_methods.state_dict = gen_methods.get_state
function gen_methods.load_state_dict(g, sd) return gen_methods.set_state(g, sd) end

function M.manual_seed(seed)
  local g = M.default_generator()
  gen_methods.manual_seed(g, seed)
  return g
end
function M.initial_seed() return gen_methods.initial_seed(M.default_generator()) end
function M.is_generator(x) return istype(Generator, x) end

-- The C generator of an options table: NULL means the default one.
M.generator_handle = gen_handle -- for other bindings (dropout)

local function opt_generator(op, opts)
  local g = opts and opts.generator
  if g == nil then return nil end
  return gen_handle(op, g)
end

---------------------------------------------------------------------------------------------
-- Creation

local function empty(op, n, sizes, opts, default_dtype)
  local o = core.options(op, opts, random_opts)
  local dtype = core.dtype(op, o.dtype, default_dtype or F32)
  local device = core.device(op, o.device)
  return new(op, C.dlua_tensor_empty, 4, n, sizes, dtype, device), o
end

function M.empty(...)
  local n, sizes, opts = core.size_args('empty', false, 1, ...)
  core.options('empty', opts, creation_opts)
  return (empty('empty', n, sizes, opts))
end

function M.zeros(...)
  local n, sizes, opts = core.size_args('zeros', false, 1, ...)
  local o = core.options('zeros', opts, creation_opts)
  return new('zeros', C.dlua_tensor_zeros, 4, n, sizes, core.dtype('zeros', o.dtype, F32), core.device('zeros', o.device))
end

function M.ones(...)
  local n, sizes, opts = core.size_args('ones', false, 1, ...)
  core.options('ones', opts, creation_opts)
  local t = empty('ones', n, sizes, opts)
  call('ones', C.dlua_tensor_fill_, 2, t, 1)
  return t
end

local function number_arg(op, v, what)
  if type(v) == 'boolean' then return v and 1 or 0 end
  if type(v) ~= 'number' then raise(format('%s: %s must be a number, got %s', op, what, type(v))) end
  return v
end

-- full(sizes, value, opts): sizes a list (or one number for 1-D).
function M.full(size, value, opts)
  if type(size) == 'number' then size = { size } end
  if type(size) ~= 'table' then raise('full: expected a list of sizes, got ' .. type(size)) end
  local n, sizes = core.size_args('full', false, 1, size)
  core.options('full', opts, creation_opts)
  local default = type(value) == 'boolean' and BOOL or F32
  local t = empty('full', n, sizes, opts, default)
  call('full', C.dlua_tensor_fill_, 2, t, number_arg('full', value, 'the fill value'))
  return t
end

local function like(op, t, opts, allowed)
  local p = handle(op, t, 'argument 1')
  local o = core.options(op, opts, allowed or creation_opts)
  local dtype = core.dtype(op, o.dtype, core.dtype_of(p))
  local device = o.device == nil and C.dlua_tensor_device(p) or core.device(op, o.device)
  local n = C.dlua_tensor_ndim(p)
  return new(op, C.dlua_tensor_empty, 4, n, C.dlua_tensor_sizes(p), dtype, device), o
end

function M.empty_like(t, opts) return (like('empty_like', t, opts)) end

-- An uninitialised (N, C, H, W) tensor in channels-last memory; sizes = {N, C, H, W}.
function M.empty_channels_last(sizes, opts)
  return M.empty(sizes[1], sizes[3], sizes[4], sizes[2], opts):permute(1, 4, 2, 3)
end
function M.zeros_like(t, opts)
  local r = like('zeros_like', t, opts)
  call('zeros_like', C.dlua_tensor_fill_, 2, r, 0)
  return r
end
function M.ones_like(t, opts)
  local r = like('ones_like', t, opts)
  call('ones_like', C.dlua_tensor_fill_, 2, r, 1)
  return r
end
function M.full_like(t, value, opts)
  local r = like('full_like', t, opts)
  call('full_like', C.dlua_tensor_fill_, 2, r, number_arg('full_like', value, 'the fill value'))
  return r
end
function M.rand_like(t, opts)
  local r, o = like('rand_like', t, opts, random_opts)
  call('rand_like', C.dlua_tensor_uniform_, 4, r, 0, 1, opt_generator('rand_like', o))
  return r
end
function M.randn_like(t, opts)
  local r, o = like('randn_like', t, opts, random_opts)
  call('randn_like', C.dlua_tensor_normal_, 4, r, 0, 1, opt_generator('randn_like', o))
  return r
end

-- t on `device` (a C ordinal): t itself when it is there, else a copy there (t is freed).
local function on_device(t, device)
  local name = core.device_name(device)
  if t.device == name then return t end
  local d = t:to(name)
  t:free()
  return d
end

-- arange(end) / arange(start, end [, step]) [, opts]: [start, end) as PyTorch; int64 when
-- every bound is an integer, else float32.
function M.arange(a, b, c, d)
  local args = { a, b, c, d }
  local opts
  for k = 4, 1, -1 do
    if type(args[k]) == 'table' then opts = args[k]; args[k] = nil; break end
  end
  local start, stop, step = args[1], args[2], args[3]
  if stop == nil then start, stop = 0, start end
  step = step or 1
  for _, v in ipairs({ start, stop, step }) do number_arg('arange', v, 'a bound') end
  if start == nil then raise('arange: expected arange(end) or arange(start, end [, step])') end
  local o = core.options('arange', opts, creation_opts)
  local device = core.device('arange', o.device)
  local ints = core.is_int(start) and core.is_int(stop) and core.is_int(step)
  local dtype = core.dtype('arange', o.dtype, ints and I64 or F32)
  return on_device(new('arange', C.dlua_tensor_arange, 4, start, stop, step, dtype), device)
end

function M.linspace(start, stop, steps, opts)
  number_arg('linspace', start, 'start')
  number_arg('linspace', stop, 'end')
  if not core.is_int(steps) or steps < 0 then
    raise(format('linspace: steps must be a non-negative integer, got %s', tostring(steps)))
  end
  local o = core.options('linspace', opts, creation_opts)
  local device = core.device('linspace', o.device)
  return on_device(new('linspace', C.dlua_tensor_linspace, 4, start, stop, steps, core.dtype('linspace', o.dtype, F32)),
    device)
end

-- eye(n [, m] [, opts])
function M.eye(n, m, opts)
  if type(m) == 'table' then m, opts = nil, m end
  m = m or n
  for _, v in ipairs({ n, m }) do
    if not core.is_int(v) or v < 0 then
      raise(format('eye: sizes must be non-negative integers, got %s', tostring(v)))
    end
  end
  local o = core.options('eye', opts, creation_opts)
  local device = core.device('eye', o.device)
  return on_device(new('eye', C.dlua_tensor_eye, 3, n, m, core.dtype('eye', o.dtype, F32)), device)
end

function M.rand(...)
  local n, sizes, opts = core.size_args('rand', false, 1, ...)
  local t, o = empty('rand', n, sizes, opts)
  call('rand', C.dlua_tensor_uniform_, 4, t, 0, 1, opt_generator('rand', o))
  return t
end

function M.randn(...)
  local n, sizes, opts = core.size_args('randn', false, 1, ...)
  local t, o = empty('randn', n, sizes, opts)
  call('randn', C.dlua_tensor_normal_, 4, t, 0, 1, opt_generator('randn', o))
  return t
end

-- randint(low, high, sizes... [, opts]) or randint(high, sizes [, opts]): integers in
-- [low, high), int64 unless a dtype is given.
function M.randint(low, high, ...)
  if type(high) == 'table' then
    return M.randint(0, low, high, ...)
  end
  if not core.is_int(low) or not core.is_int(high) then
    raise(format('randint: low and high must be integers, got %s and %s', tostring(low), tostring(high)))
  end
  if low >= high then raise(format('randint: expected low < high, got low = %d, high = %d', low, high)) end
  local n, sizes, opts = core.size_args('randint', false, 1, ...)
  local t, o = empty('randint', n, sizes, opts, I64)
  call('randint', C.dlua_tensor_randint_, 4, t, low, high, opt_generator('randint', o))
  return t
end

-- A random permutation of 1..n (positions are 1-based in Lua).
function M.randperm(n, opts)
  if not core.is_int(n) or n < 0 then
    raise(format('randperm: n must be a non-negative integer, got %s', tostring(n)))
  end
  local o = core.options('randperm', opts, random_opts)
  local device = core.device('randperm', o.device)
  -- The shuffle is sequential: drawn on the host, then copied to the device (the same values).
  return on_device(new('randperm', C.dlua_tensor_randperm, 4, n, 1, core.dtype('randperm', o.dtype, I64),
    opt_generator('randperm', o)), device)
end

-- In-place fills from a generator.
function methods.uniform_(t, low, high, opts)
  if type(low) == 'table' then low, high, opts = nil, nil, low end
  local o = core.options('uniform_', opts, { generator = true })
  call('uniform_', C.dlua_tensor_uniform_, 4, t, low or 0, high or 1, opt_generator('uniform_', o))
  return t
end
function methods.normal_(t, mean, std, opts)
  if type(mean) == 'table' then mean, std, opts = nil, nil, mean end
  local o = core.options('normal_', opts, { generator = true })
  call('normal_', C.dlua_tensor_normal_, 4, t, mean or 0, std or 1, opt_generator('normal_', o))
  return t
end
function methods.bernoulli_(t, prob, opts)
  if type(prob) == 'table' then prob, opts = nil, prob end
  local o = core.options('bernoulli_', opts, { generator = true })
  call('bernoulli_', C.dlua_tensor_bernoulli_, 3, t, prob or 0.5, opt_generator('bernoulli_', o))
  return t
end
-- random_(low, high): integers in [low, high).
function methods.random_(t, low, high, opts)
  if type(high) == 'table' or high == nil then low, high, opts = 0, low, high end
  local o = core.options('random_', opts, { generator = true })
  call('random_', C.dlua_tensor_randint_, 4, t, low, high, opt_generator('random_', o))
  return t
end

---------------------------------------------------------------------------------------------
-- dlua.tensor(nested table [, opts])

local function path_str(path, depth)
  local parts = {}
  for k = 1, depth do parts[k] = '[' .. path[k] .. ']' end
  return table.concat(parts)
end

-- The shape of a nested table, following first elements.
local function infer_shape(data)
  local shape, x = {}, data
  while type(x) == 'table' do
    shape[#shape + 1] = #x
    if #shape > 8 then raise('tensor: at most 8 dimensions') end
    if #x == 0 then break end
    x = x[1]
  end
  return shape, x
end

function M.tensor(data, opts)
  local o = core.options('tensor', opts, creation_opts)
  local device = core.device('tensor', o.device)
  if core.is_tensor(data) then
    local p = handle('tensor', data)
    local dtype = core.dtype('tensor', o.dtype, core.dtype_of(p))
    -- a copy, as torch.tensor(t): on t's own device unless device= says another
    local t = new('tensor', C.dlua_tensor_to_dtype, 2, data, dtype)
    return o.device == nil and t or on_device(t, device)
  end
  local kind = type(data)
  if kind ~= 'table' and kind ~= 'number' and kind ~= 'boolean' then
    raise('tensor: expected a number, a boolean or a nested table of them, got ' .. kind)
  end
  local shape, leaf = infer_shape(data)
  local numel = 1
  for k = 1, #shape do numel = numel * shape[k] end
  local default = type(leaf) == 'boolean' and BOOL or F32
  local dtype = core.dtype('tensor', o.dtype, default)
  local buf = core.array_types[dtype](numel > 0 and numel or 1)
  local ndim = #shape
  local path = {}
  local pos = 0
  local leaf_type = type(leaf)
  local function fill(x, depth)
    if depth == ndim then
      local tx = type(x)
      if tx ~= 'number' and tx ~= 'boolean' then
        raise(format('tensor: expected a number at %s (the shape is %s), got %s%s',
          path_str(path, depth), core.shape_str(shape), core.is_tensor(x) and 'a tensor' or tx,
          core.is_tensor(x) and ' (dlua.stack joins tensors)' or ''))
      end
      if tx ~= leaf_type then
        raise(format('tensor: mixed booleans and numbers: %s is a %s, %s a %s', path_str(path, depth), tx,
          ndim > 0 and path_str({ 1, 1, 1, 1, 1, 1, 1, 1 }, ndim) or 'the first', leaf_type))
      end
      write(dtype, buf, pos, x)
      pos = pos + 1
      return
    end
    if type(x) ~= 'table' then
      raise(format('tensor: ragged nested table: expected a table of %d at %s (the shape is %s), got %s',
        shape[depth + 1], depth == 0 and 'the top' or path_str(path, depth), core.shape_str(shape), type(x)))
    end
    if #x ~= shape[depth + 1] then
      raise(format('tensor: ragged nested table: %s has %d entries, expected %d (the shape is %s)',
        depth == 0 and 'the top' or path_str(path, depth), #x, shape[depth + 1], core.shape_str(shape)))
    end
    for k = 1, #x do
      path[depth + 1] = k
      fill(x[k], depth + 1)
    end
  end
  fill(data, 0)
  local sizes = ffi.new('int64_t[8]')
  for k = 1, ndim do sizes[k - 1] = shape[k] end
  return on_device(new('tensor', C.dlua_tensor_from_data, 4, ndim, sizes, dtype, buf), device)
end

---------------------------------------------------------------------------------------------
-- Raw memory, for loaders

local ptr_opts = { dtype = true, strides = true, copy = true }

-- A tensor over `ptr` (a cdata pointer) with `sizes`. With copy = false (the default is true)
-- the tensor wraps the memory without copying, and the memory must outlive the tensor and
-- every view of it.
function M.from_pointer(ptr, sizes, opts)
  if type(ptr) ~= 'cdata' then raise('from_pointer: expected a cdata pointer, got ' .. type(ptr)) end
  local n, sz = core.size_args('from_pointer', false, 1, sizes)
  local o = core.options('from_pointer', opts, ptr_opts)
  local dtype = core.dtype('from_pointer', o.dtype, F32)
  local strides = nil
  if o.strides ~= nil then
    if type(o.strides) ~= 'table' or #o.strides ~= n then
      raise(format('from_pointer: strides must be a list of %d integers', n))
    end
    strides = ffi.new('int64_t[8]')
    for k = 1, n do
      if not core.is_int(o.strides[k]) then raise('from_pointer: strides must be integers') end
      strides[k - 1] = o.strides[k]
    end
  end
  local data = ffi.cast('void *', ptr)
  if o.copy == false then
    return new('from_pointer', C.dlua_tensor_wrap, 7, n, sz, strides, dtype, data, nil, nil)
  end
  if strides == nil then
    return new('from_pointer', C.dlua_tensor_from_data, 4, n, sz, dtype, data)
  end
  local view = new('from_pointer', C.dlua_tensor_wrap, 7, n, sz, strides, dtype, data, nil, nil)
  local r = new('from_pointer', C.dlua_tensor_clone, 1, view)
  view:free()
  return r
end

-- A tensor holding a copy of a Lua string's bytes (e.g. a file's contents).
function M.from_string(s, sizes, opts)
  if type(s) ~= 'string' then raise('from_string: expected a string, got ' .. type(s)) end
  local n, sz = core.size_args('from_string', false, 1, sizes)
  local o = core.options('from_string', opts, { dtype = true })
  local dtype = core.dtype('from_string', o.dtype, U8)
  local numel = 1
  for k = 0, n - 1 do numel = numel * tonumber(sz[k]) end
  if numel * core.elem_sizes[dtype] ~= #s then
    raise(format('from_string: %d bytes do not hold %s %s (%d bytes)', #s, core.shape_str(core.sizes_of_buf(n, sz)),
      core.dtype_names[dtype], numel * core.elem_sizes[dtype]))
  end
  return new('from_string', C.dlua_tensor_from_data, 4, n, sz, dtype, ffi.cast('const void *', s))
end

-- Address of the first element (CPU tensors); valid while t and its storage live.
function methods.data_ptr(t)
  local p = handle('data_ptr', t)
  if C.dlua_tensor_device(p) ~= CPU then raise('data_ptr: only CPU tensors have a host address, got ' .. core.describe(p)) end
  return C.dlua_tensor_data(p)
end

local function nbytes(p)
  return tonumber(C.dlua_tensor_numel(p)) * core.elem_sizes[core.dtype_of(p)]
end

-- Writes the elements, contiguous and row-major, to `ptr` (which holds nbytes bytes).
function methods.copy_to_pointer(t, ptr, size)
  local p = handle('copy_to_pointer', t)
  local need = nbytes(p)
  if size ~= nil and size ~= need then
    raise(format('copy_to_pointer: %s needs %d bytes, got a buffer of %d', core.describe(p), need, size))
  end
  call('copy_to_pointer', C.dlua_tensor_to_data, 3, t, ffi.cast('void *', ptr), need)
  return t
end

-- The elements as a Lua string of bytes, contiguous and row-major.
function methods.to_bytes(t)
  local p = handle('to_bytes', t)
  local need = nbytes(p)
  local buf = ffi.new('uint8_t[?]', need > 0 and need or 1)
  call('to_bytes', C.dlua_tensor_to_data, 3, t, buf, need)
  return ffi.string(buf, need)
end

---------------------------------------------------------------------------------------------
-- Elements to Lua

local scratch = ffi.new('double[1]')

function methods.item(t)
  local p = handle('item', t)
  if C.dlua_tensor_numel(p) ~= 1 then
    raise(format('item: expected a tensor with one element, got %s', core.describe(p)))
  end
  local code = core.dtype_of(p)
  call('item', C.dlua_tensor_to_data, 3, t, scratch, core.elem_sizes[code])
  return read(code, ffi.cast(core.ptr_types[code], scratch), 0)
end

-- A readable view of t's elements in host memory: typed pointer and strides (in elements).
-- CPU tensors are read in place; `keep` holds any copy alive.
function M.host_elements(p)
  local code = core.dtype_of(p)
  local n = C.dlua_tensor_ndim(p)
  local sizes = core.sizes(p)
  local strides = {}
  if C.dlua_tensor_device(p) == CPU then
    local s = C.dlua_tensor_strides(p)
    for k = 1, n do strides[k] = tonumber(s[k - 1]) end
    return ffi.cast(core.ptr_types[code], C.dlua_tensor_data(p)), sizes, strides, code, nil
  end
  local numel = tonumber(C.dlua_tensor_numel(p))
  local keep = core.array_types[code](numel > 0 and numel or 1)
  core.check(C.dlua_tensor_to_data(p, keep, numel * core.elem_sizes[code]), 'totable')
  local acc = 1
  for k = n, 1, -1 do strides[k] = acc; acc = acc * sizes[k] end
  return ffi.cast(core.ptr_types[code], keep), sizes, strides, code, keep
end

-- Nested Lua tables (a number or boolean for a 0-d tensor).
function methods.totable(t)
  local p = handle('totable', t)
  local tp, sizes, strides, code, keep = M.host_elements(p)
  local n = #sizes
  local function walk(depth, off)
    if depth > n then return read(code, tp, off) end
    local r, st = {}, strides[depth]
    for k = 1, sizes[depth] do r[k] = walk(depth + 1, off + (k - 1) * st) end
    return r
  end
  local r = walk(1, 0)
  core.keepalive(t, 'totable')
  core.keepalive(keep)
  return r
end
methods.tolist = methods.totable

---------------------------------------------------------------------------------------------
-- Conversion

-- A copy of t in dtype code; a channels-last tensor's copy is channels-last too (PyTorch's preserve_format).
local function convert(op, t, code)
  local p = handle(op, t)
  if C.dlua_tensor_ndim(p) == 4 and C.dlua_tensor_is_contiguous(p) == 0 and core.has_memory_format(op, p, 'channels_last') then
    local o = { dtype = core.dtype_names[code], device = core.device_name(C.dlua_tensor_device(p)) }
    return M.empty_channels_last(core.sizes(p), o):copy_(t)
  end
  return new(op, C.dlua_tensor_to_dtype, 2, t, code)
end

local function to_dtype(op, t, code)
  if core.dtype_of(handle(op, t)) == code then return t end
  return convert(op, t, code)
end
M.to_dtype = to_dtype

-- to(dtype) / to(device) / to(other tensor) / to{dtype=, device=, copy=, non_blocking=}: returns
-- t itself when nothing changes (as PyTorch), unless copy = true. The result keeps t's memory format:
-- a move keeps the strides of a dense t (channels-last, a transpose), a dtype change keeps channels-last.
function methods.to(t, what, opts)
  local p = handle('to', t)
  local dtype, device, copy
  if core.is_tensor(what) then
    local q = handle('to', what, 'argument 1')
    dtype, device = core.dtype_of(q), C.dlua_tensor_device(q)
  elseif type(what) == 'string' then
    if core.dtype_codes[what] then dtype = core.dtype_codes[what] else device = core.device('to', what) end
  elseif type(what) == 'table' then
    opts = what
  elseif what ~= nil then
    raise('to: expected a dtype, a device, a tensor or an options table, got ' .. type(what))
  end
  local o = core.options('to', opts, { dtype = true, device = true, copy = true, non_blocking = true })
  if o.dtype ~= nil then dtype = core.dtype('to', o.dtype) end
  if o.device ~= nil then device = core.device('to', o.device) end
  copy = o.copy
  dtype = dtype or core.dtype_of(p)
  if device ~= nil and device ~= C.dlua_tensor_device(p) then
    -- convert where the conversion runs today (the CPU), then move
    if C.dlua_tensor_device(p) == CPU then t = to_dtype('to', t, dtype) end
    -- non_blocking: a CPU -> GPU copy is only queued on the current stream (keep t unchanged
    -- until it has run, e.g. by an Event); other moves wait as usual.
    local moved = new('to', o.non_blocking and C.dlua_tensor_to_device_async or C.dlua_tensor_to_device, 2, t, device)
    return to_dtype('to', moved, dtype)
  end
  if copy then return convert('to', t, dtype) end
  return to_dtype('to', t, dtype)
end

-- t:cuda() (the current device), t:cuda(1) or t:cuda('cuda:1'): t itself when already there.
function methods.cuda(t, device)
  local p = handle('cuda', t)
  local dev
  if device == nil then dev = core.device('cuda', 'cuda')
  elseif type(device) == 'number' then dev = core.device('cuda', 'cuda:' .. device)
  else dev = core.device('cuda', device) end
  if dev == CPU then raise("cuda: expected a CUDA device, got 'cpu'") end
  if C.dlua_tensor_device(p) == dev then return t end
  return new('cuda', C.dlua_tensor_to_device, 2, t, dev)
end

-- A copy in page-locked host memory, for fast asynchronous copies to the GPU.
function methods.pin_memory(t)
  handle('pin_memory', t)
  return new('pin_memory', C.dlua_tensor_pin_memory, 1, t)
end

function methods.float(t) return to_dtype('float', t, F32) end
function methods.double(t) return to_dtype('double', t, F64) end
function methods.half(t) return to_dtype('half', t, F16) end
function methods.bfloat16(t) return to_dtype('bfloat16', t, BF16) end
function methods.int(t) return to_dtype('int', t, I32) end
function methods.long(t) return to_dtype('long', t, I64) end
function methods.byte(t) return to_dtype('byte', t, U8) end
function methods.bool(t) return to_dtype('bool', t, BOOL) end
function methods.cpu(t)
  local p = handle('cpu', t)
  if C.dlua_tensor_device(p) == CPU then return t end
  return new('cpu', C.dlua_tensor_to_device, 2, t, CPU)
end
function methods.type_as(t, other)
  return to_dtype('type_as', t, core.dtype_of(handle('type_as', other, 'argument 1')))
end

---------------------------------------------------------------------------------------------
-- Properties

function getters.dtype(t) return core.dtype_names[core.dtype_of(handle('dtype', t))] end
function getters.device(t) return core.device_name(C.dlua_tensor_device(handle('device', t))) end
function getters.ndim(t) return C.dlua_tensor_ndim(handle('ndim', t)) end
function getters.shape(t) return core.sizes(handle('shape', t)) end
function getters.is_cuda(t) return C.dlua_tensor_device(handle('is_cuda', t)) ~= CPU end

function methods.dim(t) return C.dlua_tensor_ndim(handle('dim', t)) end
methods.ndimension = methods.dim
function methods.numel(t) return tonumber(C.dlua_tensor_numel(handle('numel', t))) end
methods.nelement = methods.numel

-- size() -> list; size(d) -> one size (d 1-based, negative from the end).
function methods.size(t, d)
  local p = handle('size', t)
  if d == nil then return core.sizes(p) end
  return tonumber(C.dlua_tensor_sizes(p)[core.dim('size', p, d)])
end

function methods.stride(t, d)
  local p = handle('stride', t)
  local s = C.dlua_tensor_strides(p)
  if d ~= nil then return tonumber(s[core.dim('stride', p, d)]) end
  local r = {}
  for k = 0, C.dlua_tensor_ndim(p) - 1 do r[k + 1] = tonumber(s[k]) end
  return r
end

-- is_contiguous([memory_format]): 'contiguous' (default) or 'channels_last'. Channels-last
-- means exactly the strides of (N, H, W, C) memory, size-1 dims included, so a one-channel
-- image made channels-last is not taken for a row-major one by the layers.
-- Whether tensor handle p has memory_format ('contiguous' or 'channels_last'); op names the caller.
function core.has_memory_format(op, p, memory_format)
  if memory_format == nil or memory_format == 'contiguous' then return C.dlua_tensor_is_contiguous(p) ~= 0 end
  if memory_format ~= 'channels_last' then
    raise(format("%s: memory_format must be 'contiguous' or 'channels_last', got %s", op, tostring(memory_format)))
  end
  if C.dlua_tensor_ndim(p) ~= 4 then
    raise(format("%s: memory_format 'channels_last' needs a 4-D (N, C, H, W) tensor, got %s", op, core.describe(p)))
  end
  local sz, st = C.dlua_tensor_sizes(p), C.dlua_tensor_strides(p)
  if sz[0] * sz[1] * sz[2] * sz[3] == 0 then return true end
  local c, w = sz[1], sz[3]
  return st[1] == 1 and st[3] == c and st[2] == w * c and st[0] == sz[2] * w * c
end
-- is_contiguous([memory_format]): 'contiguous' (default) or 'channels_last'. Channels-last
-- means exactly the strides of (N, H, W, C) memory, size-1 dims included, so a one-channel
-- image made channels-last is not taken for a row-major one by the layers.
function methods.is_contiguous(t, memory_format)
  return core.has_memory_format('is_contiguous', handle('is_contiguous', t), memory_format)
end
function methods.is_floating_point(t) return core.is_floating(core.dtype_of(handle('is_floating_point', t))) end
function methods.element_size(t) return core.elem_sizes[core.dtype_of(handle('element_size', t))] end
function methods.nbytes(t) return nbytes(handle('nbytes', t)) end
function methods.is_freed(t) return t.p == nil end
-- Whether two tensors share storage (a view and its base do).
function methods.same_storage(t, other)
  return C.dlua_tensor_same_storage(handle('same_storage', t), handle('same_storage', other, 'argument 1')) ~= 0
end

function core.__len(t)
  local p = handle('len', t)
  if C.dlua_tensor_ndim(p) == 0 then raise('len: a 0-d tensor has no length') end
  return tonumber(C.dlua_tensor_sizes(p)[0])
end

return M
