-- dlua side of bench/ddp_cpu: DDP training steps on random batches, under `dlua --nproc N`: ResNet-20 on 1x28x28
-- (Fashion-MNIST's shape) or ResNet-18 on 3x32x32.
-- usage: dlua --nproc N bench/ddp_cpu.lua <steps> <batch per rank> [resnet20|resnet18]; rank 0 prints
-- `img/s<TAB>value` (all ranks together).
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local resnet = require 'models.resnet'
local dist = dlua.dist

local steps, batch, which = tonumber(arg[1]), tonumber(arg[2]), arg[3] or 'resnet20'
dlua.set_num_threads(tonumber(os.getenv('OMP_NUM_THREADS') or '1'))
dist.init()
local rank, world = dist.rank(), dist.world_size()
dlua.manual_seed(0)
local net, c, hw
if which == 'resnet18' then
  net, c, hw = resnet.resnet18({ num_classes = 10 }), 3, 32
else
  net, c, hw = resnet.resnet20({ in_channels = 1, num_classes = 10 }), 1, 28
end
-- DDP_BROADCAST_BUFFERS=0: without the buffers' broadcast before each forward (its cost; torch's side keeps its default)
local model = dist.DDP(net:input_grad(false), { broadcast_buffers = os.getenv('DDP_BROADCAST_BUFFERS') ~= '0' })
local opt = optim.SGD(model, { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 5e-4 })
local crit = nn.CrossEntropyLoss()
dlua.manual_seed(1 + rank)  -- each rank its own data
local x = dlua.randn(batch, c, hw, hw)
x = x:contiguous('channels_last')  -- channels-last input, as bench/fmnist_cpu
local y = dlua.randint(1, 11, batch)

local function step()
  opt:zero_grad()
  local out = model:forward(x)
  local loss = crit:forward(out, y):item()
  model:backward(x, crit:backward(out, y))
  opt:step()
  return loss
end

for _ = 1, 3 do step() end -- warm-up: primitive creation, allocator, connections
dist.barrier()
local t0 = dlua.perf_counter()
for _ = 1, steps do step() end
model:wait()
local elapsed = dlua.tensor({ dlua.perf_counter() - t0 }, { dtype = 'float64' })
dist.all_reduce(elapsed, 'max')  -- the job's pace is its slowest rank's
if rank == 0 then print(('img/s\t%.1f'):format(world * steps * batch / elapsed[1])) end
dist.destroy()
