-- dlua.ckpt: tensor files (every dtype and layout), the whole training state (bit-exact continuation), rotation, async saves and their memory, cursors, and every corrupt-file case with its message.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local lr = require 'dlua.lr'
local data = require 'dlua.data'
local ckpt = require 'dlua.ckpt'

local function tmpdir()
  local p = os.tmpname()
  os.remove(p)
  return p
end
local function rm(p) os.execute("rm -rf '" .. p .. "'") end
local function slurp(p)
  local f = assert(io.open(p, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end
local function spit(p, s)
  local f = assert(io.open(p, 'wb'))
  f:write(s)
  f:close()
end
local function exists(p)
  local f = io.open(p, 'rb')
  if f then f:close() end
  return f ~= nil
end
local function ls(p)
  local h = io.popen("ls -A '" .. p .. "' 2>/dev/null")
  local r = {}
  for l in h:lines() do r[#r + 1] = l end
  h:close()
  return r
end

-- The CRC32 of a module's parameters and buffers in state-dict order (as the recipes print it).
local function crc(m)
  local sd, list = m:state_dict(), {}
  for _, k in ipairs(sd:keys()) do list[#list + 1] = sd[k] end
  return ckpt.crc32(list)
end

local function err_of(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok, 'expected an error')
  return tostring(e)
end

if not ckpt.available() then
  describe('dlua.ckpt', function()
    it('says checkpoints are off when built without cJSON', function()
      assert.truthy(err_of(ckpt.save_file, '/tmp/x', {}):find('checkpoints are off', 1, true))
    end)
  end)
  return
end

describe('dlua.ckpt files', function()
  local dir
  before_each(function() dir = tmpdir(); os.execute("mkdir -p '" .. dir .. "'") end)
  after_each(function() rm(dir) end)

  it('round-trips every dtype, values and shapes', function()
    local ts = {
      f32 = dlua.randn(3, 4), f64 = dlua.randn(2, 3, { dtype = 'float64' }), f16 = dlua.randn(5, { dtype = 'float16' }),
      bf16 = dlua.randn(2, 2, { dtype = 'bfloat16' }), i32 = dlua.randint(-100, 100, 7, { dtype = 'int32' }),
      i64 = dlua.tensor({ -2 ^ 40, 3, 2 ^ 50 }, { dtype = 'int64' }), u8 = dlua.randint(0, 256, 4, 4, { dtype = 'uint8' }),
      b = dlua.tensor({ true, false, true }), scalar = dlua.tensor(2.5), empty = dlua.zeros(0, 3),
    }
    ckpt.save_file(dir .. '/a.safetensors', ts, { note = 'x' })
    local r, meta = ckpt.load_file(dir .. '/a.safetensors')
    assert.equal('x', meta.note)
    assert.equal('pt', meta.format)
    for k, t in pairs(ts) do
      assert.equal(t.dtype, r[k].dtype, k)
      assert.same(t:size(), r[k]:size(), k)
      assert.same(t:totable(), r[k]:totable(), k)
    end
  end)

  it('writes views and channels-last tensors as their logical row-major values', function()
    local x = dlua.arange(2 * 3 * 4 * 5):view(2, 3, 4, 5):float()
    local ts = { t = x:transpose(2, 4), cl = x:contiguous('channels_last'), n = x:narrow(3, 2, 2), e = dlua.ones(3):view(3, 1):expand(3, 4) }
    assert.is_false(ts.t:is_contiguous())
    ckpt.save_file(dir .. '/v.safetensors', ts)
    local r = ckpt.load_file(dir .. '/v.safetensors')
    for k, t in pairs(ts) do
      assert.is_true(r[k]:is_contiguous())
      assert.same(t:totable(), r[k]:totable(), k)
    end
  end)

  it('rejects bad arguments by name', function()
    assert.truthy(err_of(ckpt.save_file, dir .. '/x', { a = 1 }):find("'a' is a number, not a tensor", 1, true))
    assert.truthy(err_of(ckpt.save_file, dir .. '/x', { a = dlua.ones(1) }, { k = 3 }):find('string %-> string'))
    assert.truthy(err_of(ckpt.load_file, dir .. '/missing.safetensors'):find('missing.safetensors: No such file', 1, true))
  end)

  it('names the file and the tensor for a truncated, corrupt or altered file', function()
    local p = dir .. '/c.safetensors'
    ckpt.save_file(p, { big = dlua.randn(1000, { dtype = 'float64' }), small = dlua.randn(10) })
    local whole = slurp(p)
    local n = whole:byte(1) + 256 * whole:byte(2)
    spit(p, whole:sub(1, 8 + n + 40))
    local e = err_of(ckpt.load_file, p)
    assert.truthy(e:find(p, 1, true) and e:find("tensor 'big'", 1, true) and e:find('truncated', 1, true), e)
    spit(p, whole:sub(1, 6))
    assert.truthy(err_of(ckpt.load_file, p):find('truncated', 1, true))
    spit(p, whole:sub(1, 8) .. '[' .. whole:sub(10))
    assert.truthy(err_of(ckpt.load_file, p):find('corrupt header', 1, true))
    -- one flipped bit in the data of 'small' (it lies after 'big': 8-byte elements come first)
    local at = #whole - 5
    spit(p, whole:sub(1, at - 1) .. string.char((whole:byte(at) + 1) % 256) .. whole:sub(at + 1))
    e = err_of(ckpt.load_file, p)
    assert.truthy(e:find("checksum mismatch for tensor 'small'", 1, true) and e:find(p, 1, true), e)
  end)

  it('reads a file as PyTorch writes it (no checksums)', function()
    local header = '{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    local pad = (8 - #header % 8) % 8
    header = header .. string.rep(' ', pad)
    local le = string.char(#header % 256, math.floor(#header / 256), 0, 0, 0, 0, 0, 0)
    spit(dir .. '/py.safetensors', le .. header .. '\0\0\128\63\0\0\0\64')  -- 1.0, 2.0
    local r = ckpt.load_file(dir .. '/py.safetensors')
    assert.same({ 1, 2 }, r.w:totable())
  end)
end)

---------------------------------------------------------------------------------------------

local function make_run(seed)
  dlua.manual_seed(seed or 3)
  local net = nn.Sequential(nn.Conv2d(1, 4, 3, { padding = 1 }), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))
  local opt = optim.SGD(net, { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 1e-3 })
  local sched = lr.cosine({ lr = 0.05, steps = 20 })
  local crit = nn.CrossEntropyLoss()
  local g = dlua.Generator(99)
  local run = { net = net, opt = opt, sched = sched, g = g, progress = { step = 0 } }
  function run.step()
    local x = dlua.randn(8, 1, 6, 6, { generator = g })
    local y = dlua.randint(1, 4, 8, { generator = g, dtype = 'int64' })
    opt:set_lr(sched(run.progress.step))
    opt:zero_grad()
    local out = net:forward(x)
    local loss = crit:forward(out, y):item()
    net:backward(x, crit:backward(out, y))
    opt:step()
    run.progress.step = run.progress.step + 1
    return loss
  end
  function run.state() return { model = net, optimizer = opt, schedule = sched, rng = g, progress = run.progress } end
  return run
end

describe('dlua.ckpt training state', function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm(dir) end)

  it('a run continued from a checkpoint is bit-identical to the uninterrupted run', function()
    local a = make_run()
    for _ = 1, 3 do a.step() end
    ckpt.save(dir, a.state(), { step = 3 })
    local losses = {}
    for i = 1, 4 do losses[i] = a.step() end
    local b = make_run(77)  -- other initial weights and generator: all must come from the file
    local info = ckpt.load(dir, b.state())
    assert.equal(3, info.step)
    assert.equal(3, b.progress.step)
    for i = 1, 4 do assert.equal(losses[i], b.step()) end
    assert.equal(crc(a.net), crc(b.net))
    assert.equal(ckpt.crc32({ a.opt.state.float32.momentum }), ckpt.crc32({ b.opt.state.float32.momentum }))
  end)

  it('lays out step-N/ with index.json and latest, keeps N and never removes latest', function()
    local a = make_run()
    for s = 1, 5 do
      a.step()
      ckpt.save(dir, a.state(), { step = s, keep = 2 })
    end
    assert.same({ 'latest', 'step-000004', 'step-000005' }, ls(dir))
    assert.equal('step-000005\n', slurp(dir .. '/latest'))
    assert.same({ 'index.json', 'model.safetensors', 'optimizer.safetensors' }, ls(dir .. '/step-000005'))
    ckpt.save(dir, a.state(), { step = 5, keep = 1 })  -- the same step again: still complete, still latest
    assert.same({ 'latest', 'step-000005' }, ls(dir))
    assert.equal(dir .. '/step-000005', ckpt.latest(dir))
    -- model.safetensors holds the plain state-dict names, for PyTorch
    local r = ckpt.load_file(dir .. '/step-000005/model.safetensors')
    assert.truthy(r['1.running_mean'] and r['0.weight'] and r['4.bias'])
  end)

  it('skips an incomplete checkpoint and says which one is complete', function()
    local a = make_run()
    a.step()
    ckpt.save(dir, a.state(), { step = 1 })
    a.step()
    ckpt.save(dir, a.state(), { step = 2 })
    os.remove(dir .. '/step-000002/index.json')  -- as a save killed before its index
    assert.equal(dir .. '/step-000001', ckpt.latest(dir))
    local b = make_run()
    assert.equal(1, ckpt.load(dir, b.state()).step)
    local e = err_of(ckpt.load, dir .. '/step-000002', b.state())
    assert.truthy(e:find('incomplete', 1, true) and e:find('step-000001', 1, true), e)
    a.step()
    ckpt.save(dir, a.state(), { step = 3, keep = 5 })
    assert.is_false(exists(dir .. '/step-000002'))  -- left by a cut save: removed by the next one
  end)

  it('checks everything before loading anything', function()
    local a = make_run()
    a.step()
    ckpt.save(dir, a.state(), { step = 1 })
    local b = make_run(5)
    local before = crc(b.net)
    -- a corrupt optimizer file: the model (loaded first otherwise) must stay as it was
    local p = dir .. '/step-000001/optimizer.safetensors'
    local s = slurp(p)
    spit(p, s:sub(1, #s - 1) .. string.char((s:byte(#s) + 7) % 256))
    local e = err_of(ckpt.load, dir, b.state())
    assert.truthy(e:find("checksum mismatch for tensor 'buffers.float32.momentum'", 1, true) and e:find(p, 1, true), e)
    assert.equal(before, crc(b.net))
    spit(p, s)
    -- a model of another shape: every mismatch in one message, nothing loaded
    local other = nn.Sequential(nn.Conv2d(1, 5, 3, { padding = 1 }), nn.BatchNorm2d(5), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 36, 3))
    local st = b.state()
    st.model = other
    local oc = crc(other)
    e = err_of(ckpt.load, dir, st)
    assert.truthy(e:find("state 'model'", 1, true) and e:find('0.weight: the checkpoint has (4, 1, 3, 3) float32, the model (5, 1, 3, 3) float32', 1, true), e)
    assert.equal(oc, crc(other))
    assert.equal(before, crc(b.net))
    -- entries: missing and unexpected
    st = b.state()
    st.extra = { a = 1 }
    assert.truthy(err_of(ckpt.load, dir, st):find('not in the checkpoint: extra', 1, true))
    st = b.state()
    st.rng = nil
    assert.truthy(err_of(ckpt.load, dir, st):find('in the checkpoint but not in the state', 1, true))
    ckpt.load(dir, st, { strict = false })
    -- a different schedule is refused by the schedule itself
    st = b.state()
    st.schedule = lr.cosine({ lr = 0.05, steps = 30 })
    assert.truthy(err_of(ckpt.load, dir, st):find("the checkpoint's schedule is cosine(lr=0.05, steps=20", 1, true))
    -- a missing file is named
    os.remove(p)
    e = err_of(ckpt.load, dir, b.state())
    assert.truthy(e:find(p .. ' is missing', 1, true), e)
  end)

  it('saves in the background from a snapshot, and frees it', function()
    local a = make_run()
    a.step()
    collectgarbage()
    collectgarbage()
    local base = dlua.memory_allocated()
    local info = ckpt.save(dir, a.state(), { step = 1, async = true })
    assert.is_true(info.snapshot_bytes > 0)
    assert.is_true(info.snapshot_bytes >= a.net:num_parameters() * 4)
    local want = crc(a.net)
    a.step()  -- training goes on while the file is written
    local stats = ckpt.wait()
    assert.equal(info.snapshot_bytes, stats.snapshot_bytes)
    collectgarbage()
    collectgarbage()
    assert.equal(base, dlua.memory_allocated())  -- the snapshot is gone
    local b = make_run(9)
    ckpt.load(dir, b.state())
    assert.equal(want, crc(b.net))
    -- several async saves in a row: each waits for the previous one; live memory comes back to
    -- the same bytes and the allocator's cache does not grow (the snapshot blocks are reused)
    a.step()
    collectgarbage()
    collectgarbage()
    local live, cached
    for s = 2, 6 do
      ckpt.save(dir, a.state(), { step = s, async = true, keep = 2 })
      if s == 3 then
        ckpt.wait()
        live, cached = dlua.memory_allocated(), dlua.memory_cached()
      end
    end
    ckpt.wait()
    assert.equal(live, dlua.memory_allocated())
    assert.equal(cached, dlua.memory_cached())
    assert.same({ 'latest', 'step-000005', 'step-000006' }, ls(dir))
  end)

  it('reports a failed background save at the next wait', function()
    local a = make_run()
    spit(dir, 'a file where the directory should be')
    local e = err_of(ckpt.save, dir, a.state(), { step = 1, async = true })
    assert.truthy(e:find(dir, 1, true), e)
    os.remove(dir)
  end)

  it('checks its options and state by name', function()
    local a = make_run()
    assert.truthy(err_of(ckpt.save, dir, a.state()):find('opts.step', 1, true))
    assert.truthy(err_of(ckpt.save, dir, a.state(), { step = 1, kep = 2 }):find("unknown option 'kep'", 1, true))
    assert.truthy(err_of(ckpt.save, dir, { f = print }, { step = 1 }):find("state 'f' is a function", 1, true))
    assert.truthy(err_of(ckpt.save, dir, { ['a b'] = 1 }, { step = 1 }):find('letters, digits', 1, true))
    assert.truthy(err_of(ckpt.save, dir, { t = { x = print } }, { step = 1 }):find("state 't': x is a function", 1, true))
    assert.truthy(err_of(ckpt.load, dir, a.state()):find('no complete checkpoint in ' .. dir, 1, true))
  end)

  it('keeps numbers exact: doubles, 64-bit seeds, NaN, and tensors inside tables', function()
    local g = dlua.Generator(2 ^ 63 + 2 ^ 62)  -- a seed past 2^53 (a 64-bit cdata)
    local st = { g = g, t = { x = 0.1, big = 2 ^ 60 + 1, nan = 0 / 0, w = dlua.randn(3) }, v = 7 }
    local w = st.t.w:clone()
    ckpt.save(dir, st, { step = 0 })
    local g2 = dlua.Generator(1)
    local tbl = {}
    local info = ckpt.load(dir, { g = g2, t = tbl, v = 0 })
    assert.equal(tostring(g:initial_seed()), tostring(g2:initial_seed()))
    assert.equal(0.1, tbl.x)
    assert.equal(2 ^ 60 + 1, tbl.big)
    assert.is_true(tbl.nan ~= tbl.nan)
    assert.same(w:totable(), tbl.w:totable())
    assert.equal(7, info.values.v)
  end)
end)

describe('dlua.ckpt data cursors', function()
  it('DistributedSampler: the rest of an epoch re-split over another number of ranks', function()
    local n, b = 61, 4
    local saved = {}
    local consumed = {}
    for r = 0, 1 do
      local s = data.DistributedSampler({ n = n, num_replicas = 2, rank = r, seed = 5 })
      s:set_epoch(3)
      local idx = s:indices():totable()
      for k = 1, 3 * b do consumed[idx[k]] = (consumed[idx[k]] or 0) + 1 end
      for _ = 1, 3 do s:advance(b) end
      saved[r] = s:state_dict()
    end
    assert.equal(24, saved[0].consumed)
    for _, world in ipairs({ 1, 3, 2 }) do
      local seen = {}
      for k, v in pairs(consumed) do seen[k] = v end
      for r = 0, world - 1 do
        local s = data.DistributedSampler({ n = n, num_replicas = world, rank = r, seed = 5 })
        s:load_state_dict(saved[0])
        s:set_epoch(3)
        local idx = s:indices(3):totable()
        for k = s:skip(3) + 1, #idx do seen[idx[k]] = (seen[idx[k]] or 0) + 1 end
      end
      -- every sample of the epoch once; padding (drop_last = false) may repeat at most world - 1
      local extra = 0
      for i = 1, n do
        assert.is_true((seen[i] or 0) >= 1, ('world %d: sample %d never seen'):format(world, i))
        extra = extra + (seen[i] - 1)
      end
      assert.is_true(extra < world, ('world %d: %d repeats'):format(world, extra))
      -- the next epoch is whole again
      local s = data.DistributedSampler({ n = n, num_replicas = world, rank = 0, seed = 5 })
      s:load_state_dict(saved[0])
      s:set_epoch(4)
      assert.equal(0, s:skip())
      assert.equal(s:len(), s:indices():size(1))
    end
    local other = data.DistributedSampler({ n = 60, num_replicas = 2, rank = 0, seed = 5 })
    assert.truthy(err_of(other.load_state_dict, other, saved[0]):find('saved with n = 61', 1, true))
  end)

  it('data.batches{skip} continues an epoch with the same batches and augmentation', function()
    local x = dlua.randint(0, 256, 20, 1, 6, 6, { dtype = 'uint8' })
    local ds = data.TensorDataset(x, dlua.arange(1, 21, { dtype = 'int64' }))
    local opts = { batch = 4, shuffle = true, seed = 2, epoch = 3, augment = { crop_pad = 1, flip = true } }
    local full = {}
    for i, bx, by in data.batches(ds, opts) do full[i] = { bx, by } end
    opts.skip = 8
    local got = 0
    for i, bx, by in data.batches(ds, opts) do
      got = got + 1
      assert.same(full[i][1]:totable(), bx:totable())
      assert.same(full[i][2]:totable(), by:totable())
    end
    assert.equal(3, got)
  end)
end)
