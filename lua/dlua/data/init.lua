-- dlua.data: IDX files, Fashion-MNIST, in-memory datasets, batches, image folders, transforms, samplers and the threaded DataLoader.
local dlua = require 'dlua'
local binding = require 'bindings.data'

local U = require 'dlua.data.util'
require 'dlua.data.files'       -- read_idx, read_mnist, read_image, write_jpeg, write_png
require 'dlua.data.batches'     -- order, num_batches, batches, augment, normalize
local T = require 'dlua.data.transforms'  -- RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip, Normalize, ToTensor, Compose
local D = require 'dlua.data.datasets'    -- TensorDataset, FashionMNIST, ImageFolder, Synthetic

local data = U.data
local format, floor, ceil = string.format, math.floor, math.ceil
local reraise, fail, describe_value, check_options = U.reraise, U.fail, U.describe_value, U.check_options
local dataset_size, batch_size = U.dataset_size, U.batch_size
local ImageFolder, Synthetic, Compose, pipeline_of = D.ImageFolder, D.Synthetic, T.Compose, T.pipeline_of

---------------------------------------------------------------------------------------------
-- Samplers

local DistributedSampler = {}
DistributedSampler.__index = DistributedSampler

local function dist_defaults()
  local dist = package.loaded['dlua.dist']
  if type(dist) == 'table' and type(dist.is_initialized) == 'function' and dist.is_initialized() then
    local ws = dist.world_size or dist.get_world_size
    local rk = dist.rank or dist.get_rank
    if type(ws) == 'function' and type(rk) == 'function' then return ws(), rk() end
  end
  return 1, 0
end

-- DistributedSampler{n = or dataset =, num_replicas =, rank =, shuffle = true, seed = 0,
-- drop_last = false}: torch's semantics. Every rank orders 1..n the same way (a function of
-- (seed, epoch)), pads by wrapping around to a multiple of num_replicas (or drops the tail
-- with drop_last) and takes positions rank+1, rank+1+num_replicas, ... num_replicas and
-- rank (0-based, as torch's) default to dlua.dist's world size and rank once it is initialised.
function data.DistributedSampler(opts)
  local o = check_options('DistributedSampler', opts, { n = true, dataset = true, num_replicas = true, rank = true,
    shuffle = true, seed = true, drop_last = true }, 2)
  local n = o.n
  if n == nil and o.dataset ~= nil then
    local ds = o.dataset
    if type(ds) == 'table' and type(ds.n) == 'number' then n = ds.n else n = dataset_size('DistributedSampler', ds, 2) end
  end
  if type(n) ~= 'number' or n < 0 or n ~= floor(n) then
    fail(2, 'DistributedSampler: n must be a non-negative integer (or give dataset =), got %s', describe_value(n))
  end
  local dr, dk = dist_defaults()
  local R, rank = o.num_replicas or dr, o.rank or dk
  if type(R) ~= 'number' or R < 1 or R ~= floor(R) then
    fail(2, 'DistributedSampler: num_replicas must be a positive integer, got %s', describe_value(R))
  end
  if type(rank) ~= 'number' or rank < 0 or rank >= R or rank ~= floor(rank) then
    fail(2, 'DistributedSampler: rank must be in 0..%d (0-based, as torch), got %s', R - 1, describe_value(rank))
  end
  local drop_last = o.drop_last and true or false
  local num_samples
  if drop_last and n % R ~= 0 then num_samples = ceil((n - R) / R) else num_samples = ceil(n / R) end
  if num_samples < 0 then num_samples = 0 end
  return setmetatable({ n = n, num_replicas = R, rank = rank, shuffle = o.shuffle ~= false, seed = o.seed or 0,
    drop_last = drop_last, num_samples = num_samples, total_size = num_samples * R, epoch = 1 }, DistributedSampler)
end

function DistributedSampler:set_epoch(e)
  if type(e) ~= 'number' or e ~= floor(e) or e < 0 then fail(2, 'set_epoch: epoch must be a non-negative integer, got %s', describe_value(e)) end
  if e ~= self.epoch then self.consumed, self.resume = 0, nil end
  self.epoch = e
end

function DistributedSampler:len() return self.num_samples end

-- This rank's sample indices (int64, 1-based) for `epoch` (default: the one set_epoch gave).
-- In the epoch a checkpoint resumed, when its cursor does not fall on a multiple of the ranks
-- (another world size), the rest of the epoch's order, split over these ranks.
function DistributedSampler:indices(epoch)
  epoch = epoch or self.epoch
  local order = data.order(self.n, { seed = self.seed, epoch = epoch, shuffle = self.shuffle })
  local pos, R, n = {}, self.num_replicas, self.n
  local r, first, count = self.resume, 0, self.num_samples
  if r and r.epoch == epoch and r.consumed % R ~= 0 then
    local left = math.max(self.total_size - r.consumed, 0)
    first, count = r.consumed, self.drop_last and floor(left / R) or ceil(left / R)
  end
  if count == 0 or n == 0 then return dlua.empty(0, { dtype = 'int64' }) end
  for k = 0, count - 1 do pos[k + 1] = (first + self.rank + k * R) % n + 1 end
  return order:index_select(1, dlua.tensor(pos, { dtype = 'int64' }))
end

-- Checkpoints (dlua.ckpt). The cursor is global: the samples of the epoch consumed by all ranks
-- (positions 1..consumed of its order), so a run resumed on another number of ranks splits the
-- rest of the epoch over them. advance(k): this rank took k more samples (every rank does).
function DistributedSampler:advance(k) self.consumed = (self.consumed or 0) + k * self.num_replicas end
function DistributedSampler:state_dict()
  return { epoch = self.epoch, consumed = self.consumed or 0, n = self.n, num_replicas = self.num_replicas, seed = self.seed,
    shuffle = self.shuffle, drop_last = self.drop_last }
end
function DistributedSampler:load_state_dict(sd)
  for _, k in ipairs({ 'n', 'seed', 'shuffle' }) do
    if sd[k] ~= self[k] then
      fail(2, 'DistributedSampler: the checkpoint was saved with %s = %s, this sampler has %s: the data order would differ',
        k, describe_value(sd[k]), describe_value(self[k]))
    end
  end
  self.epoch, self.consumed = sd.epoch, sd.consumed
  self.resume = sd.consumed > 0 and { epoch = sd.epoch, consumed = sd.consumed } or nil
end
-- The leading samples of indices(epoch) already consumed (0 outside the resumed epoch).
function DistributedSampler:skip(epoch)
  local r = self.resume
  if r and r.epoch == (epoch or self.epoch) and r.consumed % self.num_replicas == 0 then
    return math.min(r.consumed / self.num_replicas, self.num_samples)
  end
  return 0
end

function DistributedSampler:__tostring()
  return format('DistributedSampler(n=%d, rank %d of %d, %d samples, shuffle=%s, drop_last=%s)', self.n, self.rank,
    self.num_replicas, self.num_samples, tostring(self.shuffle), tostring(self.drop_last))
end

---------------------------------------------------------------------------------------------
-- DataLoader

local DataLoader = {}
local states = setmetatable({}, { __mode = 'k' })

local loader_options = { dataset = true, batch = true, batch_size = true, shuffle = true, sampler = true,
  workers = true, num_workers = true, drop_last = true, pin_memory = true, prefetch = true, seed = true,
  dct_scaling = true, quiet = true, device = true, normalize = true }

-- Whether a transform's batches are channels-last (ToTensor{memory_format = 'channels_last'}).
local function channels_last_of(tf)
  if tf == nil then return false end
  local list = getmetatable(tf) == Compose and tf.transforms or { tf }
  for _, t in ipairs(list) do
    if t.kind == 'ToTensor' then return t.memory_format == 'channels_last' end
  end
  return false
end

-- normalize = {mean =, std =} (numbers or per-channel lists): applied where the batch lands,
-- after the copy, so uint8 batches (ToTensor{dtype = 'uint8'}) cross to the GPU at a quarter of
-- the bytes. uint8 values are scaled by 1/255 first, as ToTensor does.
local function check_normalize(v)
  if v == nil then return nil end
  if type(v) ~= 'table' then fail(3, 'DataLoader: normalize must be {mean =, std =}, got %s', describe_value(v)) end
  local mean = type(v.mean) == 'number' and { v.mean } or v.mean
  local std = type(v.std) == 'number' and { v.std } or v.std
  if type(mean) ~= 'table' or type(std) ~= 'table' or #mean == 0 or #mean ~= #std then
    fail(3, 'DataLoader: normalize needs mean and std, numbers or lists of one length, got %s and %s',
      describe_value(v.mean), describe_value(v.std))
  end
  for k = 1, #std do
    if type(mean[k]) ~= 'number' or type(std[k]) ~= 'number' or std[k] == 0 then
      fail(3, 'DataLoader: normalize entry %d needs a number mean and a non-zero std, got %s and %s', k,
        describe_value(mean[k]), describe_value(std[k]))
    end
  end
  return { mean = mean, std = std, cache = {} }
end

-- x (N, C, ...) as float32, (x [/ 255] - mean) / std per channel, on x's device, in x's memory
-- format: one multiply and one add with (C)-shaped factors made once per device and dtype. A
-- channels-last x is worked on as its (N, H, W, C) view, so the result is channels-last too.
local function normalize_batch(nm, x, channels_last)
  local u8 = x.dtype == 'uint8'
  local C = x:size(2)
  if #nm.mean ~= 1 and #nm.mean ~= C then
    fail(3, 'DataLoader: normalize has %d channels, the batch %s has %d in dimension 2', #nm.mean,
      table.concat(x:size(), 'x'), C)
  end
  local cl = channels_last and x:dim() == 4
  if cl then x = x:permute(1, 3, 4, 2) end
  local d = cl and 4 or 2
  local key = x.device .. (u8 and '/u8' or '/f') .. (cl and '/cl' or '')
  local f = nm.cache[key]
  if not f then
    local a, b, shape = {}, {}, {}
    for k = 1, #nm.mean do
      a[k] = (u8 and 1 / 255 or 1) / nm.std[k]
      b[k] = -nm.mean[k] / nm.std[k]
    end
    for k = 1, x:dim() do shape[k] = (k == d) and #a or 1 end
    f = { dlua.tensor(a):view(shape):to(x.device), dlua.tensor(b):view(shape):to(x.device) }
    nm.cache[key] = f
  end
  local y = x.dtype == 'float32' and x * f[1] or x:float():mul_(f[1])
  y:add_(f[2])
  if cl then y = y:permute(1, 4, 2, 3) end
  return y
end

local function state_of(self, op)
  local st = states[self]
  if not st then fail(3, '%s: expected a DataLoader (call it with a colon: loader:%s())', op, op) end
  if not st.handle then fail(3, '%s: the DataLoader was closed', op) end
  return st
end

-- DataLoader{dataset =, batch = 1, shuffle = false, sampler =, workers = 0, drop_last =
-- false, pin_memory = false, prefetch = 2 * max(workers, 1), seed = 0, dct_scaling = true,
-- quiet = false, device = 'cpu', normalize = nil}. device 'cuda[:n]' (or 'auto') delivers the
-- batches there: the next batch's copy runs on a copy stream while the current one trains. dataset: an ImageFolder, a Synthetic, or an in-memory dataset (tables with
-- x and y, e.g. FashionMNIST{}; its `transform` field, if any, applies to uint8 images).
-- Iterate with `for i, x, y in loader:batches() do ... end`.
function data.DataLoader(opts)
  local o = check_options('DataLoader', opts, loader_options, 2)
  local ds = o.dataset
  if ds == nil then fail(2, 'DataLoader: dataset is required') end
  local batch = o.batch or o.batch_size or 1
  batch_size('DataLoader', batch, 2)
  local workers = o.workers or o.num_workers or 0
  if type(workers) ~= 'number' or workers < 0 or workers ~= floor(workers) then
    fail(2, 'DataLoader: workers must be a non-negative integer, got %s', describe_value(workers))
  end
  local prefetch = o.prefetch or 2 * math.max(workers, 1)
  if type(prefetch) ~= 'number' or prefetch < 1 or prefetch ~= floor(prefetch) then
    fail(2, 'DataLoader: prefetch must be a positive integer (batches in flight), got %s', describe_value(prefetch))
  end
  if o.sampler ~= nil and o.shuffle then fail(2, 'DataLoader: sampler and shuffle are mutually exclusive (as in torch)') end
  local sampler = o.sampler
  if sampler ~= nil and (type(sampler) ~= 'table' or type(sampler.indices) ~= 'function' or type(sampler.len) ~= 'function') then
    fail(2, 'DataLoader: sampler must have :indices(epoch) and :len() (e.g. DistributedSampler), got %s', type(sampler))
  end
  local cfg = { batch = batch, workers = workers, prefetch = prefetch, pin_memory = o.pin_memory,
    dct_scaling = o.dct_scaling ~= false, quiet = o.quiet, seed = o.seed or 0 }
  local tf, n
  if getmetatable(ds) == ImageFolder then
    cfg.folder, tf, n = ds._folder, ds.transform, ds.n
  elseif getmetatable(ds) == Synthetic then
    cfg.synthetic, tf, n = { n = ds.n, shape = ds.shape, classes = ds.classes }, ds.transform, ds.n
  elseif type(ds) == 'table' and dlua.is_tensor(ds.x) then
    cfg.x, tf, n = ds.x, ds.transform, ds.x:size(1)
    if ds.y ~= nil then cfg.y = ds.y.dtype == 'int64' and ds.y or ds.y:long() end
  else
    fail(2, 'DataLoader: dataset must be an ImageFolder, a Synthetic or a dataset with tensors x and y, got %s', type(ds))
  end
  if tf ~= nil then cfg.pipeline = pipeline_of(tf, 2) end
  if sampler ~= nil and sampler.n ~= nil and sampler.n ~= n then
    fail(2, 'DataLoader: the sampler covers %d samples, the dataset holds %d', sampler.n, n)
  end
  local device = 'cpu'
  if o.device ~= nil then
    local okd, dv = pcall(require('dlua.cuda').resolve_device, o.device)
    if not okd then fail(2, 'DataLoader: device %s: %s', describe_value(o.device), (tostring(dv):gsub('^.-: ', ''))) end
    device = dv
  end
  local norm = check_normalize(o.normalize)
  local channels_last = channels_last_of(tf)
  local ok, handle = pcall(binding.loader_new, cfg)
  if not ok then reraise(2, handle) end
  local sample, dtype = binding.loader_sample(handle)
  local st = { handle = handle, dataset = ds, n = n, batch = batch, workers = workers, prefetch = prefetch,
    shuffle = o.shuffle and true or false, sampler = sampler, drop_last = o.drop_last and true or false,
    seed = o.seed or 0, epoch = nil, explicit = false, gen = 0, sample_shape = sample, dtype = dtype,
    pin_memory = o.pin_memory and true or false, cfg = cfg, device = device, norm = norm,
    channels_last = channels_last }
  local proxy = newproxy(true)
  local mt = getmetatable(proxy)
  mt.__index = function(_, k)
    if k == 'stats' then return st.handle and binding.loader_stats(st.handle) or nil end
    local m = DataLoader[k]
    if m ~= nil then return m end
    return st[k]
  end
  mt.__newindex = function(_, k) error(format("DataLoader: cannot set '%s' (use set_epoch)", tostring(k)), 2) end
  mt.__len = function() return DataLoader.len(proxy) end
  mt.__tostring = function()
    return format('DataLoader(%s, batch %d, %d workers, %d batches per epoch, sample (%s) %s)', tostring(ds), batch,
      workers, DataLoader.len(proxy), table.concat(sample, ', '), dtype)
  end
  states[proxy] = st
  return proxy
end

function data.is_loader(v) return states[v] ~= nil end

-- Batches per epoch (torch's len(loader)).
function DataLoader.len(self)
  local st = state_of(self, 'len')
  local n = st.sampler and st.sampler:len() or st.n
  return st.drop_last and floor(n / st.batch) or ceil(n / st.batch)
end

-- The epoch the next batches() runs (and the sampler's), as torch's sampler.set_epoch.
function DataLoader.set_epoch(self, e)
  local st = state_of(self, 'set_epoch')
  if type(e) ~= 'number' or e ~= floor(e) or e < 0 then fail(2, 'set_epoch: epoch must be a non-negative integer, got %s', describe_value(e)) end
  st.epoch, st.explicit = e, true
  if st.sampler and st.sampler.set_epoch then st.sampler:set_epoch(e) end
end

-- Ends the running epoch now (threads joined); batches() starts a new one.
function DataLoader.stop(self)
  local st = state_of(self, 'stop')
  st.gen = st.gen + 1
  binding.loader_stop(st.handle)
end

-- Frees the loader now (threads joined, buffers released once no batch uses them).
function DataLoader.close(self)
  local st = states[self]
  if st and st.handle then
    binding.loader_free(st.handle)
    st.handle = nil
  end
end

-- for i, x, y in loader:batches() do ... end: one epoch; i counts batches from 1. Without a
-- set_epoch call since the last epoch, the epoch number advances by itself (1, 2, ...), so
-- the order and the augmentation change every epoch. Breaking out of the loop stops the
-- workers when the iterator is collected (or call loader:stop()); an error or Ctrl-C
-- stops them at once.
function DataLoader.batches(self)
  local st = state_of(self, 'batches')
  local epoch
  if st.explicit then
    epoch, st.explicit = st.epoch, false
  else
    epoch = (st.epoch or 0) + 1
    st.epoch = epoch
    if st.sampler and st.sampler.set_epoch then st.sampler:set_epoch(epoch) end
  end
  local ok, err = pcall(function()
    local order
    if st.sampler then
      order = st.sampler:indices(epoch)
      if type(order) == 'table' then order = dlua.tensor(order, { dtype = 'int64' }) end
      local skip = st.sampler.skip and st.sampler:skip(epoch) or 0  -- a resumed epoch (dlua.ckpt)
      if skip > 0 then order = order:narrow(1, skip + 1, order:size(1) - skip) end
    else
      order = binding.order(st.n, st.seed, epoch, st.shuffle)
    end
    binding.loader_start(st.handle, order, epoch, st.drop_last)
  end)
  if not ok then reraise(2, err) end
  st.gen = st.gen + 1
  local gen, handle = st.gen, st.handle
  -- Collected with the iterator (a loop left by break): stop this epoch's workers.
  local guard = newproxy(true)
  getmetatable(guard).__gc = function()
    if st.gen == gen and st.handle then binding.loader_stop(st.handle) end
  end
  local norm, cl = st.norm, st.channels_last
  if st.device == 'cpu' then
    return function()
      local _ = guard
      if st.gen ~= gen or not st.handle then return nil end
      local ok2, x, y, b = pcall(binding.loader_next, handle)
      if not ok2 then reraise(2, x) end
      if x == nil then return nil end
      if norm then x = normalize_batch(norm, x, cl) end
      return b, x, y
    end
  end
  -- On a GPU: batch i + 1 is copied on st.stream (allocated there) while batch i trains. The
  -- compute stream waits for the copy's event, the batch's memory is marked as used by the
  -- compute stream (record_stream), and the host batch is kept until its copy has run. A
  -- channels-last batch crosses as its (N, H, W, C) bytes (a contiguous view: no host copy) and
  -- is channels-last on the device too.
  local cuda = require 'dlua.cuda'
  local dev = st.device
  local ord = tonumber(dev:match('%d+$'))
  st.stream = st.stream or cuda.Stream(ord)
  local function issue()
    if st.gen ~= gen or not st.handle then return nil end
    local ok2, hx, hy, b = pcall(binding.loader_next, handle)
    if not ok2 then reraise(3, hx) end
    if hx == nil then return nil end
    local nb = { non_blocking = true }
    local x, y = cuda.with_stream(st.stream, function()
      if cl and hx:dim() == 4 then return hx:permute(1, 3, 4, 2):to(dev, nb):permute(1, 4, 2, 3), hy:to(dev, nb) end
      return hx:to(dev, nb), hy:to(dev, nb)
    end)
    local ev = cuda.Event { device = ord }
    ev:record(st.stream)
    return { hx = hx, hy = hy, x = x, y = y, ev = ev, b = b }
  end
  local nxt, cur = issue(), nil
  return function()
    local _ = guard
    local c = nxt
    if c == nil or st.gen ~= gen then return nil end
    nxt = issue()
    local compute = cuda.current_stream(ord)
    c.ev:wait(compute)
    cuda.record_stream(c.x, compute)
    cuda.record_stream(c.y, compute)
    if cur then cur.ev:synchronize() end -- the previous host batch may go back to the loader now
    cur = c
    local x = norm and normalize_batch(norm, c.x, cl) or c.x
    return c.b, x, c.y
  end
end

return data
