-- The Lua face of the data C API: IDX files, sample order, batch augmentation, image decoding, ImageFolder, transforms, the threaded loader.
local core = require 'bindings.tensor_core'
local create = require 'bindings.tensor_create'
local capi = require 'bindings.capi'
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

---------------------------------------------------------------------------------------------
-- The image pipeline: decoding, ImageFolder lists, transforms, the threaded loader

local out_folder = ffi.new('dlua_folder_t *[1]')
local out_pipe = ffi.new('dlua_pipeline_t *[1]')
local out_loader = ffi.new('dlua_loader_t *[1]')
local out_x = ffi.new('dlua_tensor_t *[1]')
local out_y = ffi.new('dlua_tensor_t *[1]')
local out_b = ffi.new('int64_t[1]')

local function check(st, op)
  if st ~= 0 then core.check(st, op) end
end

-- A JPEG/PNG file as uint8 (H, W, 3); scale = {num, den} decodes a JPEG at a DCT scale.
function M.image_read(path, scale)
  local num, den = 1, 0
  if scale ~= nil then num, den = scale[1], scale[2] end
  return new('image_read', C.dlua_image_read, 3, path_arg('image_read', path), num, den)
end

-- Decodes JPEG/PNG bytes held in a Lua string.
function M.image_decode(bytes, scale)
  if type(bytes) ~= 'string' then raise('image_decode: expected the file bytes as a string, got ' .. type(bytes)) end
  local num, den = 1, 0
  if scale ~= nil then num, den = scale[1], scale[2] end
  return new('image_decode', C.dlua_image_decode, 4, bytes, #bytes, num, den)
end

function M.image_write_jpeg(img, path, quality)
  core.call('image_write_jpeg', C.dlua_image_write_jpeg, 3, core.handle('write_jpeg', img, 'the image'),
    path_arg('image_write_jpeg', path), quality or 90)
end

function M.image_write_png(img, path)
  core.call('image_write_png', C.dlua_image_write_png, 2, core.handle('write_png', img, 'the image'),
    path_arg('image_write_png', path))
end

-- An ImageFolder's file list: a cdata handle freed by the GC. cache_dir: nil (default), '' (off) or a folder.
function M.folder_open(root, cache_dir)
  out_folder[0] = nil
  check(C.dlua_folder_open(out_folder, path_arg('ImageFolder', root, 'a folder name'), cache_dir), 'ImageFolder')
  local f = ffi.gc(out_folder[0], C.dlua_folder_free)
  out_folder[0] = nil
  return f
end

function M.folder_info(f)
  local classes = {}
  for c = 0, C.dlua_folder_num_classes(f) - 1 do classes[c + 1] = ffi.string(C.dlua_folder_class(f, c)) end
  return {
    n = tonumber(C.dlua_folder_size(f)),
    classes = classes,
    root = ffi.string(C.dlua_folder_root(f)),
    cached = C.dlua_folder_cached(f) ~= 0,
    cache_path = capi.string(C.dlua_folder_cache_path(f)),
  }
end

-- File i (1-based) of the list: its path relative to the root and its class (1-based).
function M.folder_entry(f, i)
  local p = C.dlua_folder_file(f, i - 1)
  if p == nil then return nil end
  return ffi.string(p), C.dlua_folder_label(f, i - 1) + 1
end

local kinds = { RandomResizedCrop = C.DLUA_TF_RANDOM_RESIZED_CROP, Resize = C.DLUA_TF_RESIZE,
  CenterCrop = C.DLUA_TF_CENTER_CROP, RandomHorizontalFlip = C.DLUA_TF_HFLIP, Normalize = C.DLUA_TF_NORMALIZE,
  ToTensor = C.DLUA_TF_TO_TENSOR }

-- A compiled transform list from specs {kind = 'Resize', h =, w =, ...} (see dlua.h).
function M.pipeline(specs)
  local n = #specs
  local ops = ffi.new('dlua_transform_t[?]', math.max(n, 1))
  for k, t in ipairs(specs) do
    local o = ops[k - 1]
    o.kind = kinds[t.kind]
    o.h, o.w = t.h or 0, t.w or 0
    if t.scale then o.scale[0], o.scale[1] = t.scale[1], t.scale[2] end
    if t.ratio then o.ratio[0], o.ratio[1] = t.ratio[1], t.ratio[2] end
    o.p = t.p or 0
    if t.mean then
      o.n = #t.mean
      for c = 1, math.min(#t.mean, 4) do o.mean[c - 1], o.std[c - 1] = t.mean[c], t.std[c] end
    end
    o.layout = t.layout == 'nhwc' and 1 or 0
    o.dtype = t.dtype == 'uint8' and C.DLUA_DTYPE_U8 or C.DLUA_DTYPE_F32
  end
  out_pipe[0] = nil
  check(C.dlua_pipeline_new(out_pipe, ops, n), 'Compose')
  local p = ffi.gc(out_pipe[0], C.dlua_pipeline_free)
  out_pipe[0] = nil
  return p
end

-- The transforms applied to one image (H, W, C) uint8, as sample `index` (1-based) of `epoch`.
function M.pipeline_apply(p, img, seed, epoch, index)
  return new('transform', C.dlua_pipeline_apply, 5, p, core.handle('transform', img, 'the image'),
    u64('transform', 'seed', seed, 0),
    u64('transform', 'epoch', epoch, 1), index - 1)
end

-- The crop box (top, left, height, width; top/left 1-based) RandomResizedCrop draws.
function M.rrc_box(scale, ratio, h, w, seed, epoch, index, position)
  local sc, ra, box = ffi.new('double[2]', scale), ffi.new('double[2]', ratio), ffi.new('int[4]')
  C.dlua_transform_rrc_box(sc, ra, h, w, u64('rrc_box', 'seed', seed, 0), u64('rrc_box', 'epoch', epoch, 1),
    index - 1, position - 1, box)
  return { box[0] + 1, box[1] + 1, box[2], box[3] }
end

function M.flip_draw(p, seed, epoch, index, position)
  return C.dlua_transform_flip_draw(p, u64('flip_draw', 'seed', seed, 0), u64('flip_draw', 'epoch', epoch, 1),
    index - 1, position - 1) ~= 0
end

-- The loader handle (freed, threads joined, by the GC or loader_free). cfg: folder, x, y,
-- synthetic = {n =, shape =, classes =}, pipeline, batch, workers, prefetch, pin_memory,
-- dct_scaling, quiet, seed.
function M.loader_new(cfg)
  local c = ffi.new('dlua_loader_config_t')
  c.folder = cfg.folder
  if cfg.x ~= nil then c.x = core.handle('DataLoader', cfg.x, 'x') end
  if cfg.y ~= nil then c.y = core.handle('DataLoader', cfg.y, 'y') end
  if cfg.synthetic then
    c.synthetic_n = cfg.synthetic.n
    for k = 1, 3 do c.synthetic_shape[k - 1] = cfg.synthetic.shape[k] end
    c.synthetic_classes = cfg.synthetic.classes
  end
  c.pipeline = cfg.pipeline
  c.batch, c.workers, c.prefetch = cfg.batch, cfg.workers, cfg.prefetch
  c.pin_memory = cfg.pin_memory and 1 or 0
  c.dct_scaling = cfg.dct_scaling and 1 or 0
  c.quiet = cfg.quiet and 1 or 0
  c.seed = u64('DataLoader', 'seed', cfg.seed, 0)
  c.label_base = 1
  out_loader[0] = nil
  local st = C.dlua_loader_new(out_loader, c)
  if st == C.DLUA_ERR_OOM then
    core.full_gc()
    st = C.dlua_loader_new(out_loader, c)
  end
  check(st, 'DataLoader')
  local l = ffi.gc(out_loader[0], C.dlua_loader_free)
  out_loader[0] = nil
  core.keepalive(cfg.x, 'DataLoader')
  core.keepalive(cfg.y, 'DataLoader')
  return l
end

-- Frees now (threads joined); the handle must not be used afterwards.
function M.loader_free(l)
  ffi.gc(l, nil)
  C.dlua_loader_free(l)
end

-- The sizes of one sample and the batch dtype name.
function M.loader_sample(l)
  local sz, dt = ffi.new('int64_t[8]'), ffi.new('int[1]')
  local n = C.dlua_loader_sample_shape(l, sz, dt)
  local r = {}
  for d = 1, n do r[d] = tonumber(sz[d - 1]) end
  return r, core.dtype_names[dt[0]]
end

-- Starts an epoch over `order` (int64 tensor of 1-based sample indices).
function M.loader_start(l, order, epoch, drop_last)
  local o = core.handle('DataLoader', order, 'the sample order')
  if core.dtype_of(o) ~= core.I64 or C.dlua_tensor_is_contiguous(o) == 0 or C.dlua_tensor_ndim(o) ~= 1 then
    order = order:contiguous():long()
    o = core.handle('DataLoader', order)
  end
  check(C.dlua_loader_start(l, ffi.cast('const int64_t *', C.dlua_tensor_data(o)), C.dlua_tensor_numel(o), 1,
    u64('DataLoader', 'epoch', epoch, 1), drop_last and 1 or 0), 'DataLoader')
  core.keepalive(order, 'DataLoader')
end

-- The next batch: x, y (or nil), its 1-based position; nil at the end of the epoch.
function M.loader_next(l)
  out_x[0], out_y[0] = nil, nil
  local st = C.dlua_loader_next(l, out_x, out_y, out_b)
  if st ~= 0 then
    C.dlua_loader_stop(l)  -- an error, Ctrl-C: the workers stop before the error travels
    core.check(st, 'DataLoader')
  end
  local px, py = out_x[0], out_y[0]
  out_x[0], out_y[0] = nil, nil
  if px == nil then return nil end
  local x = core.wrap(px)
  local y = py ~= nil and core.wrap(py) or nil
  return x, y, tonumber(out_b[0]) + 1
end

function M.loader_stop(l) C.dlua_loader_stop(l) end

function M.loader_stats(l)
  local s = ffi.new('dlua_loader_stats_t')
  C.dlua_loader_get_stats(l, s)
  local bad = {}
  for i = 0, tonumber(s.bad_files) - 1 do
    local m = C.dlua_loader_bad_file(l, i)
    if m == nil then break end
    bad[#bad + 1] = ffi.string(m)
  end
  return {
    samples = tonumber(s.samples), batches = tonumber(s.batches), decoded = tonumber(s.decoded),
    skipped = tonumber(s.skipped), bad_files = tonumber(s.bad_files), dct_scaled = tonumber(s.dct_scaled),
    buffers = tonumber(s.buffers), wait_s = s.wait_s, work_s = s.work_s, threads = s.threads,
    epoch_active = s.epoch_active ~= 0, bad = bad,
  }
end

function M.live_threads() return C.dlua_loader_live_threads() end

return M
