-- DDP's bucket_mb = 'auto': a few bucket plans timed in the first steps of the real run, the fastest kept (docs/ddp.md).
local dlua = require 'dlua'

local M = {}
local format = string.format
local now = dlua.perf_counter

M.default_candidates = { 1, 4, 16, 25, 64, 256 }

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

-- A plan's identity: its bucket boundaries (two caps that cut alike are one candidate).
local function signature(plan)
  local parts = {}
  for i, b in ipairs(plan) do parts[i] = b.dtype .. ':' .. b.offset .. '+' .. b.numel end
  return table.concat(parts, ',')
end

-- The tuner of ddp (a DDP under construction); opts: candidates (bucket sizes in MB), steps (timed
-- steps per candidate, default 3: the fastest counts), warmup (first steps not timed, default 1).
function M.new(ddp, plan_of, opts, level)
  opts = opts or {}
  if type(opts) ~= 'table' then fail(level, 'DDP: auto must be a table {candidates =, steps =, warmup =}') end
  for k in pairs(opts) do
    if k ~= 'candidates' and k ~= 'steps' and k ~= 'warmup' then
      fail(level, "DDP: unknown auto option '%s' (candidates, steps, warmup)", tostring(k))
    end
  end
  local steps, warmup = opts.steps or 3, opts.warmup or 1
  if type(steps) ~= 'number' or steps < 1 or steps ~= math.floor(steps) then fail(level, 'DDP: auto.steps must be a whole number >= 1') end
  if type(warmup) ~= 'number' or warmup < 0 or warmup ~= math.floor(warmup) then fail(level, 'DDP: auto.warmup must be a whole number >= 0') end
  local sizes = opts.candidates or M.default_candidates
  if type(sizes) ~= 'table' or #sizes == 0 then fail(level, 'DDP: auto.candidates must be a non-empty list of bucket sizes in MB') end
  local cands, seen = {}, {}
  for i, mb in ipairs(sizes) do
    if type(mb) ~= 'number' or mb <= 0 then fail(level, 'DDP: auto.candidates[%d] must be a positive number of MB, got %s', i, tostring(mb)) end
    local plan = plan_of(mb)
    local sig = signature(plan)
    if not seen[sig] then
      seen[sig] = true
      cands[#cands + 1] = { bucket_mb = mb, plan = plan, buckets = #plan, periods = {} }
    end
  end
  return setmetatable({ ddp = ddp, cands = cands, steps = steps, warmup = warmup, cur = 1, last_t = nil, done = false,
    first_step = nil }, { __index = M })
end

function M:initial_plan() return self.cands[1].plan end

-- Called at the start of each synchronising backward, when no communication is in flight: the
-- time since the previous one is one step of the plan then in use. Every rank calls it at the same
-- steps, so the one collective (when the candidates are done) and the switches line up.
function M:tick()
  if self.done then return end
  local t = now()
  local ddp = self.ddp
  if self.last_t then
    if self.warmup > 0 then
      self.warmup = self.warmup - 1
    else
      local c = self.cands[self.cur]
      c.periods[#c.periods + 1] = t - self.last_t
      self.first_step = self.first_step or ddp.steps_synced
      if #c.periods >= self.steps then
        if self.cur == #self.cands then return self:_decide() end
        self.cur = self.cur + 1
        ddp:set_buckets(self.cands[self.cur].plan)
      end
    end
  end
  self.last_t = t
end

-- The slowest rank's time of each step counts; each candidate's fastest step is its time.
function M:_decide()
  local ddp = self.ddp
  local flat = {}
  for _, c in ipairs(self.cands) do
    for _, p in ipairs(c.periods) do flat[#flat + 1] = p end
  end
  local t = dlua.tensor(flat, { dtype = 'float64' })
  ddp.dist.all_reduce(t, 'max', { group = ddp.group })
  local k, best = 0, nil
  for i, c in ipairs(self.cands) do
    local m = math.huge
    for _ = 1, #c.periods do
      k = k + 1
      m = math.min(m, t[k])
    end
    c.seconds = m
    if best == nil or m < self.cands[best].seconds then best = i end
  end
  local chosen = self.cands[best]
  self.done = true
  ddp:set_buckets(chosen.plan)
  ddp.bucket_mb = chosen.bucket_mb
  local report = { bucket_mb = chosen.bucket_mb, buckets = chosen.buckets, seconds = chosen.seconds,
    first_step = self.first_step, last_step = ddp.steps_synced, candidates = {} }
  for i, c in ipairs(self.cands) do
    report.candidates[i] = { bucket_mb = c.bucket_mb, buckets = c.buckets, seconds = c.seconds }
  end
  ddp.auto_report = report
  if ddp.rank == (ddp.group and ddp.group:global_rank(0) or 0) then
    io.stdout:write(M.describe(report), '\n')
    io.stdout:flush()
  end
end

-- One line: the plan kept and every candidate's step time.
function M.describe(r)
  local parts = {}
  for i, c in ipairs(r.candidates) do
    parts[i] = format('%g MB (%d bucket%s) %.1f ms', c.bucket_mb, c.buckets, c.buckets == 1 and '' or 's', c.seconds * 1e3)
  end
  return format('DDP bucket_mb=auto: keeping %g MB (%d bucket%s); fastest step of each plan over steps %d-%d: %s',
    r.bucket_mb, r.buckets, r.buckets == 1 and '' or 's', r.first_step, r.last_step, table.concat(parts, ', '))
end

return M
