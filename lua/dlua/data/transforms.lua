-- dlua.data.transforms: image transforms with torchvision's names and semantics, compiled to C pipelines that the loader's threads run.
local binding = require 'bindings.data'
local U = require 'dlua.data.util'

local data = U.data
local format, floor = string.format, math.floor
local reraise, fail, describe_value, check_options = U.reraise, U.fail, U.describe_value, U.check_options

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
  local o = check_options('transform', opts, apply_opts, 2)
  local p = pipeline_of(t, 2)
  local ok, r = pcall(binding.pipeline_apply, p, img, o.seed or 0, o.epoch or 1, o.index or 1)
  if not ok then reraise(2, r) end
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

-- What the datasets and the DataLoader need (the public functions are on dlua.data).
return { Transform = Transform, Compose = Compose, pipeline_of = pipeline_of }
