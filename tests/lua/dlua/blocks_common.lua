-- Shared by blocks_spec.lua and blocks_imagenet_spec.lua: comparisons, one training step, and the bit-for-bit test of a list of ResNet configs against the hand-written blocks (tests/lua/fixtures/resnet_handwritten.lua).
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local resnet = require 'models.resnet'
local old = require 'tests.lua.fixtures.resnet_handwritten'

local M = {}

-- max |a - b| (0 for the same bits up to the sign of zero; NaN anywhere fails the == 0 tests)
function M.diff(a, b)
  if tostring(a:size()) ~= tostring(b:size()) then error('shapes differ: ' .. tostring(a:size()) .. ' and ' .. tostring(b:size()), 2) end
  if a:numel() == 0 then return 0 end
  return (a:double() - b:double()):abs():max():item()
end

function M.rel(a, b) return M.diff(a, b) / (b:double():abs():max():item() + 1e-300) end

-- forward + cross-entropy + backward (gradients accumulate): output, input gradient, the gradient and
-- buffer values by name, copied.
function M.step(m, x, y)
  local crit = nn.CrossEntropyLoss()
  local out = m:forward(x)
  crit:forward(out, y)
  local gx = m:backward(x, crit:backward(out, y))
  local r = { out = out:clone(), gx = gx and gx:clone(), grads = {}, buffers = {} }
  for _, e in ipairs(m:named_parameters()) do r.grads[e.name] = e.grad:clone() end
  for _, e in ipairs(m:named_buffers()) do r.buffers[e.name] = e.buffer:clone() end
  return r
end


-- One `it` per config: {name, opts, input (N, C, H, W), dtype, channels-last, checkpoint policy, steps (2),
-- input_grad(false)}, numbered from first.
function M.same_bits(CONFIGS, first, it, assert) -- (busted gives a spec its own `it` and `assert`)
  local diff, step = M.diff, M.step
  for k, c in ipairs(CONFIGS) do
    local i = first + k - 1
    local name, opts, xs, dtype, cl, policy, steps, no_input_grad = c[1], c[2], c[3], c[4] or 'float32', c[5], c[6], c[7] or 2, c[8]
    local label = string.format('%d: %s %s %s%s%s%s', i, name, table.concat(xs, 'x'), dtype, cl and ' channels-last' or '',
      policy and (' checkpoint ' .. policy) or '', no_input_grad and ' input_grad(false)' or '')
    it(label .. ': the same bits as the hand-written blocks (outputs, input and parameter gradients, statistics), ' .. steps
      .. ' step(s)', function()
      local copts = {}
      for k, v in pairs(opts) do copts[k] = v end
      copts.num_classes = 5
      dlua.manual_seed(100 + i)
      local ref = old[name](copts)
      local new = resnet[name](copts)
      if dtype ~= 'float32' then ref:to(dtype); new:to(dtype) end
      new:load_state_dict(ref:state_dict())
      if policy then ref:checkpoint(policy); new:checkpoint(policy) end
      if no_input_grad then ref:input_grad(false); new:input_grad(false) end
      local x = dlua.randn(xs, { dtype = dtype })
      if cl then x = x:contiguous('channels_last') end
      local y = dlua.randint(1, 6, { xs[1] }, { dtype = 'int64' })
      for s = 1, steps do
        local a, b = step(ref, x, y), step(new, x, y)
        assert.equals(0, diff(b.out, a.out), 'output, step ' .. s)
        if no_input_grad then
          assert.is_nil(a.gx)
          assert.is_nil(b.gx)
        else
          assert.equals(0, diff(b.gx, a.gx), 'input gradient, step ' .. s)
        end
        local n = 0
        for k, g in pairs(a.grads) do
          assert.is_truthy(b.grads[k], k)
          assert.equals(0, diff(b.grads[k], g), k .. ', step ' .. s)
          n = n + 1
        end
        for k, t in pairs(a.buffers) do assert.equals(0, diff(b.buffers[k], t), k .. ', step ' .. s) end
        assert.is_true(n > 0)
      end
      ref, new = nil, nil
      collectgarbage()
    end)
  end

end

return M
