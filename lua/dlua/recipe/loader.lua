-- dlua.recipe.loader: batches of an in-memory dataset (Fashion-MNIST, TensorDataset) through a sampler, with nearest-neighbour Resize and grey-to-RGB.
local dlua = require 'dlua'
local data = require 'dlua.data'

local loader = {}
local format, floor = string.format, math.floor

local MemoryLoader = {}
MemoryLoader.__index = MemoryLoader

local allowed = { dataset = true, sampler = true, batch = true, drop_last = true, augment = true, mean = true, std = true,
  seed = true, size = true, channels = true, memory_format = true }

-- Positions 1..from picked for `to` outputs: output i reads input floor((i - 0.5) * from / to) + 1,
-- the centre of its cell (torch's interpolate(mode='nearest-exact')).
local function nearest(from, to)
  local pick = {}
  for i = 1, to do pick[i] = math.min(from, floor((i - 0.5) * from / to) + 1) end
  return dlua.tensor(pick, { dtype = 'int64' })
end

-- MemoryLoader{dataset =, sampler = nil, batch =, drop_last = false, augment = nil, mean =, std =,
-- seed = 0, size = nil, channels = nil, memory_format = 'contiguous'}: for i, x, y in
-- l:batches(epoch) gives this rank's batches of `dataset` (x (N, C, H, W) uint8 or float, y labels)
-- in the sampler's order for the epoch (a DistributedSampler; without one, 1..n in order), skipping
-- what a resumed checkpoint consumed. augment ({crop_pad =, flip =}) draws from (seed, epoch) as
-- data.batches does; mean/std default to the dataset's. size: the side the images are resized to
-- (nearest neighbour, a number or {h, w}); channels = 3 repeats a grey channel (an expand view, no
-- copy); memory_format 'channels_last' lays the batch out NHWC.
function loader.MemoryLoader(opts)
  if opts == nil then error('MemoryLoader: expected an options table', 2) end
  require('dlua.options').check('MemoryLoader', opts, allowed, 2)
  local ds = opts.dataset
  if type(ds) ~= 'table' or not dlua.is_tensor(ds.x) then
    error('MemoryLoader: dataset must hold tensors x and y (TensorDataset, FashionMNIST)', 2)
  end
  if type(opts.batch) ~= 'number' or opts.batch < 1 or opts.batch ~= floor(opts.batch) then
    error(format('MemoryLoader: batch must be a positive integer, got %s', tostring(opts.batch)), 2)
  end
  local x = ds.x
  if x:dim() ~= 4 and (opts.size or opts.channels) then
    error(format('MemoryLoader: size and channels need (N, C, H, W) images, the dataset holds %d-d x', x:dim()), 2)
  end
  local self = setmetatable({ dataset = ds, sampler = opts.sampler, batch = opts.batch, drop_last = opts.drop_last and true or false,
    augment = opts.augment, mean = opts.mean or ds.mean, std = opts.std or ds.std, seed = opts.seed or 0,
    memory_format = opts.memory_format or 'contiguous', epoch = 1 }, MemoryLoader)
  if self.memory_format ~= 'contiguous' and self.memory_format ~= 'channels_last' then
    error(format("MemoryLoader: memory_format must be 'contiguous' or 'channels_last', got %s", tostring(self.memory_format)), 2)
  end
  if opts.size then
    local h, w = opts.size, opts.size
    if type(opts.size) == 'table' then h, w = opts.size[1], opts.size[2] end
    if x:size(3) ~= h then self.pick_h = nearest(x:size(3), h) end
    if x:size(4) ~= w then self.pick_w = h == w and x:size(3) == x:size(4) and self.pick_h or nearest(x:size(4), w) end
    self.h, self.w = h, w
  end
  if opts.channels and opts.channels ~= (x:dim() == 4 and x:size(2) or 1) then
    if x:size(2) ~= 1 then
      error(format('MemoryLoader: channels = %d repeats a grey image; these have %d channels', opts.channels, x:size(2)), 2)
    end
    self.channels = opts.channels
  end
  return self
end

function MemoryLoader:set_epoch(e) self.epoch = e end

-- Samples this rank reads per epoch.
function MemoryLoader:samples()
  return self.sampler and self.sampler:len() or self.dataset.x:size(1)
end

-- Batches per epoch (torch's len(loader)).
function MemoryLoader:len()
  return data.num_batches(self:samples(), { batch = self.batch, drop_last = self.drop_last })
end

function MemoryLoader:_shape(x)
  if self.pick_h then x = x:index_select(3, self.pick_h) end
  if self.pick_w then x = x:index_select(4, self.pick_w) end
  if self.channels then x = x:expand({ x:size(1), self.channels, x:size(3), x:size(4) }) end
  if self.memory_format == 'channels_last' then return x:contiguous('channels_last') end
  return x:contiguous()
end

-- for i, x, y in l:batches(epoch) do ... end: i counts the epoch's batches from 1 (a resumed epoch's
-- numbers go on from the batches its checkpoint had consumed).
function MemoryLoader:batches(epoch)
  epoch = epoch or self.epoch
  local ds, skip = self.dataset, 0
  if self.sampler then
    local idx = self.sampler:indices(epoch)
    ds = data.TensorDataset(ds.x:index_select(1, idx), ds.y:index_select(1, idx))
    skip = self.sampler.skip and self.sampler:skip(epoch) or 0
  end
  local it = data.batches(ds, { batch = self.batch, drop_last = self.drop_last, seed = self.seed, epoch = epoch,
    augment = self.augment, mean = self.mean, std = self.std, skip = skip })
  return function()
    local i, x, y = it()
    if i == nil then return nil end
    return i, self:_shape(x), y
  end
end

function MemoryLoader:__tostring()
  local x = self.dataset.x
  return format('MemoryLoader(%d samples of %s, batch %d%s%s%s)', self:samples(), tostring(x:size()), self.batch,
    self.h and format(', resized to %dx%d', self.h, self.w) or '', self.channels and format(', %d channels', self.channels) or '',
    self.memory_format == 'channels_last' and ', channels-last' or '')
end

-- SubsetSampler(inner, subset): `inner` (a sampler over 1..#subset) read through `subset` (int64
-- positions of the dataset): a DistributedSampler over a fixed part of a larger dataset, with the
-- dataset's size as `n` (so a DataLoader over the whole dataset takes it). Checkpoints and the
-- resume cursor are the inner sampler's.
local SubsetSampler = {}
SubsetSampler.__index = function(t, k)
  local m = rawget(SubsetSampler, k)
  if m ~= nil then return m end
  local inner = rawget(t, 'inner')
  local v = inner[k]
  if type(v) == 'function' then return function(self, ...) return v(inner, ...) end end
  return v
end
function SubsetSampler:indices(epoch) return self.subset:index_select(1, self.inner:indices(epoch)) end
function loader.SubsetSampler(inner, subset, n) return setmetatable({ inner = inner, subset = subset, n = n }, SubsetSampler) end

return loader
