-- Gradient compression hooks (dlua.dist.compress) on N ranks: fp16/bf16 equal a hand-computed 16-bit reduction bit for
-- bit; topk{ratio = 1} and full-rank PowerSGD give plain all-reduce's gradients; top-k residuals hold exactly what was
-- not sent; momentum correction and warm-up follow their recurrences; ranks stay bit-identical; hook state survives a
-- checkpoint resume; ZeRO-1 takes a hook, ZeRO-2/3 refuse one; from_spec; comm_stats.
-- Run: dlua --nproc 2 tests/dist/compress.lua [scratch dir]
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local ckpt = require 'dlua.ckpt'
local dist = dlua.dist
local compress = dist.compress
dist.init{ timeout = 60 }
local rank, world = dist.rank(), dist.world_size()
local dir = arg and arg[1] or os.tmpname() .. '.d'
local checks = 0
local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end
local function check(cond, fmt, ...)
  if not cond then fail(fmt, ...) end
  checks = checks + 1
end
local function say(fmt, ...) if rank == 0 then print(string.format(fmt, ...)) end end

-- conv (4-D weight), linear (2-D), biases (1-D): every kind PowerSGD sorts
local function net()
  dlua.manual_seed(3)
  return nn.Sequential(nn.Conv2d(3, 8, 3, { padding = 1 }), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32), nn.ReLU(),
    nn.Linear(32, 10)):input_grad(false)
end
local B = 4
local function batch(s)
  local g = dlua.Generator(100 + s)
  local x = dlua.randn({ B * world, 3, 6, 6 }, { generator = g })
  local y = dlua.randint(1, 11, { B * world }, { generator = g, dtype = 'int64' })
  return x:narrow(1, rank * B + 1, B):contiguous(), y:narrow(1, rank * B + 1, B):contiguous()
end
local crit = nn.CrossEntropyLoss()
local function backward(m, s)
  local x, y = batch(s)
  local out = m:forward(x)
  crit:forward(out, y)
  m:backward(x, crit:backward(out, y))
end
local function grads(ddp) ddp:wait(); return ddp.arena.grads.float32:clone() end
local function max_abs(t) return t:abs():max():item() end
local function gather(t)
  local all = dist.all_gather(nil, t:contiguous())
  return all
end
local function bits_equal(a, b) return a:view(-1):clone():to('float64'):eq(b:view(-1):clone():to('float64')):all():item() end

-- one backward's local gradient (no communication): what each rank feeds its hook
local function local_grad(s)
  local m = net()
  m:flatten()
  backward(m, s)
  return m._arena.grads.float32:clone()
end

---------------------------------------------------------------------------------------------
-- fp16 / bf16: (g_r / world) cast to 16 bits, summed in f32 and rounded to 16 bits per step (the reducer's rule,
-- host/comm/pg_reduce.c), cast back: computed here by hand from every rank's local gradient.
do
  local gl = local_grad(1)
  local all = gather(gl)
  for _, spec in ipairs({ 'fp16', 'bf16' }) do
    local dt = spec == 'fp16' and 'float16' or 'bfloat16'
    local want = (all[1] * (1 / world)):to(dt)
    for r = 2, world do want = (want:to('float32') + (all[r] * (1 / world)):to(dt):to('float32')):to(dt) end
    want = want:to('float32')
    local ddp = dist.DDP(net(), { hook = compress.from_spec(spec), first_bucket_mb = 0.01 })
    backward(ddp, 1)
    local got = grads(ddp)
    check(bits_equal(got, want), '%s hook: gradients differ from the hand-computed 16-bit reduction by %g', spec,
      max_abs(got - want))
    local st = ddp:comm_stats()
    check(st.ratio == 2 and st.bytes_per_step == got:numel() * 2, '%s comm_stats: ratio %g, %g bytes', spec, st.ratio, st.bytes_per_step)
    -- DDP{grad_dtype = ...} is the same reduction
    local ddp2 = dist.DDP(net(), { grad_dtype = dt, first_bucket_mb = 0.01 })
    backward(ddp2, 1)
    local got2 = grads(ddp2)
    check(bits_equal(got2, want), 'grad_dtype %s: gradients differ from the hand-computed 16-bit reduction by %g', dt,
      max_abs(got2 - want))
    check(ddp2:comm_stats().hook == spec, 'grad_dtype %s: comm_stats names hook %s', dt, tostring(ddp2:comm_stats().hook))
  end
  for _, bad in ipairs({ { { grad_dtype = 'int8' }, "grad_dtype must be 'float32', 'bfloat16' or 'float16', got int8" },
    { { grad_dtype = 'bfloat16', hook = compress.fp16() }, "give grad_dtype or hook, not both" } }) do
    local ok, e = pcall(dist.DDP, net(), bad[1])
    check(not ok and tostring(e):find(bad[2], 1, true), 'DDP%s: expected the error %q, got %s', bad[1].grad_dtype, bad[2],
      ok and 'success' or tostring(e))
  end
  say('fp16/bf16 hooks: bit-identical to the hand-computed 16-bit reduction (%d buckets)', 0 + #dist.DDP(net(), { first_bucket_mb = 0.01 }).buckets)
end

---------------------------------------------------------------------------------------------
-- topk{ratio = 1} and full-rank PowerSGD against the default all-reduce
do
  local plain = dist.DDP(net(), { first_bucket_mb = 0.01 })
  backward(plain, 2)
  local want = grads(plain)
  local scale = max_abs(want)
  local tk = dist.DDP(net(), { hook = compress.topk{ ratio = 1 }, first_bucket_mb = 0.01 })
  backward(tk, 2)
  local got_tk = grads(tk)
  local d_tk = max_abs(got_tk - want)
  -- exact: with every entry sent, the scatter-add in rank order and the division are all-reduce's sum and avg
  check(bits_equal(got_tk, want), 'topk{ratio = 1}: max |difference| %g against plain all-reduce (max |g| %g): not bit for bit',
    d_tk, scale)
  local ps = dist.DDP(net(), { hook = compress.powersgd{ rank = 1000, start_step = 0, min_compression_rate = 0 },
    first_bucket_mb = 0.01 })
  backward(ps, 2)
  local d_ps = max_abs(grads(ps) - want)
  -- float32 rounding of the products P = MQ, Q = M^T P, PQ^T: measured 1.5e-8 at max |g| 0.16 on 2 ranks (9e-9 at 0.10 on
  -- 3), i.e. ~1e-7 of max |g|; the bound is ~10x that
  check(d_ps <= 1e-6 * scale, 'full-rank PowerSGD: max |difference| %g against plain all-reduce (max |g| %g; allowed %g)', d_ps,
    scale, 1e-6 * scale)
  -- the error fed back is each rank's matrix minus the shared approximation (Vogels et al.'s and torch's rule): at full
  -- rank, the local gradient minus the average, so the ranks' residuals sum to zero
  local res = gather(ps.hook_state.residual.float32)
  local sum = res[1]
  for r = 2, world do sum = sum + res[r] end
  -- measured 3.0e-8 at 0.16 on 2 ranks, 2.8e-8 at 0.10 on 3 (up to ~3e-7 of max |g|); the bound is ~10x that
  check(max_abs(sum) <= 3e-6 * scale, 'full-rank PowerSGD: the residuals sum to %g, not 0 (allowed %g)', max_abs(sum), 3e-6 * scale)
  say('topk{ratio = 1} vs all-reduce: max |diff| %.3g (max |g| %.3g; bit for bit); full-rank PowerSGD: %.3g (%.2g of max |g|, '
    .. 'allowed 1e-6), residuals sum to %.3g (%.2g, allowed 3e-6)', d_tk, scale, d_ps, d_ps / scale, max_abs(sum), max_abs(sum) / scale)
end

---------------------------------------------------------------------------------------------
-- PowerSGD leaves 1-D tensors (biases) and small matrices ((n + m) rank min_compression_rate >= n m, torch's rule)
-- out of the compression: their gradients are plain all-reduce's bit for bit; the compressed ones are not. And
-- comm_stats counts what it sends: at rank 4 the model's parameters are, by hand,
--   conv weight 8 x 27:  (8 + 27) 4 2 = 280 >= 216: whole,       216 floats
--   conv bias 8:         1-D: whole,                              8
--   linear1 32 x 288:    (32 + 288) 4 2 = 2560 < 9216: P 32x4 + Q 288x4 = 1280
--   linear1 bias 32:     whole,                                  32
--   linear2 10 x 32:     (10 + 32) 4 2 = 336 >= 320: whole,     320
--   linear2 bias 10:     whole,                                  10
-- 1866 floats = 7464 bytes a step, against 9802 floats = 39208 dense.
do
  local plain = dist.DDP(net(), { first_bucket_mb = 0.01 })
  local ps = dist.DDP(net(), { hook = compress.powersgd{ rank = 4, start_step = 0 }, first_bucket_mb = 0.01 })
  local whole, squeezed, worst_whole = 0, 0, 0
  for s = 1, 2 do
    plain:zero_grad()
    ps:zero_grad()
    backward(plain, 50 + s)
    backward(ps, 50 + s)
    local want, got = grads(plain), grads(ps)
    for _, en in ipairs(ps.arena.entries) do
      local a, b = got:narrow(1, en.offset + 1, en.numel), want:narrow(1, en.offset + 1, en.numel)
      local n = en.shape[1]
      local m = en.numel / n
      local r = math.min(4, n, m)
      if #en.shape < 2 or (n + m) * r * 2 >= n * m then
        worst_whole = math.max(worst_whole, max_abs(a - b))
        check(bits_equal(a, b), 'PowerSGD step %d: %s (%s) is left whole, yet differs from plain all-reduce by %g', s, en.name,
          table.concat(en.shape, 'x'), max_abs(a - b))
        whole = whole + (s == 1 and 1 or 0)
      else
        check(not bits_equal(a, b), 'PowerSGD step %d: %s (%s) is compressed at rank 4, yet equals plain all-reduce', s, en.name,
          table.concat(en.shape, 'x'))
        squeezed = squeezed + (s == 1 and 1 or 0)
      end
    end
  end
  check(whole == 5 and squeezed == 1, 'PowerSGD rank 4: %d parameters whole, %d compressed (expected 5 and 1)', whole, squeezed)
  local st = ps:comm_stats()
  check(st.steps == 2 and st.bytes_per_step == 7464 and st.dense_bytes_per_step == 39208,
    'PowerSGD rank 4 comm_stats: %g bytes a step of %g dense over %d steps (hand count: 7464 of 39208)', st.bytes_per_step,
    st.dense_bytes_per_step, st.steps)
  say('PowerSGD rank 4: %d tensors left whole equal plain all-reduce bit for bit (max |diff| %g), %d compressed; '
    .. 'comm_stats %d bytes a step of %d dense = the hand count', whole, worst_whole, squeezed, st.bytes_per_step, st.dense_bytes_per_step)
end

---------------------------------------------------------------------------------------------
-- top-k residuals: after each step, residual = (old residual + g) with exactly the sent entries zeroed, the sent
-- entries are the k largest |old residual + g|, and the dense gradient is the average of every rank's sparse part.
do
  local h = compress.topk{ ratio = 0.05 }
  local seen = {}
  local wrap = function(state, b)
    local old = h.residual and h.residual.float32 and h.residual.float32:narrow(1, b.offset + 1, b.numel):clone()
      or dlua.zeros({ b.numel })
    seen[b.index] = { g = b.tensor:clone(), old = old, b = b }
    return h.comm_hook(h, b)
  end
  local ddp = dist.DDP(net(), { hook = wrap, hook_state = h, first_bucket_mb = 0.01 })
  for s = 1, 3 do
    ddp:zero_grad()
    backward(ddp, 10 + s)
    ddp:wait()
    for i, v in pairs(seen) do
      local acc = v.old + v.g
      local res = h.residual.float32:narrow(1, v.b.offset + 1, v.b.numel)
      local packed = h._buf[i .. '/packed']
      local k = packed:numel() / 2
      check(k == math.ceil(0.05 * v.b.numel), 'bucket %d: k = %d for %d elements', i, k, v.b.numel)
      local idx = packed:narrow(1, k + 1, k):to('int64') + 1
      local sent = dlua.zeros({ v.b.numel }):scatter_add_(1, idx, dlua.ones({ k })):gt(0)
      -- unsent: residual == acc exactly; sent: residual == 0
      local keep = acc:clone():masked_fill_(sent, 0)
      check(bits_equal(res, keep), 'bucket %d step %d: the residual is not exactly what was not sent (max diff %g)', i, s,
        max_abs(res - keep))
      local sent_abs = acc:index_select(1, idx):abs()
      local unsent_max = acc:clone():masked_fill_(sent, 0):abs():max():item()
      check(sent_abs:min():item() >= unsent_max, 'bucket %d: a sent |value| %g is below an unsent one %g', i,
        sent_abs:min():item(), unsent_max)
      -- what every rank sent, averaged, is the gradient now in the bucket
      local mine = dlua.zeros({ v.b.numel }):scatter_add_(1, idx, acc:index_select(1, idx))
      local sum = gather(mine)
      local want = sum[1]
      for r = 2, world do want = want + sum[r] end
      want = want / world
      -- exact: the kernel and this sum add the ranks' parts in rank order, then divide (measured 0 on 2 and 3 ranks)
      check(bits_equal(v.b.tensor, want), 'bucket %d: the dense gradient is not the average of the sent parts (max diff %g)', i,
        max_abs(v.b.tensor - want))
    end
    seen = {}
  end
  local st = ddp:comm_stats()
  check(st.ratio > 8 and st.ratio < 12, 'topk 5%%: comm_stats ratio %g (expected ~10)', st.ratio)
  say('top-k 5%%: residuals exactly what was not sent over 3 steps; comm_stats ratio %.2f, %.3f ms compressing per step',
    st.ratio, st.compress_s_per_step * 1e3)
end

---------------------------------------------------------------------------------------------
-- momentum correction (DGC): u = m u + g, v += u, then the sent entries of u and v are zeroed; warm-up density
do
  local m = 0.9
  local h = compress.topk{ ratio = 0.1, momentum_correction = m, warmup_steps = 2 }
  local u, v
  local wrap = function(state, b)
    if b.index == 1 then
      local g = b.tensor:clone()
      u = u and u * m + g or g:clone()
      v = v and v + u or u:clone()
    end
    return h.comm_hook(h, b)
  end
  local ddp = dist.DDP(net(), { hook = wrap, hook_state = h, first_bucket_mb = 0.01 })
  local dens = {}
  for s = 1, 4 do
    ddp:zero_grad()
    backward(ddp, 20 + s)
    ddp:wait()
    dens[s] = h:density()
    local b = ddp.buckets[1]
    local res = h.residual.float32:narrow(1, b.offset + 1, b.numel)
    local mom = h.momentum_buffer.float32:narrow(1, b.offset + 1, b.numel)
    local sent = res:eq(0):logical_and(v:ne(0))
    u:masked_fill_(sent, 0)
    v:masked_fill_(sent, 0)
    check(bits_equal(res, v) and bits_equal(mom, u), 'momentum correction, step %d: residual/momentum differ from the '
      .. 'recurrence by %g / %g', s, max_abs(res - v), max_abs(mom - u))
  end
  -- DGC's warm-up starts at 25% density: 0.25, 0.25 (0.1 / 0.25)^(1/2), then the ratio
  check(dens[1] == 0.25 and math.abs(dens[2] - 0.25 * 0.4 ^ 0.5) < 1e-12 and dens[3] == 0.1 and dens[4] == 0.1,
    'warm-up densities %g %g %g %g', dens[1], dens[2], dens[3], dens[4])
  -- from dense (warmup_from = 1): 1, 0.1^(1/2), 0.1; a ratio above warmup_from has no warm-up
  local dense = compress.topk{ ratio = 0.1, warmup_steps = 2, warmup_from = 1 }
  local fd = {}
  for s = 1, 3 do dense.step = s; fd[s] = dense:density() end
  check(fd[1] == 1 and math.abs(fd[2] - 0.1 ^ 0.5) < 1e-12 and fd[3] == 0.1, 'warm-up from dense: densities %g %g %g', fd[1], fd[2], fd[3])
  local wide = compress.topk{ ratio = 0.5, warmup_steps = 4 }
  wide.step = 1
  check(wide:density() == 0.5, 'ratio 0.5 above warmup_from 0.25: first density %g', wide:density())
  local ok, err = pcall(compress.topk, { ratio = 0.1, warmup_steps = 2, warmup_from = 0 })
  check(not ok and tostring(err):find('warmup_from', 1, true), 'warmup_from = 0: expected a refusal, got %s', tostring(err))
  say('momentum correction follows u = m u + g, v += u with masking; warm-up densities %g %.4f %g %g (from dense: %g %.4f %g)',
    dens[1], dens[2], dens[3], dens[4], fd[1], fd[2], fd[3])
end

---------------------------------------------------------------------------------------------
-- ranks stay bit-identical over training (PowerSGD's Q is the same everywhere), and a checkpoint resume continues
-- bit for bit: the hook's residuals, Q factors, generator and step counter are saved (per rank) and restored.
-- warm_start = false draws a fresh Q every step: the resumed run must continue the generator's stream.
-- The state is saved either by an explicit entry comm = ckpt.comm_state(model), or by ckpt.save itself with the DDP
-- model (entry 'model.comm'); a resume loads it from either form, with or without the explicit entry.
-- o: {load = checkpoint, comm = true (give comm = ckpt.comm_state(model)), skip = {...}, after_load = fn(model),
-- wrap = fn(net, hook) -> the model (default DDP), seed = the first step's batch seed - 1 (default 30)}
local function train(make, from, to, o)
  o = o or {}
  local m = net()
  local hook = make and make() or nil
  local model = o.wrap and o.wrap(m, hook) or dist.DDP(m, { hook = hook, first_bucket_mb = 0.01 })
  local opt = optim.SGD(model, { lr = 0.05, momentum = 0.9 })
  local st = { model = model, optimizer = opt, comm = o.comm and ckpt.comm_state(model) or nil }
  if o.load then ckpt.load(o.load, st, { skip = o.skip }) end
  if o.after_load then o.after_load(model) end
  for s = from, to do
    opt:zero_grad()
    backward(model, (o.seed or 30) + s)
    opt:step()
  end
  return model, st
end
local makers = {
  ['powersgd:1'] = function() return compress.powersgd{ rank = 1, start_step = 3 } end,
  ['powersgd:1:cold'] = function() return compress.powersgd{ rank = 1, start_step = 3, warm_start = false } end,
  ['topk:0.02'] = function() return compress.topk{ ratio = 0.02, momentum_correction = 0.5, warmup_steps = 12 } end,
}
local function has_entry(path, name)
  for _, e in ipairs(ckpt.info(path).entries) do if e == name then return true end end
  return false
end
for _, spec in ipairs({ 'powersgd:1', 'powersgd:1:cold', 'topk:0.02' }) do
  local make = makers[spec]
  local full = train(make, 1, 14)
  local p = full.arena.params.float32
  local all = gather(p)
  for r = 2, world do check(bits_equal(all[1], all[r]), '%s: rank %d parameters differ from rank 0 after 14 steps', spec, r - 1) end
  local base = dir .. '/' .. spec:gsub(':', '_')
  local paths = {}
  for _, saved in ipairs({ 'explicit', 'plain' }) do
    local _, st = train(make, 1, 9, { comm = saved == 'explicit' })
    paths[saved] = base .. '_' .. saved
    ckpt.save(paths[saved], st, { step = 9 })
  end
  dist.barrier()  -- rank 0 writes index.json once every rank's files are written
  check(has_entry(paths.plain, 'model.comm') and not has_entry(paths.explicit, 'model.comm') and has_entry(paths.explicit, 'comm'),
    "%s: {model = ddp} saves 'model.comm', {model, comm = ckpt.comm_state(model)} saves 'comm' only", spec)
  for _, saved in ipairs({ 'explicit', 'plain' }) do
    for _, given in ipairs({ true, false }) do
      local resumed = train(make, 10, 14, { load = paths[saved], comm = given })
      check(bits_equal(resumed.arena.params.float32, p), '%s: saved %s, loaded %s: a resumed run differs from the '
        .. 'uninterrupted one by %g', spec, saved, given and 'with comm' or 'as {model, optimizer}', max_abs(resumed.arena.params.float32 - p))
      check(resumed.hook_state.step == 14, '%s: the resumed hook counts step %d', spec, resumed.hook_state.step)
    end
  end
  if spec == 'powersgd:1:cold' then
    -- the generator is what carries it: restarting its draws from the seed (as before it was saved) diverges
    local reseeded = train(make, 10, 14, { load = paths.plain, after_load = function(m) m.hook_state._gen = nil end })
    check(not bits_equal(reseeded.arena.params.float32, p), '%s: resuming with the generator reset to its seed changed nothing',
      spec)
  end
  -- and the check can fail: the same resume without the hook's state (skipped) does not continue bit for bit
  for saved, skip in pairs({ explicit = 'comm', plain = 'model.comm' }) do
    local m2 = train(make, 10, 14, { load = paths[saved], skip = { skip } })
    check(not bits_equal(m2.arena.params.float32, p), '%s: resuming without the hook state (skip %s) changed nothing', spec, skip)
  end
  say('%s: parameters bit-identical on %d ranks after 14 steps; resumed at step 10 from a checkpoint of {model, optimizer} '
    .. 'or {model, optimizer, comm}, loaded either way: bit for bit', spec, world)
end
-- a checkpoint without communication state (a model without a hook, or saved before ckpt.save carried it) still
-- loads into a model with a hook, strict, and the hook starts afresh
do
  local _, st = train(nil, 1, 4)
  ckpt.save(dir .. '/nohook', st, { step = 4 })
  dist.barrier()
  check(not has_entry(dir .. '/nohook', 'model.comm'), 'a DDP model without a hook saved a model.comm entry')
  local ok, err = pcall(train, makers['topk:0.02'], 5, 6, { load = dir .. '/nohook' })
  check(ok, 'loading a checkpoint without comm state into a hooked model: %s', tostring(err))
  say('a checkpoint without communication state loads into a model with a hook (strict)')
end

---------------------------------------------------------------------------------------------
-- ZeRO: stage 1 runs the hook on the whole arena (topk{ratio = 1} equals plain ZeRO-1); stages 2 and 3 refuse
do
  local function zrun(hook)
    local z = dist.ZeRO(net(), { stage = 1, hook = hook })
    local opt = optim.SGD(z, { lr = 0.05, momentum = 0.9 })
    for s = 1, 3 do
      opt:zero_grad()
      backward(z, 40 + s)
      opt:step()
    end
    if hook then  -- top-k at ratio 1 sends a value and an index per element: twice the dense bytes
      local st = z:comm_stats()
      check(st.ratio == 0.5 and st.steps == 3 and z:comm_state_dict().hook_state.step == 3,
        'ZeRO-1 comm_stats: ratio %g over %d steps', st.ratio, st.steps)
    end
    return z:state_dict()
  end
  local a, b = zrun(nil), zrun(compress.topk{ ratio = 1 })
  local worst = 0
  for k, t in pairs(a) do worst = math.max(worst, max_abs(t - b[k])) end
  check(worst == 0, 'ZeRO-1 with topk{ratio = 1}: parameters differ from plain ZeRO-1 by %g (top-k at ratio 1 is exact)', worst)
  for _, stage in ipairs({ 2, 3 }) do
    local ok, err = pcall(dist.ZeRO, net(), { stage = stage, hook = compress.fp16() })
    check(not ok and tostring(err):find('stage ' .. stage .. ' cannot take a communication hook', 1, true),
      'ZeRO-%d with a hook: expected a refusal, got %s', stage, tostring(err))
  end
  say('ZeRO-1 + topk{ratio = 1} = ZeRO-1 (max diff %g); ZeRO-2/3 refuse a hook with a reason', worst)
  -- ZeRO-1's hook state goes with the model into a checkpoint ({model = zero} saves 'model.comm'), as DDP's does
  local function ztrain(from, to, o)
    o = o or {}
    o.wrap, o.seed = function(m, hook) return dist.ZeRO(m, { stage = 1, hook = hook }) end, 60
    return train(function() return compress.topk{ ratio = 0.05 } end, from, to, o)
  end
  local full = ztrain(1, 8):state_dict()
  local _, st = ztrain(1, 5)
  ckpt.save(dir .. '/zero1_topk', st, { step = 5 })
  dist.barrier()
  check(has_entry(dir .. '/zero1_topk', 'model.comm'), "ZeRO-1 with a top-k hook: {model = zero} saved no 'model.comm'")
  local function diff(z)
    local w, sd = 0, z:state_dict()
    for k, t in pairs(full) do w = math.max(w, max_abs(t - sd[k])) end
    return w
  end
  local resumed = diff(ztrain(6, 8, { load = dir .. '/zero1_topk' }))
  check(resumed == 0, 'ZeRO-1 + top-k resumed at step 5 differs from the uninterrupted run by %g', resumed)
  local without = diff(ztrain(6, 8, { load = dir .. '/zero1_topk', skip = { 'model.comm' } }))
  check(without > 0, 'ZeRO-1 + top-k resumed without its residuals (skip model.comm) changed nothing')
  say('ZeRO-1 + top-k: {model = zero} saves the residuals as model.comm; resumed bit for bit (without them: off by %g)',
    without)
end

---------------------------------------------------------------------------------------------
-- from_spec and bad options
do
  check(compress.from_spec('none') == nil, "from_spec('none') is not nil")
  check(compress.from_spec('topk:0.01').ratio == 0.01 and compress.from_spec('powersgd:4').rank == 4, 'from_spec values')
  check(compress.from_spec('topk:0.1:noef').error_feedback == false, 'from_spec :noef')
  local dgc = compress.from_spec('topk:0.001:warmup=50:mc=0.9')
  check(dgc.warmup_steps == 50 and dgc.momentum == 0.9 and dgc.error_feedback and dgc.warmup_from == 0.25, 'from_spec :warmup= :mc=')
  check(compress.from_spec('topk:0.01:warmup=10:from=1').warmup_from == 1, 'from_spec :from=')
  for _, bad in ipairs({ 'topk:2', 'topk:x', 'powersgd:0', 'powersgd:1.5', 'gzip', 'topk:0.1:zz', 'topk:0.1:noef:mc=0.9' }) do
    local ok, err = pcall(compress.from_spec, bad)
    check(not ok and tostring(err):find("'" .. bad .. "'", 1, true), 'from_spec(%s): expected an error naming it, got %s', bad,
      tostring(err))
  end
  local ok, err = pcall(compress.topk, { ratio = 0.1, momentum_correction = 0.9, error_feedback = false })
  check(not ok and tostring(err):find('needs error_feedback'), 'momentum correction without error feedback: %s', tostring(err))
  ok, err = pcall(compress.powersgd, { rnk = 2 })
  check(not ok and tostring(err):find("unknown option 'rnk'"), 'powersgd bad option: %s', tostring(err))
end

print(string.format('compress checks passed (%d)', checks))
dist.destroy()
