-- The tensor handle as a Lua object: FFI types, finalisers, errors at the caller's line, GC pacing, dims, dtypes, options.
local capi = require 'bindings.capi'
local ffi, C = capi.ffi, capi.C

-- A Lua tensor is a one-pointer struct: the metatype gives it methods, metamethods and a
-- finaliser, and t:free() can release the C handle early by setting p to NULL.
ffi.cdef [[
struct dlua_tensor_ref { dlua_tensor_t *p; };
struct dlua_generator_ref { dlua_generator_t *p; int owned; };
]]

local M = { ffi = ffi, C = C }
local floor, huge = math.floor, math.huge
local format = string.format

-- Filled by the other bindings/tensor_*.lua files; looked up at call time by __index.
local methods, getters = {}, {}
M.methods, M.getters = methods, getters

---------------------------------------------------------------------------------------------
-- Errors at the user's line

-- Frames of the binding layer (and the dlua module that re-exports it) are skipped, so an
-- error points at the line that called the tensor function, however deep inside the
-- bindings it was detected.
local function internal(src)
  return src:find('[/\\]bindings[/\\][%w_]+%.lua$') ~= nil or src:find('^@bindings[/\\]') ~= nil
      or src:find('[/\\]dlua[/\\]init%.lua$') ~= nil
end

-- The error() level, counted from the function that calls user_level, of the first frame
-- outside the bindings.
local function user_level()
  local level = 2
  while true do
    local info = debug.getinfo(level + 1, 'S')
    if info == nil then return 1 end
    if info.what ~= 'C' and not internal(info.source) then return level end
    level = level + 1
  end
end

function M.raise(msg)
  error(msg, user_level())
end

-- Raises for a failed status with the C message (which names the op and C file:line).
function M.check(status, op)
  if status == 0 then return end
  -- An in-place form (add_) runs the C op of its base (add): name the op the user called.
  local base = op:match('^(.-)_$')
  if base and status ~= C.DLUA_ERR_INTERRUPTED then
    local msg = ffi.string(C.dlua_last_error())
    if msg:sub(1, #base + 1) == base .. ':' then
      C.dlua_clear_error()
      error(op .. msg:sub(#base + 1), user_level())
    end
  end
  capi.check(status, op, user_level())
end

local function freed(op)
  M.raise(op .. ': tensor was freed')
end

---------------------------------------------------------------------------------------------
-- dtypes and devices

local F32, F64, F16, BF16 = C.DLUA_DTYPE_F32, C.DLUA_DTYPE_F64, C.DLUA_DTYPE_F16, C.DLUA_DTYPE_BF16
local I32, I64, U8, BOOL = C.DLUA_DTYPE_I32, C.DLUA_DTYPE_I64, C.DLUA_DTYPE_U8, C.DLUA_DTYPE_BOOL
M.F32, M.F64, M.F16, M.BF16, M.I32, M.I64, M.U8, M.BOOL = F32, F64, F16, BF16, I32, I64, U8, BOOL

-- PyTorch's names; a dtype is its name in Lua, so `t.dtype == dlua.float32` reads naturally.
local dtype_names = { [F32] = 'float32', [F64] = 'float64', [F16] = 'float16', [BF16] = 'bfloat16',
  [I32] = 'int32', [I64] = 'int64', [U8] = 'uint8', [BOOL] = 'bool' }
M.dtype_names = dtype_names
local dtype_codes = {
  float32 = F32, float = F32, f32 = F32,
  float64 = F64, double = F64, f64 = F64,
  float16 = F16, half = F16, f16 = F16,
  bfloat16 = BF16, bf16 = BF16,
  int32 = I32, int = I32, i32 = I32,
  int64 = I64, long = I64, i64 = I64,
  uint8 = U8, byte = U8, u8 = U8,
  bool = BOOL, boolean = BOOL,
}
M.dtype_codes = dtype_codes
-- Element C types, for reading and writing CPU memory from Lua.
local ctypes = { [F32] = 'float', [F64] = 'double', [F16] = 'uint16_t', [BF16] = 'uint16_t',
  [I32] = 'int32_t', [I64] = 'int64_t', [U8] = 'uint8_t', [BOOL] = 'uint8_t' }
M.ctypes = ctypes
M.ptr_types = {}
M.array_types = {}
for code, name in pairs(ctypes) do
  M.ptr_types[code] = ffi.typeof(name .. ' *')
  M.array_types[code] = ffi.typeof(name .. '[?]')
end
local elem_sizes = { [F32] = 4, [F64] = 8, [F16] = 2, [BF16] = 2, [I32] = 4, [I64] = 8, [U8] = 1, [BOOL] = 1 }
M.elem_sizes = elem_sizes

-- A handle's dtype as a Lua number (enum results are cdata, which do not index tables).
function M.dtype_of(p) return tonumber(C.dlua_tensor_dtype(p)) end

function M.is_floating(code) return code == F32 or code == F64 or code == F16 or code == BF16 end

-- A dtype argument (a name such as 'float32' or 'half') as its C code; nil gives `default`.
function M.dtype(op, v, default)
  if v == nil then return default end
  local code = dtype_codes[v]
  if code == nil then
    M.raise(format("%s: unknown dtype %s (expected float32, float64, float16, bfloat16, int32, int64, uint8 or bool)",
      op, type(v) == 'string' and "'" .. v .. "'" or tostring(v)))
  end
  return code
end

local function device_name(dev)
  if dev == C.DLUA_CPU then return 'cpu' end
  return 'cuda:' .. dev
end
M.device_name = device_name

-- A CUDA ordinal that exists (n = -1: the current device), or an error naming `name` and why not:
-- without a device the reason is the driver's ("no CUDA device available (...)").
function M.cuda_ordinal(op, name, n)
  local count = C.dlua_cuda_device_count()
  if count == 0 then
    M.raise(format("%s: no CUDA device available for device '%s' (%s)", op, name,
      ffi.string(C.dlua_cuda_unavailable_reason())))
  end
  if n < 0 then
    local cur = ffi.new('int[1]')
    M.check(C.dlua_cuda_get_device(cur), op)
    n = cur[0]
  end
  if n >= count then
    M.raise(format("%s: no device '%s' (%d CUDA device%s: cuda:0 to cuda:%d)", op, name, count,
      count == 1 and '' or 's', count - 1))
  end
  return n
end

-- A device argument ('cpu', 'cuda', 'cuda:N') as its C ordinal (-1: CPU). CUDA ordinals count
-- from 0, as in 'cuda:0' (a device name, not a position).
function M.device(op, v)
  if v == nil or v == 'cpu' or v == C.DLUA_CPU then return C.DLUA_CPU end
  if type(v) == 'string' then
    local n = v == 'cuda' and -1 or tonumber(v:match('^cuda:(%d+)$'))
    if n then return M.cuda_ordinal(op, v, n) end
  end
  M.raise(format("%s: unknown device %s (expected 'cpu' or 'cuda[:N]')", op,
    type(v) == 'string' and "'" .. v .. "'" or tostring(v)))
end

---------------------------------------------------------------------------------------------
-- The tensor object

local Tensor -- the metatype, set below
local istype = ffi.istype

function M.is_tensor(x) return istype(Tensor, x) end

-- The live C handle of a tensor argument; `what` names the argument in the message.
function M.handle(op, t, what)
  if not istype(Tensor, t) then
    M.raise(format('%s: expected a tensor%s, got %s', op, what and ' as ' .. what or '', type(t)))
  end
  local p = t.p
  if p == nil then freed(op) end
  return p
end
local handle = M.handle

local describe_buf = ffi.new('char[256]')
-- "(2, 3) float32 cpu" for messages; a C handle or a tensor object.
-- Keeps `x` (a tensor, or a table of tensors or buffers) reachable up to this call: code that
-- walks memory through a raw pointer calls it afterwards, since a value that is dead by
-- bytecode liveness may be collected while the pointer is still in use.
function M.keepalive(x, op)
  if istype(Tensor, x) and x.p == nil then freed(op) end
end

function M.describe(x)
  local p = x
  if istype(Tensor, x) then
    p = x.p
    if p == nil then return '(freed tensor)' end
  end
  return ffi.string(C.dlua_tensor_describe(p, describe_buf, 256))
end

---------------------------------------------------------------------------------------------
-- Memory the Lua GC cannot see (DESIGN.md): a tensor is a few bytes to the collector while
-- its storage may be gigabytes. After each allocation, if storage bytes grew by more than
-- gc_threshold since the last look, run a collection step sized by that growth, as if the
-- Lua heap had grown by as much. collectgarbage('stop') stops these steps too (a Lua 'step' runs
-- even when the collector is stopped, so the pacer asks first): the growth meanwhile counts at the
-- first allocation after collectgarbage('restart'). Out-of-memory still collects first (full_gc).

M.gc_threshold = 64 * 2 ^ 20
local last_total = 0

local function pace()
  local now = tonumber(C.dlua_memory_allocated_total())
  if now < last_total then
    last_total = now
  elseif now - last_total > M.gc_threshold and collectgarbage('isrunning') then
    collectgarbage('step', floor((now - last_total) / 1024))
    last_total = tonumber(C.dlua_memory_allocated_total())
  end
end
M.pace = pace

-- Before reporting out-of-memory: a full cycle (twice, so finalisers queued by the first
-- have run), which frees every unreachable tensor's storage.
local function full_gc()
  collectgarbage('collect')
  collectgarbage('collect')
  last_total = tonumber(C.dlua_memory_allocated_total())
end
M.full_gc = full_gc

function M.wrap(p)
  local t = Tensor(p)
  pace()
  return t
end
local wrap = M.wrap

---------------------------------------------------------------------------------------------
-- Calling C. Arguments that are tensor objects are passed as their handles; the objects stay
-- referenced by these frames through an out-of-memory retry, so the collection run before
-- the retry cannot free an operand.

local OOM = C.DLUA_ERR_OOM
local out1 = ffi.new('dlua_tensor_t *[1]')
local out2 = ffi.new('dlua_tensor_t *[1]')

local function arg(op, x)
  if istype(Tensor, x) then
    local p = x.p
    if p == nil then freed(op) end
    return p
  end
  return x
end

local function invoke(op, f, n, a, b, c, d, e, g, h, i, j, l)
  if n == 0 then return f() end
  a = arg(op, a)
  if n == 1 then return f(a) end
  b = arg(op, b)
  if n == 2 then return f(a, b) end
  c = arg(op, c)
  if n == 3 then return f(a, b, c) end
  d = arg(op, d)
  if n == 4 then return f(a, b, c, d) end
  e = arg(op, e)
  if n == 5 then return f(a, b, c, d, e) end
  g = arg(op, g)
  if n == 6 then return f(a, b, c, d, e, g) end
  h = arg(op, h)
  if n == 7 then return f(a, b, c, d, e, g, h) end
  i = arg(op, i)
  if n == 8 then return f(a, b, c, d, e, g, h, i) end
  j = arg(op, j)
  if n == 9 then return f(a, b, c, d, e, g, h, i, j) end
  return f(a, b, c, d, e, g, h, i, j, arg(op, l))
end

-- f(args...) for a C function without an `out`; raises on failure.
function M.call(op, f, n, a, b, c, d, e, g, h, i, j)
  local st = invoke(op, f, n, a, b, c, d, e, g, h, i, j)
  if st ~= 0 then
    if st == OOM then
      full_gc()
      st = invoke(op, f, n, a, b, c, d, e, g, h, i, j)
    end
    M.check(st, op)
  end
end

-- f(out, args...) allocating a new tensor: returns it as a Lua object.
function M.new(op, f, n, a, b, c, d, e, g, h, i)
  out1[0] = nil
  local st = invoke(op, f, n + 1, out1, a, b, c, d, e, g, h, i)
  if st ~= 0 then
    if st == OOM then
      full_gc()
      out1[0] = nil
      st = invoke(op, f, n + 1, out1, a, b, c, d, e, g, h, i)
    end
    M.check(st, op)
  end
  local p = out1[0]
  out1[0] = nil
  return wrap(p)
end

-- f(out, args...) writing into the existing tensor `t` (the in-place variants): returns t.
function M.into(op, t, f, n, a, b, c, d, e, g, h, i)
  out1[0] = handle(op, t)
  local st = invoke(op, f, n + 1, out1, a, b, c, d, e, g, h, i)
  if st ~= 0 then
    if st == OOM then
      full_gc()
      out1[0] = t.p
      st = invoke(op, f, n + 1, out1, a, b, c, d, e, g, h, i)
    end
    out1[0] = nil
    M.check(st, op)
  end
  out1[0] = nil
  return t
end

-- f(out_values, out_indices, args...): two new tensors.
function M.new2(op, f, n, a, b, c, d, e, g, h, i)
  out1[0], out2[0] = nil, nil
  local st = invoke(op, f, n + 2, out1, out2, a, b, c, d, e, g, h, i)
  if st ~= 0 then
    if st == OOM then
      full_gc()
      out1[0], out2[0] = nil, nil
      st = invoke(op, f, n + 2, out1, out2, a, b, c, d, e, g, h, i)
    end
    M.check(st, op)
  end
  local p, q = out1[0], out2[0]
  out1[0], out2[0] = nil, nil
  return wrap(p), wrap(q)
end

-- A raw C handle from f(out, args...), owned by the caller (for short-lived intermediates
-- such as the steps of a slice); `owned` is freed if the call fails.
function M.raw(op, owned, f, n, a, b, c, d, e)
  out1[0] = nil
  local st = invoke(op, f, n + 1, out1, a, b, c, d, e)
  if st ~= 0 then
    if st == OOM then
      full_gc()
      out1[0] = nil
      st = invoke(op, f, n + 1, out1, a, b, c, d, e)
    end
    if st ~= 0 then
      if owned ~= nil then C.dlua_tensor_free(owned) end
      M.check(st, op)
    end
  end
  local p = out1[0]
  out1[0] = nil
  return p
end

---------------------------------------------------------------------------------------------
-- Shapes and dimensions

-- A list of sizes that prints as a shape (like torch.Size); still a plain list otherwise.
local Size = { __tostring = function(s) return 'dlua.Size(' .. table.concat(s, ', ') .. ')' end }
M.Size = Size

-- Sizes of a handle as a Lua list.
function M.sizes(p)
  local n, s = C.dlua_tensor_ndim(p), C.dlua_tensor_sizes(p)
  local r = {}
  for i = 0, n - 1 do r[i + 1] = tonumber(s[i]) end
  return setmetatable(r, Size)
end

function M.sizes_of_buf(n, sz)
  local r = {}
  for k = 1, n do r[k] = tonumber(sz[k - 1]) end
  return r
end

function M.shape_str(sizes)
  return '(' .. table.concat(sizes, ', ') .. ')'
end

local function is_int(v) return type(v) == 'number' and v == floor(v) and v > -huge and v < huge end
M.is_int = is_int

-- A 1-based (negative: from the end) dimension of `p` as a 0-based C dimension. `extra` = 1
-- admits one past the last (unsqueeze, stack).
function M.dim(op, p, d, extra)
  local n = C.dlua_tensor_ndim(p) + (extra or 0)
  if not is_int(d) then
    M.raise(format('%s: dimension must be an integer, got %s', op, tostring(d)))
  end
  if d >= 1 and d <= n then return d - 1 end
  if d <= -1 and d >= -n then return n + d end
  if d == 0 then
    M.raise(format('%s: dimension 0 is not valid for %s: dimensions count from 1 (or from -1 at the end)',
      op, M.describe(p)))
  end
  M.raise(format('%s: dimension %d out of range for %s (expected 1..%d or -%d..-1)',
    op, d, M.describe(p), n, n))
end

-- Size arguments: varargs of integers or one list, optionally followed by an options table.
-- Returns the count, an int64_t[8] and the options (or nil). `allow_neg` admits -1 entries
-- (view, expand).
local function is_options(x)
  if type(x) ~= 'table' then return false end
  return x[1] == nil and (next(x) ~= nil)
end
M.is_options = is_options

local size_bufs = { ffi.new('int64_t[8]'), ffi.new('int64_t[8]') }
function M.size_args(op, allow_neg, buf_index, ...)
  local nargs = select('#', ...)
  local opts
  local last = select(nargs > 0 and nargs or 1, ...)
  if nargs > 0 and (is_options(last) or (nargs > 1 and type(last) == 'table' and next(last) == nil)) then
    opts = last
    nargs = nargs - 1
  end
  local list
  -- Not `local first = ...`: LuaJIT 2.1 before 2023-08 (Debian's included) miscompiles a
  -- single-value vararg read (LuaJIT issue #1046) and, once traced, `first` could be the options
  -- table, making dlua.empty({ n }, opts) a 0-d tensor (tests/lua/dlua/size_args_spec.lua).
  local first = (select(1, ...))
  if nargs == 1 and type(first) == 'table' and not istype(Tensor, first) then
    list = first
  else
    list = { ... }
    for k = #list, nargs + 1, -1 do list[k] = nil end
  end
  local n = #list
  if n > 8 then M.raise(format('%s: at most 8 dimensions, got %d', op, n)) end
  local buf = size_bufs[buf_index or 1]
  for k = 1, n do
    local v = list[k]
    if not is_int(v) or (v < 0 and not (allow_neg and v == -1)) then
      M.raise(format('%s: size %d must be a non-negative integer%s, got %s', op, k,
        allow_neg and ' or -1' or '', tostring(v)))
    end
    buf[k - 1] = v
  end
  return n, buf, opts
end

-- Checks an options table's keys against the names an op accepts (catches typos).
function M.options(op, opts, allowed)
  if opts == nil then return {} end
  if type(opts) ~= 'table' then
    M.raise(format('%s: expected an options table, got %s', op, type(opts)))
  end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for name in pairs(allowed) do names[#names + 1] = name end
      table.sort(names)
      M.raise(format("%s: unknown option '%s' (expected %s)", op, tostring(k), table.concat(names, ', ')))
    end
  end
  return opts
end

---------------------------------------------------------------------------------------------
-- The metatype

local mt = {}
M.mt = mt

mt.__index = function(t, k)
  local m = methods[k]
  if m ~= nil then return m end
  local g = getters[k]
  if g ~= nil then return g(t) end
  local ix = M.index
  if ix ~= nil and type(k) ~= 'string' then return ix(t, k) end
  return nil
end

mt.__newindex = function(t, k, v)
  local ix = M.newindex
  if ix ~= nil and type(k) ~= 'string' then return ix(t, k, v) end
  M.raise(format("tensor: cannot set field '%s' of a tensor", tostring(k)))
end

-- The finaliser (ffi.metatype's __gc is ffi.gc on every instance).
mt.__gc = function(t)
  local p = t.p
  if p ~= nil then
    t.p = nil
    C.dlua_tensor_free(p)
  end
end

-- Metamethods that other files define late (tostring, arithmetic) are looked up at call time.
for _, name in ipairs({ '__tostring', '__add', '__sub', '__mul', '__div', '__pow', '__mod', '__unm',
  '__len', '__concat' }) do
  mt[name] = function(a, b) return M[name](a, b) end
end

Tensor = ffi.metatype('struct dlua_tensor_ref', mt)
M.Tensor = Tensor

function methods.free(t)
  mt.__gc(t)
end

return M
