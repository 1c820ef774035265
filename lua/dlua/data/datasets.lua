-- dlua.data.datasets: in-memory tensors (TensorDataset, FashionMNIST), image folders on disk (ImageFolder) and synthetic images (Synthetic).
local dlua = require 'dlua'
local binding = require 'bindings.data'
local U = require 'dlua.data.util'
local T = require 'dlua.data.transforms'

local data = U.data
local format, floor = string.format, math.floor
local reraise, fail, shape, describe_value, check_options = U.reraise, U.fail, U.shape, U.describe_value, U.check_options
local pipeline_of = T.pipeline_of

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

-- Where Debian's dataset-fashion-mnist package installs the four files (DLUA_FASHION_MNIST_ROOT: elsewhere).
data.FASHION_MNIST_ROOT = os.getenv('DLUA_FASHION_MNIST_ROOT') or '/usr/share/datasets/fashion-mnist'

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
-- Image datasets

local ImageFolder = {}
ImageFolder.__index = ImageFolder
local Synthetic = {}
Synthetic.__index = Synthetic

-- ImageFolder(root, {transform =, cache_dir =, cache = true}): root/<class>/.../<image>
-- (.jpg, .jpeg, .png), classes the sorted folder names, labels 1..#classes. The file list
-- is cached (see docs/data.md) so a large tree is scanned once.
function data.ImageFolder(root, opts)
  local o = check_options('ImageFolder', opts, { transform = true, cache_dir = true, cache = true }, 2)
  if o.transform ~= nil then pipeline_of(o.transform, 2) end
  local cache_dir = o.cache_dir
  if o.cache == false then cache_dir = '' end
  local ok, f = pcall(binding.folder_open, root, cache_dir)
  if not ok then reraise(2, f) end
  local info = binding.folder_info(f)
  local class_to_idx = {}
  for k, c in ipairs(info.classes) do class_to_idx[c] = k end
  return setmetatable({ root = info.root, classes = info.classes, class_to_idx = class_to_idx, n = info.n,
    transform = o.transform, from_cache = info.cached, cache_path = info.cache_path, _folder = f }, ImageFolder)
end

function ImageFolder:size() return self.n end

local function position(op, ds, i, level)
  if type(i) ~= 'number' or i ~= floor(i) or i < 1 or i > ds.n then
    fail(level + 1, '%s: position %s out of range 1..%d', op, describe_value(i), ds.n)
  end
end

-- The file of sample i (full path) and its class (1-based).
function ImageFolder:path(i)
  position('ImageFolder:path', self, i, 2)
  local rel, label = binding.folder_entry(self._folder, i)
  return self.root .. '/' .. rel, label
end

-- Sample i: the image through the transform (as sample i of `epoch`), and its class;
-- without a transform, the uint8 (H, W, 3) image.
function ImageFolder:get(i, opts)
  local o = check_options('ImageFolder:get', opts, { seed = true, epoch = true }, 2)
  position('ImageFolder:get', self, i, 2)
  local path, label = self:path(i)
  local ok, img = pcall(binding.image_read, path)
  if not ok then reraise(2, img) end
  if self.transform then
    ok, img = pcall(binding.pipeline_apply, pipeline_of(self.transform, 1), img, o.seed or 0, o.epoch or 1, i)
    if not ok then reraise(2, img) end
  end
  return img, label
end

function ImageFolder:__tostring()
  return format("ImageFolder('%s': %d images, %d classes%s)", self.root, self.n, #self.classes,
    self.transform and ', transform' or '')
end

-- Synthetic{shape = {C, H, W}, classes = 1000, n = 10000, transform =}: images of
-- deterministic pseudo-random pixels (a function of the loader's seed and the index) and
-- labels (i - 1) % classes + 1, for benchmarks without files. Without a transform a
-- loader gives float32 (C, H, W) in [0, 1] (ToTensor).
function data.Synthetic(opts)
  local o = check_options('Synthetic', opts, { shape = true, classes = true, n = true, transform = true }, 2)
  local shape = o.shape or { 3, 224, 224 }
  if type(shape) ~= 'table' or #shape ~= 3 then fail(2, 'Synthetic: shape must be {C, H, W}, got %s', describe_value(shape)) end
  local n, classes = o.n or 10000, o.classes or 1000
  if type(n) ~= 'number' or n < 1 or n ~= floor(n) then fail(2, 'Synthetic: n must be a positive integer, got %s', describe_value(n)) end
  if type(classes) ~= 'number' or classes < 1 or classes ~= floor(classes) then
    fail(2, 'Synthetic: classes must be a positive integer, got %s', describe_value(classes))
  end
  if o.transform ~= nil then pipeline_of(o.transform, 2) end
  return setmetatable({ shape = { shape[1], shape[2], shape[3] }, classes = classes, n = n, transform = o.transform }, Synthetic)
end

function Synthetic:size() return self.n end
function Synthetic:__tostring()
  return format('Synthetic(%d images (%s), %d classes)', self.n, table.concat(self.shape, ', '), self.classes)
end

-- The classes the DataLoader recognises (the public functions are on dlua.data).
return { TensorDataset = TensorDataset, ImageFolder = ImageFolder, Synthetic = Synthetic }
