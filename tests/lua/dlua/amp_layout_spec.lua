-- dlua.amp's casts keep an activation's memory format, including the ambiguous one-channel case
-- (a grayscale batch made channels-last: its strides are both NCHW-contiguous and channels-last).
-- Before, such an input came out of the cast NCHW and so did every later bf16 activation, which
-- made oneDNN reorder each convolution's operands (issue #20: bf16 ResNet-20 slower than float32).
local dlua = require 'dlua'
local nn, amp = dlua.nn, dlua.amp

local function strides(t) return table.concat(t:stride(), ',') end

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
end)
