-- Specs for lua/dlua/nn/blocks.lua, continued: torchvision's ResNet-18..152 from the fusing blocks give the hand-written blocks' bits (a file of its own: seconds of CPU each).
local C = require 'tests.lua.dlua.blocks_common'

describe('ImageNet ResNets from the fusing blocks', function()
  -- name, opts, input (N, C, H, W), dtype, channels-last, checkpoint policy, steps (default 2), input_grad(false).
  -- At 32x32 (layer4 is 1x1) and batch 2, one step but ResNet-50's: each is seconds of CPU, mostly oneDNN
  -- compiling its kernels for each shape and layout.
  local CONFIGS = {
    { 'resnet18', {}, { 2, 3, 32, 32 }, nil, false, nil, 1 },
    { 'resnet34', {}, { 2, 3, 32, 32 }, nil, false, nil, 1 },
    { 'resnet50', {}, { 2, 3, 32, 32 } },
    { 'resnet50', { zero_init_residual = true }, { 2, 3, 32, 32 }, nil, true, nil, 1 },
    { 'resnet101', {}, { 2, 3, 32, 32 }, nil, true, nil, 1 },
    { 'resnet152', {}, { 2, 3, 32, 32 }, nil, false, nil, 1 },
  }

  C.same_bits(CONFIGS, 1, it, assert)
end)
