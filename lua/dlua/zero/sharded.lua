-- dlua.zero.sharded: ZeRO stages 2 and 3: gradients reduced bucket by bucket during backward into each rank's shard; stage 3 also gathers each module's parameters just before it runs and frees them after.
local dlua = require 'dlua'
local ddp = require 'dlua.ddp'

local M = {}
local S = {}  -- methods put on the ZeRO object
local Z       -- dlua.zero (helpers), set by setup
local format = string.format
local max, min = math.max, math.min

local function pack(...) return { n = select('#', ...), ... } end

---------------------------------------------------------------------------------------------
-- Setup

-- Modules with parameters, in registration (forward) order; a module's own parameters are
-- adjacent in the arena, so its unit is one range per dtype.
local function make_units(z)
  local units, unit_of = {}, {}
  z.module:walk(function(prefix, m)
    if #m._params == 0 then return end
    if rawget(m, '_zero_wrapped') or rawget(m, '_ddp_wrapped') then
      Z.fail(5, 'ZeRO: %s is already wrapped by a DDP or ZeRO model', prefix == '' and 'the model' or prefix)
    end
    local u = { module = m, name = prefix == '' and '(the model)' or prefix, class = m.__name or 'Module', fields = {},
      ranges = {}, dts = {}, state = 'free', buckets = {} }
    for _, f in ipairs(m._params) do
      local p = z._params[prefix == '' and f or (prefix .. '.' .. f)]
      u.fields[#u.fields + 1] = p
      local r = u.ranges[p.dtype]
      if not r then
        r = { lo = p.offset, hi = p.offset + p.numel, n = 0 }
        u.ranges[p.dtype] = r
        u.dts[#u.dts + 1] = p.dtype
      end
      r.lo, r.hi, r.n = min(r.lo, p.offset), max(r.hi, p.offset + p.numel), r.n + p.numel
    end
    table.sort(u.dts)
    for _, dt in ipairs(u.dts) do
      local r = u.ranges[dt]
      if r.hi - r.lo ~= r.n then Z.fail(5, 'ZeRO: the parameters of %s are not adjacent in the flat arena (shared parameters?)', u.name) end
    end
    units[#units + 1] = u
    u.fpos = #units
    unit_of[m] = u
  end)
  z.units, z._unit_of = units, unit_of
  z._bseq = {}
  for i = #units, 1, -1 do
    z._bseq[#z._bseq + 1] = units[i]
    units[i].bpos = #z._bseq
  end
end

local function make_buckets(z)
  local plan = ddp.plan(z.arena.entries, z.first_bucket_mb * 2 ^ 20, z.bucket_mb * 2 ^ 20)
  z.buckets, z._bucket_of = {}, {}
  for i, b in ipairs(plan) do
    local nb = { index = i, dtype = b.dtype, offset = b.offset, numel = b.numel, names = b.names, entries = {},
      params = #b.names, fresh = true }
    for _, n in ipairs(b.names) do
      nb.entries[#nb.entries + 1] = z._params[n]
      z._bucket_of[n] = nb
    end
    z.buckets[i] = nb
  end
  for _, u in ipairs(z.units) do
    local seen = {}
    for _, p in ipairs(u.fields) do
      local b = z._bucket_of[p.name]
      if not seen[b] then
        seen[b] = true
        u.buckets[#u.buckets + 1] = b
      end
    end
  end
  z._next = #z.buckets + 1  -- nothing to launch before the first backward
  z._inflight = {}
end

local function grad_placeholder(z, p) return Z.placeholder(z._placeholders, p.dtype, z.device, p.shape, 'zero') end
local function param_placeholder(z, p) return Z.placeholder(z._placeholders, p.dtype, z.device, p.shape, 'nan') end

local post_backward, post_forward

local function install(z)
  for _, u in ipairs(z.units) do
    local m = u.module
    local ob = m.backward
    m._zero_wrapped = true
    m.backward = function(mod, ...)
      z:_pre_backward(u)
      return post_backward(z, u, ob(mod, ...))
    end
    if z.stage == 3 then
      local of = m.forward
      m.forward = function(mod, ...)
        z:_acquire(u, 'forward')
        return post_forward(z, u, of(mod, ...))
      end
    end
  end
end

function M.setup(z, zero)
  Z = zero
  local slice = Z.slice
  make_units(z)
  make_buckets(z)
  for k, f in pairs(S) do
    if not (z.stage == 2 and (k == 'forward' or k == 'gathered')) then z[k] = f end
  end
  -- Gradients: this rank's shard only, the whole arena goes; modules write into bucket buffers.
  z._G = {}
  for _, dt in ipairs(z.dts) do
    local old = z.arena.grads[dt]
    z._G[dt] = dlua.zeros(z.shards[dt].len, { dtype = dt, device = z.device })
    z.arena.grads[dt] = z._G[dt]  -- Module:zero_grad() zeroes the shard
    for _, en in ipairs(z.arena.entries) do
      if en.dtype == dt then
        local p = z._params[en.name]
        p.module['grad_' .. p.field] = grad_placeholder(z, p)
      end
    end
    old:free()
  end
  -- Stage 3: this rank's shard of the parameters only.
  if z.stage == 3 then
    z._P = {}
    z._phase_n = 0
    for _, dt in ipairs(z.dts) do
      local sh = z.shards[dt]
      local old = z.arena.params[dt]
      z._P[dt] = slice(old, sh.offset, sh.len):clone()
      z.arena.params[dt] = z._P[dt]
      for _, en in ipairs(z.arena.entries) do
        if en.dtype == dt then
          local p = z._params[en.name]
          p.module[p.field] = param_placeholder(z, p)
        end
      end
      old:free()
    end
  end
  install(z)
end

---------------------------------------------------------------------------------------------
-- Gradient buckets: bound to a zeroed buffer when a module of theirs starts backward, reduce-scattered
-- (in plan order) when their last gradient is written, then each rank keeps its slice.

function S._bind(z, b)
  if b.buf then return end
  while #z._inflight >= z.max_inflight do z:_drain(z._inflight[1]) end
  b.buf = dlua.zeros(b.numel, { dtype = b.dtype, device = z.device })
  z:_track(Z.bytes_of(b.buf))
  for _, p in ipairs(b.entries) do
    p.module['grad_' .. p.field] = Z.slice(b.buf, p.offset - b.offset, p.numel):view(p.shape)
  end
end

function S._launch(z, b)
  if not b.buf then z:_bind(b) end
  -- accumulate = k: each micro-batch's gradients count 1/k (their sum in the shard is the mean)
  if z.accumulate > 1 then b.buf:mul_(1 / z.accumulate) end
  -- Reduce-scattered: rank q receives the average of the bucket's part that falls in its shard (the
  -- parts differ in size, some are empty), summed in rank order as DDP's all-reduce, so each element is
  -- what DDP would compute, at half DDP's traffic.
  if z.world > 1 then
    local parts = {}
    for q, r in ipairs(z.shards[b.dtype].ranges) do
      local lo, hi = max(b.offset, r.offset), min(b.offset + b.numel, r.offset + r.numel)
      parts[q] = Z.slice(b.buf, lo < hi and lo - b.offset or 0, lo < hi and hi - lo or 0)
    end
    b.work = z.dist.reduce_scatter(parts[z.rank + 1], parts, 'avg', { async = true, group = z.group })
  end
  b.launched = true
  z._inflight[#z._inflight + 1] = b
end

function S._launch_ready(z, all)
  while z._next <= #z.buckets do
    local b = z.buckets[z._next]
    if b.pending > 0 and not all then break end
    z:_launch(b)
    z._next = z._next + 1
  end
end

-- Waits for bucket b's reduction, keeps this rank's slice of it, frees the buffer.
function S._drain(z, b)
  if b.work then
    local w = b.work
    b.work = nil
    w:wait()
  end
  local sh = z.shards[b.dtype]
  local lo, hi = max(b.offset, sh.offset), min(b.offset + b.numel, sh.offset + sh.len)
  if lo < hi then
    local dst = Z.slice(z._G[b.dtype], lo - sh.offset, hi - lo)
    local src = Z.slice(b.buf, lo - b.offset, hi - lo)
    if b.fresh then dst:copy_(src) else dst:add_(src) end
  end
  b.fresh = false
  for _, p in ipairs(b.entries) do p.module['grad_' .. p.field] = grad_placeholder(z, p) end
  z:_track(-Z.bytes_of(b.buf))
  b.buf:free()
  b.buf = nil
  for i, x in ipairs(z._inflight) do
    if x == b then
      table.remove(z._inflight, i)
      break
    end
  end
end

function S._pre_backward(z, u)
  if not z._in_backward then
    Z.fail(3, "ZeRO: %s (%s) ran backward outside the ZeRO model's backward: call zero:backward(x, grad)", u.name, u.class)
  end
  if u.pass == z._pass then
    Z.fail(3, 'ZeRO: %s (%s) ran backward twice in one step (a module used twice in forward); ZeRO cannot tell when its gradients are final',
      u.name, u.class)
  end
  u.pass = z._pass
  for _, b in ipairs(u.buckets) do z:_bind(b) end
  if z.stage == 3 then z:_acquire(u, 'backward') end
end

post_backward = function(z, u, ...)
  if z.stage == 3 then z:_release(u) end
  for _, p in ipairs(u.fields) do
    local b = z._bucket_of[p.name]
    b.pending = b.pending - 1
  end
  z:_launch_ready()
  return ...
end

-- Runs the model's backward: each bucket is reduce-scattered as its last gradient is written (a
-- parameter without gradient holds its bucket, and those after it, to the end of backward: zeros),
-- and this rank adds its slice to its shard. Every micro-batch is reduced, no_sync or not: keeping
-- unreduced sums would need the whole gradient (docs/zero.md).
function S.backward(z, x, grad, ...)
  z:wait()
  z:_wait_params()
  if z._phase then Z.fail(2, 'ZeRO: backward called inside a forward or backward') end
  z._micro = z._micro + 1
  z._pass = (z._pass or 0) + 1
  for _, b in ipairs(z.buckets) do b.pending, b.launched = b.params, false end
  z._next = 1
  if z.stage == 3 then z:_begin_phase('backward') end
  z._in_backward = true
  local r = pack(pcall(z.module.backward, z.module, x, grad, ...))
  z._in_backward = false
  if z.stage == 3 then
    if r[1] then z:_end_phase() else z:_abort_phase() end
  end
  if not r[1] then error(r[2], 0) end
  z:_launch_ready(true)
  z._pending = true
  z.steps_synced = z.steps_synced + 1
  return unpack(r, 2, r.n)
end

function S.wait(z)
  if not z._pending then return end
  z:_launch_ready(true)
  while #z._inflight > 0 do z:_drain(z._inflight[1]) end
  z._pending = false
end

-- The optimizer's piece [offset, offset + numel) of this rank's shard: its buckets drained.
function S.wait_range(z, dt, offset, numel)
  local s = z.shards[dt].offset + offset
  local i = 1
  while i <= #z._inflight do
    local b = z._inflight[i]
    if b.dtype == dt and b.offset < s + numel and s < b.offset + b.numel then z:_drain(b) else i = i + 1 end
  end
  z:_offload_grads(dt, offset, numel)
end

-- A shard range cut at bucket boundaries, so the optimizer steps each piece as its bucket lands.
function S.pieces(z, dt, offset, numel)
  local s0 = z.shards[dt].offset
  local lo0, hi0 = s0 + offset, s0 + offset + numel
  local r = {}
  for _, b in ipairs(z.buckets) do
    if b.dtype == dt then
      local lo, hi = max(lo0, b.offset), min(hi0, b.offset + b.numel)
      if lo < hi then r[#r + 1] = { offset = lo - s0, numel = hi - lo } end
    end
  end
  if #r == 0 then r[1] = { offset = offset, numel = numel } end
  return r
end

function S._zero_shard_grads(z)
  for _, dt in ipairs(z.dts) do z._G[dt]:zero_() end
  for _, b in ipairs(z.buckets) do b.fresh = true end
end

---------------------------------------------------------------------------------------------
-- Stage 3: parameter gathering. A pass (forward, or backward) walks the modules in a fixed order
-- (registration order forward, the reverse backward) and every rank gathers every module exactly
-- once per pass in that order, whichever modules it runs: a module this rank skips is gathered as
-- the pass goes by it (or at its end) and freed, so ranks that take different branches issue the
-- same collectives and nothing hangs (DeepSpeed #7170).

function S._begin_phase(z, kind)
  z._phase_n = z._phase_n + 1
  z._phase = { kind = kind, seq = kind == 'forward' and z.units or z._bseq, cursor = 0, id = z._phase_n, held = {} }
end

function S._issue(z, u, ph)
  ph.cursor = ph.cursor + 1
  u.phase_id, u.state, u.bufs, u.works = ph.id, 'inflight', {}, {}
  for _, dt in ipairs(u.dts) do
    local r, sh = u.ranges[dt], z.shards[dt]
    local n = r.hi - r.lo
    local buf = dlua.empty(n, { dtype = dt, device = z.device })
    z:_track(Z.bytes_of(buf))
    u.bufs[dt] = buf
    if z.world == 1 then
      buf:copy_(Z.slice(z._P[dt], r.lo, n))
    else
      local outs = {}
      for q = 1, z.world do
        local s = sh.ranges[q]
        local lo = min(max(r.lo, s.offset), r.hi)
        local hi = max(min(r.hi, s.offset + s.numel), lo)
        outs[q] = Z.slice(buf, lo - r.lo, hi - lo)
      end
      local lo = max(r.lo, sh.offset)
      local hi = min(r.hi, sh.offset + sh.len)
      local mine = hi > lo and Z.slice(z._P[dt], lo - sh.offset, hi - lo) or Z.slice(z._P[dt], 0, 0)
      u.works[#u.works + 1] = z.dist.all_gather(outs, mine, { async = true, group = z.gather_group })
    end
  end
  ph.held[#ph.held + 1] = u
end

local function finish_gather(u)
  for i, w in ipairs(u.works) do
    u.works[i] = nil
    w:wait()
  end
end

function S._ready(z, u)
  if u.state == 'ready' then return end
  finish_gather(u)
  for _, p in ipairs(u.fields) do
    p.module[p.field] = Z.slice(u.bufs[p.dtype], p.offset - u.ranges[p.dtype].lo, p.numel):view(p.shape)
  end
  u.state = 'ready'
end

function S._release(z, u)
  if u.state == 'free' then return end
  finish_gather(u)
  for _, p in ipairs(u.fields) do p.module[p.field] = param_placeholder(z, p) end
  for _, dt in ipairs(u.dts) do
    z:_track(-Z.bytes_of(u.bufs[dt]))
    u.bufs[dt]:free()
  end
  u.bufs, u.state = nil, 'free'
end

-- Gathers unit u (and every unit before it in the pass's order not yet gathered, then the next
-- `prefetch` ones) and points its module's parameters at the gathered values.
function S._acquire(z, u, what)
  if z._all_gathered then return end
  local ph = z._phase
  if not ph then
    Z.fail(3, "ZeRO stage 3: %s (%s) ran %s outside the ZeRO model's forward/backward: its parameters are sharded "
      .. '(call zero:forward / zero:backward, or read them inside zero:gathered(fn))', u.name, u.class, what)
  end
  if u.phase_id == ph.id and u.state == 'free' then
    Z.fail(3, 'ZeRO stage 3: %s (%s) ran %s twice in one %s pass (a module used twice): its parameters were freed after '
      .. 'its first use', u.name, u.class, what, ph.kind)
  end
  local p = ph.kind == 'forward' and u.fpos or u.bpos
  local upto = min(#ph.seq, p + z.prefetch)
  while ph.cursor < upto do z:_issue(ph.seq[ph.cursor + 1], ph) end
  z:_ready(u)
end

post_forward = function(z, u, ...)
  local ph = z._phase
  if ph and ph.kind == 'forward' and not z._all_gathered then z:_release(u) end
  return ...
end

-- The rest of the pass's order (modules this rank skipped at the end), then everything still held.
function S._end_phase(z)
  local ph = z._phase
  while ph.cursor < #ph.seq do
    local u = ph.seq[ph.cursor + 1]
    z:_issue(u, ph)
    z:_release(u)
  end
  for _, u in ipairs(ph.held) do z:_release(u) end
  z._phase = nil
end

function S._abort_phase(z)
  for _, u in ipairs(z._phase.held) do pcall(z._release, z, u) end
  z._phase = nil
end

function S.forward(z, x, ...)
  if z._phase then Z.fail(2, 'ZeRO: forward called inside a forward or backward') end
  if z._all_gathered then return z.module:forward(x, ...) end
  z:_begin_phase('forward')
  local r = pack(pcall(z.module.forward, z.module, x, ...))
  if r[1] then z:_end_phase() else z:_abort_phase() end
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

-- Whole parameters of dt gathered into one fresh tensor (collective).
local function gather_all(z)
  local full = {}
  for _, dt in ipairs(z.dts) do full[dt] = z:_gather_full(dt, z._P[dt]) end
  return full
end

-- gathered(fn): runs fn() with every parameter gathered (evaluation, inspection, surgery); changes
-- fn makes to parameters are kept (each rank keeps its shard of them). Collective.
function S.gathered(z, fn)
  if z._phase or z._all_gathered then Z.fail(2, 'ZeRO: gathered() inside a forward, backward or gathered()') end
  z:wait()
  local full = gather_all(z)
  for _, p in pairs(z._params) do p.module[p.field] = Z.slice(full[p.dtype], p.offset, p.numel):view(p.shape) end
  z._all_gathered = true
  local r = pack(pcall(fn))
  z._all_gathered = false
  for _, dt in ipairs(z.dts) do
    local sh = z.shards[dt]
    z._P[dt]:copy_(Z.slice(full[dt], sh.offset, sh.len))
  end
  for _, p in pairs(z._params) do p.module[p.field] = param_placeholder(z, p) end
  for _, t in pairs(full) do t:free() end
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

-- The model's state dict with whole parameters (fresh tensors, gathered) and this rank's buffers,
-- in Module:state_dict's order: what a module without ZeRO would give. Collective.
function S._full_state_dict(z)
  z:wait()
  local full = gather_all(z)
  local sd, order = {}, {}
  for _, e in ipairs(z.module:named_parameters()) do
    local p = z._params[e.name]
    sd[e.name] = Z.slice(full[p.dtype], p.offset, p.numel):view(p.shape)
    order[#order + 1] = e.name
  end
  for _, e in ipairs(z.module:named_buffers()) do
    sd[e.name] = e.buffer
    order[#order + 1] = e.name
  end
  return setmetatable(sd, { __index = { keys = function() return order end } })
end

-- Loads whole parameters (any world size or stage saved them): each rank copies its shard's part.
function S._load_full_state_dict(z, sd, strict)
  if strict == nil then strict = true end
  z:wait()
  local buffers = {}
  for _, e in ipairs(z.module:named_buffers()) do buffers[e.name] = e.buffer end
  local missing, unexpected, misshaped = {}, {}, {}
  local function check(name, shape, numel)
    local v = sd[name]
    if v == nil then
      missing[#missing + 1] = name
    elseif v:numel() ~= numel or table.concat(v:size(), ',') ~= table.concat(shape, ',') then
      misshaped[#misshaped + 1] = format('%s: expected (%s), got (%s)', name, table.concat(shape, ', '), table.concat(v:size(), ', '))
    end
  end
  for name, p in pairs(z._params) do check(name, p.shape, p.numel) end
  for name, b in pairs(buffers) do check(name, b:size(), b:numel()) end
  for name in pairs(sd) do
    if z._params[name] == nil and buffers[name] == nil then unexpected[#unexpected + 1] = name end
  end
  table.sort(missing)
  table.sort(unexpected)
  table.sort(misshaped)
  local problems = {}
  if #misshaped > 0 then problems[#problems + 1] = 'mis-shaped keys: ' .. table.concat(misshaped, '; ') end
  if strict and #missing > 0 then problems[#problems + 1] = 'missing keys: ' .. table.concat(missing, ', ') end
  if strict and #unexpected > 0 then problems[#problems + 1] = 'unexpected keys: ' .. table.concat(unexpected, ', ') end
  if #problems > 0 then Z.fail(3, 'ZeRO.load_state_dict: %s', table.concat(problems, '; ')) end
  for name, p in pairs(z._params) do
    local v = sd[name]
    if v ~= nil then
      local sh = z.shards[p.dtype]
      local lo, hi = max(p.offset, sh.offset), min(p.offset + p.numel, sh.offset + sh.len)
      if lo < hi then
        local flat = v:contiguous():view(v:numel())
        Z.slice(z._P[p.dtype], lo - sh.offset, hi - lo):copy_(Z.slice(flat, lo - p.offset, hi - lo))
      end
    end
  end
  for name, b in pairs(buffers) do
    if sd[name] ~= nil then b:copy_(sd[name]) end
  end
  return { missing = missing, unexpected = unexpected }
end

return M
