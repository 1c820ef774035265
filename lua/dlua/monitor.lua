-- dlua.monitor: a training loop's step boundary: the NaN guard, `dlua attach`'s commands, a restart's log line (docs/launch.md).
local dlua = require 'dlua'
local binding = require 'bindings.monitor'
local dist_binding = require 'bindings.dist'
local spmd = require 'dlua.spmd'

local M = {}
local format = string.format

local Monitor = {}
Monitor.__index = Monitor

local function finite(v) return v == v and v ~= math.huge and v ~= -math.huge end

-- The number of a loss given as a number or a one-element tensor.
local function number_of(loss)
  if type(loss) == 'number' then return loss end
  if dlua.is_tensor(loss) then return loss:item() end
  return nil
end

-- Whether a module's output (a tensor, or a table of them) holds a NaN or an infinity.
local function nonfinite(v, depth)
  depth = depth or 0
  if dlua.is_tensor(v) then return v:is_floating_point() and v:numel() > 0 and v:count_nonfinite():item() > 0 end
  if type(v) == 'table' and depth < 3 then
    for _, x in pairs(v) do
      if nonfinite(x, depth + 1) then return true end
    end
  end
  return false
end

-- The plain model under a DDP/ZeRO wrapper (which forwards to .module).
local function inner(model)
  while type(model) == 'table' and rawget(model, 'module') ~= nil and model.walk == nil do model = model.module end
  return model
end

-- Monitor{model=, optimizer=, schedule=, save=fn, scaler=, nan_check='loss'|'modules'|'off', print=fn, state=}
--   model       the trained model (a DDP/ZeRO wrapper or a module): the NaN guard walks its modules, attach reads it
--   optimizer   set_lr goes through it; schedule(step) gives the learning rate until attach overrides it
--   save        a function that saves a checkpoint (every rank calls it, at the same step: ckpt.save is collective)
--   scaler      a loss scaler (mixed precision): a non-finite loss is then its business, not the guard's
--   nan_check   'loss' (default, or DLUA_NAN_CHECK): a non-finite loss stops the run, naming the step and the first
--               module whose output went non-finite (found by running that forward again with checks on);
--               'modules': every module's output is checked in every forward (slow; finds it as it happens); 'off'
--   state       more values `dlua attach` chunks may read by name (the sampler, the progress table...)
function M.Monitor(opts)
  opts = opts or {}
  local allowed = { model = true, optimizer = true, schedule = true, save = true, scaler = true, nan_check = true, print = true,
    state = true }
  for k in pairs(opts) do
    if not allowed[k] then error(format('Monitor: unknown option %s', tostring(k)), 2) end
  end
  local check = opts.nan_check
  if check == nil or check == '' then check = os.getenv('DLUA_NAN_CHECK') or 'loss' end
  if check == '' or check == '1' then check = 'loss' end
  if check ~= 'loss' and check ~= 'modules' and check ~= 'off' and check ~= '0' then
    error(format("Monitor: nan_check must be 'loss', 'modules' or 'off', got %s", tostring(check)), 2)
  end
  if check == '0' then check = 'off' end
  local self = setmetatable({ model = opts.model, optimizer = opts.optimizer, schedule = opts.schedule, save = opts.save,
    scaler = opts.scaler, nan_check = check, print = opts.print or print, state = opts.state or {}, steps = 0,
    lr_override = nil, stopping = false, attached = binding.available() }, Monitor)
  if check == 'modules' and self.model then self:_hook_modules(true) end
  return self
end

---------------------------------------------------------------------------------------------
-- The NaN guard

-- Wraps (on = true) or unwraps every module's forward with a check of its output. The first module whose
-- forward returns a non-finite value is recorded in self._culprit (then raised, when raise is set).
function Monitor:_hook_modules(raise)
  local root = inner(self.model)
  if type(root) ~= 'table' or root.walk == nil then return false end
  self._culprit = nil
  local hooked = {}
  root:walk(function(path, m)
    local cls_forward = getmetatable(m).forward
    local mon = self
    rawset(m, 'forward', function(mod, x, ...)
      local out = cls_forward(mod, x, ...)
      if mon._culprit == nil and nonfinite(out) then
        local bad = {}
        for _, p in ipairs(mod._params or {}) do
          if dlua.is_tensor(mod[p]) and nonfinite(mod[p]) then bad[#bad + 1] = p end
        end
        mon._culprit = { path = path, name = mod.__name or 'Module', input_bad = nonfinite(x), params = bad }
        if raise then error(mon:_nan_message('output', mon.steps + 1), 0) end
      end
      return out
    end)
    hooked[#hooked + 1] = m
  end)
  self._hooked = hooked
  return true
end

function Monitor:_unhook_modules()
  for _, m in ipairs(self._hooked or {}) do rawset(m, 'forward', nil) end
  self._hooked = nil
end

-- Why the culprit's output went non-finite.
local function why(c)
  if #c.params > 0 then
    return format('its %s hold%s non-finite values', table.concat(c.params, ', '), #c.params == 1 and 's' or '')
  end
  return c.input_bad and 'its input was already non-finite (the data?)' or 'its input and parameters were finite'
end

function Monitor:_nan_message(what, step, value)
  local c = self._culprit
  -- raised inside the module's forward: nn.Module's error names the module ("layer1.0.conv1 (Conv2d) forward: ...")
  if what == 'output' then return format('output went non-finite at step %d: %s', step, why(c)) end
  local head = format('loss is %s at step %d', value ~= value and 'nan' or value > 0 and 'inf' or '-inf', step)
  if not c then return head .. (self._nan_hint or '') end
  local who = c.path == '' and c.name or format('%s (%s)', c.path, c.name)
  return format('%s; the first module whose output went non-finite: %s; %s', head, who, why(c))
end

-- Checks the step's loss (a number or a one-element tensor) before backward, with the step's input: a NaN or an
-- infinity stops the run (an error on this rank, which the launcher reports), unless a loss scaler handles it.
-- Returns the loss as a number.
function Monitor:check_loss(loss, input, ...)
  local v = number_of(loss)
  self.loss = v
  if self.nan_check == 'off' or self.scaler ~= nil or v == nil or finite(v) then return v end
  local step = self.steps + 1
  self._nan_hint = ''
  if self.nan_check ~= 'modules' then
    -- the same forward again, module by module (once: the run ends here), on this rank alone: a forward that talks to
    -- the other ranks (SyncBatchNorm, ZeRO-3's gathers) stops at its first collective, which would not meet theirs
    if input ~= nil and self:_hook_modules(false) then
      local root = inner(self.model)
      dist_binding.forbid('the NaN guard\'s check runs no collective')
      local ok = pcall(root.forward, root, input, ...)
      dist_binding.forbid(nil)
      self:_unhook_modules()
      -- a culprit found before the forward stopped stands: modules run in order
      if not ok and not self._culprit then self._nan_hint = ' (its forward talks to the other ranks, so it was not run again' ..
        ' here; DLUA_NAN_CHECK=modules checks every module in every forward)' end
    end
    if not self._culprit and self._nan_hint == '' and self.model then
      self._nan_hint = ' (DLUA_NAN_CHECK=modules checks every module in every forward)'
    end
  end
  error(self:_nan_message('loss', step, v), 2)  -- at the recipe's line
end

---------------------------------------------------------------------------------------------
-- The learning rate, the step boundary and `dlua attach`

-- The learning rate for step (0-based optimizer steps done): the schedule's, or the one attach set.
function Monitor:lr(step)
  if self.lr_override then return self.lr_override end
  return self.schedule and self.schedule(step) or nil
end

-- What an attach chunk sees by name, besides the globals.
function Monitor:_env()
  local mon = self
  local model = self.model
  local env = {
    loss = self.loss, step = self.steps, model = model, optimizer = self.optimizer, schedule = self.schedule, monitor = self,
    lr = self.optimizer and self.optimizer.lr or self:lr(self.steps),
    scale = self.scaler and self.scaler.get_scale and self.scaler:get_scale() or nil,
    buckets = type(model) == 'table' and model.bucket_plan and model:bucket_plan() or nil,
    set_lr = function(x)
      if type(x) ~= 'number' or not (x >= 0) then error('set_lr: a learning rate >= 0', 2) end
      mon.lr_override = x
      if mon.optimizer then mon.optimizer:set_lr(x) end
      return format('lr %.6g from step %d on', x, mon.steps + 1)
    end,
    checkpoint = function()
      if not mon.save then error('checkpoint: this run saves no checkpoints (no --save)', 2) end
      mon.save()
      return format('checkpoint saved at step %d', mon.steps)
    end,
    stop = function()
      mon.stopping = true
      return format('stopping after step %d', mon.steps)
    end,
  }
  env.dlua, env.dist = dlua, package.loaded['dlua.dist']  -- as in the SPMD REPL
  for k, v in pairs(self.state) do if env[k] == nil then env[k] = v end end
  return setmetatable(env, { __index = _G })
end

-- The step boundary: call it after each optimizer step with the number of steps done (and, optionally, the
-- step's loss). Runs what `dlua attach` sent (a command for every rank runs at the same step on each).
-- Returns true when the run should stop here (attach's :stop).
function Monitor:step(step, loss)
  self.steps = step
  if loss ~= nil then self.loss = loss end
  if self.attached and binding.boundary(step) then
    local code, every, at = binding.command()
    local ok, text = spmd.run_chunk(code or '', self:_env())
    if every and (code or ''):match('^set_lr%(') and ok then
      self.print(format('dlua attach: learning rate %s at step %d', tostring(self.lr_override), at))
    elseif every and ok then
      self.print(format('dlua attach: ran %s at step %d', code, at))
    end
    binding.done(ok, text)
  end
  return self.stopping
end

-- After ckpt.resume in a restarted job (`dlua --nproc N --max-restarts K`): the log line saying where the run
-- continues and how many steps the failure cost. info: ckpt.resume's answer (nil: no checkpoint, a fresh start).
function Monitor:restarted(info, step)
  local n = tonumber(os.getenv('DLUA_RESTART_COUNT') or '0') or 0
  if n <= 0 then return end
  local reached = tonumber(os.getenv('DLUA_RESTART_STEP') or '')
  local from = info and format('resumed from %s at step %d', info.path, step) or 'no checkpoint to resume from: starting again at step 0'
  local lost = reached and format('; %d step%s lost (the failed run had finished step %d)', reached - step,
    reached - step == 1 and '' or 's', reached) or ''
  self.print(format('restart %d of %s: %s%s', n, os.getenv('DLUA_MAX_RESTARTS') or '?', from, lost))
end

-- The resume setting for a recipe: a restarted job resumes from its newest checkpoint ('auto') when it saves any.
function M.resume_option(resume, save)
  local n = tonumber(os.getenv('DLUA_RESTART_COUNT') or '0') or 0
  if n > 0 and resume == '' and save ~= '' then return 'auto' end
  return resume
end

M.set_bucket = binding.set_bucket

return M
