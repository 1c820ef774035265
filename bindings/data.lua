-- The Lua face of the data C API: IDX files, the (seed, epoch) sample order, batch augmentation and normalisation.
local core = require 'bindings.tensor_core'
local create = require 'bindings.tensor_create'
local ffi, C = core.ffi, core.C
local raise, new, new2 = core.raise, core.new, core.new2
local format = string.format

local M = {}

local function is_int(v) return core.is_int(v) end

local function describe_value(v)
  if type(v) == 'string' then return "'" .. v .. "'" end
  return tostring(v)
end

-- A seed or epoch: a non-negative integer (a Lua number, or a 64-bit cdata for seeds past 2^53).
local function u64(op, what, v, default)
  if v == nil then return default end
  if type(v) == 'cdata' and (ffi.istype('uint64_t', v) or (ffi.istype('int64_t', v) and v >= 0)) then
    return ffi.cast('uint64_t', v)
  end
  if not is_int(v) or v < 0 or v >= 2 ^ 64 then
    raise(format('%s: %s must be a non-negative integer, got %s', op, what, describe_value(v)))
  end
  return v
end
M.u64 = u64

local function path_arg(op, path, what)
  if type(path) ~= 'string' or path == '' then
    raise(format('%s: expected %s as a non-empty string, got %s', op, what or 'a file name', describe_value(path)))
  end
  return path
end

---------------------------------------------------------------------------------------------
-- Files

-- An IDX file (gzipped or not) as a tensor of its dims and type (uint8 for MNIST's files).
function M.read_idx(path)
  return new('read_idx', C.dlua_data_read_idx, 1, path_arg('read_idx', path))
end

-- An MNIST image/label pair: images uint8 (N, H, W), labels int64 (N) counted from 1.
function M.read_mnist(images_path, labels_path)
  return new2('read_mnist', C.dlua_data_read_mnist, 3, path_arg('read_mnist', images_path, 'the images file'),
    path_arg('read_mnist', labels_path, 'the labels file'), 1)
end

---------------------------------------------------------------------------------------------
-- Sample order

-- Offsets are counted in Philox blocks; epochs start 2^32 blocks apart, so one epoch's
-- permutation can never reach into the next one's stream (n < 2^34 samples).
local EPOCH_STRIDE = 0x100000000ULL

-- The positions 1..n in the order of epoch `epoch` (int64): a permutation drawn by
-- dlua.randperm from a Generator(seed) whose offset is set by the epoch, or 1..n in order
-- when shuffle is false. A function of (n, seed, epoch) alone.
function M.order(n, seed, epoch, shuffle)
  if not is_int(n) or n < 0 then raise(format('order: n must be a non-negative integer, got %s', describe_value(n))) end
  if not shuffle then return create.arange(1, n + 1, { dtype = 'int64' }) end
  local g = create.Generator(u64('order', 'seed', seed, 0))
  g:set_offset(EPOCH_STRIDE * ffi.cast('uint64_t', u64('order', 'epoch', epoch, 1)))
  return create.randperm(n, { generator = g })
end

---------------------------------------------------------------------------------------------
-- Augmentation and normalisation

local augment_opts = { crop_pad = true, flip = true, seed = true, epoch = true, index = true, out = true }

-- Random crop with zero padding and random horizontal flip of images x (N, C, H, W), uint8 or
-- float32; each sample's crop and flip are a function of (seed, epoch, its index in x).
-- opts: crop_pad (0), flip (false; true means probability 0.5, or a probability), seed (0),
-- epoch (1), index (positions in x counted from 1: the batch to gather; default all of x),
-- out (a tensor to write: float32 from uint8 converts on the way).
function M.augment(x, opts)
  local o = core.options('augment', opts, augment_opts)
  local pad = o.crop_pad or 0
  if not is_int(pad) or pad < 0 then
    raise(format('augment: crop_pad must be a non-negative integer, got %s', describe_value(pad)))
  end
  local flip = o.flip
  if flip == nil or flip == false then
    flip = 0
  elseif flip == true then
    flip = 0.5
  elseif type(flip) ~= 'number' or not (flip >= 0 and flip <= 1) then
    raise(format('augment: flip must be a boolean or a probability in [0, 1], got %s', describe_value(flip)))
  end
  local index = o.index
  if type(index) == 'table' then index = create.tensor(index, { dtype = 'int64' }) end
  if index ~= nil then core.handle('augment', index, 'index') end
  local seed, epoch = u64('augment', 'seed', o.seed, 0), u64('augment', 'epoch', o.epoch, 1)
  if o.out ~= nil then
    return core.into('augment', o.out, C.dlua_data_augment, 7, x, index, 1, pad, flip, seed, epoch)
  end
  return new('augment', C.dlua_data_augment, 7, x, index, 1, pad, flip, seed, epoch)
end

-- A number or a list of numbers as a double array and its length.
local function stats(op, what, v)
  if type(v) == 'number' then v = { v } end
  if type(v) ~= 'table' or #v == 0 then
    raise(format('%s: %s must be a number or a list of numbers, got %s', op, what, describe_value(v)))
  end
  local arr = ffi.new('double[?]', #v)
  for k = 1, #v do
    if type(v[k]) ~= 'number' then
      raise(format('%s: %s[%d] must be a number, got %s', op, what, k, describe_value(v[k])))
    end
    arr[k - 1] = v[k]
  end
  return arr, #v
end

local normalize_opts = { scale = true, out = true }

-- (x * scale - mean[c]) / std[c] over channels along dimension 2 of x (N, C, ...), as float32.
-- mean and std: numbers or lists of one value per channel. opts.scale defaults to 1/255 for
-- uint8 x (pixels become [0, 1] first, as torchvision's ToTensor does) and 1 otherwise;
-- opts.out: a tensor to write (x itself for float32 x, in place).
function M.normalize(x, mean, std, opts)
  local o = core.options('normalize', opts, normalize_opts)
  local p = core.handle('normalize', x)
  local scale = o.scale
  if scale == nil then scale = core.dtype_of(p) == core.U8 and 1 / 255 or 1 end
  if type(scale) ~= 'number' then raise('normalize: scale must be a number, got ' .. describe_value(scale)) end
  local m, nm = stats('normalize', 'mean', mean)
  local s, ns = stats('normalize', 'std', std)
  if nm ~= ns then
    raise(format('normalize: mean has %d values but std has %d', nm, ns))
  end
  if o.out ~= nil then
    return core.into('normalize', o.out, C.dlua_data_normalize, 5, x, scale, nm, m, s)
  end
  return new('normalize', C.dlua_data_normalize, 5, x, scale, nm, m, s)
end

return M
