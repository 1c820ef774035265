-- dlua.dist.ZeRO: sharded data parallelism (ZeRO stages 1, 2 and 3) over the flat arenas, used like DDP (docs/zero.md).
local dlua = require 'dlua'
local ddp = require 'dlua.ddp'
local K = require 'bindings.nn'

local M = {}
local format = string.format
local huge = math.huge

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

local ZeRO = {}
M.methods = ZeRO

local dtype_bytes = { float32 = 4, float64 = 8, float16 = 2, bfloat16 = 2 }
local function bytes_of(t) return t:numel() * (dtype_bytes[t.dtype] or t:element_size()) end

-- [offset, offset + numel) of t (a 1-D tensor), 0-based; numel may be 0.
local function slice(t, offset, numel) return t:narrow(1, offset + 1, numel) end
M.slice = slice

-- Shard q of an arena of P elements over N ranks: [q*m, (q+1)*m) clipped to P, m = ceil(P / N). Contiguous,
-- no divisibility asked: the last shards are shorter (empty when P < N*(m-1)+1).
function M.shard_ranges(P, N)
  local m = math.ceil(P / N)
  local r = {}
  for q = 0, N - 1 do
    local lo, hi = math.min(q * m, P), math.min((q + 1) * m, P)
    r[q + 1] = { offset = lo, numel = hi - lo }
  end
  return r, m
end

-- Placeholders for parameters and gradients that a rank does not hold: the right shape (so sizes,
-- dims and parameter counts still read true) over one element, NaN for parameters so that a
-- use outside ZeRO's gathering shows.
local function placeholder(cache, dt, dev, shape, fill)
  local key = dt .. '/' .. dev .. '/' .. fill
  local one = cache[key]
  if not one then
    one = dlua.full({ 1 }, fill == 'nan' and 0 / 0 or 0, { dtype = dt, device = dev })
    cache[key] = one
  end
  local ones = {}
  for i = 1, #shape do ones[i] = 1 end
  if #shape == 0 then return one:view({}) end
  return one:view(ones):expand(shape)
end

---------------------------------------------------------------------------------------------
-- Construction

local allowed = { stage = true, offload = true, bucket_mb = true, first_bucket_mb = true, accumulate = true,
  group = true, gather_group = true, broadcast = true, prefetch = true, max_inflight = true, hook = true, hook_state = true }

-- dist.ZeRO(model, {stage = 1|2|3, offload = false, bucket_mb = 25, first_bucket_mb = 1, accumulate = 1,
-- group = g, gather_group = g2, broadcast = true, prefetch = 1, max_inflight = 2})
function M.new(dist, model, opts)
  opts = opts or {}
  if type(model) ~= 'table' or model.flatten == nil or model.walk == nil then
    fail(3, 'ZeRO: expected a dlua.nn module, got %s', type(model))
  end
  if type(opts) ~= 'table' then fail(3, 'ZeRO: expected an options table, got %s', type(opts)) end
  for k in pairs(opts) do
    if not allowed[k] then fail(3, "ZeRO: unknown option '%s'", tostring(k)) end
  end
  if not dist.is_initialized() then fail(3, 'ZeRO: dlua.dist is not initialised: call dlua.dist.init() first') end
  local stage = opts.stage or 1
  if stage ~= 1 and stage ~= 2 and stage ~= 3 then
    fail(3, 'ZeRO: stage must be 1, 2 or 3, got %s (stage 0 is dist.DDP)', tostring(stage))
  end
  -- A communication hook (gradient compression) replaces the reduction. Stage 1 keeps whole gradients, so a hook
  -- that leaves every rank the averaged arena (what an all-reduce gives) serves: each rank reads its shard of it.
  -- Stages 2 and 3 reduce-scatter bucket by bucket and keep only the shard: a compressor would need its own
  -- sparse/low-rank reduce-scatter, so they refuse rather than train on something else (docs/zero.md).
  if opts.hook ~= nil and stage ~= 1 then
    fail(3, 'ZeRO: stage %d cannot take a communication hook (%s): it reduce-scatters gradient buckets and keeps only '
      .. "this rank's shard, which compression hooks (all-reduce or all-gather of whole buckets) do not give; use stage 1 "
      .. '(whole gradients, sharded optimizer state) or no hook', stage, tostring(opts.hook))
  end
  local accumulate = opts.accumulate or 1
  if type(accumulate) ~= 'number' or accumulate < 1 or accumulate ~= math.floor(accumulate) then
    fail(3, 'ZeRO: accumulate must be a whole number >= 1, got %s', tostring(accumulate))
  end
  local bucket_mb, first_mb = opts.bucket_mb or 25, opts.first_bucket_mb or 1
  if type(bucket_mb) ~= 'number' or bucket_mb <= 0 then fail(3, 'ZeRO: bucket_mb must be a positive number') end
  if type(first_mb) ~= 'number' or first_mb <= 0 then fail(3, 'ZeRO: first_bucket_mb must be a positive number') end
  local prefetch, inflight = opts.prefetch or 1, opts.max_inflight or 2
  if type(prefetch) ~= 'number' or prefetch < 0 or prefetch ~= math.floor(prefetch) then
    fail(3, 'ZeRO: prefetch must be a whole number >= 0 (modules gathered ahead), got %s', tostring(prefetch))
  end
  if type(inflight) ~= 'number' or inflight < 1 or inflight ~= math.floor(inflight) then
    fail(3, 'ZeRO: max_inflight must be a whole number >= 1 (gradient buckets in flight), got %s', tostring(inflight))
  end
  if rawget(model, '_zero') or rawget(model, '_grad_sync') then
    fail(3, 'ZeRO: this model is already wrapped (by DDP or ZeRO)')
  end
  local group = opts.group
  local self = setmetatable({ module = model, dist = dist, group = group, stage = stage, accumulate = accumulate,
    bucket_mb = bucket_mb, first_bucket_mb = first_mb, prefetch = prefetch, max_inflight = inflight,
    _micro = 0, steps_synced = 0, _optimizers = {}, _ph = {}, _buf_bytes = 0, _peak_buf = 0 }, ZeRO)
  self.rank = group and group:rank() or dist.rank()
  self.world = group and group:size() or dist.world_size()
  if self.rank == nil then fail(3, 'ZeRO: rank %d is not a member of the group', dist.rank()) end
  if opts.hook ~= nil then
    self.hook, self.hook_state = ddp.resolve_hook(opts.hook, opts.hook_state, 'ZeRO')
    self.comm_counters = { bytes = 0, dense_bytes = 0, compress_s = 0 }
  end

  -- Same model everywhere? Checked first (as DDP does): what follows is collective.
  local named = model:named_parameters()
  local layout = {}
  for i = #named, 1, -1 do
    layout[#layout + 1] = { name = named[i].name, dtype = named[i].param.dtype, shape = named[i].param:size() }
  end
  ddp.verify_same_model(dist, group, layout, dist.rank(), 'ZeRO')
  local arena = model:flatten()
  self.arena, self.device = arena, arena.device
  self.dts = {}
  for dt in pairs(arena.params) do self.dts[#self.dts + 1] = dt end
  table.sort(self.dts)
  if opts.broadcast ~= false then
    for _, dt in ipairs(self.dts) do dist.broadcast(arena.params[dt], 0, { group = group }) end
    for _, e in ipairs(model:named_buffers()) do dist.broadcast(e.buffer, 0, { group = group }) end
  end
  -- name -> {module, field, shape, dtype, offset, numel}
  self._params = {}
  for _, e in ipairs(named) do self._params[e.name] = { module = e.module, field = e.field } end
  for _, en in ipairs(arena.entries) do
    local p = self._params[en.name]
    p.dtype, p.offset, p.numel, p.shape, p.name = en.dtype, en.offset, en.numel, en.shape, en.name
  end
  self.shards = {}
  for _, dt in ipairs(self.dts) do
    local P = arena.params[dt]:numel()
    local ranges, m = M.shard_ranges(P, self.world)
    self.shards[dt] = { numel = P, m = m, ranges = ranges, offset = ranges[self.rank + 1].offset,
      len = ranges[self.rank + 1].numel }
  end
  self._placeholders = {}

  -- Parameter all-gathers run on a group of their own under stage 3: gathers are issued as modules
  -- run, reductions as buckets fill, and the two orders need not interleave alike on every rank.
  if stage == 3 then
    if opts.gather_group then
      self.gather_group = opts.gather_group
    elseif group then
      fail(3, 'ZeRO: stage 3 on a group needs gather_group = dist.new_group(the same ranks), called by every rank '
        .. '(parameter gathers run on their own comm thread)')
    else
      self.gather_group = dist.new_group()
    end
    if self.gather_group:size() ~= self.world then
      fail(3, 'ZeRO: gather_group has %d ranks, the group %d', self.gather_group:size(), self.world)
    end
  end

  self:_setup_offload(opts.offload)
  if stage == 1 then
    self:_setup_stage1()
  else
    require('dlua.zero.sharded').setup(self, M)
  end
  model._zero = self
  arena.zero = self  -- an optimizer built on the module before now refuses to step (dlua.optim)
  self._grad_sync = self
  named, layout = nil, nil
  collectgarbage()  -- the whole arenas' last views go now, not at the next collection
  return self
end

-- Points every parameter's gradient field at the same place of a new gradient tensor for dt.
function ZeRO:_rebind_grads(dt, t)
  for _, en in ipairs(self.arena.entries) do
    if en.dtype == dt then
      local p = self._params[en.name]
      p.module['grad_' .. p.field] = slice(t, en.offset, en.numel):view(en.shape)
    end
  end
  self.arena.grads[dt] = t
end

-- Stage 1: the gradient arena stays whole on every rank, padded to N*m elements so that one
-- reduce-scatter of equal parts gives each rank the averaged gradients of its shard.
function ZeRO:_setup_stage1()
  self._padded = {}
  for _, dt in ipairs(self.dts) do
    local sh = self.shards[dt]
    local old = self.arena.grads[dt]
    local big = dlua.zeros(sh.m * self.world, { dtype = dt, device = self.device })
    local view = slice(big, 0, sh.numel)
    view:copy_(old)
    self:_rebind_grads(dt, view)
    old:free()
    self._padded[dt] = big
  end
end

-- Offload: the optimizer's state and step in host memory. CPU parameters have nothing to move.
function ZeRO:_setup_offload(offload)
  self.offload = offload and true or false
  self.offload_active = false
  if not offload then return end
  if self.device == 'cpu' then
    self.offload_why = 'the parameters are on the CPU: the optimizer state and step already are in host memory'
    if not M._offload_said then
      M._offload_said = true
      if self.dist.rank() == 0 then io.stderr:write('ZeRO: offload = true is a no-op here: ' .. self.offload_why .. '\n') end
    end
    return
  end
  -- Device parameters (untested on a GPU so far, see docs/zero.md): a pinned host master copy of this
  -- rank's shard and a host copy of its gradients; the optimizer runs on them (its buffers follow the
  -- host parameters), and the shard goes back to the device after each step.
  self.offload_active = true
  self.offload_why = 'optimizer state and step on the host'
  self._host_p, self._host_g = {}, {}
  for _, dt in ipairs(self.dts) do
    local len = self.shards[dt].len
    local hp, hg = dlua.empty(len, { dtype = dt }), dlua.zeros(len, { dtype = dt })
    self._host_p[dt] = len > 0 and hp:pin_memory() or hp
    self._host_g[dt] = len > 0 and hg:pin_memory() or hg
  end
end

-- This rank's shard of the parameters of dt on the device (a view of the full arena below stage 3).
function ZeRO:_param_shard(dt)
  if self.stage == 3 then return self._P[dt] end
  local sh = self.shards[dt]
  return slice(self.arena.params[dt], sh.offset, sh.len)
end

-- This rank's averaged gradients of dt on the device.
function ZeRO:_grad_shard(dt)
  if self.stage == 1 then
    local sh = self.shards[dt]
    return slice(self.arena.grads[dt], sh.offset, sh.len)
  end
  return self._G[dt]
end

-- Unknown fields read through to the module, as DDP's do. At stage 3 the module's parameters are
-- placeholders: named_parameters/parameters are not offered (state_dict() gathers them).
local hidden3 = { named_parameters = true, parameters = true }
ZeRO.__index = function(t, k)
  local v = rawget(ZeRO, k)
  if v ~= nil then return v end
  if hidden3[k] and rawget(t, 'stage') == 3 then return nil end
  local m = rawget(t, 'module')
  local mv = m[k]
  if type(mv) == 'function' then
    return function(s, ...)
      if s == t then return mv(m, ...) end
      return mv(s, ...)
    end
  end
  return mv
end
ZeRO.__tostring = function(t) return format('ZeRO-%d(%s)', t.stage, tostring(t.module)) end
ZeRO.__call = function(t, x, ...) return t:forward(x, ...) end

function ZeRO:flatten()
  error('ZeRO: a sharded model has no whole flat arena to hand out: clip with zero:clip_grad_norm_(max_norm) '
    .. '(the norm needs every rank\'s shard); optimizers take the ZeRO model itself', 2)
end

---------------------------------------------------------------------------------------------
-- The training step, stage 1 (stages 2 and 3 replace these in dlua/zero/sharded.lua)

function ZeRO:_syncing() return not self._no_sync and (self._micro % self.accumulate == 0) end

function ZeRO:forward(x, ...)
  self:_wait_params()
  return self.module:forward(x, ...)
end

function ZeRO:backward(x, grad, ...)
  self:wait()
  self._micro = self._micro + 1
  local r = { self.module:backward(x, grad, ...) }
  if self:_syncing() then
    self._rs = {}
    for _, dt in ipairs(self.dts) do
      local sh, big = self.shards[dt], self._padded[dt]
      -- accumulate = k: the summed micro-batches become their mean (as DDP scales each bucket)
      if self.accumulate > 1 then self.arena.grads[dt]:mul_(1 / self.accumulate) end
      local ins = {}
      for q = 1, self.world do ins[q] = slice(big, (q - 1) * sh.m, sh.m) end
      if self.hook and self.world > 1 then
        self._rs[dt] = self:_run_hook(dt)
      elseif self.world > 1 then
        self._rs[dt] = self.dist.reduce_scatter(ins[self.rank + 1], ins, 'avg', { async = true, group = self.group })
      end
    end
    self._pending = true
    self.steps_synced = self.steps_synced + 1
  end
  return unpack(r, 1, table.maxn(r))
end

-- Stage 1 with a hook: the whole arena of dt is one bucket; the hook leaves the average in place.
function ZeRO:_run_hook(dt)
  local g = self.arena.grads[dt]
  self._hook_buckets = self._hook_buckets or {}
  local b = self._hook_buckets[dt]
  if b == nil then
    local entries, names = {}, {}
    for _, en in ipairs(self.arena.entries) do
      if en.dtype == dt then
        entries[#entries + 1] = { name = en.name, offset = en.offset, numel = en.numel, shape = en.shape }
        names[#names + 1] = en.name
      end
    end
    local index = 0
    for i, d in ipairs(self.dts) do if d == dt then index = i end end
    b = { index = index, dtype = dt, offset = 0, numel = g:numel(), tensor = g, names = names, entries = entries,
      arena_numel = g:numel(), counters = self.comm_counters, group = self.group, dist = self.dist }
    self._hook_buckets[dt] = b
  end
  self.comm_counters.dense_bytes = self.comm_counters.dense_bytes + g:numel() * g:element_size()
  local w = self.hook(self.hook_state, b)
  if w == nil or w.wait == nil then fail(3, 'ZeRO: the communication hook must return a handle with wait()') end
  return w
end

function ZeRO:comm_stats(opts)
  if not self.hook then fail(2, "ZeRO:comm_stats: no communication hook (give ZeRO{hook = ...}); without one stage %d reduce-scatters every gradient", self.stage) end
  return ddp.DDP_methods.comm_stats(self, opts)
end

-- Waits for every reduction in flight.
function ZeRO:wait()
  if not self._pending then return end
  for dt, w in pairs(self._rs or {}) do
    self._rs[dt] = nil
    w:wait()
  end
  self._pending = false
end

-- Optimizer interface (dlua.optim): ranges are in elements of this rank's shard of dt.
function ZeRO:wait_range(dt, offset, numel)
  local w = self._rs and self._rs[dt]
  if w then
    self._rs[dt] = nil
    w:wait()
  end
  self:_offload_grads(dt, offset, numel)
end

function ZeRO:pieces(dt, offset, numel) return { { offset = offset, numel = numel } } end

function ZeRO:no_sync(fn)
  local prev = self._no_sync
  self._no_sync = true
  local ok, err = pcall(fn)
  self._no_sync = prev
  self._micro = 0
  if not ok then error(err, 0) end
end

function ZeRO:zero_grad()
  self:wait()
  if self.stage == 1 then
    for _, dt in ipairs(self.dts) do self._padded[dt]:zero_() end
  else
    self:_zero_shard_grads()
  end
end

function ZeRO:input_grad(flag)
  self.module:input_grad(flag)
  return self
end

-- Offload: the optimizer's piece of the gradients, and of the parameters (the device holds the
-- truth: a checkpoint or gathered() may have changed them), go to the host before it is stepped.
function ZeRO:_offload_grads(dt, offset, numel)
  if not self.offload_active or numel == 0 then return end
  slice(self._host_g[dt], offset, numel):copy_(slice(self:_grad_shard(dt), offset, numel))
  slice(self._host_p[dt], offset, numel):copy_(slice(self:_param_shard(dt), offset, numel))
end

-- After the optimizer's step: this rank's shard of the parameters goes to every rank (stages 1, 2);
-- stage 3 keeps shards only. Asynchronous: the next forward waits.
function ZeRO:after_step()
  self:wait()  -- buckets outside this rank's shard: the step did not need them, their buffers go now
  for _, dt in ipairs(self.dts) do
    if self.offload_active then self:_param_shard(dt):copy_(self._host_p[dt]) end
  end
  if self.stage == 3 or self.world == 1 then return end
  self._gathers = self._gathers or {}
  for _, dt in ipairs(self.dts) do
    local sh, p = self.shards[dt], self.arena.params[dt]
    local outs = {}
    for q = 1, self.world do outs[q] = slice(p, sh.ranges[q].offset, sh.ranges[q].numel) end
    -- on the CPU the input is this rank's part of the outputs (the copy onto itself is skipped or
    -- harmless); a device copy onto itself is not allowed, so GPUs send a copy
    local mine = outs[self.rank + 1]
    if self.device ~= 'cpu' then mine = mine:clone() end
    self._gathers[#self._gathers + 1] = self.dist.all_gather(outs, mine, { async = true, group = self.group })
  end
end

function ZeRO:_wait_params()
  local g = self._gathers
  if not g then return end
  self._gathers = nil
  for _, w in ipairs(g) do w:wait() end
end

---------------------------------------------------------------------------------------------
-- Optimizers (dlua.optim builds over zero:optim_arena(): this rank's shard, offsets from its start)

-- The entries of the arena's layout that meet [s, s + len), offsets counted from s.
function ZeRO:_clipped_entries(dt)
  local sh = self.shards[dt]
  local s, e = sh.offset, sh.offset + sh.len
  local out = {}
  for _, en in ipairs(self.arena.entries) do
    if en.dtype == dt then
      local lo, hi = math.max(en.offset, s), math.min(en.offset + en.numel, e)
      if lo < hi then
        out[#out + 1] = { name = en.name, dtype = dt, offset = lo - s, numel = hi - lo, shape = en.shape,
          whole = lo == en.offset and hi == en.offset + en.numel }
      end
    end
  end
  return out
end

function ZeRO:_named()
  local r = {}
  for _, e in ipairs(self.module:named_parameters()) do r[#r + 1] = { name = e.name, param = e.param } end
  return r
end

function ZeRO:optim_arena()
  local a = { params = {}, grads = {}, entries = {}, zero = self, named = self:_named(),
    device = self.offload_active and 'cpu' or self.device }
  for _, dt in ipairs(self.dts) do
    a.params[dt] = self.offload_active and self._host_p[dt] or self:_param_shard(dt)
    a.grads[dt] = self.offload_active and self._host_g[dt] or self:_grad_shard(dt)
    for _, en in ipairs(self:_clipped_entries(dt)) do a.entries[#a.entries + 1] = en end
  end
  if self.offload_active then
    for _, dt in ipairs(self.dts) do a.params[dt]:copy_(self:_param_shard(dt)) end
  end
  return a
end

-- The device shard's gradients as an arena (what clipping and the overflow check read).
function ZeRO:_grad_arena()
  local a = { grads = {}, entries = {}, device = self.device }
  for _, dt in ipairs(self.dts) do
    a.grads[dt] = self:_grad_shard(dt)
    for _, en in ipairs(self:_clipped_entries(dt)) do a.entries[#a.entries + 1] = en end
  end
  return a
end

-- An optimizer built over this model: its state buffers exist from the start, the same names on
-- every rank (empty on a rank whose shard is), so state dicts gather alike everywhere.
function ZeRO:attach(opt)
  self._optimizers[#self._optimizers + 1] = opt
  opt._zero_names = opt:_state_names()
  for _, dt in ipairs(self.dts) do
    for _, k in ipairs(opt._zero_names) do opt:buffer(dt, k) end
  end
end

-- A tensor of the whole arena of dt gathered from every rank's shard `part` (same dtype).
function ZeRO:_gather_full(dt, part, dev)
  local sh = self.shards[dt]
  local full = dlua.empty(sh.numel, { dtype = part.dtype, device = dev or part.device })
  local outs = {}
  for q = 1, self.world do outs[q] = slice(full, sh.ranges[q].offset, sh.ranges[q].numel) end
  if part.device ~= full.device then part = part:to(full.device) end
  self.dist.all_gather(outs, part, { group = self.gather_group or self.group })
  return full
end

-- The optimizer's state dict with whole buffers (the format of an optimizer without ZeRO, so a
-- checkpoint loads on any world size and stage, and into DDP). Collective.
function ZeRO:full_optim_state(opt, sd)
  self:wait()
  local bufs = {}
  for _, dt in ipairs(self.dts) do
    bufs[dt] = {}
    for _, k in ipairs(opt._zero_names) do bufs[dt][k] = self:_gather_full(dt, opt:buffer(dt, k)) end
  end
  sd.buffers = bufs
  return sd
end

-- The reverse: whole buffers (from any world size or stage) -> this rank's shard of them.
function ZeRO:shard_optim_state(opt, sd)
  local out = { steps = sd.steps, lr = sd.lr, buffers = {} }
  for dt, b in pairs(sd.buffers or {}) do
    local sh = self.shards[dt]
    if not sh then fail(3, 'ZeRO: the optimizer state has dtype %s, which the model has no parameters of', tostring(dt)) end
    out.buffers[dt] = {}
    for k, v in pairs(b) do
      if v:numel() ~= sh.numel then
        fail(3, "ZeRO: optimizer state '%s' (%s) has %d elements, the model's arena %d", k, dt, v:numel(), sh.numel)
      end
      out.buffers[dt][k] = slice(v:contiguous():view(v:numel()), sh.offset, sh.len)
    end
  end
  return out
end

---------------------------------------------------------------------------------------------
-- Clipping, the overflow check, state dicts, memory

-- clip_grad_norm_(max_norm, norm_type = 2, {error_if_nonfinite}): nn.utils.clip_grad_norm_ over the
-- shards: each rank's sum of |g|^p over its shard, all-reduced, then each rank scales its shard.
function ZeRO:clip_grad_norm_(max_norm, norm_type, opts)
  if type(norm_type) == 'table' and opts == nil then norm_type, opts = nil, norm_type end
  self:wait()
  local o = { group = self.group or true }
  if opts and opts.error_if_nonfinite then o.error_if_nonfinite = true end
  return require('dlua.nn.utils').clip_grad_norm_(self:_grad_arena(), max_norm, norm_type, o)
end

-- Whether any rank's shard of the averaged gradients holds an inf or a NaN: one verdict for all
-- ranks (AMP's GradScaler skips the step on it; dlua's AMP is to call this).
function ZeRO:found_inf()
  self:wait()
  local bad = 0
  for _, dt in ipairs(self.dts) do
    local g = self:_grad_shard(dt)
    if g:numel() > 0 then
      local v = K.grad_norm_partial(g, 0, g:numel(), huge)
      if v ~= v or v == huge then bad = 1 end
    end
  end
  local t = dlua.tensor({ bad }, { dtype = 'float32', device = self.device })
  self.dist.all_reduce(t, 'max', { group = self.group })
  return t:cpu()[1] > 0
end

-- Stages 1 and 2: the module's own state dict (every rank holds the whole parameters).
function ZeRO:state_dict()
  self:_wait_params()
  if self.stage == 3 then return self:_full_state_dict() end
  return self.module:state_dict()
end

function ZeRO:load_state_dict(sd, strict)
  self:_wait_params()
  if self.stage == 3 then return self:_load_full_state_dict(sd, strict) end
  return self.module:load_state_dict(sd, strict)
end

-- gathered(fn): runs fn() with the whole parameters in place (stage 3 gathers them; below, every
-- rank holds them once the last step's gathers are in).
function ZeRO:gathered(fn)
  self:_wait_params()
  return fn()
end

-- DDP's communication state, for ckpt.comm_state(zero).
function ZeRO:comm_state_dict()
  local hs = self.hook_state
  if type(hs) == 'table' and type(hs.state_dict) == 'function' then hs = hs:state_dict() end
  return { micro_step = self._micro, hook_state = hs }
end
function ZeRO:load_comm_state_dict(sd)
  self._micro = sd.micro_step or 0
  local hs = self.hook_state
  if sd.hook_state ~= nil and type(hs) == 'table' and type(hs.load_state_dict) == 'function' then hs:load_state_dict(sd.hook_state) end
end

local function state_bytes(self)
  local n = 0
  for _, opt in ipairs(self._optimizers) do
    for _, s in pairs(opt.state) do
      for k, v in pairs(s) do if k ~= 'numel' and dlua.is_tensor(v) then n = n + bytes_of(v) end end
    end
  end
  return n
end

-- Bytes this rank holds for the model's states: {parameters, gradients, optimizer, model_states,
-- buffers (gradient buckets and gathered modules now), peak (model states + the most buffers seen),
-- host (offload's host copies, counted apart), stage, ranks}.
function ZeRO:memory()
  local params, grads, host = 0, 0, 0
  for _, dt in ipairs(self.dts) do
    params = params + (self.stage == 3 and bytes_of(self._P[dt]) or bytes_of(self.arena.params[dt]))
    grads = grads + (self.stage == 1 and bytes_of(self._padded[dt]) or bytes_of(self._G[dt]))
    if self.offload_active then host = host + bytes_of(self._host_p[dt]) + bytes_of(self._host_g[dt]) end
  end
  local opt = state_bytes(self)
  local states = params + grads + (self.offload_active and 0 or opt)
  return { stage = self.stage, ranks = self.world, parameters = params, gradients = grads, optimizer = opt,
    model_states = states, buffers = self._buf_bytes, peak = states + self._peak_buf,
    host = self.offload_active and host + opt or 0, offload = self.offload_active }
end

function ZeRO:reset_peak() self._peak_buf = self._buf_bytes end

function ZeRO:_track(delta)
  self._buf_bytes = self._buf_bytes + delta
  if self._buf_bytes > self._peak_buf then self._peak_buf = self._buf_bytes end
end

-- One line for a recipe's plan: "ZeRO-2 on 4 ranks: per rank 12.3 MB parameters, ...".
function ZeRO:memory_line()
  local m = self:memory()
  local function mb(b) return format('%.2f MB', b / 2 ^ 20) end
  return format('ZeRO-%d on %d ranks: per rank %s parameters, %s gradients, %s optimizer state%s (%s model states, peak %s with buffers)%s',
    m.stage, m.ranks, mb(m.parameters), mb(m.gradients), mb(m.optimizer), m.offload and ' on the host' or '',
    mb(m.model_states), mb(m.peak), self.offload and not self.offload_active and ('; offload: no-op (' .. self.offload_why .. ')') or '')
end

-- The bucket plan (stages 2, 3) as DDP's bucket_plan() gives it; stage 1 reduces each dtype's
-- arena in one reduce-scatter after backward.
function ZeRO:bucket_plan()
  local r = {}
  for i, b in ipairs(self.buckets or {}) do
    r[i] = { index = b.index, dtype = b.dtype, offset = b.offset, numel = b.numel, names = b.names }
  end
  return r
end

M.placeholder = placeholder
M.bytes_of = bytes_of
M.fail = fail
return M
