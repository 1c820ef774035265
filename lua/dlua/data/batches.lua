-- dlua.data.batches: epoch orders and the batches of an in-memory dataset (gathered, augmented and normalised in C).
local dlua = require 'dlua'
local binding = require 'bindings.data'
local U = require 'dlua.data.util'

local data = U.data
local floor, ceil = math.floor, math.ceil
local reraise, fail, shape, describe_value, check_options = U.reraise, U.fail, U.shape, U.describe_value, U.check_options
local dataset_size, batch_size = U.dataset_size, U.batch_size

data.augment = binding.augment
data.normalize = binding.normalize

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

return data
