-- dlua.lr: every schedule at chosen steps against values computed by hand (and PyTorch 1.13's schedulers, stored below), composition boundaries, errors.
local dlua = require 'dlua'
local lr = dlua.lr
local cos, pi = math.cos, math.pi

local function near(want, got, what)
  assert.is_true(math.abs(want - got) <= 1e-12 * math.max(1, math.abs(want)),
    string.format('%s: expected %.17g, got %.17g', what or '', want, got))
end

describe('dlua.lr schedules', function()
  it('constant and the linear scaling rule', function()
    local s = lr.constant(0.1)
    near(0.1, s(0)); near(0.1, s(12345.5))
    assert.equals('constant(lr=0.1)', tostring(lr.constant{ lr = 0.1 }))
    near(0.4, lr.scale(0.1, 1024, 256))
    near(0.2, lr.scale(0.1, 512))  -- reference batch 256 by default
    near(0.0125, lr.scale(0.1, 32, 256))
  end)

  it('step decays by gamma every step_size, fractional steps included', function()
    local s = lr.step{ lr = 1, step_size = 3, gamma = 0.5 }
    near(1, s(0)); near(1, s(2.999)); near(0.5, s(3)); near(0.5, s(5)); near(0.25, s(6)); near(0.125, s(9.5))
    near(0.1, lr.step{ lr = 1, step_size = 30 }(30))  -- gamma 0.1 by default
    assert.equals('step(lr=1, step_size=3, gamma=0.5)', tostring(s))
  end)

  it('multi_step decays once per milestone reached', function()
    local s = lr.multi_step{ lr = 0.1, milestones = { 2, 5 }, gamma = 0.1 }
    near(0.1, s(0)); near(0.1, s(1.99)); near(0.01, s(2)); near(0.01, s(4.5)); near(0.001, s(5)); near(0.001, s(1e6))
    assert.equals('multi_step(lr=0.1, milestones={2, 5}, gamma=0.1)', tostring(s))
  end)

  it('linear and linear_warmup move the factor linearly, then hold', function()
    local s = lr.linear{ lr = 0.3, steps = 4 }  -- start_factor 1/3, end_factor 1 (PyTorch's LinearLR)
    near(0.1, s(0)); near(0.15, s(1)); near(0.2, s(2)); near(0.3, s(4)); near(0.3, s(40))
    local d = lr.linear{ lr = 2, steps = 10, start_factor = 1, end_factor = 0.5 }
    near(2, d(0)); near(1.5, d(5)); near(1, d(10)); near(1, d(11))
    local w = lr.linear_warmup{ lr = 0.4, steps = 5, start_factor = 0.25 }
    near(0.1, w(0)); near(0.25, w(2.5)); near(0.34, w(4)); near(0.4, w(5)); near(0.4, w(9))
    assert.equals(5, w.steps)
    assert.equals('linear_warmup(lr=0.4, steps=5, start_factor=0.25)', tostring(w))
  end)

  it('cosine anneals to eta_min at steps and stays there', function()
    local s = lr.cosine{ lr = 1, steps = 10, eta_min = 0.1 }
    near(1, s(0)); near(0.55, s(5)); near(0.1, s(10)); near(0.1, s(25))
    near(0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2, s(2.5), 'quarter')
    near(0.2 * (1 + cos(pi * 0.3)) / 2, lr.cosine{ lr = 0.2, steps = 100 }(30))
    assert.equals('cosine(lr=1, steps=10, eta_min=0.1)', tostring(s))
  end)

  it('polynomial decays as (1 - t/steps)^power', function()
    local s = lr.polynomial{ lr = 1, steps = 4, power = 2 }
    near(1, s(0)); near(0.5625, s(1)); near(0.25, s(2)); near(0, s(4)); near(0, s(8))
    local l = lr.polynomial{ lr = 0.5, steps = 10, eta_min = 0.1 }  -- power 1: a straight line to eta_min
    near(0.5, l(0)); near(0.3, l(5)); near(0.1, l(10))
  end)

  it('one_cycle follows OneCycleLR (hand-computed and PyTorch values)', function()
    local s = lr.one_cycle{ max_lr = 1, steps = 10 }
    -- initial = max_lr / 25 = 0.04; phase 1 ends at 0.3 * 10 - 1 = 2; minimum 0.04 / 1e4 = 4e-6 at step 9.
    near(0.04, s(0)); near(0.52, s(1)); near(1, s(2))
    near(4e-6 + (1 - 4e-6) * (1 + cos(pi / 7)) / 2, s(3), 'step 3')
    near(4e-6, s(9)); near(4e-6, s(15))
    -- torch.optim.lr_scheduler.OneCycleLR(max_lr=1, total_steps=10), lr before each step:
    local torch_cos = { 0.040000000000000036, 0.52, 1.0, 0.9504846320134737, 0.8117456539497631, 0.6112620219362893,
      0.38874197806371075, 0.18825834605023697, 0.049519367986526286, 4e-06 }
    for t = 0, 9 do near(torch_cos[t + 1], s(t), 'cos ' .. t) end
    local torch_lin = { 0.04, 0.52, 1.0, 0.8571434285714286, 0.7142868571428571, 0.5714302857142857,
      0.42857371428571434, 0.2857171428571429, 0.14286057142857145, 4.000000000004e-06 }
    local l = lr.one_cycle{ max_lr = 1, total_steps = 10, anneal = 'linear' }
    for t = 0, 9 do near(torch_lin[t + 1], l(t), 'linear ' .. t) end
    local torch_three = { 0.040000000000000036, 0.52, 1.0, 0.52, 0.04, 0.0361807218535102, 0.0261817218535102,
      0.013822278146489805, 0.0038232781464898036, 4e-06 }
    local th = lr.one_cycle{ max_lr = 1, steps = 10, three_phase = true }
    for t = 0, 9 do near(torch_three[t + 1], th(t), 'three_phase ' .. t) end
    -- A phase boundary that is not an integer (0.25 * 7 - 1 = 0.75).
    local torch_pct = { 0.09999999999999998, 0.9944209976994517, 0.8666594099789982, 0.611649206511179,
      0.31801215832898566, 0.08779373222916066, 0.001 }
    local p = lr.one_cycle{ max_lr = 1, steps = 7, pct_start = 0.25, div_factor = 10, final_div_factor = 100 }
    for t = 0, 6 do near(torch_pct[t + 1], p(t), 'pct_start ' .. t) end
    assert.matches('^one_cycle%(max_lr=1, steps=10, pct_start=0.3, div_factor=25, final_div_factor=10000, anneal=cos%)$',
      tostring(s))
  end)
end)

describe('dlua.lr.sequential', function()
  it('runs warmup then cosine, each counting from its milestone (as SequentialLR)', function()
    local s = lr.sequential{ lr.linear_warmup{ lr = 0.4, steps = 5, start_factor = 0.25 }, lr.cosine{ lr = 0.4, steps = 10 } }
    -- torch: SequentialLR([LinearLR(start_factor=0.25, total_iters=5), CosineAnnealingLR(T_max=10)], milestones=[5])
    local torch_seq = { 0.1, 0.16000000000000003, 0.22000000000000003, 0.28, 0.34, 0.4, 0.39021130325903075,
      0.3618033988749895, 0.3175570504584947, 0.26180339887498955, 0.20000000000000004, 0.13819660112501056,
      0.08244294954150541, 0.03819660112501054, 0.009788696740969296 }
    for t = 0, 14 do near(torch_seq[t + 1], s(t), 'step ' .. t) end
    near(0.1 + 0.3 * 4.999 / 5, s(4.999), 'just before the milestone')
    near(0, s(15)); near(0, s(1000))
    assert.equals(15, s.steps)
    assert.equals('sequential(linear_warmup(lr=0.4, steps=5, start_factor=0.25), from 5: cosine(lr=0.4, steps=10, eta_min=0))',
      tostring(s))
  end)

  it('takes explicit milestones, cutting a schedule short or holding it', function()
    local s = lr.sequential{ lr.constant(1), lr.constant(2), lr.constant(3), milestones = { 2, 4 } }
    near(1, s(0)); near(1, s(1.999)); near(2, s(2)); near(2, s(3.999)); near(3, s(4)); near(3, s(1e9))
    local c = lr.sequential{ lr.linear_warmup{ lr = 1, steps = 10, start_factor = 0 }, lr.step{ lr = 1, step_size = 2, gamma = 0.5 },
      milestones = { 3 } }
    near(0.2, c(2)); near(1, c(3)); near(1, c(4.5)); near(0.5, c(5)); near(0.25, c(7))
    -- Nested: the inner sequential's length counts for the outer one's milestone.
    local inner = lr.sequential{ lr.linear_warmup{ lr = 1, steps = 2, start_factor = 0.5 }, lr.cosine{ lr = 1, steps = 4 } }
    local outer = lr.sequential{ inner, lr.constant(0.01) }
    near(0.75, outer(1)); near(1, outer(2)); near(0.5, outer(4)); near(0.01, outer(6)); near(0.01, outer(60))
  end)

  it('rejects bad composition with the reason', function()
    assert.has_error(function() lr.sequential{ lr.step{ lr = 1, step_size = 2 }, lr.constant(1) } end,
      'lr.sequential: give milestones, or schedules with a length: step(lr=1, step_size=2, gamma=0.1) (item 1) has none')
    assert.has_error(function() lr.sequential{ lr.constant(1), lr.constant(2), milestones = { 3, 4 } } end,
      'lr.sequential: 2 schedules need 1 milestones, got 2')
    assert.has_error(function() lr.sequential{ lr.constant(1), lr.constant(2), lr.constant(3), milestones = { 4, 3 } } end,
      'lr.sequential: milestones must be increasing positive numbers, got 3 at position 2')
    assert.has_error(function() lr.sequential{ lr.constant(1), 0.5 } end, 'lr.sequential: item 2 is not a schedule (number)')
    assert.has_error(function() lr.sequential{ lr.constant(1), milestone = { 2 } } end,
      "lr.sequential: unknown option 'milestone' (expected a list of schedules and milestones)")
  end)
end)

describe('dlua.lr errors', function()
  it('name the schedule, the option and the value, at the caller', function()
    local ok, err = pcall(function() local s = lr.cosine{ lr = 0.1, steps = 100, eta_mn = 0 }; return s end)
    assert.is_false(ok)
    assert.matches('lr_spec.lua:%d+: lr.cosine: unknown option \'eta_mn\' %(expected eta_min, lr, steps%)', err)
    assert.has_error(function() lr.cosine{ lr = 0.1 } end, 'lr.cosine: option steps is required')
    assert.has_error(function() lr.step{ lr = 0.1, step_size = -1 } end,
      'lr.step: step_size must be a positive number, got -1')
    assert.has_error(function() lr.one_cycle{ max_lr = 1, steps = 10.5 } end,
      'lr.one_cycle: steps must be a positive integer, got 10.5')
    assert.has_error(function() lr.one_cycle{ max_lr = 1, steps = 10, pct_start = 1 } end,
      'lr.one_cycle: pct_start must be a number in (0, 1), got 1')
    assert.has_error(function() lr.one_cycle{ max_lr = 1, steps = 10, anneal = 'cosine' } end,
      "lr.one_cycle: anneal must be 'cos' or 'linear', got cosine")
    assert.has_error(function() lr.multi_step{ lr = 1, milestones = { 5, 2 } } end,
      'lr.multi_step: milestones must be increasing numbers >= 0, got 2 at position 2')
    assert.has_error(function() lr.scale(0.1, 0) end, 'lr.scale: global_batch must be a positive number, got 0')
    local s = lr.constant(1)
    assert.has_error(function() s(-1) end, 'constant: the step must be a finite number >= 0, got -1')
    assert.has_error(function() s(0 / 0) end)
    assert.is_true(lr.is_schedule(s))
    assert.is_false(lr.is_schedule({}))
  end)
end)
