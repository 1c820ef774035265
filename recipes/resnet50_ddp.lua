-- ResNet-50 with DDP on dlua.recipe.train: every local GPU (NCCL) or `dlua --nproc N` CPU ranks (gloo); Fashion-MNIST built in, or an ImageFolder.
--   dlua --nproc 2 recipes/resnet50_ddp.lua --limit 2048            # 2 CPU ranks, built-in data (3 channels, resized)
--   dlua --nproc 4 recipes/resnet50_ddp.lua --pipeline 2 --chunks 4  # 2 pipelines of 2 stages (docs/pipeline.md)
--   dlua --nproc 4 recipes/resnet50_ddp.lua --zero 2 --accumulate 2 --save /tmp/r50 --save-every 100
--   dlua --nproc gpu recipes/resnet50_ddp.lua --data /data/imagenet --image-size 224 --batch 256 --amp bf16
--   dlua recipes/resnet50_ddp.lua --config run.lua --dry-run         # options from a Lua table; the plan, no training
local recipe = require 'dlua.recipe'
local resnet = require 'models.resnet'

local opt = recipe.options.parse(arg, {
  model = 'resnet50', batch = 32, lr = 0.1, lr_per = 256, warmup = 5, weight_decay = 1e-4, image_size = 32,
  eval_batch = 250, zero_init_residual = true,
}, {
  description = 'Trains a ResNet (default ResNet-50) data-parallel with dlua.dist.DDP, through dlua.recipe.train.',
  help = {
    model = 'resnet18, resnet34, resnet50, resnet101, resnet152',
    zero_init_residual = 'blocks start as the identity (last batch-norm scale 0, Goyal et al. 2017)',
  },
})
local build = resnet[opt.model]
if not build then error(('unknown --model %s'):format(opt.model), 0) end

local run = recipe.options.to_train(opt)
run.name, run.data.channels = 'resnet50_ddp', 3  -- Fashion-MNIST's grey images repeated into RGB
run.model = function(info)
  return build({ in_channels = 3, num_classes = info.classes, zero_init_residual = opt.zero_init_residual })
end
recipe.train(run)
