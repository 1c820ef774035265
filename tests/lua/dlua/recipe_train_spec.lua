-- dlua.recipe.train: every refused combination names its option and reason before any data is read or the job joined; the printed plan; a tiny run.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local data = require 'dlua.data'
local recipe = require 'dlua.recipe'
local V = require 'dlua.recipe.validate'
local P = require 'dlua.recipe.plan'
local format = string.format

local function model() return nn.Sequential(nn.Flatten(), nn.Linear(784, 10)) end
local function spec(t)
  local s = { model = model, data = { batch = 8 } }
  for k, v in pairs(t or {}) do
    if type(v) == 'table' and type(s[k]) == 'table' then for k2, v2 in pairs(v) do s[k][k2] = v2 end else s[k] = v end
  end
  return s
end
local function refused(s, want, world)
  local ok, err = pcall(V.validate, s, world or 1, world or 1)
  assert.is_false(ok, 'accepted: ' .. want)
  assert.equals('train: ' .. want, tostring(err))
end

describe('recipe.train validation', function()
  it("amp = 'auto': off on the CPU and with a pipeline, bf16 on a GPU of compute capability >= 8.0", function()
    assert.equals('off', (V.resolve_amp({ amp = 'auto' }, 'cpu')))
    assert.equals('auto: off on the CPU', select(2, V.resolve_amp({ amp = 'auto' }, 'cpu')))
    for _, a in ipairs({ 'off', 'bf16', 'f16' }) do assert.equals(a, (V.resolve_amp({ amp = a }, 'cpu'))) end
    assert.equals('auto', V.validate(spec({ amp = 'auto' }), 1, 1).amp)  -- kept until the device is known
    local cuda = require 'dlua.cuda'
    if not cuda.is_available() then
      assert.is_false(cuda.is_bf16_supported())
      return print('  (no CUDA device: the GPU half of amp = auto not checked here)')
    end
    local major, minor = cuda.get_device_capability(0)
    assert.is_true(major >= 1 and minor >= 0, 'capability ' .. major .. '.' .. minor)
    assert.equals(major >= 8, cuda.is_bf16_supported(0))
    assert.equals(major >= 8 and 'bf16' or 'off', (V.resolve_amp({ amp = 'auto' }, 'cuda:0')))
    assert.equals('off', (V.resolve_amp({ amp = 'auto', stages = 2 }, 'cuda:0')))
  end)

  it('refuses the modules of issues not merged yet, by issue', function()
    if not pcall(require, 'dlua.amp') then refused(spec({ amp = 'bf16' }), 'amp: not yet available (issue #20)') end
    if not pcall(require, 'dlua.dist.compress') then
      refused(spec({ parallel = { compress = 'topk:0.01' } }), 'parallel.compress: not yet available (issue #22)', 2)
    end
  end)

  it('refuses each unsupported or risky combination with its reason', function()
    refused(spec({ data = { batch = 0, global_batch = 100 }, accumulate = 3 }),
      'data.global_batch = 100: not divisible by 2 replicas x accumulate 3 (6); choose a multiple of 6', 2)
    refused(spec({ parallel = { pipeline = { stages = 4 } } }), "parallel.pipeline.stages = 4: more stages than the job's 2 ranks (one stage per rank)", 2)
    refused(spec({ parallel = { pipeline = { stages = 2 } } }), 'parallel.pipeline.stages = 2: the 3 ranks do not divide into pipelines of 2 stages', 3)
    refused(spec({ parallel = { pipeline = { stages = 2 } }, accumulate = 2 }),
      'accumulate with parallel.pipeline: the pipeline accumulates its chunks micro-batches itself', 2)
    refused(spec({ parallel = { pipeline = { stages = 2 }, zero = 2 } }),
      'parallel.zero 2 with parallel.pipeline: not supported yet (zero 1 shards the optimizer state across the replicas)', 2)
    refused(spec({ parallel = { pipeline = { stages = 2 } }, checkpoint = { dir = '/tmp/x' } }),
      'checkpoint with parallel.pipeline: not supported yet', 2)
    refused(spec({ parallel = { pipeline = { stages = 2, chunks = 16 } } }),
      "parallel.pipeline.chunks = 16: more micro-batches than the 8 images of a pipeline's batch", 2)
    refused(spec({ parallel = { offload = true } }), 'parallel.offload: needs parallel.zero 1, 2 or 3 (it moves the sharded optimizer state)')
    refused(spec({ parallel = { zero = 4 } }), 'parallel.zero = 4: expected 0 (DDP), 1, 2 or 3')
    refused(spec({ parallel = { zero = 2, ddp = { bucket_mb = 'auto' } } }),
      "parallel.ddp.bucket_mb = 'auto' with parallel.zero: DDP only (give ZeRO a number of MB)")
    refused(spec({ data = { batch = 8, global_batch = 32 } }),
      'data.batch = 8 and data.global_batch = 32 disagree: 2 replicas x accumulate 1 x 8 = 16', 2)
    refused(spec({ data = { batch = 0 } }), 'data.batch or data.global_batch: one is required')
    refused(spec({ data = { limit = 64, batch = 32 }, accumulate = 2 }),
      "data.batch 32 x accumulate 2 is more than a replica's 32 images (data.limit 64 over 2 replicas)", 2)
    refused(spec({ checkpoint = { every = 10 } }), 'checkpoint.every: needs checkpoint.dir')
    refused(spec({ checkpoint = { resume = 'auto' } }), "checkpoint.resume = 'auto': needs checkpoint.dir (where to look)")
    refused(spec({ activation_checkpoint = 'layers' }), 'activation_checkpoint = layers: expected none, blocks, stages')
    refused(spec({ epochs = 0 }), 'epochs = 0: expected a positive integer')
    refused(spec({ parallel = { zer = 1 } }), "unknown option 'parallel.zer' (did you mean 'zero'?)")
    refused(spec({ optim = { name = 'rmsprop' } }), 'optim.name = rmsprop: expected sgd, adamw, adam, lars, lamb')
    refused({ data = { batch = 8 } }, 'model: required (a module, or function(info) -> module)')
    if not dlua.cuda.is_available() then
      local ok, err = pcall(V.validate, spec({ device = 'cuda' }), 1, 1)
      assert.is_false(ok)
      assert.truthy(tostring(err):find('train: device = cuda: no CUDA device available', 1, true))
    end
    if pcall(require, 'dlua.dist.compress') then
      refused(spec({ parallel = { compress = 'powersgd:2', zero = 2 } }),
        "parallel.compress with parallel.zero 2: ZeRO-2 reduce-scatters gradient buckets and keeps only each rank's shard, which a compression hook (all-reduce or all-gather of whole buckets) does not give; use zero 1 or 0", 2)
    end
  end)

  it('refuses before reading any data or joining the job', function()
    local loads = 0
    local real = data.FashionMNIST
    data.FashionMNIST = function(...) loads = loads + 1; return real(...) end
    local ok, err = pcall(recipe.train, spec({ parallel = { offload = true } }))
    data.FashionMNIST = real
    assert.is_false(ok)
    assert.truthy(tostring(err):find('parallel.offload', 1, true))
    assert.equals(0, loads)
    assert.is_false(dlua.dist.is_initialized())
  end)
end)

describe('recipe.train plan', function()
  it('states world, batches, the scaled learning rate, sharding and memory per rank', function()
    local c = V.validate(spec({ data = { batch = 0, global_batch = 512 }, accumulate = 2, optim = { lr = 0.1, scale_lr = 256 },
      parallel = { zero = 2 } }), 4, 2)
    local params = 1000000
    local lines = P.lines(c, { params = params, classes = 10, model = 'Net', data = 'D', image_size = 28, channels = 1, backend = 'gloo',
      device = 'cpu', threads = 2, total = 40, steps_per_epoch = 40, peak = 0.2, schedule = 'S' })
    local text = table.concat(lines, '\n')
    assert.truthy(text:find('world      4 ranks (2 per node), gloo, CPU, 2 threads per rank', 1, true), text)
    assert.truthy(text:find('batch      4 ranks x batch 64 x accumulate 2 = global batch 512', 1, true), text)
    assert.truthy(text:find('lr         sgd 0.2 (0.1 per 256 images x global batch 512, linear scaling rule); S', 1, true), text)
    assert.truthy(text:find('parallel   ZeRO-2 over 4 ranks', 1, true), text)
    -- ZeRO-2 on 4 ranks, SGD with momentum: 4 B parameters, 4/4 B gradients, 4/4 B momentum per parameter
    local want = string.format('memory     %.1f MB model states per rank (parameters %.1f MB, gradients %.1f MB, optimizer %.1f MB)',
      (4 + 1 + 1) * params / 2 ^ 20, 4 * params / 2 ^ 20, params / 2 ^ 20, params / 2 ^ 20)
    assert.truthy(text:find(want, 1, true), text)
    local m = P.memory(V.validate(spec({ optim = { name = 'adamw' }, parallel = { zero = 3 } }), 8, 8), 800)
    assert.same({ parameters = 400, gradients = 400, optimizer = 800, total = 1600 }, m)
  end)

  it('prints the plan on a dry run and trains nothing', function()
    local r = recipe.train(spec({ dry_run = true, data = { limit = 64, batch = 16 }, epochs = 2 }))
    local text = table.concat(r.plan, '\n')
    assert.truthy(text:find('batch      1 rank x batch 16 x accumulate 1 = global batch 16', 1, true), text)
    assert.truthy(text:find('steps      8 steps of 16 images, 4 per epoch, 2 epochs', 1, true), text)
    assert.truthy(text:find('model      Sequential, 7850 parameters, 10 classes', 1, true), text)
    recipe.teardown()
  end)

  it('trains on loaders of one\'s own (data.train, data.eval, data.sampler)', function()
    dlua.manual_seed(5)
    local x = dlua.randn({ 96, 4 })
    local y = x:narrow(2, 1, 1):view(96):gt(0):long() + 1  -- class 2 when the first feature is positive
    local ds = data.TensorDataset(x, y)
    local sampler = data.DistributedSampler({ n = 96, num_replicas = 1, rank = 0, shuffle = true, seed = 3, drop_last = true })
    local train = recipe.MemoryLoader({ dataset = ds, sampler = sampler, batch = 16, drop_last = true, mean = 0, std = 1 })
    local eval = recipe.MemoryLoader({ dataset = ds, batch = 32, mean = 0, std = 1 })
    local r = recipe.train({ model = nn.Linear(4, 2), data = { train = train, eval = eval, sampler = sampler, classes = 2, batch = 16 },
      epochs = 4, optim = { lr = 0.5 }, print_every = 100 })
    assert.equals(24, r.step)
    assert.is_true(r.accuracy > 0.85, 'accuracy ' .. r.accuracy)
    refused({ model = model, data = { batch = 8, train = train, classes = 2 } },
      "data.train needs data.sampler: the DistributedSampler it follows (the epoch's order, the resume cursor)")
    refused({ model = model, data = { batch = 8, train = train, sampler = sampler, eval = eval } },
      "data.classes: needed with data.train (the model's outputs)")
  end)

  it('amp f16: a skipped step saves no second checkpoint of the step before it, nor one of step 0', function()
    if not pcall(require, 'dlua.amp') then return print('  (no dlua.amp in this build: not checked)') end
    dlua.manual_seed(5)
    local x = dlua.randn({ 64, 4 })
    local y = x:narrow(2, 1, 1):view(64):gt(0):long() + 1
    local ds = data.TensorDataset(x, y)
    local sampler = data.DistributedSampler({ n = 64, num_replicas = 1, rank = 0, shuffle = true, seed = 3, drop_last = true })
    local train = recipe.MemoryLoader({ dataset = ds, sampler = sampler, batch = 16, drop_last = true, mean = 0, std = 1 })
    local dir = os.tmpname()
    os.remove(dir)
    local outcomes, saved = {}, {}
    -- a second layer's weights of ~50: the hidden gradient, 65536 x (loss gradient / 16) x 50 x 8, overflows float16
    -- until the scale has halved a few times; then the steps apply
    local net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    for _, e in ipairs(net:named_parameters()) do if e.name == '1.weight' then e.param:copy_(dlua.randn({ 2, 8 }) * 50) end end
    local r = recipe.train({ model = net, data = { train = train, sampler = sampler, classes = 2, batch = 16 },
      epochs = 3, amp = 'f16', eval = false, print_every = 100, checkpoint = { dir = dir, every = 1 },
      hooks = { on_step = function(t, info)
        if not t._counting then
          t._counting, t.save = true, function(self, ...)
            saved[#saved + 1] = self.progress.step
            return getmetatable(self).__index.save(self, ...)
          end
        end
        outcomes[#outcomes + 1] = info.outcome
      end } })
    os.execute("rm -rf '" .. dir .. "'")
    local skipped = 0
    for _, o in ipairs(outcomes) do if o == 'skipped' then skipped = skipped + 1 end end
    assert.is_true(skipped > 0 and skipped < #outcomes, format('%d of %d steps skipped: the test needs some of each', skipped, #outcomes))
    assert.equals(#outcomes - skipped, r.step)
    local seen = {}
    for _, s in ipairs(saved) do
      assert.is_true(s > 0, 'a checkpoint of step 0')
      assert.is_nil(seen[s], 'step ' .. s .. ' saved twice')
      seen[s] = true
    end
  end)

  it('runs: a small model on 256 images learns, calls its hooks, reports its step and checksum', function()
    local steps, epochs = {}, {}
    local r = recipe.train(spec({ data = { limit = 256, eval_limit = 200, batch = 32 }, epochs = 2, optim = { lr = 0.05 },
      print_every = 100, hooks = { on_step = function(_, i) steps[#steps + 1] = i.step end,
        on_epoch = function(t, i) epochs[#epochs + 1] = { i.epoch, t.progress.step, i.accuracy } end } }))
    assert.equals(16, r.step)
    assert.equals(16, #steps)
    assert.equals(16, steps[16])
    assert.same({ 1, 8 }, { epochs[1][1], epochs[1][2] })
    assert.same({ 2, 16, r.accuracy }, epochs[2])
    assert.is_true(r.accuracy > 0.3, 'accuracy ' .. r.accuracy)
    assert.truthy(r.crc32:match('^%x+$'))
  end)
end)
