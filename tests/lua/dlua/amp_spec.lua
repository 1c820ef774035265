-- dlua.amp: autocast's policy (dtypes in and out, nesting, enabled = false, casts per region), backward in the forward's precision against float64 references, GradScaler's outcomes, from_spec, float16 + scaler against float32.
local dlua = require 'dlua'
local nn, optim, amp = dlua.nn, dlua.optim, dlua.amp

local function rel(a, b)
  local d = (a:double() - b:double()):norm():item()
  return d / math.max(b:double():norm():item(), 1e-30)
end

-- What a bfloat16 (float16) tensor holds, in float64: the rounding autocast applies.
local function rounded(t, dt) return t:to(dt):double() end

describe('dlua.amp.autocast', function()
  it('runs convolution and linear layers in the low precision, losses and pooling in float32', function()
    dlua.manual_seed(1)
    local net = nn.Sequential(nn.Conv2d(3, 4, 3, { padding = 1 }), nn.BatchNorm2d(4, { relu = true }),
      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    local crit = nn.CrossEntropyLoss()
    local x, y = dlua.randn(2, 3, 6, 6), dlua.tensor({ 1, 3 }, { dtype = 'int64' })
    local loss
    local r1, r2 = amp.autocast('bfloat16', function(a, b)
      local out = net:forward(x)
      assert.equals('bfloat16', net:get(1).output.dtype)
      assert.equals('bfloat16', net:get(2).output.dtype)   -- batch-norm keeps its input's dtype
      assert.equals('float32', net:get(3).output.dtype)    -- a reduction: float32
      assert.equals('bfloat16', out.dtype)
      loss = crit:forward(out, y)
      return a + b, 'x'
    end, 1, 2)
    assert.equals(3, r1); assert.equals('x', r2)
    assert.equals('float32', loss.dtype)
    assert.equals('float32', net:get(1).weight.dtype)   -- the master weights stay
    assert.is_false(amp.is_enabled())
    assert.equals('float32', net:forward(x).dtype)       -- off again outside the region
  end)

  it('nests, and enabled = false turns it off inside a region', function()
    local lin = nn.Linear(3, 2)
    local x = dlua.randn(4, 3)
    amp.autocast('bf16', function()
      assert.equals('bfloat16', lin:forward(x).dtype)
      amp.autocast({ enabled = false }, function()
        assert.is_nil(amp.get_dtype())
        assert.equals('float32', lin:forward(x).dtype)
        amp.autocast('float16', function() assert.equals('float16', lin:forward(x).dtype) end)
      end)
      assert.equals('bfloat16', amp.get_dtype())
      assert.equals('bfloat16', lin:forward(x).dtype)
    end)
    assert.is_nil(amp.get_dtype())
  end)

  it('restores the state and the master weights when the region raises', function()
    local lin = nn.Linear(3, 2)
    local w = lin.weight
    local ok, e = pcall(amp.autocast, 'bf16', function() lin:forward(dlua.randn(4, 5)) end)
    assert.is_false(ok)
    assert.truthy(tostring(e):find('expected %(N, 3%)'))
    assert.is_nil(amp.get_dtype())
    assert.is_true(rawequal(w, lin.weight))
    assert.has_error(function() amp.autocast('int8', function() end) end,
      "autocast: dtype must be 'bfloat16' or 'float16' (or 'bf16', 'f16'), got int8")
  end)

  it('the policy is a table by module type that a user can change', function()
    local lin = nn.Linear(3, 2)
    local x = dlua.randn(4, 3)
    assert.equals('lower', amp.policy.Linear)
    amp.policy.Linear = 'float32'
    local dt = amp.autocast('bf16', function() return lin:forward(x:bfloat16()).dtype end)
    amp.policy.Linear = 'lower'
    assert.equals('float32', dt)
    -- a subclass takes its parent's entry (SyncBatchNorm: BatchNorm2d's)
    assert.equals('input', amp.policy_of(nn.SyncBatchNorm(3)))
    assert.equals('lower', amp.policy_of(nn.Conv2d(1, 1, 1)))
    -- direct products follow policy.matmul
    local a, b = dlua.randn(2, 3), dlua.randn(3, 4)
    assert.equals('bfloat16', amp.autocast('bf16', function() return dlua.mm(a, b).dtype end))
    assert.equals('float32', dlua.mm(a, b).dtype)
  end)

  it('casts each weight once per region, not once per call', function()
    local lin1, lin2 = nn.Linear(3, 3), nn.Linear(3, 3, { bias = false })
    local x = dlua.randn(2, 3)
    local before = amp.cast_count()
    amp.autocast('bf16', function()
      for _ = 1, 3 do lin2:forward(lin1:forward(x)) end
      lin1:backward(x, dlua.ones(2, 3))
    end)
    assert.equals(3, amp.cast_count() - before)  -- weight and bias of lin1, weight of lin2
    amp.autocast('bf16', function() lin1:forward(x) end)
    assert.equals(5, amp.cast_count() - before)  -- a new region casts afresh (the weights may have changed)
    -- the copy follows the master weight
    lin1.weight:fill_(0.5)
    local out = amp.autocast('bf16', function() return lin1:forward(x) end)
    local want = dlua.addmm(lin1.bias:bfloat16():float(), x:bfloat16():float(), dlua.full({ 3, 3 }, 0.5))
    assert.is_true(rel(out, want) < 1e-2)
  end)

  it('backward runs in the forward precision: gradients of the rounded operands, float32 arena', function()
    -- oneDNN's bf16 kernels (f32 accumulation): NCHW with bias and stride 2; channels-last 16 -> 16 at
    -- stride 1 (the blocked kernel, backward-data run as a forward, adding into the shortcut gradient);
    -- a channels-last 1x1 stride-2 projection; groups
    local cases = {
      { cin = 3, cout = 5, k = 3, o = { padding = 1, stride = 2 }, n = 3, hw = 7 },
      { cin = 16, cout = 16, k = 3, o = { padding = 1, bias = false }, n = 2, hw = 6, cl = true, add = true },
      { cin = 8, cout = 12, k = 1, o = { stride = 2, bias = false }, n = 3, hw = 7, cl = true },
      { cin = 4, cout = 6, k = 3, o = { padding = 1, groups = 2 }, n = 2, hw = 5, cl = true },
    }
    for ci, c in ipairs(cases) do
      dlua.manual_seed(10 + ci)
      local conv = nn.Conv2d(c.cin, c.cout, c.k, c.o)
      local x = dlua.randn(c.n, c.cin, c.hw, c.hw)
      if c.cl then x = x:contiguous('channels_last') end
      local out = amp.autocast('bf16', function() return conv:forward(x) end)
      assert.equals('bfloat16', out.dtype)
      if c.cl then assert.is_true(out:is_contiguous('channels_last'), ci .. ': output channels-last') end
      local gy = dlua.randn(out:size())
      local acc = c.add and dlua.randn(x:size()):bfloat16() or nil
      local acc0 = acc and acc:double()
      local gx = conv:backward(x, gy, acc)         -- outside the region, as after torch's autocast block
      assert.equals(c.add and 'bfloat16' or 'float32', gx.dtype)  -- the input's dtype (or add_to's)
      assert.equals('float32', conv.grad_weight.dtype)
      -- reference: float64 convolution of the bf16-rounded operands
      local o64 = {}
      for k, v in pairs(c.o) do o64[k] = v end
      o64.dtype = 'float64'
      local ref = nn.Conv2d(c.cin, c.cout, c.k, o64)
      ref.weight:copy_(rounded(conv.weight, 'bfloat16'))
      if ref.bias then ref.bias:copy_(rounded(conv.bias, 'bfloat16')) end
      local xd = rounded(x, 'bfloat16')
      local yd = ref:forward(xd)
      local gd = rounded(gy, 'bfloat16')
      local gxd = ref:backward(xd, gd)
      if acc0 then gxd = gxd + acc0 end
      -- outputs are stored in bf16 (8 bits: 2^-9 relative); the weight gradient is accumulated and
      -- stored in f32 from the rounded operands, so it matches far closer
      assert.is_true(rel(out, yd) < 8e-3, ci .. ': forward ' .. rel(out, yd))
      assert.is_true(rel(gx, gxd) < 8e-3, ci .. ': grad input ' .. rel(gx, gxd))
      assert.is_true(rel(conv.grad_weight, ref.grad_weight) < 1e-5, ci .. ': grad weight ' .. rel(conv.grad_weight, ref.grad_weight))
      if ref.bias then
        assert.is_true(rel(conv.grad_bias, ref.grad_bias) < 1e-5, ci .. ': grad bias ' .. rel(conv.grad_bias, ref.grad_bias))
      end
      -- a later forward without autocast is float32 again, and so is its backward
      assert.equals('float32', conv:forward(x).dtype)
      assert.equals('float32', conv:backward(x, gy).dtype)
    end
  end)

  it('a Linear layer runs on bf16 products (oneDNN bf16 GEMM on the CPU): bounds against float64', function()
    -- References: float64 products of the bf16-rounded operands. A float32 accumulation of k terms is
    -- within e32 = (k + 2) 2^-24 sum|terms| of the exact sum; a bf16 output adds its rounding, at most
    -- one bf16 ulp, and one ulp at |v| is at most 2^-7 |v| (8 significant bits).
    local function within(got, exact, mag, k, to_bf16, what)
      local e32 = mag * ((k + 2) * 2 ^ -24)
      local bound = to_bf16 and e32 + (exact:abs() + e32) * 2 ^ -7 or e32
      local over = ((got:double() - exact):abs() - bound):max():item()
      assert.is_true(over <= 0, what .. ' exceeds its bound by ' .. over)
    end
    dlua.manual_seed(21)
    local lin = nn.Linear(53, 29)  -- k = 53 in the forward: not a multiple of 16
    lin:zero_grad()
    local x, gy = dlua.randn(37, 53), dlua.randn(37, 29)
    local out = amp.autocast('bf16', function() return lin:forward(x) end)
    assert.equals('bfloat16', out.dtype)
    local gx = amp.autocast('bf16', function() return lin:backward(x, gy) end)
    assert.equals('float32', gx.dtype)               -- the input's dtype
    assert.equals('float32', lin.grad_weight.dtype)  -- the float32 arena, not rounded to bf16
    local xd, wd, bd, gd = rounded(x, 'bfloat16'), rounded(lin.weight, 'bfloat16'), rounded(lin.bias, 'bfloat16'),
      rounded(gy, 'bfloat16')
    within(out, dlua.addmm(bd, xd, wd:t()), dlua.addmm(bd:abs(), xd:abs(), wd:abs():t()), 53, true, 'forward')
    within(lin.grad_weight, dlua.mm(gd:t(), xd), dlua.mm(gd:abs():t(), xd:abs()), 37, false, 'grad weight')
    within(gx, dlua.mm(gd, wd), dlua.mm(gd:abs(), wd:abs()), 29, true, 'grad input')  -- bf16, then widened
    -- a second backward accumulates into the float32 gradient
    amp.autocast('bf16', function() return lin:backward(x, gy) end)
    within(lin.grad_weight, dlua.mm(gd:t(), xd) * 2, dlua.mm(gd:abs():t(), xd:abs()) * 2, 38, false, 'grad weight x2')
  end)

  it('keeps channels-last activations channels-last through the casts', function()
    local x = dlua.randn(2, 16, 3, 3):contiguous('channels_last')
    local b = amp.cast(x, 'bfloat16')
    assert.is_true(b:is_contiguous('channels_last'))
    assert.equals(0, (b:double() - rounded(x, 'bfloat16')):abs():max():item())
  end)

  it('master weights: the fused step writes the 16-bit twin, so a step casts nothing', function()
    for _, mk in ipairs({ function(m) return optim.SGD(m, { lr = 0.1, momentum = 0.9, weight_decay = 1e-3 }) end,
                          function(m) return optim.AdamW(m, { lr = 0.01 }) end }) do
      dlua.manual_seed(8)
      local net = nn.Sequential(nn.Linear(5, 40000), nn.ReLU(), nn.Linear(40000, 3))  -- 2 chunks and a tail
      local opt = mk(net)
      local crit = nn.CrossEntropyLoss()
      local x, y = dlua.randn(4, 5), dlua.randint(1, 4, 4)
      local function step()
        opt:zero_grad()
        local out = amp.autocast('bf16', function() return net:forward(x) end)
        crit:forward(out, y)
        net:backward(x, crit:backward(out, y))
        opt:step()
      end
      local a0, c0 = amp.arena_cast_count(), amp.cast_count()
      step()
      assert.equals(1, amp.arena_cast_count() - a0)  -- the first region: one pass over the arena
      for _ = 1, 3 do step() end
      assert.equals(1, amp.arena_cast_count() - a0)  -- then the steps wrote it
      assert.equals(0, amp.cast_count() - c0)
      local twin = opt._lowp.float32.tensor
      assert.equals('bfloat16', twin.dtype)
      assert.equals(0, (twin:float() - opt.arena.params.float32:bfloat16():float()):abs():max():item())
      -- the layers computed with exactly those weights
      local out = amp.autocast('bf16', function() return net:get(1):forward(x) end)
      local want = dlua.addmm(net:get(1).bias:bfloat16():float(), x:bfloat16():float(), net:get(1).weight:bfloat16():float():t())
      assert.is_true(rel(out, want) < 8e-3)
      -- parameters changed outside a step: the twin is cast afresh
      net:load_state_dict(net:state_dict())
      amp.autocast('bf16', function() net:forward(x) end)
      assert.equals(2, amp.arena_cast_count() - a0)
    end
    -- the kernel checks its twin
    local K = require 'bindings.nn'
    local p, g = dlua.zeros(10), dlua.zeros(10)
    assert.has_error(function() K.sgd_step(p, g, nil, 0, 10, 0.1, 0, 0, 0, false, false, true, 1, dlua.zeros(9):bfloat16()) end)
    local ok, e = pcall(K.sgd_step, p, g, nil, 0, 10, 0.1, 0, 0, 0, false, false, true, 1, dlua.zeros(10))
    assert.is_false(ok)
    assert.truthy(tostring(e):find('must be a contiguous bfloat16 or float16 tensor', 1, true), e)
  end)

  it('a checkpointed segment recomputes in its forward precision', function()
    dlua.manual_seed(3)
    local function build()
      dlua.manual_seed(4)
      return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    end
    local plain, ck = build(), build()
    ck = nn.Sequential(nn.Checkpoint(ck))
    local x = dlua.randn(5, 6)
    local o1 = amp.autocast('bf16', function() return plain:forward(x) end)
    local o2 = amp.autocast('bf16', function() return ck:forward(x) end)
    local g = dlua.ones(5, 3)
    plain:backward(x, g)
    ck:backward(x, g)
    assert.equals(0, (o1:float() - o2:float()):abs():max():item())
    local a, b = plain:named_parameters(), ck:named_parameters()
    for i = 1, #a do assert.equals(0, (a[i].grad - b[i].grad):abs():max():item(), a[i].name) end
  end)
end)

describe('dlua.amp.GradScaler', function()
  local function setup()
    dlua.manual_seed(5)
    local net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    local opt = optim.SGD(net, { lr = 0.1, momentum = 0.9 })
    return net, opt, dlua.randn(8, 4), dlua.randn(8, 2)
  end

  it('scales, unscales and applies; a non-finite gradient skips the step and halves the scale', function()
    local net, opt, x, y = setup()
    local crit = nn.MSELoss()
    local sc = amp.GradScaler({ init_scale = 1024, growth_interval = 2 })
    assert.equals(1024, sc:get_scale())
    assert.equals(2048, sc:scale(2))
    local function backward()
      opt:zero_grad()
      local out = net:forward(x)
      crit:forward(out, y)
      net:backward(x, sc:scale(crit:backward(out, y)))
    end
    -- the unscaled gradient equals the unscaled run's
    backward()
    local scaled = net:get(1).grad_weight:clone()
    sc:unscale_(opt)
    assert.is_true(rel(net:get(1).grad_weight * 1024, scaled) < 1e-6)
    assert.equals('applied', (sc:step(opt)))
    assert.equals(1, opt.steps)
    backward()
    assert.equals('applied', (sc:step(opt)))
    assert.equals(2048, sc:get_scale())   -- grew after growth_interval applied steps
    -- forced overflow
    backward()
    net:get(3).grad_weight[1][1] = math.huge
    local p0, m0 = opt.arena.params.float32:clone(), opt:buffer('float32', 'momentum'):clone()
    local outcome, why = sc:step(opt)
    assert.equals('skipped', outcome)
    assert.equals('overflow: scale 2048 -> 1024', why)
    assert.equals(0, (opt.arena.params.float32 - p0):abs():max():item())
    assert.equals(0, (opt:buffer('float32', 'momentum') - m0):abs():max():item())
    assert.equals(2, opt.steps)                       -- a schedule on opt.steps did not move
    assert.equals(1024, sc:get_scale())
    assert.equals('scale 1024, 1 skipped', sc:summary())
    backward()
    net:get(1).grad_bias[2] = 0 / 0                   -- NaN counts too
    assert.equals('skipped', (sc:step(opt)))
    assert.equals(512, sc:get_scale())
    -- state dict round trip
    local sd = sc:state_dict()
    local sc2 = amp.GradScaler()
    sc2:load_state_dict(sd)
    assert.equals(512, sc2:get_scale()); assert.equals(2, sc2.skipped); assert.equals(2, sc2.consecutive)
  end)

  it('stops after max_skips steps skipped in a row, with an explanation', function()
    local net, opt = setup()
    local sc = amp.GradScaler({ init_scale = 8, max_skips = 3 })
    local function poison() opt:zero_grad(); net:get(1).grad_weight[1][1] = math.huge end
    poison(); assert.equals('skipped', (sc:step(opt)))
    poison(); assert.equals('skipped', (sc:step(opt)))
    poison()
    local ok, e = pcall(sc.step, sc, opt)
    assert.is_false(ok)
    assert.truthy(tostring(e):find('3 steps in a row skipped', 1, true), e)
    assert.truthy(tostring(e):find('from 8 down to 2', 1, true), e)
  end)

  it('disabled, it passes everything through', function()
    local _, opt = setup()
    local sc = amp.GradScaler({ enabled = false })
    local g = dlua.ones(2)
    assert.is_true(rawequal(g, sc:scale(g)))
    assert.equals(1, sc:get_scale())
    assert.equals('applied', (sc:step(opt)))
    assert.has_error(function() amp.GradScaler({ init_scal = 3 }) end)
  end)

  it('float16 with the scaler follows the float32 trajectory for 20 steps', function()
    local function train(spec)
      dlua.manual_seed(6)
      local net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
      local opt = optim.SGD(net, { lr = 0.2, momentum = 0.9 })
      local crit = nn.CrossEntropyLoss()
      local sc = spec.scaler or amp.GradScaler({ enabled = false })
      local x, y = dlua.randn(64, 8), dlua.randint(1, 5, 64)
      local losses, skipped = {}, 0
      for i = 1, 20 do
        opt:zero_grad()
        local out, loss = amp.run(spec, function()
          local o = net:forward(x)
          return o, crit:forward(o, y)
        end)
        net:backward(x, sc:scale(crit:backward(out, y)))
        if sc:step(opt) == 'skipped' then skipped = skipped + 1 end
        losses[i] = loss:item()
      end
      return losses, skipped, net
    end
    local l32, _, n32 = train(amp.from_spec('off'))
    local spec = amp.from_spec('f16')
    assert.equals('float16', spec.dtype)
    assert.is_not_nil(spec.scaler)
    local l16, skipped, n16 = train(spec)
    assert.equals(0, skipped)
    -- tolerance: float16 rounds to 2^-11 relative; 20 steps stay within 2e-3 of the loss and 5e-3 (relative 2-norm) of each parameter
    for i = 1, 20 do assert.is_true(math.abs(l16[i] - l32[i]) < 2e-3 * l32[i], ('step %d: %g vs %g'):format(i, l16[i], l32[i])) end
    assert.is_true(l32[20] < 0.8 * l32[1], 'it learned: ' .. l32[1] .. ' -> ' .. l32[20])
    local a, b = n16:named_parameters(), n32:named_parameters()
    for i = 1, #a do assert.is_true(rel(a[i].param, b[i].param) < 5e-3, a[i].name .. ' ' .. rel(a[i].param, b[i].param)) end
  end)

  it('from_spec names what it cannot read', function()
    assert.same({ dtype = 'bfloat16' }, amp.from_spec('bf16'))
    assert.is_nil(amp.from_spec('off').dtype)
    assert.has_error(function() amp.from_spec('fp8') end,
      "dlua.amp.from_spec: unknown precision 'fp8' (expected bf16, f16 or off)")
  end)
end)
