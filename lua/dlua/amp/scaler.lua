-- dlua.amp.GradScaler: dynamic loss scaling whose step returns what it did ('applied' / 'skipped', why), agreed by every rank.
local dlua = require 'dlua'
local K = require 'bindings.nn'

local format = string.format

return function(amp)
  local GradScaler = {}
  GradScaler.__index = GradScaler

  local defaults = { init_scale = 2 ^ 16, growth_factor = 2, backoff_factor = 0.5, growth_interval = 2000, enabled = true,
    max_skips = 50, group = false }

  local function positive(name, v, lo_open)
    if type(v) ~= 'number' or v ~= v or v == math.huge or (lo_open and v <= 0) then
      error(format('GradScaler: %s must be a finite positive number, got %s', name, tostring(v)), 4)
    end
  end

  -- GradScaler{init_scale = 2^16, growth_factor = 2, backoff_factor = 0.5, growth_interval = 2000,
  -- enabled = true, max_skips = 50, group = nil}: torch.cuda.amp.GradScaler's options, plus
  -- max_skips (that many consecutive skipped steps stop the run with an explanation; 0: never) and
  -- group (the process group that agrees on the verdict; default: the world when dlua.dist is up).
  setmetatable(GradScaler, { __call = function(_, opts)
    opts = opts or {}
    for k in pairs(opts) do
      if defaults[k] == nil then
        local known = {}
        for n in pairs(defaults) do known[#known + 1] = n end
        table.sort(known)
        error(format("GradScaler: unknown option '%s' (expected %s)", tostring(k), table.concat(known, ', ')), 2)
      end
    end
    local self = setmetatable({}, GradScaler)
    for k, v in pairs(defaults) do if opts[k] == nil then self[k] = v else self[k] = opts[k] end end
    positive('init_scale', self.init_scale, true)
    positive('growth_factor', self.growth_factor, true)
    positive('backoff_factor', self.backoff_factor, true)
    if self.growth_factor < 1 then error('GradScaler: growth_factor must be >= 1, got ' .. self.growth_factor, 2) end
    if self.backoff_factor >= 1 then error('GradScaler: backoff_factor must be < 1, got ' .. self.backoff_factor, 2) end
    if type(self.growth_interval) ~= 'number' or self.growth_interval < 1 or self.growth_interval % 1 ~= 0 then
      error('GradScaler: growth_interval must be a positive integer, got ' .. tostring(self.growth_interval), 2)
    end
    if type(self.max_skips) ~= 'number' or self.max_skips < 0 then
      error('GradScaler: max_skips must be a number >= 0 (0: never stop), got ' .. tostring(self.max_skips), 2)
    end
    self.enabled = self.enabled ~= false
    self._scale = self.init_scale
    self._growth_tracker = 0   -- applied steps since the last growth or backoff
    self.skipped = 0            -- skipped steps in all
    self.consecutive = 0        -- skipped steps in a row, up to now
    self.applied = 0
    self._unscaled = nil        -- {optimizer, nonfinite} after unscale_
    return self
  end })

  function GradScaler:get_scale() return self.enabled and self._scale or 1 end
  function GradScaler:is_enabled() return self.enabled end

  -- scale(grad): grad * scale (a tensor or a number), the gradient that starts the backward.
  function GradScaler:scale(g)
    if not self.enabled then return g end
    if type(g) == 'number' then return g * self._scale end
    return g * self._scale
  end

  -- Every gradient range the optimizer steps (this rank's shard under ZeRO), after DDP's buckets.
  local function each_range(opt, fn)
    local sync = opt.model and opt.model._grad_sync
    for dt, ranges in pairs(opt.ranges) do
      local g = opt.arena.grads[dt]
      for _, r in ipairs(ranges) do
        if sync then sync:wait_range(dt, r.offset, r.length) end
        fn(g, r.offset, r.length)
      end
    end
  end

  local function group_of(self)
    local dist = dlua.dist
    if self.group then return self.group end
    if dist.is_initialized() and dist.world_size() > 1 then return true end
    return nil
  end

  -- unscale_(opt): divides the optimizer's gradients by the scale and counts the non-finite ones, in
  -- one fused pass over the arena; every rank then agrees on the count (one tiny all-reduce). Call it
  -- before clipping (as torch's); step() calls it when you did not.
  function GradScaler:unscale_(opt)
    if not self.enabled then return 0 end
    if self._unscaled and self._unscaled.opt == opt then
      error('GradScaler:unscale_: already called for this optimizer since the last step', 2)
    end
    local inv, bad = 1 / self._scale, 0
    each_range(opt, function(g, off, len) bad = bad + K.unscale(g, off, len, inv) end)
    local grp = group_of(self)
    if grp then
      local t = dlua.tensor({ bad }, { dtype = 'float64' })
      dlua.dist.all_reduce(t, 'sum', grp ~= true and { group = grp } or nil)
      bad = t[1]
    end
    self._unscaled = { opt = opt, nonfinite = bad }
    return bad
  end

  -- step(opt [, step_opts]) -> 'applied' | 'skipped', reason. Unscales (unless unscale_ did), and
  -- when any gradient of any rank is Inf/NaN skips the optimizer step on every rank (parameters,
  -- optimizer state and step count untouched) and multiplies the scale by backoff_factor; otherwise
  -- steps, and after growth_interval applied steps in a row multiplies the scale by growth_factor.
  function GradScaler:step(opt, step_opts)
    if type(opt) ~= 'table' or type(opt.step) ~= 'function' then
      error('GradScaler:step(optimizer): expected a dlua.optim optimizer, got ' .. type(opt), 2)
    end
    if not self.enabled then
      opt:step(step_opts)
      self.applied = self.applied + 1
      return 'applied'
    end
    if not (self._unscaled and self._unscaled.opt == opt) then self:unscale_(opt) end
    local bad = self._unscaled.nonfinite
    self._unscaled = nil
    if bad > 0 then
      local old = self._scale
      self._scale = old * self.backoff_factor
      self._growth_tracker = 0
      self.skipped, self.consecutive = self.skipped + 1, self.consecutive + 1
      local reason = format('overflow: scale %s -> %s', amp.fmt_scale(old), amp.fmt_scale(self._scale))
      self.last = { outcome = 'skipped', reason = reason, nonfinite = bad }
      if self.max_skips > 0 and self.consecutive >= self.max_skips then
        error(format('GradScaler: %d steps in a row skipped (non-finite gradients at every scale from %s down to %s; '
          .. '%d non-finite values in the last): the loss or its gradients overflow even unscaled, or training '
          .. 'diverged. Lower the learning rate, check the data and the loss, or train in bf16 (--amp bf16); '
          .. 'max_skips = 0 never stops', self.consecutive, amp.fmt_scale(old / self.backoff_factor ^ (self.consecutive - 1)),
          amp.fmt_scale(old), bad), 2)
      end
      return 'skipped', reason
    end
    opt:step(step_opts)
    self.applied, self.consecutive = self.applied + 1, 0
    self._growth_tracker = self._growth_tracker + 1
    if self._growth_tracker >= self.growth_interval then
      self._scale = self._scale * self.growth_factor
      self._growth_tracker = 0
    end
    self.last = { outcome = 'applied' }
    return 'applied'
  end

  -- update([new_scale]): step() has already moved the scale; update sets it (torch's update(new_scale))
  -- and otherwise does nothing, so torch-shaped loops (step, then update) work unchanged.
  function GradScaler:update(new_scale)
    if new_scale ~= nil then
      positive('new_scale', new_scale, true)
      self._scale = new_scale
    end
  end

  -- A line for the progress output: "scale 32768, 3 skipped".
  function GradScaler:summary()
    if not self.enabled then return 'no loss scaling' end
    return format('scale %s, %d skipped', amp.fmt_scale(self._scale), self.skipped)
  end

  function GradScaler:state_dict()
    return { scale = self._scale, growth_factor = self.growth_factor, backoff_factor = self.backoff_factor,
      growth_interval = self.growth_interval, growth_tracker = self._growth_tracker, skipped = self.skipped,
      consecutive = self.consecutive, applied = self.applied, enabled = self.enabled }
  end

  function GradScaler:load_state_dict(sd)
    if type(sd) ~= 'table' or type(sd.scale) ~= 'number' then
      error('GradScaler:load_state_dict: expected a table from state_dict() with a number scale', 2)
    end
    self._scale = sd.scale
    self.growth_factor = sd.growth_factor or self.growth_factor
    self.backoff_factor = sd.backoff_factor or self.backoff_factor
    self.growth_interval = sd.growth_interval or self.growth_interval
    self._growth_tracker = sd.growth_tracker or 0
    self.skipped, self.consecutive, self.applied = sd.skipped or 0, sd.consecutive or 0, sd.applied or 0
  end

  function GradScaler:__tostring()
    return format('GradScaler(%s, growth x%g every %d steps, backoff x%g)', self:summary(), self.growth_factor,
      self.growth_interval, self.backoff_factor)
  end

  -- 65536 rather than 65536.0; 2^-30 and the like in %g.
  function amp.fmt_scale(s)
    if s == math.floor(s) and math.abs(s) < 2 ^ 53 then return format('%d', s) end
    return format('%g', s)
  end

  return GradScaler
end
