-- nn.Checkpoint and Module:checkpoint(policy): activation checkpointing, a segment's forward run again in its backward.
local dlua = require 'dlua'
local Module = require 'dlua.nn.module'

local is_tensor, is_generator = dlua.is_tensor, dlua.is_generator
local format = string.format
local pack = function(...) return { n = select('#', ...), ... } end

---------------------------------------------------------------------------------------------
-- Checkpoint(module): forward runs the module, then frees every tensor the module's forward left in
-- the fields of its modules (outputs, batch-norm statistics, masks, saved inputs), keeping only the
-- input, the output and what the recompute must repeat (the generators' positions). backward runs the
-- module's forward again on the kept input, with the generators where the first forward had them (the
-- same dropout masks) and the buffers unchanged (batch-norm running statistics are updated once), then
-- the module's own backward, and frees what that recompute made. The kernels and their order are the
-- same as without checkpointing, so gradients are bit-identical. Outputs and gradients given up are
-- freed once spent (see forward and backward), not when the collector finds them.
--
-- The wrapper is transparent: parameters keep their names ("layer1.0.conv1.weight", not
-- "layer1.0.module.conv1.weight"), fields it does not have read through to the module
-- (`ck.conv1`, `ck.grad_in_place`), and every parameter gradient is written once, by the module's own
-- backward during the wrapper's backward (DDP marks each ready once).

local Checkpoint = Module:extend('Checkpoint')

-- Unknown fields read through to the wrapped module.
Checkpoint.__index = function(t, k)
  local v = Checkpoint[k]
  if v ~= nil then return v end
  local inner = rawget(t, 'module')
  if inner ~= nil then return inner[k] end
  return nil
end

local function is_module(v)
  return type(v) == 'table' and rawget(v, '_children') ~= nil and rawget(v, '_params') ~= nil and v.forward ~= nil
end
local function is_checkpoint(v) return type(v) == 'table' and getmetatable(v) == Checkpoint end

-- A table with this metatable holds tensors a module keeps between steps: never freed as activations.
local KEEP = { __name = 'kept tensors' }

function Checkpoint:__init(module)
  if not is_module(module) then
    error(format('nn.Checkpoint: expected a dlua.nn module, got %s', type(module) == 'table' and 'a table' or type(module)), 3)
  end
  rawset(self, 'module', module)
  self._children = module._children  -- printing shows the module's tree under the wrapper
  self.training = module.training
  self._scratch = setmetatable({}, KEEP)
end

function Checkpoint:extra_repr()
  local e = self.module:extra_repr()
  return self.module.__name .. (e ~= '' and (', ' .. e) or '')
end

-- The wrapper and its module share one path (names are the module's own).
function Checkpoint:walk(fn, prefix)
  prefix = prefix or ''
  fn(prefix, self)
  self.module:walk(fn, prefix)
end

function Checkpoint:input_grad(flag)
  self.needs_input_grad = flag ~= false
  self.module:input_grad(flag)
  return self
end

---------------------------------------------------------------------------------------------
-- Hooks: what the recompute must see as the first forward saw it. A hook is a table of optional
-- functions, run for every checkpointed segment:
--   save(ck)              at forward, before the segment runs -> state (kept until the next forward)
--   enter(ck, state)      in backward, before the recompute -> token
--   recomputed(ck, token) after the recompute, before the segment's backward
--   leave(ck, token)      after the segment's backward (hooks leave in reverse order)
-- ck.module is the segment, ck:modules() its modules. Built in: 'rng' (generator positions) and
-- 'buffers' (batch-norm running statistics). Mixed precision registers its autocast state here (save
-- the policy in force, enter it, restore at recomputed): docs/nn.md. ZeRO-3 needs no hook: the
-- recompute runs inside its backward pass, which keeps a module's gathered parameters until the
-- module's backward, so one gather serves both.

Checkpoint.hooks = {}

function Checkpoint.register_hook(name, hook)
  if type(name) ~= 'string' or type(hook) ~= 'table' then
    error('Checkpoint.register_hook(name, {save =, enter =, recomputed =, leave =}): a name and a table of functions expected', 2)
  end
  for k, v in pairs(hook) do
    if not (k == 'save' or k == 'enter' or k == 'recomputed' or k == 'leave') or type(v) ~= 'function' then
      error(format("Checkpoint.register_hook(%q): unknown field '%s' (expected functions save, enter, recomputed, leave)",
        name, tostring(k)), 2)
    end
  end
  for i, h in ipairs(Checkpoint.hooks) do
    if h.name == name then Checkpoint.hooks[i] = { name = name, fns = hook }; return end
  end
  Checkpoint.hooks[#Checkpoint.hooks + 1] = { name = name, fns = hook }
end

-- The segment's modules (the wrapped module first), depth first.
function Checkpoint:modules()
  local r = {}
  self.module:walk(function(_, m) r[#r + 1] = m end)
  return r
end

-- The generators the segment draws from: the default one and any a module holds (Dropout's).
local function generators(ck)
  local gs, seen = { dlua.default_generator() }, {}
  for _, m in ipairs(ck._mods) do
    for _, v in pairs(m) do
      if is_generator(v) and not seen[v] then seen[v] = true; gs[#gs + 1] = v end
    end
  end
  return gs
end

local function positions(gs)
  local st = {}
  for i, g in ipairs(gs) do st[i] = g:get_state() end
  return st
end
local function set_positions(gs, st)
  for i, g in ipairs(gs) do g:set_state(st[i]) end
end

Checkpoint.register_hook('rng', {
  save = function(ck)
    local gs = generators(ck)
    return { gens = gs, at = positions(gs) }
  end,
  enter = function(_, state)
    local now = positions(state.gens)
    set_positions(state.gens, state.at)
    return { gens = state.gens, now = now }
  end,
  recomputed = function(_, token) set_positions(token.gens, token.now) end,
})

-- Buffers the forward updates (running statistics, num_batches_tracked) are updated by the first
-- forward only: copied aside before the recompute and back after it.
Checkpoint.register_hook('buffers', {
  enter = function(ck)
    local saved, scratch, n = {}, ck._scratch, 0
    for _, m in ipairs(ck._mods) do
      for _, f in ipairs(m._buffers) do
        local b = m[f]
        n = n + 1
        local s = scratch[n]
        if s == nil or s.p == nil or s.device ~= b.device or s.dtype ~= b.dtype or s:numel() ~= b:numel() then
          s = b:clone()
          scratch[n] = s
        else
          s:copy_(b)
        end
        saved[n] = b
      end
    end
    return saved
  end,
  recomputed = function(ck, saved)
    for i, b in ipairs(saved) do b:copy_(ck._scratch[i]) end
  end,
})

---------------------------------------------------------------------------------------------
-- The tensors a segment's modules hold: in a field, or one level down in a plain table (Sequential's
-- _inputs). Parameters, their gradients, buffers and KEEP tables are the model's state, not activations.

local function each_held(mods, fn)
  for _, m in ipairs(mods) do
    local keep = {}
    for _, f in ipairs(m._params) do keep[f] = true; keep['grad_' .. f] = true end
    for _, f in ipairs(m._buffers) do keep[f] = true end
    for k, v in pairs(m) do
      if not keep[k] then
        if is_tensor(v) then
          fn(m, k, nil, v)
        elseif type(v) == 'table' and getmetatable(v) == nil then
          for k2, v2 in pairs(v) do
            if is_tensor(v2) then fn(m, k, k2, v2) end
          end
        end
      end
    end
  end
end

local function held_set(mods)
  local s = {}
  each_held(mods, function(_, _, _, t) s[t] = true end)
  return s
end

local function add_all(set, list)
  for i = 1, list.n do
    local t = list[i]
    if is_tensor(t) then set[t] = true end
  end
  return set
end

-- Frees the tensors the modules came to hold since `before`, except those in `spare` (inputs,
-- outputs, gradients passed in or out): their fields are cleared and their memory goes back to the
-- allocator now, not when the collector finds them. Returns the number of tensors freed.
local function release(mods, before, spare)
  local doomed = {}
  each_held(mods, function(m, k, k2, t)
    if not before[t] and not spare[t] then doomed[#doomed + 1] = { m, k, k2, t } end
  end)
  for _, d in ipairs(doomed) do
    if d[3] == nil then d[1][d[2]] = nil else d[1][d[2]][d[3]] = nil end
  end
  for _, d in ipairs(doomed) do d[4]:free() end
  return #doomed
end

---------------------------------------------------------------------------------------------
-- forward and backward

function Checkpoint:forward(...)
  local inner = self.module
  local args = pack(...)
  -- As Torch7's output buffers, the previous forward's outputs go when the next forward starts, once
  -- their backward has run (the layers after them have run theirs too); waiting for the collector
  -- would hold a second set of kept activations through this step. Not before that backward: a
  -- pipeline stage runs several forwards before their backwards, keeping each one's fields aside.
  -- (Inputs belong to the caller and stay.)
  local prev = rawget(self, '_out')
  if prev and rawget(self, '_spent') then
    local mine = add_all(add_all({}, args), rawget(self, '_args'))
    for i = 1, prev.n do
      local t = prev[i]
      if is_tensor(t) and not mine[t] then t:free() end
    end
  end
  self._out, self._spent = nil, nil
  local mods = self:modules()
  self._mods = mods
  local before = held_set(mods)
  local hooks, states = Checkpoint.hooks, {}
  for i, h in ipairs(hooks) do
    local save = h.fns.save
    if save then states[i] = save(self) end
  end
  local out = pack(inner:forward(...))
  self._args, self._states = args, states
  local probe = rawget(self, '_probe')  -- model:checkpoint{budget_mb =} measuring what this segment frees
  local live = probe and dlua.memory_allocated(probe.device)
  release(mods, before, add_all(add_all({}, args), out))
  if probe then probe.freed = live - dlua.memory_allocated(probe.device) end
  self.output, self._out = out[1], out
  return unpack(out, 1, out.n)
end

function Checkpoint:backward(...)
  local args, states = rawget(self, '_args'), rawget(self, '_states')
  if args == nil then error('Checkpoint: backward before forward', 2) end
  local inner, mods, hooks = self.module, self._mods, Checkpoint.hooks
  local tokens = {}
  for i, h in ipairs(hooks) do
    local enter = h.fns.enter
    if enter then tokens[i] = enter(self, states[i]) end
  end
  local before = held_set(mods)
  inner:forward(unpack(args, 1, args.n))
  for i, h in ipairs(hooks) do
    local f = h.fns.recomputed
    if f then f(self, tokens[i]) end
  end
  local r = pack(inner:backward(...))
  for i = #hooks, 1, -1 do
    local f = hooks[i].fns.leave
    if f then f(self, tokens[i]) end
  end
  local spare = add_all(add_all(add_all({}, args), pack(...)), r)
  release(mods, before, spare)
  -- A caller that gives the gradient up (backward(x, grad, true): Sequential between its children, the
  -- ResNets and their blocks) has also run the backward of everything that read this segment's
  -- output. Both are spent: the gradient goes now, and so does the output when a policy made the
  -- wrapper and the output is not the model's (as PyTorch frees a graph's saved tensors in backward);
  -- waiting for the next forward would hold them through the rest of this backward. A plain
  -- backward(x, grad) keeps both (its caller may still read the output).
  if inner.grad_in_place and select(3, ...) == true then
    local kept = add_all(add_all({}, args), r)
    local grad = select(2, ...)
    if is_tensor(grad) and not kept[grad] then grad:free() end
    local root, out = rawget(self, '_root'), rawget(self, '_out')
    if root ~= nil and out ~= nil then
      local final = rawget(root, 'output')
      for i = 1, out.n do
        local t = out[i]
        if is_tensor(t) and not kept[t] and not rawequal(t, final) then t:free() end
      end
      self._out = nil
    end
  end
  self.grad_input, self._spent = r[1], true
  return unpack(r, 1, r.n)
end

---------------------------------------------------------------------------------------------
-- model:checkpoint(policy): wraps parts of a model in Checkpoint in place.
--   'blocks'              every residual block (modules whose class sets is_block: the ResNet blocks, nn.Residual)
--   'stages'              every module all of whose children are blocks (a ResNet's layer1..layer4)
--   {'layer1', 'fc', ...} these module paths (state-dict prefixes)
--   {budget_mb = N, input = x}  the fewest blocks whose checkpointing brings the activations that forward
--                         keeps for backward under N MiB, measured on one forward of x
--   'none' (or nil)       none
-- Wrappers a previous call made are removed first. Returns the plan: {policy, segments = {paths}} and,
-- for a budget, budget_mb, baseline_mb, planned_mb, fits; tostring(plan) reports it in one line.

local function join(prefix, name) return prefix == '' and name or (prefix .. '.' .. name) end
local function real(m)
  while is_checkpoint(m) do m = rawget(m, 'module') end
  return m
end

-- Visits (path, module, parent, name) depth first; fn returning false skips the module's children.
-- A Checkpoint is visited in place of its module (they share the path and the children).
local function visit(m, path, parent, name, fn)
  if fn(path, m, parent, name) == false then return end
  for _, c in ipairs(m._children) do visit(c.module, join(path, c.name), m, c.name, fn) end
end

local function replace(parent, name, old, new)
  local p = real(parent)
  for _, c in ipairs(p._children) do
    if c.name == name and rawequal(c.module, old) then c.module = new end
  end
  if rawequal(rawget(p, name), old) then rawset(p, name, new) end
  rawset(p, '_chain', nil) -- the ResNets cache their children by name
end

local function is_block(m) return m.is_block == true end
local function is_stage(m)
  if is_block(m) or #m._children == 0 then return false end
  for _, c in ipairs(m._children) do
    if not is_block(c.module) then return false end
  end
  return true
end

local function unwrap_policy(root)
  local found = {}
  visit(root, '', nil, nil, function(_, m, parent, name)
    if is_checkpoint(m) and rawget(m, '_policy') and parent then found[#found + 1] = { parent, name, m } end
  end)
  for i = #found, 1, -1 do
    local f = found[i]
    replace(f[1], f[2], f[3], rawget(f[3], 'module'))
  end
end

-- Outermost modules (not the root) for which pred holds; a module already in a Checkpoint is left as it is.
local function find(root, pred)
  local r = {}
  visit(root, '', nil, nil, function(path, m, parent, name)
    if parent == nil then return true end
    if is_checkpoint(m) then return false end
    if pred(m) then
      r[#r + 1] = { path = path, module = m, parent = parent, name = name }
      return false
    end
    return true
  end)
  return r
end

local function by_paths(root, paths, level)
  local at = {}
  visit(root, '', nil, nil, function(path, m, parent, name)
    if at[path] == nil then at[path] = { path = path, module = m, parent = parent, name = name } end
  end)
  local r, missing = {}, {}
  for i, p in ipairs(paths) do
    if type(p) ~= 'string' then
      error(format('model:checkpoint: path %d is a %s, expected a module path such as "layer1.0"', i, type(p)), level + 1)
    end
    local e = at[p]
    if p == '' then
      error('model:checkpoint: the root cannot be wrapped in place; use nn.Checkpoint(model)', level + 1)
    elseif e == nil then
      missing[#missing + 1] = format('%q', p)
    else
      r[#r + 1] = e
    end
  end
  if #missing > 0 then
    local top = {}
    for _, c in ipairs(root._children) do top[#top + 1] = c.name end
    error(format('model:checkpoint: no module at %s (the model\'s children: %s)', table.concat(missing, ', '),
      table.concat(top, ', ')), level + 1)
  end
  for i, a in ipairs(r) do
    for j, b in ipairs(r) do
      if i ~= j and (a.path == b.path or b.path:sub(1, #a.path + 1) == a.path .. '.') then
        error(format('model:checkpoint: %q %s %q: give segments that do not overlap', b.path,
          a.path == b.path and 'is listed twice, as' or 'is inside', a.path), level + 1)
      end
    end
  end
  return r
end

local function wrap(root, list)
  for _, e in ipairs(list) do
    if not is_checkpoint(e.module) then
      local ck = Checkpoint(e.module)
      ck._policy, ck._root = true, root
      replace(e.parent, e.name, e.module, ck)
      e.ck = ck
    else
      e.ck = e.module
    end
  end
end

local Plan = {}
Plan.__index = Plan
function Plan:__tostring()
  local names = table.concat(self.segments, ', ')
  if #names > 160 then names = names:sub(1, 157) .. '...' end
  if self.policy == 'none' then return 'activation checkpointing: none' end
  local s = format('activation checkpointing (%s): %d segment%s%s', self.policy, #self.segments,
    #self.segments == 1 and '' or 's', #self.segments > 0 and (' (' .. names .. ')') or '')
  if self.budget_mb then
    s = s .. format('; activations kept for backward %.1f MiB planned, %.1f MiB without checkpointing, budget %g MiB%s',
      self.planned_mb, self.baseline_mb, self.budget_mb, self.fits and '' or ' (does not fit even with every block checkpointed)')
  end
  return s
end

local function plan_of(policy, list)
  local segs = {}
  for i, e in ipairs(list) do segs[i] = e.path end
  return setmetatable({ policy = policy, segments = segs }, Plan)
end

-- Every buffer and generator position of the model, to put back after a probe forward.
local function snapshot(root)
  local bufs = {}
  for _, e in ipairs(root:named_buffers()) do bufs[#bufs + 1] = { e.buffer, e.buffer:clone() } end
  local gens, seen = { dlua.default_generator() }, {}
  root:walk(function(_, m)
    for _, v in pairs(m) do
      if is_generator(v) and not seen[v] then seen[v] = true; gens[#gens + 1] = v end
    end
  end)
  return { bufs = bufs, gens = gens, at = positions(gens) }
end
local function restore(s)
  for _, b in ipairs(s.bufs) do b[1]:copy_(b[2]); b[2]:free() end
  set_positions(s.gens, s.at)
end

local function full_gc()
  collectgarbage('collect')
  collectgarbage('collect')
end

-- {budget_mb = N, input = x}: one forward of x with every block checkpointed measures what each block
-- frees (s_k) and what the forward still keeps; without checkpointing it keeps that plus the sum of the
-- s_k. (A module keeps its activations in its fields until the next forward replaces them, so while
-- one segment's backward runs, everything that is not checkpointed is still held.) With a set S checkpointed, forward keeps baseline - sum(S) and backward brings back one
-- segment at a time: planned = baseline - sum(S) + max(S). Blocks are taken largest first (the early,
-- wide-activation ones, which also cost the least compute per byte to recompute) until planned fits.
local function budget_plan(root, policy, level)
  local budget, x = policy.budget_mb, policy.input
  if type(budget) ~= 'number' or budget <= 0 then
    error(format('model:checkpoint{budget_mb = N}: N must be a positive number of MiB, got %s', tostring(budget)), level + 1)
  end
  for k in pairs(policy) do
    if k ~= 'budget_mb' and k ~= 'input' then
      error(format("model:checkpoint{budget_mb =}: unknown option '%s' (expected budget_mb, input)", tostring(k)), level + 1)
    end
  end
  if not is_tensor(x) then
    error('model:checkpoint{budget_mb = N, input = x}: a sample input batch x is needed to measure the activations', level + 1)
  end
  local cands = find(root, is_block)
  if #cands == 0 then
    error(format('model:checkpoint{budget_mb =}: %s has no residual blocks to choose from (modules with is_block)', root.__name), level + 1)
  end
  wrap(root, cands)
  local dev = x.device
  for _, e in ipairs(cands) do e.ck._probe = { device = dev } end
  local snap = snapshot(root)
  -- what the forward keeps is what freeing the tensors it left in the model's fields gives back (the
  -- model is left holding no activations; tensors of an earlier step it replaced are collected first)
  local mods = {}
  root:walk(function(_, m) mods[#mods + 1] = m end)
  local before = held_set(mods)
  local out = root:forward(x)
  full_gc()
  local live = dlua.memory_allocated(dev)
  release(mods, before, { [x] = true })
  if is_tensor(out) and not rawequal(out, x) then out:free() end
  local kept = live - dlua.memory_allocated(dev)
  restore(snap)
  local baseline = kept
  for _, e in ipairs(cands) do
    e.saved = e.ck._probe.freed
    e.ck._probe = nil
    baseline = baseline + e.saved
  end
  local order = {}
  for i, e in ipairs(cands) do order[i] = { i = i, e = e } end
  table.sort(order, function(a, b)
    if a.e.saved ~= b.e.saved then return a.e.saved > b.e.saved end
    return a.i < b.i
  end)
  local limit = budget * 2 ^ 20
  local planned, sum, big = baseline, 0, 0
  local chosen = {}
  for _, o in ipairs(order) do
    if planned <= limit then break end
    chosen[o.i] = true
    sum = sum + o.e.saved
    big = math.max(big, o.e.saved)
    planned = baseline - sum + big
  end
  local keep, drop = {}, {}
  for i, e in ipairs(cands) do
    if chosen[i] then keep[#keep + 1] = e else drop[#drop + 1] = e end
  end
  for _, e in ipairs(drop) do replace(e.parent, e.name, e.ck, e.module) end
  local plan = plan_of('budget', keep)
  plan.budget_mb, plan.baseline_mb, plan.planned_mb = budget, baseline / 2 ^ 20, planned / 2 ^ 20
  plan.fits = planned <= limit
  plan.saved_mb = {}
  for _, e in ipairs(keep) do plan.saved_mb[e.path] = e.saved / 2 ^ 20 end
  return plan
end

function Module:checkpoint(policy)
  unwrap_policy(self)
  if policy == nil or policy == false or policy == 'none' then return plan_of('none', {}) end
  local list
  if policy == 'blocks' then
    list = find(self, is_block)
    if #list == 0 then
      error(format("model:checkpoint('blocks'): %s has no residual blocks (modules whose class sets is_block: the ResNet blocks, nn.Residual)",
        self.__name), 2)
    end
  elseif policy == 'stages' then
    list = find(self, is_stage)
    if #list == 0 then
      error(format("model:checkpoint('stages'): %s has no stages (modules whose children are all residual blocks)", self.__name), 2)
    end
  elseif type(policy) == 'table' and getmetatable(policy) == nil and policy.budget_mb ~= nil then
    local plan = budget_plan(self, policy, 2)
    return plan -- (not a tail call: errors name the caller's line)
  elseif type(policy) == 'table' and getmetatable(policy) == nil then
    list = by_paths(self, policy, 2)
    policy = 'paths'
  else
    error(format("model:checkpoint: policy must be 'none', 'blocks', 'stages', a list of module paths or {budget_mb = N, input = x}, got %s",
      type(policy) == 'string' and format('%q', policy) or type(policy)), 2)
  end
  wrap(self, list)
  return plan_of(policy, list)
end

return Checkpoint
