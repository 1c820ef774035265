-- dlua.metrics: per-step training metrics as JSON Lines (loss, lr, img/s, the step's time by phase, memory), epochs, a run summary.
--   local mw = metrics.Writer('run.jsonl', { rank = rank, model = ddp, device = 'cpu', run = { options = opt } })
--   mw:start_epoch(epoch)
--   for ... do  mw:phase('data') ... forward ... mw:phase('forward') ... mw:phase('backward') ... opt:step()
--               mw:phase('optimizer'); mw:step{ step = s, loss = l, lr = lr, images = n }  end
--   mw:epoch{ epoch = e, train_loss = ..., test_accuracy = ... };  mw:close{ test_accuracy = ... }
local dlua = require 'dlua'
local json = require 'dlua.json'

local M = {}
local format = string.format
local now = dlua.perf_counter

-- The phases of a step, in the order the lines give them; time between marks that no phase
-- claims (the loss read back, the schedule) is `other`.
M.phases = { 'data', 'forward', 'backward', 'comm', 'optimizer', 'other' }
local phase_known = {}
for _, p in ipairs(M.phases) do phase_known[p] = true end

-- The fields of a step line, first in this order (the rest sorted after them).
local step_order = { 'kind', 'step', 'epoch', 'loss', 'lr', 'scale', 'skipped', 'images', 'img_s', 'time_s', 'data_s', 'forward_s',
  'backward_s', 'comm_s', 'optimizer_s', 'other_s', 'mem_bytes', 'mem_peak_bytes', 'mem_peak_backward_bytes', 'wall_s' }

local Writer = {}
Writer.__index = Writer

-- A writer that writes nothing: ranks other than 0, or no file given.
local Null = setmetatable({ enabled = false }, { __index = function() return function() end end })

-- metrics.Writer(path, opts): path '' or nil, or a rank other than 0, gives a writer whose methods do
-- nothing. opts: rank (default 0), model (a dist.DDP: its comm_wait_s splits communication wait out
-- of the phase it happened in), device (whose memory is counted; a CUDA device is synchronised at
-- each mark so that phases are device time), run (fields of the first line: options, recipe...),
-- reset_peak (default true: the device's peak counter is reset at each step, so mem_peak_bytes is
-- the step's own peak).
function M.Writer(path, opts)
  opts = opts or {}
  if type(opts) ~= 'table' then error(format('metrics.Writer: expected an options table, got %s', type(opts)), 2) end
  local allowed = { rank = true, model = true, device = true, run = true, reset_peak = true }
  for k in pairs(opts) do
    if not allowed[k] then error(format("metrics.Writer: unknown option '%s' (rank, model, device, run, reset_peak)", tostring(k)), 2) end
  end
  if path == nil or path == '' or (opts.rank or 0) ~= 0 then return Null end
  if type(path) ~= 'string' then error(format('metrics.Writer: expected a file name, got %s', type(path)), 2) end
  if not json.available() then error('metrics.Writer: ' .. select(2, pcall(json.encode, 0)), 2) end
  local f, err = io.open(path, 'w')
  if not f then error(format('metrics.Writer: cannot write %s', err), 2) end
  f:setvbuf('line')  -- a line per step, readable while the run goes on
  local device = opts.device or 'cpu'
  local cuda = type(device) == 'string' and device:sub(1, 4) == 'cuda'
  local self = setmetatable({ enabled = true, path = path, f = f, model = opts.model, device = device, cuda = cuda,
    reset_peak = opts.reset_peak ~= false, t0 = now(), acc = {}, epoch_no = nil, steps = 0, images = 0, seconds = 0,
    totals = {}, peak = 0, first_loss = nil, last_loss = nil, skipped = nil, last_epoch = nil, warm_seconds = 0,
    warm_images = 0 }, Writer)
  local run = { kind = 'run', started = os.date('!%Y-%m-%dT%H:%M:%SZ'), dlua = dlua.version(), threads = dlua.get_num_threads(),
    device = tostring(device) }
  for k, v in pairs(opts.run or {}) do run[k] = v end
  if run.options then  -- a cli.parse result reads strictly: copy its fields
    local o = {}
    for k, v in pairs(run.options) do o[k] = v end
    run.options = o
  end
  self:_write(run, { 'kind', 'recipe', 'label', 'world', 'threads', 'device', 'dlua', 'started' })
  self:_restart()
  return self
end

function Writer:_write(record, order)
  self.f:write(json.encode(record, { order = order }), '\n')
end

function Writer:_comm()
  local m = self.model
  local c = m and m.comm_wait_s
  return type(c) == 'number' and c or nil
end

-- The clock restarts: what happened since (evaluation, checkpoints) is no step's.
function Writer:_restart()
  if self.cuda then dlua.cuda.synchronize() end
  local t = now()
  self.mark, self.step_start, self.comm_mark = t, t, self:_comm()
  self.acc = {}
  if self.reset_peak then dlua.reset_peak_memory_stats(self.device) end
end

-- Starts an epoch (the first step's data wait counts from here).
function Writer:start_epoch(epoch)
  self.epoch_no = epoch
  self:_restart()
end

-- Ends a phase of the current step: the time since the previous mark goes to `name`, less the
-- communication wait DDP counted meanwhile (which goes to comm). Repeated phases (micro-batches of
-- an accumulated step) add up.
function Writer:phase(name)
  if not phase_known[name] then
    error(format("metrics: unknown phase '%s' (%s)", tostring(name), table.concat(M.phases, ', ')), 2)
  end
  if self.cuda then dlua.cuda.synchronize() end
  local t, c = now(), self:_comm()
  local dt = t - self.mark
  if c and self.comm_mark then
    local dc = c - self.comm_mark
    dt = dt - dc
    self.acc.comm = (self.acc.comm or 0) + dc
  end
  self.acc[name] = (self.acc[name] or 0) + dt
  self.mark, self.comm_mark = t, c
  -- the step's peak through its (last) backward: activations at their fullest, before the optimizer's own temporaries
  if name == 'backward' then self.peak_backward = dlua.memory_peak(self.device) end
end

-- Ends a step and writes its line. fields: step, loss, lr, images (this step's, over all ranks:
-- img/s is images / the step's time), scale and skipped (a loss scaler's), and any other numbers
-- or strings to keep with the step.
function Writer:step(fields)
  fields = fields or {}
  self:phase('other')
  local t = self.mark
  local total = t - self.step_start
  local rec = { kind = 'step', epoch = self.epoch_no, time_s = total, wall_s = t - self.t0 }
  for k, v in pairs(fields) do rec[k] = v end
  local images = fields.images
  if type(images) == 'number' and total > 0 then rec.img_s = images / total end
  for _, p in ipairs(M.phases) do
    local v = self.acc[p]
    if v ~= nil then
      rec[p .. '_s'] = v
      self.totals[p] = (self.totals[p] or 0) + v
    end
  end
  local ms = dlua.memory_stats(self.device)
  rec.mem_bytes, rec.mem_peak_bytes, rec.mem_peak_backward_bytes = ms.allocated, ms.peak_allocated, self.peak_backward
  self.peak_backward = nil
  self:_write(rec, step_order)
  self.steps, self.seconds = self.steps + 1, self.seconds + total
  if type(images) == 'number' then
    self.images = self.images + images
    if self.steps > 1 then self.warm_images, self.warm_seconds = self.warm_images + images, self.warm_seconds + total end
  end
  self.peak = math.max(self.peak, ms.peak_allocated)
  if rec.mem_peak_backward_bytes then self.peak_bwd_max = math.max(self.peak_bwd_max or 0, rec.mem_peak_backward_bytes) end
  if type(fields.loss) == 'number' then
    self.first_loss = self.first_loss or fields.loss
    self.last_loss = fields.loss
  end
  if type(fields.skipped) == 'number' then self.skipped = fields.skipped end
  self.step_start = t
  self.acc = {}
  if self.reset_peak then dlua.reset_peak_memory_stats(self.device) end
end

-- An epoch's line: epoch, train_loss, test_accuracy, img_s... as the caller measured them (over all
-- ranks). The next step's clock restarts after it (evaluation is no step's time).
function Writer:epoch(fields)
  local rec = { kind = 'epoch', epoch = self.epoch_no }
  for k, v in pairs(fields or {}) do rec[k] = v end
  self.last_epoch = rec
  self:_write(rec, { 'kind', 'epoch' })
  self:_restart()
end

-- The summary line (steps, images, seconds, img/s overall and after the first step, each phase's
-- mean per step, the largest step peak of memory, first and last loss, the last epoch's fields,
-- then `fields`), and the file closed.
function Writer:close(fields)
  if not self.f then return end
  local rec = { kind = 'summary', steps = self.steps, images = self.images, seconds = self.seconds,
    wall_s = now() - self.t0, mem_peak_bytes = self.peak, mem_peak_backward_bytes = self.peak_bwd_max, first_loss = self.first_loss, loss = self.last_loss,
    skipped = self.skipped }
  if self.seconds > 0 then rec.img_s = self.images / self.seconds end
  if self.warm_seconds > 0 then rec.img_s_after_first = self.warm_images / self.warm_seconds end
  if self.steps > 0 then
    rec.step_s = self.seconds / self.steps
    for p, v in pairs(self.totals) do rec[p .. '_s'] = v / self.steps end
  end
  for k, v in pairs(self.last_epoch or {}) do
    if k ~= 'kind' and k ~= 'img_s' then rec[k] = v end
  end
  for k, v in pairs(fields or {}) do rec[k] = v end
  self:_write(rec, { 'kind', 'steps', 'images', 'seconds', 'img_s', 'img_s_after_first', 'step_s' })
  self.f:close()
  self.f = nil
end

-- metrics.read(path): a metrics file as { run = first line, steps = {...}, epochs = {...}, summary = ... }.
function M.read(path)
  local ok, records = pcall(json.read_lines, path)
  if not ok then error((tostring(records):gsub('^json%.read_lines: ', 'metrics.read: ')), 2) end
  local r = { path = path, steps = {}, epochs = {}, records = records }
  for _, rec in ipairs(records) do
    local kind = type(rec) == 'table' and rec.kind or nil
    if kind == 'run' then r.run = rec
    elseif kind == 'step' then r.steps[#r.steps + 1] = rec
    elseif kind == 'epoch' then r.epochs[#r.epochs + 1] = rec
    elseif kind == 'summary' then r.summary = rec end
  end
  return r
end

return M
