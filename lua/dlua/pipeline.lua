-- dlua.dist.Pipeline: pipeline parallelism over ranks (GPipe and 1F1B micro-batch schedules), DDP across each stage's replicas (docs/pipeline.md).
local dlua = require 'dlua'

local M = {}
local format = string.format
local floor, max, min = math.floor, math.max, math.min

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

local Pipeline = {}
M.Pipeline = Pipeline

---------------------------------------------------------------------------------------------
-- Schedules: the list of operations {kind = 'F'|'B', micro = i} that stage s (1-based) of p runs
-- for n micro-batches. Both send activations and gradients in micro-batch order, so every
-- message has one place in each peer's sequence.
--   gpipe: every forward, then every backward (holds n micro-batches' activations).
--   1f1b:  p - s forwards to fill the pipeline, then one forward and one backward in turn, then
--          the remaining backwards (PipeDream-flush: holds at most p - s + 1 <= p).

function M.schedule(kind, p, s, n)
  local ops = {}
  local function op(k, i) ops[#ops + 1] = { kind = k, micro = i } end
  if kind == 'gpipe' then
    for i = 1, n do op('F', i) end
    for i = 1, n do op('B', i) end
  elseif kind == '1f1b' then
    local warm = min(p - s, n)
    for i = 1, warm do op('F', i) end
    for i = 1, n - warm do
      op('F', warm + i)
      op('B', i)
    end
    for i = n - warm + 1, n do op('B', i) end
  elseif kind == 'forward' then
    for i = 1, n do op('F', i) end
  else
    fail(2, "Pipeline: unknown schedule '%s' (expected 'gpipe' or '1f1b')", tostring(kind))
  end
  return ops
end

-- Micro-batch sizes: a batch of N rows in min(chunks, N) pieces whose sizes differ by at most one,
-- the larger first (torch.tensor_split's), so any chunk count works and the last piece may be smaller.
function M.split_sizes(N, chunks)
  local n = min(chunks, N)
  local sizes, base, extra = {}, floor(N / n), N % n
  for i = 1, n do sizes[i] = base + (i <= extra and 1 or 0) end
  return sizes
end

---------------------------------------------------------------------------------------------
-- The forward state of a stage, one copy per micro-batch in flight. Torch7-style modules keep what
-- backward needs in their own fields (output, saved inputs, batch-norm statistics...); a stage that
-- runs several forwards before their backwards saves those fields after each forward and puts
-- them back before that micro-batch's backward. Parameters, gradients, buffers, children,
-- functions and the training/input-gradient flags are never swapped. Plain tables (a
-- Sequential's list of inputs) are copied one level, so a later forward cannot write into a saved one.

local function is_module(v) return type(v) == 'table' and rawget(v, '_children') ~= nil and rawget(v, '_params') ~= nil end

local fixed_keys = { _params = true, _buffers = true, _children = true, training = true, needs_input_grad = true,
                     _ddp_wrapped = true, _grad_sync = true, _arena = true }

local function state_plan(module)
  local plan = {}
  module:walk(function(_, m)
    local skip = {}
    for _, f in ipairs(m._params) do skip[f] = true; skip['grad_' .. f] = true end
    for _, f in ipairs(m._buffers) do skip[f] = true end
    plan[#plan + 1] = { m = m, skip = skip }
  end)
  return plan
end

local function swappable(e, k, v)
  return not fixed_keys[k] and not e.skip[k] and type(v) ~= 'function' and not is_module(v)
end

local function copy_plain(v)
  if type(v) ~= 'table' or getmetatable(v) ~= nil then return v end
  local c = {}
  for k, x in pairs(v) do c[k] = x end
  return c
end

local function capture(plan)
  local snap = {}
  for i, e in ipairs(plan) do
    local t = {}
    for k, v in pairs(e.m) do
      if swappable(e, k, v) then t[k] = copy_plain(v) end
    end
    snap[i] = t
  end
  return snap
end

local function restore(plan, snap)
  for i, e in ipairs(plan) do
    local m, t = e.m, snap[i]
    local gone = {}
    for k, v in pairs(m) do
      if t[k] == nil and swappable(e, k, v) then gone[#gone + 1] = k end
    end
    for _, k in ipairs(gone) do m[k] = nil end
    for k, v in pairs(t) do m[k] = copy_plain(v) end
  end
end

---------------------------------------------------------------------------------------------
-- Messages. A step starts with a header from each stage to the next: the kind of call, the
-- micro-batch count, the batch size and, once the shapes are known, every activation's shape, so the
-- receiver allocates and posts its receives before the data is sent. A stage learns its output
-- shape for each input shape from the forwards it ran; until it knows them all (the first step,
-- a new batch size) it sends a small shape record before each activation instead. Gradients have
-- the shapes of the activations they answer, so they need no header.

local MAGIC = 0x5049504531  -- "PIPE1"
local KIND = { step = 1, forward = 2 }
local KIND_NAME = { 'step', 'forward' }
local STEP_FIXED = 8
local REC = 12  -- dtype, layout, ndim, up to 9 sizes
local MAX_DIMS = REC - 3
local TAG_STEP, TAG_HEAD, TAG_ACT, TAG_GRAD = 0x70000000, 0x71000000, 0x72000000, 0x73000000
local MAX_CHUNKS = 0x00ffffff

local DTYPES = { 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64', 'uint8', 'bool' }
local DTYPE_CODE = {}
for i, d in ipairs(DTYPES) do DTYPE_CODE[d] = i end

-- How a tensor travels: a contiguous tensor as it is; a channels-last one as its (N, H, W, C) memory,
-- which the receiver views back as (N, C, H, W) channels-last (no copy on either side); anything
-- else through a contiguous copy.
local function wire_form(t)
  if t:is_contiguous() then return t, 0 end
  if t:dim() == 4 and t:is_contiguous('channels_last') then return t:permute(1, 3, 4, 2), 1 end
  return t:contiguous(), 0
end

local function record_of(t)
  local sizes = t:size()
  local layout = 0
  if not t:is_contiguous() and t:dim() == 4 and t:is_contiguous('channels_last') then layout = 1 end
  return { dtype = t.dtype, layout = layout, shape = { unpack(sizes) } }
end

local function rec_key(r) return r.dtype .. '/' .. r.layout .. '/' .. table.concat(r.shape, 'x') end
local function rec_str(r)
  return '(' .. table.concat(r.shape, ', ') .. ') ' .. r.dtype .. (r.layout == 1 and ' channels-last' or '')
end

local function put_rec(buf, at, r)
  buf[at + 1] = DTYPE_CODE[r.dtype]
  buf[at + 2] = r.layout
  buf[at + 3] = #r.shape
  for d = 1, #r.shape do buf[at + 3 + d] = r.shape[d] end
end

local function get_rec(buf, at)
  local dt = DTYPES[buf[at + 1]]
  local nd = buf[at + 3]
  if dt == nil or nd < 0 or nd > MAX_DIMS then return nil end
  local shape = {}
  for d = 1, nd do shape[d] = buf[at + 3 + d] end
  return { dtype = dt, layout = buf[at + 2], shape = shape }
end

-- A receive buffer for record r: the tensor the stage sees and the contiguous one on the wire.
local function alloc(r, device)
  local o = { dtype = r.dtype, device = device }
  if r.layout == 1 then
    local s = r.shape
    local base = dlua.empty({ s[1], s[3], s[4], s[2] }, o)
    return base:permute(1, 4, 2, 3), base
  end
  local t = dlua.empty(r.shape, o)
  return t, t
end

-- A gradient in the layout its activation travelled in (the receiver's buffer has it).
local function grad_wire(g, r)
  if r.layout == 1 then
    if not g:is_contiguous('channels_last') then g = g:contiguous('channels_last') end
    return g:permute(1, 3, 4, 2)
  end
  return g:is_contiguous() and g or g:contiguous()
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

---------------------------------------------------------------------------------------------
-- Construction

local SCHEDULES = { gpipe = 1, ['1f1b'] = 2 }
local links = {}  -- key -> the 2-rank group of a pipeline edge and direction
-- (a group of a job that dist.destroy ended is not reused)
local function alive(g) return (g.pg ~= nil and g.pg.h ~= nil) or (g.nccl ~= nil and g.nccl.h ~= nil) end
local function schedule_name(code)
  for k, v in pairs(SCHEDULES) do if v == code then return k end end
  return tostring(code)
end

-- dist.Pipeline(stages, {chunks = 8, schedule = '1f1b', group = g, data_group = d, loss = criterion,
-- ddp = {...}, data_parallel = fn}): stages[s] runs on rank s - 1 of `group` (the world by
-- default); every rank of the group calls it alike, with the same list.
function M.new(dist, stages, opts)
  opts = opts or {}
  if type(opts) ~= 'table' then fail(3, 'Pipeline: expected an options table, got %s', type(opts)) end
  local allowed = { chunks = true, schedule = true, group = true, data_group = true, loss = true, ddp = true,
                    data_parallel = true }
  for k in pairs(opts) do
    if not allowed[k] then
      fail(3, "Pipeline: unknown option '%s' (expected chunks, schedule, group, data_group, loss, ddp, data_parallel)",
           tostring(k))
    end
  end
  if not dist.is_initialized() then fail(3, 'Pipeline: dlua.dist is not initialised: call dlua.dist.init() first') end
  if type(stages) ~= 'table' or getmetatable(stages) ~= nil or #stages == 0 then
    fail(3, 'Pipeline: expected a list of stage modules (or Pipeline.split(model, n)), got %s',
         is_module(stages) and 'a single module' or type(stages))
  end
  for i, m in ipairs(stages) do
    if not is_module(m) then fail(3, 'Pipeline: stages[%d] is not a dlua.nn module (%s)', i, type(m)) end
  end
  local chunks = opts.chunks or 8
  if type(chunks) ~= 'number' or chunks < 1 or chunks ~= floor(chunks) or chunks > MAX_CHUNKS then
    fail(3, 'Pipeline: chunks must be a whole number >= 1, got %s', tostring(chunks))
  end
  local schedule = opts.schedule or '1f1b'
  if not SCHEDULES[schedule] then
    fail(3, "Pipeline: unknown schedule '%s' (expected 'gpipe' or '1f1b')", tostring(schedule))
  end
  local group = opts.group
  local size, me
  if group ~= nil then
    if type(group) ~= 'table' or type(group.is_member) ~= 'function' then
      fail(3, 'Pipeline: group must come from dist.new_group, got %s', type(group))
    end
    if not group:is_member() then
      fail(3, 'Pipeline: rank %d is not a member of the pipeline group (ranks %s)', dist.rank(),
           table.concat(group.ranks, ','))
    end
    size, me = group:size(), group:rank()
  else
    size, me = dist.world_size(), dist.rank()
  end
  if #stages ~= size then
    fail(3, 'Pipeline: %d stages for a pipeline group of %d ranks (each rank runs one stage; '
         .. 'Pipeline.split(model, %d) cuts a model into as many)', #stages, size, size)
  end
  local loss = opts.loss
  if loss ~= nil and (type(loss) ~= 'table' or type(loss.forward) ~= 'function' or type(loss.backward) ~= 'function') then
    fail(3, 'Pipeline: loss must be a criterion (forward and backward), got %s', type(loss))
  end
  if loss ~= nil and loss.reduction ~= nil and loss.reduction ~= 'mean' and loss.reduction ~= 'sum' then
    fail(3, "Pipeline: the loss must reduce each micro-batch to a number (reduction 'mean' or 'sum'), got '%s'",
         tostring(loss.reduction))
  end

  local s = me + 1
  local module = stages[s]
  local self = { dist = dist, group = group, stages = size, stage = s, chunks = chunks, schedule = schedule,
                 module = module, criterion = loss, rank = dist.rank(), _shape_cache = {}, _steps = 0 }
  self._neighbour = function(d) return group and group:global_rank(d) or d end
  -- the first stage's input is data (no gradient wanted); every other stage sends its input's back
  if s == 1 then module:input_grad(false) else module:input_grad(true) end

  -- every rank of the pipeline agrees on the options (a disagreement would hang or mis-match)
  local mine = dlua.tensor({ chunks, SCHEDULES[schedule], #stages, loss and 1 or 0 }, { dtype = 'int64' })
  local all = dist.all_gather(nil, mine, { group = group })
  local names = { 'chunks', 'schedule', 'the number of stages', 'a loss' }
  for r = 1, #all do
    for k = 1, 4 do
      if all[r][k] ~= all[1][k] then
        local a, b = all[1][k], all[r][k]
        if k == 2 then a, b = schedule_name(a), schedule_name(b) end
        fail(3, 'Pipeline: the ranks of the pipeline disagree on %s: %s on rank %d, %s on rank %d', names[k],
             tostring(a), self._neighbour(0), tostring(b), self._neighbour(r - 1))
      end
    end
  end

  -- the links to the neighbouring stages (see Pipeline:_p2p), made once per pipeline group and
  -- shared by the pipelines made on it (a step finishes all its transfers before the next begins)
  local gid = group and tostring(group.id) or 'world'
  local function link(e, dir)  -- the edge between stages e and e + 1
    local key = format('pipeline/%s/%s%d', gid, dir, e)
    local g = links[key]
    if g == nil or not alive(g) then
      g = dist.new_group_of({ self._neighbour(e - 1), self._neighbour(e) }, key)
      links[key] = g
    end
    return { group = g, peer = 1 - g:rank() }
  end
  if s > 1 then self._fin, self._bout = link(s - 1, 'F'), link(s - 1, 'B') end
  if s < size then self._fout, self._bin = link(s, 'F'), link(s, 'B') end

  -- 2-D: the replicas of this stage (one per pipeline) average their gradients once per step
  local dg = opts.data_group
  if dg ~= nil then
    if type(dg) ~= 'table' or type(dg.is_member) ~= 'function' then
      fail(3, 'Pipeline: data_group must come from dist.new_group, got %s', type(dg))
    end
    if not dg:is_member() then fail(3, 'Pipeline: rank %d is not a member of data_group', dist.rank()) end
    self.data_group = dg
  end
  if dg ~= nil and dg:size() > 1 then
    -- The hook for other data-parallel wrappers (ZeRO): fn(stage_module, data_group) returns an
    -- object with DDP's forward, backward, no_sync and wait.
    local wrap = opts.data_parallel
    if wrap ~= nil then
      if type(wrap) ~= 'function' then fail(3, 'Pipeline: data_parallel must be a function(module, group)') end
      self.ddp = wrap(module, dg)
    else
      local o = {}
      for k, v in pairs(opts.ddp or {}) do o[k] = v end
      o.group = dg
      self.ddp = dist.DDP(module, o)
    end
  elseif opts.ddp ~= nil or opts.data_parallel ~= nil then
    fail(3, 'Pipeline: ddp/data_parallel options need a data_group of more than one rank')
  end
  self._run = self.ddp or module
  self._plan = state_plan(module)
  self.stats = {}
  setmetatable(self, Pipeline)
  self:reset_stats()
  return self
end


-- Fields and methods a Pipeline lacks read through to this rank's stage (its DDP wrapper under
-- 2-D parallelism): optimizers, state_dict, parameters, train/evaluate, zero_grad work on it.
Pipeline.__index = function(t, k)
  local v = rawget(Pipeline, k)
  if v ~= nil then return v end
  local m = rawget(t, '_run')
  local mv = m[k]
  if type(mv) == 'function' then
    return function(s, ...)
      if s == t then return mv(m, ...) end
      return mv(s, ...)
    end
  end
  return mv
end
Pipeline.__tostring = function(t)
  return format('Pipeline(%s, stage %d of %d, %d chunks): %s', t.schedule, t.stage, t.stages, t.chunks,
                tostring(t.module))
end

function Pipeline:is_first() return self.stage == 1 end
function Pipeline:is_last() return self.stage == self.stages end

---------------------------------------------------------------------------------------------
-- One call (a training step or a forward) on this stage

local LOOKAHEAD = 2  -- activation receives posted ahead of the forward that needs them

function Pipeline:_where() return format('Pipeline stage %d of %d (rank %d)', self.stage, self.stages, self.rank) end

-- Point-to-point traffic runs on one 2-rank group per neighbouring pair and direction (links: fin
-- from the previous stage, fout to the next, bin gradients from the next, bout gradients to the
-- previous). A group completes its posted transfers in the order they were posted, so on each link
-- they are posted in the order the peer sends them: what a stage waits for is never queued behind
-- a transfer that completes later.
function Pipeline:_p2p(fn, t, link, tag)
  return fn(t, link.peer, { group = link.group, tag = tag, async = true })
end

-- Waits for a receive or send; a failure names the stage, the micro-batch and the peer.
function Pipeline:_wait(w, what)
  local t0 = dlua.perf_counter()
  local ok, err = pcall(w.wait, w)
  self._cur.wait = self._cur.wait + (dlua.perf_counter() - t0)
  if not ok then error(format('%s: %s: %s', self:_where(), what, tostring(err)), 0) end
end

-- Posts the next receives from the previous stage, in the order it sends: (shape record, then)
-- activation, micro-batch by micro-batch, activations up to LOOKAHEAD beyond the forwards done.
function Pipeline:_progress()
  local c = self._cur
  if self.stage == 1 then return end
  while c.next_post <= c.n do
    local i = c.next_post
    if not c.inrec[i] then  -- mode 0: its shape record first
      if c.head_work[i] == nil then
        c.head_buf[i] = dlua.empty({ REC }, { dtype = 'int64' })
        c.head_work[i] = self:_p2p(self.dist.recv, c.head_buf[i], self._fin, TAG_HEAD + i)
      end
      if not c.head_work[i]:is_completed() then break end
      self:_take_head(i)
    end
    if i > c.forwards + LOOKAHEAD then break end
    c.act_view[i], c.act_buf[i] = alloc(c.inrec[i], self._device)
    c.act_work[i] = self:_p2p(self.dist.recv, c.act_buf[i], self._fin, TAG_ACT + i)
    c.next_post = i + 1
  end
end

function Pipeline:_take_head(i)
  local c = self._cur
  self:_wait(c.head_work[i], format("micro-batch %d's shape from stage %d (rank %d)", i, self.stage - 1,
                                    self._neighbour(self.stage - 2)))
  local r = get_rec(c.head_buf[i], 0)
  if r == nil then error(format('%s: a malformed shape record from stage %d', self:_where(), self.stage - 1), 0) end
  c.inrec[i] = r
  c.head_work[i], c.head_buf[i] = nil, nil
end

-- The activation of micro-batch i from the previous stage (waits for it).
function Pipeline:_input(i)
  local c = self._cur
  self:_progress()
  if c.act_work[i] == nil then  -- its shape record has not come yet (_progress posted its receive)
    self:_take_head(i)
    self:_progress()
  end
  self:_wait(c.act_work[i], format("micro-batch %d's activation %s from stage %d (rank %d)", i, rec_str(c.inrec[i]),
                                   self.stage - 1, self._neighbour(self.stage - 2)))
  c.act_work[i], c.act_buf[i] = nil, nil
  local x = c.act_view[i]
  c.act_view[i] = nil
  return x
end

-- Reads the step header from the previous stage (or makes it from x on the first stage), then
-- sends this stage's own to the next.
function Pipeline:_begin(kind, x, target)
  local p, s = self.stages, self.stage
  if kind == KIND.step and self.criterion == nil then  -- every stage knows: the ranks agreed on it
    fail(3, '%s: step needs a loss on the last stage: dist.Pipeline(stages, {loss = criterion})', self:_where())
  end
  local c = { kind = kind, wait = 0, busy_f = 0, busy_b = 0, forwards = 0, live = 0, peak = 0, next_post = 1,
              inrec = {}, act_work = {}, act_buf = {}, act_view = {}, head_work = {}, head_buf = {},
              grad_work = {}, grad_view = {}, grad_buf = {}, outrec = {}, sends = {}, saved = {} }
  self._cur = c
  local step_len = STEP_FIXED + REC * self.chunks
  if s == 1 then
    if not dlua.is_tensor(x) or x:dim() < 1 or x:size(1) < 1 then
      fail(3, '%s: %s(x, ...) needs the batch as a tensor of at least one row on the first stage, got %s', self:_where(),
           KIND_NAME[kind], dlua.is_tensor(x) and ('shape ' .. tostring(x:size())) or type(x))
    end
    c.N = x:size(1)
    c.sizes = M.split_sizes(c.N, self.chunks)
    c.n = #c.sizes
    c.inputs = {}
    local off = 0
    for i, b in ipairs(c.sizes) do
      c.inputs[i] = x:narrow(1, off + 1, b)
      c.inrec[i] = record_of(c.inputs[i])
      off = off + b
    end
    c.mode = 1
    self._device = self._device or x.device
  else
    local hb = dlua.empty({ step_len }, { dtype = 'int64' })
    local w = self:_p2p(self.dist.recv, hb, self._fin, TAG_STEP)
    self:_wait(w, format('the step header from stage %d (rank %d)', s - 1, self._neighbour(s - 2)))
    if hb[1] ~= MAGIC then error(format('%s: a malformed step header from stage %d', self:_where(), s - 1), 0) end
    if hb[2] ~= kind then
      error(format('%s: this stage called %s but stage %d (rank %d) called %s: every stage of a pipeline makes the same '
                   .. 'calls in the same order', self:_where(), KIND_NAME[kind], s - 1, self._neighbour(s - 2),
                   KIND_NAME[hb[2]] or '?'), 3)  -- the caller's line
    end
    c.n, c.N, c.mode = hb[3], hb[4], hb[5]
    c.sizes = M.split_sizes(c.N, self.chunks)
    if c.mode == 1 then
      for i = 1, c.n do c.inrec[i] = get_rec(hb, STEP_FIXED + REC * (i - 1)) end
    end
    self._device = self._device or self.module:device()
  end
  if s == p and kind == KIND.step then
    if not dlua.is_tensor(target) or target:dim() < 1 or target:size(1) ~= c.N then
      fail(3, '%s: step(x, target) needs the batch\'s %d targets on the last stage, got %s', self:_where(), c.N,
           dlua.is_tensor(target) and ('shape ' .. tostring(target:size())) or type(target))
    end
    c.targets = {}
    local off = 0
    for i, b in ipairs(c.sizes) do
      c.targets[i] = target:narrow(1, off + 1, b)
      off = off + b
    end
  end
  -- this stage's header to the next: the output shapes when every input's shape is known and
  -- maps to a known output shape
  if s < p then
    local hb = dlua.zeros({ step_len }, { dtype = 'int64' })
    hb[1], hb[2], hb[3], hb[4] = MAGIC, kind, c.n, c.N
    local mode = c.mode
    if mode == 1 then
      for i = 1, c.n do
        local r = self._shape_cache[rec_key(c.inrec[i])]
        if r == nil then mode = 0; break end
        c.outrec[i] = r
        put_rec(hb, STEP_FIXED + REC * (i - 1), r)
      end
    end
    if mode == 0 then c.outrec = {} end
    c.out_mode = mode
    hb[5] = mode
    c.sends[#c.sends + 1] = self:_p2p(self.dist.send, hb, self._fout, TAG_STEP)
  end
  self:_progress()
end

-- "train.lua:42: Pipeline stage 2 of 4 (rank 1), forward of micro-batch 3 of 8, input (4, 16) float32 from
-- stage 1: 0 (Linear) forward: expected (N, 7), ...": the caller's line first, as the modules' own errors.
local function annotate(self, phase, i, what, err)
  local head = format('%s, %s of micro-batch %d of %d%s', self:_where(), phase, i, self._cur.n, what)
  local pos, rest = tostring(err):match('^([^\n]-:%d+): (.*)$')
  if pos then return format('%s: %s: %s', pos, head, rest) end
  return format('%s: %s', head, tostring(err))
end

function Pipeline:_forward(i)
  local c = self._cur
  local p, s = self.stages, self.stage
  local x
  if s == 1 then x = c.inputs[i] else x = self:_input(i) end
  local t0 = dlua.perf_counter()
  local ok, out = pcall(self._run.forward, self._run, x)
  if not ok then
    local from = s == 1 and '' or format(', input %s from stage %d', rec_str(c.inrec[i]), s - 1)
    error(annotate(self, 'forward', i, from, out), 0)
  end
  c.forwards = i
  if s < p or c.kind == KIND.forward then
    if not dlua.is_tensor(out) then
      error(annotate(self, 'forward', i, '', format('the stage returned %s; a stage passes one tensor on', type(out))), 0)
    end
  end
  local saved = c.kind == KIND.step and { x = x } or nil
  if s < p then
    local r = record_of(out)
    if #r.shape > MAX_DIMS then
      error(annotate(self, 'forward', i, '', format('an output of %d dimensions (at most %d travel)', #r.shape, MAX_DIMS)), 0)
    end
    if c.out_mode == 1 then
      local want = c.outrec[i]
      if rec_key(r) ~= rec_key(want) then
        error(annotate(self, 'forward', i, '', format('the output is %s, but an earlier step gave %s for the same input %s: '
          .. "a stage's output shape must follow from its input's", rec_str(r), rec_str(want), rec_str(c.inrec[i]))), 0)
      end
    else
      c.outrec[i] = r
      self._shape_cache[rec_key(c.inrec[i])] = r
      local hb = dlua.empty({ REC }, { dtype = 'int64' })
      put_rec(hb, 0, r)
      c.sends[#c.sends + 1] = self:_p2p(self.dist.send, hb, self._fout, TAG_HEAD + i)
    end
    local wire = wire_form(out)
    c.sends[#c.sends + 1] = self:_p2p(self.dist.send, wire, self._fout, TAG_ACT + i)
    if c.kind == KIND.step then  -- its gradient comes back in the same layout
      c.grad_view[i], c.grad_buf[i] = alloc(r, out.device)
      c.grad_work[i] = self:_p2p(self.dist.recv, c.grad_buf[i], self._bin, TAG_GRAD + i)
    end
  elseif c.kind == KIND.step then
    local crit, y = self.criterion, c.targets[i]
    local okl, l = pcall(function()
      local lv = crit:forward(out, y)
      local g = crit:backward(out, y)
      -- the whole batch's mean is the micro-batches' means weighted by their share of it
      local w = (crit.reduction == 'sum') and 1 or c.sizes[i] / c.N
      if w ~= 1 then g:mul_(w) end
      return { lv, g, w }
    end)
    if not okl then error(annotate(self, 'loss', i, format(', output %s', rec_str(record_of(out))), l), 0) end
    local lv = l[1]:double() * l[3]
    c.loss = c.loss and (c.loss + lv) or lv
    saved.grad = l[2]
  else
    c.outputs = c.outputs or {}
    c.outputs[i] = out
  end
  if saved then
    saved.state = capture(self._plan)
    c.saved[i] = saved
    c.live = c.live + 1
    if c.live > c.peak then c.peak = c.live end
  end
  c.busy_f = c.busy_f + (dlua.perf_counter() - t0)
  self:_progress()
end

function Pipeline:_backward(i)
  local c = self._cur
  local s = self.stage
  local saved = c.saved[i]
  local grad = saved.grad
  if grad == nil then
    self:_wait(c.grad_work[i], format("micro-batch %d's gradient from stage %d (rank %d)", i, s + 1,
                                      self._neighbour(s)))
    grad = c.grad_view[i]
    c.grad_work[i], c.grad_view[i], c.grad_buf[i] = nil, nil, nil
  end
  local t0 = dlua.perf_counter()
  restore(self._plan, saved.state)
  local run = self._run
  local ok, gin
  if self.ddp and i < c.n then  -- gradients reduce once per step, after the last micro-batch
    ok, gin = pcall(function()
      local r
      run:no_sync(function() r = run:backward(saved.x, grad) end)
      return r
    end)
  else
    ok, gin = pcall(run.backward, run, saved.x, grad)
  end
  if not ok then error(annotate(self, 'backward', i, '', gin), 0) end
  c.saved[i] = nil
  c.live = c.live - 1
  if s > 1 then
    local want = c.inrec[i]
    if not dlua.is_tensor(gin) then
      error(annotate(self, 'backward', i, '', format('the stage returned no input gradient (%s) for its input %s; '
        .. 'stages after the first must compute it', type(gin), rec_str(want))), 0)
    end
    if not same_shape(gin:size(), want.shape) or gin.dtype ~= want.dtype then
      error(annotate(self, 'backward', i, '', format('the input gradient is (%s) %s but the input was %s',
        table.concat(gin:size(), ', '), gin.dtype, rec_str(want))), 0)
    end
    c.sends[#c.sends + 1] = self:_p2p(self.dist.send, grad_wire(gin, want), self._bout, TAG_GRAD + i)
  end
  c.busy_b = c.busy_b + (dlua.perf_counter() - t0)
  self:_progress()
end

-- Runs the schedule, then waits for the sends.
function Pipeline:_run_ops(kind_name)
  local c = self._cur
  for _, op in ipairs(M.schedule(kind_name, self.stages, self.stage, c.n)) do
    if op.kind == 'F' then self:_forward(op.micro) else self:_backward(op.micro) end
  end
  for k, w in ipairs(c.sends) do
    self:_wait(w, 'a send to a neighbouring stage')
    c.sends[k] = nil
  end
end

-- step(x, target): forward and backward of the batch through every stage, in micro-batches.
-- x is read on the first stage, target on the last (both may be nil elsewhere). Parameter
-- gradients accumulate over the micro-batches, weighted so that they equal one pass over the whole
-- batch (a 'mean' loss's micro-batch means weighted by their share of the rows). Returns the batch's loss
-- (a 0-dim float64 CPU tensor) on every stage of the pipeline.
function Pipeline:step(x, target)
  local t0 = dlua.perf_counter()
  self:_begin(KIND.step, x, target)
  self:_run_ops(self.schedule)
  local c = self._cur
  local loss = dlua.zeros({}, { dtype = 'float64' })
  if self:is_last() then loss:copy_(c.loss:to('cpu')) end
  if self.stages > 1 then self.dist.broadcast(loss, self.stages - 1, { group = self.group }) end
  -- the statistics count training steps only (an evaluation in between leaves them as they were)
  local st = self.stats
  st.steps = st.steps + 1
  st.forward = st.forward + c.busy_f
  st.backward = st.backward + c.busy_b
  st.wait = st.wait + c.wait
  st.micro = c.n
  st.peak_live = max(st.peak_live, c.peak)
  st.last_peak_live = c.peak
  st.wall = st.wall + (dlua.perf_counter() - t0)
  self._steps = self._steps + 1
  self._cur = nil
  return loss
end

-- forward(x): the batch through every stage in micro-batches, no backward (evaluation). Returns
-- the output (the micro-batches' outputs concatenated) on the last stage, nil on the others.
function Pipeline:forward(x)
  self:_begin(KIND.forward, x, nil)
  self:_run_ops('forward')
  local c = self._cur
  self._cur = nil
  self.stats.forward_calls = self.stats.forward_calls + 1
  if self:is_last() then return #c.outputs == 1 and c.outputs[1] or dlua.cat(c.outputs, 1) end
  return nil
end

-- Pipeline.split, Pipeline.partition, Pipeline.groups: lua/dlua/pipeline_split.lua
do
  local split = require 'dlua.pipeline_split'
  M.split, M.partition, M.groups = split.split, split.partition, split.groups
end

---------------------------------------------------------------------------------------------
-- Statistics and the report

function Pipeline:reset_stats()
  self.stats = { steps = 0, forward_calls = 0, forward = 0, backward = 0, wait = 0, wall = 0, peak_live = 0,
                 last_peak_live = 0, micro = 0 }
end

-- The measured bubble of this stage: the share of its step time it spent not computing.
local function bubble_of(busy, wall) return wall > 0 and max(0, 1 - busy / wall) or 0 end

local function ops_text(ops)
  local parts = {}
  for i, op in ipairs(ops) do parts[i] = op.kind .. op.micro end
  return table.concat(parts, ' ')
end

-- report({print = true}): every rank of the pipeline calls it (it gathers each stage's times). Prints,
-- on the pipeline's first rank, the schedule, each stage's forward/backward/wait time per step, its
-- measured bubble and the micro-batches it held at most, and the mean bubble beside the ideal
-- (p - 1)/(m + p - 1). Returns the numbers as a table on every rank.
function Pipeline:report(opts)
  opts = opts or {}
  local st = self.stats
  local steps = max(st.steps, 1)
  local mine = dlua.tensor({ st.forward / steps, st.backward / steps, st.wait / steps, st.wall / steps,
                             st.peak_live, st.steps, st.micro }, { dtype = 'float64' })
  local all = self.dist.all_gather(nil, mine, { group = self.group })
  local p = self.stages
  local m = st.micro
  local r = { schedule = self.schedule, stages = p, micro_batches = m, chunks = self.chunks, steps = st.steps,
              ideal_bubble = m > 0 and (p - 1) / (m + p - 1) or 0, per_stage = {} }
  local sum = 0
  for s = 1, p do
    local a = all[s]
    local busy = a[1] + a[2]
    local e = { stage = s, rank = self._neighbour(s - 1), forward = a[1], backward = a[2], wait = a[3], wall = a[4],
                peak_live = a[5], bubble = bubble_of(busy, a[4]) }
    r.per_stage[s] = e
    sum = sum + e.bubble
  end
  r.bubble = sum / p
  local here = self.group and self.group:rank() or self.dist.rank()
  if opts.print ~= false and here == 0 then
    local lines = {}
    lines[1] = format('Pipeline %s: %d stages x %d micro-batches (chunks %d), %d steps measured', self.schedule, p, m,
                      self.chunks, st.steps)
    for s = 1, p do
      lines[#lines + 1] = format('  stage %d: %s', s, ops_text(M.schedule(self.schedule, p, s, max(m, 1))))
    end
    lines[#lines + 1] = '  stage  rank  forward ms  backward ms  wait ms  step ms  bubble  held (max)'
    for s, e in ipairs(r.per_stage) do
      lines[#lines + 1] = format('  %5d  %4d  %10.2f  %11.2f  %7.2f  %7.2f  %5.1f%%  %d', s, e.rank, e.forward * 1e3,
                                 e.backward * 1e3, e.wait * 1e3, e.wall * 1e3, e.bubble * 100, e.peak_live)
    end
    lines[#lines + 1] = format('  bubble %.1f%% measured (mean over stages), %.1f%% ideal (p - 1)/(m + p - 1)',
                               r.bubble * 100, r.ideal_bubble * 100)
    print(table.concat(lines, '\n'))
  end
  return r
end

return M
