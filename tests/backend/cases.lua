-- The backend test table: every op case once (op, dtypes, shapes, layouts, reduction length, tolerance knobs); tests/backend/run.lua runs them in each mode.
-- A case: { op = name, dtypes = {...}, instances = function(dt) -> {inst...}, fn = function(inst, inputs...) -> result(s),
--           ulps = , c = , exact = , modes = {cpu = true, emu = true, cuda = true} (default all), outputs = {names},
--           deterministic = (device: the same bits twice), must_fail = (bad input: both refuse), refused = fn(dt, inst)
--           (inputs both sides refuse by design), rejects = (device: tensors on two devices), eps_of_input = }
-- An instance: { tag = 'text', inputs = {spec...}, K = terms per result element (1), threads = n, ... (fn's own) }
-- A spec: { shape = {...}, dtype = (the case's dtype), gen = 'normal'|'positive'|'int'|'index', lo =, hi =, scale =, view = fn }
-- See docs/testing.md.
local dlua = require 'dlua'
local K = require 'bindings.nn'

local FLOATS = { 'float32', 'float64', 'float16', 'bfloat16' }
local INTS = { 'int32', 'int64', 'uint8', 'bool' }
local ALL = { 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64', 'uint8', 'bool' }

local function str(s)
  local p = {}
  for i = 1, #s do p[i] = tostring(s[i]) end
  return '(' .. table.concat(p, ',') .. ')'
end
local function prod(s)
  local n = 1
  for i = 1, #s do n = n * s[i] end
  return n
end

-- odd sizes: 0-d, 1, primes, empty, a 4-D and a long one
local SHAPES = { {}, { 1 }, { 7 }, { 0 }, { 13, 17 }, { 3, 1, 5 }, { 1031 }, { 2, 3, 5, 7 } }
-- views that are not contiguous, over fresh tensors of `base` size
local VIEWS = {
  { 't', { 17, 13 }, function(t) return t:t() end },
  { 'narrow', { 5, 40 }, function(t) return t:narrow(2, 3, 31) end },
  { 'permute', { 2, 3, 5, 7 }, function(t) return t:permute(4, 2, 1, 3) end },
  { 'expand', { 1, 29 }, function(t) return t:expand(6, 29) end },
}

local function cl(t) return t:contiguous('channels_last') end

-- one instance per shape and per view, one input each (gen for the input)
local function unary_instances(gen)
  return function()
    local r = {}
    for _, s in ipairs(SHAPES) do r[#r + 1] = { tag = str(s), inputs = { { shape = s, gen = gen } } } end
    for _, v in ipairs(VIEWS) do r[#r + 1] = { tag = v[1], inputs = { { shape = v[2], gen = gen, view = v[3] } } } end
    return r
  end
end

local cases = {}
local function add(c) cases[#cases + 1] = c end

---------------------------------------------------------------------------------------------
-- element-wise

for _, op in ipairs({ 'neg', 'abs', 'relu', 'sign', 'square', 'floor', 'ceil', 'round', 'isfinite', 'isnan', 'isinf',
  'logical_not' }) do
  add { op = op, dtypes = FLOATS, instances = unary_instances(), fn = function(_, x) return x[op](x) end }
end
-- transcendental: the backends' libm differ by a few ulps
for _, op in ipairs({ 'sqrt', 'rsqrt', 'log', 'log1p' }) do
  add { op = op, dtypes = FLOATS, ulps = 4, instances = unary_instances('positive'), fn = function(_, x) return x[op](x) end }
end
for _, op in ipairs({ 'exp', 'expm1', 'tanh', 'sigmoid', 'sin', 'cos', 'reciprocal' }) do
  add { op = op, dtypes = FLOATS, ulps = 4, instances = unary_instances(), fn = function(_, x) return x[op](x) end }
end
for _, op in ipairs({ 'abs', 'relu', 'sign', 'square', 'logical_not' }) do
  add { op = op .. ' int', dtypes = INTS, instances = unary_instances(), fn = function(_, x) return x[op](x) end }
end
add { op = 'clamp', dtypes = ALL, instances = unary_instances(), fn = function(_, x) return x:clamp(-3, 7) end }

-- binary, with broadcasting; b positive so that integer fmod/remainder/div have no zero divisor
local BSHAPES = { { {}, {} }, { { 1 }, { 1 } }, { { 0 }, { 0 } }, { { 1031 }, { 1031 } }, { { 13, 17 }, { 17 } },
  { { 13, 1 }, { 1, 17 } }, { { 101 }, {} }, { { 3, 1, 5 }, { 4, 1 } }, { { 2, 3, 5, 7 }, { 3, 1, 7 } } }
local function binary_instances()
  local r = {}
  for _, s in ipairs(BSHAPES) do
    r[#r + 1] = { tag = str(s[1]) .. 'x' .. str(s[2]), inputs = { { shape = s[1] }, { shape = s[2], gen = 'positive' } } }
  end
  r[#r + 1] = { tag = 't x narrow', inputs = { { shape = { 17, 13 }, view = function(t) return t:t() end },
    { shape = { 13, 20 }, gen = 'positive', view = function(t) return t:narrow(2, 2, 17) end } } }
  return r
end
for _, op in ipairs({ 'add', 'sub', 'mul', 'maximum', 'minimum', 'eq', 'ne', 'lt', 'le', 'gt', 'ge', 'logical_and',
  'logical_or', 'logical_xor' }) do
  -- (bool - bool is refused, as in PyTorch: logical_xor)
  add { op = op, dtypes = ALL, instances = binary_instances, fn = function(_, a, b) return a[op](a, b) end,
    refused = op == 'sub' and function(dt) return dt == 'bool' end or nil }
end
for _, op in ipairs({ 'div', 'fmod', 'remainder' }) do
  add { op = op, dtypes = { 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64' }, instances = binary_instances,
    fn = function(_, a, b) return a[op](a, b) end }
end
add { op = 'atan2', dtypes = FLOATS, ulps = 4, instances = binary_instances, fn = function(_, a, b) return a:atan2(b) end }
add { op = 'pow', dtypes = FLOATS, ulps = 8, instances = function()
  return { { tag = '(64,33)', inputs = { { shape = { 64, 33 }, gen = 'positive', scale = 1 }, { shape = { 64, 33 }, scale = 1 } } } }
end, fn = function(_, a, b) return a:pow(b) end }
add { op = 'scalar ops', dtypes = FLOATS, instances = unary_instances(), fn = function(_, x)
  return { x * 2.5, x + 1, x - 0.75, x / 3 }
end, outputs = { 'mul', 'add', 'sub', 'div' } }
add { op = 'where', dtypes = ALL, instances = function()
  return { { tag = '(13,17)', inputs = { { shape = { 13, 17 }, dtype = 'bool' }, { shape = { 13, 17 } }, { shape = { 17 } } } } }
end, fn = function(_, c, a, b) return dlua.where(c, a, b) end }
-- x + v * a * b: two terms (K = 2: they may cancel)
add { op = 'addcmul_ addcdiv_', dtypes = FLOATS, ulps = 4, instances = function()
  return { { tag = '(13,17)', K = 2, inputs = { { shape = { 13, 17 } }, { shape = { 13, 17 } }, { shape = { 17 }, gen = 'positive' } } } }
end, fn = function(_, x, a, b) return { x:clone():addcmul_(a, b, 0.5), x:clone():addcdiv_(a, b, -2) } end }

-- copies and casts are exact
add { op = 'copy', dtypes = ALL, exact = true, instances = unary_instances(), fn = function(_, x)
  local y = x:contiguous():clone()
  return { x:contiguous(), y:fill_(1), x:clone() }
end, outputs = { 'contiguous', 'fill_', 'clone' } }
for _, to in ipairs(ALL) do
  add { op = 'cast to ' .. to, dtypes = ALL, exact = true, modes = { emu = true, cuda = true },
    instances = unary_instances(), fn = function(_, x) return x:to(to) end }
end

---------------------------------------------------------------------------------------------
-- reductions: K = the terms per result element

-- (long rows: a device reduces them in chunks, then the chunks' results)
local RSHAPES = { { 1 }, { 7 }, { 1031 }, { 13, 17 }, { 2, 3, 5, 7 }, { 64, 33 } }
-- long rows, which a device reduces in chunks and then the chunks' results (sum and max/min, some dtypes)
local LONG = { { 100003 }, { 3, 70001 }, { 4099, 3 } }
local LONG_DTYPES = { float32 = true, int64 = true }
local function reduce_instances(with_dims, long)
  return function(dt)
    local r = {}
    local shapes = {}
    for _, s in ipairs(RSHAPES) do shapes[#shapes + 1] = s end
    if long and LONG_DTYPES[dt] then for _, s in ipairs(LONG) do shapes[#shapes + 1] = s end end
    for _, s in ipairs(shapes) do
      r[#r + 1] = { tag = str(s), inputs = { { shape = s } }, K = prod(s) }
      if with_dims then
        for d = 1, #s do r[#r + 1] = { tag = str(s) .. ' dim ' .. d, dim = d, inputs = { { shape = s } }, K = s[d] } end
      end
    end
    r[#r + 1] = { tag = 'permute dims 1,3', dims = { 1, 3 }, K = 2 * 5, inputs = { { shape = { 2, 3, 5, 7 },
      view = function(t) return t:permute(4, 2, 1, 3) end } } }
    return r
  end
end
add { op = 'sum', dtypes = { 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64' }, deterministic = true,
  instances = reduce_instances(true, true),
  fn = function(i, x)
    if i.dims then return x:sum(i.dims) end
    return i.dim and x:sum(i.dim) or x:sum()
  end }
add { op = 'mean', dtypes = FLOATS, instances = reduce_instances(true),
  fn = function(i, x) return i.dim and x:mean(i.dim) or x:mean() end }
add { op = 'max min', dtypes = { 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64', 'uint8' }, exact = true,
  instances = reduce_instances(true, true), fn = function(i, x)
    if not i.dim then return { x:max(), x:min(), x:argmax(), x:argmin() } end
    local v, j = x:max(i.dim)
    local w, k = x:min(i.dim)
    return { v, j, w, k }
  end, outputs = { 'max', 'argmax', 'min', 'argmin' } }
add { op = 'any all', dtypes = ALL, exact = true, instances = reduce_instances(false), fn = function(_, x)
  return { x:any(), x:all() }
end }
add { op = 'norm var std', dtypes = FLOATS, ulps = 4, instances = reduce_instances(false), fn = function(i, x)
  return { x:norm(), x:var(), x:std() }
end, outputs = { 'norm', 'var', 'std' } }
add { op = 'prod', dtypes = FLOATS, ulps = 4, instances = function()
  return { { tag = '(7,5)', inputs = { { shape = { 7, 5 }, scale = 1 } }, K = 5 } }
end, fn = function(_, x) return x:prod(2) end }

---------------------------------------------------------------------------------------------
-- matrix products: K = the inner dimension

local MNK = { { 1, 1, 1 }, { 7, 5, 3 }, { 33, 17, 65 }, { 64, 64, 64 }, { 0, 4, 5 }, { 5, 4, 0 } }
add { op = 'mm', dtypes = FLOATS, instances = function()
  local r = {}
  for _, d in ipairs(MNK) do
    local m, n, k = d[1], d[2], d[3]
    r[#r + 1] = { tag = string.format('%dx%dx%d', m, n, k), K = k, inputs = { { shape = { m, k } }, { shape = { k, n } } } }
    r[#r + 1] = { tag = string.format('%dx%dx%d a^T', m, n, k), K = k,
      inputs = { { shape = { k, m }, view = function(t) return t:t() end }, { shape = { k, n } } } }
    r[#r + 1] = { tag = string.format('%dx%dx%d b^T', m, n, k), K = k,
      inputs = { { shape = { m, k } }, { shape = { n, k }, view = function(t) return t:t() end } } }
  end
  return r
end, fn = function(_, a, b) return dlua.mm(a, b) end }
add { op = 'addmm bmm matmul', dtypes = FLOATS, instances = function()
  return { { tag = '9x7x13', K = 13, inputs = { { shape = { 9, 7 } }, { shape = { 9, 13 } }, { shape = { 13, 7 } },
    { shape = { 3, 9, 13 } }, { shape = { 3, 13, 7 } } } } }
end, fn = function(_, c, a, b, ba, bb)
  return { dlua.addmm(c, a, b, { beta = 0.5, alpha = 2 }), dlua.bmm(ba, bb), dlua.matmul(ba, b), dlua.matmul(a, b:narrow(2, 1, 1):squeeze(2)) }
end, outputs = { 'addmm', 'bmm', 'matmul broadcast', 'matmul vector' } }

---------------------------------------------------------------------------------------------
-- convolution: forward (K = C/g*kh*kw), backward-data (O/g*kh*kw), backward-weights and bias (N*OH*OW)

local function osize(i, k, s, p, d) return math.max(0, math.floor((i + 2 * p - d * (k - 1) - 1) / s) + 1) end
-- label, n, c, h, w, o, k (kh, kw), stride, padding, dilation, groups, bias [, threads]
local GEOMS = {
  { 'basic 3x3', 2, 3, 11, 13, 5, { 3, 3 }, 1, 1, 1, 1, true },
  { 'stride 2', 3, 4, 9, 7, 6, { 3, 3 }, 2, 0, 1, 1, false },
  { 'dilation 2', 2, 5, 12, 10, 4, { 3, 3 }, 1, 2, 2, 1, true },
  { 'groups 2', 2, 6, 8, 9, 4, { 3, 3 }, 1, 1, 1, 2, true },
  { 'depthwise', 2, 8, 10, 10, 8, { 3, 3 }, 1, 1, 1, 8, false },
  { '1x1', 4, 16, 7, 7, 32, { 1, 1 }, 1, 0, 1, 1, false },
  { '1x1 stride 2', 2, 8, 9, 9, 16, { 1, 1 }, 2, 0, 1, 1, true },
  -- oneDNN 2.6's strided 1x1 weight gradient, channels-last, fewer than 16 input channels, 2 threads, odd
  -- batch: 0.2-1.2 relative error before conv.c gathered the pixels itself (oneDNN #6035)
  { '1x1 stride 2 batch 3', 3, 8, 9, 9, 16, { 1, 1 }, 2, 0, 1, 1, true, 2 },
  { '1x1 stride 2 batch 5', 5, 12, 6, 20, 4, { 1, 1 }, 2, 0, 1, 1, false, 2 },
  { '7x7 stride 2', 2, 3, 32, 29, 16, { 7, 7 }, 2, 3, 1, 1, false },
  { '1x5', 2, 3, 8, 11, 4, { 1, 5 }, 1, 0, 1, 1, true },
  { '16ch 3x3', 8, 16, 14, 14, 16, { 3, 3 }, 1, 1, 1, 1, false },
  { '1x1 image', 5, 8, 1, 1, 6, { 1, 1 }, 1, 0, 1, 1, true },
  { 'empty batch', 0, 3, 8, 8, 4, { 3, 3 }, 1, 1, 1, 1, true },
}
local CONV_LAYOUTS = { { 'nchw' }, { 'nhwc', cl }, { 'nhwc/ohwi', cl, cl } }

add { op = 'conv2d', dtypes = FLOATS, c = 4, outputs = { 'forward', 'backward_data', 'backward_weights', 'backward_bias' },
  instances = function()
    local r = {}
    for _, G in ipairs(GEOMS) do
      local n, c, h, w, o, k, s, p, d, g, bias = G[2], G[3], G[4], G[5], G[6], G[7], G[8], G[9], G[10], G[11], G[12]
      local oh, ow = osize(h, k[1], s, p, d), osize(w, k[2], s, p, d)
      for _, L in ipairs(CONV_LAYOUTS) do
        local inputs = { { shape = { n, c, h, w }, view = L[2] }, { shape = { o, c / g, k[1], k[2] }, view = L[3] },
          { shape = { n, o, oh, ow }, view = L[2] }, { shape = { o } } }
        -- K: the longest of the three reductions (forward's, backward-data's, the weight gradient's)
        r[#r + 1] = { tag = G[1] .. ' ' .. L[1], inputs = inputs, conv = { s, s, p, p, d, d, g }, bias = bias, threads = G[13],
          K = math.max(c / g * k[1] * k[2], o / g * k[1] * k[2], n * oh * ow) }
      end
    end
    return r
  end,
  fn = function(i, x, w, gy, b)
    local y = K.conv2d(x, w, i.bias and b or nil, i.conv)
    local gx = K.conv2d_backward_data(gy, w, x, i.conv)
    local gw, gb = dlua.zeros_like(w), i.bias and dlua.zeros_like(b) or nil
    if gw:dim() == 4 and w:is_contiguous('channels_last') and not w:is_contiguous() then gw = gw:contiguous('channels_last') end
    K.conv2d_backward_weights(gw, gb, x, gy, i.conv)
    return { y, gx, gw, gb or dlua.zeros({ 0 }, { dtype = x.dtype, device = x.device }) }
  end }

---------------------------------------------------------------------------------------------
-- batch-norm (train: statistics over K = N*H*W; fused ReLU and residual add) and pooling

local BN_SHAPES = { { 4, 3, 5, 7 }, { 2, 16, 9, 9 }, { 7, 5, 1, 1 }, { 3, 4, 13 } }
add { op = 'batch_norm', dtypes = FLOATS, ulps = 8, c = 4, deterministic = true,
  outputs = { 'out', 'running_mean', 'running_var', 'grad_input', 'grad_skip', 'grad_gamma', 'grad_beta' },
  instances = function()
    local r = {}
    for _, s in ipairs(BN_SHAPES) do
      local C = s[2]
      for _, v in ipairs({ { 'contig' }, { 'channels-last', #s == 4 and cl or nil } }) do
        for _, f in ipairs({ { 'plain', false, false }, { 'relu', true, false }, { 'relu+skip', true, true } }) do
          if v[1] == 'contig' or v[2] then
            r[#r + 1] = { tag = str(s) .. ' ' .. v[1] .. ' ' .. f[1], relu = f[2], skip = f[3], K = prod(s) / C,
              inputs = { { shape = s, view = v[2] }, { shape = { C } }, { shape = { C } }, { shape = s, view = v[2] },
                { shape = s, view = v[2] } } }
          end
        end
      end
    end
    return r
  end,
  fn = function(i, x, gamma, beta, skip, gy)
    local C = x:size(2)
    local rm = dlua.zeros({ C }, { dtype = x.dtype, device = x.device })
    local rv = dlua.ones({ C }, { dtype = x.dtype, device = x.device })
    local sk = i.skip and skip or nil
    local y, mean, invstd = K.batch_norm(x, gamma, beta, sk, rm, rv, true, 0.1, 1e-5, i.relu, true)
    local gg, gb = dlua.zeros_like(gamma), dlua.zeros_like(beta)
    local gi, gs = K.batch_norm_backward(gy, x, i.relu and y or nil, gamma, (i.relu and not i.skip) and beta or nil, mean,
      invstd, gg, gb, true, i.relu, i.skip, nil)
    return { y, rm, rv, gi, gs or gi, gg, gb }
  end }

-- c = {kh, kw, sh, sw, ph, pw, dh, dw, ceil}
local POOLS = {
  { '2x2', { 2, 3, 8, 9 }, { 2, 2, 2, 2, 0, 0, 1, 1, false } },
  { '3x3 s2 p1', { 2, 4, 11, 10 }, { 3, 3, 2, 2, 1, 1, 1, 1, false } },
  { '3x3 s2 ceil', { 1, 3, 9, 8 }, { 3, 3, 2, 2, 0, 0, 1, 1, true } },
}
add { op = 'max_pool2d', dtypes = FLOATS, exact = true, outputs = { 'out', 'grad_input' }, instances = function()
  local r = {}
  for _, P in ipairs(POOLS) do
    for _, v in ipairs({ { 'nchw' }, { 'nhwc', cl } }) do
      r[#r + 1] = { tag = P[1] .. ' ' .. v[1], pool = P[3], gshape = P[2], inputs = { { shape = P[2], view = v[2] } } }
    end
  end
  return r
end, fn = function(i, x)
  local y, idx = K.max_pool2d(x, i.pool, true)
  local g = dlua.ones_like(y)
  return { y, K.max_pool2d_backward(g, idx, x) }
end }
add { op = 'avg_pool2d adaptive', dtypes = FLOATS, ulps = 4, outputs = { 'avg', 'avg grad', 'adaptive', 'adaptive grad' },
  instances = function()
    local r = {}
    for _, v in ipairs({ { 'nchw' }, { 'nhwc', cl } }) do
      r[#r + 1] = { tag = v[1], K = 9, inputs = { { shape = { 2, 5, 11, 10 }, view = v[2] } } }
    end
    return r
  end, fn = function(_, x)
    local c = { 3, 3, 2, 2, 1, 1, false, true, 0 }
    local y = K.avg_pool2d(x, c)
    local a = K.adaptive_avg_pool2d(x, 3, 4)
    return { y, K.avg_pool2d_backward(dlua.ones_like(y), x, c), a, K.adaptive_avg_pool2d_backward(dlua.ones_like(a), x) }
  end }

---------------------------------------------------------------------------------------------
-- softmax, losses

add { op = 'softmax', dtypes = FLOATS, ulps = 8, outputs = { 'softmax', 'log_softmax', 'softmax grad', 'log_softmax grad' },
  instances = function()
    local r = {}
    for _, s in ipairs({ { 5, 10 }, { 3, 1031 }, { 2, 3, 4 } }) do
      for d = 1, #s do r[#r + 1] = { tag = str(s) .. ' dim ' .. d, dim = d - 1, K = s[d], inputs = { { shape = s }, { shape = s } } } end
    end
    return r
  end, fn = function(i, x, g)
    local s, ls = K.softmax(x, i.dim, false), K.softmax(x, i.dim, true)
    return { s, ls, K.softmax_backward(g, s, i.dim, false), K.softmax_backward(g, ls, i.dim, true) }
  end }
add { op = 'cross_entropy', dtypes = FLOATS, ulps = 8, deterministic = true, outputs = { 'loss', 'grad' }, instances = function()
  local r = {}
  for _, red in ipairs({ 'mean', 'sum', 'none' }) do
    for _, ls in ipairs({ 0, 0.1 }) do
      r[#r + 1] = { tag = red .. ' smoothing ' .. ls, reduction = red, smoothing = ls, K = 9 * 10,
        inputs = { { shape = { 9, 10 } }, { shape = { 9 }, dtype = 'int64', gen = 'index', lo = 1, hi = 11 } } }
    end
  end
  return r
end, fn = function(i, logits, labels)
  local loss, lp = K.cross_entropy(logits, labels, nil, i.reduction, i.smoothing)
  local go = i.reduction == 'none' and dlua.ones_like(loss) or dlua.ones({}, { dtype = logits.dtype, device = logits.device })
  return { loss, K.cross_entropy_backward(go, lp, labels, nil, i.reduction, i.smoothing) }
end }
add { op = 'mse_loss', dtypes = FLOATS, deterministic = true, outputs = { 'loss', 'grad' }, instances = function()
  return { { tag = '(13,17)', K = 13 * 17, inputs = { { shape = { 13, 17 } }, { shape = { 13, 17 } } } } }
end, fn = function(_, a, b)
  local l = K.mse_loss(a, b, 'mean')
  return { l, K.mse_loss_backward(dlua.ones({}, { dtype = a.dtype, device = a.device }), a, b, 'mean') }
end }

---------------------------------------------------------------------------------------------
-- indexing and sorting: exact

add { op = 'index_select gather scatter_add', dtypes = { 'float32', 'float64', 'int32', 'int64' }, exact = true, deterministic = true,
  outputs = { 'index_select', 'gather', 'scatter_add_' }, instances = function()
    return { { tag = '(6,7)', inputs = { { shape = { 6, 7 }, gen = 'int' }, { shape = { 9 }, dtype = 'int64', gen = 'index', lo = 1, hi = 7 },
      { shape = { 6, 4 }, dtype = 'int64', gen = 'index', lo = 1, hi = 8 } } } }
  end, fn = function(_, x, idx, gidx)
    local acc = dlua.zeros({ 6, 7 }, { dtype = x.dtype, device = x.device })
    return { x:index_select(1, idx), x:gather(2, gidx), acc:scatter_add_(2, gidx, x:narrow(2, 1, 4)) }
  end }
add { op = 'sort topk', dtypes = { 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64' }, exact = true,
  outputs = { 'sorted', 'indices', 'topk values', 'topk indices' }, instances = function()
    local r = {}
    for _, s in ipairs({ { 1 }, { 13 }, { 5, 17 }, { 1031 } }) do r[#r + 1] = { tag = str(s), inputs = { { shape = s, gen = 'int' } } } end
    return r
  end, fn = function(_, x)
    -- integer-valued inputs have ties: both backends break them by position
    local v, i = x:sort(-1)
    local k = math.min(3, x:size(-1))
    local tv, ti = x:topk(k, -1)
    return { v, i, tv, ti }
  end }
add { op = 'argsort', dtypes = FLOATS, exact = true,
  instances = function(dt)
    return { { tag = '(5,17)', inputs = { { shape = { 5, 17 } } } },
             { tag = 't', inputs = { { shape = { 17, 5 }, view = function(t) return t:t() end } } } }
  end,
  fn = function(inst, x) return { x:argsort(-1), x:argsort(1, true) } end,
  outputs = { 'last dim', 'first dim descending' } }
add { op = 'cat stack one_hot', dtypes = ALL, exact = true, outputs = { 'cat', 'stack' }, instances = function()
  return { { tag = '(3,4)+(2,4)', inputs = { { shape = { 3, 4 } }, { shape = { 2, 4 } }, { shape = { 3, 4 } } } } }
end, fn = function(_, a, b, c) return { dlua.cat({ a, b }, 1), dlua.stack({ a, c }, 2) } end }

---------------------------------------------------------------------------------------------
-- special values: NaN, infinities, signed zero, the float16 range

local SPECIALS = { 0 / 0, 1 / 0, -1 / 0, -0.0, 0, 1, -1, 0.5, -2.5, 1e-30, 65504, 3.5 }
local SPECIAL_OPS = { 'neg', 'abs', 'relu', 'sign', 'floor', 'ceil', 'round', 'isfinite', 'isnan', 'isinf', 'sqrt', 'exp',
  'log', 'tanh', 'sigmoid', 'reciprocal' }
add { op = 'specials', dtypes = FLOATS, ulps = 4, outputs = SPECIAL_OPS, instances = function()
  return { { tag = 'nan inf -0', inputs = { { values = SPECIALS } } } }
end, fn = function(_, v)
  local r = {}
  for i, op in ipairs(SPECIAL_OPS) do r[i] = v[op](v) end
  return r
end }
add { op = 'max min nan', dtypes = FLOATS, exact = true, instances = function()
  return { { tag = 'nan', inputs = { { values = SPECIALS } } } }
end, fn = function(_, v)
  return { v:max(), v:min(), v:argmax(), v:sum():isnan() }
end }
add { op = 'masked_fill copy_', dtypes = ALL, exact = true, outputs = { 'masked_fill_', 'copy_ broadcast', 'copy_ overlapping' },
  instances = function()
    return { { tag = '(13,17)', inputs = { { shape = { 13, 17 } }, { shape = { 13, 17 }, dtype = 'bool' }, { shape = { 17 } } } } }
  end, fn = function(_, a, c, b)
    local q = a:clone()
    q:narrow(2, 2, 16):copy_(q:narrow(2, 1, 16))
    return { a:clone():masked_fill_(c, 1), a:clone():copy_(b), q }
  end }

---------------------------------------------------------------------------------------------
-- fused optimizer steps over a range of a flat arena (K = 1: a few flops per element)

local OPTIM_SHAPE = { 1031 }
add { op = 'optimizer steps', dtypes = { 'float32', 'float64' }, ulps = 8,
  outputs = { 'sgd param', 'sgd momentum', 'nesterov param', 'adamw param', 'adamw m', 'adamw v', 'adam amsgrad param',
    'unscale', 'grad_scale' },
  instances = function()
    -- K = 4: each result sums about four terms (the parameter, the step, momentum or decay), which may cancel
    return { { tag = '(1031) from 3', K = 4, inputs = { { shape = OPTIM_SHAPE }, { shape = OPTIM_SHAPE }, { shape = OPTIM_SHAPE },
      { shape = OPTIM_SHAPE, gen = 'positive' } } } }
  end, fn = function(_, p0, g, m0, v0)
    local n = p0:numel() - 3
    local p, buf = p0:clone(), m0:clone()
    K.sgd_step(p, g, buf, 3, n, 0.1, 0.9, 0, 1e-4, false, false, false, 1)
    local pn, bn = p0:clone(), m0:clone()
    K.sgd_step(pn, g, bn, 3, n, 0.1, 0.9, 0, 0, true, false, true, 1)
    local pa, m, v = p0:clone(), m0:clone(), v0:clone()
    K.adamw_step(pa, g, m, v, nil, 3, n, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 3, false, false, 1)
    local pm, mm, vm, vmax = p0:clone(), m0:clone(), v0:clone(), v0:clone()
    K.adam_step(pm, g, mm, vm, vmax, 3, n, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 2, true, true, 1)
    local u = g:clone()
    K.unscale(u, 3, n, 0.125)
    local gs = g:clone()
    K.grad_scale(gs, 3, n, 0.3)
    return { p, buf, pn, pa, m, v, pm, u, gs }
  end }
add { op = 'grad_norm_partial', dtypes = { 'float32', 'float64' }, ulps = 4, instances = function()
  return { { tag = '(1031)', K = 1031, inputs = { { shape = { 1031 } } } } }
end, fn = function(_, g)
  local r = {}
  for i, p in ipairs({ 1, 2, 3, math.huge }) do r[i] = dlua.tensor({ K.grad_norm_partial(g, 5, 1000, p) }, { dtype = 'float64', device = g.device }) end
  return r
end, outputs = { 'p=1', 'p=2', 'p=3', 'inf' } }

---------------------------------------------------------------------------------------------
-- more batch-norm: evaluation mode (running statistics), SyncBatchNorm's halves (float64 sums)

add { op = 'batch_norm eval', dtypes = FLOATS, ulps = 8, instances = function()
  -- K = 2: gamma * (x - mean) * invstd + beta, two terms that may cancel
  return { { tag = '(4,3,5,7) relu', K = 2, inputs = { { shape = { 4, 3, 5, 7 } }, { shape = { 3 } }, { shape = { 3 } }, { shape = { 3 } },
    { shape = { 3 }, gen = 'positive' } } } }
end, fn = function(_, x, gamma, beta, rm, rv)
  return (K.batch_norm(x, gamma, beta, nil, rm, rv, false, 0.1, 1e-5, true, false))
end }
-- (the sums are float64 of terms computed in the input's dtype: the input's eps)
add { op = 'sync batch_norm', dtypes = FLOATS, ulps = 8, c = 4, eps_of_input = true,
  outputs = { 'stats', 'out', 'backward sums', 'grad_input' }, instances = function()
    return { { tag = '(4,3,5,7) relu', K = 4 * 5 * 7, inputs = { { shape = { 4, 3, 5, 7 } }, { shape = { 3 } }, { shape = { 3 } },
      { shape = { 4, 3, 5, 7 } } } } }
  end, fn = function(_, x, gamma, beta, gy)
    local st = K.batch_norm_stats(x)
    local rm = dlua.zeros({ 3 }, { dtype = x.dtype, device = x.device })
    local rv = dlua.ones({ 3 }, { dtype = x.dtype, device = x.device })
    local y, mean, invstd = K.batch_norm_apply(x, gamma, beta, nil, st, rm, rv, 0.1, 1e-5, true)
    local gg, gb = dlua.zeros_like(gamma), dlua.zeros_like(beta)
    local sums = K.batch_norm_backward_reduce(gy, x, y, gamma, beta, mean, invstd, gg, gb, true)
    local gi = K.batch_norm_backward_apply(gy, x, y, gamma, beta, mean, invstd, sums, true, false)
    return { st, y, sums, gi }
  end }

---------------------------------------------------------------------------------------------
-- cross-entropy with class weights and ignore_index; one_hot, count_nonfinite

add { op = 'cross_entropy weighted', dtypes = FLOATS, ulps = 8, outputs = { 'loss', 'grad' }, instances = function()
  return { { tag = 'mean ignore 3', K = 9 * 10, inputs = { { shape = { 9, 10 } },
    { shape = { 9 }, dtype = 'int64', gen = 'index', lo = 1, hi = 11 }, { shape = { 10 }, gen = 'positive' } } } }
end, fn = function(_, logits, labels, w)
  local loss, lp = K.cross_entropy(logits, labels, w, 'mean', 0.1, 3)
  return { loss, K.cross_entropy_backward(dlua.ones({}, { dtype = logits.dtype, device = logits.device }), lp, labels, w,
    'mean', 0.1, 3) }
end }

---------------------------------------------------------------------------------------------
-- random streams: the same generator state gives the same bits on every backend (device modes)

add { op = 'random', dtypes = { 'float32', 'float64', 'float16', 'bfloat16' }, exact = true, modes = { emu = true, cuda = true },
  outputs = { 'uniform_', 'normal_', 'bernoulli_', 'dropout out', 'dropout mask', 'randint', 'randperm' },
  instances = function()
    return { { tag = '(37,29)', inputs = { { shape = { 37, 29 } } } } }
  end, fn = function(_, x)
    local o = { dtype = x.dtype, device = x.device }
    local g = dlua.Generator(77)
    local out, mask = K.dropout(x, 0.3, true, g)
    return { dlua.empty({ 37, 29 }, o):uniform_(-2.5, 7, { generator = g }), dlua.empty({ 37, 29 }, o):normal_(3, 0.25, { generator = g }),
      dlua.empty({ 37, 29 }, o):bernoulli_(0.3, { generator = g }), out, mask,
      dlua.randint(-3, 1000, { 37, 29 }, { device = x.device, generator = g }), dlua.randperm(1031, { device = x.device, generator = g }) }
  end }

---------------------------------------------------------------------------------------------
-- bad input: ops given tensors on two devices must refuse, naming both (device modes; fn gets the CPU
-- inputs, then the device ones)

add { op = 'mixed devices', dtypes = { 'float32' }, rejects = true, modes = { emu = true, cuda = true }, instances = function()
  local r = {}
  for _, name in ipairs({ 'add', 'mm', 'conv2d', 'conv2d_backward_weights', 'batch_norm', 'cross_entropy', 'index_select' }) do
    r[#r + 1] = { tag = name, which = name, inputs = { { shape = { 2, 3, 8, 8 } }, { shape = { 4, 3, 3, 3 } }, { shape = { 3 } },
      { shape = { 2 }, dtype = 'int64', gen = 'index', lo = 1, hi = 3 } } }
  end
  return r
end, fn = function(i, c, d)
  local w = i.which
  if w == 'add' then return c[1] + d[1] end
  if w == 'mm' then return dlua.mm(c[1]:view(6, 64), d[1]:view(64, 6)) end
  if w == 'conv2d' then return K.conv2d(c[1], d[2], nil, { 1, 1, 0, 0, 1, 1, 1 }) end
  if w == 'conv2d_backward_weights' then return K.conv2d_backward_weights(d[2]:clone(), nil, c[1], d[1]:narrow(3, 1, 6):narrow(4, 1, 6):contiguous(), { 1, 1, 0, 0, 1, 1, 1 }) end
  if w == 'batch_norm' then return K.batch_norm(d[1], c[3], d[3], nil, nil, nil, true, 0.1, 1e-5, false, false) end
  if w == 'cross_entropy' then return K.cross_entropy(d[1]:view(2, 192):narrow(2, 1, 3), c[4], nil, 'mean', 0, -100) end
  return d[1]:index_select(1, c[4])
end }

---------------------------------------------------------------------------------------------
-- per-dimension norms, variance, products; count_nonfinite; one_hot

add { op = 'norm var prod dims', dtypes = FLOATS, ulps = 4, c = 4,
  outputs = { 'norm 1', 'norm 2', 'norm inf', 'var', 'var correction 0', 'std', 'prod' }, instances = function()
    local r = {}
    for _, s in ipairs({ { 13, 17 }, { 2, 3, 5, 7 } }) do
      for d = 1, #s do r[#r + 1] = { tag = str(s) .. ' dim ' .. d, dim = d, K = s[d], inputs = { { shape = s, scale = 0.3 } } } end
    end
    return r
  end, fn = function(i, x)
    local near1 = x * 0.1 + 1 -- products stay finite
    return { x:norm(1, i.dim), x:norm(2, i.dim), x:norm(math.huge, i.dim), x:var(i.dim), x:var(i.dim, { correction = 0 }),
      x:std(i.dim), near1:prod(i.dim) }
  end }
add { op = 'count_nonfinite', dtypes = FLOATS, exact = true, instances = function()
  return { { tag = 'specials (12)', inputs = { { values = SPECIALS } } } }
end, fn = function(_, v) return { v:count_nonfinite(), v:view(3, 4):count_nonfinite(2) } end }
add { op = 'one_hot', dtypes = { 'int64', 'int32' }, exact = true, outputs = { 'one_hot', 'inferred', 'strided' }, instances = function()
  return { { tag = '(5,3)', inputs = { { shape = { 5, 3 }, gen = 'index', lo = 1, hi = 8 } } } }
end, fn = function(_, l) return { dlua.one_hot(l, 7), dlua.one_hot(l), dlua.one_hot(l:t(), 9) } end }

---------------------------------------------------------------------------------------------
-- LARS and LAMB over several parameters of one arena: one excluded, one with a zero gradient, one empty

local LRANGES = { { 0, 37, false }, { 37, 5, true }, { 42, 0, false }, { 42, 1003, false }, { 1045, 64, false } }
add { op = 'lars lamb', dtypes = { 'float32', 'float64' }, ulps = 8, c = 4,
  outputs = { 'lars param', 'lars momentum', 'lamb param', 'lamb m', 'lamb v' }, instances = function()
    local r = {}
    for _, cfg in ipairs({ { first = true, wd = 0, scale = 1, step = 1, bc = true }, { first = false, wd = 5e-4, scale = 0.5, step = 9, bc = true },
      { first = false, wd = 1e-2, scale = 1, step = 3, bc = false } }) do
      -- K: the norms sum a parameter's elements (up to 1003); each element's update is a few terms
      r[#r + 1] = { tag = string.format('first %s wd %g scale %g', tostring(cfg.first), cfg.wd, cfg.scale), cfg = cfg, K = 1003,
        inputs = { { shape = { 1112 } }, { shape = { 1112 }, scale = 0.01 }, { shape = { 1112 }, scale = 0.1 },
          { shape = { 1112 }, gen = 'positive', scale = 1e-4 } } }
    end
    return r
  end, fn = function(i, p0, g0, b0, v0)
    local c = i.cfg
    local g = g0:clone()
    g:narrow(1, 1046, 64):zero_() -- the last parameter: zero gradient
    local p, b = p0:clone(), b0:clone()
    K.lars_step(p, g, b, LRANGES, 0.1, 0.9, c.wd, 0.001, 1e-8, c.first, c.scale)
    local pl, m, v = p0:clone(), b0:clone(), v0:clone()
    K.lamb_step(pl, g, m, v, LRANGES, 0.01, 0.9, 0.999, 1e-6, c.wd, c.step, c.bc, c.scale)
    return { p, b, pl, m, v }
  end }

---------------------------------------------------------------------------------------------
-- convolution beyond the plain layouts: inputs in neither format or misaligned (copied before the
-- kernels see them), and 16-bit activations behind a float32 gradient arena

add { op = 'conv2d odd layouts', dtypes = FLOATS, c = 4, outputs = { 'forward', 'backward_data', 'backward_weights' },
  instances = function()
    local offset = function(t) -- one element past an aligned start
      local s = t:size()
      local flat = dlua.empty(t:numel() + 1, { dtype = t.dtype, device = t.device })
      local v = flat:narrow(1, 2, t:numel()):view(s[1], s[2], s[3], s[4])
      v:copy_(t)
      return v
    end
    local strided = function(t) -- a channel slice
      local s = t:size()
      local wide = dlua.zeros(s[1], s[2] + 3, s[3], s[4], { dtype = t.dtype, device = t.device })
      local v = wide:narrow(2, 2, s[2])
      v:copy_(t)
      return v
    end
    return { { tag = 'offset', conv = { 1, 1, 1, 1, 1, 1, 1 }, K = 3 * 9 * 11 * 13, inputs = { { shape = { 3, 3, 11, 13 }, view = offset },
        { shape = { 5, 3, 3, 3 }, view = offset }, { shape = { 3, 5, 11, 13 }, view = offset } } },
      { tag = 'channel slice', conv = { 1, 1, 1, 1, 1, 1, 2 }, K = 2 * 8 * 9, inputs = { { shape = { 2, 6, 8, 9 }, view = strided },
        { shape = { 4, 3, 3, 3 } }, { shape = { 2, 4, 8, 9 }, view = strided } } } }
  end, fn = function(i, x, w, gy)
    local gw = dlua.zeros_like(w)
    K.conv2d_backward_weights(gw, nil, x, gy, i.conv)
    return { K.conv2d(x, w, nil, i.conv), K.conv2d_backward_data(gy, w, x, i.conv), gw }
  end }
add { op = 'conv2d float32 arena', dtypes = { 'bfloat16', 'float16' }, c = 4, eps_of_input = true,
  outputs = { 'grad_weight', 'grad_bias' }, instances = function()
    return { { tag = '(4,8,9,9) nhwc', K = 4 * 81, inputs = { { shape = { 4, 8, 9, 9 }, view = cl }, { shape = { 4, 12, 9, 9 }, view = cl },
      { shape = { 12, 8, 3, 3 }, dtype = 'float32' }, { shape = { 12 }, dtype = 'float32' } } } }
  end, fn = function(_, x, gy, gw0, gb0)
    local gw, gb = gw0:clone(), gb0:clone()
    K.conv2d_backward_weights(gw, gb, x, gy, { 1, 1, 1, 1, 1, 1, 1 })
    assert(gw.dtype == 'float32' and gb.dtype == 'float32', 'the arena changed dtype')
    return { gw, gb }
  end }

---------------------------------------------------------------------------------------------
-- dropout backward, spatial cross-entropy targets

add { op = 'dropout backward', dtypes = FLOATS, exact = true, modes = { emu = true, cuda = true }, instances = function()
  return { { tag = '(64,33)', inputs = { { shape = { 64, 33 } }, { shape = { 64, 33 } } } } }
end, fn = function(_, x, g)
  local out, mask = K.dropout(x, 0.25, true, dlua.Generator(5))
  return { out, K.dropout_backward(g, mask, 0.25) }
end }
add { op = 'cross_entropy spatial', dtypes = FLOATS, ulps = 8, outputs = { 'loss', 'grad' }, instances = function()
  return { { tag = '(3,5,4,6)', K = 3 * 5 * 4 * 6, inputs = { { shape = { 3, 5, 4, 6 } },
    { shape = { 3, 4, 6 }, dtype = 'int64', gen = 'index', lo = 1, hi = 6 } } } }
end, fn = function(_, logits, labels)
  local loss, lp = K.cross_entropy(logits, labels, nil, 'mean', 0)
  return { loss, K.cross_entropy_backward(dlua.ones({}, { dtype = logits.dtype, device = logits.device }), lp, labels, nil, 'mean', 0) }
end }

---------------------------------------------------------------------------------------------
-- bad input both backends refuse (the CPU's message is listed in the report)

local function idx(v) return { values = v, dtype = 'int64' } end
local BAD = {
  { 'index_select out of range', { { shape = { 5, 4 } }, idx({ 1, 2, 6, 0 }) }, function(x, i) return x:index_select(1, i) end },
  { 'index_select zero', { { shape = { 5, 4 } }, idx({ 0 }) }, function(x, i) return x:index_select(2, i) end },
  { 'index_select negative', { { shape = { 5, 4 } }, idx({ 2, -7 }) }, function(x, i) return x:index_select(2, i) end },
  { 'gather out of range', { { shape = { 5, 4 } }, idx({ 1, 2, 5, 9, 1 }) }, function(x, i) return x:gather(2, i:view(5, 1)) end },
  { 'scatter_add_ out of range', { { shape = { 5, 4 } }, idx({ 3, 6, 9, 12 }) },
    function(x, i) return x:clone():scatter_add_(1, i:view(1, 4), x:narrow(1, 1, 1)) end },
  { 'one_hot out of range', { { shape = { 1 } }, idx({ 1, 2, 4, 0 }) }, function(_, l) return dlua.one_hot(l, 3) end },
  { 'cat shapes', { { shape = { 5, 4 } }, { shape = { 5, 3 } } }, function(a, b) return dlua.cat({ a, b }, 1) end },
  { 'topk k too large', { { shape = { 5, 4 } } }, function(x) return x:topk(6, 1) end },
  { 'conv channels mismatch', { { shape = { 2, 4, 8, 8 } }, { shape = { 5, 3, 3, 3 } } },
    function(x, w) return K.conv2d(x, w, nil, { 1, 1, 0, 0, 1, 1, 1 }) end },
  { 'conv kernel larger than the padded input', { { shape = { 2, 3, 4, 4 } }, { shape = { 5, 3, 7, 7 } } },
    function(x, w) return K.conv2d(x, w, nil, { 1, 1, 1, 1, 1, 1, 1 }) end },
  { 'conv groups not dividing', { { shape = { 2, 6, 8, 8 } }, { shape = { 5, 2, 3, 3 } } },
    function(x, w) return K.conv2d(x, w, nil, { 1, 1, 0, 0, 1, 1, 3 }) end },
  { 'conv zero stride', { { shape = { 2, 3, 8, 8 } }, { shape = { 5, 3, 3, 3 } } },
    function(x, w) return K.conv2d(x, w, nil, { 0, 1, 0, 0, 1, 1, 1 }) end },
}
add { op = 'bad input', dtypes = { 'float32' }, must_fail = true, instances = function()
  local r = {}
  for _, b in ipairs(BAD) do r[#r + 1] = { tag = b[1], inputs = b[2], call = b[3] } end
  return r
end, fn = function(i, ...) return i.call(...) end }

---------------------------------------------------------------------------------------------
-- odds and ends the old per-family scripts checked: integer inputs to float functions, copies across
-- devices, ReLU's backward, scatter_add_ at sizes that take the sorted path, random fills of views and wide
-- integer ranges

add { op = 'int to float', dtypes = { 'int32', 'int64', 'uint8' }, ulps = 4, instances = unary_instances('positive'),
  fn = function(_, x) return { x:sqrt(), x:exp() } end, outputs = { 'sqrt', 'exp' } }
add { op = 'copy_ from cpu', dtypes = ALL, exact = true, instances = function()
  return { { tag = '(13,17)', inputs = { { shape = { 13, 17 } }, { shape = { 17 } } } } }
end, fn = function(_, a, b)
  local u = a:clone():copy_(b:cpu())
  return { u, a:t():to('cpu'):contiguous():to(a.device) }
end, outputs = { 'broadcast from cpu', 'strided round trip' } }
add { op = 'relu_backward', dtypes = FLOATS, exact = true, instances = function()
  return { { tag = '(64,33)', inputs = { { shape = { 64, 33 } }, { shape = { 64, 33 } } } } }
end, fn = function(_, x, g) return K.relu_backward(g, K.relu(x)) end }
add { op = 'scatter_add_ large', dtypes = { 'float32' }, deterministic = true, c = 4, instances = function()
  -- float sums in another order: K = the elements per bin
  return { { tag = '1000003 into 37', K = 1000003 / 37, dim = 1, acc = { 37 }, inputs = { { shape = { 1000003 } },
      { shape = { 1000003 }, dtype = 'int64', gen = 'index', lo = 1, hi = 38 } } },
    { tag = '(20000,200) into (20000,3)', K = 200 / 3, dim = 2, acc = { 20000, 3 }, inputs = { { shape = { 20000, 200 } },
      { shape = { 20000, 200 }, dtype = 'int64', gen = 'index', lo = 1, hi = 4 } } } }
end, fn = function(i, src, idx)
  return dlua.zeros(i.acc, { dtype = src.dtype, device = src.device }):scatter_add_(i.dim, idx, src)
end }
add { op = 'random views and ranges', dtypes = { 'float32' }, exact = true, modes = { emu = true, cuda = true },
  outputs = { 'normal_ transposed', 'uniform_ narrowed', 'bernoulli_ strided bool', 'randint wide', 'randint rejecting', 'random_' },
  instances = function() return { { tag = '', inputs = { { shape = { 1 } } } } } end,
  fn = function(_, x)
    local d = x.device
    local g = dlua.Generator(31)
    local a = dlua.zeros(29, 37, { device = d })
    a:t():normal_(0, 1, { generator = g })
    local b = dlua.zeros(7, 40, { device = d })
    b:narrow(2, 5, 31):uniform_(0, 1, { generator = g })
    local c = dlua.zeros(11, 13, { dtype = 'bool', device = d })
    c:t():bernoulli_(0.6, { generator = g })
    return { a, b, c, dlua.randint(-2 ^ 40, 2 ^ 41 + 12345, { 1031 }, { device = d, generator = g }),
      dlua.randint(0, 3 * 2 ^ 30, { 1031 }, { device = d, generator = g }),
      dlua.empty(1031, { dtype = 'int64', device = d }):random_(5, 17, { generator = g }) }
  end }

---------------------------------------------------------------------------------------------
-- what the old per-family GPU scripts checked beyond the cases above: average pooling's options,
-- SyncBatchNorm's halves with a residual input, more ops refusing two devices, nn modules on the device

-- c = {kh, kw, sh, sw, ph, pw, ceil_mode, count_include_pad, divisor_override}
local AVG_OPTIONS = {
  { 'ceil no-pad-count', { 3, 3, 2, 2, 1, 1, true, false, 0 } },
  { 'divisor 5', { 3, 3, 1, 1, 1, 1, false, true, 5 } },
  { '4x3 s3,2 p2,1 ceil', { 4, 3, 3, 2, 2, 1, true, true, 0 } },
  { '2x2 no-pad-count', { 2, 2, 2, 2, 1, 1, false, false, 0 } },
}
add { op = 'avg_pool2d options', dtypes = FLOATS, ulps = 4, outputs = { 'out', 'grad_input' }, instances = function()
  local r = {}
  for _, P in ipairs(AVG_OPTIONS) do
    for _, v in ipairs({ { 'nchw' }, { 'nhwc', cl } }) do
      r[#r + 1] = { tag = P[1] .. ' ' .. v[1], pool = P[2], K = P[2][1] * P[2][2], inputs = { { shape = { 2, 3, 9, 8 }, view = v[2] } } }
    end
  end
  return r
end, fn = function(i, x)
  local y = K.avg_pool2d(x, i.pool)
  local g = (y * 0.5 + 0.25):contiguous()
  return { y, K.avg_pool2d_backward(g, x, i.pool) }
end }

add { op = 'sync batch_norm skip', dtypes = FLOATS, ulps = 8, c = 4, eps_of_input = true,
  outputs = { 'out', 'running_mean', 'running_var', 'grad_input', 'grad_skip' }, instances = function()
    return { { tag = '(4,3,5,7) relu+skip', K = 4 * 5 * 7, inputs = { { shape = { 4, 3, 5, 7 } }, { shape = { 4, 3, 5, 7 } },
      { shape = { 3 } }, { shape = { 3 } }, { shape = { 4, 3, 5, 7 } } } },
      { tag = '(2,8,5,5) nhwc relu+skip', K = 2 * 5 * 5, inputs = { { shape = { 2, 8, 5, 5 }, view = cl },
        { shape = { 2, 8, 5, 5 }, view = cl }, { shape = { 8 } }, { shape = { 8 } }, { shape = { 2, 8, 5, 5 }, view = cl } } } }
  end, fn = function(_, x, skip, gamma, beta, gy)
    local C = x:size(2)
    local st = K.batch_norm_stats(x)
    local rm = dlua.zeros({ C }, { dtype = x.dtype, device = x.device })
    local rv = dlua.ones({ C }, { dtype = x.dtype, device = x.device })
    local y, mean, invstd = K.batch_norm_apply(x, gamma, beta, skip, st, rm, rv, 0.1, 1e-5, true)
    local sums = K.batch_norm_backward_reduce(gy, x, y, gamma, nil, mean, invstd, nil, nil, true)
    local gi, gs = K.batch_norm_backward_apply(gy, x, y, gamma, nil, mean, invstd, sums, true, true)
    return { y, rm, rv, gi, gs }
  end }

add { op = 'mixed devices more', dtypes = { 'float32' }, rejects = true, modes = { emu = true, cuda = true }, instances = function()
  local r = {}
  for _, name in ipairs({ 'bn gamma', 'bn skip', 'bn backward', 'gather', 'scatter_add_', 'mse_loss', 'softmax_backward',
    'where', 'addcmul_', 'masked_fill_' }) do
    r[#r + 1] = { tag = name, which = name, inputs = { { shape = { 2, 4, 5, 5 } }, { shape = { 4 } },
      { shape = { 2, 4, 5, 5 }, dtype = 'int64', gen = 'index', lo = 1, hi = 3 } } }
  end
  return r
end, fn = function(i, c, d)
  local w = i.which
  if w == 'bn gamma' then return K.batch_norm(d[1], c[2], nil, nil, nil, nil, true, 0.1, 1e-5, false, true) end
  if w == 'bn skip' then return K.batch_norm(d[1], nil, nil, c[1], nil, nil, true, 0.1, 1e-5, false, true) end
  if w == 'bn backward' then
    local _, sm, si = K.batch_norm(d[1], nil, nil, nil, nil, nil, true, 0.1, 1e-5, false, true)
    return K.batch_norm_backward(c[1], d[1], nil, nil, nil, sm, si, nil, nil, true, false, false)
  end
  if w == 'gather' then return d[1]:gather(1, c[3]) end
  if w == 'scatter_add_' then return d[1]:clone():scatter_add_(1, d[3], c[1]) end
  if w == 'mse_loss' then return K.mse_loss(d[1], c[1], 'mean') end
  if w == 'softmax_backward' then return K.softmax_backward(c[1], K.softmax(d[1], 1, false), 1, false) end
  if w == 'where' then return dlua.where(c[1]:gt(0), d[1], d[1]) end
  if w == 'addcmul_' then return d[1]:clone():addcmul_(c[1], d[1], 0.5) end
  return d[1]:clone():masked_fill_(c[1]:gt(0), 1)
end }

-- nn modules moved with Module:to: forward and backward on the device against the same module on the CPU (the
-- runner seeds the generator before each side, so both build the same parameters)
local MODULES = {
  { 'BatchNorm2d relu', function(nn) return nn.BatchNorm2d(8, { relu = true }) end, 81 * 4 },
  { 'MaxPool2d', function(nn) return nn.MaxPool2d(3, { stride = 2, padding = 1 }) end, 1 },
  { 'AvgPool2d ceil', function(nn) return nn.AvgPool2d(3, { stride = 2, padding = 1, ceil_mode = true }) end, 9 },
  { 'AdaptiveAvgPool2d', function(nn) return nn.AdaptiveAvgPool2d(1) end, 81 },
  { 'ReLU', function(nn) return nn.ReLU() end, 1 },
  { 'Conv2d', function(nn) return nn.Conv2d(8, 6, 3, { padding = 1, bias = true }) end, 72 * 4 * 9 },
  { 'BasicBlock', function(nn) return nn.BasicBlock(8, 8) end, 72 * 4 * 81 },
}
add { op = 'nn modules', dtypes = { 'float32' }, ulps = 8, c = 4, modes = { emu = true, cuda = true },
  outputs = { 'output', 'grad_input', 'first parameter', 'its gradient' }, instances = function()
    local r = {}
    for _, m in ipairs(MODULES) do
      r[#r + 1] = { tag = m[1], make = m[2], K = m[3], inputs = { { shape = { 4, 8, 9, 9 }, view = cl } } }
    end
    return r
  end, fn = function(i, x)
    local m = i.make(dlua.nn)
    if x.device ~= 'cpu' then m:to(x.device) end
    m:train()
    local y = m:forward(x)
    local gi = m:backward(x, (y * 0.5 + 0.25):contiguous())
    local ps, gs = m:parameters()
    local p = ps and ps[1] or dlua.zeros({ 1 }, { device = x.device })
    local g = gs and gs[1] or dlua.zeros({ 1 }, { device = x.device })
    return { y, gi, p, g }
  end }

return cases
