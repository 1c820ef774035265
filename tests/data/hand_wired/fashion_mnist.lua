-- tests/data/hand_wired/fashion_mnist.lua: recipes/fashion_mnist.lua as it was before dlua.recipe (#27), wired by hand from the primitives; kept as the reference that tests/cli/test_recipe_layer.sh compares the recipe with (the same losses, the same parameters' crc32). Not a recipe to copy.
-- Fashion-MNIST with a CIFAR-style ResNet-20: SGD + Nesterov, warmup then cosine, crop/flip augmentation.
-- Under `dlua --nproc N` it trains data-parallel (dlua.dist.DDP), each rank on its share of every epoch.
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
  epochs = 10, batch = 128, lr = 0, momentum = 0.9, weight_decay = 5e-4, warmup = 1,
  label_smoothing = 0.0, model = 'resnet20', threads = 0, seed = 1, data = '',
  limit = 0, eval_limit = 0, eval_batch = 1000, channels_last = true, zero_init_residual = true, clip_grad = 0,
  print_every = 100, zero = 0, offload = false, save = '', save_every = 0, save_async = false, keep = 0, resume = '', stop_after = 0,
  checkpoint_activations = 'none', nan_check = '', metrics = '',
}, {
  description = 'Trains a ResNet on Fashion-MNIST (Debian package dataset-fashion-mnist).',
  help = {
    epochs = 'passes over the 60000 training images',
    batch = 'images per step',
    lr = "peak learning rate (after warmup); 0: the model's own, 0.1 for the ResNets, 0.01 for small_cnn",
    warmup = 'epochs of linear warmup before the cosine decay',
    weight_decay = 'L2 decay on weights (none on batch-norm and bias)',
    label_smoothing = 'cross-entropy label smoothing',
    model = 'resnet20, resnet32, resnet56 or small_cnn',
    threads = 'CPU threads (0: all cores)',
    data = 'folder holding the Fashion-MNIST IDX files (default: the Debian package)',
    limit = 'train on the first N images only (0: all), for quick checks',
    eval_limit = 'evaluate on the first N test images only (0: all 10000)',
    eval_batch = 'images per evaluation step',
    channels_last = 'keep activations in NHWC memory (faster convolutions)',
    clip_grad = 'clip the gradients\' total 2-norm to N before each step (nn.utils.clip_grad_norm_; 0: off)',
    print_every = 'steps between progress lines (when not on a terminal)',
    zero = 'ZeRO stage 1, 2 or 3 (dlua.dist.ZeRO: optimizer state, gradients, parameters sharded over the ranks); 0: DDP',
    offload = 'with --zero: optimizer state and step in host memory (a no-op for CPU ranks, which says so)',
    save = 'checkpoint directory (dlua.ckpt: DIR/step-N/, DIR/latest)',
    save_every = 'save a checkpoint every N optimizer steps (0: only at the end, with --save)',
    save_async = 'write checkpoints on a background thread while training goes on',
    keep = 'keep the newest N checkpoints (0: all)',
    resume = "'auto' (the newest complete checkpoint in --save, or a fresh start) or a checkpoint directory",
    stop_after = 'stop after N optimizer steps, saving first (the schedule is the full run\'s)',
    zero_init_residual = 'ResNets: blocks start as the identity (last batch-norm scale 0, Goyal et al. 2017)',
    checkpoint_activations = "none, blocks or stages: recompute those in backward instead of keeping their activations",
    nan_check = "loss: a non-finite loss stops the run, naming the step and the first module whose output went non-finite; "
      .. "modules: every module's output checked in every forward (slow); off (default: DLUA_NAN_CHECK, else loss)",
    metrics = 'write one JSON line per step (loss, lr, img/s, time by phase, memory), per epoch and a summary to FILE (rank 0)',
  },
})

io.stdout:setvbuf('line') -- progress lines appear as they happen, also in a log file
if opt.threads > 0 then dlua.set_num_threads(opt.threads) end
dlua.manual_seed(opt.seed)
-- Several ranks (dlua --nproc N, torchrun, Slurm...): DDP, a DistributedSampler, rank 0 prints.
local dist = dlua.dist
local world_env = tonumber(os.getenv('WORLD_SIZE') or os.getenv('SLURM_NTASKS') or os.getenv('OMPI_COMM_WORLD_SIZE') or '1') or 1
local distributed = world_env > 1
if opt.zero ~= 0 and opt.zero ~= 1 and opt.zero ~= 2 and opt.zero ~= 3 then error('--zero: 0 (DDP), 1, 2 or 3', 0) end
if opt.offload and opt.zero == 0 then error('--offload needs --zero 1, 2 or 3', 0) end
local rank, world = 0, 1
if distributed or opt.zero > 0 then
  dist.init()
  rank, world = dist.rank(), dist.world_size()
end
local print = rank == 0 and print or function() end

local root = opt.data ~= '' and opt.data or nil
local train = data.FashionMNIST({ root = root, train = true })
local test = data.FashionMNIST({ root = root, train = false })
if opt.limit > 0 and opt.limit < train:size() then train = train:narrow(1, opt.limit) end
if opt.eval_limit > 0 and opt.eval_limit < test:size() then test = test:narrow(1, opt.eval_limit) end

local build = resnet[opt.model]
if not build then error(('unknown --model %s (resnet20, resnet32, resnet56, small_cnn)'):format(opt.model), 0) end
-- Each model's usual SGD rate: 0.1 for the ResNets (He et al. 2016: batch-norm throughout, a 64-wide classifier
-- after global pooling); 0.01 for small_cnn, whose classifier reads 3136 features directly: at 0.1 (with
-- Nesterov momentum 0.9) its first epoch diverges, in PyTorch as here.
local model_lr = { resnet20 = 0.1, resnet32 = 0.1, resnet56 = 0.1, small_cnn = 0.01 }
if opt.lr == 0 then opt.lr = model_lr[opt.model] or 0.1 end
local net = build({ in_channels = 1, num_classes = 10, zero_init_residual = opt.zero_init_residual })
  :input_grad(false) -- the images need no gradient
local ckpt_policy = opt.checkpoint_activations
if ckpt_policy ~= 'none' and ckpt_policy ~= 'blocks' and ckpt_policy ~= 'stages' then
  error(('--checkpoint-activations %s: expected none, blocks or stages'):format(ckpt_policy), 0)
end
local ckpt_plan = net:checkpoint(ckpt_policy)
local model = opt.zero > 0 and dist.ZeRO(net, { stage = opt.zero, offload = opt.offload }) or distributed and dist.DDP(net) or net
local criterion = nn.CrossEntropyLoss({ label_smoothing = opt.label_smoothing })
local sgd = optim.SGD(model, {
  lr = opt.lr, momentum = opt.momentum, nesterov = true, weight_decay = opt.weight_decay,
  groups = { { filter = function(_, p) return p:dim() <= 1 end, weight_decay = 0 } },
})
-- One data order for any number of ranks (a DistributedSampler of 1 when alone), so a checkpoint's
-- cursor can continue on another world size.
local sampler = data.DistributedSampler({ n = train:size(), num_replicas = world, rank = rank, shuffle = true, seed = opt.seed,
  drop_last = true })
local steps_per_epoch = data.num_batches(sampler:len(), { batch = opt.batch, drop_last = true })
local total = opt.epochs * steps_per_epoch
local warm = math.min(math.floor(opt.warmup * steps_per_epoch), total - 1)
local schedule = warm > 0
    and lr.sequential({ lr.linear_warmup({ lr = opt.lr, steps = warm, start_factor = 0.1 }),
      lr.cosine({ lr = opt.lr, steps = total - warm }) })
    or lr.cosine({ lr = opt.lr, steps = total })

print(net)
if ckpt_policy ~= 'none' then print(tostring(ckpt_plan)) end
print(('%d parameters, %d steps of %d images%s, lr %s, %d threads%s'):format(net:num_parameters(), total, opt.batch,
  distributed and ' per rank' or '', tostring(schedule), dlua.get_num_threads(), distributed and (' per rank, %d ranks'):format(world) or ''))
if opt.zero > 0 then print(model:memory_line()) end

-- A redrawn progress bar on a terminal, plain periodic lines otherwise (LuaJIT has no isatty).
local tty
do
  local st = os.execute('test -t 1')
  tty = st == true or st == 0
end

local function progress_line(epoch, i, n, loss, ips, eta)
  local line = ('epoch %d  %5d/%d  loss %.4f  %6.0f img/s  ETA %ds'):format(epoch, i, n, loss, ips, eta)
  if tty then
    local width = 20
    local done = math.floor(width * i / n)
    io.stdout:write('\r[' .. string.rep('=', done) .. string.rep(' ', width - done) .. '] ' .. line)
    io.stdout:flush()
  elseif i % opt.print_every == 0 or i == n then
    print(line)
  end
end

local mean, std = train.mean, train.std
local function to_input(x)
  if opt.channels_last then return x:contiguous('channels_last') end
  return x
end

-- Under DDP each rank evaluates samples rank+1, rank+1+world, ... and the counts are summed.
local eval_set = test
if distributed then
  local mine = {}
  for i = rank + 1, test:size(), world do mine[#mine + 1] = i end
  mine = dlua.tensor(mine, { dtype = 'int64' })
  eval_set = data.TensorDataset(test.x:index_select(1, mine), test.y:index_select(1, mine))
end
local function evaluate()
  model:evaluate()
  local correct, seen = 0, 0
  for _, x, y in data.batches(eval_set, { batch = opt.eval_batch, mean = mean, std = std }) do
    local logits = model:forward(to_input(x))
    correct = correct + logits:argmax(2):eq(y):sum():item()
    seen = seen + y:numel()
  end
  model:train()
  if distributed then
    local c = dlua.tensor({ correct, seen }, { dtype = 'float64' })
    dist.all_reduce(c, 'sum')
    correct, seen = c[1], c[2]
  end
  return correct / seen
end

-- This rank's training samples of an epoch: its DistributedSampler share.
local function epoch_set(epoch)
  local idx = sampler:indices(epoch)
  return data.TensorDataset(train.x:index_select(1, idx), train.y:index_select(1, idx))
end

-- --clip-grad: the gradient norms before clipping, summarised per epoch.
local clip = { n = 0, sum = 0, max = 0, clipped = 0 }
function clip:add(norm)
  self.n, self.sum, self.max = self.n + 1, self.sum + norm, math.max(self.max, norm)
  if norm > opt.clip_grad then self.clipped = self.clipped + 1 end
end
function clip:report()
  if self.n == 0 then return end
  print(('clip-grad %g: gradient norm mean %.4g, max %.4g; clipped %d of %d steps'):format(opt.clip_grad,
    self.sum / self.n, self.max, self.clipped, self.n))
  self.n, self.sum, self.max, self.clipped = 0, 0, 0, 0
end

-- Checkpoints: everything the run continues from. The epoch's running sums are each rank's own.
local progress = { step = 0, images = 0 }  -- optimizer steps; images trained on, all ranks
local meter = { loss_sum = 0, images = 0 }
function meter:state_dict()
  return { loss_sum = self.loss_sum, images = self.images, clip = { n = clip.n, sum = clip.sum, max = clip.max, clipped = clip.clipped } }
end
function meter:load_state_dict(sd)
  self.loss_sum, self.images = sd.loss_sum, sd.images
  for k, v in pairs(sd.clip) do clip[k] = v end
end
local state = { model = model, optimizer = sgd, schedule = schedule, sampler = sampler, rng = dlua.default_generator(),
  progress = progress, meter = ckpt.per_rank(meter), comm = model ~= net and ckpt.comm_state(model) or nil, options = opt }
local function save_checkpoint()
  if opt.save == '' then return end
  ckpt.save(opt.save, state, { step = progress.step, keep = opt.keep > 0 and opt.keep or nil, async = opt.save_async })
end
-- The step boundary: the NaN guard, `dlua attach` (read the loss, change the learning rate, save, stop).
local mon = monitor.Monitor({ model = model, optimizer = sgd, schedule = schedule, save = opt.save ~= '' and save_checkpoint or nil,
  nan_check = opt.nan_check, print = print, state = { progress = progress, sampler = sampler, net = net, opt = opt } })
opt.resume = monitor.resume_option(opt.resume, opt.save)  -- a job restarted by --max-restarts resumes from its newest checkpoint
local resumed_epoch, resumed_info
if opt.resume ~= '' then
  local saved_opts = {}
  state.options = saved_opts
  -- on another world size the schedule and the step count follow the images trained on; the epoch's sums restart
  local info = ckpt.resume(opt.resume, opt.save, state, { skip_if_resharded = { 'schedule', 'meter', 'comm' } })
  state.options = opt
  if info then
    for _, k in ipairs({ 'model', 'batch', 'lr', 'epochs', 'warmup', 'momentum', 'weight_decay', 'seed', 'limit', 'label_smoothing', 'clip_grad' }) do
      if saved_opts[k] ~= opt[k] then
        print(('warning: --%s is %s, the checkpoint was saved with %s'):format(k:gsub('_', '-'), tostring(opt[k]), tostring(saved_opts[k])))
      end
    end
    if info.resharded then progress.step = math.floor(progress.images / (opt.batch * world)) end
    resumed_epoch, resumed_info = sampler.epoch, info
    print(('resumed from %s: step %d, epoch %d%s'):format(info.path, progress.step, sampler.epoch,
      info.resharded and (' (saved by %d ranks, now %d)'):format(info.world_size, world) or ''))
  end
end
mon:restarted(resumed_info, progress.step)

local step = progress.step
local stopped = false
local mw = metrics.Writer(opt.metrics, { rank = rank, model = model, run = { recipe = 'fashion_mnist', options = opt, world = world } })
local t_start = dlua.perf_counter()
for epoch = resumed_epoch or 1, opt.epochs do
  sampler:set_epoch(epoch)
  if epoch ~= resumed_epoch then meter.loss_sum, meter.images = 0, 0 end
  local t0 = dlua.perf_counter()
  local fresh = 0  -- images this run trained on in this epoch (for img/s)
  mw:start_epoch(epoch)
  for i, x, y in data.batches(epoch_set(epoch), { batch = opt.batch, skip = sampler:skip(epoch),
    seed = opt.seed * 1000 + rank, epoch = epoch, drop_last = true, augment = { crop_pad = 2, flip = true }, mean = mean, std = std }) do
    sgd:set_lr(mon:lr(step))
    sgd:zero_grad()
    local input = to_input(x)
    mw:phase('data')
    local out = model:forward(input)
    local loss = mon:check_loss(criterion:forward(out, y):item(), input)
    mw:phase('forward')
    model:backward(input, criterion:backward(out, y))
    mw:phase('backward')
    if opt.clip_grad > 0 then  -- after DDP's all-reduce; under ZeRO over every rank's shard
      clip:add(opt.zero > 0 and model:clip_grad_norm_(opt.clip_grad) or nn.utils.clip_grad_norm_(model, opt.clip_grad))
    end
    sgd:step()
    mw:phase('optimizer')
    mw:step({ step = step + 1, loss = loss, lr = schedule(step), images = y:numel() * world })
    step = step + 1
    meter.loss_sum, meter.images, fresh = meter.loss_sum + loss * y:numel(), meter.images + y:numel(), fresh + y:numel()
    sampler:advance(y:numel())
    progress.step, progress.images = step, progress.images + y:numel() * world
    local dt = dlua.perf_counter() - t0
    if rank == 0 then
      progress_line(epoch, i, steps_per_epoch, meter.loss_sum / meter.images, fresh * world / dt, math.floor((total - step) * dt / fresh * opt.batch))
    end
    if opt.save_every > 0 and step % opt.save_every == 0 then save_checkpoint() end
    if mon:step(step, loss) or opt.stop_after > 0 and step >= opt.stop_after then
      stopped = true
      break
    end
  end
  if stopped then break end
  if tty then io.stdout:write('\n') end
  local dt = dlua.perf_counter() - t0
  local ips, loss_sum, images = fresh / dt, meter.loss_sum, meter.images
  local loss_avg = loss_sum / images
  if distributed then  -- img/s summed over ranks, loss over every rank's images
    local t = dlua.tensor({ ips, loss_sum, images }, { dtype = 'float64' })
    dist.all_reduce(t, 'sum')
    ips, loss_avg = t[1], t[2] / t[3]
  end
  local accuracy = evaluate()
  print(('epoch %d  train loss %.4f  test accuracy %.4f  img/s %.0f'):format(epoch, loss_avg, accuracy, ips))
  mw:epoch({ train_loss = loss_avg, test_accuracy = accuracy, img_s = ips })
  clip:report()
end
-- The end, or --stop-after: the last state saved (unless the last step just was), then a checksum of the
-- parameters and buffers, so runs can be compared bit for bit.
if opt.save ~= '' and not (opt.save_every > 0 and step % opt.save_every == 0 and step > 0) then save_checkpoint() end
ckpt.wait()
if stopped then print(('stopped after step %d'):format(step)) else print(('done in %.0f s'):format(dlua.perf_counter() - t_start)) end
local crc = ckpt.crc32(model)  -- ZeRO-3: its gathered state dict
print('parameters crc32 ' .. crc)
mw:close({ parameters_crc32 = crc })
if dist.is_initialized() then dist.destroy() end
