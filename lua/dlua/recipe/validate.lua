-- dlua.recipe.validate: train{}'s table checked as a whole before any data is read or any device touched; every refusal names the option at fault and why.
local cli = require 'dlua.cli'

local M = {}
local format, floor = string.format, math.floor

-- The options train{} knows, their defaults, and what each may be. A nested table is a group.
-- kinds: 'int+' positive integer, 'int0' non-negative integer, 'num0' number >= 0, 'num+' > 0, 'bool',
-- 'string', 'fn' function, 'any', or a list of allowed strings.
local SCHEMA = {
  name = { 'string', 'train' },
  model = { 'any' },        -- a module, or function(info) -> module (info: classes, channels, image_size)
  loss = { 'any' },         -- a criterion, or nil: cross-entropy with data.label_smoothing
  epochs = { 'int+', 1 },
  accumulate = { 'int+', 1 },
  clip_grad = { 'num0', 0 },
  amp = { { 'off', 'bf16', 'f16', 'auto' }, 'off' },  -- 'auto': M.resolve_amp, once the device is known
  activation_checkpoint = { { 'none', 'blocks', 'stages' }, 'none' },
  device = { 'string', 'auto' },
  threads = { 'int0', 0 },
  seed = { 'int0', 1 },
  print_every = { 'int+', 10 },
  progress = { { 'steps', 'bar' }, 'steps' },
  metrics = { 'string', '' },
  nan_check = { 'string', '' },
  eval = { 'bool', true },
  dry_run = { 'bool', false },
  options = { 'any' },      -- the command-line options, saved in checkpoints and metrics
  hooks = { on_step = { 'fn' }, on_epoch = { 'fn' } },
  data = {
    source = { 'string', 'fashion_mnist' },  -- 'fashion_mnist' (built in) or an ImageFolder root with train/ and val/
    root = { 'string', '' },                 -- the Fashion-MNIST IDX folder (default: the Debian package)
    batch = { 'int0', 0 },                   -- images per rank per micro-batch (0: from global_batch)
    global_batch = { 'int0', 0 },            -- images per optimizer step over all replicas (0: from batch)
    eval_batch = { 'int0', 0 },              -- images per evaluation step (0: batch)
    limit = { 'int0', 0 },
    eval_limit = { 'int0', 0 },
    image_size = { 'int0', 0 },              -- 0: the data's own size
    channels = { 'int0', 0 },                -- 0: the data's own; 3 turns grey images into RGB
    workers = { 'int0', 2 },
    channels_last = { 'bool', true },
    augment = { 'bool', true },
    label_smoothing = { 'num0', 0 },
    -- data of your own instead of source: loaders with :batches(epoch) (i, x, y) and the sampler they follow
    train = { 'any' }, eval = { 'any' }, sampler = { 'any' }, classes = { 'int0', 0 },
  },
  optim = {
    name = { { 'sgd', 'adamw', 'adam', 'lars', 'lamb' }, 'sgd' },
    lr = { 'num+', 0.1 },
    scale_lr = { 'int0', 0 },                -- N: lr is per N images, scaled by global batch / N (linear scaling rule); 0: as given
    momentum = { 'num0', 0.9 },
    nesterov = { 'bool', false },
    weight_decay = { 'num0', 1e-4 },
    no_decay = { 'bool', true },             -- no weight decay on biases and batch-norm
  },
  schedule = {
    name = { { 'warmup_cosine', 'cosine', 'constant' }, 'warmup_cosine' },
    warmup = { 'num0', 0 },                  -- epochs of linear warmup
    start_factor = { 'num+', 0.1 },
  },
  parallel = {
    ddp = { bucket_mb = { 'any', 25 } },     -- a number of MB or 'auto'
    zero = { 'int0', 0 },
    offload = { 'bool', false },
    compress = { 'string', 'none' },         -- #22's specs: none, fp16, bf16, topk:R, powersgd:K
    sync_bn = { 'bool', false },
    pipeline = { stages = { 'int0', 0 }, chunks = { 'int+', 8 }, schedule = { { 'gpipe', '1f1b' }, '1f1b' },
      split = { { 'time', 'params' }, 'time' } },
  },
  checkpoint = {
    dir = { 'string', '' },
    every = { 'int0', 0 },
    keep = { 'int0', 0 },
    resume = { 'string', '' },
    async = { 'bool', false },
    stop_after = { 'int0', 0 },
  },
}
M.SCHEMA = SCHEMA

local function is_leaf(s) return s[1] ~= nil or next(s) == nil end

local keys_of = require('dlua.options').sorted_keys

local function refuse(fmt, ...) error(format('train: ' .. fmt, ...), 0) end
M.refuse = refuse

local function check_value(path, kind, v)
  if type(kind) == 'table' then
    for _, a in ipairs(kind) do if v == a then return end end
    refuse("%s = %s: expected %s", path, tostring(v), table.concat(kind, ', '))
  end
  local ok = true
  if kind == 'int+' then ok = type(v) == 'number' and v >= 1 and v == floor(v)
  elseif kind == 'int0' then ok = type(v) == 'number' and v >= 0 and v == floor(v)
  elseif kind == 'num0' then ok = type(v) == 'number' and v >= 0 and v < math.huge
  elseif kind == 'num+' then ok = type(v) == 'number' and v > 0 and v < math.huge
  elseif kind == 'bool' then ok = type(v) == 'boolean'
  elseif kind == 'string' then ok = type(v) == 'string'
  elseif kind == 'fn' then ok = type(v) == 'function'
  end
  if not ok then
    local want = ({ ['int+'] = 'a positive integer', int0 = 'an integer >= 0', num0 = 'a number >= 0', ['num+'] = 'a positive number',
      bool = 'true or false', string = 'a string', fn = 'a function' })[kind]
    refuse('%s = %s: expected %s', path, tostring(v), want)
  end
end

-- The table with every default filled in, unknown names refused (with the closest known one).
local function fill(path, schema, given)
  if given ~= nil and type(given) ~= 'table' then refuse('%s: expected a table, got %s', path, type(given)) end
  given = given or {}
  local out, known = {}, keys_of(schema)
  for k in pairs(given) do
    if schema[k] == nil then
      local hint = type(k) == 'string' and cli.closest(k, known)
      refuse("unknown option '%s%s'%s", path == '' and '' or path .. '.', tostring(k), hint and format(" (did you mean '%s'?)", hint) or '')
    end
  end
  for k, s in pairs(schema) do
    local p = path == '' and k or path .. '.' .. k
    if is_leaf(s) then
      local v = given[k]
      if v == nil then v = s[2] end
      if v ~= nil and s[1] ~= 'any' then check_value(p, s[1], v) end
      out[k] = v
    else
      out[k] = fill(p, s, given[k])
    end
  end
  return out
end

-- The job's size as the launcher's variables give it, without joining it (no store, no device).
function M.world()
  local e = require('dlua.dist')._environment()
  return e.world, e.local_world
end

-- A module of another issue, or nil when it is not there: `require(name)`, or for dlua.dist.compress
-- also a `compress` field of dlua.dist (wherever #22 puts it).
function M.module(name)
  local ok, m = pcall(require, name)
  if ok then return m end
  if name == 'dlua.dist.compress' then
    local dist = require('dlua.dist')
    return rawget(dist, 'compress')
  end
  return nil
end
local function available(name) return M.module(name) ~= nil end
M.available = available

-- validate(spec, world, local_world) -> c: the whole combination checked; c is the filled-in table plus
-- derived values (replicas, batch, global_batch, stages). Raises 'train: <option>: <reason>' on the
-- first refusal. world defaults to the environment's.
function M.validate(spec, world, local_world)
  if type(spec) ~= 'table' then refuse('expected a table of options, got %s', type(spec)) end
  if not world then world, local_world = M.world() end
  local c = fill('', SCHEMA, spec)
  c.world, c.local_world = world, local_world or world
  local p, d, k = c.parallel, c.data, c.checkpoint
  if c.model == nil then refuse('model: required (a module, or function(info) -> module)') end
  if type(c.model) ~= 'function' and (type(c.model) ~= 'table' or type(c.model.forward) ~= 'function') then
    refuse('model: expected a module or a function(info) returning one, got %s', type(c.model))
  end
  -- the modules of issues not merged yet
  if c.amp ~= 'off' and c.amp ~= 'auto' and not available('dlua.amp') then refuse('amp: not yet available (issue #20)') end
  if p.compress ~= 'none' and not available('dlua.dist.compress') then refuse('parallel.compress: not yet available (issue #22)') end
  -- sharding, compression
  if p.zero > 3 then refuse('parallel.zero = %d: expected 0 (DDP), 1, 2 or 3', p.zero) end
  if p.offload and p.zero == 0 then refuse('parallel.offload: needs parallel.zero 1, 2 or 3 (it moves the sharded optimizer state)') end
  local bmb = p.ddp.bucket_mb
  if bmb ~= 'auto' and (type(bmb) ~= 'number' or not (bmb > 0)) then
    refuse("parallel.ddp.bucket_mb = %s: expected a number of MB or 'auto'", tostring(bmb))
  end
  if bmb == 'auto' and p.zero > 0 then refuse("parallel.ddp.bucket_mb = 'auto' with parallel.zero: DDP only (give ZeRO a number of MB)") end
  if p.compress ~= 'none' and p.zero > 1 then
    refuse('parallel.compress with parallel.zero %d: ZeRO-%d reduce-scatters gradient buckets and keeps only each rank\'s shard, which a compression hook (all-reduce or all-gather of whole buckets) does not give; use zero 1 or 0', p.zero, p.zero)
  end
  -- pipelines
  local stages = p.pipeline.stages
  if stages == 1 then stages = 0 end
  c.stages = stages
  local replicas = world
  if stages > 0 then
    if stages > world then refuse('parallel.pipeline.stages = %d: more stages than the job\'s %d ranks (one stage per rank)', stages, world) end
    if world % stages ~= 0 then refuse('parallel.pipeline.stages = %d: the %d ranks do not divide into pipelines of %d stages', stages, world, stages) end
    if c.accumulate ~= 1 then refuse('accumulate with parallel.pipeline: the pipeline accumulates its chunks micro-batches itself') end
    if k.dir ~= '' or k.resume ~= '' then refuse('checkpoint with parallel.pipeline: not supported yet') end
    if p.zero > 1 then refuse('parallel.zero %d with parallel.pipeline: not supported yet (zero 1 shards the optimizer state across the replicas)', p.zero) end
    if p.zero == 1 and c.clip_grad > 0 then refuse('clip_grad with parallel.pipeline and zero 1: not supported yet') end
    if p.compress ~= 'none' then refuse('parallel.compress with parallel.pipeline: not supported yet') end
    if c.amp ~= 'off' and c.amp ~= 'auto' then refuse('amp with parallel.pipeline: not supported yet (the pipeline runs its own forward)') end
    if bmb == 'auto' then refuse("parallel.ddp.bucket_mb = 'auto' with parallel.pipeline: not supported") end
    replicas = world / stages
  end
  c.replicas = replicas
  -- batches: per rank per micro-batch, or the global batch (divided by replicas x accumulate)
  local per = stages > 0 and 1 or c.accumulate  -- a pipeline's batch is per pipeline per step
  if d.batch == 0 and d.global_batch == 0 then refuse('data.batch or data.global_batch: one is required') end
  if d.global_batch > 0 then
    if d.global_batch % (replicas * per) ~= 0 then
      refuse('data.global_batch = %d: not divisible by %d replicas x accumulate %d (%d); choose a multiple of %d',
        d.global_batch, replicas, per, replicas * per, replicas * per)
    end
    local b = d.global_batch / (replicas * per)
    if d.batch > 0 and d.batch ~= b then
      refuse('data.batch = %d and data.global_batch = %d disagree: %d replicas x accumulate %d x %d = %d', d.batch, d.global_batch,
        replicas, per, d.batch, d.batch * replicas * per)
    end
    d.batch = b
  end
  c.global_batch = d.batch * replicas * per
  if stages > 0 and p.pipeline.chunks > d.batch then
    refuse('parallel.pipeline.chunks = %d: more micro-batches than the %d images of a pipeline\'s batch', p.pipeline.chunks, d.batch)
  end
  if d.eval_batch == 0 then d.eval_batch = d.batch end
  if d.train ~= nil then
    if type(d.train) ~= 'table' or type(d.train.batches) ~= 'function' then
      refuse('data.train: expected a loader with :batches(epoch) giving (i, x, y), got %s', type(d.train))
    end
    if type(d.sampler) ~= 'table' or type(d.sampler.len) ~= 'function' or type(d.sampler.set_epoch) ~= 'function' then
      refuse('data.train needs data.sampler: the DistributedSampler it follows (the epoch\'s order, the resume cursor)')
    end
    if c.eval and (type(d.eval) ~= 'table' and type(d.eval) ~= 'function') then
      refuse('data.eval: expected a loader (or eval = false), got %s', type(d.eval))
    end
    if d.classes == 0 then refuse('data.classes: needed with data.train (the model\'s outputs)') end
    if stages > 0 and p.pipeline.split == 'time' and (d.image_size == 0 or d.channels == 0) then
      refuse("parallel.pipeline.split = 'time' with data.train: give data.channels and data.image_size (the input it times), or split = 'params'")
    end
  -- data the size of which is known before reading it: the built-in Fashion-MNIST (60000 training images)
  elseif d.source == 'fashion_mnist' then
    local n = d.limit > 0 and math.min(d.limit, 60000) or 60000
    local per_rank = floor(n / replicas)
    if floor(per_rank / d.batch / per) < 1 then
      refuse('data.batch %d x accumulate %d is more than a replica\'s %d images (data.limit %d over %d replicas)', d.batch, per, per_rank,
        n, replicas)
    end
  elseif d.channels ~= 0 and d.channels ~= 3 then
    refuse('data.channels = %d: an image folder decodes RGB (3 channels)', d.channels)
  end
  -- checkpoints
  if k.every > 0 and k.dir == '' then refuse('checkpoint.every: needs checkpoint.dir') end
  if k.async and k.dir == '' then refuse('checkpoint.async: needs checkpoint.dir') end
  if k.keep > 0 and k.dir == '' then refuse('checkpoint.keep: needs checkpoint.dir') end
  if k.resume == 'auto' and k.dir == '' then refuse("checkpoint.resume = 'auto': needs checkpoint.dir (where to look)") end
  -- the device, without touching it
  if c.device ~= 'auto' and c.device ~= 'cpu' then
    if c.device ~= 'cuda' and not c.device:match('^cuda:%d+$') then
      refuse("device = %s: expected 'auto', 'cpu', 'cuda' or 'cuda:N'", c.device)
    end
    local cuda = require('dlua.cuda')
    if not cuda.is_available() then refuse('device = %s: no CUDA device available (%s)', c.device, tostring(cuda.unavailable_reason())) end
  end
  return c
end

-- amp = 'auto' on the device the rank trains on: bf16 on a GPU with bfloat16 arithmetic (compute capability
-- >= 8.0), else off: the CPU (where bf16 pays only with AVX512-BF16 or AMX, ~1.4x on our build machines, docs/nn.md;
-- opt in with amp = 'bf16'), older GPUs, a pipeline, a build without dlua.amp. Returns the setting and why, for the plan.
function M.resolve_amp(c, device)
  if c.amp ~= 'auto' then return c.amp end
  if device == 'cpu' then return 'off', 'auto: off on the CPU' end
  if c.stages and c.stages > 0 then return 'off', 'auto: off with a pipeline' end
  if not available('dlua.amp') then return 'off', 'auto: dlua.amp is not in this build' end
  local cuda = require 'dlua.cuda'
  local major, minor = cuda.get_device_capability(device)
  if major < 8 then return 'off', format('auto: %s has compute capability %d.%d, bf16 needs 8.0', device, major, minor) end
  return 'bf16', format('auto: %s supports bf16', device)
end

return M
