-- The Lua face of tensors: one table of every creation function and free function; methods live on the tensor objects.
local core = require 'bindings.tensor_core'
local create = require 'bindings.tensor_create'
local shape = require 'bindings.tensor_shape'
local math_ = require 'bindings.tensor_math'
require 'bindings.tensor_str'

local M = {}

for _, name in ipairs({ 'tensor', 'empty', 'zeros', 'ones', 'full', 'arange', 'linspace', 'eye',
  'rand', 'randn', 'randint', 'randperm', 'empty_like', 'zeros_like', 'ones_like', 'full_like',
  'rand_like', 'randn_like', 'manual_seed', 'initial_seed', 'Generator', 'default_generator',
  'is_generator', 'from_pointer', 'from_string' }) do
  M[name] = create[name]
end
M.cat, M.stack, M.one_hot = shape.cat, shape.stack, shape.one_hot
M.where, M.matmul, M.mm, M.bmm, M.addmm = math_.where, math_.matmul, math_.mm, math_.bmm, math_.addmm
M.is_tensor = core.is_tensor

-- Methods that PyTorch also offers as functions: dlua.exp(t) is t:exp().
for _, name in ipairs({ 'add', 'sub', 'mul', 'div', 'pow', 'neg', 'abs', 'sqrt', 'rsqrt', 'exp', 'log',
  'tanh', 'sigmoid', 'relu', 'sign', 'clamp', 'maximum', 'minimum', 'eq', 'ne', 'lt', 'le', 'gt', 'ge',
  'sum', 'mean', 'prod', 'max', 'min', 'argmax', 'argmin', 'norm', 'var', 'std', 'any', 'all',
  'count_nonfinite', 'index_select', 'gather', 'topk', 'sort', 'argsort', 'split', 'chunk',
  'transpose', 'permute', 'reshape', 'flatten', 'squeeze', 'unsqueeze', 'narrow', 'select', 'clone',
  'isfinite', 'isnan', 'isinf', 'masked_fill', 'lerp', 'addcmul', 'addcdiv', 'numel' }) do
  M[name] = core.methods[name]
end

-- dtypes are their names: dlua.float32 == 'float32', and t.dtype == dlua.float32.
M.dtypes = {}
for alias, code in pairs(core.dtype_codes) do
  M[alias] = core.dtype_names[code]
  M.dtypes[alias] = core.dtype_names[code]
end

-- Storage bytes alive (DESIGN.md: the GC's pacing uses the total).
function M.memory_allocated(device)
  return tonumber(core.C.dlua_memory_allocated(core.device('memory_allocated', device)))
end
function M.memory_peak(device)
  return tonumber(core.C.dlua_memory_peak(core.device('memory_peak', device)))
end
-- torch.cuda.memory_stats / reset_peak_memory_stats for the CPU as well: bytes of tensor storage alive
-- now (allocated) and at most since start or the last reset (peak_allocated), and what the allocator
-- keeps for reuse (cached; reserved = allocated + cached). A CUDA device gives its caching allocator's
-- full table (dlua.cuda.memory_stats: sizes rounded to its blocks).
function M.memory_stats(device)
  local d = core.device('memory_stats', device)
  if d ~= core.C.DLUA_CPU then return require('bindings.cuda').memory_stats(d) end
  local C = core.C
  local allocated, cached = tonumber(C.dlua_memory_allocated(d)), tonumber(C.dlua_memory_cached(d))
  return { allocated = allocated, peak_allocated = tonumber(C.dlua_memory_peak(d)), cached = cached,
           reserved = allocated + cached }
end
function M.reset_peak_memory_stats(device)
  local d = core.device('reset_peak_memory_stats', device)
  if d ~= core.C.DLUA_CPU then return require('bindings.cuda').reset_peak_memory_stats(d) end
  core.C.dlua_memory_reset_peak(d)
end
-- Bytes kept by the allocator for reuse, and releasing them (PyTorch's torch.cuda.memory_reserved /
-- empty_cache, here for the CPU too).
function M.memory_cached(device)
  return tonumber(core.C.dlua_memory_cached(core.device('memory_cached', device)))
end
function M.empty_cache(device)
  core.C.dlua_memory_empty_cache(core.device('empty_cache', device))
end

return M
