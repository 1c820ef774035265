-- dlua's side of tests/cli/ckpt_interop.sh: a torchvision state dict (written by the safetensors package) into models/resnet.lua, strict, and its logits; dlua's files for PyTorch to read.
--   dlua ckpt_interop.lua DIR ARCH
local dlua = require 'dlua'
local ckpt = require 'dlua.ckpt'
local resnet = require 'models.resnet'
local dir, arch = arg[1], arg[2]

local sd, meta = ckpt.load_file(dir .. '/tv.safetensors')
assert(meta.from == 'torchvision', 'metadata lost')
local net = resnet[arch]({ num_classes = 1000 })
net:load_state_dict(sd)  -- strict: every name and shape
net:evaluate()
local io = ckpt.load_file(dir .. '/io.safetensors')
local y = net:forward(io.x)
local ref = io.logits
local err = (y - ref):abs():max():item()
local scale = 1 + ref:abs():max():item()
print(string.format('dlua: torchvision %s loaded strictly (%d tensors); logits differ from torchvision by %.3g (scale %.3g)', arch,
  #sd:keys(), err, scale))
assert(err <= 2e-4 * scale, 'logits differ from torchvision beyond float32 tolerance')

-- strictness: a missing and a mis-shaped tensor are named
local missing = {}
for k, v in pairs(sd) do missing[k] = v end
missing['layer1.0.conv1.weight'] = nil
local ok, e = pcall(net.load_state_dict, net, missing)
assert(not ok and tostring(e):find('missing keys: layer1.0.conv1.weight', 1, true), tostring(e))
local small = resnet[arch]({ num_classes = 10 })
ok, e = pcall(small.load_state_dict, small, sd)
assert(not ok and tostring(e):find('fc.weight: expected', 1, true), tostring(e))

-- for PyTorch: this model's weights, an input and dlua's logits, every dtype, a whole checkpoint
local x = dlua.randn(2, 3, 64, 64)
ckpt.save_file(dir .. '/dlua_model.safetensors', net:state_dict())
ckpt.save_file(dir .. '/dlua_io.safetensors', { x = x, logits = net:forward(x):clone() })
local base = dlua.arange(24, { dtype = 'float64' }):view(2, 3, 4) - 11.5
ckpt.save_file(dir .. '/dtypes.safetensors', {
  f32 = base:float(), f64 = base, f16 = base:half(), bf16 = base:to({ dtype = 'bfloat16' }), i32 = base:floor():int(),
  i64 = base:floor():long() * 1000000007, u8 = (base + 12):floor():to({ dtype = 'uint8' }), b = base:gt(0),
  t = base:float():transpose(1, 3), cl = base:float():view(1, 2, 3, 4):contiguous('channels_last'),
})
ckpt.save(dir .. '/ckpt', { model = net, progress = { step = 1 } }, { step = 1 })
print('dlua: wrote dlua_model, dlua_io, dtypes and a checkpoint for PyTorch')
