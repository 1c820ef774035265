-- Residual blocks that fuse: nn.Residual (the add and ReLU inside the last batch-norm, gradients reused in place), nn.BasicBlock, nn.Bottleneck.
--
-- A residual block computes out = act(body(x) + shortcut(x)). Written as plain modules that is three
-- extra passes over the activation (the add, the ReLU, and their backward), plus a fresh gradient
-- buffer for every layer. nn.Residual does what models/resnet.lua used to write by hand:
--   * when the body ends with a BatchNorm2d, the shortcut's output goes into that batch-norm as its
--     skip, so normalise + add + ReLU is one pass forward and one backward (which also gives the
--     shortcut's gradient, ReLU-masked);
--   * a gradient made inside the block and used once is given up to the module before it (a
--     batch-norm writes its own over it), and freed as soon as it is used: its memory goes back to
--     the allocator while still in cache (ResNet-20, batch 128: the step's peak 308 -> 236 MB);
--   * the first module's input gradient is added into the shortcut's gradient (inside the
--     convolution for a channels-last float32 Conv2d), and the block's incoming gradient, when the
--     caller gives it up, carries the shortcut's: one buffer per stage.
-- The results are the same bits as the hand-written blocks (tests/lua/dlua/blocks_spec.lua).
return function(nn)
  local Module, Sequential, BatchNorm2d, Conv2d = nn.Module, nn.Sequential, nn.BatchNorm2d, nn.Conv2d
  local K = require 'bindings.nn'

  local function is_a(m, cls)
    local c = getmetatable(m)
    while c do
      if c == cls then return true end
      local mt = getmetatable(c)
      c = mt and mt.__index
    end
    return false
  end

  local function is_module(m) return type(m) == 'table' and getmetatable(m) ~= nil and m.forward ~= nil end

  -- The block's gradients made inside it are freed once used; the modules that held them as
  -- grad_input forget them.
  local function drop(t, holders)
    for _, m in ipairs(holders) do m.grad_input = nil end
    t:free()
  end

  -----------------------------------------------------------------------------------------------
  -- Residual(body [, shortcut [, opts]]): out = body(x) + shortcut(x) (x when no shortcut), then a
  -- ReLU when opts.relu.
  --   body:     a module (a child named 'block'; a Sequential's children are run one by one), or a
  --             list of modules or {name, module} pairs, which become the Residual's own children,
  --             under those names (torchvision's "layer1.0.conv1.weight") or "0", "1", ... as in a
  --             Sequential.
  --   shortcut: a module (child 'shortcut') or a {name, module} pair ('downsample').
  --   opts:     relu (false); fuse (true): false keeps the add and ReLU as passes of their own.
  -- Fused when the body's last module is a BatchNorm2d built without relu: the add goes into it
  -- (and the ReLU, whose flag it then takes). Otherwise plain: add, ReLU, each a pass of its own.
  local Residual = Module:extend('Residual')
  nn.Residual = Residual
  Residual.is_block = true -- a residual block for model:checkpoint('blocks')
  Residual.grad_in_place = true

  local function named(what, v, default_name, level)
    if is_module(v) then return default_name, v end
    if type(v) == 'table' and getmetatable(v) == nil and type(v[1]) == 'string' and is_module(v[2]) then return v[1], v[2] end
    error(string.format('Residual: %s must be a module or a {name, module} pair, got %s', what, type(v)), level + 1)
  end

  function Residual:__init(body, shortcut, opts)
    opts = opts or {}
    for k in pairs(opts) do
      if k ~= 'relu' and k ~= 'fuse' then
        error(string.format("Residual: unknown option '%s' (expected relu, fuse)", tostring(k)), 3)
      end
    end
    local last
    if is_module(body) then
      self:add_module('block', body)
      self._body = 'block'
      last = is_a(body, Sequential) and body._children[#body._children] and body._children[#body._children].module or body
    elseif type(body) == 'table' and getmetatable(body) == nil and #body > 0 then
      self._body = {}
      for i, e in ipairs(body) do
        local name, m = named('body[' .. i .. ']', e, tostring(i - 1), 3)
        self:add_module(name, m)
        self._body[i] = name
        last = m
      end
    else
      error('Residual: body must be a module or a non-empty list of {name, module} pairs, got ' .. type(body), 3)
    end
    if shortcut ~= nil then
      local name, m = named('shortcut', shortcut, 'shortcut', 3)
      self:add_module(name, m)
      self._shortcut = name
    end
    -- (underscored: a child may be named 'relu')
    self._relu = opts.relu == true
    self._fused = opts.fuse ~= false and is_a(last, BatchNorm2d) and not last.relu
    if self._fused then last.relu = self._relu end -- it now computes relu(bn(h) + s)
  end

  -- Whether the add (and ReLU) run inside the body's last batch-norm.
  function Residual:is_fused() return self._fused end

  function Residual:extra_repr()
    return (self._fused and 'fused' or 'plain') .. (self._relu and ', relu' or '')
  end

  -- The body's modules in order, looked up afresh (model:checkpoint may have wrapped some of them).
  function Residual:_body_modules()
    local r = {}
    if type(self._body) == 'string' then
      local b = self:_child(self._body)
      if is_a(b, Sequential) then
        for i, c in ipairs(b._children) do r[i] = c.module end
      else
        r[1] = b
      end
    else
      for i, name in ipairs(self._body) do r[i] = self:_child(name) end
    end
    return r
  end

  function Residual:_child(name)
    for _, c in ipairs(self._children) do
      if c.name == name then return c.module end
    end
  end

  function Residual:_shortcut_module() return self._shortcut and self:_child(self._shortcut) or nil end

  function Residual:forward(x)
    local body = self:_body_modules()
    local n = #body
    self._inputs = self._inputs or {}
    local h = x
    for i = 1, n - 1 do
      self._inputs[i] = h
      h = body[i]:forward(h)
    end
    self._inputs[n] = h
    local sc = self:_shortcut_module()
    local s = sc and sc:forward(x) or x
    if self._fused then
      self.output = body[n]:forward(h, s)
    else
      local y = body[n]:forward(h) + s
      self.output = self._relu and K.relu(y) or y
    end
    return self.output
  end

  function Residual:input_grad(flag)
    self.needs_input_grad = flag ~= false
    self:_body_modules()[1]:input_grad(flag)
    local sc = self:_shortcut_module()
    if sc then sc:input_grad(flag) end
    return self
  end

  -- The first module's input gradient for g, added into gs (the shortcut's gradient, the block's own
  -- to write): inside the convolution for a Conv2d.
  local function first_backward(m, x, g, gs)
    if is_a(m, Conv2d) then return m:backward(x, g, gs) end
    local gi = m:backward_given(x, g, true)
    if gi == nil then return nil end
    gs:add_(gi)
    return gs
  end

  local function fused_backward(self, x, grad, in_place)
    local body, inputs = self:_body_modules(), self._inputs
    local n = #body
    -- the batch-norm with the skip: gs is the shortcut's gradient (over grad when given up)
    local g, gs = body[n]:backward(inputs[n], grad, in_place)
    local sc = self:_shortcut_module()
    if n == 1 then -- the batch-norm is the whole body: its input gradient is the body's
      if sc then gs = sc:backward_given(x, gs, true) end
      return gs:add_(g)
    end
    local holders = { body[n] } -- the modules whose grad_input is g (made inside the block)
    for i = n - 1, 2, -1 do
      local m = body[i]
      local gn = m:backward_given(inputs[i], g, true)
      if rawequal(gn, g) then
        holders[#holders + 1] = m -- written over g (a batch-norm)
      else
        drop(g, holders)
        g, holders = gn, { m }
      end
    end
    if sc then gs = sc:backward_given(x, gs, true) end
    local gi = first_backward(body[1], x, g, gs)
    if not rawequal(g, gi) then drop(g, holders) end
    return gi
  end

  -- Without the fusion: the ReLU's mask, then the body and the shortcut each from that gradient,
  -- then the sum. The shortcut runs first: the body may write over gradients it made itself.
  local function plain_backward(self, x, grad)
    local body, inputs = self:_body_modules(), self._inputs
    local gy = self._relu and K.relu_backward(grad, self.output) or grad
    local sc = self:_shortcut_module()
    local gs = sc and sc:backward(x, gy) or gy
    local g = gy
    for i = #body, 1, -1 do
      local own = not rawequal(g, gy) and not rawequal(g, gs)
      g = body[i]:backward_given(inputs[i], g, own)
    end
    if g == nil then return nil end
    return g + gs
  end

  function Residual:backward(x, grad, in_place)
    self.grad_input = self._fused and fused_backward(self, x, grad, in_place) or plain_backward(self, x, grad)
    return self.grad_input
  end

  -----------------------------------------------------------------------------------------------
  -- torchvision's v1.5 blocks with its child names (conv1, bn1, conv2, bn2[, conv3, bn3], downsample),
  -- as fusing Residuals: (cin, planes, stride, downsample (a module or nil), {zero_init_residual}).

  local function conv(cin, cout, k, stride)
    return Conv2d(cin, cout, k, { stride = stride or 1, padding = (k - 1) / 2, bias = false })
  end

  -- out = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))
  local BasicBlock = Residual:extend('BasicBlock')
  nn.BasicBlock = BasicBlock
  BasicBlock.expansion = 1

  function BasicBlock:__init(cin, planes, stride, downsample, opts)
    Residual.__init(self, {
      { 'conv1', conv(cin, planes, 3, stride) },
      { 'bn1', BatchNorm2d(planes, { relu = true }) },
      { 'conv2', conv(planes, planes, 3) },
      { 'bn2', BatchNorm2d(planes, { zero_init = opts and opts.zero_init_residual }) },
    }, downsample and { 'downsample', downsample } or nil, { relu = true })
  end
  function BasicBlock:extra_repr() return '' end

  -- v1.5: the stride sits on the 3x3 convolution (conv2), as in torchvision.
  local Bottleneck = Residual:extend('Bottleneck')
  nn.Bottleneck = Bottleneck
  Bottleneck.expansion = 4

  function Bottleneck:__init(cin, planes, stride, downsample, opts)
    Residual.__init(self, {
      { 'conv1', conv(cin, planes, 1) },
      { 'bn1', BatchNorm2d(planes, { relu = true }) },
      { 'conv2', conv(planes, planes, 3, stride) },
      { 'bn2', BatchNorm2d(planes, { relu = true }) },
      { 'conv3', conv(planes, planes * 4, 1) },
      { 'bn3', BatchNorm2d(planes * 4, { zero_init = opts and opts.zero_init_residual }) },
    }, downsample and { 'downsample', downsample } or nil, { relu = true })
  end
  function Bottleneck:extra_repr() return '' end
end
