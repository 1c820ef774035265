-- dlua.nn: Torch7-style modules with PyTorch's names: containers, layers and criterions over the C kernels.
local dlua = require 'dlua'
local Module = require 'dlua.nn.module'
local K = require 'bindings.nn'

local nn = { Module = Module }

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

function Sequential:input_grad(flag)
  self.needs_input_grad = flag ~= false
  if self._children[1] then self._children[1].module:input_grad(flag) end
  return self
end

-- in_place: the caller gives grad up (BatchNorm2d:backward). The gradients between children are
-- made here and used once, so they are given up to the children (Module:backward_given).
function Sequential:backward(x, grad, in_place)
  local n = #self._children
  for i = n, 1, -1 do grad = self._children[i].module:backward_given(self._inputs[i], grad, i < n or in_place) end
  self.grad_input = grad
  return grad
end
Sequential.grad_in_place = true

function Sequential:__len() return #self._children end

-- (Residual, BasicBlock, Bottleneck: lua/dlua/nn/blocks.lua, installed at the end)

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
  self.output = K.relu(x)
  return self.output
end
-- The gradient passes where the output is positive (the output is what is kept).
function ReLU:backward(_, grad)
  self.grad_input = K.relu_backward(grad, self.output)
  return self.grad_input
end

-- Dropout(p = 0.5): zeroes elements with probability p in training and scales the rest by
-- 1/(1-p); the mask comes from the Philox generator (opts.generator or the default one).
local Dropout = Module:extend('Dropout')
nn.Dropout = Dropout
function Dropout:__init(p, opts)
  p = p or 0.5
  if type(p) ~= 'number' or p < 0 or p > 1 then error('Dropout: p must be in [0, 1], got ' .. tostring(p), 3) end
  self.p, self.generator = p, opts and opts.generator
end
function Dropout:extra_repr() return 'p=' .. self.p end
function Dropout:forward(x)
  self.output, self.mask = K.dropout(x, self.p, self.training, self.generator)
  return self.output
end
function Dropout:backward(_, grad)
  self.grad_input = self.mask and K.dropout_backward(grad, self.mask, self.p) or grad
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
  self.grad_input = self.needs_input_grad ~= false and dlua.mm(grad, self.weight) or nil
  return self.grad_input
end

---------------------------------------------------------------------------------------------
-- Conv2d(in, out, kernel, {stride = 1, padding = 0, dilation = 1, groups = 1, bias = true,
-- dtype}): torch.nn.Conv2d, PyTorch's default init U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
-- Input (N, C, H, W) in NCHW or channels-last memory; the output keeps the input's format.

local function pair(v, name)
  if type(v) == 'number' then return v, v end
  if type(v) == 'table' and #v == 2 then return v[1], v[2] end
  error(string.format('Conv2d: %s must be a number or a pair, got %s', name, tostring(v)), 4)
end

local Conv2d = Module:extend('Conv2d')
nn.Conv2d = Conv2d

function Conv2d:__init(cin, cout, kernel, opts)
  opts = opts or {}
  local kh, kw = pair(kernel, 'kernel')
  local sh, sw = pair(opts.stride or 1, 'stride')
  local ph, pw = pair(opts.padding or 0, 'padding')
  local dh, dw = pair(opts.dilation or 1, 'dilation')
  local groups = opts.groups or 1
  if cin % groups ~= 0 or cout % groups ~= 0 then
    error(string.format('Conv2d: in (%d) and out (%d) channels must divide by groups (%d)', cin, cout, groups), 3)
  end
  self.in_channels, self.out_channels, self.groups = cin, cout, groups
  self.kernel, self.stride, self.padding, self.dilation = { kh, kw }, { sh, sw }, { ph, pw }, { dh, dw }
  self.c = { sh, sw, ph, pw, dh, dw, groups }
  local dtype = opts.dtype or 'float32'
  local bound = 1 / math.sqrt(cin / groups * kh * kw)
  self:register_parameter('weight', dlua.empty(cout, cin / groups, kh, kw, { dtype = dtype }):uniform_(-bound, bound))
  if opts.bias ~= false then
    self:register_parameter('bias', dlua.empty(cout, { dtype = dtype }):uniform_(-bound, bound))
  end
end

function Conv2d:extra_repr()
  local s = string.format('%d -> %d, %dx%d', self.in_channels, self.out_channels, self.kernel[1], self.kernel[2])
  if self.stride[1] ~= 1 or self.stride[2] ~= 1 then s = s .. string.format(', stride %d', self.stride[1]) end
  if self.padding[1] ~= 0 or self.padding[2] ~= 0 then s = s .. string.format(', padding %d', self.padding[1]) end
  if self.groups ~= 1 then s = s .. ', groups ' .. self.groups end
  if not self.bias then s = s .. ', no bias' end
  return s
end

function Conv2d:forward(x)
  if x:dim() ~= 4 or x:size(2) ~= self.in_channels then
    self:input_error(x, string.format('(N, %d, H, W)', self.in_channels))
  end
  self.output = K.conv2d(x, self.weight, self.bias, self.c)
  return self.output
end

-- add_to (optional, x's shape): the input gradient is added to it in place and it is returned (a
-- residual block's shortcut gradient; channels-last float32 adds inside the convolution).
function Conv2d:backward(x, grad, add_to)
  K.conv2d_backward_weights(self.grad_weight, self.grad_bias, x, grad, self.c)
  if self.needs_input_grad == false then
    self.grad_input = nil
  else
    self.grad_input = K.conv2d_backward_data(grad, self.weight, x, self.c, add_to)
  end
  return self.grad_input
end

---------------------------------------------------------------------------------------------
-- BatchNorm2d(C, {eps = 1e-5, momentum = 0.1, affine = true, relu = false, zero_init = false,
-- sync = false, group = nil, dtype = 'float32', device = 'cpu'}): torch.nn.BatchNorm2d (batch statistics in training, running ones
-- in evaluation; running_var updated with the unbiased variance). relu = true fuses a ReLU (the
-- output is what is kept); zero_init starts gamma at 0 (the last BN of a residual block, "Bag of
-- Tricks"). sync = true is torch.nn.SyncBatchNorm: in training the statistics are those of the
-- batch of every rank of `group` (the world by default), summed in one all-reduce forward and one
-- backward; without dlua.dist initialised, or in a group of one, it is plain BatchNorm2d.

local BatchNorm2d = Module:extend('BatchNorm2d')
nn.BatchNorm2d = BatchNorm2d

local function check_group(g, where, level)
  if g ~= nil and (type(g) ~= 'table' or type(g.size) ~= 'function' or type(g.is_member) ~= 'function') then
    error(string.format('%s: group must come from dlua.dist.new_group, got %s', where, type(g)), level + 1)
  end
  return g
end

function BatchNorm2d:__init(c, opts)
  opts = opts or {}
  self.num_features, self.eps, self.momentum = c, opts.eps or 1e-5, opts.momentum or 0.1
  self.relu = opts.relu or false
  self.sync = opts.sync or false
  self.process_group = check_group(opts.group, self.__name, getmetatable(self) == BatchNorm2d and 3 or 4)  -- the caller's line
  local o = { dtype = opts.dtype or 'float32', device = opts.device }
  if opts.affine ~= false then
    self:register_parameter('weight', opts.zero_init and dlua.zeros(c, o) or dlua.ones(c, o))
    self:register_parameter('bias', dlua.zeros(c, o))
  end
  self:register_buffer('running_mean', dlua.zeros(c, o))
  self:register_buffer('running_var', dlua.ones(c, o))
  self:register_buffer('num_batches_tracked', dlua.zeros({}, { dtype = 'int64', device = opts.device }))
end

function BatchNorm2d:extra_repr()
  return tostring(self.num_features) .. (self.relu and ', relu' or '') .. (self.sync and ', sync' or '')
end

-- The size of the group SyncBatchNorm reduces over (1: nothing to synchronise).
function BatchNorm2d:_sync_size()
  if not self.sync then return 1 end
  local dist = dlua.dist
  if not dist.is_initialized() then return 1 end
  if self.process_group then return self.process_group:size() end
  return dist.world_size()
end

-- skip (optional): a tensor added before the ReLU (a residual block's shortcut), fused.
function BatchNorm2d:forward(x, skip)
  if x:dim() < 2 or x:size(2) ~= self.num_features then
    self:input_error(x, string.format('(N, %d, ...)', self.num_features))
  end
  if self.training then self.num_batches_tracked:add_(1) end
  self._synced = self.training and self:_sync_size() > 1
  if self._synced then
    -- SyncBatchNorm: [sum x, sum x^2, count] of every rank in one all-reduce, then normalise
    if self._sums and self._sums.device ~= x.device then self._sums = nil end -- the model moved
    self._sums = K.batch_norm_stats(x, self._sums)
    dlua.dist.all_reduce(self._sums, 'sum', { group = self.process_group })
    self.output, self.save_mean, self.save_invstd = K.batch_norm_apply(x, self.weight, self.bias, skip, self._sums,
      self.running_mean, self.running_var, self.momentum, self.eps, self.relu)
  else
    self.output, self.save_mean, self.save_invstd = K.batch_norm(x, self.weight, self.bias, skip, self.running_mean,
      self.running_var, self.training, self.momentum, self.eps, self.relu, true)
  end
  self.has_skip = skip ~= nil
  return self.output
end

-- -> grad_input (and grad_skip when forward had a skip). in_place = true: the caller gives up
-- `grad` (as Torch7's in-place ReLU), which is written over with grad_skip (or grad_input without a
-- skip), saving a fresh buffer's memory traffic.
BatchNorm2d.grad_in_place = true -- backward's third argument (Sequential, the ResNets)
function BatchNorm2d:backward(x, grad, in_place)
  local out = self.relu and self.output or nil
  -- without a skip, the ReLU mask is recomputed from x, gamma and beta rather than read from out
  local beta = self.relu and not self.has_skip and self.bias or nil
  local gi, gs
  if self._synced then
    -- the local sums of d and d (x - mean) give grad_weight/grad_bias (DDP averages them); summed
    -- over the ranks they give grad_input
    self._sums = K.batch_norm_backward_reduce(grad, x, out, self.weight, beta, self.save_mean, self.save_invstd,
      self.grad_weight, self.grad_bias, self.relu, self._sums)
    dlua.dist.all_reduce(self._sums, 'sum', { group = self.process_group })
    gi, gs = K.batch_norm_backward_apply(grad, x, out, self.weight, beta, self.save_mean, self.save_invstd, self._sums,
      self.relu, self.has_skip, in_place and grad or nil)
  else
    gi, gs = K.batch_norm_backward(grad, x, out, self.weight, beta, self.save_mean, self.save_invstd, self.grad_weight,
      self.grad_bias, self.training, self.relu, self.has_skip, in_place and grad or nil)
  end
  self.grad_input = gi
  return gi, gs
end

-- SyncBatchNorm(C, opts): BatchNorm2d(C, opts) with sync = true (torch.nn.SyncBatchNorm).
local SyncBatchNorm = BatchNorm2d:extend('SyncBatchNorm')
nn.SyncBatchNorm = SyncBatchNorm

function SyncBatchNorm:__init(c, opts)
  local o = {}
  for k, v in pairs(opts or {}) do o[k] = v end
  o.sync = true
  BatchNorm2d.__init(self, c, o)
end

local function is_batch_norm(m)
  local cls = getmetatable(m)
  while cls do
    if cls == BatchNorm2d then return true end
    local mt = getmetatable(cls)
    cls = mt and mt.__index
  end
  return false
end

-- SyncBatchNorm.convert(model, {group = g}) (torch's convert_sync_batchnorm): every BatchNorm2d
-- of the model becomes a SyncBatchNorm in place, keeping its parameters, buffers, name and
-- options (relu, eps, momentum; views into flat arenas stay). Returns the model.
function SyncBatchNorm.convert(model, opts)
  if type(model) ~= 'table' or type(model.walk) ~= 'function' then
    error('SyncBatchNorm.convert: expected a dlua.nn module, got ' .. type(model), 2)
  end
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= 'group' then error(string.format("SyncBatchNorm.convert: unknown option '%s' (expected group)", tostring(k)), 2) end
  end
  local group = check_group(opts.group, 'SyncBatchNorm.convert', 2)
  model:walk(function(_, m)
    if is_batch_norm(m) then
      m.sync, m.process_group = true, group
      if getmetatable(m) == BatchNorm2d then setmetatable(m, SyncBatchNorm) end
    end
  end)
  return model
end

-- Pooling: kernel, {stride = kernel, padding = 0, dilation = 1, ceil_mode = false}.
local MaxPool2d = Module:extend('MaxPool2d')
nn.MaxPool2d = MaxPool2d
function MaxPool2d:__init(kernel, opts)
  opts = opts or {}
  local kh, kw = pair(kernel, 'kernel')
  local sh, sw = pair(opts.stride or kernel, 'stride')
  local ph, pw = pair(opts.padding or 0, 'padding')
  local dh, dw = pair(opts.dilation or 1, 'dilation')
  self.c = { kh, kw, sh, sw, ph, pw, dh, dw, opts.ceil_mode or false }
end
function MaxPool2d:extra_repr() return string.format('%dx%d, stride %d', self.c[1], self.c[2], self.c[3]) end
function MaxPool2d:forward(x)
  if x:dim() ~= 4 then self:input_error(x, '(N, C, H, W)') end
  self.output, self.indices = K.max_pool2d(x, self.c, self.training)
  return self.output
end
function MaxPool2d:backward(x, grad)
  if not self.indices then error('MaxPool2d: backward after a forward in evaluation mode', 2) end
  self.grad_input = K.max_pool2d_backward(grad, self.indices, x)
  return self.grad_input
end

local AvgPool2d = Module:extend('AvgPool2d')
nn.AvgPool2d = AvgPool2d
function AvgPool2d:__init(kernel, opts)
  opts = opts or {}
  local kh, kw = pair(kernel, 'kernel')
  local sh, sw = pair(opts.stride or kernel, 'stride')
  local ph, pw = pair(opts.padding or 0, 'padding')
  local cip = opts.count_include_pad
  if cip == nil then cip = true end
  self.c = { kh, kw, sh, sw, ph, pw, opts.ceil_mode or false, cip, opts.divisor_override or 0 }
end
function AvgPool2d:extra_repr() return string.format('%dx%d, stride %d', self.c[1], self.c[2], self.c[3]) end
function AvgPool2d:forward(x)
  if x:dim() ~= 4 then self:input_error(x, '(N, C, H, W)') end
  self.output = K.avg_pool2d(x, self.c)
  return self.output
end
function AvgPool2d:backward(x, grad)
  self.grad_input = K.avg_pool2d_backward(grad, x, self.c)
  return self.grad_input
end

-- AdaptiveAvgPool2d(size or {h, w}): torch.nn.AdaptiveAvgPool2d.
local AdaptiveAvgPool2d = Module:extend('AdaptiveAvgPool2d')
nn.AdaptiveAvgPool2d = AdaptiveAvgPool2d
function AdaptiveAvgPool2d:__init(size) self.oh, self.ow = pair(size, 'output size') end
function AdaptiveAvgPool2d:extra_repr() return string.format('%dx%d', self.oh, self.ow) end
function AdaptiveAvgPool2d:forward(x)
  if x:dim() ~= 4 then self:input_error(x, '(N, C, H, W)') end
  self.output = K.adaptive_avg_pool2d(x, self.oh, self.ow)
  return self.output
end
function AdaptiveAvgPool2d:backward(x, grad)
  self.grad_input = K.adaptive_avg_pool2d_backward(grad, x)
  return self.grad_input
end

---------------------------------------------------------------------------------------------
-- Criterions: forward(input, target) -> loss tensor; backward(input, target [, grad_out]) -> grad.

local MSELoss = Module:extend('MSELoss')
nn.MSELoss = MSELoss
function MSELoss:__init(opts) self.reduction = (opts and opts.reduction) or 'mean' end
function MSELoss:forward(x, target)
  self.output = K.mse_loss(x, target, self.reduction)
  return self.output
end
function MSELoss:backward(x, target, grad_out)
  self.grad_input = K.mse_loss_backward(grad_out, x, target, self.reduction)
  return self.grad_input
end

-- CrossEntropyLoss{label_smoothing = 0, ignore_index = nil, weight = nil, reduction = 'mean'}:
-- logits (N, K) and class labels 1..K (int64), as torch.nn.CrossEntropyLoss with 1-based
-- classes. The log-softmax from forward is kept, so backward is one fused pass.
local CrossEntropyLoss = Module:extend('CrossEntropyLoss')
nn.CrossEntropyLoss = CrossEntropyLoss
function CrossEntropyLoss:__init(opts)
  opts = opts or {}
  self.reduction = opts.reduction or 'mean'
  self.label_smoothing = opts.label_smoothing or 0
  self.ignore_index = opts.ignore_index or -100
  -- A buffer, as in torch: criterion:to('cuda') moves the class weights with the logits.
  if opts.weight ~= nil then self:register_buffer('weight', opts.weight) end
end
function CrossEntropyLoss:extra_repr()
  return self.label_smoothing > 0 and ('label_smoothing=' .. self.label_smoothing) or ''
end
function CrossEntropyLoss:forward(logits, labels)
  self.output, self.log_probs = K.cross_entropy(logits, labels, self.weight, self.reduction, self.label_smoothing,
    self.ignore_index)
  return self.output
end
function CrossEntropyLoss:backward(_, labels, grad_out)
  self.grad_input = K.cross_entropy_backward(grad_out, self.log_probs, labels, self.weight, self.reduction,
    self.label_smoothing, self.ignore_index)
  return self.grad_input
end

nn.utils = require 'dlua.nn.utils'  -- clip_grad_norm_, grad_norm_partial
nn.Checkpoint = require 'dlua.nn.checkpoint' -- and Module:checkpoint(policy)
require 'dlua.nn.blocks'(nn)  -- Residual, BasicBlock, Bottleneck (fusing)

return nn
