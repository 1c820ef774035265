-- dlua.optim: SGD, Adam, AdamW, LARS and LAMB as one fused C loop per range of the model's flat parameter arena.
local dlua = require 'dlua'
local K = require 'bindings.nn'

local optim = {}

-- Mixed precision's master weights (dlua.amp): parameter tensor -> {opt, dt, offset, numel} for the
-- optimizers whose fused step can write a 16-bit twin of the arena in the same pass (SGD, Adam, AdamW
-- over a float32 arena, on the CPU or CUDA; not under ZeRO, whose step covers a shard only).
-- Weak: a dropped model takes its entries.
optim.lowp_owner = setmetatable({}, { __mode = 'k' })

-- Splits the model's flat layout into ranges that share a parameter group. Groups are
-- tried in order: the first whose `filter(name, param)` returns true takes the parameter;
-- the rest go to the default group (the options themselves). Returns {dtype = {ranges}} with
-- ranges {offset, length, group, entries}.
local function plan(model, opts, defaults)
  -- a ZeRO model hands out this rank's shard: ranges count from the shard's start (docs/zero.md)
  local arena = model.optim_arena and model:optim_arena() or model:flatten()
  local groups = {}
  for i, g in ipairs(opts.groups or {}) do
    if type(g.filter) ~= 'function' then error(('optim: group %d needs a filter(name, param) function'):format(i), 4) end
    groups[i] = g
  end
  local default = {}
  for k, v in pairs(defaults) do default[k] = opts[k] == nil and v or opts[k] end
  local named = {}
  for _, e in ipairs(arena.named or model:named_parameters()) do named[e.name] = e.param end
  local by_dtype = {}
  for _, en in ipairs(arena.entries) do
    local g = default
    for _, cand in ipairs(groups) do
      if cand.filter(en.name, named[en.name]) then g = cand; break end
    end
    local list = by_dtype[en.dtype] or {}
    by_dtype[en.dtype] = list
    local last = list[#list]
    if last and last.group == g and last.offset + last.length == en.offset then
      last.length = last.length + en.numel
      last.entries[#last.entries + 1] = en
    else
      list[#list + 1] = { offset = en.offset, length = en.numel, group = g, entries = { en } }
    end
  end
  -- a group's missing options come from the default group
  for _, g in ipairs(groups) do
    for k, v in pairs(default) do if g[k] == nil then g[k] = v end end
  end
  return arena, by_dtype, default, groups
end

-- optim.no_decay_groups(): the usual exemption from weight decay, as a `groups` list: every
-- parameter of at most one dimension (biases, batch-norm and layer-norm scales and shifts)
-- gets weight_decay = 0 (Goyal et al. 2017; timm's and most ImageNet recipes' default).
-- A fresh list each call: an optimizer fills its groups' missing options in place.
function optim.no_decay_groups()
  return { { filter = function(_, p) return p:dim() <= 1 end, weight_decay = 0 } }
end

local Optimizer = {}
Optimizer.__index = Optimizer

-- An optimizer built on a module before a ZeRO model took its arenas over would step stale ranges.
local function check_arena(self)
  local a = self.arena
  if a.zero and not self._zero_names then
    error(self.name .. '.step: this optimizer was built before dist.ZeRO wrapped its model, whose arenas ZeRO has '
      .. 'since sharded; build the optimizer over the ZeRO model', 3)
  end
end

-- A ZeRO model gathers the stepped shards back to every rank (stages 1, 2) after a step.
local function after_step(self)
  local sync = self.model._grad_sync
  if sync and sync.after_step then sync:after_step(self) end
end

-- The pieces of an optimizer range to step, as (offset, length). Under DDP (the model has a
-- gradient synchroniser) the range is cut at bucket boundaries and each piece is stepped as
-- soon as its bucket's all-reduce is done, while later buckets are still in flight.
local function pieces(self, dt, r)
  local sync = self.model._grad_sync
  if not sync then
    local done = false
    return function()
      if done then return nil end
      done = true
      return r.offset, r.length
    end
  end
  local list, i = sync:pieces(dt, r.offset, r.length), 0
  return function()
    i = i + 1
    local piece = list[i]
    if piece == nil then return nil end
    sync:wait_range(dt, piece.offset, piece.numel)
    return piece.offset, piece.numel
  end
end

local function new_optimizer(cls, name, model, opts, defaults)
  if type(model) ~= 'table' or model.flatten == nil then
    error(name .. ': expected a dlua.nn module as the first argument', 3)
  end
  opts = opts or {}
  if rawget(model, '_zero') then model = rawget(model, '_zero') end  -- a module under ZeRO: its ZeRO model
  local self = setmetatable({ name = name, model = model, steps = 0 }, cls)
  self.arena, self.ranges, self.defaults, self.groups = plan(model, opts, defaults)
  self.lr = self.defaults.lr
  if type(self.lr) ~= 'number' or self.lr < 0 then error(name .. ': lr must be a non-negative number', 3) end
  self.state = {}
  for dt, p in pairs(self.arena.params) do self.state[dt] = {} ; self.state[dt].numel = p:numel() end
  if self.arena.zero then
    if not cls._state_names then
      error(name .. ': not available over ZeRO (its trust ratios need whole parameters, which shards split); use SGD, Adam or AdamW', 3)
    end
    self.arena.zero:attach(self)
  end
  if cls._lowp_kernels and not self.arena.zero then
    local named = {}
    for _, e in ipairs(model:named_parameters()) do named[e.name] = e.param end
    for _, en in ipairs(self.arena.entries) do
      local prm = named[en.name]
      if prm and en.dtype == 'float32' then  -- either backend's kernel writes the twin (host/ops/optim.c)
        optim.lowp_owner[prm] = { opt = self, dt = en.dtype, offset = en.offset, numel = en.numel }
      end
    end
  end
  return self
end

-- The arena's 16-bit twin for autocast (dlua.amp): {tensor, dtype, fresh}, made on first use on the
-- arena's device (the kernel writes it there); fresh while the last step wrote it. Nil where the step
-- cannot write one.
function Optimizer:lowp_twin(dt, lowdt)
  if not self._lowp_kernels then return nil end
  self._lowp = self._lowp or {}
  local tw, dev = self._lowp[dt], self.arena.params[dt].device
  if not tw or tw.dtype ~= lowdt or tw.tensor.p == nil or tw.tensor.device ~= dev then  -- or the arena moved
    tw = { dtype = lowdt, tensor = dlua.empty(self.state[dt].numel, { dtype = lowdt, device = dev }), fresh = false }
    self._lowp[dt] = tw
  end
  return tw
end

-- The twin the fused kernel writes this step (nil: none), and its marking once written.
local function twin_of(self, dt)
  local tw = self._lowp and self._lowp[dt]
  return tw and tw.tensor.p ~= nil and tw.tensor or nil
end
local function twins_written(self)
  for _, tw in pairs(self._lowp or {}) do tw.fresh = true end
end

-- Sets the learning rate (schedules call this each step); groups scale it by their lr_mult.
function Optimizer:set_lr(lr) self.lr = lr end
function Optimizer:get_lr() return self.lr end
function Optimizer:zero_grad() self.model:zero_grad() end

function Optimizer:buffer(dt, key)
  local s = self.state[dt]
  if not s[key] then s[key] = dlua.zeros(s.numel, { dtype = dt, device = self.arena.params[dt].device }) end
  return s[key]
end

-- {steps, lr, buffers = {dtype = {name = tensor}}}: live tensors (clone to snapshot).
function Optimizer:state_dict()
  local bufs = {}
  for dt, s in pairs(self.state) do
    bufs[dt] = {}
    for k, v in pairs(s) do if k ~= 'numel' then bufs[dt][k] = v end end
  end
  local sd = { steps = self.steps, lr = self.lr, buffers = bufs }
  if self.arena.zero then sd = self.arena.zero:full_optim_state(self, sd) end  -- whole buffers, gathered
  return sd
end

function Optimizer:load_state_dict(sd)
  if self.arena.zero then sd = self.arena.zero:shard_optim_state(self, sd) end  -- this rank's range of them
  self.steps, self.lr = sd.steps, sd.lr
  for dt, b in pairs(sd.buffers or {}) do
    for k, v in pairs(b) do self:buffer(dt, k):copy_(v) end
  end
end

function Optimizer:__tostring()
  local parts = {}
  for k, v in pairs(self.defaults) do if type(v) ~= 'table' then parts[#parts + 1] = k .. '=' .. tostring(v) end end
  table.sort(parts)
  return ('%s(%s; %d groups, step %d)'):format(self.name, table.concat(parts, ', '), #self.groups + 1, self.steps)
end

---------------------------------------------------------------------------------------------
-- SGD(model, {lr, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false,
-- maximize = false, groups = {{filter = fn, weight_decay = 0}, ...}}), as torch.optim.SGD.

local SGD = setmetatable({ _lowp_kernels = true }, { __index = Optimizer })
SGD.__index, SGD.__tostring = SGD, Optimizer.__tostring

function optim.SGD(model, opts)
  local self = new_optimizer(SGD, 'SGD', model, opts,
    { lr = 0.01, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false, maximize = false, lr_mult = 1 })
  if self.defaults.nesterov and (self.defaults.momentum <= 0 or self.defaults.dampening ~= 0) then
    error('SGD: nesterov needs momentum > 0 and dampening 0', 2)
  end
  return self
end

-- step{grad_scale = 1}: grad_scale multiplies every gradient first (1/loss scale under AMP).
function SGD:step(opts)
  check_arena(self)
  local scale = opts and opts.grad_scale or 1
  local first = self.steps == 0
  for dt, ranges in pairs(self.ranges) do
    local p, g = self.arena.params[dt], self.arena.grads[dt]
    local lp = twin_of(self, dt)
    for _, r in ipairs(ranges) do
      local grp = r.group
      local buf = grp.momentum ~= 0 and self:buffer(dt, 'momentum') or nil
      for off, len in pieces(self, dt, r) do
        K.sgd_step(p, g, buf, off, len, self.lr * grp.lr_mult, grp.momentum, grp.dampening, grp.weight_decay,
          grp.nesterov, grp.maximize, first, scale, lp)
      end
    end
  end
  twins_written(self)
  self.steps = self.steps + 1
  after_step(self)
end

-- The buffers a ZeRO model allocates for this optimizer up front, alike on every rank.
function SGD:_state_names()
  local any = self.defaults.momentum ~= 0
  for _, g in ipairs(self.groups) do any = any or g.momentum ~= 0 end
  return any and { 'momentum' } or {}
end

---------------------------------------------------------------------------------------------
-- AdamW(model, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 1e-2,
-- amsgrad = false, maximize = false, groups = ...}), as torch.optim.AdamW (decoupled decay), and
-- Adam(model, {... weight_decay = 0 ...}), as torch.optim.Adam (L2: weight_decay * p joins the gradient).

local AdamW = setmetatable({ _lowp_kernels = true }, { __index = Optimizer })
AdamW.__index, AdamW.__tostring = AdamW, Optimizer.__tostring
AdamW._kernel = 'adamw_step'
local Adam = setmetatable({ _kernel = 'adam_step' }, { __index = AdamW })
Adam.__index, Adam.__tostring = Adam, Optimizer.__tostring

local function adam_defaults(wd)
  return { lr = 1e-3, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = wd, amsgrad = false, maximize = false,
    lr_mult = 1 }
end

function optim.AdamW(model, opts) return new_optimizer(AdamW, 'AdamW', model, opts, adam_defaults(1e-2)) end
function optim.Adam(model, opts) return new_optimizer(Adam, 'Adam', model, opts, adam_defaults(0)) end

function AdamW:step(opts)
  check_arena(self)
  local scale = opts and opts.grad_scale or 1
  local kernel = K[self._kernel]
  self.steps = self.steps + 1
  for dt, ranges in pairs(self.ranges) do
    local p, g = self.arena.params[dt], self.arena.grads[dt]
    local m, v = self:buffer(dt, 'exp_avg'), self:buffer(dt, 'exp_avg_sq')
    local lp = twin_of(self, dt)
    for _, r in ipairs(ranges) do
      local grp = r.group
      local vmax = grp.amsgrad and self:buffer(dt, 'max_exp_avg_sq') or nil
      for off, len in pieces(self, dt, r) do
        kernel(p, g, m, v, vmax, off, len, self.lr * grp.lr_mult, grp.betas[1], grp.betas[2], grp.eps,
          grp.weight_decay, self.steps, grp.amsgrad, grp.maximize, scale, lp)
      end
    end
  end
  twins_written(self)
  after_step(self)
end

function AdamW:_state_names()
  local ams = self.defaults.amsgrad
  for _, g in ipairs(self.groups) do ams = ams or g.amsgrad end
  return ams and { 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq' } or { 'exp_avg', 'exp_avg_sq' }
end

---------------------------------------------------------------------------------------------
-- LARS(model, {lr, momentum = 0.9, weight_decay = 0, trust_coefficient = 0.001, eps = 1e-8,
-- exclude = function(name, param) -> bool (default: 1-D parameters: biases, batch-norm), groups = ...}):
-- each parameter's step is scaled by its own trust ratio |w| / (|g| + wd |w|) (You et al.).

local LARS = setmetatable({}, { __index = Optimizer })
LARS.__index, LARS.__tostring = LARS, Optimizer.__tostring

function optim.LARS(model, opts)
  opts = opts or {}
  local self = new_optimizer(LARS, 'LARS', model, opts,
    { lr = 0.1, momentum = 0.9, weight_decay = 0, trust_coefficient = 0.001, eps = 1e-8, lr_mult = 1 })
  local exclude = opts.exclude or function(_, param) return param:dim() <= 1 end
  local named = {}
  for _, e in ipairs(model:named_parameters()) do named[e.name] = e.param end
  -- {dtype = {{group = g, list = {{offset, numel, excluded}, ...}}, ...}}: one fused call per group, which
  -- brings its own lr_mult, momentum, weight_decay, trust_coefficient and eps
  self.param_ranges = {}
  for dt, ranges in pairs(self.ranges) do
    local per_group, order = {}, {}
    for _, r in ipairs(ranges) do
      local pg = per_group[r.group]
      if not pg then
        pg = { group = r.group, list = {} }
        per_group[r.group] = pg
        order[#order + 1] = pg
      end
      for _, en in ipairs(r.entries) do pg.list[#pg.list + 1] = { en.offset, en.numel, exclude(en.name, named[en.name]) } end
    end
    self.param_ranges[dt] = order
  end
  return self
end

function LARS:step(opts)
  check_arena(self)
  local scale = opts and opts.grad_scale or 1
  for dt, groups in pairs(self.param_ranges) do
    local sync = self.model._grad_sync
    if sync then sync:wait_range(dt, 0, self.state[dt].numel) end  -- trust ratios need whole gradients
    local buf = self:buffer(dt, 'momentum')
    for _, pg in ipairs(groups) do
      local grp = pg.group
      K.lars_step(self.arena.params[dt], self.arena.grads[dt], buf, pg.list, self.lr * grp.lr_mult, grp.momentum,
        grp.weight_decay, grp.trust_coefficient, grp.eps, self.steps == 0, scale)
    end
  end
  self.steps = self.steps + 1
end

---------------------------------------------------------------------------------------------
-- LAMB(model, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-6, weight_decay = 0.01, bias_correction = true,
-- exclude = function(name, param) -> bool (default: none), groups = ...}), You et al. 2019 (Algorithm 2):
-- Adam's bias-corrected direction plus weight_decay * p, scaled per parameter tensor by |p| / |update|
-- (1 when either norm is 0). Excluded parameters take a plain Adam step: no decay, no ratio.

local LAMB = setmetatable({}, { __index = Optimizer })
LAMB.__index, LAMB.__tostring = LAMB, Optimizer.__tostring

function optim.LAMB(model, opts)
  opts = opts or {}
  local self = new_optimizer(LAMB, 'LAMB', model, opts,
    { lr = 1e-3, betas = { 0.9, 0.999 }, eps = 1e-6, weight_decay = 0.01, bias_correction = true, lr_mult = 1 })
  local exclude = opts.exclude
  if exclude ~= nil and type(exclude) ~= 'function' then
    error('LAMB: exclude must be a function(name, param) returning true for parameters to leave unadapted', 2)
  end
  local named = {}
  for _, e in ipairs(model:named_parameters()) do named[e.name] = e.param end
  -- {dtype = {{group = g, list = {{offset, numel, excluded}, ...}}, ...}}: one fused call per group
  self.param_ranges = {}
  for dt, ranges in pairs(self.ranges) do
    local per_group, order = {}, {}
    for _, r in ipairs(ranges) do
      local pg = per_group[r.group]
      if not pg then
        pg = { group = r.group, list = {} }
        per_group[r.group] = pg
        order[#order + 1] = pg
      end
      for _, en in ipairs(r.entries) do
        pg.list[#pg.list + 1] = { en.offset, en.numel, exclude ~= nil and exclude(en.name, named[en.name]) or false }
      end
    end
    self.param_ranges[dt] = order
  end
  return self
end

function LAMB:step(opts)
  check_arena(self)
  local scale = opts and opts.grad_scale or 1
  self.steps = self.steps + 1
  for dt, groups in pairs(self.param_ranges) do
    local sync = self.model._grad_sync
    if sync then sync:wait_range(dt, 0, self.state[dt].numel) end  -- the ratios need whole gradients
    local m, v = self:buffer(dt, 'exp_avg'), self:buffer(dt, 'exp_avg_sq')
    for _, pg in ipairs(groups) do
      local grp = pg.group
      K.lamb_step(self.arena.params[dt], self.arena.grads[dt], m, v, pg.list, self.lr * grp.lr_mult, grp.betas[1],
        grp.betas[2], grp.eps, grp.weight_decay, self.steps, grp.bias_correction, scale)
    end
  end
end

return optim
