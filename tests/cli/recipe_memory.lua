-- The plan's model-state memory per rank against what dist.ZeRO holds (ZeRO-1/2/3, SGD and AdamW), under `dlua --nproc N`.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local recipe = require 'dlua.recipe'
local V = require 'dlua.recipe.validate'
local P = require 'dlua.recipe.plan'
local resnet = require 'models.resnet'

local e = recipe.setup({ device = 'cpu' })
local bad = 0
for _, name in ipairs({ 'sgd', 'adamw' }) do
  for stage = 1, 3 do
    dlua.manual_seed(1)
    local net = resnet.resnet20({ in_channels = 1, num_classes = 10 })
    local z = dlua.dist.ZeRO(net, { stage = stage })
    local o = name == 'sgd' and optim.SGD(z, { lr = 0.1, momentum = 0.9 }) or optim.AdamW(z, { lr = 1e-3 })
    local x, y = dlua.randn({ 4, 1, 28, 28 }), dlua.tensor({ 1, 2, 3, 4 }, { dtype = 'int64' })
    local crit = nn.CrossEntropyLoss()
    local out = z:forward(x)
    crit:forward(out, y)
    z:backward(x, crit:backward(out, y))
    o:step()  -- the optimizer state exists from the first step
    local m = z:memory()
    local c = V.validate({ model = net, data = { batch = 4 }, optim = { name = name }, parallel = { zero = stage } }, e.world, e.local_world)
    local est = P.memory(c, net:num_parameters())
    for _, k in ipairs({ 'parameters', 'gradients', 'optimizer' }) do
      local r = est[k] / m[k]
      local ok = math.abs(r - 1) <= 0.10
      if not ok then bad = bad + 1 end
      if e.rank == 0 then
        print(string.format('%s %s ZeRO-%d %s: plan %.0f B, ZeRO holds %.0f B (%.3f)', ok and 'ok  ' or 'FAIL', name, stage, k, est[k], m[k], r))
      end
    end
  end
end
recipe.teardown()
if bad > 0 then os.exit(1) end
