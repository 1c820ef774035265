-- dlua.recipe's pieces: lr.warmup_cosine against the hand-written composition, the no-decay preset, the
-- unpadded DistributedSampler, MemoryLoader's resize/grey-to-RGB/order, the rank-0 logger, setup alone.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local lr = require 'dlua.lr'
local data = require 'dlua.data'
local recipe = require 'dlua.recipe'

local f64 = { dtype = 'float64' }

describe('lr.warmup_cosine', function()
  it('is the linear warmup then cosine that recipes wrote by hand, value for value and in its description', function()
    local peak, total, warm = 0.4, 50, 7
    local hand = lr.sequential({ lr.linear_warmup({ lr = peak, steps = warm, start_factor = 0.1 }),
      lr.cosine({ lr = peak, steps = total - warm }) })
    local s = lr.warmup_cosine({ lr = peak, steps = total, warmup = warm })
    assert.equals(tostring(hand), tostring(s))
    for t = 0, total + 2 do assert.equals(hand(t), s(t)) end
    assert.equals(peak * 0.1, s(0))
    assert.equals(peak, s(warm))
    assert.is_true(math.abs(s(total)) < 1e-15)
  end)
  it('caps the warmup to the run and is a plain cosine without one', function()
    local s = lr.warmup_cosine({ lr = 1, steps = 4, warmup = 10 })
    assert.equals(tostring(lr.sequential({ lr.linear_warmup({ lr = 1, steps = 3, start_factor = 0.1 }), lr.cosine({ lr = 1, steps = 1 }) })),
      tostring(s))
    assert.equals(tostring(lr.cosine({ lr = 1, steps = 4 })), tostring(lr.warmup_cosine({ lr = 1, steps = 4 })))
    assert.equals(tostring(lr.cosine({ lr = 1, steps = 4 })), tostring(lr.warmup_cosine({ lr = 1, steps = 4, warmup = 0.5 })))
    assert.has_error(function() lr.warmup_cosine({ lr = 1, steps = 4, warmpu = 1 }) end)
    assert.has_error(function() lr.warmup_cosine({ lr = 1 }) end, 'lr.warmup_cosine: option steps is required')
  end)
end)

describe('optim.no_decay_groups', function()
  it('exempts 1-D parameters (bias, batch-norm) from weight decay and decays the rest', function()
    dlua.manual_seed(3)
    local m = nn.Sequential(nn.Linear(3, 4, f64), nn.Linear(4, 2, f64))
    m:flatten()
    local before = {}
    for _, e in ipairs(m:named_parameters()) do before[e.name] = e.param:clone() end
    local sgd = optim.SGD(m, { lr = 0.1, weight_decay = 0.5, groups = optim.no_decay_groups() })
    m:zero_grad()
    sgd:step()
    for _, e in ipairs(m:named_parameters()) do
      local want = e.param:dim() <= 1 and before[e.name] or before[e.name] * (1 - 0.1 * 0.5)
      assert.is_true((e.param - want):abs():max():item() < 1e-15, e.name)
    end
    assert.are_not.equal(optim.no_decay_groups()[1], optim.no_decay_groups()[1])  -- fresh each call
  end)
end)

describe('DistributedSampler{pad = false}', function()
  it('gives every sample to exactly one rank, unequal shares, shuffled or not', function()
    for _, shuffle in ipairs({ false, true }) do
      local seen, lens = {}, {}
      for r = 0, 2 do
        local s = data.DistributedSampler({ n = 10, num_replicas = 3, rank = r, shuffle = shuffle, seed = 5, pad = false })
        local idx = s:indices(1):totable()
        lens[#lens + 1] = s:len()
        assert.equals(s:len(), #idx)
        for _, i in ipairs(idx) do
          assert.is_nil(seen[i], 'sample ' .. i .. ' twice')
          seen[i] = true
        end
      end
      for i = 1, 10 do assert.is_true(seen[i], 'sample ' .. i .. ' missing') end
      assert.same({ 4, 3, 3 }, lens)
    end
    local s = data.DistributedSampler({ n = 10, num_replicas = 3, rank = 1, shuffle = false, pad = false })
    assert.same({ 2, 5, 8 }, s:indices(1):totable())
    assert.equals(0, data.DistributedSampler({ n = 2, num_replicas = 3, rank = 2, pad = false }):len())
    assert.has_error(function() data.DistributedSampler({ n = 10, num_replicas = 3, rank = 0, pad = false, drop_last = true }) end)
  end)
end)

describe('recipe.MemoryLoader', function()
  -- 6 grey 2x3 images; image k's pixel (i, j) is 10 k + 3 (i - 1) + j; labels are the sample ids
  local x = dlua.empty({ 6, 1, 2, 3 }, { dtype = 'uint8' })
  for k = 1, 6 do for i = 1, 2 do for j = 1, 3 do x[k][1][i][j] = 10 * k + 3 * (i - 1) + j end end end
  local ds = data.TensorDataset(x, dlua.arange(1, 7, { dtype = 'int64' }))

  it('resizes by nearest neighbour and repeats a grey channel into three, in the sampler\'s order', function()
    local sampler = data.DistributedSampler({ n = 6, num_replicas = 2, rank = 1, shuffle = true, seed = 9 })
    local l = recipe.MemoryLoader({ dataset = ds, sampler = sampler, batch = 2, mean = 0, std = 1, size = { 4, 6 }, channels = 3 })
    assert.equals(2, l:len())
    local order = sampler:indices(1):totable()
    local got = {}
    for i, xb, yb in l:batches(1) do
      assert.same({ yb:numel(), 3, 4, 6 }, { xb:size(1), xb:size(2), xb:size(3), xb:size(4) })
      for b = 1, yb:numel() do
        local id = yb[b]
        got[#got + 1] = id
        for c = 1, 3 do
          for i2 = 1, 4 do
            for j2 = 1, 6 do  -- output (i2, j2) reads input (ceil(i2 / 2), ceil(j2 / 2))
              local want = (10 * id + 3 * (math.ceil(i2 / 2) - 1) + math.ceil(j2 / 2)) / 255
              assert.is_true(math.abs(xb[b][c][i2][j2] - want) < 1e-6, ('batch %d sample %d (%d,%d,%d)'):format(i, b, c, i2, j2))
            end
          end
        end
      end
    end
    assert.same(order, got)
  end)

  it('lays batches out channels-last on request and refuses colour images for grey-to-RGB', function()
    local l = recipe.MemoryLoader({ dataset = ds, batch = 4, size = 5, channels = 3, memory_format = 'channels_last', mean = 0, std = 1 })
    local _, xb = l:batches(1)()
    assert.is_true(xb:is_contiguous('channels_last'))
    local rgb = data.TensorDataset(dlua.zeros({ 2, 2, 3, 3 }), dlua.ones({ 2 }, { dtype = 'int64' }))
    assert.has_error(function() recipe.MemoryLoader({ dataset = rgb, batch = 1, channels = 3 }) end,
      'MemoryLoader: channels = 3 repeats a grey image; these have 2 channels')
    local ok, err = pcall(recipe.MemoryLoader, { dataset = ds, batch = 1, shufle = true })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("MemoryLoader: unknown option 'shufle' (expected augment, batch,", 1, true), err)
  end)
end)

describe('recipe.Logger', function()
  local function sink()
    local s = { text = '' }
    function s:write(...) for _, v in ipairs({ ... }) do self.text = self.text .. v end end
    function s:flush() end
    return s
  end
  it('prints on rank 0 only, a progress line every N steps and at the end of the epoch', function()
    local out0, out1 = sink(), sink()
    local l0 = recipe.Logger({ rank = 0, every = 2, tty = false, out = out0 })
    local l1 = recipe.Logger({ rank = 1, every = 2, tty = false, out = out1 })
    for _, l in ipairs({ l0, l1 }) do
      l:print('hello %d', 7)
      for i = 1, 5 do l:progress(1, i, 5, 0.5, 100, 3) end
    end
    assert.equals('', out1.text)
    local lines = {}
    for line in out0.text:gmatch('[^\n]+') do lines[#lines + 1] = line end
    assert.same({ 'hello 7', 'epoch 1      2/5  loss 0.5000     100 img/s  ETA 3s', 'epoch 1      4/5  loss 0.5000     100 img/s  ETA 3s',
      'epoch 1      5/5  loss 0.5000     100 img/s  ETA 3s' }, lines)
  end)
end)

describe('recipe.setup', function()
  it('joins a world of one and picks the CPU when there is no GPU; a CUDA request says why not', function()
    local e = recipe.setup({ device = 'auto' })
    assert.equals(0, e.rank)
    assert.equals(1, e.world)
    assert.is_true(dlua.dist.is_initialized())
    if not dlua.cuda.is_available() then
      assert.equals('cpu', e.device)
      local ok, err = pcall(recipe.pick_device, 'cuda', dlua.dist)
      assert.is_false(ok)
      assert.truthy(tostring(err):find('device cuda: no CUDA device available', 1, true))
    end
    assert.has_error(function() recipe.pick_device('tpu', dlua.dist) end, "device tpu: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    recipe.teardown()
    assert.is_false(dlua.dist.is_initialized())
    dlua.dist.init()  -- a job the caller joined stays joined
    assert.equals(1, recipe.setup().world)
    recipe.teardown()
    assert.is_true(dlua.dist.is_initialized())
    dlua.dist.destroy()
  end)
end)
