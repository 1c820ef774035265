-- dlua.recipe.train: a whole training run from one table: checked, planned, run, checkpointed and resumed.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local lr = require 'dlua.lr'
local ckpt = require 'dlua.ckpt'
local metrics = require 'dlua.metrics'
local validate = require 'dlua.recipe.validate'
local plan = require 'dlua.recipe.plan'
local env = require 'dlua.recipe.env'
local log = require 'dlua.recipe.log'
local rdata = require 'dlua.recipe.data'
local T = require 'dlua.recipe.trainer'

local M = {}
local format, floor = string.format, math.floor

-- The options a resumed run should share with its checkpoint (a warning names each that differs).
local run_control = { save = true, save_every = true, save_async = true, keep = true, resume = true, stop_after = true,
  print_every = true, metrics = true, threads = true, nan_check = true, workers = true, device = true, config = true,
  dry_run = true }

local function schedule_of(c, peak, total, steps_per_epoch)
  local s = c.schedule
  if s.name == 'constant' then return lr.constant(peak), 0 end
  if s.name == 'cosine' then return lr.cosine({ lr = peak, steps = total }), 0 end
  local warm = math.min(floor(s.warmup * steps_per_epoch), total - 1)
  return lr.warmup_cosine({ lr = peak, steps = total, warmup = warm, start_factor = s.start_factor }), math.max(warm, 0)
end

-- Per-epoch sums, each rank's own: the loss over the epoch's images, and (with clip_grad) the norms.
local function new_meter(device)
  local m = { loss_sum = dlua.zeros({}, { dtype = 'float64', device = device }), seen = 0,
    clip = { n = 0, sum = 0, max = 0, clipped = 0 } }
  function m:state_dict() return { loss_sum = self.loss_sum:item(), seen = self.seen, clip = self.clip } end
  function m:load_state_dict(sd)
    self.loss_sum:fill_(sd.loss_sum)
    self.seen = sd.seen
    for k, v in pairs(sd.clip or {}) do self.clip[k] = v end
  end
  function m:reset()
    self.loss_sum:zero_()
    self.seen = 0
  end
  return m
end

-- train{...}: see docs/recipes.md. Returns {accuracy =, step =, crc32 =, stopped =} (on every rank),
-- or, with dry_run, the validated table and the plan's lines.
function M.train(spec)
  local c = validate.validate(spec)
  local e = env.setup({ device = c.device, threads = c.threads })
  c.amp, c.amp_why = validate.resolve_amp(c, e.device)
  dlua.manual_seed(c.seed)
  local L = log.Logger({ rank = e.rank, every = c.print_every, tty = c.progress == 'bar' and nil or false })
  local dist = dlua.dist
  local layout
  if c.stages > 0 then layout = dist.Pipeline.groups(c.stages) end
  local replica, replicas = layout and layout.replica - 1 or e.rank, c.replicas
  local d = c.data

  -- data, then the model on the CPU (the trainer moves it)
  local D = rdata.build(c, replica, replicas, e.device)
  local net = c.model
  if type(net) == 'function' then
    net = net({ classes = D.classes, channels = D.channels, image_size = D.image_size })
  end
  if net.input_grad then net:input_grad(false) end  -- the images need no gradient
  local per = c.stages > 0 and 1 or c.accumulate
  local micro_per_epoch = floor(D.train_len / d.batch)
  local steps_per_epoch = floor(micro_per_epoch / per)
  if steps_per_epoch < 1 then
    validate.refuse('data.batch %d x accumulate %d is more than a replica\'s %d images', d.batch, per, D.train_len)
  end
  local total = c.epochs * steps_per_epoch
  local o = c.optim
  local peak = o.scale_lr > 0 and lr.scale(o.lr, c.global_batch, o.scale_lr) or o.lr
  local schedule, warm = schedule_of(c, peak, total, steps_per_epoch)
  local lines = plan.lines(c, { params = net:num_parameters(), classes = D.classes, model = tostring(net.__name or 'model'),
    data = D.name, samples = D.train_len, image_size = D.image_size, channels = D.channels, backend = e.backend, device = e.device,
    threads = dlua.get_num_threads(), total = total, steps_per_epoch = steps_per_epoch, peak = peak,
    schedule = format('%s, %d warmup steps of %d', tostring(schedule), warm, total) })
  for _, l in ipairs(lines) do L:print('%s', l) end
  if c.dry_run then return { config = c, plan = lines } end

  local criterion = c.loss or nn.CrossEntropyLoss(d.label_smoothing > 0 and { label_smoothing = d.label_smoothing } or nil)
  local optim_spec = { name = o.name, lr = peak, weight_decay = o.weight_decay, no_decay = o.no_decay }
  if o.name == 'sgd' or o.name == 'lars' then optim_spec.momentum = o.momentum end
  if o.name == 'sgd' and o.nesterov then optim_spec.nesterov = true end
  local p = c.parallel
  local t = T.trainer({ model = net, loss = criterion, optim = optim_spec, schedule = schedule, accumulate = c.accumulate,
    clip_grad = c.clip_grad, amp = c.amp, activation_checkpoint = c.activation_checkpoint, env = e, layout = layout,
    sampler = D.sampler, batch = d.batch, channels_last = d.channels_last, log = L, nan_check = c.nan_check, options = c.options,
    checkpoint = { dir = c.checkpoint.dir ~= '' and c.checkpoint.dir or nil, keep = c.checkpoint.keep, async = c.checkpoint.async },
    parallel = { ddp = (c.world > 1 or p.compress ~= 'none') or nil, bucket_mb = p.ddp.bucket_mb, zero = p.zero, offload = p.offload, compress = p.compress,
      sync_bn = p.sync_bn, pipeline = c.stages > 0 and { stages = c.stages, chunks = p.pipeline.chunks, schedule = p.pipeline.schedule,
        split = p.pipeline.split, input = { D.channels, D.image_size, D.image_size } } or nil } })
  local model = t.model
  -- what the wrapping decided
  if c.stages > 0 then
    for s, b in ipairs(t.split_info.bounds) do
      L:print('  stage %d (by %s): %s .. %s', s, t.split_info.by, t.split_info.units[b[1]], t.split_info.units[b[2]])
    end
    L:print('%s', model.ddp and format('%s across the %d replicas of each stage: %d buckets over %s', p.zero == 1 and 'ZeRO-1' or 'DDP',
      replicas, #model.ddp:bucket_plan(), e.transport) or 'one pipeline: no data parallelism')
  elseif p.zero > 0 then
    L:print('%s; %d gradient buckets over %s', model:memory_line(), #model:bucket_plan(), e.transport)
  elseif model ~= net then
    L:print('DDP: %d buckets%s, all-reduce over %s', #model:bucket_plan(),
      p.ddp.bucket_mb == 'auto' and ' (auto: plans timed in the first steps)' or '', e.transport)
  end
  if c.activation_checkpoint ~= 'none' then L:print('%s', tostring(t.activation_plan)) end

  local meter = new_meter(e.device)
  t.state.meter = ckpt.per_rank(meter)
  local progress = t.progress
  local k = c.checkpoint
  local saving = k.dir ~= ''
  local resumed_epoch, info
  local saved
  info, saved = t:resume(k.resume, c.global_batch)
  if info then
    if saved and c.options then
      local ok_keys = {}
      for key in pairs(saved) do ok_keys[#ok_keys + 1] = key end
      table.sort(ok_keys)
      for _, key in ipairs(ok_keys) do
        local now = rawget(c.options, key)
        if not run_control[key] and type(now) ~= 'table' and now ~= saved[key] then
          L:print('warning: --%s is %s, the checkpoint was saved with %s', (key:gsub('_', '-')), tostring(now), tostring(saved[key]))
        end
      end
    end
    resumed_epoch = D.sampler.epoch
    L:print('resumed from %s: step %d, epoch %d%s', info.path, progress.step, D.sampler.epoch,
      info.resharded and format(' (saved by %d ranks, now %d)', info.world_size, e.world) or '')
  end
  t.monitor:restarted(info, progress.step)

  local mw = metrics.Writer(c.metrics, { rank = e.rank, model = model, device = e.device,
    run = { recipe = c.name, options = c.options, world = e.world } })
  t.mw = mw.enabled and mw or nil
  local function save() if saving then t:save() end end
  local step, acc = progress.step, 0
  local stopped = false
  local hooks = c.hooks
  local t_start = dlua.perf_counter()
  for epoch = resumed_epoch or 1, c.epochs do
    D.sampler:set_epoch(epoch)
    if epoch ~= resumed_epoch then meter:reset() end
    local t0, fresh = dlua.perf_counter(), 0  -- fresh: images this run trained on in this epoch (for img/s)
    mw:start_epoch(epoch)
    local step_loss, step_seen = mw.enabled and meter.loss_sum:item() or 0, meter.seen
    for i, x, y in D.train:batches(epoch) do
      if i > steps_per_epoch * per then break end
      local loss, outcome = t:step(x, y)
      meter.loss_sum:add_(loss:double() * y:numel())
      meter.seen, fresh = meter.seen + y:numel(), fresh + y:numel()
      if outcome ~= 'accumulated' then
        step = progress.step
        local norm = t.grad_norm
        if norm then
          local cl = meter.clip
          cl.n, cl.sum, cl.max = cl.n + 1, cl.sum + norm, math.max(cl.max, norm)
          if norm > c.clip_grad then cl.clipped = cl.clipped + 1 end
        end
        if mw.enabled then  -- reading the loss back syncs a GPU once per step: only with metrics
          local l = meter.loss_sum:item()
          mw:step({ step = step, loss = (l - step_loss) / (meter.seen - step_seen), lr = schedule(step - 1),
            images = (meter.seen - step_seen) * replicas })
          step_loss, step_seen = l, meter.seen
        end
        local s = floor(i / per)
        local dt = dlua.perf_counter() - t0
        local scale = t.scaler and t.scaler:is_enabled() and '  ' .. t.scaler:summary() or ''  -- the loss scale and the steps skipped
        if c.progress == 'bar' then
          L:progress(epoch, s, steps_per_epoch, meter.loss_sum:item() / meter.seen, fresh * replicas / dt,
            floor((total - step) * dt / fresh * d.batch), scale)
        elseif s % c.print_every == 0 or s == steps_per_epoch then
          L:print('epoch %d  step %d/%d  loss %.4f  lr %.4g  %.1f img/s%s%s', epoch, s, steps_per_epoch, meter.loss_sum:item() / meter.seen,
            t.optimizer:get_lr(), fresh * replicas / dt, norm and format('  grad norm %.4g', norm) or '', scale)
        end
        if hooks.on_step then hooks.on_step(t, { epoch = epoch, step = step, loss = loss, outcome = outcome }) end
        if outcome ~= 'skipped' and k.every > 0 and step % k.every == 0 then save() end  -- a skipped step left step where the last save was
        if t.stop_requested or k.stop_after > 0 and step >= k.stop_after then
          stopped = true
          break
        end
      end
    end
    if stopped then break end
    L:finish_line()
    local dt = dlua.perf_counter() - t0
    if c.stages > 0 then model:report({ print = layout.replica == 1 }) end  -- the schedule, its bubble, each stage's time
    -- a pipeline's ranks all saw its images: each counts 1/stages of them
    local share = c.stages > 0 and 1 / c.stages or 1
    local sums = dlua.tensor({ fresh / dt * share, meter.loss_sum:item() * share, meter.seen * share }, { dtype = 'float64' })
    dist.all_reduce(sums, 'sum')  -- img/s summed over ranks, loss averaged over every image
    local n_eval = 0
    if c.eval then acc, n_eval = t:evaluate(D.eval) end
    if c.eval then
      L:print('epoch %d  train loss %.4f  test accuracy %.4f (%d images)  img/s %.1f', epoch, sums[2] / sums[3], acc, n_eval, sums[1])
    else
      L:print('epoch %d  train loss %.4f  img/s %.1f', epoch, sums[2] / sums[3], sums[1])
    end
    mw:epoch({ train_loss = sums[2] / sums[3], test_accuracy = acc, img_s = sums[1] })
    local cl = meter.clip
    if cl.n > 0 then
      L:print('clip-grad %g: gradient norm mean %.4g, max %.4g; clipped %d of %d steps', c.clip_grad, cl.sum / cl.n, cl.max, cl.clipped, cl.n)
      cl.n, cl.sum, cl.max, cl.clipped = 0, 0, 0, 0
    end
    if hooks.on_epoch then hooks.on_epoch(t, { epoch = epoch, train_loss = sums[2] / sums[3], accuracy = acc }) end
  end
  -- the end, or stop_after: the last state saved (unless the last step just was), then a checksum of the
  -- parameters and buffers, so runs can be compared bit for bit
  if saving and not (k.every > 0 and step % k.every == 0 and step > 0) then save() end
  ckpt.wait()
  if stopped then
    L:print('stopped after step %d', step)
  else
    L:print('done in %.0f s%s', dlua.perf_counter() - t_start, c.eval and format(': test accuracy %.4f', acc) or '')
  end
  local crc = t:crc32()
  if c.stages > 0 then
    if layout.replica == 1 then print(format('stage %d parameters crc32 %s', layout.stage, crc)) end
  else
    L:print('parameters crc32 %s', crc)
  end
  mw:close({ test_accuracy = acc, parameters_crc32 = crc,
    bucket_choice = c.stages == 0 and p.zero == 0 and model ~= net and model:bucket_choice() or nil })
  env.teardown()
  return { accuracy = acc, step = step, crc32 = crc, stopped = stopped, trainer = t }
end

return M
