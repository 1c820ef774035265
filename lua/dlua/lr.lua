-- dlua.lr: learning-rate schedules as pure functions of the step (or fractional epoch), composable, plus the linear scaling rule.
local lr = {}
local format, floor, cos, pi, huge = string.format, math.floor, math.cos, math.pi, math.huge

-- Every schedule is a callable object: s(t) is the learning rate after t steps (t = 0 for
-- the first step, as PyTorch's scheduler.last_epoch counts), and t may be fractional (an
-- epoch count such as 2.5). tostring(s) shows its parameters.
local Schedule = {}
Schedule.__index = Schedule
lr.Schedule = Schedule

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

function Schedule.__call(s, t)
  if type(t) ~= 'number' or t ~= t or t < 0 or t == huge then
    fail(2, '%s: the step must be a finite number >= 0, got %s', s.kind, tostring(t))
  end
  return s.f(t)
end

function Schedule.__tostring(s) return s.desc end

function lr.is_schedule(v) return getmetatable(v) == Schedule end

-- Checkpoints (dlua.ckpt): a schedule is a pure function of the step, which the run saves; its
-- state is its description, and loading checks that the run resumes with the same schedule (a
-- different one would move the learning rates of the rest of the run).
function Schedule:state_dict() return { kind = self.kind, desc = self.desc } end
function Schedule:load_state_dict(sd)
  if type(sd) ~= 'table' or sd.desc ~= self.desc then
    fail(2, "%s: the checkpoint's schedule is %s, this run's is %s (leave the schedule out of the load to change it)",
      self.kind, type(sd) == 'table' and tostring(sd.desc) or tostring(sd), self.desc)
  end
end

local function num(v)
  if v == floor(v) and math.abs(v) < 2 ^ 53 then return format('%d', v) end
  return format('%.6g', v)
end

-- Checks an options table against `spec` ({name = {kind, default}}), fills defaults, and
-- rejects unknown names (a typo such as `eta_mn` must not be silently ignored).
local function options(kind, opts, spec, level)
  level = level + 1
  if type(opts) ~= 'table' then fail(level, 'lr.%s: expected an options table, got %s', kind, type(opts)) end
  for k in pairs(opts) do
    if spec[k] == nil and type(k) ~= 'number' then
      local names = {}
      for name in pairs(spec) do names[#names + 1] = name end
      table.sort(names)
      fail(level, "lr.%s: unknown option '%s' (expected %s)", kind, tostring(k), table.concat(names, ', '))
    end
  end
  local o = {}
  for name, sp in pairs(spec) do
    local v = opts[name]
    if v == nil then
      if sp[2] == nil then fail(level, 'lr.%s: option %s is required', kind, name) end
      v = sp[2]
    end
    local what = sp[1]
    local ok = type(v) == 'number' and v == v and v > -huge and v < huge
    if what == 'positive' then ok = ok and v > 0
    elseif what == 'nonneg' then ok = ok and v >= 0
    elseif what == 'fraction' then ok = ok and v > 0 and v < 1
    elseif what == 'count' then ok = ok and v > 0 and v == floor(v)
    elseif what == 'any' then ok = true
    end
    if not ok then
      local expect = ({ positive = 'a positive number', nonneg = 'a number >= 0', fraction = 'a number in (0, 1)',
        count = 'a positive integer', number = 'a finite number' })[what]
      fail(level, 'lr.%s: %s must be %s, got %s', kind, name, expect, tostring(v))
    end
    o[name] = v
  end
  return o
end

local function schedule(kind, desc, f, steps)
  return setmetatable({ kind = kind, desc = desc, f = f, steps = steps }, Schedule)
end

---------------------------------------------------------------------------------------------
-- Schedules

-- constant{lr = x} or constant(x).
function lr.constant(opts)
  if type(opts) == 'number' then opts = { lr = opts } end
  local o = options('constant', opts, { lr = { 'nonneg' } }, 2)
  local v = o.lr
  return schedule('constant', format('constant(lr=%s)', num(v)), function() return v end)
end

-- step{lr, step_size, gamma = 0.1}: lr * gamma^floor(t / step_size) (PyTorch's StepLR).
function lr.step(opts)
  local o = options('step', opts, { lr = { 'nonneg' }, step_size = { 'positive' }, gamma = { 'nonneg', 0.1 } }, 2)
  local base, size, gamma = o.lr, o.step_size, o.gamma
  return schedule('step', format('step(lr=%s, step_size=%s, gamma=%s)', num(base), num(size), num(gamma)),
    function(t) return base * gamma ^ floor(t / size) end)
end

-- multi_step{lr, milestones = {m1, m2, ...}, gamma = 0.1}: lr times gamma once for every
-- milestone <= t (PyTorch's MultiStepLR).
function lr.multi_step(opts)
  local ms = type(opts) == 'table' and opts.milestones or nil
  local o = options('multi_step', opts, { lr = { 'nonneg' }, gamma = { 'nonneg', 0.1 }, milestones = { 'any', {} } }, 2)
  if type(ms) ~= 'table' or #ms == 0 then
    fail(2, 'lr.multi_step: milestones must be a non-empty list of increasing steps, got %s', tostring(ms))
  end
  local m = {}
  for k, v in ipairs(ms) do
    if type(v) ~= 'number' or v < 0 or v ~= v or v == huge or (k > 1 and v <= m[k - 1]) then
      fail(2, 'lr.multi_step: milestones must be increasing numbers >= 0, got %s at position %d', tostring(v), k)
    end
    m[k] = v
  end
  local base, gamma = o.lr, o.gamma
  local parts = {}
  for k, v in ipairs(m) do parts[k] = num(v) end
  return schedule('multi_step',
    format('multi_step(lr=%s, milestones={%s}, gamma=%s)', num(base), table.concat(parts, ', '), num(gamma)),
    function(t)
      local k = 0
      while k < #m and m[k + 1] <= t do k = k + 1 end
      return base * gamma ^ k
    end)
end

-- linear{lr, steps, start_factor = 1/3, end_factor = 1}: lr times a factor that moves
-- linearly from start_factor at t = 0 to end_factor at t = steps, then stays (PyTorch's LinearLR).
function lr.linear(opts, kind)
  kind = kind or 'linear'
  local spec = { lr = { 'nonneg' }, steps = { 'positive' }, start_factor = { 'nonneg', 1 / 3 } }
  if kind == 'linear' then spec.end_factor = { 'nonneg', 1 } end
  local o = options(kind, opts, spec, 2)
  local base, steps, a = o.lr, o.steps, o.start_factor
  local b = o.end_factor or 1
  local desc = format('%s(lr=%s, steps=%s, start_factor=%s', kind, num(base), num(steps), num(a))
  if kind == 'linear' then desc = desc .. format(', end_factor=%s', num(b)) end
  return schedule(kind, desc .. ')', function(t)
    if t >= steps then return base * b end
    return base * (a + (b - a) * t / steps)
  end, steps)
end

-- linear_warmup{lr, steps, start_factor = 1/3}: from lr * start_factor at t = 0 up to lr at
-- t = steps ("Accurate, Large Minibatch SGD" warms up over 5 epochs from the small-batch lr,
-- i.e. start_factor = 1 / k for a k times larger batch). Put it first in lr.sequential.
function lr.linear_warmup(opts) return lr.linear(opts, 'linear_warmup') end

-- cosine{lr, steps, eta_min = 0}: eta_min + (lr - eta_min) (1 + cos(pi t / steps)) / 2 for
-- t <= steps, then eta_min (PyTorch's CosineAnnealingLR for one half period, without restarts).
function lr.cosine(opts)
  local o = options('cosine', opts, { lr = { 'nonneg' }, steps = { 'positive' }, eta_min = { 'nonneg', 0 } }, 2)
  local base, steps, eta_min = o.lr, o.steps, o.eta_min
  return schedule('cosine', format('cosine(lr=%s, steps=%s, eta_min=%s)', num(base), num(steps), num(eta_min)),
    function(t)
      if t >= steps then return eta_min end
      return eta_min + (base - eta_min) * (1 + cos(pi * t / steps)) / 2
    end, steps)
end

-- polynomial{lr, steps, power = 1, eta_min = 0}: eta_min + (lr - eta_min) (1 - t / steps)^power,
-- eta_min after steps (PyTorch's PolynomialLR when eta_min = 0).
function lr.polynomial(opts)
  local o = options('polynomial', opts, { lr = { 'nonneg' }, steps = { 'positive' }, power = { 'nonneg', 1 },
    eta_min = { 'nonneg', 0 } }, 2)
  local base, steps, power, eta_min = o.lr, o.steps, o.power, o.eta_min
  return schedule('polynomial', format('polynomial(lr=%s, steps=%s, power=%s, eta_min=%s)', num(base), num(steps),
    num(power), num(eta_min)), function(t)
    if t >= steps then return eta_min end
    return eta_min + (base - eta_min) * (1 - t / steps) ^ power
  end, steps)
end

-- one_cycle{max_lr, steps, pct_start = 0.3, div_factor = 25, final_div_factor = 1e4,
-- anneal = 'cos' | 'linear', three_phase = false}: PyTorch's OneCycleLR (its learning-rate
-- part): from max_lr / div_factor up to max_lr over the first pct_start of the steps, then
-- down to max_lr / div_factor / final_div_factor at step steps - 1 (three_phase: back to the
-- initial lr first, then down to the minimum). `total_steps` is accepted for `steps`.
function lr.one_cycle(opts)
  if type(opts) == 'table' and opts.total_steps ~= nil then
    if opts.steps ~= nil then fail(2, 'lr.one_cycle: give steps or total_steps, not both') end
    local c = {}
    for k, v in pairs(opts) do c[k] = v end
    c.steps, c.total_steps = c.total_steps, nil
    opts = c
  end
  local anneal = type(opts) == 'table' and opts.anneal or 'cos'
  local three = type(opts) == 'table' and opts.three_phase or false
  if anneal ~= 'cos' and anneal ~= 'linear' then
    fail(2, "lr.one_cycle: anneal must be 'cos' or 'linear', got %s", tostring(anneal))
  end
  if type(three) ~= 'boolean' then fail(2, 'lr.one_cycle: three_phase must be a boolean, got %s', tostring(three)) end
  local o = options('one_cycle', opts, { max_lr = { 'nonneg' }, steps = { 'count' }, pct_start = { 'fraction', 0.3 },
    div_factor = { 'positive', 25 }, final_div_factor = { 'positive', 1e4 }, anneal = { 'any', 'cos' },
    three_phase = { 'any', false } }, 2)
  local total, pct = o.steps, o.pct_start
  local initial = o.max_lr / o.div_factor
  local min_lr = initial / o.final_div_factor
  -- Phase ends as PyTorch computes them (floats; the last phase ends at total - 1).
  local phases
  if three then
    phases = { { pct * total - 1, initial, o.max_lr }, { 2 * pct * total - 2, o.max_lr, initial },
      { total - 1, initial, min_lr } }
  else
    phases = { { pct * total - 1, initial, o.max_lr }, { total - 1, o.max_lr, min_lr } }
  end
  local function interp(a, b, frac)
    if anneal == 'cos' then return b + (a - b) / 2 * (cos(pi * frac) + 1) end
    return (b - a) * frac + a
  end
  local desc = format('one_cycle(max_lr=%s, steps=%s, pct_start=%s, div_factor=%s, final_div_factor=%s, anneal=%s%s)',
    num(o.max_lr), num(total), num(pct), num(o.div_factor), num(o.final_div_factor), anneal,
    three and ', three_phase=true' or '')
  return schedule('one_cycle', desc, function(t)
    local start = 0
    for k, ph in ipairs(phases) do
      local stop = ph[1]
      if t <= stop or k == #phases then
        local frac = stop > start and (t - start) / (stop - start) or 1
        if frac > 1 then frac = 1 end  -- past the last step: stay at the minimum
        return interp(ph[2], ph[3], frac)
      end
      start = stop
    end
  end, total)
end

-- sequential{s1, s2, ..., milestones = {m1, ...}}: s1(t) for t < m1, then s2(t - m1) for
-- m1 <= t < m2, ... (PyTorch's SequentialLR: each schedule restarts its count at its
-- milestone). Without milestones, each schedule but the last runs for its own length
-- (`steps`), e.g. lr.sequential{lr.linear_warmup{lr = 0.4, steps = 500}, lr.cosine{lr = 0.4, steps = 9500}}.
function lr.sequential(opts)
  if type(opts) ~= 'table' then fail(2, 'lr.sequential: expected a list of schedules, got %s', type(opts)) end
  for k in pairs(opts) do
    if type(k) ~= 'number' and k ~= 'milestones' then
      fail(2, "lr.sequential: unknown option '%s' (expected a list of schedules and milestones)", tostring(k))
    end
  end
  local list = {}
  for k, s in ipairs(opts) do
    if not lr.is_schedule(s) then fail(2, 'lr.sequential: item %d is not a schedule (%s)', k, type(s)) end
    list[k] = s
  end
  if #list == 0 then fail(2, 'lr.sequential: expected at least one schedule') end
  local ms = {}
  if opts.milestones ~= nil then
    if type(opts.milestones) ~= 'table' then
      fail(2, 'lr.sequential: milestones must be a list, got %s', type(opts.milestones))
    end
    for k, v in ipairs(opts.milestones) do ms[k] = v end
  else
    local acc = 0
    for k = 1, #list - 1 do
      if not list[k].steps then
        fail(2, 'lr.sequential: give milestones, or schedules with a length: %s (item %d) has none',
          list[k].desc, k)
      end
      acc = acc + list[k].steps
      ms[k] = acc
    end
  end
  if #ms ~= #list - 1 then
    fail(2, 'lr.sequential: %d schedules need %d milestones, got %d', #list, #list - 1, #ms)
  end
  for k, v in ipairs(ms) do
    if type(v) ~= 'number' or v <= 0 or v ~= v or v == huge or (k > 1 and v <= ms[k - 1]) then
      fail(2, 'lr.sequential: milestones must be increasing positive numbers, got %s at position %d', tostring(v), k)
    end
  end
  local parts = { list[1].desc }
  for k = 2, #list do parts[k] = format('from %s: %s', num(ms[k - 1]), list[k].desc) end
  local total = list[#list].steps and (ms[#ms] or 0) + list[#list].steps or nil
  return schedule('sequential', 'sequential(' .. table.concat(parts, ', ') .. ')', function(t)
    local k = 0
    while k < #ms and ms[k + 1] <= t do k = k + 1 end
    if k == 0 then return list[1].f(t) end
    return list[k + 1].f(t - ms[k])
  end, total)
end

-- warmup_cosine{lr, steps, warmup = 0, start_factor = 0.1, eta_min = 0}: linear warmup from
-- lr * start_factor over `warmup` steps (capped to steps - 1, so the peak is reached), then a
-- cosine down to eta_min over the rest: Goyal et al.'s warmup with the cosine decay most
-- ImageNet recipes use. It is lr.sequential{lr.linear_warmup{...}, lr.cosine{...}} (the same
-- description, so checkpoints of runs that wrote the two out by hand resume under it).
function lr.warmup_cosine(opts)
  local o = options('warmup_cosine', opts, { lr = { 'positive' }, steps = { 'count' }, warmup = { 'nonneg', 0 },
    start_factor = { 'positive', 0.1 }, eta_min = { 'nonneg', 0 } }, 2)
  local warm = math.min(math.floor(o.warmup), o.steps - 1)
  local cos_opts = { lr = o.lr, steps = o.steps - math.max(warm, 0) }
  if o.eta_min ~= 0 then cos_opts.eta_min = o.eta_min end
  if warm <= 0 then return lr.cosine(cos_opts) end
  return lr.sequential({ lr.linear_warmup({ lr = o.lr, steps = warm, start_factor = o.start_factor }), lr.cosine(cos_opts) })
end

-- The linear scaling rule ("Accurate, Large Minibatch SGD", Goyal et al. 2017): the lr for a
-- global batch is base_lr * global_batch / reference_batch (reference 256 by default).
function lr.scale(base_lr, global_batch, reference_batch)
  reference_batch = reference_batch or 256
  for _, p in ipairs({ { 'base_lr', base_lr }, { 'global_batch', global_batch }, { 'reference_batch', reference_batch } }) do
    local v = p[2]
    if type(v) ~= 'number' or not (v > 0) or v == huge then
      fail(2, 'lr.scale: %s must be a positive number, got %s', p[1], tostring(v))
    end
  end
  return base_lr * global_batch / reference_batch
end

return lr
