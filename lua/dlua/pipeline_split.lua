-- dlua.dist.Pipeline.split/groups: cutting a chain model into balanced pipeline stages, and the 2-D (pipeline x data) rank layout.
local dlua = require 'dlua'

local M = {}
local format = string.format
local floor, max = math.floor, math.max

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end
local function is_module(v) return type(v) == 'table' and rawget(v, '_children') ~= nil and rawget(v, '_params') ~= nil end
local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- Pipeline.split(model, n, {by = 'params'|'time', input = x, repeats = 3, costs = {...}}): n stages cut from
-- a model whose forward runs its children in order (a Sequential, or a module with an `order` list of
-- child names: the ResNets); nested Sequentials are opened, so the cut may fall between blocks. Each
-- stage is a Sequential of the model's own modules (shared, not copied) under their paths in the
-- model, so a stage's state-dict keys are the model's. Balanced by parameter count, or (by = 'time',
-- the default when `input` is given) by each piece's measured forward + backward time on `input`.
-- With `input`, the chain of pieces is checked against model:forward(input) (evaluation mode) first.
-- `costs` (one number per piece, as info.costs lists them) skips the measuring. Returns the list of
-- stages and info {units (the pieces' names), costs, bounds ({first, last} piece of each stage), by}.

local function is_a(m, cls)
  local c = getmetatable(m)
  while c do
    if c == cls then return true end
    local mt = getmetatable(c)
    c = mt and rawget(mt, '__index')
    if type(c) ~= 'table' then return false end
  end
  return false
end

local function join(prefix, name) return prefix == '' and name or (prefix .. '.' .. name) end

-- The children a module runs one after the other, or nil.
local function chain_of(m)
  local nn = require 'dlua.nn'
  if is_a(m, nn.Sequential) then
    local r = {}
    for i, c in ipairs(m._children) do r[i] = c end
    return r
  end
  local order = rawget(m, 'order')
  if type(order) == 'table' and #order > 0 then
    local by_name = {}
    for _, c in ipairs(m._children) do by_name[c.name] = c end
    local r = {}
    for i, name in ipairs(order) do
      if by_name[name] == nil then return nil end
      r[i] = by_name[name]
    end
    return r
  end
  return nil
end

local function expand(m, prefix, out)
  local kids = chain_of(m)
  if kids == nil or #kids == 0 then
    out[#out + 1] = { name = prefix, module = m }
    return
  end
  for _, c in ipairs(kids) do expand(c.module, join(prefix, c.name), out) end
end

-- Cuts costs[1..k] into n contiguous non-empty parts with the smallest largest sum; returns
-- {{first, last}, ...}.
function M.partition(costs, n)
  local k = #costs
  local pre = { [0] = 0 }
  for i = 1, k do pre[i] = pre[i - 1] + costs[i] end
  local best, cut = { [0] = { [0] = 0 } }, {}
  for j = 1, n do
    best[j], cut[j] = {}, {}
    for i = j, k - (n - j) do
      local b, arg = math.huge, nil
      for t = j - 1, i - 1 do
        local prev = best[j - 1][t]
        if prev ~= nil then
          local v = max(prev, pre[i] - pre[t])
          if v < b then b, arg = v, t end
        end
      end
      best[j][i], cut[j][i] = b, arg
    end
  end
  local bounds, i = {}, k
  for j = n, 1, -1 do
    local t = cut[j][i]
    bounds[j] = { t + 1, i }
    i = t
  end
  return bounds
end

local function max_abs_diff(a, b)
  return (a:to('cpu'):double() - b:to('cpu'):double()):abs():max():item()
end

function M.split(model, n, opts)
  opts = opts or {}
  if not is_module(model) then fail(2, 'Pipeline.split: expected a dlua.nn module, got %s', type(model)) end
  if type(n) ~= 'number' or n < 1 or n ~= floor(n) then
    fail(2, 'Pipeline.split: n must be a whole number >= 1, got %s', tostring(n))
  end
  for k in pairs(opts) do
    if k ~= 'by' and k ~= 'input' and k ~= 'repeats' and k ~= 'costs' then
      fail(2, "Pipeline.split: unknown option '%s' (expected by, input, repeats, costs)", tostring(k))
    end
  end
  if chain_of(model) == nil then
    fail(2, 'Pipeline.split: %s is not a chain of children (a Sequential, or a module with an `order` list of '
         .. 'its children run in turn, as the ResNets); build the stages yourself', model.__name or 'the model')
  end
  local x = opts.input
  local by = opts.by or (x ~= nil and 'time' or 'params')
  if by ~= 'params' and by ~= 'time' then fail(2, "Pipeline.split: by must be 'params' or 'time', got %s", tostring(by)) end
  if by == 'time' and opts.costs == nil and not dlua.is_tensor(x) then fail(2, "Pipeline.split: by = 'time' needs a sample batch: {input = x}") end
  local units = {}
  expand(model, '', units)
  if #units < n then
    fail(2, 'Pipeline.split: %s has %d pieces to cut, fewer than %d stages', model.__name or 'the model', #units, n)
  end
  local costs = {}
  if dlua.is_tensor(x) then
    -- the chain must compute what the model does (evaluation mode: no randomness, no statistics updated)
    local modes = {}
    model:walk(function(_, m) modes[m] = m.training end)
    model:evaluate()
    local want = model:forward(x)
    local h = x
    for _, u in ipairs(units) do h = u.module:forward(h) end
    for m, t in pairs(modes) do m.training = t end
    if not dlua.is_tensor(h) or not same_shape(h:size(), want:size()) or max_abs_diff(h, want) > 1e-4 * (1 + want:abs():max():item()) then
      fail(2, "Pipeline.split: running %s's pieces in turn does not give its output: its forward is not the chain "
           .. 'of its children; build the stages yourself', model.__name or 'the model')
    end
  end
  if opts.costs ~= nil then  -- given (say measured on every rank and averaged, so all ranks cut alike)
    if type(opts.costs) ~= 'table' or #opts.costs ~= #units then
      fail(2, 'Pipeline.split: costs must list one number per piece (%d), got %s', #units,
           type(opts.costs) == 'table' and #opts.costs or type(opts.costs))
    end
    for i = 1, #units do costs[i] = opts.costs[i] end
    by = opts.by or 'given costs'
  elseif by == 'params' then
    for i, u in ipairs(units) do costs[i] = u.module:num_parameters() end
  else
    -- forward + backward of each piece on its own input, the fastest of `repeats` after a warm-up;
    -- the batch-norm statistics are put back and the gradients zeroed afterwards
    local saved = {}
    for _, e in ipairs(model:named_buffers()) do saved[#saved + 1] = { e.buffer, e.buffer:clone() } end
    local repeats = opts.repeats or 3
    local h = x
    for i, u in ipairs(units) do
      local best = math.huge
      local out
      for r = 0, repeats do
        local t0 = dlua.perf_counter()
        out = u.module:forward(h)
        u.module:backward(h, dlua.ones_like(out))
        local dt = dlua.perf_counter() - t0
        if r > 0 and dt < best then best = dt end
      end
      costs[i] = best
      h = out
    end
    for _, b in ipairs(saved) do b[1]:copy_(b[2]) end
    model:zero_grad()
  end
  local bounds = M.partition(costs, n)
  local nn = require 'dlua.nn'
  local stages = {}
  for j, b in ipairs(bounds) do
    local seq = nn.Sequential()
    for i = b[1], b[2] do seq:add(units[i].module, units[i].name) end
    stages[j] = seq
  end
  local names = {}
  for i, u in ipairs(units) do names[i] = u.name end
  return stages, { units = names, costs = costs, bounds = bounds, by = by }
end

-- Pipeline.groups(p): the 2-D layout of the world, p stages per pipeline and world / p pipelines
-- (rank = (replica - 1) * p + stage - 1): {pipe = this rank's pipeline group (nil: the world),
-- data = the group of this stage's replicas (nil when there is one), stage, replica, stages,
-- replicas}. Every rank calls it (it creates groups).
function M.groups(p)
  local dist = require 'dlua.dist'
  if not dist.is_initialized() then fail(2, 'Pipeline.groups: dlua.dist is not initialised: call dlua.dist.init() first') end
  local world, rank = dist.world_size(), dist.rank()
  if type(p) ~= 'number' or p < 1 or p ~= floor(p) or world % p ~= 0 then
    fail(2, 'Pipeline.groups: %s stages do not divide the %d ranks into pipelines', tostring(p), world)
  end
  local D = world / p
  local r = { stage = rank % p + 1, replica = floor(rank / p) + 1, stages = p, replicas = D }
  if D > 1 then
    for d = 0, D - 1 do
      local ranks = {}
      for s = 0, p - 1 do ranks[#ranks + 1] = d * p + s end
      local g = dist.new_group(ranks)
      if d + 1 == r.replica then r.pipe = g end
    end
    for s = 0, p - 1 do
      local ranks = {}
      for d = 0, D - 1 do ranks[#ranks + 1] = d * p + s end
      local g = dist.new_group(ranks)
      if s + 1 == r.stage then r.data = g end
    end
  end
  return r
end

return M
