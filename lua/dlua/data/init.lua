-- dlua.data: IDX files, Fashion-MNIST, in-memory datasets, batches, image folders, transforms, samplers and the threaded DataLoader.
local dlua = require 'dlua'
local binding = require 'bindings.data'

local U = require 'dlua.data.util'

local data = U.data
local format, floor, ceil = string.format, math.floor, math.ceil
local reraise, fail, shape, describe_value, check_options = U.reraise, U.fail, U.shape, U.describe_value, U.check_options
local dataset_size, batch_size = U.dataset_size, U.batch_size

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
-- Batches

-- The sample order of an epoch: int64 positions 1..n, shuffled by (seed, epoch) when shuffle.
function data.order(n, opts)
  local o = check_options('order', opts, { seed = true, epoch = true, shuffle = true }, 2)
  local ok, r = pcall(binding.order, n, o.seed or 0, o.epoch or 1, o.shuffle ~= false)
  if not ok then reraise(2, r) end
  return r
end

-- How many batches an epoch of `ds` (a dataset or a sample count) makes.
function data.num_batches(ds, opts)
  local o = check_options('num_batches', opts, { batch = true, drop_last = true, shuffle = true, seed = true,
    epoch = true, augment = true, mean = true, std = true, scale = true, dtype = true }, 2)
  local n, b = dataset_size('num_batches', ds, 2), batch_size('num_batches', o.batch, 2)
  return o.drop_last and floor(n / b) or ceil(n / b)
end

local batch_options = { batch = true, shuffle = true, seed = true, epoch = true, drop_last = true, augment = true,
  mean = true, std = true, scale = true, dtype = true, skip = true }

-- for i, x, y in data.batches(ds, opts) do ... end: batch i (1-based) of the epoch.
-- opts: batch (required), shuffle (false), seed (0), epoch (1), drop_last (false),
-- augment = {crop_pad = p, flip = true} (images (N, C, H, W) only), mean/std (numbers or
-- per-channel lists), scale (default 1/255 for uint8 data), dtype ('float32'; 'uint8' keeps
-- raw pixels, without normalisation), skip (0: leading samples of the epoch's order already
-- consumed, for a resumed run; batch numbers go on from floor(skip / batch)). The order and the
-- augmentation are functions of (seed, epoch): the same pair replays an epoch exactly, whatever
-- the thread count.
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
  local skip = o.skip or 0
  if type(skip) ~= 'number' or skip < 0 or skip ~= floor(skip) then fail(2, 'batches: skip must be an integer >= 0, got %s', describe_value(skip)) end
  local left = math.max(n - skip, 0)
  local nb = o.drop_last and floor(left / b) or ceil(left / b)
  local base = floor(skip / b)

  local i = 0
  return function()
    i = i + 1
    if i > nb then return nil end
    local first = skip + (i - 1) * b + 1
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
    return base + i, bx, y and y:index_select(1, idx)
  end
end

---------------------------------------------------------------------------------------------
-- Images

-- A JPEG or PNG file as uint8 (H, W, 3) RGB. opts.scale = {num, den}: decode a JPEG at a
-- TurboJPEG DCT scale (1/2, 1/4, 1/8...).
function data.read_image(path, opts)
  local o = check_options('read_image', opts, { scale = true }, 2)
  local ok, r = pcall(binding.image_read, path, o.scale)
  if not ok then reraise(2, r) end
  return r
end

-- Writes img (H, W, C) uint8 as a JPEG (C = 1, 3, or 4 for CMYK); opts.quality 1..100 (90).
function data.write_jpeg(img, path, opts)
  local o = check_options('write_jpeg', opts, { quality = true }, 2)
  local ok, e = pcall(binding.image_write_jpeg, img, path, o.quality or 90)
  if not ok then reraise(2, e) end
end

-- Writes img (H, W, C) uint8 as an 8-bit PNG (C = 1 grey, 2 grey+alpha, 3 RGB, 4 RGBA).
function data.write_png(img, path)
  local ok, e = pcall(binding.image_write_png, img, path)
  if not ok then reraise(2, e) end
end

---------------------------------------------------------------------------------------------
-- Transforms (torchvision's names and semantics; run in C by the loader's threads)

local Transform = {}
Transform.__index = Transform
local Compose = {}
Compose.__index = Compose

local function size2(op, v, level)
  if type(v) == 'number' and v == floor(v) and v >= 1 then return v, v end
  if type(v) == 'table' and #v == 2 and type(v[1]) == 'number' and type(v[2]) == 'number' then return v[1], v[2] end
  fail(level + 1, '%s: size must be a positive integer or {h, w}, got %s', op, describe_value(v))
end

local function pair(op, what, v, default, level)
  if v == nil then return default end
  if type(v) ~= 'table' or #v ~= 2 or type(v[1]) ~= 'number' or type(v[2]) ~= 'number' then
    fail(level + 1, '%s: %s must be a pair {lo, hi}, got %s', op, what, describe_value(v))
  end
  return { v[1], v[2] }
end

local function transform(spec) return setmetatable(spec, Transform) end

-- A random crop of area scale * image area and aspect ratio in ratio (log-uniform), resized
-- to size (bilinear, antialiased as Pillow); 10 attempts, then the central crop.
function data.RandomResizedCrop(size, opts)
  local o = check_options('RandomResizedCrop', opts, { scale = true, ratio = true }, 2)
  local h, w = size2('RandomResizedCrop', size, 2)
  return transform { kind = 'RandomResizedCrop', h = h, w = w, scale = pair('RandomResizedCrop', 'scale', o.scale, { 0.08, 1.0 }, 2),
    ratio = pair('RandomResizedCrop', 'ratio', o.ratio, { 3 / 4, 4 / 3 }, 2) }
end

-- Resize(n): the shorter side becomes n (the other int(n * long / short)); Resize{h, w}: exactly.
function data.Resize(size)
  if type(size) == 'number' then
    if size ~= floor(size) or size < 1 then fail(2, 'Resize: size must be a positive integer, got %s', describe_value(size)) end
    return transform { kind = 'Resize', h = size, w = 0 }
  end
  local h, w = size2('Resize', size, 2)
  return transform { kind = 'Resize', h = h, w = w }
end

-- The central (h, w) window; zero padding where it is larger than the image.
function data.CenterCrop(size)
  local h, w = size2('CenterCrop', size, 2)
  return transform { kind = 'CenterCrop', h = h, w = w }
end

function data.RandomHorizontalFlip(p)
  if p == nil then p = 0.5 end
  if type(p) ~= 'number' or p < 0 or p > 1 then
    fail(2, 'RandomHorizontalFlip: p must be a probability in [0, 1], got %s', describe_value(p))
  end
  return transform { kind = 'RandomHorizontalFlip', p = p }
end

-- (x - mean[c]) / std[c] per channel, after ToTensor (numbers or lists of one per channel).
function data.Normalize(mean, std)
  if type(mean) == 'number' then mean = { mean } end
  if type(std) == 'number' then std = { std } end
  if type(mean) ~= 'table' or type(std) ~= 'table' or #mean == 0 or #mean ~= #std or #mean > 4 then
    fail(2, 'Normalize: mean and std must be numbers or lists of the same length (1..4), got %s and %s',
      describe_value(mean), describe_value(std))
  end
  return transform { kind = 'Normalize', mean = { unpack(mean) }, std = { unpack(std) } }
end

-- uint8 HWC pixels -> float32 / 255 (dtype 'uint8' keeps the raw pixels: normalise on the GPU,
-- 4x less to copy). A sample is (C, H, W) and a batch (N, C, H, W), as torchvision's; memory_format
-- 'channels_last' lays them out as (H, W, C) / (N, H, W, C) bytes with the strides that say so
-- (x:is_contiguous('channels_last')), 'contiguous' (default) row-major. layout = 'nhwc' / 'nchw'
-- are older names of the two.
local layouts = { nhwc = 'channels_last', nchw = 'contiguous' }
function data.ToTensor(opts)
  local o = check_options('ToTensor', opts, { memory_format = true, layout = true, dtype = true }, 2)
  local mf = o.memory_format
  if mf ~= nil and mf ~= 'contiguous' and mf ~= 'channels_last' then
    fail(2, "ToTensor: memory_format must be 'contiguous' or 'channels_last', got %s", describe_value(mf))
  end
  if o.layout ~= nil then
    local from = layouts[o.layout]
    if not from then fail(2, "ToTensor: layout must be 'nchw' or 'nhwc', got %s", describe_value(o.layout)) end
    if mf ~= nil and mf ~= from then
      fail(2, "ToTensor: layout %s and memory_format %s disagree (give one of them)", describe_value(o.layout),
        describe_value(mf))
    end
    mf = from
  end
  mf = mf or 'contiguous'
  local dtype = o.dtype or 'float32'
  if dtype ~= 'float32' and dtype ~= 'uint8' then fail(2, "ToTensor: dtype must be 'float32' or 'uint8', got %s", describe_value(dtype)) end
  return transform { kind = 'ToTensor', memory_format = mf, layout = mf == 'channels_last' and 'nhwc' or 'nchw',
    dtype = dtype }
end

-- Compose{t1, t2, ...}: the transforms in order (nested Compose lists are flattened).
function data.Compose(list)
  if type(list) ~= 'table' then fail(2, 'Compose: expected a list of transforms, got %s', type(list)) end
  local flat = {}
  for k, t in ipairs(list) do
    if getmetatable(t) == Compose then
      for _, u in ipairs(t.transforms) do flat[#flat + 1] = u end
    elseif getmetatable(t) == Transform then
      flat[#flat + 1] = t
    else
      fail(2, 'Compose: entry %d is not a dlua.data transform (got %s)', k, type(t))
    end
  end
  local c = setmetatable({ transforms = flat }, Compose)
  local ok, e = pcall(function() c._pipe = binding.pipeline(flat) end)
  if not ok then reraise(2, e) end
  return c
end

function data.is_transform(v) return getmetatable(v) == Transform or getmetatable(v) == Compose end

-- The compiled C pipeline of a transform or Compose.
local function pipeline_of(t, level)
  if getmetatable(t) == Compose then return t._pipe end
  if getmetatable(t) == Transform then
    if not t._pipe then
      local ok, e = pcall(function() t._pipe = binding.pipeline({ t }) end)
      if not ok then reraise(level + 1, e) end
    end
    return t._pipe
  end
  fail(level + 1, 'expected a dlua.data transform or Compose, got %s', type(t))
end

local apply_opts = { seed = true, epoch = true, index = true }

-- t(img, {seed = 0, epoch = 1, index = 1}): the transform on one image (H, W, C) uint8,
-- drawn as sample `index` of `epoch`, exactly as a DataLoader with that seed would.
local function apply(t, img, opts)
  local o = check_options('transform', opts, apply_opts, 3)
  local p = pipeline_of(t, 3)
  local ok, r = pcall(binding.pipeline_apply, p, img, o.seed or 0, o.epoch or 1, o.index or 1)
  if not ok then reraise(3, r) end
  return r
end
Transform.__call = apply
Compose.__call = apply

-- RandomResizedCrop's crop for an (h, w) image as sample `index` of `epoch` when it is the
-- first transform (torchvision's get_params): top, left (1-based), height, width.
function Transform:get_params(h, w, opts)
  if self.kind ~= 'RandomResizedCrop' then fail(2, 'get_params: only RandomResizedCrop draws a crop, this is %s', self.kind) end
  local o = check_options('get_params', opts, { seed = true, epoch = true, index = true, position = true }, 2)
  return unpack(binding.rrc_box(self.scale, self.ratio, h, w, o.seed or 0, o.epoch or 1, o.index or 1, o.position or 1))
end

function Transform:__tostring()
  local k = self.kind
  if k == 'RandomResizedCrop' then
    return format('RandomResizedCrop(%dx%d, scale=(%g, %g), ratio=(%g, %g))', self.w, self.h, self.scale[1],
      self.scale[2], self.ratio[1], self.ratio[2])
  elseif k == 'Resize' then
    return self.w == 0 and format('Resize(%d)', self.h) or format('Resize(%dx%d)', self.w, self.h)
  elseif k == 'CenterCrop' then
    return format('CenterCrop(%dx%d)', self.w, self.h)
  elseif k == 'RandomHorizontalFlip' then
    return format('RandomHorizontalFlip(p=%g)', self.p)
  elseif k == 'Normalize' then
    return format('Normalize(mean={%s}, std={%s})', table.concat(self.mean, ', '), table.concat(self.std, ', '))
  end
  return format("ToTensor(memory_format='%s', dtype='%s')", self.memory_format, self.dtype)
end

function Compose:__tostring()
  local parts = {}
  for k, t in ipairs(self.transforms) do parts[k] = '  ' .. tostring(t) end
  return 'Compose{\n' .. table.concat(parts, ',\n') .. '\n}'
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
