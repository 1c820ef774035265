-- ResNets: torchvision's v1.5 ResNet-18..152 (same parameter names), CIFAR-style ResNet-20/32/56, a small CNN.
local dlua = require 'dlua'
local nn = require 'dlua.nn'

local M = {}

local function conv3x3(cin, cout, stride)
  return nn.Conv2d(cin, cout, 3, { stride = stride or 1, padding = 1, bias = false })
end
local function conv1x1(cin, cout, stride)
  return nn.Conv2d(cin, cout, 1, { stride = stride or 1, bias = false })
end

---------------------------------------------------------------------------------------------
-- Blocks, named as torchvision's (conv1, bn1, conv2, bn2[, conv3, bn3], downsample)

-- A gradient made and used inside a block is freed once used, not when the collector finds it:
-- its memory goes back to the allocator while still in cache, for the next gradient of its size,
-- and the step's peak shrinks (ResNet-20, batch 128: 308 -> 236 MB). The grad_input fields of
-- the modules that held it are cleared.
local function drop(t, ...)
  for i = 1, select('#', ...) do select(i, ...).grad_input = nil end
  t:free()
end

-- out = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)). bn1 runs fused with its ReLU and
-- bn2 with the residual add and the ReLU, so each activation is read and written once.
local BasicBlock = nn.Module:extend('BasicBlock')
M.BasicBlock = BasicBlock
BasicBlock.expansion = 1
BasicBlock.is_block = true -- for model:checkpoint('blocks'); a stage is a module of blocks

function BasicBlock:__init(cin, planes, stride, downsample, opts)
  self:add_module('conv1', conv3x3(cin, planes, stride))
  self:add_module('bn1', nn.BatchNorm2d(planes, { relu = true }))
  self:add_module('conv2', conv3x3(planes, planes))
  self:add_module('bn2', nn.BatchNorm2d(planes, { relu = true, zero_init = opts and opts.zero_init_residual }))
  if downsample then self:add_module('downsample', downsample) end
end

function BasicBlock:forward(x)
  local h = self.bn1:forward(self.conv1:forward(x))
  local s = self.downsample and self.downsample:forward(x) or x
  self._h = h
  self.output = self.bn2:forward(self.conv2:forward(h), s)
  return self.output
end

-- The shortcut's gradient gs is fresh (bn2's or the downsample's), so conv1's input gradient
-- is added into it: inside the convolution for stride 1 channels-last, without a pass of its own.
-- A gradient made inside the block and used once (conv2's input gradient) is given up to the
-- batch-norm before it, which writes its own over it; so is the block's incoming gradient when
-- the caller gives it up (in_place, as a Sequential does between its children): bn2 masks it in
-- place into the shortcut's gradient, and one buffer carries a stage's residual gradient.
BasicBlock.grad_in_place = true
function BasicBlock:backward(x, grad, in_place)
  local gy, gs = self.bn2:backward(self.conv2.output, grad, in_place)
  local gh = self.conv2:backward(self._h, gy)
  drop(gy, self.bn2)
  if self.downsample then gs = self.downsample:backward_given(x, gs, true) end
  local g1 = self.bn1:backward(self.conv1.output, gh, true) -- gh's memory
  self.grad_input = self.conv1:backward(x, g1, gs)
  drop(g1, self.bn1, self.conv2)
  return self.grad_input
end

-- v1.5: the stride sits on the 3x3 convolution (conv2), as in torchvision.
local Bottleneck = nn.Module:extend('Bottleneck')
M.Bottleneck = Bottleneck
Bottleneck.expansion = 4
Bottleneck.is_block = true

function Bottleneck:__init(cin, planes, stride, downsample, opts)
  self:add_module('conv1', conv1x1(cin, planes))
  self:add_module('bn1', nn.BatchNorm2d(planes, { relu = true }))
  self:add_module('conv2', conv3x3(planes, planes, stride))
  self:add_module('bn2', nn.BatchNorm2d(planes, { relu = true }))
  self:add_module('conv3', conv1x1(planes, planes * 4))
  self:add_module('bn3', nn.BatchNorm2d(planes * 4, { relu = true, zero_init = opts and opts.zero_init_residual }))
  if downsample then self:add_module('downsample', downsample) end
end

function Bottleneck:forward(x)
  local h1 = self.bn1:forward(self.conv1:forward(x))
  local h2 = self.bn2:forward(self.conv2:forward(h1))
  local s = self.downsample and self.downsample:forward(x) or x
  self._h1, self._h2 = h1, h2
  self.output = self.bn3:forward(self.conv3:forward(h2), s)
  return self.output
end

Bottleneck.grad_in_place = true -- as BasicBlock
function Bottleneck:backward(x, grad, in_place)
  local gy, gs = self.bn3:backward(self.conv3.output, grad, in_place)
  local g2 = self.conv3:backward(self._h2, gy)
  drop(gy, self.bn3)
  local b2 = self.bn2:backward(self.conv2.output, g2, true) -- g2's memory
  local g1 = self.conv2:backward(self._h1, b2)
  drop(b2, self.bn2, self.conv3)
  if self.downsample then gs = self.downsample:backward_given(x, gs, true) end
  local b1 = self.bn1:backward(self.conv1.output, g1, true) -- g1's memory
  self.grad_input = self.conv1:backward(x, b1, gs)
  drop(b1, self.bn1, self.conv2)
  return self.grad_input
end

---------------------------------------------------------------------------------------------
-- ImageNet ResNets (torchvision layout and names)

local ResNet = nn.Module:extend('ResNet')
M.ResNet = ResNet

local function make_layer(block, cin, planes, blocks, stride, opts)
  local downsample
  if stride ~= 1 or cin ~= planes * block.expansion then
    downsample = nn.Sequential(conv1x1(cin, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion))
  end
  local layer = nn.Sequential(block(cin, planes, stride, downsample, opts))
  for _ = 2, blocks do layer:add(block(planes * block.expansion, planes, 1, nil, opts)) end
  return layer, planes * block.expansion
end

-- opts: num_classes (1000), in_channels (3), zero_init_residual (false).
function ResNet:__init(block, layers, opts)
  opts = opts or {}
  local c = 64
  self:add_module('conv1', nn.Conv2d(opts.in_channels or 3, 64, 7, { stride = 2, padding = 3, bias = false }))
  self:add_module('bn1', nn.BatchNorm2d(64, { relu = true }))
  self:add_module('maxpool', nn.MaxPool2d(3, { stride = 2, padding = 1 }))
  local planes = { 64, 128, 256, 512 }
  for i = 1, 4 do
    local layer
    layer, c = make_layer(block, c, planes[i], layers[i], i == 1 and 1 or 2, opts)
    self:add_module('layer' .. i, layer)
  end
  self:add_module('avgpool', nn.AdaptiveAvgPool2d(1))
  self:add_module('flatten', nn.Flatten())
  self:add_module('fc', nn.Linear(c, opts.num_classes or 1000))
  self.order = { 'conv1', 'bn1', 'maxpool', 'layer1', 'layer2', 'layer3', 'layer4', 'avgpool', 'flatten', 'fc' }
end

-- A fixed chain of named children: forward in order, backward in reverse.
-- (Children are looked up by name: `flatten` is also a Module method, so not a field.)
local function chain(self)
  if not self._chain then
    local by_name = {}
    for _, c in ipairs(self._children) do by_name[c.name] = c.module end
    self._chain = {}
    for i, name in ipairs(self.order) do self._chain[i] = by_name[name] end
  end
  return self._chain
end
local function chain_forward(self, x)
  self._inputs = self._inputs or {}
  for i, m in ipairs(chain(self)) do
    self._inputs[i] = x
    x = m:forward(x)
  end
  self.output = x
  return x
end
-- (the gradients between children are given up to those that can take them, as in Sequential)
local function chain_backward(self, _, grad, in_place)
  local mods = chain(self)
  for i = #mods, 1, -1 do grad = mods[i]:backward_given(self._inputs[i], grad, i < #mods or in_place) end
  self.grad_input = grad
  return grad
end
local function chain_input_grad(self, flag)
  self.needs_input_grad = flag ~= false
  chain(self)[1]:input_grad(flag)
  return self
end
ResNet.forward, ResNet.backward, ResNet.input_grad = chain_forward, chain_backward, chain_input_grad
ResNet.grad_in_place = true

function M.resnet18(opts) return ResNet(BasicBlock, { 2, 2, 2, 2 }, opts) end
function M.resnet34(opts) return ResNet(BasicBlock, { 3, 4, 6, 3 }, opts) end
function M.resnet50(opts) return ResNet(Bottleneck, { 3, 4, 6, 3 }, opts) end
function M.resnet101(opts) return ResNet(Bottleneck, { 3, 4, 23, 3 }, opts) end
function M.resnet152(opts) return ResNet(Bottleneck, { 3, 8, 36, 3 }, opts) end

---------------------------------------------------------------------------------------------
-- CIFAR-style ResNets (He et al. 2016, section 4.2): 3x3 stem with 16 channels, three stages
-- of n blocks (16, 32, 64 channels), 6n+2 layers. Shortcuts that change shape are 1x1
-- projections (option B) so every parameter is trained; in_channels 1 for Fashion-MNIST.

local CifarResNet = nn.Module:extend('CifarResNet')
M.CifarResNet = CifarResNet

function CifarResNet:__init(n, opts)
  opts = opts or {}
  self.depth = 6 * n + 2
  self:add_module('conv1', conv3x3(opts.in_channels or 3, 16))
  self:add_module('bn1', nn.BatchNorm2d(16, { relu = true }))
  local c = 16
  for i, planes in ipairs({ 16, 32, 64 }) do
    local layer
    layer, c = make_layer(BasicBlock, c, planes, n, i == 1 and 1 or 2, opts)
    self:add_module('layer' .. i, layer)
  end
  self:add_module('avgpool', nn.AdaptiveAvgPool2d(1))
  self:add_module('flatten', nn.Flatten())
  self:add_module('fc', nn.Linear(64, opts.num_classes or 10))
  self.order = { 'conv1', 'bn1', 'layer1', 'layer2', 'layer3', 'avgpool', 'flatten', 'fc' }
end
CifarResNet.forward, CifarResNet.backward, CifarResNet.input_grad = chain_forward, chain_backward, chain_input_grad
CifarResNet.grad_in_place = true
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
