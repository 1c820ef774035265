-- Arithmetic on tensors from Lua: element-wise ops and their in-place forms, metamethods, reductions, sort/topk, matmul.
local core = require 'bindings.tensor_core'
local create = require 'bindings.tensor_create'
local ffi, C = core.ffi, core.C
local methods = core.methods
local raise, handle, new, into, call = core.raise, core.handle, core.new, core.into, core.call
local format = string.format
local istype = ffi.istype
local nan = 0 / 0

local M = {}

local function is_scalar(x) return type(x) == 'number' or type(x) == 'boolean' end
local function scalar(x) if type(x) == 'boolean' then return x and 1 or 0 end return x end

---------------------------------------------------------------------------------------------
-- Unary ops: t:exp() returns a new tensor, t:exp_() overwrites t.

local unary = {
  neg = C.DLUA_UNARY_NEG, abs = C.DLUA_UNARY_ABS, sqrt = C.DLUA_UNARY_SQRT, rsqrt = C.DLUA_UNARY_RSQRT,
  exp = C.DLUA_UNARY_EXP, log = C.DLUA_UNARY_LOG, tanh = C.DLUA_UNARY_TANH, sigmoid = C.DLUA_UNARY_SIGMOID,
  relu = C.DLUA_UNARY_RELU, sign = C.DLUA_UNARY_SIGN, reciprocal = C.DLUA_UNARY_RECIPROCAL,
  square = C.DLUA_UNARY_SQUARE, floor = C.DLUA_UNARY_FLOOR, ceil = C.DLUA_UNARY_CEIL,
  round = C.DLUA_UNARY_ROUND, sin = C.DLUA_UNARY_SIN, cos = C.DLUA_UNARY_COS, log1p = C.DLUA_UNARY_LOG1P,
  expm1 = C.DLUA_UNARY_EXPM1,
}
-- These give bool tensors and have no in-place form.
local predicates = {
  isfinite = C.DLUA_UNARY_ISFINITE, isnan = C.DLUA_UNARY_ISNAN, isinf = C.DLUA_UNARY_ISINF,
  logical_not = C.DLUA_UNARY_LOGICAL_NOT,
}

for name, code in pairs(unary) do
  methods[name] = function(t) return new(name, C.dlua_tensor_unary, 2, t, code) end
  local iname = name .. '_'
  methods[iname] = function(t) return into(iname, t, C.dlua_tensor_unary, 2, t, code) end
end
for name, code in pairs(predicates) do
  methods[name] = function(t) return new(name, C.dlua_tensor_unary, 2, t, code) end
end
methods.negative = methods.neg

---------------------------------------------------------------------------------------------
-- Binary ops with broadcasting: tensor op tensor, tensor op number, number op tensor.

local ADD, SUB = C.DLUA_BINARY_ADD, C.DLUA_BINARY_SUB

-- a op b into `target` (a tensor for the in-place forms, nil for a new tensor).
local function binary(op, code, a, b, alpha, target)
  alpha = alpha or 1
  if type(alpha) ~= 'number' then raise(format('%s: alpha must be a number, got %s', op, type(alpha))) end
  if istype(core.Tensor, a) then
    if istype(core.Tensor, b) then
      if target then return into(op, target, C.dlua_tensor_binary, 4, a, b, code, alpha) end
      return new(op, C.dlua_tensor_binary, 4, a, b, code, alpha)
    end
    if not is_scalar(b) then
      raise(format('%s: expected a tensor or a number as the other operand, got %s', op, type(b)))
    end
    local s = scalar(b)
    if code == ADD or code == SUB then s = s * alpha end
    if target then return into(op, target, C.dlua_tensor_binary_scalar, 4, a, s, code, 0) end
    return new(op, C.dlua_tensor_binary_scalar, 4, a, s, code, 0)
  end
  if not is_scalar(a) then
    raise(format('%s: expected a tensor or a number as the first operand, got %s', op, type(a)))
  end
  handle(op, b, 'the other operand')
  if alpha ~= 1 and (code == ADD or code == SUB) then
    -- s op alpha * b: scale b first (only reachable through dlua.add(s, t, alpha))
    b = binary(op, C.DLUA_BINARY_MUL, b, alpha)
  end
  return new(op, C.dlua_tensor_binary_scalar, 4, b, scalar(a), code, 1)
end
M.binary = binary

local binaries = {
  add = ADD, sub = SUB, mul = C.DLUA_BINARY_MUL, div = C.DLUA_BINARY_DIV, pow = C.DLUA_BINARY_POW,
  maximum = C.DLUA_BINARY_MAXIMUM, minimum = C.DLUA_BINARY_MINIMUM, fmod = C.DLUA_BINARY_FMOD,
  remainder = C.DLUA_BINARY_REMAINDER, atan2 = C.DLUA_BINARY_ATAN2,
}
local comparisons = {
  eq = C.DLUA_BINARY_EQ, ne = C.DLUA_BINARY_NE, lt = C.DLUA_BINARY_LT, le = C.DLUA_BINARY_LE,
  gt = C.DLUA_BINARY_GT, ge = C.DLUA_BINARY_GE, logical_and = C.DLUA_BINARY_LOGICAL_AND,
  logical_or = C.DLUA_BINARY_LOGICAL_OR, logical_xor = C.DLUA_BINARY_LOGICAL_XOR,
}

for name, code in pairs(binaries) do
  -- add(other [, alpha]) / sub(other [, alpha]): self + alpha * other
  methods[name] = function(a, b, alpha)
    handle(name, a)
    return binary(name, code, a, b, alpha)
  end
  local iname = name .. '_'
  methods[iname] = function(a, b, alpha)
    handle(iname, a)
    return binary(iname, code, a, b, alpha, a)
  end
end
for name, code in pairs(comparisons) do
  methods[name] = function(a, b)
    handle(name, a)
    return binary(name, code, a, b)
  end
end
methods.multiply, methods.divide, methods.subtract = methods.mul, methods.div, methods.sub
methods.greater, methods.less, methods.not_equal = methods.gt, methods.lt, methods.ne

-- Operators follow PyTorch: * is element-wise (use matmul for products of matrices), and
-- == is object identity, as for any Lua value: use t:eq(other) for element-wise equality.
function core.__add(a, b) return binary('add', ADD, a, b) end
function core.__sub(a, b) return binary('sub', SUB, a, b) end
function core.__mul(a, b) return binary('mul', C.DLUA_BINARY_MUL, a, b) end
function core.__div(a, b) return binary('div', C.DLUA_BINARY_DIV, a, b) end
function core.__pow(a, b) return binary('pow', C.DLUA_BINARY_POW, a, b) end
function core.__mod(a, b) return binary('remainder', C.DLUA_BINARY_REMAINDER, a, b) end
function core.__unm(a) return methods.neg(a) end
function core.__concat(a, b) return tostring(a) .. tostring(b) end

-- clamp(min, max): nil leaves that side open.
function methods.clamp(t, low, high)
  if low == nil and high == nil then raise('clamp: expected at least one of min and max') end
  return new('clamp', C.dlua_tensor_clamp, 3, t, low or nan, high or nan)
end
function methods.clamp_(t, low, high)
  if low == nil and high == nil then raise('clamp_: expected at least one of min and max') end
  return into('clamp_', t, C.dlua_tensor_clamp, 3, t, low or nan, high or nan)
end
methods.clip, methods.clip_ = methods.clamp, methods.clamp_

-- A number operand of where() as a 0-d tensor of the other operand's dtype (PyTorch treats
-- Python scalars as weakly typed).
local function scalar_tensor(op, v, like)
  local dtype = like and core.dtype_names[core.dtype_of(handle(op, like))] or 'float32'
  return create.tensor(scalar(v), { dtype = dtype })
end

-- where(cond, a, b): a where cond is true, else b; a and b tensors or numbers.
function M.where(cond, a, b)
  handle('where', cond, 'the condition')
  local ta = istype(core.Tensor, a) and a or nil
  local tb = istype(core.Tensor, b) and b or nil
  if not ta and not is_scalar(a) then raise('where: expected a tensor or a number as argument 2, got ' .. type(a)) end
  if not tb and not is_scalar(b) then raise('where: expected a tensor or a number as argument 3, got ' .. type(b)) end
  ta = ta or scalar_tensor('where', a, tb)
  tb = tb or scalar_tensor('where', b, ta)
  return new('where', C.dlua_tensor_where, 3, cond, ta, tb)
end
-- t:where(cond, other) = where(cond, t, other), as PyTorch's Tensor.where.
function methods.where(t, cond, other) return M.where(cond, t, other) end

function methods.masked_fill_(t, mask, value)
  handle('masked_fill_', mask, 'the mask')
  if not is_scalar(value) then raise('masked_fill_: the value must be a number, got ' .. type(value)) end
  call('masked_fill_', C.dlua_tensor_masked_fill_, 3, t, mask, scalar(value))
  return t
end
function methods.masked_fill(t, mask, value)
  handle('masked_fill', t)
  return methods.masked_fill_(methods.clone(t), mask, value)
end

function methods.fill_(t, value)
  if not is_scalar(value) then raise('fill_: the value must be a number, got ' .. type(value)) end
  call('fill_', C.dlua_tensor_fill_, 2, t, scalar(value))
  return t
end
function methods.zero_(t)
  call('zero_', C.dlua_tensor_fill_, 2, t, 0)
  return t
end

-- copy_(src): src broadcast to t's shape and converted to t's dtype.
function methods.copy_(t, src)
  handle('copy_', t)
  if is_scalar(src) then return methods.fill_(t, src) end
  handle('copy_', src, 'the source')
  call('copy_', C.dlua_tensor_copy_, 2, t, src)
  return t
end

local function value_arg(op, v, default)
  if type(v) == 'table' then v = v.value end
  if v == nil then return default end
  if type(v) ~= 'number' then raise(format('%s: value must be a number, got %s', op, type(v))) end
  return v
end

-- addcmul_(a, b [, value]): t += value * a * b; addcdiv_: t += value * a / b.
function methods.addcmul_(t, a, b, value)
  handle('addcmul_', a, 'argument 1')
  handle('addcmul_', b, 'argument 2')
  call('addcmul_', C.dlua_tensor_addcmul_, 4, t, a, b, value_arg('addcmul_', value, 1))
  return t
end
function methods.addcdiv_(t, a, b, value)
  handle('addcdiv_', a, 'argument 1')
  handle('addcdiv_', b, 'argument 2')
  call('addcdiv_', C.dlua_tensor_addcdiv_, 4, t, a, b, value_arg('addcdiv_', value, 1))
  return t
end
-- lerp_(end, weight): t += weight * (end - t).
function methods.lerp_(t, finish, weight)
  handle('lerp_', finish, 'the end')
  if type(weight) ~= 'number' then raise('lerp_: weight must be a number, got ' .. type(weight)) end
  call('lerp_', C.dlua_tensor_lerp_, 3, t, finish, weight)
  return t
end
function methods.addcmul(t, a, b, value) return methods.addcmul_(methods.clone(t), a, b, value) end
function methods.addcdiv(t, a, b, value) return methods.addcdiv_(methods.clone(t), a, b, value) end
function methods.lerp(t, finish, weight) return methods.lerp_(methods.clone(t), finish, weight) end

---------------------------------------------------------------------------------------------
-- Reductions: op() over everything gives a 0-d tensor; op(dim [, keepdim]) with dim a
-- number or a list of dims (1-based, negative from the end).

local dims_buf = ffi.new('int[8]')

local function reduce_dims(op, p, dim)
  if dim == nil then return 0 end
  local list = type(dim) == 'table' and dim or { dim }
  if #list > 8 then raise(format('%s: at most 8 dimensions, got %d', op, #list)) end
  local seen = {}
  for k = 1, #list do
    local d = core.dim(op, p, list[k])
    if seen[d] then raise(format('%s: dimension %d repeated', op, d + 1)) end
    seen[d] = true
    dims_buf[k - 1] = d
  end
  if #list == 0 then
    raise(format('%s: expected at least one dimension in the list (omit it to reduce over all)', op))
  end
  return #list
end

local function keepdim_arg(op, keepdim)
  if keepdim == nil then return 0 end
  if type(keepdim) ~= 'boolean' then raise(format('%s: keepdim must be a boolean, got %s', op, type(keepdim))) end
  return keepdim and 1 or 0
end

local function reduce(op, code, t, dim, keepdim, p)
  local h = handle(op, t)
  local nd = reduce_dims(op, h, dim)
  return new(op, C.dlua_tensor_reduce, 8, nil, t, code, nd, dims_buf, keepdim_arg(op, keepdim), p or 0, 1)
end

local function reduce2(op, code, t, dim, keepdim)
  local h = handle(op, t)
  local nd = reduce_dims(op, h, dim)
  return core.new2(op, C.dlua_tensor_reduce, 7, t, code, nd, dims_buf, keepdim_arg(op, keepdim), 0, 1)
end

local simple = {
  sum = C.DLUA_REDUCE_SUM, mean = C.DLUA_REDUCE_MEAN, prod = C.DLUA_REDUCE_PROD,
  any = C.DLUA_REDUCE_ANY, all = C.DLUA_REDUCE_ALL, count_nonfinite = C.DLUA_REDUCE_COUNT_NONFINITE,
  argmax = C.DLUA_REDUCE_ARGMAX, argmin = C.DLUA_REDUCE_ARGMIN,
}
for name, code in pairs(simple) do
  methods[name] = function(t, dim, keepdim) return reduce(name, code, t, dim, keepdim) end
end

-- max() -> 0-d tensor; max(dim [, keepdim]) -> values, 1-based indices; max(other tensor)
-- -> element-wise maximum.
local function extremum(name, code, elementwise)
  return function(t, dim, keepdim)
    if istype(core.Tensor, dim) then return methods[elementwise](t, dim) end
    if dim == nil then return reduce(name, code, t) end
    if type(dim) == 'table' then
      raise(format('%s: takes one dimension (a number), got a list; use amax/amin for several', name))
    end
    return reduce2(name, code, t, dim, keepdim)
  end
end
methods.max = extremum('max', C.DLUA_REDUCE_MAX, 'maximum')
methods.min = extremum('min', C.DLUA_REDUCE_MIN, 'minimum')
function methods.amax(t, dim, keepdim) return reduce('amax', C.DLUA_REDUCE_MAX, t, dim, keepdim) end
function methods.amin(t, dim, keepdim) return reduce('amin', C.DLUA_REDUCE_MIN, t, dim, keepdim) end

-- norm([p [, dim [, keepdim]]]): p = 1, 2 (default, also 'fro') or math.huge / 'inf'.
function methods.norm(t, p, dim, keepdim)
  if p == nil or p == 'fro' then p = 2 end
  if p == 'inf' then p = math.huge end
  if p ~= 1 and p ~= 2 and p ~= math.huge then
    raise(format('norm: p must be 1, 2 or math.huge (inf), got %s', tostring(p)))
  end
  return reduce('norm', C.DLUA_REDUCE_NORM, t, dim, keepdim, p)
end

-- var([dim] [, opts]) with opts {correction = 1, keepdim = false} (or unbiased = bool);
-- a boolean in place of opts is keepdim.
local function spread(name, code)
  return function(t, dim, opts)
    if core.is_options(dim) then dim, opts = nil, dim end
    local correction, keepdim = 1, nil
    if type(opts) == 'boolean' then
      keepdim = opts
    elseif opts ~= nil then
      local o = core.options(name, opts, { correction = true, keepdim = true, unbiased = true })
      if o.unbiased ~= nil then correction = o.unbiased and 1 or 0 end
      if o.correction ~= nil then correction = o.correction end
      keepdim = o.keepdim
    end
    if type(correction) ~= 'number' then raise(format('%s: correction must be a number', name)) end
    return reduce(name, code, t, dim, keepdim, correction)
  end
end
methods.var = spread('var', C.DLUA_REDUCE_VAR)
methods.std = spread('std', C.DLUA_REDUCE_STD)

---------------------------------------------------------------------------------------------
-- Sorting

local function bool_arg(op, v, what, default)
  if v == nil then return default end
  if type(v) ~= 'boolean' then raise(format('%s: %s must be a boolean, got %s', op, what, type(v))) end
  return v
end

-- topk(k [, dim = -1] [, opts {largest = true, sorted = true, by_magnitude = false}])
-- -> values, indices (1-based).
function methods.topk(t, k, dim, opts)
  local p = handle('topk', t)
  if type(dim) == 'table' then dim, opts = nil, dim end
  local o = core.options('topk', opts, { largest = true, sorted = true, by_magnitude = true })
  if not core.is_int(k) or k < 0 then raise(format('topk: k must be a non-negative integer, got %s', tostring(k))) end
  local d = core.dim('topk', p, dim or -1)
  local size = tonumber(C.dlua_tensor_sizes(p)[d])
  if k > size then
    raise(format('topk: k = %d exceeds the size %d of dimension %d in %s', k, size, d + 1, core.describe(p)))
  end
  return core.new2('topk', C.dlua_tensor_topk, 7, t, k, d,
    bool_arg('topk', o.largest, 'largest', true) and 1 or 0,
    bool_arg('topk', o.by_magnitude, 'by_magnitude', false) and 1 or 0,
    bool_arg('topk', o.sorted, 'sorted', true) and 1 or 0, 1)
end

-- sort([dim = -1] [, descending = false]) -> values, indices (1-based); stable.
-- Also sort{dim =, descending =}.
function methods.sort(t, dim, descending)
  local p = handle('sort', t)
  if type(dim) == 'table' then
    local o = core.options('sort', dim, { dim = true, descending = true })
    dim, descending = o.dim, o.descending
  elseif type(dim) == 'boolean' then
    dim, descending = nil, dim
  end
  local d = core.dim('sort', p, dim or -1)
  return core.new2('sort', C.dlua_tensor_sort, 4, t, d, bool_arg('sort', descending, 'descending', false) and 1 or 0, 1)
end

function methods.argsort(t, dim, descending)
  local values, indices = methods.sort(t, dim, descending)
  values:free()
  return indices
end

---------------------------------------------------------------------------------------------
-- Linear algebra

-- Each takes an optional last {out = t}: the product is written into t (shape checked), so
-- a layer can reuse its buffers across steps.
local function product(op, f, opts, n, a, b, c, d, e)
  local out = opts ~= nil and core.options(op, opts, { out = true, beta = true, alpha = true }).out or nil
  if out ~= nil then return into(op, out, f, n, a, b, c, d, e) end
  return new(op, f, n, a, b, c, d, e)
end

function M.matmul(a, b, opts)
  handle('matmul', a, 'argument 1'); handle('matmul', b, 'argument 2')
  return product('matmul', C.dlua_tensor_matmul, opts, 2, a, b)
end
function M.mm(a, b, opts)
  handle('mm', a, 'argument 1'); handle('mm', b, 'argument 2')
  return product('mm', C.dlua_tensor_mm, opts, 2, a, b)
end
function M.bmm(a, b, opts)
  handle('bmm', a, 'argument 1'); handle('bmm', b, 'argument 2')
  return product('bmm', C.dlua_tensor_bmm, opts, 2, a, b)
end
-- addmm(c, a, b [, {beta = 1, alpha = 1, out = t}]) = beta * c + alpha * (a @ b); out may be c.
function M.addmm(c, a, b, opts)
  handle('addmm', c, 'argument 1'); handle('addmm', a, 'argument 2'); handle('addmm', b, 'argument 3')
  local o = core.options('addmm', opts, { beta = true, alpha = true, out = true })
  local beta, alpha = o.beta or 1, o.alpha or 1
  if type(beta) ~= 'number' or type(alpha) ~= 'number' then raise('addmm: beta and alpha must be numbers') end
  return product('addmm', C.dlua_tensor_addmm, opts, 5, c, a, b, beta, alpha)
end
methods.matmul, methods.mm, methods.bmm, methods.addmm = M.matmul, M.mm, M.bmm, M.addmm

return M
