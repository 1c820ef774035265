-- dlua.nn.utils: clip_grad_norm_ over the flat gradient arena, in pieces that a sharded optimizer combines across ranks.
local dlua = require 'dlua'
local K = require 'bindings.nn'

local utils = {}
local huge = math.huge

local function norm_type_of(op, p)
  if p == nil then return 2 end
  if p == 'inf' or p == huge then return huge end
  if type(p) ~= 'number' or not (p > 0) or p ~= p then
    error(("%s: norm_type must be a number > 0 or 'inf', got %s"):format(op, tostring(p)), 3)
  end
  return p
end

-- The gradient arena and the DDP synchroniser (nil for a bare arena) of a module, a DDP model or
-- an arena (model:flatten()).
local function arena_of(op, x)
  if type(x) == 'table' and x.flatten ~= nil then return x:flatten(), x._grad_sync end
  if type(x) == 'table' and type(x.grads) == 'table' and type(x.entries) == 'table' then return x, nil end
  error(('%s: expected a dlua.nn module, a DDP model or model:flatten()\'s arena, got %s'):format(op, type(x)), 3)
end

-- {{dtype, offset, length}, ...} in a fixed order (dtypes sorted): the whole arena, or the given
-- ranges {dtype = {{offset, length}, ...}} (offsets count elements from 0, as the arena's layout).
local function ranges_of(op, arena, ranges)
  local dts = {}
  for dt in pairs(ranges or arena.grads) do dts[#dts + 1] = dt end
  table.sort(dts)
  local out = {}
  for _, dt in ipairs(dts) do
    local g = arena.grads[dt]
    if g == nil then error(('%s: ranges name dtype %s, which the gradient arena does not hold'):format(op, tostring(dt)), 3) end
    if ranges == nil then
      out[#out + 1] = { dt, 0, g:numel() }
    else
      for i, r in ipairs(ranges[dt]) do
        if type(r) ~= 'table' or type(r[1]) ~= 'number' or type(r[2]) ~= 'number' then
          error(('%s: ranges.%s[%d] must be {offset, length}'):format(op, dt, i), 3)
        end
        out[#out + 1] = { dt, r[1], r[2] }
      end
    end
  end
  return out
end

local function partial(op, x, norm_type, ranges)
  local p = norm_type_of(op, norm_type)
  local arena, sync = arena_of(op, x)
  -- Under DDP the norm is the averaged gradients': every bucket's all-reduce must have finished.
  if sync then sync:wait() end
  local acc = 0
  for _, r in ipairs(ranges_of(op, arena, ranges)) do
    local part = K.grad_norm_partial(arena.grads[r[1]], r[2], r[3], p)
    if p == huge then
      if part > acc or part ~= part then acc = part end  -- NaN wins, as in torch's max
    else
      acc = acc + part
    end
  end
  return acc, p, arena
end

-- grad_norm_partial(model_or_arena, norm_type = 2, ranges = nil): this rank's piece of the total
-- norm: the sum of |g|^p over the ranges (the whole arena by default), or max |g| for 'inf'.
-- Pieces add (max for 'inf') over shards and ranks; the total is sum^(1/p).
function utils.grad_norm_partial(model_or_arena, norm_type, ranges)
  return (partial('grad_norm_partial', model_or_arena, norm_type, ranges))
end

-- clip_grad_norm_(model_or_arena, max_norm, norm_type = 2, {error_if_nonfinite = false, ranges =, group =}):
-- torch.nn.utils.clip_grad_norm_ over the flat gradient arena. Returns the total norm (a number)
-- and, when max_norm / (total + 1e-6) < 1, multiplies the gradients by it. Under DDP it waits for
-- the buckets first (the norm of the averaged gradients). A ZeRO shard passes its own `ranges` and
-- `group` (a process group, or true for the world): the pieces are all-reduced before the root,
-- and each rank scales only its ranges.
function utils.clip_grad_norm_(model_or_arena, max_norm, norm_type, opts)
  local op = 'clip_grad_norm_'
  if type(norm_type) == 'table' and opts == nil then norm_type, opts = nil, norm_type end
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= 'error_if_nonfinite' and k ~= 'ranges' and k ~= 'group' then
      error(("%s: unknown option '%s' (error_if_nonfinite, ranges, group)"):format(op, tostring(k)), 2)
    end
  end
  if type(max_norm) ~= 'number' or max_norm ~= max_norm then
    error(('%s: max_norm must be a number, got %s'):format(op, tostring(max_norm)), 2)
  end
  local acc, p, arena = partial(op, model_or_arena, norm_type, opts.ranges)
  if opts.group then
    local dist = dlua.dist
    local t = dlua.tensor({ acc }, { dtype = 'float64', device = arena.device or 'cpu' })
    dist.all_reduce(t, p == huge and 'max' or 'sum', opts.group ~= true and { group = opts.group } or nil)
    acc = t:cpu()[1]
  end
  local total = p == huge and acc or p == 2 and math.sqrt(acc) or p == 1 and acc or acc ^ (1 / p)
  if opts.error_if_nonfinite and (total ~= total or total == huge) then
    error(('%s: the total norm of order %s of the gradients is non-finite (%s), so it cannot be clipped; with '
      .. 'error_if_nonfinite = false the gradients are scaled by it anyway'):format(op, tostring(p), tostring(total)), 2)
  end
  local coef = max_norm / (total + 1e-6)
  if not (coef >= 1) then  -- NaN scales too, as torch's clamp passes it through
    for _, r in ipairs(ranges_of(op, arena, opts.ranges)) do K.grad_scale(arena.grads[r[1]], r[2], r[3], coef) end
  end
  return total
end

return utils
