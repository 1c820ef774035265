-- nn.Module: Torch7-style modules (forward/backward) with PyTorch's names, state dicts and flat arenas.
local dlua = require 'dlua'

local Module = {}
Module.__index = Module
Module.__name = 'Module'

---------------------------------------------------------------------------------------------
-- Errors name the module and the caller's line. A forward or backward called from outside any
-- module (the model's root) runs protected; an error raised anywhere below it is re-raised as
--   train.lua:42: layer3.1.conv2 (Conv2d) forward: expected (N, 3, H, W), got ...
-- naming the innermost module on the stack by its state-dict path and the first line of code
-- outside dlua's own tree (lua/dlua, bindings, models) that called the model. Calls below the
-- root run unwrapped: one integer test each.

local depth = 0  -- > 0 while a root forward/backward runs
local tree = debug.getinfo(1, 'S').source:match('^@(.*)lua/dlua/nn/module%.lua$')
local function is_library(src)
  if tree == nil or src:sub(1, 1) ~= '@' then return src == '=[C]' end
  local rel = src:sub(2, #tree + 1) == tree and src:sub(#tree + 2) or nil
  return rel ~= nil and (rel:find('^lua/dlua/') or rel:find('^bindings/') or rel:find('^models/')) ~= nil
end

local function is_module(v) return type(v) == 'table' and rawget(v, '_children') ~= nil and rawget(v, '_params') ~= nil end

-- xpcall handler: the message and the innermost module on the stack where it was raised.
local function catch(e)
  local level = 2
  while true do
    local info = debug.getinfo(level, 'f')
    if not info then break end
    local _, v = debug.getlocal(level, 1)
    if is_module(v) then return { e, v } end
    level = level + 1
  end
  return { e }
end

-- The path of `target` below `root` ('' for the root itself), or nil.
local function path_of(root, target)
  local found
  root:walk(function(prefix, m) if found == nil and m == target then found = prefix end end)
  return found
end

-- "file:line" of the first caller outside dlua's tree, counting from `level`.
local function user_line(level)
  while true do
    local info = debug.getinfo(level, 'Sl')
    if not info then return nil end
    if not is_library(info.source) and info.currentline > 0 then return info.short_src .. ':' .. info.currentline end
    level = level + 1
  end
end

local function annotate(root, phase, caught)
  local e, m = caught[1], caught[2]
  if type(e) ~= 'string' or e:find('interrupted$') then return e end
  local pos, text = e:match('^([^\n]-:%d+): (.*)$')
  if not pos then text = e end
  local where = user_line(4)
  m = m or root
  local path = path_of(root, m)
  local name = m.__name or 'Module'
  local who = (path == nil or path == '') and name or string.format('%s (%s)', path, name)
  text = text:gsub('^' .. name:gsub('%p', '%%%0') .. ': ', '', 1)
  local msg = string.format('%s %s: %s', who, phase, text)
  -- where a line outside dlua raised it (a bug in the user's own module, say), keep that line too
  if pos and where and pos ~= where and (text:find('^attempt to') or text:find('^bad argument')
      or not pos:find('lua/dlua/', 1, true) and not pos:find('bindings/', 1, true) and not pos:find('models/', 1, true)) then
    msg = msg .. ' [raised at ' .. pos .. ']'
  end
  return where and (where .. ': ' .. msg) or msg
end

local function guarded(phase, fn)
  return function(self, ...)
    if depth > 0 then return fn(self, ...) end
    depth = 1
    local r = { xpcall(fn, catch, self, ...) }
    depth = 0
    if not r[1] then error(annotate(self, phase, r[2]), 0) end
    return unpack(r, 2, table.maxn(r))
  end
end

-- Mixed precision (dlua.amp fills in forward and backward): a forward goes through it while
-- autocast is on, a backward when its module's forward did (it runs in the forward's precision).
-- Off, each call costs one test.
local amp = { on = false }
Module._amp = amp
local function autocasted(key, fn)
  if key == 'forward' then
    return function(self, ...)
      if amp.on or rawget(self, '_amp') ~= nil then return amp.forward(fn, self, ...) end
      return fn(self, ...)
    end
  end
  return function(self, ...)
    if rawget(self, '_amp') ~= nil then return amp.backward(fn, self, ...) end
    return fn(self, ...)
  end
end

-- A class's forward and backward are wrapped as they are defined (guarded above).
local function define(cls, key, value)
  if (key == 'forward' or key == 'backward') and type(value) == 'function' then value = guarded(key, autocasted(key, value)) end
  rawset(cls, key, value)
end

-- Declares a module class: `local Linear = Module:extend('Linear')`; instances are made by
-- calling the class (`Linear(4, 2)`), which runs `__init(self, ...)`.
function Module:extend(name)
  local cls = setmetatable({}, { __index = self, __call = function(c, ...) return c.new(c, ...) end, __newindex = define })
  cls.__index = cls
  cls.__name = name
  cls.__tostring, cls.__call = self.__tostring, self.__call
  return cls
end

function Module.new(cls, ...)
  local m = setmetatable({}, cls)
  m.training = true
  m._params = {}   -- ordered {name, field, grad_field}
  m._buffers = {}  -- ordered {name, field}
  m._children = {} -- ordered {name, module}
  if cls.__init then cls.__init(m, ...) end
  return m
end

setmetatable(Module, { __call = function(c, ...) return c.new(c, ...) end })

-- A parameter lives in self[field] and its gradient in self['grad_' .. field].
function Module:register_parameter(name, tensor)
  self[name] = tensor
  self['grad_' .. name] = dlua.zeros_like(tensor)
  self._params[#self._params + 1] = name
  return tensor
end

function Module:register_buffer(name, tensor)
  self[name] = tensor
  self._buffers[#self._buffers + 1] = name
  return tensor
end

function Module:add_module(name, module)
  if getmetatable(module) == nil or module.forward == nil then
    error(string.format('%s: add_module(%q): not a module', self.__name, tostring(name)), 2)
  end
  self._children[#self._children + 1] = { name = tostring(name), module = module }
  if self[name] == nil then self[name] = module end -- model.layer1, model.fc, ...
  return module
end

function Module:children()
  local r = {}
  for i, c in ipairs(self._children) do r[i] = c.module end
  return r
end

-- Visits (prefix, module) for this module and every descendant, depth first, in order.
function Module:walk(fn, prefix)
  prefix = prefix or ''
  fn(prefix, self)
  for _, c in ipairs(self._children) do
    c.module:walk(fn, prefix == '' and c.name or (prefix .. '.' .. c.name))
  end
end

local function join(prefix, name) return prefix == '' and name or (prefix .. '.' .. name) end

-- {{name=, param=, grad=, module=, field=}...} in registration order (PyTorch's names:
-- "layer1.0.conv1.weight").
function Module:named_parameters()
  local r = {}
  self:walk(function(prefix, m)
    for _, f in ipairs(m._params) do
      r[#r + 1] = { name = join(prefix, f), param = m[f], grad = m['grad_' .. f], module = m, field = f }
    end
  end)
  return r
end

-- Two lists, as Torch7: the parameters and their gradients.
function Module:parameters()
  local ps, gs = {}, {}
  for i, e in ipairs(self:named_parameters()) do ps[i], gs[i] = e.param, e.grad end
  return ps, gs
end

function Module:named_buffers()
  local r = {}
  self:walk(function(prefix, m)
    for _, f in ipairs(m._buffers) do r[#r + 1] = { name = join(prefix, f), buffer = m[f], module = m, field = f } end
  end)
  return r
end

function Module:buffers()
  local r = {}
  for i, e in ipairs(self:named_buffers()) do r[i] = e.buffer end
  return r
end

function Module:num_parameters()
  local n = 0
  for _, e in ipairs(self:named_parameters()) do n = n + e.param:numel() end
  return n
end

function Module:train(mode)
  if mode == nil then mode = true end
  self:walk(function(_, m) m.training = mode end)
  return self
end

function Module:evaluate() return self:train(false) end
Module.eval = Module.evaluate

-- Zeroes every parameter gradient: one fill per arena once flattened.
function Module:zero_grad()
  if self._arena then
    for _, a in pairs(self._arena.grads) do a:zero_() end
  else
    for _, e in ipairs(self:named_parameters()) do e.grad:zero_() end
  end
end

-- Moves every parameter and gradient into one contiguous buffer per dtype, laid out in
-- REVERSE registration order (registration follows forward order, so backward fills the
-- gradient buffer front to back: DDP buckets and ZeRO shards are ranges of it). Each
-- module's fields become views; values are kept. Returns the layout:
-- {params = {dtype = tensor}, grads = {dtype = tensor}, entries = {{name, dtype, offset, numel, shape}}}
-- where offset counts the elements before the parameter in its buffer. `opts.grads`, a function
-- (dtype, numel) returning zeroed storage (or nil for the default), places the gradient buffers
-- (DDP: memory the ranks of one host share).
function Module:flatten(opts)
  if self._arena then return self._arena end
  local grads_alloc = opts and opts.grads  -- function(dtype, numel): zeroed gradient storage, or nil
  local named = self:named_parameters()
  local totals, entries = {}, {}
  for i = #named, 1, -1 do
    local e = named[i]
    local dt = e.param.dtype
    local off = totals[dt] or 0
    entries[#entries + 1] = { name = e.name, dtype = dt, offset = off, numel = e.param:numel(), shape = e.param:size(), _e = e }
    totals[dt] = off + e.param:numel()
  end
  local dev = named[1] and named[1].param.device or 'cpu'
  for _, e in ipairs(named) do
    if e.param.device ~= dev then
      error(string.format('%s:flatten: parameters on two devices: %s on %s, %s on %s (move the model with :to first)',
        self.__name, named[1].name, dev, e.name, e.param.device), 2)
    end
  end
  local arena = { params = {}, grads = {}, entries = entries, device = dev }
  local dts = {}
  for dt in pairs(totals) do dts[#dts + 1] = dt end
  table.sort(dts)  -- the same order on every rank: grads_alloc may be a collective
  for _, dt in ipairs(dts) do
    local n = totals[dt]
    arena.params[dt] = dlua.empty(n, { dtype = dt, device = dev })
    arena.grads[dt] = grads_alloc and grads_alloc(dt, n) or dlua.zeros(n, { dtype = dt, device = dev })
  end
  for _, en in ipairs(entries) do
    local e = en._e
    en._e = nil
    local pv = arena.params[en.dtype]:narrow(1, en.offset + 1, en.numel):view(en.shape)
    local gv = arena.grads[en.dtype]:narrow(1, en.offset + 1, en.numel):view(en.shape)
    pv:copy_(e.param)
    gv:copy_(e.grad)
    e.module[e.field] = pv
    e.module['grad_' .. e.field] = gv
    e.param:free()
    e.grad:free()
  end
  self._arena = arena
  return arena
end

-- to(dtype), to(device), to{device = , dtype = }: converts every floating parameter, gradient
-- and buffer (integer buffers such as num_batches_tracked keep their dtype but move). Devices:
-- 'cpu', 'cuda', 'cuda:N'. Call it before flatten() or creating an optimizer: a flat arena is
-- built on the parameters' device on the next flatten().
local FLOAT_NAMES = { float32 = 'float32', float64 = 'float64', float16 = 'float16', bfloat16 = 'bfloat16',
  float = 'float32', double = 'float64', half = 'float16' }

local function to_spec(name, what)
  local dev, dt
  if type(what) == 'table' and getmetatable(what) == nil then
    dev, dt = what.device, what.dtype
  elseif type(what) == 'string' and FLOAT_NAMES[what] then
    dt = what
  else
    dev = what
  end
  if dt ~= nil then
    if not FLOAT_NAMES[dt] then
      error(string.format("%s:to: expected a floating dtype, got %s", name, tostring(dt)), 3)
    end
    dt = FLOAT_NAMES[dt]
  end
  if dev ~= nil then
    if type(dev) ~= 'string' or not (dev == 'cpu' or dev == 'auto' or dev == 'cuda' or dev:match('^cuda:%d+$')) then
      error(string.format("%s:to: expected a floating dtype or a device ('cpu', 'cuda', 'cuda:N', 'auto'), got %s",
        name, tostring(dev)), 3)
    end
    local ok, res = pcall(dlua.cuda.resolve_device, dev)
    if not ok then error(string.format('%s:to(%s): %s', name, dev, (tostring(res):gsub('^.-resolve_device: ', ''))), 3) end
    dev = res
  end
  return dev, dt
end

function Module:to(what)
  local dev, dt = to_spec(self.__name, what)
  local function changes(t)
    return (dev and t.device ~= dev) or (dt and t:is_floating_point() and t.dtype ~= dt)
  end
  local moving = false
  self:walk(function(_, m)
    for _, f in ipairs(m._params) do moving = moving or changes(m[f]) end
    for _, f in ipairs(m._buffers) do moving = moving or changes(m[f]) end
  end)
  if not moving then return self end
  if self._arena then error(self.__name .. ':to: the parameters are already in a flat arena (used by an optimizer); convert before', 2) end
  local function conv(t)
    local spec = {}
    if dev then spec.device = dev end
    if dt and t:is_floating_point() then spec.dtype = dt end
    if next(spec) == nil then return t end
    return t:to(spec)
  end
  self:walk(function(_, m)
    for _, f in ipairs(m._params) do
      m[f] = conv(m[f])
      m['grad_' .. f] = conv(m['grad_' .. f])
    end
    for _, f in ipairs(m._buffers) do m[f] = conv(m[f]) end
  end)
  return self
end

function Module:cuda(device) return self:to(device and ('cuda:' .. device) or 'cuda') end
function Module:cpu() return self:to('cpu') end

-- The device of the parameters ('cpu' for a module without any).
function Module:device()
  local p = self:named_parameters()[1]
  return p and p.param.device or 'cpu'
end

-- The flat layout as a Lua table (flattening first if needed).
function Module:layout()
  local a = self:flatten()
  local r = {}
  for i, en in ipairs(a.entries) do r[i] = { name = en.name, dtype = en.dtype, offset = en.offset, numel = en.numel, shape = en.shape } end
  return r
end

-- name -> tensor (parameters and buffers), as PyTorch's state_dict; tensors are the live
-- ones (clone them to keep a snapshot).
function Module:state_dict()
  local sd, order = {}, {}
  for _, e in ipairs(self:named_parameters()) do sd[e.name] = e.param; order[#order + 1] = e.name end
  for _, e in ipairs(self:named_buffers()) do sd[e.name] = e.buffer; order[#order + 1] = e.name end
  return setmetatable(sd, { __index = { keys = function() return order end } })
end

-- Copies values from `sd` into this module's parameters and buffers. strict (default)
-- reports every missing, unexpected and mis-shaped key in one error.
function Module:load_state_dict(sd, strict)
  if strict == nil then strict = true end
  local targets = {}
  for _, e in ipairs(self:named_parameters()) do targets[e.name] = e.param end
  for _, e in ipairs(self:named_buffers()) do targets[e.name] = e.buffer end
  local missing, unexpected, misshaped = {}, {}, {}
  for name, t in pairs(targets) do
    local v = sd[name]
    if v == nil then
      missing[#missing + 1] = name
    elseif v:numel() ~= t:numel() or #v:size() ~= #t:size() or tostring(v:size()) ~= tostring(t:size()) then
      misshaped[#misshaped + 1] = string.format('%s: expected %s, got %s', name, tostring(t:size()), tostring(v:size()))
    end
  end
  for name in pairs(sd) do
    if targets[name] == nil then unexpected[#unexpected + 1] = name end
  end
  table.sort(missing); table.sort(unexpected); table.sort(misshaped)
  local problems = {}
  if #misshaped > 0 then problems[#problems + 1] = 'mis-shaped keys: ' .. table.concat(misshaped, '; ') end
  if strict and #missing > 0 then problems[#problems + 1] = 'missing keys: ' .. table.concat(missing, ', ') end
  if strict and #unexpected > 0 then problems[#problems + 1] = 'unexpected keys: ' .. table.concat(unexpected, ', ') end
  if #problems > 0 then
    error(string.format('%s.load_state_dict: %s', self.__name, table.concat(problems, '; ')), 2)
  end
  for name, t in pairs(targets) do
    if sd[name] ~= nil then t:copy_(sd[name]) end
  end
  if amp.invalidate then amp.invalidate() end  -- mixed precision's 16-bit copies are stale now
  return { missing = missing, unexpected = unexpected }
end

-- One line per module: "(name): Linear(4 -> 2)  10 params", nested by indentation.
function Module:extra_repr() return '' end

local function count(n)
  if n >= 1e6 then return string.format('%.2fM', n / 1e6) end
  if n >= 1e3 then return string.format('%.1fK', n / 1e3) end
  return tostring(n)
end

function Module:__tostring()
  local lines = {}
  local function visit(m, name, depth)
    local own = 0
    for _, f in ipairs(m._params) do own = own + m[f]:numel() end
    local head = string.rep('  ', depth) .. (name and ('(' .. name .. '): ') or '') .. m.__name
    local extra = m:extra_repr()
    if extra ~= '' then head = head .. '(' .. extra .. ')' end
    local total = m:num_parameters()
    if total > 0 then head = head .. string.format('  [%s params]', count(total)) end
    lines[#lines + 1] = head
    for _, c in ipairs(m._children) do visit(c.module, c.name, depth + 1) end
  end
  visit(self, nil, 0)
  return table.concat(lines, '\n')
end

-- Shared by layers: a clear error naming the module and what was wrong with the input.
function Module:input_error(x, expected, level)
  error(string.format('%s: expected %s, got input of shape %s (%s)', self.__name, expected,
    tostring(x:size()), x.dtype), (level or 2) + 1)
end

-- input_grad(false): the gradient with respect to this module's input is not wanted (PyTorch's
-- default for data, which does not require grad), so backward may skip computing it and
-- return nil. Containers pass it to the children that see their input; Conv2d and Linear
-- then skip their backward-data product. Returns self.
function Module:input_grad(flag)
  self.needs_input_grad = flag ~= false
  return self
end

function Module:forward() error(self.__name .. ': forward is not implemented', 2) end
function Module:backward() error(self.__name .. ': backward is not implemented', 2) end

-- backward(x, grad), where `given` says whether the caller gives grad up: a module whose backward
-- can then write over its incoming gradient (grad_in_place: BatchNorm2d, Sequential, the ResNets
-- and their blocks) is told so by a third argument `true`; otherwise plain backward.
function Module:backward_given(x, grad, given)
  if given and self.grad_in_place then return self:backward(x, grad, true) end
  return self:backward(x, grad)
end
Module.__call = function(m, ...) return m:forward(...) end

return Module
