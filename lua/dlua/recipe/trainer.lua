-- dlua.recipe.trainer: one training step (forward, backward, reduction, scaler, optimizer, schedule), evaluation and checkpoints, for hand-written loops.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local ckpt = require 'dlua.ckpt'
local monitor = require 'dlua.monitor'
local env = require 'dlua.recipe.env'

local M = {}
local format = string.format

local Trainer = {}
Trainer.__index = Trainer

-- The optimizer from a spec {name = 'sgd' | 'adamw' | 'adam' | 'lars' | 'lamb', lr =, no_decay = true, ...};
-- the other fields go to the optimizer as they are. A function(model) -> optimizer is used as given.
local optimizers = { sgd = optim.SGD, adamw = optim.AdamW, adam = optim.Adam, lars = optim.LARS, lamb = optim.LAMB }
M.optimizers = optimizers
function M.make_optimizer(model, spec)
  if type(spec) == 'function' then return spec(model) end
  local o = {}
  for k, v in pairs(spec) do if k ~= 'name' and k ~= 'no_decay' then o[k] = v end end
  if spec.no_decay ~= false and o.groups == nil then o.groups = optim.no_decay_groups() end
  return optimizers[spec.name or 'sgd'](model, o)
end

-- The optional modules of other issues, loaded when present: nil and the reason when not.
function M.optional(name, issue)
  local m = require('dlua.recipe.validate').module(name)
  if m then return m end
  return nil, format('%s: not yet available (issue #%d)', name, issue)
end

-- Wraps `net` for the parallel spec (already validated): DDP, ZeRO-k or a pipeline of DDP/ZeRO-1 replicas.
local function wrap(self, net, p, c)
  local dist = dlua.dist
  local zero = p.zero or 0
  if p.pipeline then
    local pp, layout = p.pipeline, self.layout
    local by = pp.split or 'time'
    local costs
    if by == 'time' then  -- each piece's forward + backward time on a micro-batch, averaged over the ranks
      local micro = math.max(1, math.floor(c.batch / pp.chunks))
      local shape = { micro }
      for _, d in ipairs(pp.input) do shape[#shape + 1] = d end
      local sample = dlua.randn(shape, { device = self.device })
      if c.channels_last then sample = sample:contiguous('channels_last') end
      local _, info = dist.Pipeline.split(net, pp.stages, { input = sample, repeats = 1 })
      local t = dlua.tensor(info.costs, { dtype = 'float64' })
      dist.all_reduce(t, 'avg')
      costs = {}
      for i = 1, t:numel() do costs[i] = t[i] end
    end
    local stages
    stages, self.split_info = dist.Pipeline.split(net, pp.stages, { costs = costs, by = by })
    local zero1
    if zero == 1 and layout.data then
      zero1 = function(m, grp) return dist.ZeRO(m, { stage = 1, group = grp, offload = p.offload, bucket_mb = p.bucket_mb }) end
    end
    return dist.Pipeline(stages, { chunks = pp.chunks, schedule = pp.schedule or '1f1b', group = layout.pipe,
      data_group = layout.data, loss = self.criterion, data_parallel = zero1,
      ddp = layout.data and not zero1 and { bucket_mb = p.bucket_mb } or nil })
  end
  local hook, hook_state
  if p.compress and p.compress ~= 'none' then
    -- #22's API: dlua.dist.compress.from_spec(spec) -> a DDP hook (a function, or {hook =, state =}) or nil
    local compress = assert(M.optional('dlua.dist.compress', 22))
    local h = compress.from_spec(p.compress)
    if type(h) == 'table' then hook, hook_state = h.hook, h.state else hook = h end
  end
  if zero > 0 then
    return dist.ZeRO(net, { stage = zero, offload = p.offload, accumulate = c.accumulate, bucket_mb = p.bucket_mb,
      hook = hook, hook_state = hook_state })  -- (a hook only with stage 1: validate refuses 2 and 3)
  end
  if not p.ddp then return net end
  return dist.DDP(net, { accumulate = c.accumulate, bucket_mb = p.bucket_mb, hook = hook, hook_state = hook_state })
end

-- trainer{model =, loss =, optim =, schedule =, accumulate = 1, parallel = {ddp = true | {bucket_mb =},
-- zero = 0, offload = false, compress = 'none', pipeline = {stages =, chunks =, schedule =, split =, input =},
-- sync_bn = false}, amp = 'off', clip_grad = 0, activation_checkpoint = 'none', checkpoint = {dir =, keep =,
-- async =}, nan_check =, sampler =, device =, batch =, channels_last =, options =, log =}
-- `model` is the plain module, built on the CPU; the trainer checkpoints its activations as asked,
-- moves it to this rank's device, wraps it (DDP under several ranks, ZeRO, a pipeline), and builds the
-- optimizer on the wrapper. See docs/recipes.md. t:step(x, y) returns the micro-batch's loss (a 0-d
-- tensor on the device: reading it syncs) and the outcome: 'accumulated', 'stepped' or 'skipped' (the
-- scaler found an overflow; the schedule does not count it) and, when skipped, the scaler's reason.
function M.trainer(c)
  local e = c.env or env.setup({ device = c.device })
  local self = setmetatable({ env = e, device = e.device, accumulate = c.accumulate or 1, clip_grad = c.clip_grad or 0,
    micro = 0, progress = { step = 0, images = 0 }, sampler = c.sampler, log = c.log, mw = c.metrics }, Trainer)
  local p = c.parallel or {}
  if p.ddp == nil then p.ddp = e.world > 1 or (p.compress ~= nil and p.compress ~= 'none') end  -- a compressor is a DDP hook
  if type(p.ddp) == 'table' then p.bucket_mb = p.bucket_mb or p.ddp.bucket_mb end
  if type(p.zero) == 'table' then p.offload, p.zero = p.zero.offload, p.zero.stage end
  self.parallel = p
  self.layout = c.layout
  if p.pipeline and not self.layout then self.layout = dlua.dist.Pipeline.groups(p.pipeline.stages) end
  self.replicas = self.layout and self.layout.replicas or e.world
  self.replica = self.layout and self.layout.replica - 1 or e.rank
  self.criterion = c.loss or nn.CrossEntropyLoss()
  local net = c.model
  self.net = net
  if p.sync_bn and not (p.pipeline and self.layout.data == nil) then
    nn.SyncBatchNorm.convert(net, p.pipeline and { group = self.layout.data } or nil)
  end
  self.activation_plan = net:checkpoint(c.activation_checkpoint or 'none')  -- before a pipeline split: stages hold the wrappers
  net:to(self.device)
  self.model = wrap(self, net, p, c)
  self.optimizer = M.make_optimizer(self.model, c.optim or { name = 'sgd', lr = 0.1 })
  self.schedule = c.schedule
  -- mixed precision: #20's API, dlua.amp.from_spec(spec) -> {dtype =, scaler =}
  local amp = c.amp
  if amp == 'auto' then amp = require('dlua.recipe.validate').resolve_amp({ amp = amp, stages = p.pipeline and 1 or 0 }, self.device) end
  if amp and amp ~= 'off' then
    self.amp = assert(M.optional('dlua.amp', 20))
    local a = self.amp.from_spec(amp)
    self.amp_dtype, self.scaler = a.dtype, a.scaler
  end
  self.ckpt = c.checkpoint or {}
  self.state = { model = self.model, optimizer = self.optimizer, schedule = self.schedule, sampler = self.sampler,
    rng = dlua.default_generator(), progress = self.progress, comm = not p.pipeline and self.model ~= net and ckpt.comm_state(self.model) or nil,
    options = c.options, scaler = self.scaler }  -- the loss scale and its counters resume too
  local print_fn = self.log and function(...) self.log:print('%s', table.concat({ ... }, '\t')) end or nil
  self.monitor = monitor.Monitor({ model = self.model, optimizer = self.optimizer, schedule = self.schedule,
    save = self.ckpt.dir and function() self:save() end or nil, scaler = self.scaler, nan_check = c.nan_check,
    print = print_fn, state = { progress = self.progress, sampler = self.sampler, net = net, opt = c.options } })
  self.optimizer:zero_grad()
  return self
end

local function phase(self, name) if self.mw then self.mw:phase(name) end end

-- Forward and backward of one micro-batch; every `accumulate` micro-batches the optimizer step (the
-- gradients reduced, clipped, unscaled, the learning rate the schedule's for the steps applied so far).
function Trainer:step(x, y)
  x, y = x:to(self.device), y:to(self.device)  -- no-ops when the loader put them there
  phase(self, 'data')
  local loss
  if self.parallel.pipeline then
    -- the micro-batches through the stages: x is read on the first stage, y on the last; the loss comes back everywhere
    loss = self.model:step(x, y):to(self.device)
    phase(self, 'other')
  else
    local out
    if self.amp then
      out, loss = self.amp.autocast(self.amp_dtype, function()
        local o = self.model:forward(x)
        return o, self.criterion:forward(o, y)
      end)
    else
      out = self.model:forward(x)
      loss = self.criterion:forward(out, y)
    end
    self.last_loss = self.monitor:check_loss(loss, x)  -- one device sync per micro-batch on a GPU
    phase(self, 'forward')
    local g = self.criterion:backward(out, y)
    if self.scaler then g = self.scaler:scale(g) end
    self.model:backward(x, g)
    phase(self, 'backward')
  end
  if self.sampler then self.sampler:advance(y:numel()) end
  self.progress.images = self.progress.images + y:numel() * self.replicas
  self.micro = self.micro + 1
  if self.micro % self.accumulate ~= 0 then return loss, 'accumulated' end
  return loss, self:_apply()
end

function Trainer:_apply()
  local p = self.parallel
  if self.clip_grad > 0 then  -- after the reduction; under ZeRO over every rank's shard; a pipeline sums its stages' pieces
    if self.scaler then self.scaler:unscale_(self.optimizer) end  -- clip the true gradients (step then skips its unscale)
    if (p.zero or 0) > 0 and not p.pipeline then
      self.grad_norm = self.model:clip_grad_norm_(self.clip_grad)
    else
      self.grad_norm = nn.utils.clip_grad_norm_(self.model, self.clip_grad, 2,
        p.pipeline and { group = self.layout.pipe or true } or nil)
    end
  end
  local step = self.progress.step
  if self.schedule then self.optimizer:set_lr(self.monitor:lr(step)) end
  local outcome, reason = 'stepped', nil
  if self.scaler then
    outcome, reason = self.scaler:step(self.optimizer)
  else
    self.optimizer:step()
  end
  self.optimizer:zero_grad()
  phase(self, 'optimizer')
  if outcome ~= 'skipped' then self.progress.step = step + 1 end
  self.stop_requested = self.monitor:step(self.progress.step, self.last_loss) or nil
  return outcome, reason
end

-- Top-1 accuracy over a loader (anything with :batches(), or an iterator function of (i, x, y)),
-- every rank's share counted once (all-reduced). Returns accuracy, images.
function Trainer:evaluate(loader)
  local model = self.model
  model:evaluate()
  local counts = dlua.zeros({ 2 }, { dtype = 'float64' })
  local it = type(loader) == 'function' and loader() or loader:batches()
  for _, x, y in it do
    x, y = x:to(self.device), y:to(self.device)
    local logits = model:forward(x)  -- a pipeline's: on its last stage only, which counts
    if logits ~= nil then
      counts[1] = counts[1] + logits:argmax(2):eq(y):sum():item()
      counts[2] = counts[2] + y:numel()
    end
  end
  model:train()
  dlua.dist.all_reduce(counts, 'sum')
  return counts[1] / math.max(counts[2], 1), counts[2]
end

-- A checkpoint of t.state in checkpoint.dir (every rank calls it, at the same step).
function Trainer:save()
  local c = self.ckpt
  if not c.dir or c.dir == '' then error('trainer:save: no checkpoint directory (checkpoint = {dir = ...})', 2) end
  ckpt.save(c.dir, self.state, { step = self.progress.step, keep = (c.keep or 0) > 0 and c.keep or nil, async = c.async })
end

-- Resumes t.state from spec ('auto': the newest complete checkpoint in checkpoint.dir; a directory; ''):
-- returns ckpt.resume's info (nil: a fresh start) and the options the checkpoint was saved with. On
-- another world size, the step count follows the images trained on.
function Trainer:resume(spec, global_batch, skip)
  local c = self.ckpt
  spec = monitor.resume_option(spec or '', c.dir or '')
  if spec == '' then return nil end
  local mine = self.state.options
  local saved = mine ~= nil and {} or nil
  self.state.options = saved
  local info = ckpt.resume(spec, c.dir, self.state, { skip_if_resharded = skip or { 'schedule', 'meter', 'comm' } })
  self.state.options = mine
  if info and info.resharded and global_batch then self.progress.step = math.floor(self.progress.images / global_batch) end
  self.resumed = info
  return info, saved
end

-- The parameters' and buffers' crc32 (ZeRO-3: its gathered state dict; a pipeline: this stage's).
function Trainer:crc32()
  return ckpt.crc32(self.parallel.pipeline and self.model.module or self.model)
end

M.Trainer = Trainer
return M
