-- dlua.nn: Torch7-style modules with PyTorch's names; containers and the layers built on tensor ops.
local dlua = require 'dlua'
local Module = require 'dlua.nn.module'

local nn = { Module = Module }

local function shape_str(t) return tostring(t:size()) end

---------------------------------------------------------------------------------------------
-- Containers

-- Sequential{m1, m2, ...} or Sequential(m1, m2, ...). Children are NAMED "0", "1", ... as in
-- PyTorch, so state-dict keys ("layer1.0.conv1.weight") match torchvision's one to one;
-- positions stay 1-based: seq:get(1) is the child named "0". :add(module, name) names it.
local Sequential = Module:extend('Sequential')
nn.Sequential = Sequential

function Sequential:__init(...)
  local mods = select('#', ...) == 1 and getmetatable((...)) == nil and (...) or { ... }
  for _, m in ipairs(mods) do self:add(m) end
end

function Sequential:add(module, name)
  return self:add_module(name or tostring(#self._children), module) and self
end

-- The i-th child (1-based; negative from the end).
function Sequential:get(i)
  local n = #self._children
  local k = i < 0 and n + 1 + i or i
  local c = self._children[k]
  if not c then error(string.format('Sequential:get: position %d is out of range 1..%d', i, n), 2) end
  return c.module
end

function Sequential:forward(x)
  -- Each child's input is kept for its backward (Torch7 keeps them the same way).
  self._inputs = self._inputs or {}
  for i, c in ipairs(self._children) do
    self._inputs[i] = x
    x = c.module:forward(x)
  end
  self.output = x
  return x
end

function Sequential:backward(x, grad)
  for i = #self._children, 1, -1 do
    grad = self._children[i].module:backward(self._inputs[i], grad)
  end
  self.grad_input = grad
  return grad
end

function Sequential:__len() return #self._children end

-- Residual(block [, shortcut]): y = block(x) + shortcut(x) (identity when no shortcut).
local Residual = Module:extend('Residual')
nn.Residual = Residual

function Residual:__init(block, shortcut)
  self:add_module('block', block)
  if shortcut then self:add_module('shortcut', shortcut) end
  self.has_shortcut = shortcut ~= nil
end

function Residual:forward(x)
  local y = self.block:forward(x)
  local s = self.has_shortcut and self.shortcut:forward(x) or x
  self.output = y + s
  return self.output
end

function Residual:backward(x, grad)
  local gx = self.block:backward(x, grad)
  local gs = self.has_shortcut and self.shortcut:backward(x, grad) or grad
  self.grad_input = gx + gs
  return self.grad_input
end

---------------------------------------------------------------------------------------------
-- Stateless layers

local Identity = Module:extend('Identity')
nn.Identity = Identity
function Identity:forward(x) self.output = x; return x end
function Identity:backward(_, grad) self.grad_input = grad; return grad end

-- Flatten(start_dim = 2, end_dim = -1), as torch.nn.Flatten (dims 1-based).
local Flatten = Module:extend('Flatten')
nn.Flatten = Flatten
function Flatten:__init(start_dim, end_dim) self.start_dim, self.end_dim = start_dim or 2, end_dim or -1 end
function Flatten:extra_repr() return string.format('%d, %d', self.start_dim, self.end_dim) end
function Flatten:forward(x)
  self.output = x:flatten(self.start_dim, self.end_dim)
  return self.output
end
function Flatten:backward(x, grad)
  self.grad_input = grad:reshape(x:size())
  return self.grad_input
end

local ReLU = Module:extend('ReLU')
nn.ReLU = ReLU
function ReLU:forward(x)
  self.output = x:relu()
  return self.output
end
function ReLU:backward(x, grad)
  -- d relu / dx = 1 where the output is positive
  self.grad_input = grad * self.output:gt(0)
  return self.grad_input
end

---------------------------------------------------------------------------------------------
-- Linear(in, out, {bias = true}): y = x W^T + b, PyTorch's init U(-1/sqrt(in), 1/sqrt(in)).

local Linear = Module:extend('Linear')
nn.Linear = Linear

function Linear:__init(in_features, out_features, opts)
  opts = opts or {}
  assert(type(in_features) == 'number' and type(out_features) == 'number',
    'Linear(in_features, out_features): two numbers expected')
  self.in_features, self.out_features = in_features, out_features
  local bound = 1 / math.sqrt(in_features)
  local dtype = opts.dtype or 'float32'
  self:register_parameter('weight', dlua.empty(out_features, in_features, { dtype = dtype }):uniform_(-bound, bound))
  if opts.bias ~= false then
    self:register_parameter('bias', dlua.empty(out_features, { dtype = dtype }):uniform_(-bound, bound))
  end
end

function Linear:extra_repr()
  return string.format('%d -> %d%s', self.in_features, self.out_features, self.bias and '' or ', no bias')
end

function Linear:forward(x)
  if x:dim() ~= 2 or x:size(2) ~= self.in_features then
    self:input_error(x, string.format('(N, %d)', self.in_features))
  end
  if self.bias then
    self.output = dlua.addmm(self.bias, x, self.weight:t())
  else
    self.output = dlua.mm(x, self.weight:t())
  end
  return self.output
end

function Linear:backward(x, grad)
  -- grad (N, out), x (N, in): parameter gradients accumulate in place (one GEMM each).
  dlua.addmm(self.grad_weight, grad:t(), x, { out = self.grad_weight })
  if self.bias then self.grad_bias:add_(grad:sum(1)) end
  self.grad_input = dlua.mm(grad, self.weight)
  return self.grad_input
end

---------------------------------------------------------------------------------------------
-- Criterions: forward(input, target) -> 0-d loss tensor; backward(input, target) -> grad.

local MSELoss = Module:extend('MSELoss')
nn.MSELoss = MSELoss
function MSELoss:__init(opts) self.reduction = (opts and opts.reduction) or 'mean' end
function MSELoss:forward(x, target)
  if shape_str(x) ~= shape_str(target) then
    error(string.format('MSELoss: input %s and target %s differ in shape', shape_str(x), shape_str(target)), 2)
  end
  local d = x - target
  local sq = d * d
  if self.reduction == 'none' then self.output = sq
  elseif self.reduction == 'sum' then self.output = sq:sum()
  else self.output = sq:mean() end
  return self.output
end
function MSELoss:backward(x, target)
  local g = (x - target) * 2
  if self.reduction == 'mean' then g = g / math.max(x:numel(), 1) end
  self.grad_input = g
  return g
end

return nn
