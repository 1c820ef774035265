-- dlua.data.loader: the threaded DataLoader: C worker threads, epochs and samplers, normalisation where the batch lands, copies to the GPU ahead of use.
local dlua = require 'dlua'
local binding = require 'bindings.data'
local U = require 'dlua.data.util'
local D = require 'dlua.data.datasets'
local T = require 'dlua.data.transforms'

local data = U.data
local format, floor, ceil = string.format, math.floor, math.ceil
local reraise, fail, describe_value, check_options, batch_size = U.reraise, U.fail, U.describe_value, U.check_options,
  U.batch_size
local ImageFolder, Synthetic, Compose, pipeline_of = D.ImageFolder, D.Synthetic, T.Compose, T.pipeline_of

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
