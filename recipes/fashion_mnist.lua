-- Fashion-MNIST with a CIFAR-style ResNet-20: SGD + Nesterov, warmup then cosine, crop/flip augmentation.
-- Under `dlua --nproc N` it trains data-parallel (dlua.dist.DDP), each rank on its share of every epoch.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local lr = require 'dlua.lr'
local data = require 'dlua.data'
local cli = require 'dlua.cli'
local resnet = require 'models.resnet'

local opt = cli.parse(arg, {
  epochs = 10, batch = 128, lr = 0, momentum = 0.9, weight_decay = 5e-4, warmup = 1,
  label_smoothing = 0.0, model = 'resnet20', threads = 0, seed = 1, data = '',
  limit = 0, eval_limit = 0, eval_batch = 1000, channels_last = true, zero_init_residual = true,
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
    zero_init_residual = 'ResNets: blocks start as the identity (last batch-norm scale 0, Goyal et al. 2017)',
  },
})

io.stdout:setvbuf('line') -- progress lines appear as they happen, also in a log file
if opt.threads > 0 then dlua.set_num_threads(opt.threads) end
dlua.manual_seed(opt.seed)
-- Several ranks (dlua --nproc N, torchrun, Slurm...): DDP, a DistributedSampler, rank 0 prints.
local dist = dlua.dist
local world_env = tonumber(os.getenv('WORLD_SIZE') or os.getenv('SLURM_NTASKS') or os.getenv('OMPI_COMM_WORLD_SIZE') or '1') or 1
local distributed = world_env > 1
local rank, world = 0, 1
if distributed then
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
local model = distributed and dist.DDP(net) or net
local criterion = nn.CrossEntropyLoss({ label_smoothing = opt.label_smoothing })
local sgd = optim.SGD(model, {
  lr = opt.lr, momentum = opt.momentum, nesterov = true, weight_decay = opt.weight_decay,
  groups = { { filter = function(_, p) return p:dim() <= 1 end, weight_decay = 0 } },
})
local sampler = distributed and data.DistributedSampler({ n = train:size(), shuffle = true, seed = opt.seed, drop_last = true })
local steps_per_epoch = data.num_batches(distributed and sampler:len() or train, { batch = opt.batch, drop_last = true })
local total = opt.epochs * steps_per_epoch
local warm = math.min(math.floor(opt.warmup * steps_per_epoch), total - 1)
local schedule = warm > 0
    and lr.sequential({ lr.linear_warmup({ lr = opt.lr, steps = warm, start_factor = 0.1 }),
      lr.cosine({ lr = opt.lr, steps = total - warm }) })
    or lr.cosine({ lr = opt.lr, steps = total })

print(net)
print(('%d parameters, %d steps of %d images%s, lr %s, %d threads%s'):format(net:num_parameters(), total, opt.batch,
  distributed and ' per rank' or '', tostring(schedule), dlua.get_num_threads(), distributed and (' per rank, %d ranks'):format(world) or ''))

-- A redrawn progress bar on a terminal, plain periodic lines otherwise (LuaJIT has no isatty).
local tty
do
  local st = os.execute('test -t 1')
  tty = st == true or st == 0
end

local function progress(epoch, i, n, loss, ips, eta)
  local line = ('epoch %d  %5d/%d  loss %.4f  %6.0f img/s  ETA %ds'):format(epoch, i, n, loss, ips, eta)
  if tty then
    local width = 20
    local done = math.floor(width * i / n)
    io.stdout:write('\r[' .. string.rep('=', done) .. string.rep(' ', width - done) .. '] ' .. line)
    io.stdout:flush()
  elseif i % 100 == 0 or i == n then
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

-- This rank's training samples of an epoch: all of them, or its DistributedSampler share.
local function epoch_set(epoch)
  if not distributed then return train end
  local idx = sampler:indices(epoch)
  return data.TensorDataset(train.x:index_select(1, idx), train.y:index_select(1, idx))
end

local step = 0
local t_start = dlua.perf_counter()
for epoch = 1, opt.epochs do
  local t0, loss_sum, images = dlua.perf_counter(), 0, 0
  for i, x, y in data.batches(epoch_set(epoch), { batch = opt.batch, shuffle = not distributed,
    seed = opt.seed * 1000 + rank, epoch = epoch, drop_last = true, augment = { crop_pad = 2, flip = true }, mean = mean, std = std }) do
    sgd:set_lr(schedule(step))
    sgd:zero_grad()
    local input = to_input(x)
    local out = model:forward(input)
    local loss = criterion:forward(out, y):item()
    model:backward(input, criterion:backward(out, y))
    sgd:step()
    step = step + 1
    loss_sum, images = loss_sum + loss * y:numel(), images + y:numel()
    local dt = dlua.perf_counter() - t0
    if rank == 0 then
      progress(epoch, i, steps_per_epoch, loss_sum / images, images * world / dt, math.floor((total - step) * dt / i))
    end
  end
  if tty then io.stdout:write('\n') end
  local dt = dlua.perf_counter() - t0
  local ips, loss_avg = images / dt, loss_sum / images
  if distributed then  -- img/s summed over ranks, loss over every rank's images
    local t = dlua.tensor({ ips, loss_sum, images }, { dtype = 'float64' })
    dist.all_reduce(t, 'sum')
    ips, loss_avg = t[1], t[2] / t[3]
  end
  print(('epoch %d  train loss %.4f  test accuracy %.4f  img/s %.0f'):format(epoch, loss_avg, evaluate(), ips))
end
print(('done in %.0f s'):format(dlua.perf_counter() - t_start))
if distributed then dist.destroy() end
