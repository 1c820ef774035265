-- dlua.data: IDX files written here, datasets, batches that cover an epoch once in an order fixed by (seed, epoch), augmentation, real Fashion-MNIST when installed.
local dlua = require 'dlua'
local data = dlua.data

local function be32(v)
  return string.char(math.floor(v / 16777216) % 256, math.floor(v / 65536) % 256, math.floor(v / 256) % 256, v % 256)
end

-- Pixel (i, y, x) of the test images (1-based i, 0-based y and x, as a file lays them out).
local function pix(i, y, x) return (7 * i + 3 * y + x) % 256 end

local function idx_images(n, h, w)
  local parts = { be32(0x803), be32(n), be32(h), be32(w) }
  for i = 1, n do
    for y = 0, h - 1 do
      local row = {}
      for x = 0, w - 1 do row[#row + 1] = string.char(pix(i, y, x)) end
      parts[#parts + 1] = table.concat(row)
    end
  end
  return table.concat(parts)
end

local function idx_labels(n)
  local parts = { be32(0x801), be32(n) }
  for i = 1, n do parts[#parts + 1] = string.char((i * 3) % 10) end
  return table.concat(parts)
end

local function write(path, bytes)
  local f = assert(io.open(path, 'wb'))
  f:write(bytes)
  f:close()
end

local tmp = os.tmpname()
os.remove(tmp)
os.execute("mkdir -p '" .. tmp .. "'")

local N, H, W = 23, 5, 4
write(tmp .. '/train-images-idx3-ubyte', idx_images(N, H, W))
write(tmp .. '/train-labels-idx1-ubyte', idx_labels(N))
write(tmp .. '/t10k-images-idx3-ubyte', idx_images(3, H, W))
write(tmp .. '/t10k-labels-idx1-ubyte', idx_labels(3))

teardown(function() os.execute("rm -rf '" .. tmp .. "'") end)

-- A dataset whose labels are the sample ids 1..n, so batches show which samples they hold.
local function id_dataset(n)
  local ds = data.FashionMNIST{ root = tmp }
  if n then ds = ds:narrow(1, n) end
  return data.TensorDataset(ds.x, dlua.arange(1, ds:size() + 1, { dtype = 'int64' }))
end

describe('dlua.data files', function()
  it('reads an IDX file as uint8 with the file dims, gzipped or not', function()
    local t = data.read_idx(tmp .. '/train-images-idx3-ubyte')
    assert.equals('uint8', t.dtype)
    assert.same({ N, H, W }, { t:size(1), t:size(2), t:size(3) })
    for _, c in ipairs({ { 1, 0, 0 }, { 2, 4, 3 }, { 23, 2, 1 } }) do
      assert.equals(pix(c[1], c[2], c[3]), t[{ c[1], c[2] + 1, c[3] + 1 }])
    end
    if os.execute("gzip -k '" .. tmp .. "/train-labels-idx1-ubyte' 2>/dev/null") == 0 then
      local l = data.read_idx(tmp .. '/train-labels-idx1-ubyte.gz')
      assert.equals(N, l:size(1))
      assert.equals(6, l[2])  -- the file's value: 2 * 3 % 10
      os.remove(tmp .. '/train-labels-idx1-ubyte.gz')
    end
  end)

  it('reports a missing or corrupt file at the caller, naming the path', function()
    local ok, err = pcall(function() local t = data.read_idx(tmp .. '/nothing.gz'); return t end)
    assert.is_false(ok)
    assert.matches('data_spec.lua:%d+: read_idx: cannot open \'[^\']*/nothing.gz\': No such file or directory', err)
    write(tmp .. '/bad', 'not an idx file')
    assert.has_error(function() data.read_idx(tmp .. '/bad') end)
    ok, err = pcall(data.read_idx, tmp .. '/bad')
    assert.matches("read_idx: '[^']*/bad' is not an IDX file: bad magic number 0x6e6f7420", err)
    ok, err = pcall(function() local d = data.FashionMNIST{ root = tmp .. '/none' }; return d end)
    assert.matches("data_spec.lua:%d+: read_mnist: cannot open '[^']*/none/train%-images%-idx3%-ubyte.gz'", err)
    assert.has_error(function() data.FashionMNIST{ root = tmp, split = 'train' } end,
      "FashionMNIST: unknown option 'split' (expected root, train)")
  end)

  it('loads Fashion-MNIST files as (N, 1, H, W) images and 1-based classes', function()
    local ds = data.FashionMNIST{ root = tmp }
    assert.equals(N, ds:size())
    assert.same({ N, 1, H, W }, { ds.x:size(1), ds.x:size(2), ds.x:size(3), ds.x:size(4) })
    assert.equals('int64', ds.y.dtype)
    for i = 1, N do assert.equals((i * 3) % 10 + 1, ds.y[i]) end  -- a file's label 0 is class 1
    assert.equals('Ankle boot', ds.classes[10])
    local test = data.FashionMNIST{ root = tmp .. '/', train = false }
    assert.equals(3, test:size())
    -- images and labels that disagree in count
    os.execute("mkdir -p '" .. tmp .. "/mixed' && cp '" .. tmp .. "/train-images-idx3-ubyte' '" .. tmp
      .. "/mixed/' && cp '" .. tmp .. "/t10k-labels-idx1-ubyte' '" .. tmp .. "/mixed/train-labels-idx1-ubyte'")
    assert.has_error(function() data.FashionMNIST{ root = tmp .. '/mixed' } end)
    local ok, err = pcall(data.FashionMNIST, { root = tmp .. '/mixed' })
    assert.matches('holds 23 images but .* holds 3 labels', err)
  end)
end)

describe('dlua.data.TensorDataset', function()
  it('pairs samples, narrows without copying and checks counts', function()
    local x, y = dlua.arange(0, 12, { dtype = 'float32' }):view(6, 2), dlua.arange(1, 7, { dtype = 'int64' })
    local ds = data.TensorDataset(x, y)
    assert.equals(6, ds:size())
    local xi, yi = ds:get(2)
    assert.same({ 2, 3 }, xi:totable()); assert.equals(2, yi)
    local xl = ds:get(-1)
    assert.same({ 10, 11 }, xl:totable())
    local part = ds:narrow(3, 2)
    assert.equals(2, part:size())
    assert.equals(3, part.y[1])
    part.x[{ 1, 1 }] = 100
    assert.equals(100, x[{ 3, 1 }])  -- a view
    assert.truthy(tostring(ds):find('TensorDataset(6 samples: x (6, 2) float32, y (6) int64)', 1, true))
    assert.has_error(function() data.TensorDataset(x, dlua.zeros(5)) end)
    assert.has_error(function() ds:get(7) end, 'TensorDataset:get: position 7 out of range 1..6')
    assert.has_error(function() ds:narrow(5, 3) end)
  end)
end)

-- Every sample id of an epoch's batches, and the batch sizes.
local function epoch_ids(ds, opts)
  local ids, sizes = {}, {}
  for i, x, y in data.batches(ds, opts) do
    assert.equals(#sizes + 1, i)
    assert.equals(y:size(1), x:size(1))
    sizes[#sizes + 1] = y:size(1)
    for k = 1, y:size(1) do ids[#ids + 1] = y[k] end
  end
  return ids, sizes
end

describe('dlua.data.batches', function()
  it('covers every sample exactly once per epoch, in batches of the asked size', function()
    local ds = id_dataset()
    for _, shuffle in ipairs({ false, true }) do
      local ids, sizes = epoch_ids(ds, { batch = 5, shuffle = shuffle, seed = 3, epoch = 2 })
      assert.same({ 5, 5, 5, 5, 3 }, sizes)
      table.sort(ids)
      for k = 1, N do assert.equals(k, ids[k]) end
    end
    local ids, sizes = epoch_ids(ds, { batch = 5, shuffle = true, drop_last = true })
    assert.same({ 5, 5, 5, 5 }, sizes)
    local seen = {}
    for _, v in ipairs(ids) do assert.is_nil(seen[v]); seen[v] = true end
    assert.equals(5, data.num_batches(ds, { batch = 5 }))
    assert.equals(4, data.num_batches(ds, { batch = 5, drop_last = true }))
    assert.equals(1, data.num_batches(ds, { batch = 100 }))
    -- batch 1 and a batch as large as the dataset
    assert.equals(N, #select(2, epoch_ids(ds, { batch = 1, shuffle = true })))
    assert.same({ N }, select(2, epoch_ids(ds, { batch = N })))
  end)

  it('orders an epoch by (seed, epoch): same pair same order, another epoch or seed another', function()
    local ds = id_dataset()
    local a = epoch_ids(ds, { batch = 4, shuffle = true, seed = 7, epoch = 1 })
    local b = epoch_ids(ds, { batch = 4, shuffle = true, seed = 7, epoch = 1 })
    local c = epoch_ids(ds, { batch = 4, shuffle = true, seed = 7, epoch = 2 })
    local d = epoch_ids(ds, { batch = 4, shuffle = true, seed = 8, epoch = 1 })
    assert.same(a, b)
    assert.are_not.same(a, c)
    assert.are_not.same(a, d)
    local plain = epoch_ids(ds, { batch = 4 })
    for k = 1, N do assert.equals(k, plain[k]) end
    -- the order is dlua.randperm drawn from the (seed, epoch) generator, whatever the global seed
    dlua.manual_seed(99)
    assert.same(a, data.order(N, { seed = 7, epoch = 1 }):totable())
    assert.are_not.same(a, epoch_ids(ds, { batch = 4, shuffle = true, seed = 1, epoch = 7 }))
  end)

  it('normalises (x / 255 - mean) / std into float32', function()
    local ds = id_dataset()
    local mean, std = 0.25, 0.5
    for _, x, y in data.batches(ds, { batch = 6, shuffle = true, seed = 1, mean = mean, std = std }) do
      assert.equals('float32', x.dtype)
      assert.same({ y:size(1), 1, H, W }, { x:size(1), x:size(2), x:size(3), x:size(4) })
      for k = 1, y:size(1) do
        local i = y[k]
        for _, c in ipairs({ { 0, 0 }, { 4, 3 }, { 2, 1 } }) do
          local want = (pix(i, c[1], c[2]) / 255 - mean) / std
          assert.near(want, x[{ k, 1, c[1] + 1, c[2] + 1 }], 1e-6)
        end
      end
    end
    -- Without mean/std: pixels on [0, 1]; dtype uint8 keeps them raw.
    local _, x01, y01 = data.batches(ds, { batch = 2 })()
    assert.near(pix(y01[2], 1, 2) / 255, x01[{ 2, 1, 2, 3 }], 1e-7)
    local _, xr, yr = data.batches(ds, { batch = 2, dtype = 'uint8' })()
    assert.equals('uint8', xr.dtype)
    assert.equals(pix(yr[1], 3, 0), xr[{ 1, 1, 4, 1 }])
  end)

  it('augments with crops and flips fixed by (seed, epoch), whatever the thread count', function()
    local ds = id_dataset()
    local opts = { batch = 8, shuffle = true, seed = 5, epoch = 3, augment = { crop_pad = 2, flip = true } }
    local function collect()
      local r = {}
      for _, x in data.batches(ds, opts) do r[#r + 1] = x:clone() end
      return r
    end
    local before = dlua.get_num_threads()
    dlua.set_num_threads(1)
    local one = collect()
    dlua.set_num_threads(2)
    local two = collect()
    dlua.set_num_threads(before)
    for k = 1, #one do assert.equals(0, (one[k] - two[k]):abs():max():item()) end
    -- it is the C augmentation of exactly those samples, keyed by their index in the dataset
    local k = 0
    for _, x, y in data.batches(ds, opts) do
      k = k + 1
      local ref = data.augment(ds.x, { index = y, crop_pad = 2, flip = true, seed = 5, epoch = 3 }):float() / 255
      assert.near(0, (ref - x):abs():max():item(), 1e-7)
    end
    -- another epoch crops differently; no augmentation is a plain gather
    opts.epoch = 4
    local other = collect()
    local differ = false
    for b = 1, #one do differ = differ or (one[b] - other[b]):abs():max():item() > 0 end
    assert.is_true(differ)
    -- flip with probability 1 and no padding: each image mirrored left to right
    for _, x, y in data.batches(ds, { batch = 5, augment = { flip = 1 }, dtype = 'uint8' }) do
      for j = 1, y:size(1) do
        for yy = 0, H - 1 do
          for xx = 0, W - 1 do assert.equals(pix(y[j], yy, W - 1 - xx), x[{ j, 1, yy + 1, xx + 1 }]) end
        end
      end
    end
  end)

  it('rejects bad options by name at the caller', function()
    local ds = id_dataset()
    local ok, err = pcall(function() local it = data.batches(ds, { batch = 4, shufle = true }); return it end)
    assert.is_false(ok)
    assert.matches("data_spec.lua:%d+: batches: unknown option 'shufle'", err)
    assert.has_error(function() data.batches(ds, {}) end, 'batches: batch must be a positive integer, got nil')
    assert.has_error(function() data.batches(ds, { batch = 2, augment = { pad = 2 } }) end)
    assert.has_error(function() data.batches(ds, { batch = 2, dtype = 'uint8', mean = 0.5 }) end)
    local flat = data.TensorDataset(dlua.zeros(4, 3), dlua.arange(1, 5))
    assert.has_error(function() data.batches(flat, { batch = 2, augment = { crop_pad = 1 } }) end,
      'batches: augment needs images (N, C, H, W), got x (4, 3)')
    -- a non-image dataset batches by rows
    local _, fx = data.batches(flat, { batch = 3 })()
    assert.same({ 3, 3 }, { fx:size(1), fx:size(2) })
  end)

  it('names the op and the caller when a transform or an image writer gets a bad argument', function()
    local tf = data.Resize(4)
    local img = dlua.zeros({ 8, 8, 3 }, { dtype = 'uint8' })
    local ok, err = pcall(function() local y = tf(img, { sed = 1 }); return y end)
    assert.is_false(ok)
    assert.matches("data_spec.lua:%d+: transform: unknown option 'sed'", err)
    ok, err = pcall(function() local y = tf(5); return y end)
    assert.matches('data_spec.lua:%d+: transform: expected a tensor as the image, got number', err)
    ok, err = pcall(function() local y = data.write_png(5, os.tmpname()); return y end)
    assert.matches('data_spec.lua:%d+: write_png: expected a tensor as the image, got number', err)
    ok, err = pcall(function() local y = data.write_jpeg({}, os.tmpname()); return y end)
    assert.matches('data_spec.lua:%d+: write_jpeg: expected a tensor as the image, got table', err)
  end)
end)

describe('dlua.data on the real Fashion-MNIST', function()
  local root = data.FASHION_MNIST_ROOT
  local f = io.open(root .. '/train-images-idx3-ubyte.gz', 'rb')
  if not f then
    io.stderr:write('data_spec: skipping real Fashion-MNIST: ' .. root ..
      ' not found (Debian package dataset-fashion-mnist)\n')
    pending('Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)')
    return
  end
  f:close()

  it('has 60000 + 10000 images of 28 x 28, 6000 per class, with the stated pixel statistics', function()
    local train = data.FashionMNIST{}
    assert.equals(60000, train:size())
    assert.same({ 60000, 1, 28, 28 }, { train.x:size(1), train.x:size(2), train.x:size(3), train.x:size(4) })
    local counts = dlua.zeros(10, { dtype = 'int64' })
    counts:scatter_add_(1, train.y, dlua.ones(60000, { dtype = 'int64' }))
    for c = 1, 10 do assert.equals(6000, counts[c]) end
    -- mean and std of x / 255 over the training set, in float64, 10000 images at a time
    local s, s2, n = 0, 0, 0
    for first = 1, 60000, 10000 do
      local v = train.x:narrow(1, first, 10000):double() / 255
      s = s + v:sum():item()
      s2 = s2 + (v * v):sum():item()
      n = n + v:numel()
    end
    local mean = s / n
    local std = math.sqrt(s2 / n - mean * mean)
    assert.near(mean, train.mean[1], 5e-5)
    assert.near(std, train.std[1], 5e-5)
    assert.equals(10000, data.FashionMNIST{ train = false }:size())
  end)
end)
