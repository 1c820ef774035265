-- dlua side of bench/fmnist_cpu: ResNet-20 training steps on Fashion-MNIST-shaped batches; prints `img/s<TAB>value`.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local resnet = require 'models.resnet'

local threads, steps, batch, fmt = tonumber(arg[1]), tonumber(arg[2]), tonumber(arg[3]), arg[4]
dlua.set_num_threads(threads)
dlua.manual_seed(0)
local model = resnet.resnet20({ in_channels = 1, num_classes = 10 }):input_grad(false) -- as torch: data needs no grad
local opt = optim.SGD(model, { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 5e-4 })
local crit = nn.CrossEntropyLoss()
local x = dlua.randn(batch, 1, 28, 28)
if fmt == 'nhwc' then x = x:contiguous('channels_last') end
local y = dlua.randint(1, 11, batch)

local function step()
  opt:zero_grad()
  local out = model:forward(x)
  local loss = crit:forward(out, y):item()
  model:backward(x, crit:backward(out, y))
  opt:step()
  return loss
end

for _ = 1, 3 do step() end -- warm-up: primitive creation, allocator
local t0 = dlua.perf_counter()
for _ = 1, steps do step() end
print(('img/s\t%.1f'):format(steps * batch / (dlua.perf_counter() - t0)))
