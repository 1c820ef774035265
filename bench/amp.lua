-- dlua side of bench/amp: ResNet training steps in float32, bf16 or f16 (dlua.amp autocast; f16 with the
-- GradScaler); prints `img/s<TAB>v<TAB>mean_img_s<TAB>v<TAB>cpu_ms<TAB>v<TAB>peak_mb<TAB>v` (img/s of the fastest step and
-- of all; the process's CPU time per step, all threads; peak: tensor memory during the timed steps).
-- usage: dlua bench/amp.lua PRECISION THREADS STEPS BATCH [MODEL SIZE]   (MODEL resnet20 | resnet50)
local dlua = require 'dlua'
local nn, optim, amp = dlua.nn, dlua.optim, dlua.amp
local resnet = require 'models.resnet'

local prec, threads, steps, batch = arg[1], tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4])
local model_name, size = arg[5] or 'resnet20', tonumber(arg[6] or 28)
dlua.set_num_threads(threads)
dlua.manual_seed(0)
local spec = amp.from_spec(prec)
local model, x
if model_name == 'resnet50' then
  model = resnet.resnet50({ num_classes = 100 }):input_grad(false)
  x = dlua.randn(batch, 3, size, size):contiguous('channels_last')
else
  model = resnet.resnet20({ in_channels = 1, num_classes = 10 }):input_grad(false)
  x = dlua.randn(batch, 1, size, size):contiguous('channels_last')
end
local opt = optim.SGD(model, { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 5e-4 })
local crit = nn.CrossEntropyLoss()
local y = dlua.randint(1, 11, batch)
local scaler = spec.scaler or amp.GradScaler({ enabled = false })

local function fwd()
  local out = model:forward(x)
  return out, crit:forward(out, y)
end
local function step()
  opt:zero_grad()
  local out, loss = amp.run(spec, fwd)
  model:backward(x, scaler:scale(crit:backward(out, y)))
  scaler:step(opt)
  return loss:item()
end

for _ = 1, 3 do step() end -- warm-up: primitive creation, allocator
collectgarbage()
dlua.reset_peak_memory_stats()
local base = dlua.memory_allocated()
-- img/s over the fastest step (on a shared machine the slow ones measure the neighbours) and over all of them
local best, t_all, c_all = math.huge, dlua.perf_counter(), os.clock()
for _ = 1, steps do
  local t0 = dlua.perf_counter()
  step()
  best = math.min(best, dlua.perf_counter() - t0)
end
local mean, cpu = (dlua.perf_counter() - t_all) / steps, (os.clock() - c_all) / steps
print(('img/s\t%.1f\tmean_img_s\t%.1f\tcpu_ms\t%.1f\tpeak_mb\t%.1f'):format(batch / best, batch / mean, cpu * 1e3,
  (dlua.memory_peak() - base) / 2 ^ 20))
