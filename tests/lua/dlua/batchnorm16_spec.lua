-- Batch-norm on bfloat16 / float16 activations on the CPU: the kernels read and write the 16-bit tensors themselves,
-- computing in float32, and must give exactly the bits of the staged path (x:float(), the float32 kernel, then a
-- round-to-nearest-even cast back), which is what they replaced: training forward (both layouts, with ReLU and a
-- residual skip), evaluation, backward (grad_input, grad_skip, grad_weight, grad_bias) and the running statistics.
local dlua = require 'dlua'
local K = require 'bindings.nn'

-- Every element of a and b has the same dtype and the same value, zeros of the same sign, NaN where the other has.
local function same_bits(a, b, what)
  assert.equals(a.dtype, b.dtype, what)
  assert.same(a:size(), b:size(), what)
  local fa, fb = {}, {}
  local function flat(t, out)
    if type(t) ~= 'table' then out[#out + 1] = t; return end
    for k = 1, #t do flat(t[k], out) end
  end
  flat(a:double():totable(), fa)
  flat(b:double():totable(), fb)
  for i = 1, #fa do
    local u, v = fa[i], fb[i]
    local ok = (u ~= u and v ~= v) or (u == v and (u ~= 0 or 1 / u == 1 / v))
    if not ok then error(string.format('%s: element %d differs: %.9g vs %.9g', what, i, u, v), 2) end
  end
end

local function lay(t, cl) return cl and t:contiguous('channels_last') or t:contiguous() end
local function is_cl(t) return t:dim() == 4 and t:stride(2) == 1 and t:size(2) > 1 end

-- One case: forward (train or eval) and backward natively in dt, and by hand through float32.
local function check(dt, shape, cl, train, relu, with_skip, with_beta_mask)
  local tag = string.format('%s %s %s train=%s relu=%s skip=%s beta=%s', dt, table.concat(shape, 'x'),
    cl and 'channels-last' or 'NCHW', tostring(train), tostring(relu), tostring(with_skip), tostring(with_beta_mask))
  local C = shape[2]
  -- an offset mean so the shifted sums matter; values rounded to dt first, so both paths see the same inputs
  local x = lay((dlua.randn(shape) * 1.5 + 0.75):to(dt), cl)
  local skip = with_skip and lay(dlua.randn(shape):to(dt), cl) or nil
  local dy = lay(dlua.randn(shape):to(dt), cl)
  local g, b = dlua.rand(C) + 0.5, dlua.randn(C) * 0.3
  local rm0, rv0 = dlua.randn(C) * 0.1, dlua.rand(C) + 0.5

  -- native
  local rm, rv = rm0:clone(), rv0:clone()
  local y, sm, si = K.batch_norm(x, g, b, skip, rm, rv, train, 0.1, 1e-5, relu, true)
  -- staged by hand
  local xf, sf = x:float(), skip and skip:float() or nil
  local rmf, rvf = rm0:clone(), rv0:clone()
  local yf, smf, sif = K.batch_norm(xf, g, b, sf, rmf, rvf, train, 0.1, 1e-5, relu, true)
  same_bits(y, yf:to(dt), tag .. ' output')
  assert.equals(cl, is_cl(y), tag .. ' output layout')
  same_bits(sm, smf, tag .. ' save_mean')
  same_bits(si, sif, tag .. ' save_invstd')
  same_bits(rm, rmf, tag .. ' running_mean')
  same_bits(rv, rvf, tag .. ' running_var')
  assert.equals('float32', sm.dtype)
  assert.equals('float32', rm.dtype)

  -- backward: the staged path saw the 16-bit output (what a bf16 network keeps), widened
  local beta = with_beta_mask and b or nil
  local gg, gb = dlua.zeros(C), dlua.zeros(C)
  local gi, gs = K.batch_norm_backward(dy, x, relu and y or nil, g, beta, sm, si, gg, gb, train, relu, with_skip)
  local ggf, gbf = dlua.zeros(C), dlua.zeros(C)
  local gif, gsf = K.batch_norm_backward(dy:float(), xf, relu and y:float() or nil, g, beta, smf, sif, ggf, gbf, train,
    relu, with_skip)
  same_bits(gi, gif:to(dt), tag .. ' grad_input')
  assert.equals(cl, is_cl(gi), tag .. ' grad_input layout')
  if with_skip then same_bits(gs, gsf:to(dt), tag .. ' grad_skip') end
  same_bits(gg, ggf, tag .. ' grad_weight')
  same_bits(gb, gbf, tag .. ' grad_bias')
  assert.equals('float32', gg.dtype)
end

describe('batch-norm on 16-bit activations (CPU)', function()
  -- C = 19 and 35: vector chunks of 16 channels and a remainder; N*H*W = 105 and 4*9*11 = 396 (not multiples of
  -- 16); 8x35x17x15 = 2040 rows of 35 channels: several blocks of rows, and planes long enough for every loop.
  local shapes = { { 3, 19, 5, 7 }, { 4, 35, 9, 11 }, { 8, 35, 17, 15 }, { 6, 19 } }

  for _, dt in ipairs({ 'bfloat16', 'float16' }) do
    it('training forward and backward equal the staged float32 path bit for bit (' .. dt .. ', 1 and 2 threads)',
      function()
        local threads = dlua.get_num_threads()
        dlua.manual_seed(20)
        for _, nt in ipairs({ 1, 2 }) do
          dlua.set_num_threads(nt)  -- 2: the larger shapes split their planes and blocks over threads
          for _, shape in ipairs(shapes) do
            for _, cl in ipairs(#shape == 4 and { false, true } or { false }) do
              check(dt, shape, cl, true, false, false, false)
              check(dt, shape, cl, true, true, false, true)   -- ReLU, mask decided from the 16-bit output
              check(dt, shape, cl, true, true, true, false)   -- ReLU and a residual skip (a ResNet block's end)
            end
          end
        end
        dlua.set_num_threads(threads)
      end)

    it('evaluation forward and backward equal the staged float32 path bit for bit (' .. dt .. ')', function()
      dlua.manual_seed(21)
      for _, shape in ipairs(shapes) do
        for _, cl in ipairs(#shape == 4 and { false, true } or { false }) do
          check(dt, shape, cl, false, false, false, false)
          check(dt, shape, cl, false, true, true, false)
        end
      end
    end)

    it('batch_norm_stats on ' .. dt .. ' equals the sums of the widened input', function()
      dlua.manual_seed(22)
      for _, cl in ipairs({ false, true }) do
        local x = lay((dlua.randn({ 4, 19, 9, 11 }) + 3):to(dt), cl)
        same_bits(K.batch_norm_stats(x), K.batch_norm_stats(x:float()), dt .. ' stats')
      end
    end)
  end

  it('rounds special values as the staged path does: NaN, infinities, -0, subnormals, overflow', function()
    dlua.manual_seed(24)
    for _, dt in ipairs({ 'bfloat16', 'float16' }) do
      for _, cl in ipairs({ false, true }) do
        local C = 21
        local xf = dlua.randn({ 3, C, 4, 5 })
        local dyf = dlua.randn({ 3, C, 4, 5 })
        xf[{ 1, 1, 1, 1 }] = 0 / 0          -- channel 1: NaN statistics
        xf[{ 2, 2, 3, 3 }] = math.huge      -- channel 2: an infinity
        xf[{ 1, 3, 2, 2 }] = -0.0
        dyf[{ 1, 4, 1, 2 }] = 0 / 0
        dyf[{ 2, 5, 1, 1 }] = -math.huge
        for i = 1, 4 do xf[{ 3, 6, i, 1 }] = 1e-39 * i end  -- float32 subnormals (bf16 keeps some)
        local x, dy = lay(xf:to(dt), cl), lay(dyf:to(dt), cl)
        -- gammas that overflow the 16-bit range (7e4 for float16, 3e38 for bfloat16) or land in its subnormals
        local big = dt == 'float16' and 7e4 or 3e38
        local g = dlua.ones(C)
        g[7], g[8], g[9] = big, dt == 'float16' and 1e-6 or 1e-39, -big
        local b = dlua.zeros(C)
        b[10] = -0.0
        local y, sm, si = K.batch_norm(x, g, b, nil, nil, nil, true, 0.1, 1e-5, false, true)
        local yf, smf, sif = K.batch_norm(x:float(), g, b, nil, nil, nil, true, 0.1, 1e-5, false, true)
        local tag = dt .. (cl and ' channels-last' or ' NCHW') .. ' specials'
        same_bits(y, yf:to(dt), tag .. ' output')
        same_bits(si, sif, tag .. ' save_invstd')
        local gi = K.batch_norm_backward(dy, x, nil, g, nil, sm, si, nil, nil, true, false, false)
        local gif = K.batch_norm_backward(dy:float(), x:float(), nil, g, nil, smf, sif, nil, nil, true, false, false)
        same_bits(gi, gif:to(dt), tag .. ' grad_input')
        -- with a fused ReLU and a skip: the mask from the 16-bit output, grad_skip a masked copy of dy
        local sk = lay(dlua.randn({ 3, C, 4, 5 }):to(dt), cl)
        local y2 = K.batch_norm(x, g, b, sk, nil, nil, true, 0.1, 1e-5, true, true)
        local y2f = K.batch_norm(x:float(), g, b, sk:float(), nil, nil, true, 0.1, 1e-5, true, true)
        same_bits(y2, y2f:to(dt), tag .. ' relu+skip output')
        local a2, s2 = K.batch_norm_backward(dy, x, y2, g, nil, sm, si, nil, nil, true, true, true)
        local a2f, s2f = K.batch_norm_backward(dy:float(), x:float(), y2:float(), g, nil, smf, sif, nil, nil, true,
          true, true)
        same_bits(a2, a2f:to(dt), tag .. ' relu+skip grad_input')
        same_bits(s2, s2f:to(dt), tag .. ' relu+skip grad_skip')
      end
    end
  end)

  it("SyncBatchNorm's halves on 16-bit activations equal the staged float32 path bit for bit", function()
    dlua.manual_seed(25)
    for _, dt in ipairs({ 'bfloat16', 'float16' }) do
      for _, cl in ipairs({ false, true }) do
        local C = 19
        local x = lay((dlua.randn({ 5, C, 3, 7 }) + 2):to(dt), cl)
        local dy, sk = lay(dlua.randn({ 5, C, 3, 7 }):to(dt), cl), lay(dlua.randn({ 5, C, 3, 7 }):to(dt), cl)
        local g, b = dlua.rand(C) + 0.5, dlua.randn(C)
        local tag = dt .. (cl and ' channels-last' or ' NCHW') .. ' sync'
        local st, stf = K.batch_norm_stats(x), K.batch_norm_stats(x:float())
        same_bits(st, stf, tag .. ' stats')
        local rm, rv, rmf, rvf = dlua.zeros(C), dlua.ones(C), dlua.zeros(C), dlua.ones(C)
        local y, sm, si = K.batch_norm_apply(x, g, b, sk, st, rm, rv, 0.1, 1e-5, true)
        local yf, smf, sif = K.batch_norm_apply(x:float(), g, b, sk:float(), stf, rmf, rvf, 0.1, 1e-5, true)
        same_bits(y, yf:to(dt), tag .. ' apply')
        same_bits(rv, rvf, tag .. ' running_var')
        local gg, gb, ggf, gbf = dlua.zeros(C), dlua.zeros(C), dlua.zeros(C), dlua.zeros(C)
        local sums = K.batch_norm_backward_reduce(dy, x, y, g, nil, sm, si, gg, gb, true)
        local sumsf = K.batch_norm_backward_reduce(dy:float(), x:float(), y:float(), g, nil, smf, sif, ggf, gbf, true)
        same_bits(sums, sumsf, tag .. ' backward_reduce sums')
        same_bits(gg, ggf, tag .. ' grad_weight')
        same_bits(gb, gbf, tag .. ' grad_bias')
        local gi, gs = K.batch_norm_backward_apply(dy, x, y, g, nil, sm, si, sums, true, true)
        local gif, gsf = K.batch_norm_backward_apply(dy:float(), x:float(), y:float(), g, nil, smf, sif, sumsf, true,
          true)
        same_bits(gi, gif:to(dt), tag .. ' backward_apply grad_input')
        same_bits(gs, gsf:to(dt), tag .. ' backward_apply grad_skip')
      end
    end
  end)

  it('keeps the staged path for mixed dtypes (a float32 skip on a bfloat16 input)', function()
    dlua.manual_seed(23)
    local x = dlua.randn({ 2, 19, 3, 5 }):to('bfloat16')
    local skip = dlua.randn({ 2, 19, 3, 5 })
    local y = K.batch_norm(x, nil, nil, skip, nil, nil, true, 0.1, 1e-5, true, true)
    local yf = K.batch_norm(x:float(), nil, nil, skip, nil, nil, true, 0.1, 1e-5, true, true)
    same_bits(y, yf:to('bfloat16'), 'mixed output')
  end)

  it('still refuses what it must', function()
    local x = dlua.randn({ 2, 3, 4, 4 }):to('bfloat16')
    assert.has_error(function() K.batch_norm(dlua.zeros({ 2, 3, 4, 4 }, { dtype = 'int32' }), nil, nil, nil, nil, nil,
      true, 0.1, 1e-5, false, true) end)
    local ok, err = pcall(K.batch_norm, x, dlua.ones(4), nil, nil, nil, nil, true, 0.1, 1e-5, false, true)
    assert.is_false(ok)
    assert.matches('gamma', err)
    ok, err = pcall(K.batch_norm, dlua.randn({ 1, 3 }):to('bfloat16'), nil, nil, nil, nil, nil, true, 0.1, 1e-5, false,
      true)
    assert.is_false(ok)
    assert.matches('more than 1 value per channel', err)
  end)
end)
