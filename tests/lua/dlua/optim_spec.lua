-- dlua.optim and nn.utils.clip_grad_norm_ against torch.optim's update rules transcribed in plain Lua, and
-- against PyTorch itself (/usr/bin/python3 with Debian's python3-torch) where it is installed.
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

---------------------------------------------------------------------------------------------
-- Cases checked against PyTorch: a two-layer float64 model whose parameters and per-step
-- gradients are plain Lua data, so the same numbers reach dlua, the Lua transcriptions and torch.

local SHAPES = { { '0.weight', { 4, 3 } }, { '0.bias', { 4 } }, { '1.weight', { 2, 4 } }, { '1.bias', { 2 } } }

local function numel(shape)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  return n
end

-- '1.bias' starts at zero: LAMB's |p| = 0 case (ratio 1).
local function init_values()
  local v = {}
  for k, e in ipairs(SHAPES) do
    v[e[1]] = {}
    for i = 1, numel(e[2]) do v[e[1]][i] = k == 4 and 0 or 0.6 * math.sin(1.7 * k + 0.9 * i) end
  end
  return v
end

local GRAD_SCALE = { 1, 0.1, 3, 0.5 }  -- per parameter: ratios and clipping see different magnitudes
local function grad_values(step)
  local v = {}
  for k, e in ipairs(SHAPES) do
    v[e[1]] = {}
    for i = 1, numel(e[2]) do v[e[1]][i] = GRAD_SCALE[k] * math.cos(0.7 * step + 1.3 * i + k) end
  end
  return v
end

local function copy_values(v)
  local c = {}
  for n, l in pairs(v) do c[n] = { unpack(l) } end
  return c
end

-- The dlua model holding init_values(), flattened; writes/reads its arena by parameter name.
local function case_model()
  local m = nn.Sequential(nn.Linear(3, 4, f64), nn.Linear(4, 2, f64))
  local init = init_values()
  for _, e in ipairs(m:named_parameters()) do e.param:copy_(dlua.tensor(init[e.name], f64):view(e.param:size())) end
  local arena = m:flatten()
  local at = {}
  for _, en in ipairs(arena.entries) do at[en.name] = en end
  local function view(kind, name) return arena[kind].float64:narrow(1, at[name].offset + 1, at[name].numel) end
  local io = {}
  function io.set_grads(v) for n, l in pairs(v) do view('grads', n):copy_(dlua.tensor(l, f64)) end end
  function io.get(kind)
    local r = {}
    for _, e in ipairs(SHAPES) do r[e[1]] = view(kind, e[1]):totable() end
    return r
  end
  return m, io
end

local function close(want, got, tol, what)
  for _, e in ipairs(SHAPES) do
    local w, g = want[e[1]], got[e[1]]
    assert(w and g and #w == #g, what .. ': ' .. e[1] .. ' missing or of another size')
    for i = 1, #w do
      assert(math.abs(g[i] - w[i]) <= tol * (1 + math.abs(w[i])),
        ('%s: %s[%d] = %.17g, want %.17g'):format(what, e[1], i, g[i], w[i]))
    end
  end
end

-- The optimizer cases: a group for the 1-D parameters (no decay, half the learning rate).
local function is_1d(name) return name:match('bias$') ~= nil end
local ADAM_CASES = {
  { name = 'adam_l2_amsgrad', lr = 0.01, betas = { 0.8, 0.95 }, eps = 1e-6, weight_decay = 0.1, amsgrad = true,
    maximize = false },
  { name = 'adam_maximize', lr = 0.02, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.05, amsgrad = false,
    maximize = true },
}
local LAMB_CASES = {
  { name = 'lamb_exclude', lr = 0.05, betas = { 0.9, 0.99 }, eps = 1e-6, weight_decay = 0.1, bias_correction = true,
    exclude = { ['0.bias'] = true } },
  { name = 'lamb_no_bias_correction', lr = 0.02, betas = { 0.8, 0.9 }, eps = 1e-4, weight_decay = 0.01,
    bias_correction = false },
}
local CLIP_CASES = {
  { name = 'clip_l2', max_norm = 0.5, norm_type = 2 },
  { name = 'clip_l1', max_norm = 1.5, norm_type = 1 },
  { name = 'clip_l3', max_norm = 0.7, norm_type = 3 },
  { name = 'clip_inf', max_norm = 0.25, norm_type = 'inf' },
  { name = 'clip_none', max_norm = 1e3, norm_type = 2 },  -- coefficient > 1: untouched
}
local STEPS, HALF = 4, 0.5

local function group_opts(c)
  return { { filter = function(name) return is_1d(name) end, weight_decay = 0, lr_mult = HALF } }
end

local function run_adam(c)
  local m, io = case_model()
  local opt = optim.Adam(m, { lr = c.lr, betas = c.betas, eps = c.eps, weight_decay = c.weight_decay,
    amsgrad = c.amsgrad, maximize = c.maximize, groups = group_opts(c) })
  for step = 1, STEPS do
    io.set_grads(grad_values(step))
    opt:step()
  end
  return io.get('params')
end

local function run_lamb(c)
  local m, io = case_model()
  local opt = optim.LAMB(m, { lr = c.lr, betas = c.betas, eps = c.eps, weight_decay = c.weight_decay,
    bias_correction = c.bias_correction, groups = group_opts(c),
    exclude = c.exclude and function(name) return c.exclude[name] == true end })
  for step = 1, STEPS do
    io.set_grads(grad_values(step))
    opt:step()
  end
  return io.get('params')
end

local function run_clip(c)
  local m, io = case_model()
  io.set_grads(grad_values(1))
  local total = nn.utils.clip_grad_norm_(m, c.max_norm, c.norm_type)
  local r = io.get('grads')
  r.total = { total }
  return r
end

-- torch.optim.Adam's _single_tensor_adam, transcribed (maximize negates before the L2 term).
local function lua_adam(c)
  local p, m, v, vmax = init_values(), {}, {}, {}
  for step = 1, STEPS do
    local g = grad_values(step)
    for _, e in ipairs(SHAPES) do
      local n = e[1]
      local wd, lr = is_1d(n) and 0 or c.weight_decay, is_1d(n) and c.lr * HALF or c.lr
      m[n], v[n], vmax[n] = m[n] or {}, v[n] or {}, vmax[n] or {}
      for i, pi in ipairs(p[n]) do
        local gi = c.maximize and -g[n][i] or g[n][i]
        gi = gi + wd * pi
        m[n][i] = c.betas[1] * (m[n][i] or 0) + (1 - c.betas[1]) * gi
        v[n][i] = c.betas[2] * (v[n][i] or 0) + (1 - c.betas[2]) * gi * gi
        local vv = v[n][i]
        if c.amsgrad then vv = math.max(vmax[n][i] or 0, vv); vmax[n][i] = vv end
        local bc1, bc2 = 1 - c.betas[1] ^ step, 1 - c.betas[2] ^ step
        p[n][i] = pi - lr / bc1 * m[n][i] / (math.sqrt(vv) / math.sqrt(bc2) + c.eps)
      end
    end
  end
  return p
end

-- The LAMB variant dlua.h documents, per parameter tensor.
local function lua_lamb(c)
  local p, m, v = init_values(), {}, {}
  for step = 1, STEPS do
    local g = grad_values(step)
    local bc1 = c.bias_correction and 1 - c.betas[1] ^ step or 1
    local bc2 = c.bias_correction and 1 - c.betas[2] ^ step or 1
    for _, e in ipairs(SHAPES) do
      local n = e[1]
      local ex = c.exclude and c.exclude[n]
      local wd, lr = (is_1d(n) or ex) and 0 or c.weight_decay, is_1d(n) and c.lr * HALF or c.lr
      m[n], v[n] = m[n] or {}, v[n] or {}
      local u, pn, un = {}, 0, 0
      for i, pi in ipairs(p[n]) do
        local gi = g[n][i]
        m[n][i] = c.betas[1] * (m[n][i] or 0) + (1 - c.betas[1]) * gi
        v[n][i] = c.betas[2] * (v[n][i] or 0) + (1 - c.betas[2]) * gi * gi
        u[i] = (m[n][i] / bc1) / (math.sqrt(v[n][i] / bc2) + c.eps) + wd * pi
        pn, un = pn + pi * pi, un + u[i] * u[i]
      end
      pn, un = math.sqrt(pn), math.sqrt(un)
      local trust = (not ex and pn > 0 and un > 0) and pn / un or 1
      for i, pi in ipairs(p[n]) do p[n][i] = pi - lr * trust * u[i] end
    end
  end
  return p
end

-- torch.nn.utils.clip_grad_norm_, transcribed: the norm of the per-parameter norms.
local function lua_clip(c)
  local g = grad_values(1)
  local p = c.norm_type == 'inf' and math.huge or c.norm_type
  local norms = {}
  for k, e in ipairs(SHAPES) do
    local s = 0
    for _, x in ipairs(g[e[1]]) do s = p == math.huge and math.max(s, math.abs(x)) or s + math.abs(x) ^ p end
    norms[k] = p == math.huge and s or s ^ (1 / p)
  end
  local total = 0
  for _, x in ipairs(norms) do total = p == math.huge and math.max(total, x) or total + x ^ p end
  if p ~= math.huge then total = total ^ (1 / p) end
  local coef = math.min(c.max_norm / (total + 1e-6), 1)
  for _, l in pairs(g) do for i = 1, #l do l[i] = l[i] * coef end end
  g.total = { total }
  return g
end

---------------------------------------------------------------------------------------------
-- PyTorch: every case in one python3 run (importing torch takes seconds), read back by name.

local PY = '/usr/bin/python3'
local have_torch = os.execute(PY .. " -c 'import torch' >/dev/null 2>&1") == 0
local NO_TORCH = 'no PyTorch under ' .. PY .. ' (Debian package python3-torch)'
if not have_torch then print('optim_spec: the comparisons against PyTorch are skipped: ' .. NO_TORCH) end

local function py_values(v)
  local parts = {}
  for _, e in ipairs(SHAPES) do
    local l = {}
    for i, x in ipairs(v[e[1]]) do l[i] = ('%.17g'):format(x) end
    parts[#parts + 1] = ("'%s': [%s]"):format(e[1], table.concat(l, ', '))
  end
  return '{' .. table.concat(parts, ', ') .. '}'
end

local function py_bool(b) return b and 'True' or 'False' end

local PY_PRELUDE = [[
import torch
torch.set_default_dtype(torch.float64)
SHAPES = [('0.weight', (4, 3)), ('0.bias', (4,)), ('1.weight', (2, 4)), ('1.bias', (2,))]
def tensors(vals, grad=False):
    return {n: torch.tensor(vals[n], dtype=torch.float64).reshape(s).requires_grad_(grad) for n, s in SHAPES}
def emit(case, key, t):
    print(case, key, ' '.join(repr(float(x)) for x in t.detach().reshape(-1).tolist()))
def split(P, lr, half):
    return [{'params': [P[n] for n, s in SHAPES if len(s) > 1]},
            {'params': [P[n] for n, s in SHAPES if len(s) == 1], 'weight_decay': 0.0, 'lr': lr * half}]
# LAMB (torch 1.13 has none), the variant dlua documents: Adam's moments and bias-corrected direction plus
# wd * p, scaled per tensor by |p| / |u| (1 when either is 0); excluded tensors: no decay, ratio 1.
def lamb(P, grads, lr, b1, b2, eps, wd, bias_correction, excluded, half):
    m = {n: torch.zeros_like(P[n]) for n in P}
    v = {n: torch.zeros_like(P[n]) for n in P}
    for t, G in enumerate(grads, 1):
        for n, s in SHAPES:
            p, g = P[n], torch.tensor(G[n], dtype=torch.float64).reshape(s)
            m[n].mul_(b1).add_(g, alpha=1 - b1)
            v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
            bc1 = 1 - b1 ** t if bias_correction else 1.0
            bc2 = 1 - b2 ** t if bias_correction else 1.0
            ex = n in excluded
            u = (m[n] / bc1) / ((v[n] / bc2).sqrt() + eps)
            d = 0.0 if (ex or len(s) == 1) else wd
            if d != 0:
                u = u.add(p, alpha=d)
            wn, un = p.norm(2).item(), u.norm(2).item()
            trust = wn / un if (not ex and wn > 0 and un > 0) else 1.0
            p.add_(u, alpha=-(lr * half if len(s) == 1 else lr) * trust)
]]

local torch_cache
local function torch_results()
  if torch_cache then return torch_cache end
  local src = { PY_PRELUDE }
  local grads = {}
  for step = 1, STEPS do grads[step] = py_values(grad_values(step)) end
  local py_grads = '[' .. table.concat(grads, ', ') .. ']'
  src[#src + 1] = 'INIT = ' .. py_values(init_values())
  src[#src + 1] = 'GRADS = ' .. py_grads
  for _, c in ipairs(ADAM_CASES) do
    src[#src + 1] = ([[
P = tensors(INIT, True)
opt = torch.optim.Adam(split(P, %.17g, %.17g), lr=%.17g, betas=(%.17g, %.17g), eps=%.17g, weight_decay=%.17g,
                       amsgrad=%s, maximize=%s)
for G in GRADS:
    for n, s in SHAPES:
        P[n].grad = torch.tensor(G[n], dtype=torch.float64).reshape(s)
    opt.step()
for n, s in SHAPES:
    emit('%s', n, P[n])]]):format(c.lr, HALF, c.lr, c.betas[1], c.betas[2], c.eps, c.weight_decay, py_bool(c.amsgrad),
      py_bool(c.maximize), c.name)
  end
  for _, c in ipairs(LAMB_CASES) do
    local ex = {}
    for n in pairs(c.exclude or {}) do ex[#ex + 1] = "'" .. n .. "'" end
    src[#src + 1] = ([[
P = tensors(INIT)
lamb(P, GRADS, %.17g, %.17g, %.17g, %.17g, %.17g, %s, {%s}, %.17g)
for n, s in SHAPES:
    emit('%s', n, P[n])]]):format(c.lr, c.betas[1], c.betas[2], c.eps, c.weight_decay, py_bool(c.bias_correction),
      table.concat(ex, ', '), HALF, c.name)
  end
  for _, c in ipairs(CLIP_CASES) do
    src[#src + 1] = ([[
P = tensors(INIT, True)
for n, s in SHAPES:
    P[n].grad = torch.tensor(GRADS[0][n], dtype=torch.float64).reshape(s)
total = torch.nn.utils.clip_grad_norm_([P[n] for n, s in SHAPES], %.17g, %s)
emit('%s', 'total', total)
for n, s in SHAPES:
    emit('%s', n, P[n].grad)]]):format(c.max_norm, c.norm_type == 'inf' and "float('inf')" or ('%.17g'):format(c.norm_type),
      c.name, c.name)
  end
  local file = os.tmpname()
  local f = assert(io.open(file, 'w'))
  f:write(table.concat(src, '\n'), '\n')
  f:close()
  local p = assert(io.popen(PY .. " '" .. file .. "' 2>&1"))
  local out = p:read('*a')
  p:close()
  os.remove(file)
  local res = {}
  for line in out:gmatch('[^\n]+') do
    local case, key, rest = line:match('^(%S+) (%S+) (.*)$')
    if not case then error('unexpected output from PyTorch: ' .. out, 0) end
    res[case] = res[case] or {}
    local l = {}
    for x in rest:gmatch('%S+') do l[#l + 1] = tonumber(x) or error('unexpected output from PyTorch: ' .. out, 0) end
    res[case][key] = l
  end
  torch_cache = res
  return res
end

local function torch_it(name, fn)
  if have_torch then it(name, fn) else pending(name .. ' (skipped: ' .. NO_TORCH .. ')') end
end

local function clip_close(want, got, what)
  close(want, got, 1e-13, what)
  assert(math.abs(got.total[1] - want.total[1]) <= 1e-13 * want.total[1],
    ('%s: total norm %.17g, want %.17g'):format(what, got.total[1], want.total[1]))
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

  it('LARS takes each group\'s lr_mult, weight_decay and trust_coefficient', function()
    local m = setup()
    local opt = optim.LARS(m, { lr = 0.5, momentum = 0, weight_decay = 0.01, trust_coefficient = 0.02,
      exclude = function() return false end,
      groups = { { filter = function(name) return name == 'bias' end, lr_mult = 0.25, weight_decay = 0.3,
        trust_coefficient = 0.5 } } })
    set_grads(m, 1)
    local function step_ref(w, gw, lr, wd, tc)
      local nw, ng = 0, 0
      for i = 1, #w do nw, ng = nw + w[i] ^ 2, ng + gw[i] ^ 2 end
      nw, ng = math.sqrt(nw), math.sqrt(ng)
      local trust = tc * nw / (ng + wd * nw + 1e-8)
      local out = {}
      for i = 1, #w do out[i] = w[i] - lr * trust * (gw[i] + wd * w[i]) end
      return out
    end
    local rw = step_ref(values(m.weight), values(m.grad_weight), 0.5, 0.01, 0.02)
    local rb = step_ref(values(m.bias), values(m.grad_bias), 0.5 * 0.25, 0.3, 0.5)
    opt:step()
    local w2, b2 = values(m.weight), values(m.bias)
    for i = 1, #rw do assert.near(rw[i], w2[i], 1e-12) end
    for i = 1, #rb do assert.near(rb[i], b2[i], 1e-12) end
  end)

  it('refuses what is not a module, and nesterov without momentum', function()
    assert.has_error(function() optim.SGD({}, { lr = 1 }) end, 'SGD: expected a dlua.nn module as the first argument')
    assert.has_error(function() optim.SGD(setup(), { lr = 1, nesterov = true }) end,
      'SGD: nesterov needs momentum > 0 and dampening 0')
  end)

  it('Adam matches its torch.optim.Adam transcription: L2 decay in the gradient, amsgrad, maximize, groups', function()
    for _, c in ipairs(ADAM_CASES) do close(lua_adam(c), run_adam(c), 1e-12, c.name) end
  end)

  torch_it('Adam matches torch.optim.Adam (float64, 4 steps, weight decay, a group at half lr)', function()
    local t = torch_results()
    for _, c in ipairs(ADAM_CASES) do close(t[c.name], run_adam(c), 1e-12, c.name .. ' vs torch') end
  end)

  it('Adam and AdamW differ exactly by where the decay goes', function()
    local ma, ioa = case_model()
    local mw, iow = case_model()
    local a = optim.Adam(ma, { lr = 0.01, weight_decay = 0.1 })
    local w = optim.AdamW(mw, { lr = 0.01, weight_decay = 0.1 })
    ioa.set_grads(grad_values(1))
    iow.set_grads(grad_values(1))
    a:step()
    w:step()
    local pa, pw = ioa.get('params'), iow.get('params')
    local differ = false
    for _, e in ipairs(SHAPES) do
      for i = 1, #pa[e[1]] do differ = differ or math.abs(pa[e[1]][i] - pw[e[1]][i]) > 1e-9 end
    end
    assert.is_true(differ)
    assert.equals(0, optim.Adam(setup()).defaults.weight_decay)  -- torch's defaults
    assert.equals(1e-2, optim.AdamW(setup()).defaults.weight_decay)
  end)

  it('LAMB matches its transcription: per-tensor trust ratio, exclude, no-decay group, bias correction off', function()
    for _, c in ipairs(LAMB_CASES) do close(lua_lamb(c), run_lamb(c), 1e-12, c.name) end
  end)

  torch_it('LAMB matches a PyTorch reference of the documented variant (float64, 4 steps)', function()
    local t = torch_results()
    for _, c in ipairs(LAMB_CASES) do close(t[c.name], run_lamb(c), 1e-12, c.name .. ' vs torch') end
  end)

  it('Adam and LAMB resume from a state dict as if never stopped', function()
    for _, make in ipairs({
      function(m) return optim.Adam(m, { lr = 0.01, weight_decay = 0.1, amsgrad = true }) end,
      function(m) return optim.LAMB(m, { lr = 0.05, weight_decay = 0.1 }) end,
    }) do
      local m1, io1 = case_model()
      local o1 = make(m1)
      for step = 1, 4 do
        io1.set_grads(grad_values(step))
        o1:step()
      end
      local m2, io2 = case_model()
      local o2 = make(m2)
      for step = 1, 2 do
        io2.set_grads(grad_values(step))
        o2:step()
      end
      local sd = o2:state_dict()
      local saved = { steps = sd.steps, lr = sd.lr, buffers = {} }
      for dt, b in pairs(sd.buffers) do
        saved.buffers[dt] = {}
        for k, v in pairs(b) do saved.buffers[dt][k] = v:clone() end
      end
      local params = m2:flatten().params.float64:clone()
      local m3, io3 = case_model()
      m3:flatten().params.float64:copy_(params)
      local o3 = make(m3)
      o3:load_state_dict(saved)
      for step = 3, 4 do
        io3.set_grads(grad_values(step))
        o3:step()
      end
      close(io1.get('params'), io3.get('params'), 0, o1.name .. ' resumed')
      assert.equals(4, o3.steps)
    end
  end)

  it('LAMB refuses an exclude that is not a function', function()
    assert.has_error(function() optim.LAMB(setup(), { exclude = true }) end,
      'LAMB: exclude must be a function(name, param) returning true for parameters to leave unadapted')
  end)

  it('clip_grad_norm_ returns the total norm and scales as its torch transcription (2, 1, 3, inf, no clip)', function()
    for _, c in ipairs(CLIP_CASES) do clip_close(lua_clip(c), run_clip(c), c.name) end
  end)

  torch_it('clip_grad_norm_ matches torch.nn.utils.clip_grad_norm_ (norm and clipped gradients)', function()
    local t = torch_results()
    for _, c in ipairs(CLIP_CASES) do clip_close(t[c.name], run_clip(c), c.name .. ' vs torch') end
  end)

  it('clip_grad_norm_ pieces: grad_norm_partial over ranges adds up to the whole, ranges scale alone', function()
    local m, io = case_model()
    io.set_grads(grad_values(2))
    local arena = m:flatten()
    local n = arena.grads.float64:numel()
    local whole = nn.utils.grad_norm_partial(m)
    local a = nn.utils.grad_norm_partial(arena, 2, { float64 = { { 0, 7 } } })
    local b = nn.utils.grad_norm_partial(arena, 2, { float64 = { { 7, n - 7 } } })
    assert.near(whole, a + b, 1e-14 * whole)
    local before = arena.grads.float64:clone()
    local total = nn.utils.clip_grad_norm_(arena, 0.1, 2, { ranges = { float64 = { { 0, 7 } } } })
    assert.near(math.sqrt(a), total, 1e-15)
    local coef = 0.1 / (total + 1e-6)
    for i = 1, n do
      local want = i <= 7 and before[i] * coef or before[i]
      assert.near(want, arena.grads.float64[i], 1e-16)
    end
    assert.near(math.max(nn.utils.grad_norm_partial(arena, 'inf', { float64 = { { 0, 7 } } }),
      nn.utils.grad_norm_partial(arena, math.huge, { float64 = { { 7, n - 7 } } })),
      nn.utils.grad_norm_partial(arena, 'inf'), 0)
  end)

  it('clip_grad_norm_ with a non-finite norm: an error with error_if_nonfinite, else scaled as torch does', function()
    local m, io = case_model()
    local g = grad_values(1)
    g['0.bias'][2] = math.huge
    io.set_grads(g)
    assert.has_error(function() nn.utils.clip_grad_norm_(m, 1, 2, { error_if_nonfinite = true }) end,
      'clip_grad_norm_: the total norm of order 2 of the gradients is non-finite (inf), so it cannot be clipped; '
      .. 'with error_if_nonfinite = false the gradients are scaled by it anyway')
    assert.equals(3 * math.abs(g['1.weight'][1]), 3 * math.abs(io.get('grads')['1.weight'][1]))  -- nothing scaled
    assert.equals(math.huge, nn.utils.clip_grad_norm_(m, 1))
    local after = io.get('grads')
    assert.equals(0, after['1.weight'][1])  -- coefficient 1 / inf = 0, as torch
    assert.is_true(after['0.bias'][2] ~= after['0.bias'][2])  -- inf * 0
  end)

  it('clip_grad_norm_ names what is wrong', function()
    local m = setup()
    assert.has_error(function() nn.utils.clip_grad_norm_(m, 1, 0) end,
      "clip_grad_norm_: norm_type must be a number > 0 or 'inf', got 0")
    assert.has_error(function() nn.utils.clip_grad_norm_(m, 1, 'l2') end,
      "clip_grad_norm_: norm_type must be a number > 0 or 'inf', got l2")
    assert.has_error(function() nn.utils.clip_grad_norm_(m, 1, 2, { error_if_nan = true }) end,
      "clip_grad_norm_: unknown option 'error_if_nan' (error_if_nonfinite, ranges, group)")
    assert.has_error(function() nn.utils.clip_grad_norm_(m, 'one') end, 'clip_grad_norm_: max_norm must be a number, got one')
    assert.has_error(function() nn.utils.clip_grad_norm_({}, 1) end,
      "clip_grad_norm_: expected a dlua.nn module, a DDP model or model:flatten()'s arena, got table")
    assert.has_error(function() nn.utils.grad_norm_partial(m, 2, { float32 = { { 0, 1 } } }) end,
      'grad_norm_partial: ranges name dtype float32, which the gradient arena does not hold')
    local ok, err = pcall(nn.utils.grad_norm_partial, m, 2, { float64 = { { 0, 100 } } })
    assert(not ok and tostring(err):find('grad_norm_partial: range offset 0, length 100 is outside the arena of 8 elements',
      1, true), tostring(err))
  end)

  -- Several ranks through the real launcher: DDP with a hook that reduces only when waited on (a
  -- clip that read the gradients first would see this rank's own), and a ZeRO-style split of the
  -- arena whose pieces are all-reduced.
  it('clip_grad_norm_ under DDP sees the averaged gradients, and shard pieces combine over ranks', function()
    local script = os.tmpname()
    local f = assert(io.open(script, 'w'))
    f:write([[
local dlua = require 'dlua'
local nn, dist = dlua.nn, dlua.dist
local f64 = { dtype = 'float64' }
dist.init()
local rank, world = dist.rank(), dist.world_size()
dlua.manual_seed(5)
local net = nn.Sequential(nn.Linear(3, 4, f64), nn.ReLU(), nn.Linear(4, 2, f64))
local model = dist.DDP(net, { bucket_mb = 1e-5, first_bucket_mb = 1e-5 })
model:register_comm_hook(nil, function(_, b)
  return { wait = function()
    dist.all_reduce(b.tensor, 'sum')
    b.tensor:div_(world)
  end }
end)
local x = dlua.randn(5, 3, f64):add(3 * rank)  -- each rank its own data
local out = model:forward(x)
model:backward(x, out:clone():fill_(1))
local total = nn.utils.clip_grad_norm_(model, 1e9)
model:wait()
local g = model:flatten().grads.float64
local sq = 0
for i = 1, g:numel() do sq = sq + g[i] ^ 2 end
assert(math.abs(total - math.sqrt(sq)) <= 1e-12 * total, ('rank %d: norm %.17g, averaged gradients %.17g'):format(rank, total, math.sqrt(sq)))
-- ZeRO-style shards: rank r owns [r n / world, (r + 1) n / world); the pieces are all-reduced.
local n = g:numel()
local lo, hi = math.floor(rank * n / world), math.floor((rank + 1) * n / world)
local before = g:clone()
local sharded = nn.utils.clip_grad_norm_(model, 0.1, 2, { ranges = { float64 = { { lo, hi - lo } } }, group = true })
assert(math.abs(sharded - total) <= 1e-12 * total, ('rank %d: sharded norm %.17g, whole %.17g'):format(rank, sharded, total))
local coef = 0.1 / (total + 1e-6)
for i = 1, n do
  local want = (i > lo and i <= hi) and before[i] * coef or before[i]
  assert(math.abs(g[i] - want) <= 1e-15, ('rank %d: element %d %.17g, want %.17g'):format(rank, i, g[i], want))
end
-- every rank scaled its own shard only: the gradients the shards hold are before * coef everywhere
local inf = nn.utils.clip_grad_norm_(model, 1e9, 'inf', { ranges = { float64 = { { lo, hi - lo } } }, group = true })
local m = 0
for i = 1, n do m = math.max(m, math.abs(before[i] * coef)) end
assert(inf == m, ('rank %d: sharded inf norm %.17g, want %.17g'):format(rank, inf, m))
print(('rank %d ok'):format(rank))
dist.destroy()
]])
    f:close()
    local p = io.popen("CUDA_VISIBLE_DEVICES= timeout 120 '" .. arg[-1] .. "' --nproc 2 '" .. script .. "' 2>&1; echo rc=$?")
    local out = p:read('*a')
    p:close()
    os.remove(script)
    assert(out:find('rank 0 ok', 1, true) and out:find('rank 1 ok', 1, true) and out:find('rc=0', 1, true), out)
  end)

  it('the recipes take --clip-grad N and clip between backward and the step (1 rank and DDP on 2)', function()
    local exe = arg[-1]
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p '" .. dir .. "'") == 0)
    local function run(cmd)
      local p = io.popen(cmd .. ' 2>&1; echo rc=$?')
      local out = p:read('*a')
      p:close()
      return out
    end
    local root = dlua.root  -- the tree whose recipes/ and tests/ this dlua runs (ctest starts in build/)
    run(("'%s' '%s/tests/data/fake_fashion_mnist.lua' '%s' 256 100"):format(exe, root, dir))
    local env = ("DLUA_FASHION_MNIST_ROOT='%s' CUDA_VISIBLE_DEVICES= timeout 300 '%s' "):format(dir, exe)
    local out = run(env .. root .. '/recipes/fashion_mnist.lua --epochs 1 --batch 64 --model small_cnn --threads 1 '
      .. '--clip-grad 0.05')
    local mean, max, clipped, steps = out:match('clip%-grad 0%.05: gradient norm mean (%S+), max (%S+); clipped (%d+) of (%d+) steps')
    assert(out:find('rc=0', 1, true) and mean, out)
    assert(tonumber(mean) > 0 and tonumber(mean) < math.huge and tonumber(max) >= tonumber(mean), out)
    assert.equals('4', steps)
    assert.equals('4', clipped)  -- a random-label CNN's gradients are far above 0.05
    assert(out:match('epoch 1  train loss (%d+%.%d+)'), out)
    out = run(env .. '--nproc 2 ' .. root .. '/recipes/resnet50_ddp.lua --model resnet18 --limit 64 --batch 8 '
      .. '--eval-limit 16 --image-size 28 --threads 1 --print-every 2 --clip-grad 0.1')
    local loss, norm = out:match('%[0%] epoch 1  step 4/4  loss (%d+%.%d+)  lr %S+  %S+ img/s  grad norm (%S+)')
    assert(out:find('rc=0', 1, true) and loss and tonumber(norm) > 0 and tonumber(norm) < math.huge, out)
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)
