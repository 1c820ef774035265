-- dlua.amp: mixed precision. autocast (a policy table by module type), weight casts cached per autocast region, GradScaler whose step says what it did.
local dlua = require 'dlua'
local core = require 'bindings.tensor_core'
local create = require 'bindings.tensor_create'
local K = require 'bindings.nn'
local Module = require 'dlua.nn.module'

local amp = {}
local is_tensor = core.is_tensor
local format = string.format

---------------------------------------------------------------------------------------------
-- The policy: what each module type computes in while autocast is on, by class name (a class
-- without an entry takes its parent class's; none at all: 'input').
--   'lower'   floating inputs and parameters are cast to the autocast dtype (float32 accumulation
--             inside the kernels); the output stays in it; backward runs in it, parameter gradients
--             land in the float32 arena and the input gradient comes back in the input's dtype
--   'float32' floating inputs are cast to float32 (losses, softmax, reductions)
--   'input'   runs in its inputs' dtype: ReLU, pooling by max, containers; batch-norm, whose
--             statistics, parameters and running buffers are float32 whatever its input's dtype
-- `matmul` is the policy of dlua.mm / matmul / bmm / addmm called directly.
amp.policy = {
  Conv2d = 'lower', Linear = 'lower', matmul = 'lower',
  BatchNorm2d = 'input', ReLU = 'input', MaxPool2d = 'input', Dropout = 'input', Flatten = 'input', Identity = 'input',
  AvgPool2d = 'float32', AdaptiveAvgPool2d = 'float32', CrossEntropyLoss = 'float32', MSELoss = 'float32',
}

local names = { bfloat16 = 'bfloat16', bf16 = 'bfloat16', float16 = 'float16', f16 = 'float16', fp16 = 'float16',
  half = 'float16' }

-- The autocast state: the dtype in force (nil: off), the nesting depth and the cast epoch (one
-- cast of each parameter per outermost autocast region, as PyTorch's autocast cache).
local S = { dtype = nil, depth = 0, epoch = 0 }
local hook = Module._amp  -- set up below: the module classes' forward/backward run through it

function amp.get_dtype() return S.dtype end
function amp.is_enabled() return S.dtype ~= nil end

local cpu_bf16
-- Whether this CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX); without them
-- oneDNN emulates bf16 and it is slower than float32 (said once, as pytorch #118499 asked).
function amp.cpu_has_bf16()
  if cpu_bf16 == nil then
    local f = io.open('/proc/cpuinfo', 'r')
    local text = f and f:read('*a') or ''
    if f then f:close() end
    cpu_bf16 = text:find('avx512_bf16', 1, true) ~= nil or text:find('amx_bf16', 1, true) ~= nil
  end
  return cpu_bf16
end
local warned_bf16 = false

local function resolve(dtype, where)
  local dt = names[dtype]
  if not dt then
    error(format("%s: dtype must be 'bfloat16' or 'float16' (or 'bf16', 'f16'), got %s", where, tostring(dtype)), 3)
  end
  if dt == 'bfloat16' and not warned_bf16 and not amp.cpu_has_bf16() then
    warned_bf16 = true
    io.stderr:write('dlua.amp: this CPU has no bfloat16 instructions (AVX512-BF16/AMX): bfloat16 convolutions and '
      .. 'products are emulated and slower than float32\n')
  end
  return dt
end

local function restore(prev, ok, ...)
  S.dtype, S.depth = prev, S.depth - 1
  hook.on = S.dtype ~= nil
  if not ok then error((...), 0) end
  return ...
end

-- autocast(dtype, fn, ...) runs fn(...) with the policy on and returns what fn returns.
-- dtype: 'bfloat16' / 'float16' (or 'bf16', 'f16'), or a table {dtype =, enabled = true}; an
-- enabled = false region (or dtype false / 'off') runs fn in float32 even inside another region.
function amp.autocast(dtype, fn, ...)
  local enabled = true
  if type(dtype) == 'table' then
    enabled = dtype.enabled ~= false
    dtype = dtype.dtype or S.dtype or 'bfloat16'
  elseif dtype == false or dtype == 'off' then
    enabled = false
  end
  if type(fn) ~= 'function' then error('autocast(dtype, fn, ...): fn must be a function, got ' .. type(fn), 2) end
  local dt = enabled and resolve(dtype, 'autocast') or nil
  local prev = S.dtype
  if S.depth == 0 then S.epoch = S.epoch + 1 end  -- parameters are cast afresh in each outermost region
  S.dtype, S.depth = dt, S.depth + 1
  hook.on = dt ~= nil
  return restore(prev, pcall(fn, ...))
end

---------------------------------------------------------------------------------------------
-- Modules under autocast

local function policy_of(m)
  local cls = getmetatable(m)
  while cls do
    local p = rawget(amp.policy, rawget(cls, '__name') or '')
    if p then return p end
    local mt = getmetatable(cls)
    cls = mt and mt.__index
    if type(cls) ~= 'table' then return 'input' end
  end
  return 'input'
end
amp.policy_of = policy_of

local function floating(t) return is_tensor(t) and t:is_floating_point() end

-- t in dtype dt, keeping channels-last memory channels-last (oneDNN's fast kernels want it; to()
-- alone would make it NCHW). That includes a tensor whose strides are both (one channel, as a
-- grayscale image batch): NCHW there made every later activation NCHW, and oneDNN then reordered
-- each bf16 convolution's operands (0.45 ms per 128x16x28x28 tensor, more than the convolution).
local function cast(t, dt)
  if t:dim() == 4 and t:is_contiguous('channels_last') then
    return create.empty_channels_last(core.sizes(core.handle('autocast', t)), { dtype = dt, device = t.device }):copy_(t)
  end
  return t:to(dt)
end
amp.cast = cast

-- Master weights: a parameter that an SGD/Adam/AdamW arena holds is used through that arena's
-- 16-bit twin, which the optimizer's fused step writes in the same pass as the update; the twin is
-- cast in one pass only when no step has written it (the first step, or after parameters changed
-- some other way: load_state_dict, clear_cache). CPU and CUDA arenas alike: the twin lies on the
-- arena's device. Other parameters (no optimizer yet, ZeRO's shards, LARS/LAMB): one cast of each
-- per outermost autocast region, {epoch, lp} per parameter tensor, the copy overwritten in place
-- when a new region starts (no allocation per step).
local cache = setmetatable({}, { __mode = 'k' })
local twins = setmetatable({}, { __mode = 'k' })  -- every twin handed out, for invalidate()
local casts, arena_casts = 0, 0
function amp.cast_count() return casts end             -- single parameters cast so far (tests count them)
function amp.arena_cast_count() return arena_casts end -- whole-arena casts into a twin so far

local owner = require('dlua.optim').lowp_owner

local function twin_view(p, dt)
  local own = owner[p]
  if not own then return nil end
  local tw = own.opt:lowp_twin(own.dt, dt)
  if not tw then return nil end
  twins[tw] = true
  if not tw.fresh then
    tw.tensor:copy_(own.opt.arena.params[own.dt])
    tw.fresh = true
    arena_casts = arena_casts + 1
  end
  local e = cache[p]
  if e and e.twin == tw and e.lp.p ~= nil then return e.lp end
  local v = tw.tensor:narrow(1, own.offset + 1, own.numel):view(p:size())
  cache[p] = { twin = tw, lp = v, dt = dt }
  return v
end

-- After changing parameters outside an optimizer step: every cached cast and twin is made afresh.
function amp.invalidate()
  for k in pairs(cache) do cache[k] = nil end
  for tw in pairs(twins) do tw.fresh = false end
end
hook.invalidate = amp.invalidate  -- Module:load_state_dict calls it

local function cast_param(p, dt)
  local tv = twin_view(p, dt)
  if tv then return tv end
  local e = cache[p]
  if e and e.dt == dt and e.epoch == S.epoch and e.lp.p ~= nil then return e.lp end
  casts = casts + 1
  if e and e.dt == dt and e.lp.p ~= nil then
    e.lp:copy_(p)
  else
    e = { dt = dt, lp = cast(p, dt) }
    cache[p] = e
  end
  e.epoch = S.epoch
  return e.lp
end

-- Drops the cached casts and twins (after changing parameters by hand).
amp.clear_cache = amp.invalidate

local function swap_in(m, rec)
  for name, lp in pairs(rec.params) do m[name] = lp end
end
local function swap_out(m, rec)
  for name, p in pairs(rec.masters) do m[name] = p end
end

-- Inside a module that has a policy, the policy holds for the whole module: the products it calls
-- are not cast again (a 'float32' Linear's addmm stays float32).
local function finish(m, rec, ok, ...)
  S.dtype = rec.outer
  swap_out(m, rec)
  if not ok then error((...), 0) end
  return ...
end

-- forward under autocast: the module's record says what was cast, for its backward.
function hook.forward(fn, m, ...)
  local dt = S.dtype
  local mode = dt and policy_of(m) or 'input'
  if mode == 'input' then
    rawset(m, '_amp', nil)
    return fn(m, ...)
  end
  local target = mode == 'lower' and dt or 'float32'
  local n = select('#', ...)
  local args = { ... }
  local rec = rawget(m, '_amp') or {}
  rec.dt, rec.n = target, n
  rec.orig, rec.cast, rec.in_dtype = {}, {}, {}
  for i = 1, n do
    local a = args[i]
    if floating(a) then
      rec.in_dtype[i] = a.dtype
      if a.dtype ~= target then
        rec.orig[i] = a
        args[i] = cast(a, target)
        rec.cast[i] = args[i]
      end
    end
  end
  rec.params, rec.masters = {}, {}
  if mode == 'lower' then
    for _, name in ipairs(m._params) do
      local p = m[name]
      if floating(p) and p.dtype ~= target then
        rec.masters[name] = p
        rec.params[name] = cast_param(p, target)
      end
    end
  end
  rawset(m, '_amp', rec)
  swap_in(m, rec)
  rec.outer, S.dtype = dt, nil
  return finish(m, rec, pcall(fn, m, unpack(args, 1, n)))
end

local function cast_back(rec, i, t)
  local want = rec.in_dtype[i]
  if want and is_tensor(t) and t.p ~= nil and t.dtype ~= want then return cast(t, want) end
  return t
end

local function backward_done(m, rec, into, ok, ...)
  S.dtype = rec.outer
  swap_out(m, rec)
  if not ok then error((...), 0) end
  local n = select('#', ...)
  if n <= 1 then
    local gi = (...)
    -- a gradient added into a tensor the caller gave (Conv2d's add_to) is that tensor, as it is
    if not (into ~= nil and rawequal(gi, into)) then gi = cast_back(rec, 1, gi) end
    if rawget(m, 'grad_input') ~= nil or gi ~= nil then m.grad_input = gi end
    return gi
  end
  local r = { ... }
  for i = 1, n do r[i] = cast_back(rec, i, r[i]) end
  m.grad_input = r[1]
  return unpack(r, 1, n)
end

-- backward of a module whose forward ran under autocast: in the forward's precision, with the
-- same casts of its input and parameters (wherever backward is called from).
function hook.backward(fn, m, x, grad, ...)
  local rec = rawget(m, '_amp')
  local target = rec.dt
  if rec.orig[1] ~= nil and rawequal(x, rec.orig[1]) then
    x = rec.cast[1]
  elseif floating(x) and x.dtype ~= target then
    x = cast(x, target)
  end
  if floating(grad) and grad.dtype ~= target then grad = cast(grad, target) end
  swap_in(m, rec)
  rec.outer, S.dtype = S.dtype, nil
  return backward_done(m, rec, (...), pcall(fn, m, x, grad, ...))
end

-- An autocast region's state is what a checkpointed segment's recompute must see again.
require('dlua.nn.checkpoint').register_hook('autocast', {
  save = function() return { dtype = S.dtype } end,
  enter = function(_, state)
    local token = { dtype = S.dtype }
    S.dtype = state.dtype
    hook.on = S.dtype ~= nil
    return token
  end,
  recomputed = function(_, token)
    S.dtype = token.dtype
    hook.on = S.dtype ~= nil
  end,
})

-- dlua.mm / matmul / bmm / addmm called directly under autocast: policy.matmul.
for _, name in ipairs({ 'mm', 'matmul', 'bmm' }) do
  local raw = dlua[name]
  if raw then
    dlua[name] = function(a, b, ...)
      local dt = S.dtype
      if dt and amp.policy.matmul == 'lower' then
        if floating(a) and a.dtype ~= dt then a = a:to(dt) end
        if floating(b) and b.dtype ~= dt then b = b:to(dt) end
      end
      return raw(a, b, ...)
    end
  end
end
do
  local raw = dlua.addmm
  if raw then
    dlua.addmm = function(c, a, b, opts, ...)
      local dt = S.dtype
      if dt and amp.policy.matmul == 'lower' then
        if floating(a) and a.dtype ~= dt then a = a:to(dt) end
        if floating(b) and b.dtype ~= dt then b = b:to(dt) end
        -- the added term too, unless it is the output being accumulated into
        if floating(c) and c.dtype ~= dt and not (type(opts) == 'table' and rawequal(opts.out, c)) then c = c:to(dt) end
      end
      return raw(c, a, b, opts, ...)
    end
  end
end

amp.GradScaler = require('dlua.amp.scaler')(amp)

-- from_spec('bf16' | 'f16' | 'off' | 'bfloat16' | 'float16' | 'float32'): what a recipe's --amp
-- asks for, {dtype = 'bfloat16' | 'float16' | nil, scaler = GradScaler or nil}. float16 gets a
-- scaler (its range needs one), bfloat16 none (float32's exponent range).
function amp.from_spec(spec, scaler_opts)
  local s = type(spec) == 'string' and spec:lower() or spec
  if s == 'off' or s == 'float32' or s == 'fp32' or s == 'f32' or s == 'none' then return { dtype = nil, scaler = nil } end
  local dt = names[s]
  if not dt then
    error(format("dlua.amp.from_spec: unknown precision %s (expected bf16, f16 or off)",
      type(spec) == 'string' and ("'" .. spec .. "'") or tostring(spec)), 2)
  end
  resolve(dt, 'dlua.amp.from_spec')
  return { dtype = dt, scaler = dt == 'float16' and amp.GradScaler(scaler_opts) or nil }
end

-- run(spec, fn, ...): fn under autocast when spec (from from_spec) has a dtype, else plainly.
function amp.run(spec, fn, ...)
  if spec and spec.dtype then return amp.autocast(spec.dtype, fn, ...) end
  return fn(...)
end

return amp
