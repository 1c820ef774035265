-- Views and indexing from Lua: view/narrow/select/permute..., t[i] and t[{...}] slices, split/chunk, cat/stack, gather/scatter.
local core = require 'bindings.tensor_core'
local create = require 'bindings.tensor_create'
local ffi, C = core.ffi, core.C
local methods = core.methods
local raise, handle, new, call = core.raise, core.handle, core.new, core.call
local format = string.format
local I64 = core.I64

local M = {}

-- A 1-based position (negative: from the end) along a dimension of `size`, as 0-based.
-- `past_end` admits size + 1 (an empty range starting after the last element).
local function position(op, p, d0, i, what, past_end)
  local size = tonumber(C.dlua_tensor_sizes(p)[d0])
  if not core.is_int(i) then
    raise(format('%s: %s must be an integer, got %s', op, what, tostring(i)))
  end
  if i >= 1 and (i <= size or (past_end and i == size + 1)) then return i - 1, size end
  if i <= -1 and i >= -size then return size + i, size end
  raise(format('%s: %s %d out of range for dimension %d of size %d in %s (expected 1..%d or -%d..-1)',
    op, what, i, d0 + 1, size, core.describe(p), size, size))
end

---------------------------------------------------------------------------------------------
-- Views

function methods.view(t, ...)
  handle('view', t)
  local n, sizes = core.size_args('view', true, 2, ...)
  return new('view', C.dlua_tensor_view, 3, t, n, sizes)
end

function methods.reshape(t, ...)
  handle('reshape', t)
  local n, sizes = core.size_args('reshape', true, 2, ...)
  return new('reshape', C.dlua_tensor_reshape, 3, t, n, sizes)
end

function methods.view_as(t, other) return methods.view(t, core.sizes(handle('view_as', other, 'argument 1'))) end
function methods.reshape_as(t, other) return methods.reshape(t, core.sizes(handle('reshape_as', other, 'argument 1'))) end

-- narrow(dim, start, length): elements start..start+length-1 of dim (start 1-based).
function methods.narrow(t, dim, start, length)
  local p = handle('narrow', t)
  local d = core.dim('narrow', p, dim)
  local s0, size = position('narrow', p, d, start, 'start', length == 0)
  if not core.is_int(length) or length < 0 or s0 + length > size then
    raise(format('narrow: length %s from start %d exceeds dimension %d of size %d in %s',
      tostring(length), start, dim, size, core.describe(p)))
  end
  return new('narrow', C.dlua_tensor_narrow, 4, t, d, s0, length)
end

-- select(dim, i): the slice at position i of dim, which goes away.
function methods.select(t, dim, i)
  local p = handle('select', t)
  local d = core.dim('select', p, dim)
  return new('select', C.dlua_tensor_select, 3, t, d, (position('select', p, d, i, 'index')))
end

function methods.transpose(t, d1, d2)
  local p = handle('transpose', t)
  return new('transpose', C.dlua_tensor_transpose, 3, t, core.dim('transpose', p, d1), core.dim('transpose', p, d2))
end

-- t(): the transpose of a matrix; 0-D and 1-D tensors come back as views of themselves.
function methods.t(t)
  local p = handle('t', t)
  local n = C.dlua_tensor_ndim(p)
  if n > 2 then raise(format('t: expects a tensor with at most 2 dimensions, got %s', core.describe(p))) end
  if n < 2 then return new('t', C.dlua_tensor_view, 3, t, n, C.dlua_tensor_sizes(p)) end
  return new('t', C.dlua_tensor_transpose, 3, t, 0, 1)
end

local perm_buf = ffi.new('int[8]')
function methods.permute(t, ...)
  local p = handle('permute', t)
  local dims = (select('#', ...) == 1 and type(...) == 'table') and ... or { ... }
  local n = C.dlua_tensor_ndim(p)
  if #dims ~= n then
    raise(format('permute: expected %d dimensions for %s, got %d', n, core.describe(p), #dims))
  end
  local seen = {}
  for k = 1, n do
    local d = core.dim('permute', p, dims[k])
    if seen[d] then
      raise(format('permute: dimension %d repeated in (%s)', d + 1, table.concat(dims, ', ')))
    end
    seen[d] = true
    perm_buf[k - 1] = d
  end
  return new('permute', C.dlua_tensor_permute, 2, t, perm_buf)
end

-- expand(sizes...): size-1 dims broadcast without copying; -1 keeps a size.
function methods.expand(t, ...)
  handle('expand', t)
  local n, sizes = core.size_args('expand', true, 2, ...)
  return new('expand', C.dlua_tensor_expand, 3, t, n, sizes)
end
function methods.expand_as(t, other) return methods.expand(t, core.sizes(handle('expand_as', other, 'argument 1'))) end

-- squeeze() drops every size-1 dim; squeeze(dim) drops that one if its size is 1.
function methods.squeeze(t, dim)
  local p = handle('squeeze', t)
  local d = dim == nil and -1 or core.dim('squeeze', p, dim)
  return new('squeeze', C.dlua_tensor_squeeze, 2, t, d)
end

-- unsqueeze(dim): a new size-1 dim at position dim (1..ndim+1, or -1 for a new last one).
function methods.unsqueeze(t, dim)
  local p = handle('unsqueeze', t)
  return new('unsqueeze', C.dlua_tensor_unsqueeze, 2, t, core.dim('unsqueeze', p, dim, 1))
end

-- flatten([start_dim [, end_dim]]): dims start..end (inclusive, default 1..-1) into one.
function methods.flatten(t, s, e)
  local p = handle('flatten', t)
  if C.dlua_tensor_ndim(p) == 0 then return methods.reshape(t, 1) end
  return new('flatten', C.dlua_tensor_flatten, 3, t, core.dim('flatten', p, s or 1), core.dim('flatten', p, e or -1))
end

-- contiguous([memory_format]): t itself when its memory already has that layout, else a copy
-- that does. 'contiguous' (default) is row-major; 'channels_last' is (N, H, W, C) memory for a
-- logically (N, C, H, W) tensor, as torch.channels_last.
function methods.contiguous(t, memory_format)
  local p = handle('contiguous', t)
  if memory_format == nil or memory_format == 'contiguous' then
    if C.dlua_tensor_is_contiguous(p) ~= 0 then return t end
    return new('contiguous', C.dlua_tensor_contiguous, 1, t)
  end
  if core.has_memory_format('contiguous', p, memory_format) then return t end
  local s = core.sizes(p)
  return create.empty_channels_last(s, { dtype = t.dtype, device = t.device }):copy_(t)
end

function methods.clone(t)
  handle('clone', t)
  return new('clone', C.dlua_tensor_clone, 1, t)
end

-- split(size, dim) in pieces of `size` (the last may be smaller), or split({s1, s2...}, dim)
-- in pieces of those sizes: a list of views.
function methods.split(t, size, dim)
  local p = handle('split', t)
  dim = dim or 1
  local d = core.dim('split', p, dim)
  local total = tonumber(C.dlua_tensor_sizes(p)[d])
  local pieces = {}
  if type(size) == 'table' then
    local sum = 0
    for k = 1, #size do
      if not core.is_int(size[k]) or size[k] < 0 then
        raise(format('split: sizes must be non-negative integers, got %s', tostring(size[k])))
      end
      sum = sum + size[k]
    end
    if sum ~= total then
      raise(format('split: sizes (%s) add up to %d, but dimension %d of %s has size %d',
        table.concat(size, ', '), sum, dim, core.describe(p), total))
    end
    local start = 0
    for k = 1, #size do
      pieces[k] = new('split', C.dlua_tensor_narrow, 4, t, d, start, size[k])
      start = start + size[k]
    end
    return pieces
  end
  if not core.is_int(size) or size < 1 then
    raise(format('split: piece size must be a positive integer, got %s', tostring(size)))
  end
  local start = 0
  repeat
    local len = math.min(size, total - start)
    pieces[#pieces + 1] = new('split', C.dlua_tensor_narrow, 4, t, d, start, len)
    start = start + len
  until start >= total
  return pieces
end

-- chunk(n, dim): at most n views of ceil(size / n) elements each.
function methods.chunk(t, n, dim)
  local p = handle('chunk', t)
  if not core.is_int(n) or n < 1 then
    raise(format('chunk: number of chunks must be a positive integer, got %s', tostring(n)))
  end
  local d = core.dim('chunk', p, dim or 1)
  local total = tonumber(C.dlua_tensor_sizes(p)[d])
  return methods.split(t, math.max(1, math.ceil(total / n)), dim or 1)
end

-- unbind(dim): the list of slices along dim.
function methods.unbind(t, dim)
  local p = handle('unbind', t)
  local d = core.dim('unbind', p, dim or 1)
  local r = {}
  for k = 1, tonumber(C.dlua_tensor_sizes(p)[d]) do
    r[k] = new('unbind', C.dlua_tensor_select, 3, t, d, k - 1)
  end
  return r
end

---------------------------------------------------------------------------------------------
-- t[i] and t[{...}]
--
-- Torch7-style indexing, positions 1-based, negative from the end:
--   t[i]                  select i along dim 1: a view, or a number for a 1-D tensor
--   t[{i, j}]             one entry per leading dim; missing trailing dims are whole
--     a number i          selects position i (the dim goes away)
--     {} or ':'           the whole dim
--     {i}                 position i, keeping the dim (size 1)
--     {i, j}              positions i..j inclusive (j = i - 1 gives an empty range)
--     {i, j, step}        i, i+step, ... up to j (step > 0)
--   t[{...}] = v          fills the selection with the number v, or copies tensor v into it
--                         (broadcasting)
--   t[index] (int tensor) index_select along dim 1; t[mask] = v (bool tensor) masked_fill_
-- An all-number t[{...}] reading every dim gives a number, like t[i] on a 1-D tensor.

-- Applies the k-th slice spec to handle `cur` (ours to free when `owned`) at 0-based dim d;
-- returns the resulting handle, the next dim and whether the result is ours.
local function slice_step(op, cur, owned, d, spec, k)
  local function fail(msg)
    if owned then C.dlua_tensor_free(cur) end
    raise(msg)
  end
  local size = tonumber(C.dlua_tensor_sizes(cur)[d])
  -- 0-based position of a 1-based (or negative) one; `low` is the smallest 1-based value
  -- accepted (0 or size + 1 only ever make an empty range).
  local function pos(i, what, low, high)
    if not core.is_int(i) then fail(format('%s: %s must be an integer, got %s', op, what, tostring(i))) end
    if i >= low and i <= high then return i - 1 end
    if i <= -1 and i >= -size then return size + i end
    fail(format('%s: %s %d out of range for dimension %d of size %d (expected 1..%d or -%d..-1)',
      op, what, i, d + 1, size, size, size))
  end
  local r
  if type(spec) == 'number' then
    r = core.raw(op, owned and cur or nil, C.dlua_tensor_select, 3, cur, d, pos(spec, 'index', 1, size))
    if owned then C.dlua_tensor_free(cur) end
    return r, d, true
  end
  if spec == ':' then return cur, d + 1, owned end
  if type(spec) ~= 'table' or core.is_tensor(spec) then
    fail(format("%s: index %d must be a number, a range table {i, j [, step]} or ':', got %s", op, k, type(spec)))
  end
  if spec[1] == nil then return cur, d + 1, owned end
  local i, j
  if spec[2] == nil then
    i = pos(spec[1], 'range start', 1, size)
    j = i
  else
    i = pos(spec[1], 'range start', 1, size + 1)
    j = pos(spec[2], 'range end', 0, size)
    if j < i - 1 then
      fail(format('%s: range {%d, %d} runs backwards in dimension %d of size %d', op, spec[1], spec[2], d + 1, size))
    end
  end
  local step = spec[3] or 1
  if not core.is_int(step) or step < 1 then
    fail(format('%s: range step must be a positive integer, got %s', op, tostring(step)))
  end
  if step == 1 then
    r = core.raw(op, owned and cur or nil, C.dlua_tensor_narrow, 4, cur, d, i, j - i + 1)
  else
    r = core.raw(op, owned and cur or nil, C.dlua_tensor_slice, 5, cur, d, i, j + 1, step)
  end
  if owned then C.dlua_tensor_free(cur) end
  return r, d + 1, true
end

-- The C handle (owned by the caller) of t[key] for a table key.
local function slice_handle(op, t, key)
  local p = handle(op, t)
  if #key > C.dlua_tensor_ndim(p) then
    raise(format('%s: too many indices (%d) for %s', op, #key, core.describe(p)))
  end
  local cur, owned, d = p, false, 0
  for k = 1, #key do
    cur, d, owned = slice_step(op, cur, owned, d, key[k], k)
  end
  if not owned then
    -- no step narrowed anything: a fresh handle on the same elements
    cur = core.raw(op, nil, C.dlua_tensor_view, 3, p, C.dlua_tensor_ndim(p), C.dlua_tensor_sizes(p))
  end
  core.keepalive(t, op) -- the steps allocate (closures): t must not be collected under p
  return cur
end

local function select1_handle(op, t, i)
  local p = handle(op, t)
  if C.dlua_tensor_ndim(p) == 0 then raise(op .. ': cannot index a 0-d tensor ' .. core.describe(p)) end
  return core.raw(op, nil, C.dlua_tensor_select, 3, p, 0, (position(op, p, 0, i, 'index')))
end

local function all_numbers(key)
  for k = 1, #key do if type(key[k]) ~= 'number' then return false end end
  return #key > 0
end

function core.index(t, key)
  if type(key) == 'number' then
    local r = core.wrap(select1_handle('index', t, key))
    if r:dim() == 0 then
      local v = r:item()
      r:free()
      return v
    end
    return r
  end
  if core.is_tensor(key) then
    local kp = handle('index', key)
    if core.dtype_of(kp) == core.BOOL then
      raise('index: reading t[mask] is not supported; use where() or masked_fill()')
    end
    return methods.index_select(t, 1, key)
  end
  if type(key) == 'table' then
    local r = core.wrap(slice_handle('index', t, key))
    if all_numbers(key) and r:dim() == 0 then
      local v = r:item()
      r:free()
      return v
    end
    return r
  end
  raise('index: expected a number, a table of ranges or a tensor, got ' .. type(key))
end

function core.newindex(t, key, v)
  local h
  if type(key) == 'number' then
    h = select1_handle('index', t, key)
  elseif type(key) == 'table' and not core.is_tensor(key) then
    h = slice_handle('index', t, key)
  elseif core.is_tensor(key) and core.dtype_of(handle('index', key)) == core.BOOL then
    if type(v) ~= 'number' and type(v) ~= 'boolean' then
      raise('index: t[mask] = v takes a number v, got ' .. type(v))
    end
    methods.masked_fill_(t, key, v)
    return
  else
    raise('index: cannot assign to t[' .. type(key) .. ']')
  end
  local view = core.wrap(h)
  if type(v) == 'number' or type(v) == 'boolean' then
    call('index', C.dlua_tensor_fill_, 2, view, type(v) == 'boolean' and (v and 1 or 0) or v)
  elseif core.is_tensor(v) then
    call('index', C.dlua_tensor_copy_, 2, view, v)
  else
    view:free()
    raise('index: can assign a number or a tensor, got ' .. type(v))
  end
  view:free()
end

---------------------------------------------------------------------------------------------
-- Lists of tensors

-- A dlua_tensor_t*[n] of the tensors in `list`; the list keeps them alive.
local function handle_array(op, list)
  if type(list) ~= 'table' or core.is_tensor(list) then
    raise(format('%s: expected a list of tensors, got %s', op, type(list)))
  end
  local n = #list
  if n == 0 then raise(op .. ': expected a non-empty list of tensors') end
  local arr = ffi.new('dlua_tensor_t *[?]', n)
  for k = 1, n do arr[k - 1] = handle(op, list[k], 'element ' .. k) end
  return n, arr
end

local function join(op, f, list, dim, extra)
  local n, arr = handle_array(op, list)
  local d = core.dim(op, arr[0], dim or 1, extra)
  local r = new(op, f, 3, n, arr, d)
  core.keepalive(list) -- arr holds raw handles of the list's tensors
  return r
end

-- cat(list, dim): along an existing dim; stack(list, dim): along a new one.
function M.cat(list, dim) return join('cat', C.dlua_tensor_cat, list, dim, 0) end
function M.stack(list, dim) return join('stack', C.dlua_tensor_stack, list, dim, 1) end

---------------------------------------------------------------------------------------------
-- Index tensors (1-based positions)

-- A Lua list of positions becomes an int64 tensor.
local function index_tensor(op, idx)
  if core.is_tensor(idx) then handle(op, idx, 'index'); return idx end
  if type(idx) == 'table' then return create.tensor(idx, { dtype = 'int64' }) end
  raise(format('%s: expected an index tensor or a list of positions, got %s', op, type(idx)))
end

function methods.index_select(t, dim, index)
  local p = handle('index_select', t)
  local d = core.dim('index_select', p, dim)
  return new('index_select', C.dlua_tensor_index_select, 4, t, d, index_tensor('index_select', index), 1)
end

function methods.gather(t, dim, index)
  local p = handle('gather', t)
  local d = core.dim('gather', p, dim)
  return new('gather', C.dlua_tensor_gather, 4, t, d, index_tensor('gather', index), 1)
end

-- scatter_add_(dim, index, src): t[... index[i] ...] += src[i] along dim.
function methods.scatter_add_(t, dim, index, src)
  local p = handle('scatter_add_', t)
  local d = core.dim('scatter_add_', p, dim)
  handle('scatter_add_', src, 'src')
  call('scatter_add_', C.dlua_tensor_scatter_add_, 5, t, d, index_tensor('scatter_add_', index), src, 1)
  return t
end

function methods.scatter_add(t, dim, index, src)
  return methods.scatter_add_(methods.clone(t), dim, index, src)
end

-- one_hot(labels, num_classes [, opts]): labels 1..num_classes -> (..., num_classes), int64
-- by default; without num_classes, the largest label.
function M.one_hot(labels, num_classes, opts)
  if type(num_classes) == 'table' then num_classes, opts = nil, num_classes end
  handle('one_hot', labels, 'labels')
  local o = core.options('one_hot', opts, { dtype = true })
  if num_classes == nil or num_classes == -1 then
    if labels:numel() == 0 then raise('one_hot: cannot infer the number of classes from empty labels') end
    num_classes = labels:max():item()
  end
  if not core.is_int(num_classes) or num_classes < 0 then
    raise(format('one_hot: num_classes must be a non-negative integer, got %s', tostring(num_classes)))
  end
  return new('one_hot', C.dlua_tensor_one_hot, 4, labels, num_classes, 1, core.dtype('one_hot', o.dtype, I64))
end

return M
