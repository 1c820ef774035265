-- dlua.optim against torch.optim's documented update rules, computed here in plain Lua.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'

local f64 = { dtype = 'float64' }

-- A model with a 2-D weight and a 1-D bias, its gradients set to chosen values per step.
local function setup()
  dlua.manual_seed(11)
  local m = nn.Linear(3, 2, f64)
  m:flatten()
  return m
end

local function values(t) return t:view(-1):totable() end

local function set_grads(m, step)
  local gw, gb = m.grad_weight:view(-1), m.grad_bias:view(-1)
  for i = 1, gw:numel() do gw[i] = math.sin(i + step) end
  for i = 1, gb:numel() do gb[i] = math.cos(i * step) end
end

describe('dlua.optim', function()
  it('SGD with momentum, nesterov, weight decay and a no-decay group matches torch.optim.SGD', function()
    local m = setup()
    local opt = optim.SGD(m, { lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 0.01,
      groups = { { filter = function(_, p) return p:dim() == 1 end, weight_decay = 0 } } })
    local ref = { w = values(m.weight), b = values(m.bias) }
    local buf = { w = {}, b = {} }
    for step = 1, 3 do
      set_grads(m, step)
      local grads = { w = values(m.grad_weight), b = values(m.grad_bias) }
      opt:step()
      for _, k in ipairs({ 'w', 'b' }) do
        local wd = k == 'w' and 0.01 or 0
        for i, p in ipairs(ref[k]) do
          local d = grads[k][i] + wd * p
          buf[k][i] = step == 1 and d or 0.9 * buf[k][i] + d
          d = d + 0.9 * buf[k][i]
          ref[k][i] = p - 0.1 * d
        end
      end
    end
    local w, b = values(m.weight), values(m.bias)
    for i = 1, #w do assert.near(ref.w[i], w[i], 1e-12) end
    for i = 1, #b do assert.near(ref.b[i], b[i], 1e-12) end
  end)

  it('AdamW matches torch.optim.AdamW, with a grad scale', function()
    local m = setup()
    local opt = optim.AdamW(m, { lr = 0.01, betas = { 0.8, 0.9 }, eps = 1e-6, weight_decay = 0.1 })
    local ref = values(m._arena.params.float64)
    local mom, var = {}, {}
    for step = 1, 3 do
      set_grads(m, step)
      local g = values(m._arena.grads.float64)
      opt:step({ grad_scale = 0.5 })
      for i, p in ipairs(ref) do
        local gi = g[i] * 0.5
        p = p * (1 - 0.01 * 0.1)
        mom[i] = 0.8 * (mom[i] or 0) + 0.2 * gi
        var[i] = 0.9 * (var[i] or 0) + 0.1 * gi * gi
        local bc1, bc2 = 1 - 0.8 ^ step, 1 - 0.9 ^ step
        ref[i] = p - 0.01 / bc1 * mom[i] / (math.sqrt(var[i]) / math.sqrt(bc2) + 1e-6)
      end
    end
    local got = values(m._arena.params.float64)
    for i = 1, #got do assert.near(ref[i], got[i], 1e-12) end
  end)

  it('LARS scales each weight by its trust ratio and leaves 1-D parameters unadapted', function()
    local m = setup()
    local opt = optim.LARS(m, { lr = 0.5, momentum = 0, weight_decay = 0.01, trust_coefficient = 0.02 })
    set_grads(m, 1)
    local w, gw = values(m.weight), values(m.grad_weight)
    local b, gb = values(m.bias), values(m.grad_bias)
    local nw, ng = 0, 0
    for i = 1, #w do nw, ng = nw + w[i] ^ 2, ng + gw[i] ^ 2 end
    nw, ng = math.sqrt(nw), math.sqrt(ng)
    local trust = 0.02 * nw / (ng + 0.01 * nw + 1e-8)
    opt:step()
    local w2, b2 = values(m.weight), values(m.bias)
    for i = 1, #w do assert.near(w[i] - 0.5 * trust * (gw[i] + 0.01 * w[i]), w2[i], 1e-12) end
    for i = 1, #b do assert.near(b[i] - 0.5 * gb[i], b2[i], 1e-12) end
  end)

  it('refuses what is not a module, and nesterov without momentum', function()
    assert.has_error(function() optim.SGD({}, { lr = 1 }) end, 'SGD: expected a dlua.nn module as the first argument')
    assert.has_error(function() optim.SGD(setup(), { lr = 1, nesterov = true }) end,
      'SGD: nesterov needs momentum > 0 and dampening 0')
  end)
end)
