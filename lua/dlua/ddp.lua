-- dlua.dist.DDP: data-parallel training with bucketed all-reduce overlapped with backward (docs/ddp.md).
local dlua = require 'dlua'
local bit = require 'bit'
local flight = require 'bindings.monitor'  -- the flight recorder notes each collective's bucket
local dist_binding = require 'bindings.dist'

local M = {}
local format = string.format

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

local DDP = {}
M.DDP_methods = DDP

local dtype_bytes = { float32 = 4, float64 = 8, float16 = 2, bfloat16 = 2, int32 = 4, int64 = 8, uint8 = 1, bool = 1 }

-- The default communication hook: average the bucket over the group, asynchronously.
function M.allreduce_hook(state, bucket)
  local c = bucket.counters
  if c then c.bytes = c.bytes + bucket.numel * bucket.tensor:element_size() end
  return bucket.dist.all_reduce(bucket.tensor, 'avg', { async = true, group = bucket.group })
end

-- hook = fn, or a hook object of dlua.dist.compress (it is its own state): the function and state to run.
function M.resolve_hook(hook, state, who)
  if type(hook) == 'table' and type(hook.comm_hook) == 'function' then
    if state ~= nil and state ~= hook then fail(4, '%s: a compression hook object carries its own state; give no hook_state', who) end
    return hook.comm_hook, hook
  end
  if hook ~= nil and type(hook) ~= 'function' then
    fail(4, '%s: the hook must be a function or a dlua.dist.compress hook, got %s', who, type(hook))
  end
  return hook or M.allreduce_hook, state
end

---------------------------------------------------------------------------------------------
-- The bucket plan: ranges of the flat gradient arena, in its order (reverse order of use in
-- forward, so the first bucket fills first during backward).

-- entries: the arena's {name, dtype, offset, numel}; returns buckets
-- {index, dtype, offset, numel, names = {...}} with sizes capped by first_cap / cap bytes.
function M.plan(entries, first_cap, cap)
  local by_dtype, dtypes = {}, {}
  for _, en in ipairs(entries) do
    if not by_dtype[en.dtype] then by_dtype[en.dtype] = {}; dtypes[#dtypes + 1] = en.dtype end
    table.insert(by_dtype[en.dtype], en)
  end
  table.sort(dtypes)  -- the same order on every rank
  local buckets = {}
  for _, dt in ipairs(dtypes) do
    local list = by_dtype[dt]
    table.sort(list, function(a, b) return a.offset < b.offset end)
    local cur = nil
    local bytes = dtype_bytes[dt] or 4
    for _, en in ipairs(list) do
      if cur == nil then
        cur = { dtype = dt, offset = en.offset, numel = 0, names = {} }
      end
      cur.numel = en.offset + en.numel - cur.offset
      cur.names[#cur.names + 1] = en.name
      local limit = (#buckets == 0) and first_cap or cap
      if cur.numel * bytes >= limit then
        buckets[#buckets + 1] = cur
        cur = nil
      end
    end
    if cur then buckets[#buckets + 1] = cur end
  end
  for i, b in ipairs(buckets) do b.index = i end
  return buckets
end

---------------------------------------------------------------------------------------------
-- Model identity: every rank must have built the same model.

local function layout_text(entries)
  local parts = {}
  for i, en in ipairs(entries) do
    parts[i] = format('%s %s (%s)', en.name, en.dtype, table.concat(en.shape, ', '))
  end
  return parts
end

local function fnv1a(s)
  local h = 2166136261
  for i = 1, #s do h = bit.tobit(bit.bxor(h, s:byte(i)) * 16777619) end
  return h
end

local function verify_same_model(dist, group, entries, rank, who)
  local lines = layout_text(entries)
  local text = table.concat(lines, '\n')
  local mine = dlua.tensor({ fnv1a(text), #lines }, { dtype = 'int64' })
  local all = dist.all_gather(nil, mine, { group = group })
  local differs = {}
  for r = 1, #all do
    if all[r][1] ~= all[1][1] or all[r][2] ~= all[1][2] then differs[#differs + 1] = r - 1 end
  end
  if #differs == 0 then return end
  -- name the first difference: every rank posts its layout, each compares with rank 0's
  local store = dist.store()
  local key = 'dlua/ddp/layout/'
  store:set(key .. rank, text)
  local ref = store:get(key .. '0')
  local ref_lines = {}
  for l in (ref .. '\n'):gmatch('(.-)\n') do ref_lines[#ref_lines + 1] = l end
  local what = 'the same parameters'
  for i = 1, math.max(#lines, #ref_lines) do
    if lines[i] ~= ref_lines[i] then
      what = format('parameter %d is %s on rank 0 but %s on rank %d', i, ref_lines[i] or '(none)',
                    lines[i] or '(none)', rank)
      break
    end
  end
  fail(3, '%s: the ranks built different models (ranks %s differ from rank 0); %s', who or 'DDP', table.concat(differs, ', '), what)
end
M.verify_same_model = verify_same_model  -- ZeRO checks the same way

---------------------------------------------------------------------------------------------
-- Construction

-- dist.DDP(model, {bucket_mb = 25 (or 'auto'), first_bucket_mb = 1, accumulate = 1, group = g,
-- hook = fn, hook_state = s, grad_dtype = 'float32', broadcast = true, broadcast_buffers = true,
-- auto = {candidates =, steps =, warmup =}})
-- grad_dtype = 'bfloat16' | 'float16' reduces the float32 gradient buckets in 16 bits (DeepSpeed's
-- communication_data_type): each rank sends gradient / world as 16 bits and casts the sum back; it is the
-- bf16 / fp16 compression hook, so it cannot be given together with a hook.
function M.new(dist, model, opts)
  opts = opts or {}
  if type(model) ~= 'table' or model.flatten == nil then fail(3, 'DDP: expected a dlua.nn module, got %s', type(model)) end
  local allowed = { bucket_mb = true, first_bucket_mb = true, accumulate = true, group = true, hook = true,
                    hook_state = true, grad_dtype = true, broadcast = true, broadcast_buffers = true, auto = true }
  for k in pairs(opts) do
    if not allowed[k] then fail(3, "DDP: unknown option '%s'", tostring(k)) end
  end
  if not dist.is_initialized() then fail(3, 'DDP: dlua.dist is not initialised: call dlua.dist.init() first') end
  local accumulate = opts.accumulate or 1
  if type(accumulate) ~= 'number' or accumulate < 1 or accumulate ~= math.floor(accumulate) then
    fail(3, 'DDP: accumulate must be a whole number >= 1, got %s', tostring(accumulate))
  end
  local bucket_mb, first_mb = opts.bucket_mb or 25, opts.first_bucket_mb or 1
  local auto = bucket_mb == 'auto'
  if not auto and (type(bucket_mb) ~= 'number' or bucket_mb <= 0) then fail(3, "DDP: bucket_mb must be a positive number or 'auto'") end
  if opts.auto ~= nil and not auto then fail(3, "DDP: the auto option needs bucket_mb = 'auto'") end
  if type(first_mb) ~= 'number' or first_mb <= 0 then fail(3, 'DDP: first_bucket_mb must be a positive number') end

  local self = { module = model, dist = dist, group = opts.group, accumulate = accumulate, _micro = 0,
                 comm_counters = { bytes = 0, dense_bytes = 0, compress_s = 0 },
                 bucket_mb = bucket_mb, first_bucket_mb = first_mb, steps_synced = 0, comm_wait_s = 0,
                 broadcast_buffers = opts.broadcast_buffers ~= false }
  local hook = opts.hook
  local gd = opts.grad_dtype
  if gd ~= nil and gd ~= 'float32' then
    local spec = ({ bfloat16 = 'bf16', float16 = 'fp16' })[gd]
    if not spec then
      fail(3, "DDP: grad_dtype must be 'float32', 'bfloat16' or 'float16', got %s", tostring(gd))
    end
    if hook ~= nil or opts.hook_state ~= nil then
      fail(3, "DDP: grad_dtype = '%s' is the %s compression hook; give grad_dtype or hook, not both", gd, spec)
    end
    hook = require('dlua.compress').from_spec(spec)
  end
  self.hook, self.hook_state = M.resolve_hook(hook, opts.hook_state, 'DDP')
  self.rank = dist.rank()
  self.world = opts.group and opts.group:size() or dist.world_size()
  -- Same model everywhere? Checked first: the arena's allocation below is itself collective.
  local named = model:named_parameters()
  local layout = {}
  for i = #named, 1, -1 do  -- the arena's order
    layout[#layout + 1] = { name = named[i].name, dtype = named[i].param.dtype, shape = named[i].param:size() }
  end
  verify_same_model(dist, opts.group, layout, self.rank)
  -- CPU ranks on one host: the gradient arena in memory they all map, so bucket all-reduces read the
  -- peers' gradients in place (docs/comm.md). Only when DDP makes the arena: an optimizer built
  -- earlier holds the old one.
  local grads_alloc
  if model._arena == nil and named[1] ~= nil and named[1].param.device == 'cpu' then
    grads_alloc = function(dt, n)
      local t, why = dist.shared_zeros(n, dt, { group = opts.group })
      self.shared_grads = t ~= nil
      self.shared_why = why
      return t
    end
  end
  local arena = model:flatten({ grads = grads_alloc })
  self.arena = arena

  -- every rank starts from rank 0's parameters and buffers
  if opts.broadcast ~= false then
    local dts = {}
    for dt in pairs(arena.params) do dts[#dts + 1] = dt end
    table.sort(dts)
    for _, dt in ipairs(dts) do dist.broadcast(arena.params[dt], 0, { group = opts.group }) end
    for _, e in ipairs(model:named_buffers()) do dist.broadcast(e.buffer, 0, { group = opts.group }) end
  end

  setmetatable(self, DDP)
  if auto then  -- candidate plans timed in the first steps (lua/dlua/ddp_auto.lua)
    self._auto = require('dlua.ddp_auto').new(self, function(mb) return M.plan(arena.entries, first_mb * 2 ^ 20, mb * 2 ^ 20) end,
      opts.auto, 4)
    self:set_buckets(self._auto:initial_plan())
  else
    self:set_buckets(M.plan(arena.entries, first_mb * 2 ^ 20, bucket_mb * 2 ^ 20))
  end
  self:_install()
  model._grad_sync = self
  self._grad_sync = self
  return self
end

-- Unknown fields read through to the module, its methods bound to it: a DDP object can go
-- wherever the model went (optimizers, state_dict, printing).
DDP.__index = function(t, k)
  local v = rawget(DDP, k)
  if v ~= nil then return v end
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
DDP.__tostring = function(t) return 'DDP(' .. tostring(t.module) .. ')' end

-- Replaces the bucket plan (a list of {dtype, offset, numel}; names are filled in). Buckets
-- must cover every parameter exactly once, in arena order per dtype.
function DDP:set_buckets(plan)
  self:wait()
  local entries = self.arena.entries
  local buckets = {}
  for i, b in ipairs(plan) do
    if type(b) ~= 'table' or type(b.offset) ~= 'number' or type(b.numel) ~= 'number' or not self.arena.grads[b.dtype] then
      fail(2, 'DDP:set_buckets: bucket %d needs dtype, offset and numel of the gradient arena', i)
    end
    buckets[i] = { index = i, dtype = b.dtype, offset = b.offset, numel = b.numel, names = {}, entries = {}, params = 0 }
  end
  -- each entry belongs to the bucket that contains it
  local owner = {}
  for _, en in ipairs(entries) do
    local found = nil
    for _, b in ipairs(buckets) do
      if b.dtype == en.dtype and en.offset >= b.offset and en.offset + en.numel <= b.offset + b.numel then found = b; break end
    end
    if not found then fail(2, 'DDP:set_buckets: parameter %s is in no bucket (or split across two)', en.name) end
    found.names[#found.names + 1] = en.name
    found.entries[#found.entries + 1] = { name = en.name, offset = en.offset - found.offset, numel = en.numel, shape = en.shape }
    found.params = found.params + 1
    owner[en.name] = found
  end
  for _, b in ipairs(buckets) do
    if b.params == 0 then fail(2, 'DDP:set_buckets: bucket %d holds no parameter', b.index) end
    b.tensor = self.arena.grads[b.dtype]:narrow(1, b.offset + 1, b.numel)
    b.group, b.dist = self.group, self.dist
    -- for hooks: the whole arena's size (residuals span it), this step's byte and time counters
    b.arena_numel, b.counters = self.arena.grads[b.dtype]:numel(), self.comm_counters
  end
  self.buckets, self._owner = buckets, owner
  self:_reset_step()
end

-- bucket_mb = 'auto': the plan kept and each candidate's time ({bucket_mb, buckets, seconds,
-- candidates = {...}}), or nil while the first steps are still measuring.
function DDP:bucket_choice() return self.auto_report end

-- The plan as a plain table (index, dtype, offset, numel, names): read it, change it, give
-- it back to set_buckets.
function DDP:bucket_plan()
  local r = {}
  for i, b in ipairs(self.buckets) do
    r[i] = { index = b.index, dtype = b.dtype, offset = b.offset, numel = b.numel, names = b.names }
  end
  return r
end

function DDP:_reset_step()
  for _, b in ipairs(self.buckets) do b.pending, b.work, b.launched = b.params, nil, false end
  self._next = 1
  self._module_calls = {}
end

local function ready_then(ddp, mod, names, ...)
  ddp:_ready(mod, names)
  return ...
end

-- Every module with parameters reports when its backward has written their gradients.
function DDP:_install()
  local ddp = self
  self.module:walk(function(prefix, m)
    if #m._params == 0 or rawget(m, '_ddp_wrapped') then return end
    local names = {}
    for i, f in ipairs(m._params) do names[i] = prefix == '' and f or (prefix .. '.' .. f) end
    local orig = m.backward
    m._ddp_wrapped = true
    m.backward = function(mod, ...)
      return ready_then(ddp, mod, names, orig(mod, ...))  -- keeps every value (batch-norm returns two)
    end
  end)
end

function DDP:_syncing() return not self._no_sync and (self._micro % self.accumulate == 0) end

function DDP:_ready(mod, names)
  if not self._in_backward or not self:_syncing() then return end
  local calls = (self._module_calls[mod] or 0) + 1
  self._module_calls[mod] = calls
  if calls > 1 then
    fail(3, 'DDP: %s ran backward twice in one step (a module used twice in forward); DDP cannot tell when its gradients are final', names[1])
  end
  for _, n in ipairs(names) do
    local b = self._owner[n]
    b.pending = b.pending - 1
  end
  self:_launch_ready()
end

-- Starts the buckets that are ready, strictly in plan order (every rank must issue the same
-- collectives in the same order).
function DDP:_launch_ready(all)
  while self._next <= #self.buckets do
    local b = self.buckets[self._next]
    if b.pending > 0 and not all then break end
    self:_launch(b)
    self._next = self._next + 1
  end
end

function DDP:_launch(b)
  -- accumulate = k: the k micro-batches' summed gradients become their mean, so a step
  -- equals one on the k-times larger batch
  if self.accumulate > 1 then b.tensor:mul_(1 / self.accumulate) end
  self.comm_counters.dense_bytes = self.comm_counters.dense_bytes + b.numel * b.tensor:element_size()
  flight.set_bucket(b.index)  -- (a hook that raises ends the step; the next launch sets it again)
  local w = self.hook(self.hook_state, b)
  flight.set_bucket(0)
  if w == nil or w.wait == nil then
    fail(4, 'DDP: the communication hook must return a handle with wait() (bucket %d)', b.index)
  end
  b.work, b.launched = w, true
end

---------------------------------------------------------------------------------------------
-- The training step

-- broadcast_buffers: before a training forward that starts a step (not under no_sync, not between accumulated
-- micro-batches, not in evaluate() mode), rank 0's buffers (batch-norm running statistics and counters) replace every
-- rank's, as PyTorch's broadcast_buffers=True: one broadcast per dtype of the buffers packed into one flat tensor
-- (PyTorch's _broadcast_coalesced), none when the model has no buffers.
function DDP:_sync_buffers()
  local plan = self._buffer_plan
  local named = self.module:named_buffers()
  local stale = plan == nil or plan.count ~= #named
  for i = 1, stale and 0 or #named do
    if plan.list[i] ~= named[i].buffer then stale = true break end  -- replaced (module:to(), load_state_dict)
  end
  if #named == 0 then return end
  if stale then
    plan = { count = #named, list = {}, flats = {} }
    local by = {}
    for i, e in ipairs(named) do
      local b = e.buffer
      plan.list[i] = b
      local key = b.dtype .. ' ' .. b.device
      local f = by[key]
      if not f then
        f = { key = key, dtype = b.dtype, device = b.device, numel = 0, parts = {} }
        by[key] = f
        plan.flats[#plan.flats + 1] = f
      end
      f.parts[#f.parts + 1] = { buffer = b, offset = f.numel }
      f.numel = f.numel + b:numel()
    end
    table.sort(plan.flats, function(a, b) return a.key < b.key end)  -- the same order on every rank
    for _, f in ipairs(plan.flats) do
      f.tensor = dlua.empty({ f.numel }, { dtype = f.dtype, device = f.device })
      for _, part in ipairs(f.parts) do  -- views made once: a sync is one copy per buffer and one broadcast per flat
        local n = part.buffer:numel()
        part.flat, part.flat_view = part.buffer:view(n), f.tensor:narrow(1, part.offset + 1, n)
      end
    end
    self._buffer_plan = plan
  end
  local root = (self.group and self.group:rank() or self.rank) == 0
  local works = {}
  for i, f in ipairs(plan.flats) do  -- the broadcasts in flight together, then unpacked
    if root then for _, part in ipairs(f.parts) do part.flat_view:copy_(part.flat) end end
    works[i] = self.dist.broadcast(f.tensor, 0, { group = self.group, async = true })
  end
  for i, f in ipairs(plan.flats) do
    works[i]:wait()
    if not root then for _, part in ipairs(f.parts) do part.flat:copy_(part.flat_view) end end
  end
end

function DDP:forward(x, ...)
  if self._pending then self:wait() end
  if self.broadcast_buffers and self.world > 1 and self.module.training and not self._no_sync
    and self._micro % self.accumulate == 0 and not dist_binding.forbidden() then
    self:_sync_buffers()  -- (the NaN guard's one-rank re-run of this step's forward forbids collectives: it skips it)
  end
  return self.module:forward(x, ...)
end
DDP.__call = function(t, x, ...) return t:forward(x, ...) end

-- Runs the model's backward; buckets start their all-reduce as their last gradient is
-- written. Parameters that got no gradient this step leave their bucket waiting, and it
-- starts at the end with the zeros they hold. Returns without waiting for communication:
-- the optimizer waits per bucket, or call ddp:wait().
function DDP:backward(x, grad, ...)
  if self._pending then self:wait() end
  self._micro = self._micro + 1
  local syncing = self:_syncing()
  if syncing then
    if self._auto then self._auto:tick() end  -- may switch the plan: nothing is in flight here
    self:_reset_step()
  end
  self._in_backward = true
  local ok, r = pcall(self.module.backward, self.module, x, grad, ...)
  self._in_backward = false
  if not ok then error(r, 0) end
  if syncing then
    self:_launch_ready(true)
    self._pending = true
    self.steps_synced = self.steps_synced + 1
  end
  return r
end

-- Seconds spent blocked on bucket communication since construction (ddp.comm_wait_s): the
-- part of the all-reduce that backward did not hide (dlua.metrics reads it).
local now = dlua.perf_counter
local function timed(self, fn, w)
  local t0 = now()
  fn(w)
  self.comm_wait_s = self.comm_wait_s + (now() - t0)
end
local function wait_work(w) w:wait() end
local function progress_work(w) w.progress() end

-- Before waiting for bucket i, a two-stage hook (PowerSGD: w.progress) gets bucket i's and then bucket i+1's second
-- stage started, so i's second collective overlaps i+1's work; every rank waits buckets in one order. The time
-- blocked there (on the first collective) counts as waiting, as it did inside wait().
local function start_next(self, i)
  local w = self.buckets[i].work
  if w and w.progress then timed(self, progress_work, w) end
  local nb = self.buckets[i + 1]
  if nb and nb.work and nb.work.progress then timed(self, progress_work, nb.work) end
end

local function timed_wait(self, w) timed(self, wait_work, w) end

-- Waits for every bucket's communication.
function DDP:wait()
  if not self._pending then return end
  self:_launch_ready(true)
  for i, b in ipairs(self.buckets) do
    if b.work then
      start_next(self, i)
      local w = b.work
      b.work = nil
      timed_wait(self, w)
    end
  end
  self._pending = false
end

-- Waits only for the buckets that overlap [offset, offset + numel) of the dtype's arena
-- (what an optimizer step over that range needs).
function DDP:wait_range(dtype, offset, numel)
  if not self._pending then return end
  for i, b in ipairs(self.buckets) do
    if b.dtype == dtype and b.offset < offset + numel and offset < b.offset + b.numel and b.work then
      start_next(self, i)
      local w = b.work
      b.work = nil
      timed_wait(self, w)
    end
  end
end

-- Splits [offset, offset + numel) at bucket boundaries: the optimizer steps each piece as
-- soon as its bucket is reduced, while later buckets are still in flight.
function DDP:pieces(dtype, offset, numel)
  local r = {}
  local stop = offset + numel
  for _, b in ipairs(self.buckets) do
    if b.dtype == dtype then
      local lo, hi = math.max(offset, b.offset), math.min(stop, b.offset + b.numel)
      if lo < hi then r[#r + 1] = { offset = lo, numel = hi - lo } end
    end
  end
  if #r == 0 then r[1] = { offset = offset, numel = numel } end
  return r
end

-- Runs fn() with gradient synchronisation off: its backwards accumulate locally, and the
-- next backward outside no_sync reduces the sum (PyTorch's no_sync).
-- The wrapped model's input needs no gradient (see Module:input_grad). Returns self.
function DDP:input_grad(flag)
  self.module:input_grad(flag)
  return self
end

function DDP:no_sync(fn)
  local prev = self._no_sync
  self._no_sync = true
  local ok, err = pcall(fn)
  self._no_sync = prev
  self._micro = 0
  if not ok then error(err, 0) end
end

function DDP:zero_grad()
  self:wait()
  self.module:zero_grad()
end

-- Communication hooks: fn(state, bucket) starts the reduction of bucket.tensor (a view of
-- the flat gradients; bucket.index, bucket.names, bucket.dtype) and returns a handle with
-- wait(). state is saved by state_dict().
-- register_comm_hook(h) takes a dlua.dist.compress hook object (its own state).
function DDP:register_comm_hook(state, fn)
  if fn == nil and type(state) == 'table' and type(state.comm_hook) == 'function' then state, fn = nil, state end
  if type(fn) ~= 'function' and not (type(fn) == 'table' and type(fn.comm_hook) == 'function') then
    fail(2, 'DDP:register_comm_hook: expected a function or a dlua.dist.compress hook, got %s', type(fn))
  end
  self:wait()
  self.hook, self.hook_state = M.resolve_hook(fn, state, 'DDP:register_comm_hook')
end

-- What the hook sent: {steps, bytes_per_step (this rank's payload handed to collectives), dense_bytes_per_step
-- (the buckets' size: what the default all-reduce hands over), ratio (dense / sent), compress_s_per_step
-- (seconds in the hook's own work: casts, selection, products; waits for collectives excluded), hook}
-- since construction or the last comm_stats{reset = true}.
function DDP:comm_stats(opts)
  local c = self.comm_counters
  local steps = self.steps_synced - (self._stats_base or 0)
  local per = math.max(steps, 1)
  local r = { steps = steps, bytes_per_step = c.bytes / per, dense_bytes_per_step = c.dense_bytes / per,
    ratio = c.bytes > 0 and c.dense_bytes / c.bytes or 1, compress_s_per_step = c.compress_s / per,
    hook = type(self.hook_state) == 'table' and self.hook_state.spec or (self.hook == M.allreduce_hook and 'allreduce' or 'custom') }
  if opts and opts.reset then
    self:wait()
    c.bytes, c.dense_bytes, c.compress_s = 0, 0, 0
    self._stats_base = self.steps_synced
  end
  return r
end

-- The communication state for a checkpoint: the hook's state (its state_dict() if it has
-- one) and the accumulation counter. ddp:state_dict() is the model's, with the model's keys.
function DDP:comm_state_dict()
  local hs = self.hook_state
  if type(hs) == 'table' and type(hs.state_dict) == 'function' then hs = hs:state_dict() end
  return { hook_state = hs, micro_step = self._micro }
end

function DDP:load_comm_state_dict(sd)
  if sd.hook_state ~= nil then
    local hs = self.hook_state
    if type(hs) == 'table' and type(hs.load_state_dict) == 'function' then hs:load_state_dict(sd.hook_state)
    else self.hook_state = sd.hook_state end
  end
  self._micro = sd.micro_step or 0
end

return M
