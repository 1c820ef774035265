-- dlua.data: IDX files, Fashion-MNIST, in-memory datasets and a batch iterator whose order is a function of (seed, epoch).
local dlua = require 'dlua'
local binding = require 'bindings.data'

local data = {}
local format, floor, ceil = string.format, math.floor, math.ceil

-- Errors raised in the bindings under one of our functions carry our line; re-raise them at
-- the line of the user code that called the public function (`level` as for error()).
local function reraise(level, msg)
  if type(msg) == 'string' then msg = msg:gsub('^[^:\n]+:%d+: ', '', 1) end
  error(msg, level + 1)
end

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

local function shape(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

local function describe_value(v)
  if type(v) == 'string' then return "'" .. v .. "'" end
  return tostring(v)
end

-- Rejects option names a function does not know (a typo would otherwise be ignored).
local function check_options(op, opts, allowed, level)
  if opts == nil then return {} end
  if type(opts) ~= 'table' then fail(level + 1, '%s: expected an options table, got %s', op, type(opts)) end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for name in pairs(allowed) do names[#names + 1] = name end
      table.sort(names)
      fail(level + 1, "%s: unknown option '%s' (expected %s)", op, tostring(k), table.concat(names, ', '))
    end
  end
  return opts
end

---------------------------------------------------------------------------------------------
-- Files

-- An IDX file (gzipped or not) as a tensor: uint8 (N, H, W) for MNIST images, (N) for labels
-- (the file's values: label files hold 0-based classes).
data.read_idx = binding.read_idx
-- An MNIST pair (images file, labels file): images uint8 (N, H, W), labels int64 (N) counted from 1.
data.read_mnist = binding.read_mnist
data.augment = binding.augment
data.normalize = binding.normalize

---------------------------------------------------------------------------------------------
-- In-memory datasets

local TensorDataset = {}
TensorDataset.__index = TensorDataset

-- TensorDataset(x, y): samples are x[i] (and y[i]), i = 1..N, N = x's first size. y may be nil.
function data.TensorDataset(x, y)
  if not dlua.is_tensor(x) then fail(2, 'TensorDataset: expected a tensor x, got %s', type(x)) end
  if x:dim() == 0 then fail(2, 'TensorDataset: x must have a first (sample) dimension, got a 0-d tensor') end
  local n = x:size(1)
  if y ~= nil then
    if not dlua.is_tensor(y) then fail(2, 'TensorDataset: expected a tensor y, got %s', type(y)) end
    if y:dim() == 0 or y:size(1) ~= n then
      fail(2, 'TensorDataset: x %s and y %s hold different numbers of samples', shape(x), shape(y))
    end
  end
  return setmetatable({ x = x, y = y, n = n }, TensorDataset)
end

function data.is_dataset(v) return getmetatable(v) == TensorDataset end

function TensorDataset:size() return self.n end

-- Sample i (1-based, negative from the end): x[i], y[i].
function TensorDataset:get(i)
  if type(i) ~= 'number' or i ~= floor(i) or i == 0 or i > self.n or i < -self.n then
    fail(2, 'TensorDataset:get: position %s out of range 1..%d', describe_value(i), self.n)
  end
  if i < 0 then i = self.n + 1 + i end
  return self.x[i], self.y and self.y[i]
end

-- Samples first .. first + count - 1 as a dataset of views (no copy).
function TensorDataset:narrow(first, count)
  if type(first) ~= 'number' or type(count) ~= 'number' or first < 1 or count < 0 or first + count - 1 > self.n then
    fail(2, 'TensorDataset:narrow: samples %s..+%s out of range 1..%d', describe_value(first), describe_value(count),
      self.n)
  end
  local r = data.TensorDataset(self.x:narrow(1, first, count), self.y and self.y:narrow(1, first, count))
  r.classes, r.mean, r.std = self.classes, self.mean, self.std
  return r
end

function TensorDataset:__tostring()
  local s = format('TensorDataset(%d samples: x %s %s', self.n, shape(self.x), self.x.dtype)
  if self.y then s = s .. format(', y %s %s', shape(self.y), self.y.dtype) end
  return s .. ')'
end

---------------------------------------------------------------------------------------------
-- Fashion-MNIST

-- Where Debian's dataset-fashion-mnist package installs the four files.
data.FASHION_MNIST_ROOT = '/usr/share/datasets/fashion-mnist'

local fashion_classes = { 'T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker',
  'Bag', 'Ankle boot' }

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end

-- `name` under root, gzipped (as Debian and the original site ship it) or already inflated.
local function find_file(root, name)
  local gz = root .. '/' .. name .. '.gz'
  if exists(gz) or not exists(root .. '/' .. name) then return gz end
  return root .. '/' .. name
end

-- FashionMNIST{root = FASHION_MNIST_ROOT, train = true}: a TensorDataset with x uint8
-- (N, 1, 28, 28) and y int64 (N) holding classes 1..10 (a file's label 0 is class 1), plus
-- `classes` (names) and the training set's pixel `mean` and `std` (on the [0, 1] scale).
function data.FashionMNIST(opts)
  local o = check_options('FashionMNIST', opts, { root = true, train = true }, 2)
  local root = o.root or data.FASHION_MNIST_ROOT
  if type(root) ~= 'string' or root == '' then fail(2, 'FashionMNIST: root must be a folder name, got %s', describe_value(root)) end
  root = root:gsub('/+$', '')
  local train = o.train
  if train == nil then train = true end
  local prefix = train and 'train' or 't10k'
  local ok, x, y = pcall(binding.read_mnist, find_file(root, prefix .. '-images-idx3-ubyte'),
    find_file(root, prefix .. '-labels-idx1-ubyte'))
  if not ok then reraise(2, x) end
  local n, h, w = x:size(1), x:size(2), x:size(3)
  local ds = data.TensorDataset(x:view(n, 1, h, w), y)
  ds.classes = fashion_classes
  -- Per-pixel statistics of the 60000 training images, x / 255 (the test spec recomputes them).
  ds.mean, ds.std = { 0.2860 }, { 0.3530 }
  return ds
end

---------------------------------------------------------------------------------------------
-- Batches

-- The sample order of an epoch: int64 positions 1..n, shuffled by (seed, epoch) when shuffle.
function data.order(n, opts)
  local o = check_options('order', opts, { seed = true, epoch = true, shuffle = true }, 2)
  local ok, r = pcall(binding.order, n, o.seed or 0, o.epoch or 1, o.shuffle ~= false)
  if not ok then reraise(2, r) end
  return r
end

local function dataset_size(op, ds, level)
  if dlua.is_tensor(ds) then return ds:size(1) end
  if type(ds) == 'table' and dlua.is_tensor(ds.x) then return ds.x:size(1) end
  if type(ds) == 'number' and ds >= 0 and ds == floor(ds) then return ds end
  fail(level + 1, '%s: expected a dataset (with tensors x and y), got %s', op, type(ds))
end

local function batch_size(op, b, level)
  if type(b) ~= 'number' or b ~= floor(b) or b < 1 then
    fail(level + 1, '%s: batch must be a positive integer, got %s', op, describe_value(b))
  end
  return b
end

-- How many batches an epoch of `ds` (a dataset or a sample count) makes.
function data.num_batches(ds, opts)
  local o = check_options('num_batches', opts, { batch = true, drop_last = true, shuffle = true, seed = true,
    epoch = true, augment = true, mean = true, std = true, scale = true, dtype = true }, 2)
  local n, b = dataset_size('num_batches', ds, 2), batch_size('num_batches', o.batch, 2)
  return o.drop_last and floor(n / b) or ceil(n / b)
end

local batch_options = { batch = true, shuffle = true, seed = true, epoch = true, drop_last = true, augment = true,
  mean = true, std = true, scale = true, dtype = true }

-- for i, x, y in data.batches(ds, opts) do ... end: batch i (1-based) of the epoch.
-- opts: batch (required), shuffle (false), seed (0), epoch (1), drop_last (false),
-- augment = {crop_pad = p, flip = true} (images (N, C, H, W) only), mean/std (numbers or
-- per-channel lists), scale (default 1/255 for uint8 data), dtype ('float32'; 'uint8' keeps
-- raw pixels, without normalisation). The order and the augmentation are functions of
-- (seed, epoch): the same pair replays an epoch exactly, whatever the thread count.
function data.batches(ds, opts)
  local o = check_options('batches', opts, batch_options, 2)
  local n = dataset_size('batches', ds, 2)
  if type(ds) == 'number' or dlua.is_tensor(ds) then fail(2, 'batches: expected a dataset, got %s', type(ds)) end
  local b = batch_size('batches', o.batch, 2)
  local x, y = ds.x, ds.y
  local seed, epoch = o.seed or 0, o.epoch or 1
  local order
  local ok, err = pcall(function() order = binding.order(n, seed, epoch, o.shuffle) end)
  if not ok then reraise(2, err) end

  local dtype = o.dtype or 'float32'
  local raw = dtype == 'uint8' or dtype == 'byte' or dtype == 'u8'
  if raw and (o.mean ~= nil or o.std ~= nil or o.scale ~= nil) then
    fail(2, "batches: dtype 'uint8' keeps raw pixels: mean, std and scale need a floating dtype")
  end
  if raw and x.dtype ~= 'uint8' then fail(2, "batches: dtype 'uint8' needs uint8 data, got x %s", x.dtype) end
  if not raw and dtype ~= 'float32' and dtype ~= 'float' and dtype ~= 'f32' then
    fail(2, "batches: dtype must be 'float32' or 'uint8', got %s", describe_value(dtype))
  end
  local aug = o.augment
  local pad, flip = 0, false
  if aug ~= nil and aug ~= false then
    aug = check_options('batches: augment', aug, { crop_pad = true, flip = true }, 2)
    pad, flip = aug.crop_pad or 0, aug.flip or false
    if x:dim() ~= 4 then
      fail(2, 'batches: augment needs images (N, C, H, W), got x %s', shape(x))
    end
  end
  local is_u8 = x.dtype == 'uint8'
  local scale = o.scale or ((is_u8 and not raw) and 1 / 255 or 1)
  local mean, std = o.mean or 0, o.std or 1
  local normalize = not raw and (o.mean ~= nil or o.std ~= nil or scale ~= 1)
  -- Per-channel statistics must fit x's channels: say so now, naming the dataset's shape.
  for _, p in ipairs({ { 'mean', mean }, { 'std', std } }) do
    local v = p[2]
    if type(v) == 'table' and #v ~= 1 and (x:dim() < 2 or #v ~= x:size(2)) then
      fail(2, 'batches: %s has %d values for x %s (expected 1 or one per channel, dimension 2)', p[1], #v, shape(x))
    end
  end
  local images = x:dim() == 4 and (is_u8 or x.dtype == 'float32')
  local nb = o.drop_last and floor(n / b) or ceil(n / b)

  local i = 0
  return function()
    i = i + 1
    if i > nb then return nil end
    local first = (i - 1) * b + 1
    local count = math.min(b, n - first + 1)
    local idx = order:narrow(1, first, count)
    local bx
    local ok2, e2 = pcall(function()
      if images then
        -- Gather, crop and flip in one pass, straight into float32 when normalising.
        local out = nil
        if not raw then
          local s = x:size()
          s[1] = count
          out = dlua.empty(s, { dtype = 'float32' })
        end
        bx = binding.augment(x, { index = idx, crop_pad = pad, flip = flip, seed = seed, epoch = epoch, out = out })
      else
        bx = x:index_select(1, idx)
        if not raw and bx.dtype ~= 'float32' then bx = bx:float() end
      end
      if normalize then
        bx = binding.normalize(bx, mean, std, { scale = scale, out = bx.dtype == 'float32' and bx or nil })
      end
    end)
    if not ok2 then reraise(2, e2) end
    return i, bx, y and y:index_select(1, idx)
  end
end

return data
