-- dlua.monitor: the NaN guard names the step and the module where a NaN or an infinity was injected (by hand, at a
-- known place), the debug mode stops inside that forward, a loss scaler or 'off' lets it pass; the learning-rate
-- override and attach's chunks outside a launcher.
local dlua = require 'dlua'
local nn = dlua.nn
local monitor = require 'dlua.monitor'
local spmd = require 'dlua.spmd'

local nan, inf = 0 / 0, math.huge

-- Linear(3, 4) -> ReLU -> Linear(4, 2), fixed weights; its modules' paths are "0", "1", "2".
local function net()
  dlua.manual_seed(3)
  return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
end

local function loss_of(m, x) return m:forward(x):sum():item() end

local function guard_error(mon, loss, x)
  local ok, err = pcall(mon.check_loss, mon, loss, x)
  assert.is_false(ok, 'check_loss should have stopped the run')
  return tostring(err)
end

describe('dlua.monitor NaN guard', function()
  it('passes a finite loss through as a number (given as a number or a one-element tensor)', function()
    local m = net()
    local mon = monitor.Monitor({ model = m })
    local x = dlua.randn(5, 3)
    local l = loss_of(m, x)
    assert.equals(l, mon:check_loss(l, x))
    assert.equals(m:forward(x):sum():item(), mon:check_loss(m:forward(x):sum(), x))
  end)

  it('names the step and the first module whose output went non-finite: a NaN weight in module 2', function()
    local m = net()
    m:children()[3].weight[{ 1, 2 }] = nan
    local mon = monitor.Monitor({ model = m })
    mon:step(41)  -- 41 steps done: the failing one is step 42
    local x = dlua.randn(5, 3)
    local l = loss_of(m, x)
    assert.is_true(l ~= l)
    local err = guard_error(mon, l, x)
    assert.truthy(err:find('loss is nan at step 42', 1, true), err)
    assert.truthy(err:find('the first module whose output went non-finite: 2 (Linear); its weight holds non-finite values', 1, true), err)
  end)

  it('says when the input was already non-finite (module 0 gets it)', function()
    local m = net()
    local x = dlua.randn(5, 3)
    x[{ 2, 3 }] = inf
    local err = guard_error(monitor.Monitor({ model = m }), loss_of(m, x), x)
    assert.truthy(err:find('at step 1;', 1, true), err)
    assert.truthy(err:find('0 (Linear); its input was already non-finite', 1, true), err)
  end)

  it('finds an overflow of finite numbers (float32 max is 3.4e38) and says the inputs were finite', function()
    local m = net()
    local w = m:children()[1].weight
    w:fill_(1e30)
    local x = dlua.full({ 2, 3 }, 1e30)
    local l = loss_of(m, x)
    assert.is_true(l == inf or l == -inf or l ~= l, tostring(l))
    local err = guard_error(monitor.Monitor({ model = m }), l, x)
    assert.truthy(err:find('0 (Linear); its input and parameters were finite', 1, true), err)
  end)

  it('under a DDP-like wrapper (.module) walks the wrapped model', function()
    local m = net()
    m:children()[3].bias[1] = nan
    local wrapper = { module = m }
    local x = dlua.randn(2, 3)
    local err = guard_error(monitor.Monitor({ model = wrapper }), loss_of(m, x), x)
    assert.truthy(err:find('2 (Linear); its bias holds non-finite values', 1, true), err)
  end)

  it("nan_check = 'modules' stops inside the forward that made the NaN, before any loss", function()
    local m = net()
    local mon = monitor.Monitor({ model = m, nan_check = 'modules' })
    local x = dlua.randn(2, 3)
    loss_of(m, x)  -- finite: nothing happens
    m:children()[3].weight[{ 2, 1 }] = nan
    local ok, err = pcall(m.forward, m, x)
    assert.is_false(ok)
    err = tostring(err)
    assert.truthy(err:find('2 (Linear) forward: output went non-finite at step 1: its weight holds non-finite values', 1, true), err)
  end)

  it("leaves a non-finite loss to a loss scaler (mixed precision), and to nan_check = 'off'", function()
    local scaler = { get_scale = function() return 65536 end }
    assert.is_true(monitor.Monitor({ model = net(), scaler = scaler }):check_loss(inf) == inf)
    local v = monitor.Monitor({ model = net(), nan_check = 'off' }):check_loss(nan)
    assert.is_true(v ~= v)
  end)

  it('rejects an unknown option or check mode, naming it', function()
    local ok, err = pcall(monitor.Monitor, { modle = 1 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('unknown option modle', 1, true))
    ok, err = pcall(monitor.Monitor, { nan_check = 'always' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("nan_check must be 'loss', 'modules' or 'off', got always", 1, true))
  end)
end)

describe('dlua.monitor step boundary', function()
  it('gives the schedule until set_lr overrides it, on the optimizer too', function()
    local m = net()
    local opt = dlua.optim.SGD(m, { lr = 0.5 })
    local mon = monitor.Monitor({ model = m, optimizer = opt, schedule = function(s) return 0.1 * (s + 1) end })
    assert.equals(0.1, mon:lr(0))
    assert.equals(0.30000000000000004, mon:lr(2))
    assert.is_false(mon:step(3, 1.25))  -- no launcher: nothing to run, no stop
    local ok, text = spmd.run_chunk('set_lr(0.05)', mon:_env())
    assert.is_true(ok, text)
    assert.equals('lr 0.05 from step 4 on\n', text)
    assert.equals(0.05, mon:lr(7))
    assert.equals(0.05, opt:get_lr())
  end)

  it("attach's chunks read the step, the loss, the learning rate and the model by name", function()
    local m = net()
    local opt = dlua.optim.SGD(m, { lr = 0.25 })
    local mon = monitor.Monitor({ model = m, optimizer = opt, state = { epoch = 3 } })
    mon:step(9, 0.75)
    local ok, text = spmd.run_chunk('print(step, loss, lr, epoch)', mon:_env())
    assert.is_true(ok, text)
    assert.equals('9\t0.75\t0.25\t3\n', text)
    ok, text = spmd.run_chunk('=model:children()[1].weight:size(1)', mon:_env())
    assert.is_true(ok, text)
    assert.equals('4\n', text)
    ok, text = spmd.run_chunk('stop()', mon:_env())
    assert.is_true(ok, text)
    assert.is_true(mon.stopping)
    ok, text = spmd.run_chunk('checkpoint()', mon:_env())
    assert.is_false(ok)
    assert.truthy(text:find('this run saves no checkpoints', 1, true), text)
  end)
end)

describe('dlua.monitor NaN guard on one rank of many', function()
  it('runs no collective while it checks (a SyncBatchNorm-like module stops the check, not the run)', function()
    local dist_binding = require 'bindings.dist'
    local nn = dlua.nn
    local Talks = nn.Module:extend('Talks')
    function Talks:forward(x)
      dist_binding.site()  -- what every collective calls first
      return x
    end
    local m = nn.Sequential(nn.Linear(3, 2), Talks(), nn.Linear(2, 1))
    local x = dlua.randn(2, 3)
    local mon = monitor.Monitor({ model = m })
    -- the NaN comes after the talking module: the check stops there and says why
    m:children()[3].weight[{ 1, 1 }] = 0 / 0
    local err = guard_error(mon, m:forward(x):sum():item(), x)
    assert.truthy(err:find('loss is nan at step 1 (its forward talks to the other ranks', 1, true), err)
    -- a culprit before the talking module is still named
    m:children()[3].weight:fill_(1)
    m:children()[1].bias[1] = 0 / 0
    err = guard_error(mon, m:forward(x):sum():item(), x)
    assert.truthy(err:find('0 (Linear); its bias holds non-finite values', 1, true), err)
    -- and collectives work again afterwards
    assert.is_string(dist_binding.site())
  end)
end)
