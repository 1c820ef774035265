-- ResNets: torchvision's v1.5 ResNet-18..152 (same parameter names), CIFAR-style ResNet-20/32/56, a small CNN.
local nn = require 'dlua.nn'

local M = {}

-- The blocks (conv1, bn1, conv2, bn2[, conv3, bn3], downsample, as torchvision's) are dlua.nn's fusing
-- residual blocks: batch-norm + ReLU, the residual add and the gradients' memory are handled there.
M.BasicBlock, M.Bottleneck = nn.BasicBlock, nn.Bottleneck

local function conv1x1(cin, cout, stride)
  return nn.Conv2d(cin, cout, 1, { stride = stride or 1, bias = false })
end

-- A stage of `blocks` blocks; the first changes the shape (stride, channels) through a 1x1 projection.
local function make_layer(block, cin, planes, blocks, stride, opts)
  local downsample
  if stride ~= 1 or cin ~= planes * block.expansion then
    downsample = nn.Sequential(conv1x1(cin, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion))
  end
  local layer = nn.Sequential(block(cin, planes, stride, downsample, opts))
  for _ = 2, blocks do layer:add(block(planes * block.expansion, planes, 1, nil, opts)) end
  return layer, planes * block.expansion
end

---------------------------------------------------------------------------------------------
-- ImageNet ResNets (torchvision layout and names): a Sequential of named children.

local ResNet = nn.Sequential:extend('ResNet')
M.ResNet = ResNet

-- opts: num_classes (1000), in_channels (3), zero_init_residual (false).
function ResNet:__init(block, layers, opts)
  opts = opts or {}
  local c = 64
  self:add(nn.Conv2d(opts.in_channels or 3, 64, 7, { stride = 2, padding = 3, bias = false }), 'conv1')
  self:add(nn.BatchNorm2d(64, { relu = true }), 'bn1')
  self:add(nn.MaxPool2d(3, { stride = 2, padding = 1 }), 'maxpool')
  local planes = { 64, 128, 256, 512 }
  for i = 1, 4 do
    local layer
    layer, c = make_layer(block, c, planes[i], layers[i], i == 1 and 1 or 2, opts)
    self:add(layer, 'layer' .. i)
  end
  self:add(nn.AdaptiveAvgPool2d(1), 'avgpool')
  self:add(nn.Flatten(), 'flatten') -- (a Module method too, so reached as model:get(-2), not model.flatten)
  self:add(nn.Linear(c, opts.num_classes or 1000), 'fc')
end

function M.resnet18(opts) return ResNet(M.BasicBlock, { 2, 2, 2, 2 }, opts) end
function M.resnet34(opts) return ResNet(M.BasicBlock, { 3, 4, 6, 3 }, opts) end
function M.resnet50(opts) return ResNet(M.Bottleneck, { 3, 4, 6, 3 }, opts) end
function M.resnet101(opts) return ResNet(M.Bottleneck, { 3, 4, 23, 3 }, opts) end
function M.resnet152(opts) return ResNet(M.Bottleneck, { 3, 8, 36, 3 }, opts) end

---------------------------------------------------------------------------------------------
-- CIFAR-style ResNets (He et al. 2016, section 4.2): 3x3 stem with 16 channels, three stages
-- of n blocks (16, 32, 64 channels), 6n+2 layers. Shortcuts that change shape are 1x1
-- projections (option B) so every parameter is trained; in_channels 1 for Fashion-MNIST.

local CifarResNet = nn.Sequential:extend('CifarResNet')
M.CifarResNet = CifarResNet

function CifarResNet:__init(n, opts)
  opts = opts or {}
  self.depth = 6 * n + 2
  self:add(nn.Conv2d(opts.in_channels or 3, 16, 3, { padding = 1, bias = false }), 'conv1')
  self:add(nn.BatchNorm2d(16, { relu = true }), 'bn1')
  local c = 16
  for i, planes in ipairs({ 16, 32, 64 }) do
    local layer
    layer, c = make_layer(M.BasicBlock, c, planes, n, i == 1 and 1 or 2, opts)
    self:add(layer, 'layer' .. i)
  end
  self:add(nn.AdaptiveAvgPool2d(1), 'avgpool')
  self:add(nn.Flatten(), 'flatten')
  self:add(nn.Linear(64, opts.num_classes or 10), 'fc')
end
function CifarResNet:extra_repr() return 'depth ' .. self.depth end

function M.resnet20(opts) return CifarResNet(3, opts) end
function M.resnet32(opts) return CifarResNet(5, opts) end
function M.resnet56(opts) return CifarResNet(9, opts) end

-- A small CNN: two conv-bn-relu-maxpool stages and a linear classifier (for 28x28 inputs).
function M.small_cnn(opts)
  opts = opts or {}
  local cin = opts.in_channels or 1
  return nn.Sequential(
    nn.Conv2d(cin, 32, 3, { padding = 1, bias = false }), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(32, 64, 3, { padding = 1, bias = false }), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(64 * 7 * 7, opts.num_classes or 10))
end

return M
