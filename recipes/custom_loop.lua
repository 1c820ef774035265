-- A hand-written loop on dlua.recipe.trainer: the learning-rate range test (Smith 2017) on Fashion-MNIST.
--   dlua recipes/custom_loop.lua --steps 100              # the lr from 1e-5 up to 1, exponentially; stops when the loss explodes
--   dlua --nproc 2 recipes/custom_loop.lua --limit 4096   # the same under DDP: the trainer reduces, rank 0 prints
local dlua = require 'dlua'
local data = require 'dlua.data'
local recipe = require 'dlua.recipe'
local resnet = require 'models.resnet'

local opt = dlua.cli.parse(arg, { model = 'small_cnn', batch = 64, steps = 100, lr_min = 1e-5, lr_max = 1, limit = 0,
  threads = 0, seed = 1, device = 'auto', smooth = 0.9, data = '' }, {
  description = 'Learning-rate range test: raises the lr each step and prints the smoothed loss, then the lr to pick.',
  help = { steps = 'optimizer steps from --lr-min to --lr-max (exponentially)', smooth = 'the loss\'s exponential smoothing',
    limit = 'use the first N training images only (0: all)', data = 'folder with the Fashion-MNIST IDX files (default: the package)' },
})

-- The primitives: the job (any world size), rank 0's logger, this rank's share of the data.
local env = recipe.setup({ device = opt.device, threads = opt.threads, seed = opt.seed })
local log = recipe.Logger({ rank = env.rank })
local train = data.FashionMNIST({ root = opt.data ~= '' and opt.data or nil, train = true })
if opt.limit > 0 and opt.limit < train:size() then train = train:narrow(1, opt.limit) end
local sampler = data.DistributedSampler({ n = train:size(), shuffle = true, seed = opt.seed, drop_last = true })
local loader = recipe.MemoryLoader({ dataset = train, sampler = sampler, batch = opt.batch, drop_last = true,
  seed = opt.seed * 1000 + env.rank, augment = { crop_pad = 2, flip = true } })

-- The trainer does one step at a time; this loop owns the learning rate (no schedule).
local t = recipe.trainer({ model = resnet[opt.model]({ in_channels = 1, num_classes = 10 }):input_grad(false),
  optim = { name = 'sgd', lr = opt.lr_min, momentum = 0.9, weight_decay = 5e-4 }, sampler = sampler, env = env, log = log })
log:print('%s on %d rank(s), batch %d per rank, lr %g .. %g over %d steps', opt.model, env.world, opt.batch, opt.lr_min,
  opt.lr_max, opt.steps)

local ratio = (opt.lr_max / opt.lr_min) ^ (1 / math.max(opt.steps - 1, 1))
local avg, best, best_lr, steepest, steepest_lr, prev = 0, math.huge, opt.lr_min, 0, opt.lr_min, nil
local lr, step, epoch = opt.lr_min, 0, 1
while step < opt.steps do
  sampler:set_epoch(epoch)
  for _, x, y in loader:batches(epoch) do
    t.optimizer:set_lr(lr)
    local loss = t:step(x, y):item()
    local l = dlua.tensor({ loss }, { dtype = 'float64' })
    dlua.dist.all_reduce(l, 'avg')  -- every rank sees the same loss, so every rank stops at the same step
    avg = opt.smooth * avg + (1 - opt.smooth) * l[1]
    local smoothed = avg / (1 - opt.smooth ^ (step + 1))  -- bias-corrected, as fastai's
    step = step + 1
    log:print('step %3d  lr %.3e  loss %.4f  smoothed %.4f', step, lr, l[1], smoothed)
    if smoothed < best then best, best_lr = smoothed, lr end
    if prev and prev - smoothed > steepest then steepest, steepest_lr = prev - smoothed, lr end
    prev = smoothed
    if smoothed ~= smoothed or smoothed > 4 * best or step >= opt.steps then break end
    lr = lr * ratio
  end
  if step >= opt.steps or prev ~= prev or prev > 4 * best then break end
  epoch = epoch + 1
end
log:print('lowest smoothed loss %.4f at lr %.3e; steepest descent at lr %.3e; suggested lr %.3e (a tenth of the lowest)',
  best, best_lr, steepest_lr, best_lr / 10)
recipe.teardown()
