-- Fashion-MNIST with a CIFAR-style ResNet-20 on dlua.recipe.train: SGD + Nesterov, warmup then cosine, crop/flip augmentation.
-- Under `dlua --nproc N` (or torchrun, Slurm, mpirun) it trains data-parallel, each rank on its share of every epoch.
--   dlua recipes/fashion_mnist.lua --epochs 10                 # ResNet-20, about 93% test accuracy
--   dlua --nproc 4 recipes/fashion_mnist.lua --zero 2 --limit 4096
--   dlua recipes/fashion_mnist.lua --config my.lua --dry-run    # options from a Lua table; the plan, no training
local recipe = require 'dlua.recipe'
local nn = require 'dlua.nn'
local resnet = require 'models.resnet'

local opt = recipe.options.parse(arg, {
  epochs = 10, batch = 128, lr = 0, weight_decay = 5e-4, warmup = 1, nesterov = true, model = 'resnet20',
  eval_batch = 1000, zero_init_residual = true, print_every = 100,
}, {
  description = 'Trains a ResNet on Fashion-MNIST (Debian package dataset-fashion-mnist).',
  help = {
    lr = "peak learning rate (after warmup); 0: the model's own, 0.1 for the ResNets, 0.01 for small_cnn",
    model = 'resnet20, resnet32, resnet56 or small_cnn',
    data = 'folder holding the Fashion-MNIST IDX files (default: the Debian package)',
    zero_init_residual = 'ResNets: blocks start as the identity (last batch-norm scale 0, Goyal et al. 2017)',
  },
})
-- Each model's usual SGD rate: 0.1 for the ResNets (batch-norm throughout, a 64-wide classifier after
-- global pooling); 0.01 for small_cnn, whose classifier reads 3136 features directly: at 0.1 (with
-- Nesterov momentum 0.9) its first epoch diverges, in PyTorch as here.
local build = resnet[opt.model]
if not build then error(('unknown --model %s (resnet20, resnet32, resnet56, small_cnn)'):format(opt.model), 0) end
if opt.lr == 0 then opt.lr = ({ small_cnn = 0.01 })[opt.model] or 0.1 end

local run = recipe.options.to_train(opt)
run.name, run.progress = 'fashion_mnist', 'bar'
run.data.source, run.data.root = 'fashion_mnist', opt.data  -- --data: where the IDX files are
run.model = function(info)
  return build({ in_channels = info.channels, num_classes = info.classes, zero_init_residual = opt.zero_init_residual })
end
run.loss = nn.CrossEntropyLoss({ label_smoothing = opt.label_smoothing })
recipe.train(run)
