-- dlua.amp's casts keep an activation's memory format, including the ambiguous one-channel case
-- (a grayscale batch made channels-last: its strides are both NCHW-contiguous and channels-last).
-- Before, such an input came out of the cast NCHW and so did every later bf16 activation, which
-- made oneDNN reorder each convolution's operands (issue #20: bf16 ResNet-20 slower than float32).
local dlua = require 'dlua'
local nn, amp = dlua.nn, dlua.amp

local function strides(t) return table.concat(t:stride(), ',') end
local function rel(a, b) return (a:double() - b):abs():max():item() / math.max(b:abs():max():item(), 1e-30) end
local function rounded(t) return t:to('bfloat16'):double() end

describe('amp casts and memory format', function()
  it('a one-channel channels-last tensor stays channels-last, an NCHW one NCHW', function()
    local x = dlua.randn(3, 1, 5, 4)
    local cl = x:contiguous('channels_last')
    assert.equals('20,1,4,1', strides(cl))
    local b = amp.cast(cl, 'bfloat16')
    assert.equals('bfloat16', b.dtype)
    assert.equals(strides(cl), strides(b))
    assert.equals(0, (b:double() - x:bfloat16():double()):abs():max():item())
    local n = amp.cast(x, 'bfloat16')
    assert.equals(strides(x), strides(n))
    -- and back to float32 (a 'float32' module after a bf16 one)
    assert.equals(strides(cl), strides(amp.cast(b, 'float32')))
  end)

  it('a bf16 convolution of a one-channel channels-last batch gives channels-last output', function()
    dlua.manual_seed(3)
    local conv = nn.Conv2d(1, 16, 3, { padding = 1, bias = false })
    local x = dlua.randn(2, 1, 6, 6):contiguous('channels_last')
    local y32 = conv:forward(x)
    assert.is_true(y32:is_contiguous('channels_last'), 'float32 output channels-last')
    local y = amp.autocast('bf16', function() return conv:forward(x) end)
    assert.equals('bfloat16', y.dtype)
    assert.is_true(y:is_contiguous('channels_last'), 'bf16 output channels-last')
    assert.is_false(y:is_contiguous(), 'bf16 output not NCHW')
  end)

  -- bf16 forwards on channels-last activations run on oneDNN's jit_bf16 kernel rather than the
  -- brgconv one it ranks first (host/cpu/conv_dnnl.c); backward-data at stride 1 runs as such a
  -- forward, adding into the gradient given (a sum post-op). Against float64 of the rounded operands.
  it('bf16 channels-last convolutions (plain and 1x1 stride 2, adding into a gradient) match float64', function()
    local cases = {
      { cin = 32, cout = 32, k = 3, o = { padding = 1, bias = false }, n = 3, hw = 7 },
      { cin = 24, cout = 40, k = 3, o = { padding = 1, stride = 2 }, n = 2, hw = 9 },
      { cin = 32, cout = 64, k = 1, o = { stride = 2, bias = false }, n = 2, hw = 8 },
    }
    for ci, c in ipairs(cases) do
      dlua.manual_seed(20 + ci)
      local conv = nn.Conv2d(c.cin, c.cout, c.k, c.o)
      local x = dlua.randn(c.n, c.cin, c.hw, c.hw):contiguous('channels_last')
      local out = amp.autocast('bf16', function() return conv:forward(x) end)
      assert.is_true(out.dtype == 'bfloat16' and out:is_contiguous('channels_last'), ci .. ': bf16 channels-last')
      local gy = dlua.randn(out:size()):contiguous('channels_last')  -- as from a batch norm's backward
      local acc = dlua.randn(x:size()):contiguous('channels_last'):bfloat16()
      local acc0 = acc:double()
      local gx = conv:backward(x, gy, acc)
      local o64 = { dtype = 'float64' }
      for k, v in pairs(c.o) do o64[k] = v end
      local ref = nn.Conv2d(c.cin, c.cout, c.k, o64)
      ref.weight:copy_(rounded(conv.weight))
      if ref.bias then ref.bias:copy_(rounded(conv.bias)) end
      local xd = rounded(x)
      local yd = ref:forward(xd)
      local gxd = ref:backward(xd, rounded(gy)) + acc0
      assert.is_true(rel(out, yd) < 8e-3, ci .. ': forward ' .. rel(out, yd))
      assert.is_true(rel(gx, gxd) < 8e-3, ci .. ': grad input ' .. rel(gx, gxd))
      assert.is_true(rel(conv.grad_weight, ref.grad_weight) < 1e-5, ci .. ': grad weight')
    end
  end)
end)
