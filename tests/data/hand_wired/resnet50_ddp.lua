-- tests/data/hand_wired/resnet50_ddp.lua: recipes/resnet50_ddp.lua as it was before dlua.recipe (#27), wired by hand from the primitives; kept as the reference that tests/cli/test_recipe_layer.sh compares the recipe with (the same losses, the same parameters' crc32). Not a recipe to copy.
-- ResNet-50 with DDP: every local GPU (NCCL) or `dlua --nproc N` CPU ranks (gloo); Fashion-MNIST built in, or an ImageFolder.
--   dlua --nproc 2 recipes/resnet50_ddp.lua --limit 2048            # 2 CPU ranks, built-in data
--   dlua --nproc 4 recipes/resnet50_ddp.lua --pipeline 2 --chunks 4  # 2 pipelines of 2 stages (docs/pipeline.md)
--   dlua --nproc gpu recipes/resnet50_ddp.lua --data /data/imagenet --image-size 224 --batch 256
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local lr = require 'dlua.lr'
local data = require 'dlua.data'
local cli = require 'dlua.cli'
local ckpt = require 'dlua.ckpt'
local monitor = require 'dlua.monitor'
local metrics = require 'dlua.metrics'
local resnet = require 'models.resnet'

local opt = cli.parse(arg, {
  data = '', epochs = 1, batch = 32, lr = 0.1, warmup = 5, accumulate = 1, image_size = 32, workers = 2,
  seed = 1, limit = 0, eval_limit = 0, model = 'resnet50', momentum = 0.9, weight_decay = 1e-4,
  bucket_mb = '25', threads = 0, channels_last = true, print_every = 10, sync_bn = false, device = 'auto',
  clip_grad = 0, zero = 0, offload = false, save = '', save_every = 0, save_async = false, keep = 0, resume = '', stop_after = 0,
  pipeline = 0, chunks = 8, schedule = '1f1b', split = 'time', checkpoint_activations = 'none', nan_check = '', metrics = '',
}, {
  description = 'Trains a ResNet (default ResNet-50) data-parallel with dlua.dist.DDP.',
  help = {
    data = 'ImageFolder root with train/ and val/ (default: the built-in Fashion-MNIST, 3 channels, resized)',
    epochs = 'passes over the training set',
    batch = 'images per rank per step (per micro-batch with --accumulate)',
    lr = 'learning rate per 256 images: the peak is lr * global batch / 256 (linear scaling rule)',
    warmup = 'epochs of linear warmup before the cosine decay (capped to the run)',
    accumulate = 'micro-batches per optimizer step (gradients reduced once per step)',
    image_size = 'training crop (ImageFolder) or resized side (Fashion-MNIST)',
    workers = 'decoding threads of the ImageFolder loader',
    limit = 'train on the first N images only (0: all)',
    eval_limit = 'evaluate on the first N images only (0: all)',
    model = 'resnet18, resnet34, resnet50, resnet101, resnet152',
    bucket_mb = "DDP gradient bucket size in MB, or 'auto': a few sizes timed in the first steps, the fastest kept",
    threads = 'CPU threads per rank (0: the launcher\'s share of the cores)',
    channels_last = 'keep activations in NHWC memory',
    print_every = 'steps between progress lines',
    sync_bn = 'batch-norm statistics over all ranks (SyncBatchNorm) instead of per rank',
    device = "'auto' (this rank's GPU when each rank has one, else the CPU), 'cpu' or 'cuda'",
    clip_grad = 'clip the all-reduced gradients\' total 2-norm to N before each step (0: off)',
    zero = 'ZeRO stage 1, 2 or 3 instead of DDP (dlua.dist.ZeRO: optimizer state, gradients, parameters sharded); 0: DDP',
    offload = 'with --zero: optimizer state and step in pinned host memory (a no-op for CPU ranks, which says so)',
    save = 'checkpoint directory (dlua.ckpt: DIR/step-N/, DIR/latest)',
    save_every = 'save a checkpoint every N optimizer steps (0: only at the end, with --save)',
    save_async = 'write checkpoints on a background thread while training goes on',
    keep = 'keep the newest N checkpoints (0: all)',
    resume = "'auto' (the newest complete checkpoint in --save, or a fresh start) or a checkpoint directory",
    stop_after = 'stop after N optimizer steps, saving first (the schedule is the full run\'s)',
    pipeline = 'cut the model into N pipeline stages, one per rank (dist.Pipeline); the ranks left over are data-parallel '
      .. 'replicas of each pipeline, DDP or --zero 1 across them (0: no pipeline)',
    chunks = 'with --pipeline: micro-batches per step (--batch is then the images per pipeline per step)',
    schedule = "with --pipeline: 'gpipe' or '1f1b'",
    split = "with --pipeline: balance the stages by measured 'time' or by 'params'",
    checkpoint_activations = "none, blocks or stages: recompute those in backward instead of keeping their activations",
    nan_check = "loss: a non-finite loss stops the run, naming the step and the first module whose output went non-finite; "
      .. "modules: every module's output checked in every forward (slow); off (default: DLUA_NAN_CHECK, else loss)",
    metrics = 'write one JSON line per step (loss, lr, img/s, time by phase, memory), per epoch and a summary to FILE (rank 0)',
  },
})
if opt.bucket_mb ~= 'auto' then
  opt.bucket_mb = tonumber(opt.bucket_mb) or error(("--bucket-mb %s: expected a number of MB or 'auto'"):format(opt.bucket_mb), 0)
end
io.stdout:setvbuf('line')
if opt.threads > 0 then dlua.set_num_threads(opt.threads) end

local dist = dlua.dist
dist.init()
local rank, world = dist.rank(), dist.world_size()
-- --pipeline N: N stages per pipeline, world / N pipelines; data parallelism is across the pipelines,
-- so the sampler, the augmentation and the evaluation shard go by the pipeline (`replica`), not the rank
local piped = opt.pipeline > 1
local layout, replica, replicas = nil, rank, world
if piped then
  if world % opt.pipeline ~= 0 then
    error(('--pipeline %d: the %d ranks do not divide into pipelines of %d stages'):format(opt.pipeline, world, opt.pipeline), 0)
  end
  if opt.accumulate ~= 1 then error('--accumulate with --pipeline: the pipeline accumulates its --chunks micro-batches', 0) end
  if opt.save ~= '' or opt.resume ~= '' then error('--save/--resume with --pipeline: not supported yet', 0) end
  layout = dist.Pipeline.groups(opt.pipeline)
  replica, replicas = layout.replica - 1, layout.replicas
end
local function log(fmt, ...) if rank == 0 then print(string.format(fmt, ...)) end end
local device = opt.device == 'auto' and dist.device() or opt.device
if device ~= 'cpu' then
  if not dlua.cuda.is_available() then error(('--device %s: no CUDA device available (%s)'):format(opt.device, dlua.cuda.unavailable_reason()), 0) end
  if device == 'cuda' then device = 'cuda:' .. (dist.local_rank() % dlua.cuda.device_count()) end
  dlua.cuda.set_device(device)
end
dlua.manual_seed(opt.seed)

---------------------------------------------------------------------------------------------
-- Data: each rank reads its 1/world of every epoch through a DistributedSampler

local size = opt.image_size
local train_batches, eval_batches, train_len, num_classes, data_name, sampler

local function to_layout(x)  -- (N, C, H, W) values in NCHW or channels-last memory
  if opt.channels_last then return x:contiguous('channels_last') end
  return x:contiguous()
end

if opt.data == '' then
  data_name = 'Fashion-MNIST (built in)'
  local train = data.FashionMNIST({ train = true })
  local test = data.FashionMNIST({ train = false })
  if opt.limit > 0 and opt.limit < train:size() then train = train:narrow(1, opt.limit) end
  if opt.eval_limit > 0 and opt.eval_limit < test:size() then test = test:narrow(1, opt.eval_limit) end
  num_classes = 10
  local mean, std = train.mean, train.std
  -- 28x28 grey → size x size, three channels: nearest-neighbour rows and columns
  local pick = {}
  for i = 1, size do pick[i] = math.min(28, math.floor((i - 0.5) * 28 / size) + 1) end
  pick = dlua.tensor(pick, { dtype = 'int64' })
  local function rgb(x)
    if size ~= 28 then x = x:index_select(3, pick):index_select(4, pick) end
    return to_layout(x:expand({ x:size(1), 3, size, size }))
  end
  local function with_rgb(it)  -- the batches of `it`, images made rgb(x)
    return function()
      local i, x, y = it()
      if i == nil then return nil end
      return i, rgb(x), y
    end
  end
  sampler = data.DistributedSampler({ n = train:size(), shuffle = true, seed = opt.seed, drop_last = true,
    num_replicas = replicas, rank = replica })
  train_len = sampler:len()
  train_batches = function(epoch)  -- a resumed epoch skips what the checkpoint had consumed; batch numbers go on
    local idx = sampler:indices(epoch)
    local shard = data.TensorDataset(train.x:index_select(1, idx), train.y:index_select(1, idx))
    return with_rgb(data.batches(shard, { batch = opt.batch, drop_last = true, seed = opt.seed * 1000 + replica,
      epoch = epoch, augment = { crop_pad = 2, flip = true }, mean = mean, std = std, skip = sampler:skip(epoch) }))
  end
  -- evaluation: replica r takes samples r+1, r+1+replicas, ... (no padding, so nothing counts twice)
  local mine = {}
  for i = replica + 1, test:size(), replicas do mine[#mine + 1] = i end
  local eval_set = data.TensorDataset(test.x:index_select(1, dlua.tensor(mine, { dtype = 'int64' })),
    test.y:index_select(1, dlua.tensor(mine, { dtype = 'int64' })))
  eval_batches = function() return with_rgb(data.batches(eval_set, { batch = 250, mean = mean, std = std })) end
else
  data_name = opt.data
  local mean, std = { 0.485, 0.456, 0.406 }, { 0.229, 0.224, 0.225 }
  -- (N, C, H, W) batches; channels-last memory straight from the loader's workers (no copy)
  local to_tensor = data.ToTensor({ memory_format = opt.channels_last and 'channels_last' or 'contiguous' })
  local train = data.ImageFolder(opt.data .. '/train', { transform = data.Compose({
    data.RandomResizedCrop(size), data.RandomHorizontalFlip(), to_tensor, data.Normalize(mean, std) }) })
  local val = data.ImageFolder(opt.data .. '/val', { transform = data.Compose({
    data.Resize(math.floor(size * 256 / 224 + 0.5)), data.CenterCrop(size), to_tensor, data.Normalize(mean, std) }) })
  num_classes = #train.classes
  sampler = data.DistributedSampler({ dataset = train, shuffle = true, seed = opt.seed, drop_last = true,
    num_replicas = replicas, rank = replica })
  local loader = data.DataLoader({ dataset = train, batch = opt.batch, sampler = sampler, workers = opt.workers,
    drop_last = true, seed = opt.seed, pin_memory = true, device = device })
  train_len = sampler:len()
  train_batches = function(epoch)  -- the loader skips a resumed epoch's consumed samples; batch numbers go on
    local first = math.floor(sampler:skip(epoch) / opt.batch)
    loader:set_epoch(epoch)
    local it = loader:batches()
    return function()
      local i, x, y = it()
      if i == nil then return nil end
      return first + i, x, y
    end
  end
  local vsampler = data.DistributedSampler({ dataset = val, shuffle = false, num_replicas = replicas, rank = replica })
  local vloader = data.DataLoader({ dataset = val, batch = opt.batch, sampler = vsampler, workers = opt.workers,
    device = device })
  eval_batches = function() return vloader:batches() end
end

---------------------------------------------------------------------------------------------
-- Model, DDP, optimizer, schedule

local build = resnet[opt.model]
if not build then error(('unknown --model %s'):format(opt.model), 0) end
local net = build({ in_channels = 3, num_classes = num_classes, zero_init_residual = true }):input_grad(false)
-- (under --pipeline, over the replicas of each stage; with one pipeline there is nothing to synchronise)
if opt.sync_bn and not (piped and layout.data == nil) then nn.SyncBatchNorm.convert(net, piped and { group = layout.data } or nil) end
local ckpt_policy = opt.checkpoint_activations
if ckpt_policy ~= 'none' and ckpt_policy ~= 'blocks' and ckpt_policy ~= 'stages' then
  error(('--checkpoint-activations %s: expected none, blocks or stages'):format(ckpt_policy), 0)
end
local ckpt_plan = net:checkpoint(ckpt_policy) -- before any pipeline split: the stages hold the wrappers
net:to(device)
if opt.zero ~= 0 and opt.zero ~= 1 and opt.zero ~= 2 and opt.zero ~= 3 then error('--zero: 0 (DDP), 1, 2 or 3', 0) end
if opt.offload and opt.zero == 0 then error('--offload needs --zero 1, 2 or 3', 0) end
if piped and opt.zero > 1 then error('--zero 2 or 3 with --pipeline: not supported yet (--zero 1 shards the optimizer state across the replicas)', 0) end
if piped and opt.zero > 0 and opt.clip_grad > 0 then error('--clip-grad with --pipeline --zero 1: not supported yet', 0) end
local criterion = nn.CrossEntropyLoss()
local model, split_info
if piped then
  -- the stages balanced by each piece's forward + backward time on a micro-batch, averaged over the
  -- ranks so that every rank cuts the model alike
  local by = opt.split
  if by ~= 'time' and by ~= 'params' then error(("--split %s: expected 'time' or 'params'"):format(by), 0) end
  local costs
  if by == 'time' then
    local micro = math.max(1, math.floor(opt.batch / opt.chunks))
    local sample = to_layout(dlua.randn({ micro, 3, size, size }, { device = device }))
    local _, info = dist.Pipeline.split(net, opt.pipeline, { input = sample, repeats = 1 })
    local t = dlua.tensor(info.costs, { dtype = 'float64' })
    dist.all_reduce(t, 'avg')
    costs = {}
    for i = 1, t:numel() do costs[i] = t[i] end
  end
  local stages
  stages, split_info = dist.Pipeline.split(net, opt.pipeline, { costs = costs, by = by })
  -- across the replicas of each stage: DDP, or ZeRO-1 (--zero 1) through the pipeline's data_parallel hook
  local zero1
  if opt.zero == 1 and layout.data then
    zero1 = function(m, grp) return dist.ZeRO(m, { stage = 1, group = grp, offload = opt.offload, bucket_mb = opt.bucket_mb }) end
  end
  model = dist.Pipeline(stages, { chunks = opt.chunks, schedule = opt.schedule, group = layout.pipe,
    data_group = layout.data, loss = criterion, data_parallel = zero1,
    ddp = layout.data and not zero1 and { bucket_mb = opt.bucket_mb } or nil })
elseif opt.zero > 0 then
  if opt.bucket_mb == 'auto' then error('--bucket-mb auto: DDP only (give --zero a number of MB)', 0) end
  model = dist.ZeRO(net, { stage = opt.zero, offload = opt.offload, accumulate = opt.accumulate, bucket_mb = opt.bucket_mb })
else
  model = dist.DDP(net, { accumulate = opt.accumulate, bucket_mb = opt.bucket_mb })
end
local global_batch = opt.batch * replicas * opt.accumulate
local peak = lr.scale(opt.lr, global_batch, 256)
local sgd = optim.SGD(model, {
  lr = peak, momentum = opt.momentum, weight_decay = opt.weight_decay,
  groups = { { filter = function(_, p) return p:dim() <= 1 end, weight_decay = 0 } },  -- none on BN and bias
})
local micro_per_epoch = math.floor(train_len / opt.batch)
local steps_per_epoch = math.floor(micro_per_epoch / opt.accumulate)
if steps_per_epoch < 1 then error(('--batch %d x --accumulate %d is more than a rank\'s %d images'):format(opt.batch, opt.accumulate, train_len), 0) end
local total = opt.epochs * steps_per_epoch
local warm = math.min(math.floor(opt.warmup * steps_per_epoch), total - 1)
local schedule = warm > 0
    and lr.sequential({ lr.linear_warmup({ lr = peak, steps = warm, start_factor = 0.1 }),
      lr.cosine({ lr = peak, steps = total - warm }) })
    or lr.cosine({ lr = peak, steps = total })

log('%s: %s, %d parameters, %d classes, data %s', opt.model, tostring(net.__name), net:num_parameters(),
  num_classes, data_name)
-- CUDA gradients go through NCCL when every rank has a GPU; CPU ones through shared memory or TCP.
local transport = device ~= 'cpu' and dist.backend() ~= 'gloo' and 'nccl' or dist.transport()
if piped then
  log('%d pipelines x %d stages x batch %d in %d micro-batches (%s) = global batch %d; lr %.4g (%.3g per 256), %d warmup steps of %d; %s, %d threads per rank',
    replicas, opt.pipeline, opt.batch, opt.chunks, opt.schedule, global_batch, peak, opt.lr, warm, total,
    device == 'cpu' and 'CPU' or device, dlua.get_num_threads())
  for s, b in ipairs(split_info.bounds) do
    log('  stage %d (by %s): %s .. %s', s, split_info.by, split_info.units[b[1]], split_info.units[b[2]])
  end
  log('%s', model.ddp and ('%s across the %d replicas of each stage: %d buckets over %s'):format(opt.zero == 1 and 'ZeRO-1' or 'DDP',
    replicas, #model.ddp:bucket_plan(), transport) or 'one pipeline: no data parallelism')
else
  log('%d ranks x batch %d x accumulate %d = global batch %d; lr %.4g (%.3g per 256), %d warmup steps of %d; %s, %d threads per rank',
    world, opt.batch, opt.accumulate, global_batch, peak, opt.lr, warm, total, device == 'cpu' and 'CPU' or device, dlua.get_num_threads())
  if opt.zero > 0 then
    log('%s; %d gradient buckets over %s%s', model:memory_line(), #model:bucket_plan(), transport, opt.sync_bn and ', SyncBatchNorm' or '')
  else
    log('DDP: %d buckets%s, all-reduce over %s%s', #model:bucket_plan(), opt.bucket_mb == 'auto' and ' (auto: plans timed in the first steps)' or '',
      transport, opt.sync_bn and ', SyncBatchNorm' or '')
  end
end
if ckpt_policy ~= 'none' then log('%s', tostring(ckpt_plan)) end

local function evaluate()
  model:evaluate()
  local counts = dlua.zeros({ 2 }, { dtype = 'float64' })
  for _, x, y in eval_batches() do
    x, y = x:to(device), y:to(device)  -- no-ops when the loader already put them there
    local logits = model:forward(x)  -- a pipeline's: on its last stage only, which counts
    if logits ~= nil then
      counts[1] = counts[1] + logits:argmax(2):eq(y):sum():item()
      counts[2] = counts[2] + y:numel()
    end
  end
  model:train()
  dist.all_reduce(counts, 'sum')  -- accuracy over the whole evaluation set, every rank's share
  return counts[1] / counts[2], counts[2]
end

---------------------------------------------------------------------------------------------
-- Training

-- Checkpoints: everything the run continues from. The epoch's running sums are each rank's own.
local progress = { step = 0, images = 0 }  -- optimizer steps; images trained on, all ranks
local loss_sum = dlua.zeros({}, { dtype = 'float64', device = device })  -- read back only when printing: no sync per step
local meter = { seen = 0 }
function meter:state_dict() return { loss_sum = loss_sum:item(), seen = self.seen } end
function meter:load_state_dict(sd)
  loss_sum:fill_(sd.loss_sum)
  self.seen = sd.seen
end
local state = { model = model, optimizer = sgd, schedule = schedule, sampler = sampler, rng = dlua.default_generator(),
  progress = progress, meter = ckpt.per_rank(meter), comm = not piped and ckpt.comm_state(model) or nil, options = opt }
local function save_checkpoint()
  if opt.save == '' then return end
  ckpt.save(opt.save, state, { step = progress.step, keep = opt.keep > 0 and opt.keep or nil, async = opt.save_async })
end
-- The step boundary: the NaN guard, `dlua attach` (read the loss, change the learning rate, save, stop).
local mon = monitor.Monitor({ model = model, optimizer = sgd, schedule = schedule, save = opt.save ~= '' and save_checkpoint or nil,
  nan_check = opt.nan_check, print = function(...) log('%s', table.concat({ ... }, '\t')) end,
  state = { progress = progress, sampler = sampler, net = net, opt = opt } })
opt.resume = monitor.resume_option(opt.resume, opt.save)  -- a job restarted by --max-restarts resumes from its newest checkpoint
local resumed_epoch, resumed_info
if opt.resume ~= '' then
  local saved_opts = {}
  state.options = saved_opts
  -- on another world size the schedule and the step count follow the images trained on; the epoch's sums restart
  local info = ckpt.resume(opt.resume, opt.save, state, { skip_if_resharded = { 'schedule', 'meter', 'comm' } })
  state.options = opt
  if info then
    for _, k in ipairs({ 'model', 'batch', 'accumulate', 'lr', 'epochs', 'warmup', 'momentum', 'weight_decay', 'seed', 'limit',
      'image_size', 'sync_bn', 'clip_grad', 'data' }) do
      if saved_opts[k] ~= opt[k] then
        log('warning: --%s is %s, the checkpoint was saved with %s', k:gsub('_', '-'), tostring(opt[k]), tostring(saved_opts[k]))
      end
    end
    if info.resharded then progress.step = math.floor(progress.images / global_batch) end
    resumed_epoch, resumed_info = sampler.epoch, info
    log('resumed from %s: step %d, epoch %d%s', info.path, progress.step, sampler.epoch,
      info.resharded and (' (saved by %d ranks, now %d)'):format(info.world_size, world) or '')
  end
end

mon:restarted(resumed_info, progress.step)

local step, acc = progress.step, 0
local stopped = false
local mw = metrics.Writer(opt.metrics, { rank = rank, model = model, device = device,
  run = { recipe = 'resnet50_ddp', options = opt, world = world } })
local step_loss, step_seen = 0, 0  -- --metrics: the loss sum and images when the step began (rank 0's own)
local grad_norm  -- --clip-grad: the last step's gradient norm before clipping
local t_start = dlua.perf_counter()
for epoch = resumed_epoch or 1, opt.epochs do
  sampler:set_epoch(epoch)
  if epoch ~= resumed_epoch then
    loss_sum:zero_()
    meter.seen = 0
  end
  local t0, fresh = dlua.perf_counter(), 0  -- fresh: images this run trained on in this epoch (for img/s)
  sgd:zero_grad()
  mw:start_epoch(epoch)
  step_loss, step_seen = mw.enabled and loss_sum:item() or 0, meter.seen
  for i, x, y in train_batches(epoch) do
    if i > steps_per_epoch * opt.accumulate then break end
    x, y = x:to(device), y:to(device)
    mw:phase('data')
    if piped then
      -- the micro-batches through the stages: x is read on the first stage, y on the last; the batch's loss comes back everywhere
      loss_sum:add_(model:step(x, y):to(device) * y:numel())
      mw:phase('other')  -- the pipeline's forward and backward are one call
    else
      local out = model:forward(x)
      local loss = criterion:forward(out, y)
      mon:check_loss(loss, x)  -- one device sync per micro-batch on a GPU
      mw:phase('forward')
      model:backward(x, criterion:backward(out, y))
      mw:phase('backward')
      loss_sum:add_(loss:double() * y:numel())
    end
    meter.seen, fresh = meter.seen + y:numel(), fresh + y:numel()
    sampler:advance(y:numel())
    progress.images = progress.images + y:numel() * replicas
    if i % opt.accumulate == 0 then
      -- waits for DDP's buckets, so the norm is the averaged gradients' (one device sync per step);
      -- a pipeline's norm sums its stages' pieces
      if opt.clip_grad > 0 then  -- under ZeRO: over every rank's shard
        if opt.zero > 0 then
          grad_norm = model:clip_grad_norm_(opt.clip_grad)
        else
          grad_norm = nn.utils.clip_grad_norm_(model, opt.clip_grad, 2, piped and { group = layout.pipe or true } or nil)
        end
      end
      sgd:set_lr(mon:lr(step))
      sgd:step()
      sgd:zero_grad()
      mw:phase('optimizer')
      if mw.enabled then  -- reading the loss back syncs a GPU once per step: only with --metrics
        local l = loss_sum:item()
        mw:step({ step = step + 1, loss = (l - step_loss) / (meter.seen - step_seen), lr = schedule(step),
          images = (meter.seen - step_seen) * replicas })
        step_loss, step_seen = l, meter.seen
      end
      step = step + 1
      progress.step = step
      local s = i / opt.accumulate
      if s % opt.print_every == 0 or s == steps_per_epoch then
        local dt = dlua.perf_counter() - t0
        log('epoch %d  step %d/%d  loss %.4f  lr %.4g  %.1f img/s%s', epoch, s, steps_per_epoch, loss_sum:item() / meter.seen,
          sgd:get_lr(), fresh * replicas / dt, grad_norm and ('  grad norm %.4g'):format(grad_norm) or '')
      end
      if opt.save_every > 0 and step % opt.save_every == 0 then save_checkpoint() end
      if mon:step(step) or opt.stop_after > 0 and step >= opt.stop_after then
        stopped = true
        break
      end
    end
  end
  if stopped then break end
  local dt = dlua.perf_counter() - t0
  if piped then model:report({ print = layout.replica == 1 }) end  -- the schedule, its bubble, each stage's time
  -- a pipeline's ranks all saw its images: each counts 1/stages of them
  local share = piped and 1 / opt.pipeline or 1
  local ips = dlua.tensor({ fresh / dt * share, loss_sum:item() * share, meter.seen * share }, { dtype = 'float64' })
  dist.all_reduce(ips, 'sum')  -- img/s summed over ranks, loss averaged over every image
  local n_eval
  acc, n_eval = evaluate()
  log('epoch %d  train loss %.4f  test accuracy %.4f (%d images)  img/s %.1f', epoch, ips[2] / ips[3], acc, n_eval, ips[1])
  mw:epoch({ train_loss = ips[2] / ips[3], test_accuracy = acc, img_s = ips[1] })
end
-- The end, or --stop-after: the last state saved (unless the last step just was), then a checksum of the
-- parameters and buffers, so runs can be compared bit for bit.
if opt.save ~= '' and not (opt.save_every > 0 and step % opt.save_every == 0 and step > 0) then save_checkpoint() end
ckpt.wait()
if stopped then
  log('stopped after step %d', step)
else
  log('done in %.0f s: test accuracy %.4f', dlua.perf_counter() - t_start, acc)
end
if piped then  -- each stage's own (its replicas hold the same)
  local crc = ckpt.crc32(model.module)
  if layout.replica == 1 then print(('stage %d parameters crc32 %s'):format(layout.stage, crc)) end
else
  log('parameters crc32 %s', ckpt.crc32(model))  -- ZeRO-3: its gathered state dict (every rank computes it)
end
mw:close({ test_accuracy = acc, bucket_choice = not piped and opt.zero == 0 and model:bucket_choice() or nil })
dist.destroy()
