-- dlua.dist.compress: gradient compression as DDP communication hooks: fp16/bf16, top-k with error feedback, PowerSGD (docs/ddp.md).
local dlua = require 'dlua'
local K = require 'bindings.compress'

local M = {}
local format = string.format
local now = dlua.perf_counter

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

-- A hook object is its own state: DDP{hook = compress.topk{...}} (or ddp:register_comm_hook(h)) runs
-- h.comm_hook(h, bucket) for every bucket and saves h:state_dict() with the model's communication state.
local Hook = {}
Hook.__index = Hook
Hook.__tostring = function(h) return 'compress.' .. h.spec end
M.Hook = Hook
function M.is_hook(x) return getmetatable(x) == Hook end

local function world_of(b) return b.group and b.group:size() or b.dist.world_size() end

local function options(op, opts, allowed)
  opts = opts or {}
  if type(opts) ~= 'table' then fail(3, '%s: expected an options table, got %s', op, type(opts)) end
  for k in pairs(opts) do
    if not allowed[k] then fail(3, "%s: unknown option '%s'", op, tostring(k)) end
  end
  return opts
end

local function new_hook(spec, fn, fields)
  local h = setmetatable(fields or {}, Hook)
  h.spec, h.comm_hook, h.step = spec, fn, 0
  h.hook, h.state = fn, h  -- the {hook =, state =} pair the recipe layer (dlua.recipe) hands to DDP
  h._buf = {}  -- scratch per bucket index, sized on first use
  return h
end

-- A scratch tensor for bucket b kept across steps (key names its use).
function Hook:_scratch(b, key, shape, dtype)
  local k = b.index .. '/' .. key
  local t = self._buf[k]
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  if t == nil or t:numel() ~= n or t.dtype ~= dtype or t.device ~= b.tensor.device then
    t = dlua.empty(shape, { dtype = dtype, device = b.tensor.device })
    self._buf[k] = t
  end
  return t
end

-- The step counter: the first bucket of each reduction starts a step.
function Hook:_tick(b)
  if b.index == 1 then self.step = self.step + 1 end
end

local function count(b, bytes, seconds)
  local c = b.counters
  if c then
    c.bytes = c.bytes + bytes
    c.compress_s = c.compress_s + seconds
  end
end

-- Where a bucket's gradient lives: CPU buckets take the fused kernels of host/cpu/compress.c; CUDA buckets the
-- same steps composed of CUDA tensor ops (casts, top-k, gather, scatter-add, products); PowerSGD's small P goes
-- to the host for its Gram-Schmidt.
local function on_cuda(b) return b.tensor.device ~= 'cpu' end

-- The default all-reduce, for buckets a compressor leaves alone (float64, before start_step).
local function dense(b)
  count(b, b.numel * b.tensor:element_size(), 0)
  return b.dist.all_reduce(b.tensor, 'avg', { async = true, group = b.group })
end

-- A handle whose wait() waits for the collective, then runs finish() once.
local function then_do(work, finish)
  local done = false
  return {
    wait = function()
      if done then return end
      done = true
      work:wait()
      finish()
    end,
  }
end

-- Per-dtype tensors the size of the whole gradient arena (residuals, momentum): a bucket's part is a view,
-- so they survive a change of the bucket plan.
function Hook:_arena(b, key)
  self[key] = self[key] or {}
  local t = self[key][b.dtype]
  local n = b.arena_numel or (b.offset + b.numel)
  if t == nil or t:numel() < n then
    local old = t
    t = dlua.zeros({ n }, { dtype = b.dtype, device = b.tensor.device })
    if old ~= nil then t:narrow(1, 1, old:numel()):copy_(old) end
    self[key][b.dtype] = t
  end
  return t:narrow(1, b.offset + 1, b.numel)
end

---------------------------------------------------------------------------------------------
-- fp16 / bf16: divide by the world size, cast, all-reduce the 16-bit sum, cast back (torch's
-- fp16_compress_hook; the division first keeps the sum from overflowing).

local function half_hook(dtype)
  return function(h, b)
    h:_tick(b)
    if b.dtype ~= 'float32' then return dense(b) end
    local t0 = now()
    local buf = h:_scratch(b, 'half', { b.numel }, dtype)
    if on_cuda(b) then buf:copy_(b.tensor * (1 / world_of(b))) else K.to_half(buf, b.tensor, 1 / world_of(b)) end
    local w = b.dist.all_reduce(buf, 'sum', { async = true, group = b.group })
    count(b, b.numel * 2, now() - t0)
    return then_do(w, function()
      local t1 = now()
      if on_cuda(b) then b.tensor:copy_(buf) else K.from_half(b.tensor, buf) end
      count(b, 0, now() - t1)
    end)
  end
end

function M.fp16() return new_hook('fp16', half_hook('float16')) end
function M.bf16() return new_hook('bf16', half_hook('bfloat16')) end

---------------------------------------------------------------------------------------------
-- top-k with error feedback (Lin et al. 2018, Deep Gradient Compression)

-- The density of this step: warm-up goes from warmup_from (DGC's 25%) down to `ratio` exponentially over
-- warmup_steps (DGC: 25%, 6.25%, 1.5625%, 0.4%, then 0.1%).
function Hook:density()
  local w, from = self.warmup_steps, math.max(self.warmup_from or 1, self.ratio)
  if w <= 0 or self.step > w then return self.ratio end
  return from * (self.ratio / from) ^ ((math.max(self.step, 1) - 1) / w)
end

-- The CUDA form of K.topk and K.topk_unpack: the same selection (the k largest |v|, v the residual after adding the
-- gradient, or DGC's momentum), sent entries of v and u set to 0 (v - v), every rank's part scatter-added in rank
-- order, divided by the world size. As on the CPU, one all_gather of 2k 32-bit words per rank: the k values, then
-- the k 1-based indices. dlua has no reinterpreting view of a device tensor (float32 bits as int32), so the
-- indices travel as float32 values, exact up to 2^24 (h.packed_index_limit); a larger bucket (ZeRO-1's whole arena
-- of a big model) sends its int32 indices in a second all_gather instead.
M.PACKED_INDEX_LIMIT = 2 ^ 24
local function topk_cuda(h, b, k, acc, mom, world, t0)
  local g = b.tensor
  local v = g
  if mom then
    mom:mul_(h.momentum):add_(g)
    acc:add_(mom)
    v = acc
  elseif acc then
    acc:add_(g)
    v = acc
  end
  local _, idx = v:topk(k, 1, { by_magnitude = true, sorted = false })
  idx = idx:sort()
  local vals = v:gather(1, idx)
  if acc then acc:scatter_add_(1, idx, -vals) end
  if mom then mom:scatter_add_(1, idx, -mom:gather(1, idx)) end
  local ov, oi = {}, {}
  local work, indices_back
  if b.numel <= (h.packed_index_limit or M.PACKED_INDEX_LIMIT) then
    local packed = h:_scratch(b, 'packed', { 2 * k }, 'float32')
    packed:narrow(1, 1, k):copy_(vals)
    packed:narrow(1, k + 1, k):copy_(idx)  -- exact: every index is an integer <= 2^24
    local gathered = h:_scratch(b, 'gathered', { world, 2 * k }, 'float32')
    local outs = {}
    for r = 1, world do outs[r] = gathered:narrow(1, r, 1):view(2 * k) end
    work = b.dist.all_gather(outs, packed, { async = true, group = b.group })
    local gi = h:_scratch(b, 'gidx', { world, k }, 'int32')
    for r = 1, world do ov[r], oi[r] = outs[r]:narrow(1, 1, k), gi:narrow(1, r, 1):view(k) end
    indices_back = function() gi:copy_(gathered:narrow(2, k + 1, k)) end  -- back to int32 indices, every rank's at once
  else
    local i32 = h:_scratch(b, 'idx32', { k }, 'int32')
    i32:copy_(idx)
    local gv = h:_scratch(b, 'gvals', { world, k }, 'float32')
    local gi = h:_scratch(b, 'gidx', { world, k }, 'int32')
    for r = 1, world do ov[r], oi[r] = gv:narrow(1, r, 1):view(k), gi:narrow(1, r, 1):view(k) end
    local w1 = b.dist.all_gather(ov, vals, { async = true, group = b.group })
    local w2 = b.dist.all_gather(oi, i32, { async = true, group = b.group })
    work = { wait = function() w1:wait(); w2:wait() end }
  end
  count(b, 8 * k, now() - t0)
  return then_do(work, function()
    local t1 = now()
    if indices_back then indices_back() end
    g:zero_()
    for r = 1, world do g:scatter_add_(1, oi[r], ov[r]) end
    g:copy_(g / world)  -- a division, as the CPU kernel and all-reduce's avg
    count(b, 0, now() - t1)
  end)
end

local function topk_hook(h, b)
  h:_tick(b)
  if b.dtype ~= 'float32' then return dense(b) end
  local t0 = now()
  local world = world_of(b)
  local k = math.max(1, math.min(b.numel, math.ceil(h:density() * b.numel)))
  local acc = h.error_feedback and h:_arena(b, 'residual') or nil
  local mom = h.momentum ~= 0 and h:_arena(b, 'momentum_buffer') or nil
  if on_cuda(b) then return topk_cuda(h, b, k, acc, mom, world, t0) end
  local packed = h:_scratch(b, 'packed', { 2 * k }, 'int32')
  K.topk(packed, b.tensor, acc, mom, h.momentum, k)
  local gathered = h:_scratch(b, 'gathered', { world, 2 * k }, 'int32')
  local outs = {}
  for r = 1, world do outs[r] = gathered:narrow(1, r, 1):view(2 * k) end
  local w = b.dist.all_gather(outs, packed, { async = true, group = b.group })
  count(b, 8 * k, now() - t0)
  return then_do(w, function()
    local t1 = now()
    K.topk_unpack(b.tensor, gathered, world, world)
    count(b, 0, now() - t1)
  end)
end

-- compress.topk{ratio = 0.01, error_feedback = true, momentum_correction = false (or the momentum, e.g. 0.9),
-- warmup_steps = 0, warmup_from = 0.25}
function M.topk(opts)
  opts = options('compress.topk', opts,
    { ratio = true, error_feedback = true, momentum_correction = true, warmup_steps = true, warmup_from = true })
  local ratio = opts.ratio or 0.01
  if type(ratio) ~= 'number' or not (ratio > 0 and ratio <= 1) then
    fail(2, 'compress.topk: ratio must be a number in (0, 1], got %s', tostring(ratio))
  end
  local ef = opts.error_feedback
  if ef == nil then ef = true end
  if type(ef) ~= 'boolean' then fail(2, 'compress.topk: error_feedback must be a boolean, got %s', type(ef)) end
  local mc = opts.momentum_correction or false
  if mc == true then mc = 0.9 end
  if mc == false then mc = 0 end
  if type(mc) ~= 'number' or mc < 0 or mc >= 1 then
    fail(2, 'compress.topk: momentum_correction must be false, true (0.9) or a momentum in [0, 1), got %s', tostring(mc))
  end
  if mc ~= 0 and not ef then fail(2, 'compress.topk: momentum_correction needs error_feedback (DGC accumulates the momentum)') end
  local warm = opts.warmup_steps or 0
  if type(warm) ~= 'number' or warm < 0 or warm ~= math.floor(warm) then
    fail(2, 'compress.topk: warmup_steps must be a whole number >= 0, got %s', tostring(warm))
  end
  local from = opts.warmup_from or 0.25
  if type(from) ~= 'number' or not (from > 0 and from <= 1) then
    fail(2, 'compress.topk: warmup_from (the first warm-up step\'s density) must be a number in (0, 1], got %s', tostring(from))
  end
  return new_hook(format('topk:%g', ratio), topk_hook,
    { ratio = ratio, error_feedback = ef, momentum = mc, warmup_steps = warm, warmup_from = from })
end

---------------------------------------------------------------------------------------------
-- PowerSGD (Vogels et al. 2019): per matrix M (the gradient of a parameter viewed as (shape[1], rest)),
-- P = M Q, all-reduce P, orthogonalise P, Q = M^T P, all-reduce Q, M ~ P Q^T / world; the error
-- M - P Q^T / world feeds the next step. Q is warm-started from the last step and identical on every
-- rank (seeded initialisation, deterministic orthogonalisation, all-reduced), so ranks cannot drift.

-- The bucket's matrices and its exactly-reduced rest, cached per bucket placement.
function Hook:_plan(b)
  local key = format('%d/%d/%d/%s', b.index, b.offset, b.numel, b.dtype)
  local plan = self._plans[key]
  if plan then return plan end
  if b.entries == nil then fail(4, 'compress.powersgd: the bucket does not list its parameters (bucket.entries)') end
  plan = { mats = {}, rest = {}, np = 0, nq = 0, nu = 0 }
  for _, en in ipairs(b.entries) do
    local shape = en.shape
    local n = shape[1] or 1
    local m = n > 0 and en.numel / n or 0
    local r = math.min(self.rank, n, m)
    local rate = self.min_compression_rate
    if #shape >= 2 and r >= 1 and (rate == 0 or (n + m) * r * rate < n * m) then
      plan.mats[#plan.mats + 1] = { name = en.name, off = en.offset, numel = en.numel, n = n, m = m, r = r, poff = plan.np, qoff = plan.nq }
      plan.np, plan.nq = plan.np + n * r, plan.nq + m * r
    else
      plan.rest[#plan.rest + 1] = { off = en.offset, numel = en.numel, uoff = plan.nu }
      plan.nu = plan.nu + en.numel
    end
  end
  local o = { dtype = b.dtype, device = b.tensor.device }
  plan.pbuf = dlua.empty({ math.max(plan.np, 1) }, o)
  plan.qbuf = dlua.empty({ math.max(plan.nq, 1) }, o)
  plan.ubuf = dlua.empty({ math.max(plan.nu, 1) }, o)
  for _, mt in ipairs(plan.mats) do
    mt.P = plan.pbuf:narrow(1, mt.poff + 1, mt.n * mt.r):view(mt.n, mt.r)
    mt.Q = plan.qbuf:narrow(1, mt.qoff + 1, mt.m * mt.r):view(mt.m, mt.r)
    local old = self.q[mt.name]  -- restored from a checkpoint, or an earlier plan
    if old ~= nil and old:numel() == mt.Q:numel() then
      mt.Q:copy_(old:view(mt.m, mt.r))
      mt.fresh = false
    else
      mt.fresh = true
    end
    self.q[mt.name] = mt.Q
  end
  self._plans[key] = plan
  return plan
end

-- Orthonormal columns of p in place (K.orthogonalize: Gram-Schmidt in double); a CUDA p (n x rank: small) goes
-- through the host, so every backend gets the same bits from the same p.
local function orthogonalize(p, eps)
  if p.device == 'cpu' then return K.orthogonalize(p, eps) end
  local c = p:to('cpu'):contiguous()
  K.orthogonalize(c, eps)
  p:copy_(c)
end

-- A new Q: the same seeded normal draws on every rank (plans are built in the same order everywhere). The
-- generator's position is part of the hook's state: a resumed run draws what the uninterrupted one would have.
function Hook:_init_q(mt)
  self._gen = self._gen or dlua.Generator(self.seed)
  mt.Q:copy_(dlua.randn({ mt.m, mt.r }, { generator = self._gen }))
  orthogonalize(mt.Q, 0)
end

local function powersgd_hook(h, b)
  h:_tick(b)
  if b.dtype ~= 'float32' or h.step <= h.start_step then return dense(b) end
  local t0 = now()
  local world = world_of(b)
  local plan = h:_plan(b)
  local g = b.tensor
  -- the parameters kept whole: one all-reduce of their packed copy
  for _, u in ipairs(plan.rest) do plan.ubuf:narrow(1, u.uoff + 1, u.numel):copy_(g:narrow(1, u.off + 1, u.numel)) end
  local wu = plan.nu > 0 and b.dist.all_reduce(plan.ubuf, 'avg', { async = true, group = b.group }) or nil
  local e = h.error_feedback and h:_arena(b, 'residual') or nil
  for _, mt in ipairs(plan.mats) do
    local gm = g:narrow(1, mt.off + 1, mt.numel):view(mt.n, mt.m)
    if e then
      mt.M = e:narrow(1, mt.off + 1, mt.numel):view(mt.n, mt.m)
      mt.M:add_(gm)
    else
      mt.M = gm
    end
    mt.G = gm
    if mt.fresh or not h.warm_start then
      h:_init_q(mt)
      mt.fresh = false
    end
    mt.M:mm(mt.Q, { out = mt.P })
  end
  local wp = #plan.mats > 0 and b.dist.all_reduce(plan.pbuf, 'sum', { async = true, group = b.group }) or nil
  count(b, 4 * (plan.np + plan.nq + plan.nu), now() - t0)
  -- Two stages: progress() waits for P, orthogonalises it, forms Q and starts Q's all-reduce; wait() runs progress()
  -- if nobody has, then waits for Q and finishes. DDP calls the next bucket's progress() before it waits for this
  -- one, so Q's all-reduce overlaps the next bucket's products (every rank in the same order).
  local launched, done, wq = false, false, nil
  local spent = 0
  local function progress()
    if launched then return end
    launched = true
    if wu then
      wu:wait()
      for _, u in ipairs(plan.rest) do g:narrow(1, u.off + 1, u.numel):copy_(plan.ubuf:narrow(1, u.uoff + 1, u.numel)) end
    end
    if wp == nil then return end
    wp:wait()
    local t1 = now()
    for _, mt in ipairs(plan.mats) do
      orthogonalize(mt.P, h.eps)
      mt.M:t():mm(mt.P, { out = mt.Q })
    end
    spent = now() - t1
    wq = b.dist.all_reduce(plan.qbuf, 'sum', { async = true, group = b.group })
  end
  return {
    progress = progress,
    wait = function()
      if done then return end
      progress()
      done = true
      if wq == nil then return end
      wq:wait()
      local t2 = now()
      plan.qbuf:mul_(1 / world)
      for _, mt in ipairs(plan.mats) do
        mt.P:mm(mt.Q:t(), { out = mt.G })
        if e then mt.M:sub_(mt.G) end
        mt.M, mt.G = nil, nil
      end
      count(b, 0, spent + now() - t2)
    end,
  }
end

-- compress.powersgd{rank = 2, start_step = 10, warm_start = true, error_feedback = true,
-- min_compression_rate = 2, seed = 0, eps = 0}: a matrix is compressed when (n + m) * rank * min_compression_rate
-- < n * m (torch's rule); 1-D tensors never.
function M.powersgd(opts)
  opts = options('compress.powersgd', opts, { rank = true, start_step = true, warm_start = true, error_feedback = true,
    min_compression_rate = true, seed = true, eps = true })
  local rank = opts.rank or 2
  if type(rank) ~= 'number' or rank < 1 or rank ~= math.floor(rank) then
    fail(2, 'compress.powersgd: rank must be a whole number >= 1, got %s', tostring(rank))
  end
  local start = opts.start_step or 10
  if type(start) ~= 'number' or start < 0 or start ~= math.floor(start) then
    fail(2, 'compress.powersgd: start_step must be a whole number >= 0, got %s', tostring(start))
  end
  local function flag(name)
    local v = opts[name]
    if v == nil then return true end
    if type(v) ~= 'boolean' then fail(3, 'compress.powersgd: %s must be a boolean, got %s', name, type(v)) end
    return v
  end
  local rate = opts.min_compression_rate or 2
  if type(rate) ~= 'number' or rate < 0 then fail(2, 'compress.powersgd: min_compression_rate must be a number >= 0') end
  return new_hook(format('powersgd:%d', rank), powersgd_hook, {
    rank = rank, start_step = start, warm_start = flag('warm_start'), error_feedback = flag('error_feedback'),
    min_compression_rate = rate, seed = opts.seed or 0, eps = opts.eps or 0, q = {}, _plans = {} })
end

---------------------------------------------------------------------------------------------
-- State for checkpoints: step counters, residuals, momentum, Q factors, PowerSGD's generator (per rank:
-- ckpt.comm_state, or ckpt.save of the DDP model).

function Hook:state_dict()
  local sd = { spec = self.spec, step = self.step }
  if self._gen then sd.generator = self._gen:get_state() end  -- {seed, offset}: where the next fresh Q's draws start
  for _, key in ipairs({ 'residual', 'momentum_buffer' }) do
    if self[key] then
      sd[key] = {}
      for dt, t in pairs(self[key]) do sd[key][dt] = t end
    end
  end
  if self.q then
    sd.q = {}
    for name, t in pairs(self.q) do sd.q[name] = t end
  end
  return sd
end

function Hook:load_state_dict(sd)
  if type(sd) ~= 'table' then fail(2, 'compress: load_state_dict expects a table, got %s', type(sd)) end
  if sd.spec ~= nil and sd.spec ~= self.spec then
    fail(2, "compress: the saved state is of hook '%s', this hook is '%s'", tostring(sd.spec), self.spec)
  end
  self.step = sd.step or 0
  -- No saved generator: none had drawn yet (or a checkpoint from before it was saved), so draws start from the seed.
  self._gen = nil
  if sd.generator ~= nil then
    if type(sd.generator) ~= 'table' then fail(2, 'compress: load_state_dict: generator must be a {seed, offset} table, got %s', type(sd.generator)) end
    self._gen = dlua.Generator(self.seed)
    self._gen:set_state(sd.generator)
  end
  for _, key in ipairs({ 'residual', 'momentum_buffer' }) do
    if sd[key] then
      self[key] = {}
      for dt, t in pairs(sd[key]) do self[key][dt] = t:clone() end
    end
  end
  if self.q and sd.q then
    for name, t in pairs(sd.q) do
      local cur = self.q[name]
      if cur ~= nil and cur:numel() == t:numel() then cur:copy_(t:view(cur:size())) else self.q[name] = t:clone() end
    end
  end
end

---------------------------------------------------------------------------------------------
-- Specs, for command lines: 'none' | 'fp16' | 'bf16' | 'topk:RATIO[:noef][:warmup=STEPS][:from=DENSITY][:mc=MOMENTUM]' |
-- 'powersgd:RANK'

function M.from_spec(spec)
  if type(spec) ~= 'string' then fail(2, 'compress.from_spec: expected a string, got %s', type(spec)) end
  local s = spec:lower()
  if s == 'none' or s == '' then return nil end
  if s == 'fp16' then return M.fp16() end
  if s == 'bf16' then return M.bf16() end
  local ratio, rest = s:match('^topk:([^:]+)(.*)$')
  if ratio then
    local r = tonumber(ratio)
    if r == nil or not (r > 0 and r <= 1) then
      fail(2, "compress.from_spec: bad spec '%s': the top-k ratio must be a number in (0, 1], got '%s'", spec, ratio)
    end
    -- options: :noef (no error feedback), :warmup=STEPS (density warm-up), :from=DENSITY (its first step's density),
    -- :mc=MOMENTUM (DGC momentum correction)
    local o = { ratio = r }
    for part in rest:gmatch(':([^:]*)') do
      local k, v = part:match('^(%a+)=(.+)$')
      if part == 'noef' then o.error_feedback = false
      elseif k == 'warmup' and tonumber(v) then o.warmup_steps = tonumber(v)
      elseif k == 'from' and tonumber(v) then o.warmup_from = tonumber(v)
      elseif k == 'mc' and tonumber(v) then o.momentum_correction = tonumber(v)
      else
        fail(2, "compress.from_spec: bad spec '%s': after topk:RATIO come :noef, :warmup=STEPS, :from=DENSITY or :mc=MOMENTUM, not '%s'", spec, part)
      end
    end
    local ok, h = pcall(M.topk, o)
    if not ok then fail(2, "compress.from_spec: bad spec '%s': %s", spec, tostring(h):gsub('^.-compress%.topk: ', '')) end
    return h
  end
  local rank = s:match('^powersgd:(.+)$')
  if rank then
    local r = tonumber(rank)
    if r == nil or r < 1 or r ~= math.floor(r) then
      fail(2, "compress.from_spec: bad spec '%s': the PowerSGD rank must be a whole number >= 1, got '%s'", spec, rank)
    end
    return M.powersgd{ rank = r }
  end
  fail(2, "compress.from_spec: unknown spec '%s' (expected none, fp16, bf16, topk:RATIO or powersgd:RANK)", spec)
end

return M
