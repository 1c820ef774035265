-- dlua.data image pipeline: ImageFolder, transforms, the threaded DataLoader (same batches for any worker count, bad files skipped, clean stops) and DistributedSampler.
local dlua = require 'dlua'
local data = dlua.data
local binding = require 'bindings.data'

local tmp = os.tmpname()
os.remove(tmp)
local root, cache = tmp .. '/folder', tmp .. '/cache'
local function sh(cmd) assert(os.execute(cmd) == 0, cmd) end
sh("mkdir -p '" .. root .. "/cat' '" .. root .. "/dog' '" .. root .. "/emu/deep' '" .. cache .. "'")
teardown(function() os.execute("rm -rf '" .. tmp .. "'") end)

-- Images whose pixels depend on (k, y, x, c), of varying sizes.
local function picture(k, h, w)
  local img = dlua.arange(0, h * w * 3):view(h, w, 3)
  return ((img * (k + 3) + k * 17) % 256):byte()
end
local files = 0
for k = 1, 5 do data.write_jpeg(picture(k, 30 + k, 40 - k), root .. '/cat/' .. k .. '.jpg'); files = files + 1 end
for k = 1, 4 do data.write_png(picture(10 + k, 24, 24 + k), root .. '/dog/' .. k .. '.png'); files = files + 1 end
data.write_jpeg(picture(20, 50, 33), root .. '/emu/deep/a.jpeg'); files = files + 1
data.write_jpeg(picture(21, 20, 20), root .. '/emu/b.jpg'); files = files + 1

local function write(path, bytes)
  local f = assert(io.open(path, 'wb'))
  f:write(bytes)
  f:close()
end
local function read(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end

local function task_count()
  local p = io.popen('ls /proc/' .. (io.open('/proc/self/stat') and read('/proc/self/stat'):match('^(%d+)')) .. '/task | wc -l')
  local n = tonumber(p:read('*a'))
  p:close()
  return n
end

local function same(a, b) return a:size(1) == b:size(1) and (a:double() - b:double()):abs():max():item() == 0 end

local crop = data.Compose { data.RandomResizedCrop(16), data.RandomHorizontalFlip(), data.ToTensor(),
  data.Normalize({ 0.5, 0.4, 0.3 }, { 0.2, 0.25, 0.3 }) }

describe('ImageFolder', function()
  it('lists classes and files in torchvision order, labels from 1, and caches the list', function()
    local ds = data.ImageFolder(root, { cache_dir = cache })
    assert.same({ 'cat', 'dog', 'emu' }, ds.classes)
    assert.equals(files, ds:size())
    assert.is_false(ds.from_cache)
    local p, label = ds:path(10)
    assert.equals(root .. '/emu/b.jpg', p)  -- emu's own files before emu/deep's
    assert.equals(3, label)
    assert.equals(root .. '/emu/deep/a.jpeg', (ds:path(11)))
    local img, y = ds:get(6)
    assert.equals(2, y)
    assert.same({ 24, 25, 3 }, { img:size(1), img:size(2), img:size(3) })
    assert.is_true(same(img, picture(11, 24, 25)))  -- PNG: exact
    local again = data.ImageFolder(root, { cache_dir = cache })
    assert.is_true(again.from_cache)
    assert.equals(ds:size(), again:size())
    assert.is_false(data.ImageFolder(root, { cache = false }).from_cache)
  end)

  it('rejects an empty class folder and an empty dataset at construction, naming the path', function()
    local bad = tmp .. '/bad'
    sh("mkdir -p '" .. bad .. "/a' '" .. bad .. "/empty'")
    data.write_jpeg(picture(1, 8, 8), bad .. '/a/1.jpg')
    local ok, err = pcall(function() local d = data.ImageFolder(bad, { cache = false }); return d end)
    assert.is_false(ok)
    assert.matches("loader_spec.lua:%d+: ImageFolder: class folder '[^']*/bad/empty' holds no image", err)
    ok, err = pcall(function() local d = data.ImageFolder(bad .. '/empty', { cache = false }); return d end)
    assert.matches("loader_spec.lua:%d+: ImageFolder: no class folders in '[^']*/bad/empty'", err)
    ok, err = pcall(data.ImageFolder, tmp .. '/missing')
    assert.matches("cannot open '[^']*/missing'", err)
  end)
end)

describe('transforms', function()
  it('compose, print, apply to one image and report RandomResizedCrop boxes', function()
    local rrc = data.RandomResizedCrop(8, { scale = { 0.5, 0.5 }, ratio = { 1, 1 } })
    local img = picture(3, 20, 30)
    local top, left, h, w = rrc:get_params(20, 30, { seed = 2, epoch = 1, index = 4 })
    assert.equals(17, h)  -- round(sqrt(300)) = 17
    assert.equals(17, w)
    local t = data.Compose { rrc, data.ToTensor { layout = 'nhwc', dtype = 'uint8' } }
    local out = t(img, { seed = 2, epoch = 1, index = 4 })
    -- (C, H, W) as torchvision's ToTensor gives, over (H, W, C) memory (channels-last)
    assert.same({ 3, 8, 8 }, out:size())
    assert.same({ 1, 24, 3 }, out:stride())
    -- The same crop through Resize after an explicit crop (narrow), as one more route.
    local cropped = img:narrow(1, top, h):narrow(2, left, w):contiguous()
    local ref = data.Compose { data.Resize { 8, 8 }, data.ToTensor { layout = 'nhwc', dtype = 'uint8' } }(cropped)
    assert.is_true(same(out, ref))
    assert.is_true(out:permute(2, 3, 1):is_contiguous())  -- the bytes are the (H, W, C) pixels
    -- row-major (C, H, W) holds the same values
    local plain = data.Compose { data.Resize { 8, 8 }, data.ToTensor { dtype = 'uint8' } }(cropped)
    assert.same({ 3, 8, 8 }, plain:size())
    assert.is_true(plain:is_contiguous())
    assert.is_true(same(plain, out))
    -- both are the image's pixels with channels first: a crop of the whole image changes nothing
    for _, mf in ipairs({ 'contiguous', 'channels_last' }) do
      local whole = data.Compose { data.CenterCrop { 20, 30 }, data.ToTensor { memory_format = mf, dtype = 'uint8' } }(img)
      assert.same({ 3, 20, 30 }, whole:size())
      assert.is_true(same(whole, img:permute(3, 1, 2)), mf)
    end
    assert.matches('RandomResizedCrop%(8x8', tostring(t))
    local ok, err = pcall(function() local c = data.Compose { data.Normalize(0.5, 0.5), data.ToTensor() }; return c end)
    assert.matches('loader_spec.lua:%d+: Compose: Normalize %(transform 1%) needs a float ToTensor before it', err)
    ok, err = pcall(data.RandomHorizontalFlip, 2)
    assert.matches('p must be a probability', err)
  end)
end)

describe('DataLoader', function()
  local ds = data.ImageFolder(root, { transform = crop, cache = false })

  local function epoch_batches(loader)
    local xs, ys, is = {}, {}, {}
    for i, x, y in loader:batches() do
      is[#is + 1], xs[#xs + 1], ys[#ys + 1] = i, x, y
    end
    return is, xs, ys
  end

  it('gives the same batches with 1 and 4 workers (and on the calling thread)', function()
    local runs = {}
    for _, w in ipairs({ 0, 1, 4 }) do
      local loader = data.DataLoader { dataset = ds, batch = 4, workers = w, shuffle = true, seed = 7 }
      assert.equals(3, #loader)
      assert.equals(3, loader:len())
      local is, xs, ys = epoch_batches(loader)
      assert.same({ 1, 2, 3 }, is)
      runs[#runs + 1] = { xs, ys }
      assert.equals('float32', xs[1].dtype)
      assert.same({ 4, 3, 16, 16 }, { xs[1]:size(1), xs[1]:size(2), xs[1]:size(3), xs[1]:size(4) })
      assert.equals(3, xs[3]:size(1))
    end
    for r = 2, 3 do
      for b = 1, 3 do
        assert.is_true(same(runs[1][1][b], runs[r][1][b]))
        assert.is_true(same(runs[1][2][b], runs[r][2][b]))
      end
    end
    -- Every sample once per epoch: labels of the epoch = the dataset's labels.
    local counts = {}
    for b = 1, 3 do for k = 1, runs[1][2][b]:size(1) do local c = runs[1][2][b][k]; counts[c] = (counts[c] or 0) + 1 end end
    assert.same({ 5, 4, 2 }, counts)
  end)

  it('advances the epoch by itself, and set_epoch replays one', function()
    local loader = data.DataLoader { dataset = ds, batch = files, workers = 2, shuffle = true, seed = 3 }
    local _, x1, y1 = epoch_batches(loader)
    local _, x2, y2 = epoch_batches(loader)
    assert.equals(2, loader.epoch)
    assert.is_false(same(x1[1], x2[1]))
    loader:set_epoch(1)
    local _, x3, y3 = epoch_batches(loader)
    assert.is_true(same(x1[1], x3[1]))
    assert.is_true(same(y1[1], y3[1]))
    local _, x4 = epoch_batches(loader)  -- then on from the epoch given: 2
    assert.is_true(same(x2[1], x4[1]))
    local _ = y2
  end)

  it('decodes only the rows and columns a crop reads, with the pixels of a full decode', function()
    -- The loader decodes a JPEG's crop region only; ImageFolder:get decodes the whole file.
    local dir = tmp .. '/big'
    sh("mkdir -p '" .. dir .. "/a'")
    for k = 1, 6 do data.write_jpeg(picture(30 + k, 70 + 9 * k, 95 - 6 * k), dir .. '/a/' .. k .. '.jpg') end
    local big = data.ImageFolder(dir, { transform = crop, cache = false })
    -- dct_scaling off: a crop twice the output's size would otherwise be decoded at 1/2 scale.
    local loader = data.DataLoader { dataset = big, batch = 6, workers = 2, seed = 5, dct_scaling = false }
    for epoch = 1, 3 do
      local _, xs = epoch_batches(loader)
      for k = 1, 6 do
        assert.is_true(same(xs[1][k], big:get(k, { seed = 5, epoch = epoch })), 'epoch ' .. epoch .. ' sample ' .. k)
      end
    end
  end)

  it('skips corrupt, truncated, zero-byte and non-image files, counting them and warning once per file', function()
    local broken = tmp .. '/broken'
    sh("cp -r '" .. root .. "' '" .. broken .. "'")
    local good = read(broken .. '/cat/1.jpg')
    write(broken .. '/cat/zz_truncated.jpg', good:sub(1, math.floor(#good / 2)))
    write(broken .. '/cat/zz_zero.jpg', '')
    write(broken .. '/dog/zz_text.png', 'this is a text file, not a PNG')
    local junk = {}
    for k = 1, 500 do junk[k] = string.char((k * 37 + 11) % 256) end
    write(broken .. '/dog/zz_corrupt.jpg', '\255\216\255\224' .. table.concat(junk))
    local bds = data.ImageFolder(broken, { transform = crop, cache = false })
    assert.equals(files + 4, bds:size())
    local loader = data.DataLoader { dataset = bds, batch = 5, workers = 3, quiet = true }
    local seen = 0
    for _ = 1, 2 do
      for _, x, y in loader:batches() do
        seen = seen + x:size(1)
        assert.equals(x:size(1), y:size(1))
      end
    end
    assert.equals(2 * files, seen)
    local st = loader.stats
    assert.equals(8, st.skipped)
    assert.equals(4, st.bad_files)
    assert.equals(2 * files, st.decoded)
    local all = table.concat(st.bad, '\n')
    for _, name in ipairs({ 'zz_truncated.jpg', 'zz_zero.jpg', 'zz_text.png', 'zz_corrupt.jpg' }) do
      assert.truthy(all:find(name, 1, true), name)
    end
    -- The warnings on stderr, from a separate process: one line per bad file over two epochs.
    local script = tmp .. '/warn.lua'
    write(script, string.format([[
      local data = require('dlua').data
      local ds = data.ImageFolder(%q, { transform = data.Compose { data.CenterCrop(8), data.ToTensor() }, cache = false })
      local l = data.DataLoader { dataset = ds, batch = 4, workers = 2 }
      for e = 1, 2 do for i, x in l:batches() do end end
      print('stats', l.stats.skipped, l.stats.bad_files)
    ]], broken))
    local p = io.popen("'" .. arg[-1] .. "' '" .. script .. "' 2>&1")
    local out = p:read('*a')
    p:close()
    local warnings = 0
    for line in out:gmatch('[^\n]+') do
      if line:find('dlua: warning: skipping a sample: DataLoader: ', 1, true) then warnings = warnings + 1 end
    end
    assert.equals(4, warnings)
    assert.matches('stats\t8\t4', out)
  end)

  it('leaves no thread behind after a break (once collected) or stop(), and frees on close()', function()
    collectgarbage()
    collectgarbage()
    local base = task_count()
    local loader = data.DataLoader { dataset = ds, batch = 2, workers = 4, prefetch = 2 }
    for i in loader:batches() do
      if i == 1 then
        assert.is_true(task_count() >= base + 1)
        break
      end
    end
    collectgarbage()
    collectgarbage()
    assert.equals(0, binding.live_threads())
    assert.equals(base, task_count())
    for i in loader:batches() do if i == 2 then break end end
    loader:stop()
    assert.equals(0, binding.live_threads())
    assert.equals(base, task_count())
    local n = 0
    for _, x in loader:batches() do n = n + x:size(1) end  -- usable after a stop
    assert.equals(files, n)
    loader:close()
    local ok, err = pcall(function() return loader:batches() end)
    assert.matches('closed', err)
    assert.equals(base, task_count())
  end)

  it('stops its workers on Ctrl-C', function()
    local script = tmp .. '/interrupt.lua'
    write(script, [[
      local data = require('dlua').data
      local binding = require 'bindings.data'
      local fake = data.Synthetic { shape = { 3, 600, 600 }, n = 100000,
        transform = data.Compose { data.RandomResizedCrop(300), data.ToTensor() } }
      local loader = data.DataLoader { dataset = fake, batch = 64, workers = 1 }
      io.stdout:setvbuf('no')
      print('started')
      local ok, err = pcall(function() for i, x in loader:batches() do end end)
      local now = binding.live_threads()
      collectgarbage()
      collectgarbage()
      print('caught', err, now, binding.live_threads())
    ]])
    local p = io.popen("timeout --foreground -s INT 1.5 '" .. arg[-1] .. "' '" .. script .. "' 2>&1")
    local out = p:read('*a')
    p:close()
    assert.matches('started', out)
    assert.matches('caught\t[^\n]*interrupted\t%d\t0', out)
  end)

  it('rejects transforms that do not fix the size, and bad options', function()
    local ok, err = pcall(function()
      local l = data.DataLoader { dataset = data.ImageFolder(root, { transform = data.Resize(8), cache = false }), batch = 2 }
      return l
    end)
    assert.matches('loader_spec.lua:%d+: DataLoader: the images of .* may differ in size', err)
    ok, err = pcall(function() return data.DataLoader { dataset = ds, batch = 0 } end)
    assert.matches('batch must be a positive integer', err)
    ok, err = pcall(function() return data.DataLoader { dataset = ds, batch = 2, worker = 2 } end)
    assert.matches("unknown option 'worker'", err)
  end)

  it('loads in-memory datasets (raw gather, or uint8 images through transforms) and Synthetic images', function()
    local x = dlua.randint(0, 256, 10, 1, 6, 5):byte()
    local y = dlua.arange(1, 11, { dtype = 'int64' })
    local tds = data.TensorDataset(x, y)
    local loader = data.DataLoader { dataset = tds, batch = 4, workers = 2, shuffle = true, seed = 5 }
    local order = data.order(10, { seed = 5, epoch = 1 })
    local first = 0
    for i, bx, by in loader:batches() do
      local idx = order:narrow(1, first + 1, bx:size(1))
      assert.is_true(same(bx, x:index_select(1, idx)))
      assert.is_true(same(by, idx))
      assert.equals('uint8', bx.dtype)
      first = first + bx:size(1)
      assert.equals(i, math.ceil(first / 4))
    end
    assert.equals(10, first)
    tds.transform = data.Compose { data.RandomHorizontalFlip(1), data.ToTensor() }
    local l2 = data.DataLoader { dataset = tds, batch = 10 }
    for _, bx in l2:batches() do
      assert.equals('float32', bx.dtype)
      assert.near(x[{ 3, 1, 2, 5 }] / 255, bx[{ 3, 1, 2, 1 }], 1e-6)  -- mirrored
    end
    local syn = data.Synthetic { shape = { 3, 12, 10 }, classes = 4, n = 9 }
    local l3 = data.DataLoader { dataset = syn, batch = 9, workers = 2 }
    for _, bx, by in l3:batches() do
      assert.same({ 9, 3, 12, 10 }, { bx:size(1), bx:size(2), bx:size(3), bx:size(4) })
      assert.equals(2, by[6])  -- (6 - 1) % 4 + 1
      assert.is_true(bx:min():item() >= 0 and bx:max():item() <= 1)
    end
  end)
end)

describe('channels-last batches', function()
  it('ToTensor{memory_format = channels_last} gives (N, C, H, W) batches with channels-last strides', function()
    local function batches(tf, workers)
      local ds = data.ImageFolder(root, { transform = data.Compose { data.CenterCrop(8), tf }, cache = false })
      local r = {}
      for i, bx in data.DataLoader { dataset = ds, batch = 4, workers = workers }:batches() do r[i] = bx end
      return r
    end
    local plain = batches(data.ToTensor(), 0)
    for _, tf in ipairs({ data.ToTensor { memory_format = 'channels_last' }, data.ToTensor { layout = 'nhwc' } }) do
      for _, workers in ipairs({ 0, 2 }) do
        local cl = batches(tf, workers)
        assert.equals(#plain, #cl)
        for i, bx in ipairs(cl) do
          local n = plain[i]:size(1)
          assert.same({ n, 3, 8, 8 }, bx:size())
          assert.is_true(bx:is_contiguous('channels_last'))
          assert.is_false(bx:is_contiguous())
          assert.is_true(plain[i]:is_contiguous())
          assert.is_true(same(plain[i], bx), 'batch ' .. i)
        end
      end
    end
    -- what a convolution sees: the same output for either memory format, and channels-last out of channels-last in
    local conv = dlua.nn.Conv2d(3, 4, 3, { padding = 1 })
    local a, b = conv:forward(plain[1]):clone(), conv:forward(batches(data.ToTensor { layout = 'nhwc' }, 0)[1])
    assert.is_true(b:is_contiguous('channels_last'))
    assert.is_true((a - b):abs():max():item() < 1e-5)
    -- a synthetic dataset and an in-memory one take the same path
    local syn = data.Synthetic { shape = { 3, 6, 5 }, classes = 2, n = 4,
      transform = data.ToTensor { memory_format = 'channels_last', dtype = 'uint8' } }
    for _, bx in data.DataLoader { dataset = syn, batch = 4 }:batches() do
      assert.same({ 4, 3, 6, 5 }, bx:size())
      assert.is_true(bx:is_contiguous('channels_last'))
    end
  end)

  it('rejects a bad memory_format or layout by name', function()
    local function err(opts)
      local ok, e = pcall(data.ToTensor, opts)
      assert.is_false(ok)
      return tostring(e)
    end
    assert.matches("ToTensor: memory_format must be 'contiguous' or 'channels_last', got 'nhwc'",
      err { memory_format = 'nhwc' }, 1, true)
    assert.matches("ToTensor: layout must be 'nchw' or 'nhwc', got 'hwc'", err { layout = 'hwc' }, 1, true)
    assert.matches("ToTensor: layout 'nchw' and memory_format 'channels_last' disagree",
      err { layout = 'nchw', memory_format = 'channels_last' }, 1, true)
    assert.equals("ToTensor(memory_format='channels_last', dtype='uint8')",
      tostring(data.ToTensor { layout = 'nhwc', memory_format = 'channels_last', dtype = 'uint8' }))
  end)
end)

describe('DataLoader device and normalize', function()
  it('normalize on uint8 batches equals Normalize in the workers, NCHW and NHWC', function()
    local x = dlua.randint(0, 256, 6, 3, 5, 4):byte()
    local tds = data.TensorDataset(x, dlua.arange(1, 7, { dtype = 'int64' }))
    local mean, std = { 0.485, 0.456, 0.406 }, { 0.229, 0.224, 0.225 }
    for _, layout in ipairs({ 'nchw', 'nhwc' }) do
      tds.transform = data.Compose { data.ToTensor { layout = layout }, data.Normalize(mean, std) }
      local ref
      for _, bx in data.DataLoader { dataset = tds, batch = 6 }:batches() do ref = bx end
      tds.transform = data.ToTensor { layout = layout, dtype = 'uint8' }
      local got, raw
      local l = data.DataLoader { dataset = tds, batch = 6, workers = 2, normalize = { mean = mean, std = std } }
      for _, bx in l:batches() do got = bx end
      for _, bx in data.DataLoader { dataset = tds, batch = 6 }:batches() do raw = bx end
      assert.equals('uint8', raw.dtype)
      assert.equals('float32', got.dtype)
      -- (N, C, H, W) either way; normalize keeps the batch's memory format
      for _, t in ipairs({ ref, raw, got }) do
        assert.same({ 6, 3, 5, 4 }, t:size())
        assert.is_true(t:is_contiguous(layout == 'nhwc' and 'channels_last' or 'contiguous'), layout)
      end
      assert.is_true(same(raw, x), layout)
      assert.is_true((got - ref):abs():max():item() < 1e-5, layout)
      -- by hand: one element of channel 2
      local c = { 4, 2, 3, 1 }
      assert.near((x[c] / 255 - mean[2]) / std[2], got[c], 1e-5)
    end
  end)

  -- On the CUDA emulator streams run only when waited for and pinned memory is read when its copy runs, so a
  -- missing event, a host batch given back too early or device memory reused under the copy shows every time.
  local cuda_it = require('dlua.cuda').is_available() and it or pending
  cuda_it('delivers on a CUDA device the batches it gives on the CPU, normalized alike (needs a GPU)', function()
    local x = dlua.randint(0, 256, 37, 3, 5, 4):byte()
    local y = dlua.arange(1, 38, { dtype = 'int64' })
    local tds = data.TensorDataset(x, y)
    local opts = { dataset = tds, batch = 8, workers = 2, shuffle = true, seed = 9, pin_memory = true,
      normalize = { mean = { 120, 128, 130 }, std = { 60, 64, 70 } } }
    local ref = {}
    for i, bx, by in data.DataLoader(opts):batches() do ref[i] = { bx:clone(), by:clone() } end
    opts.device = 'cuda'
    local n = 0
    for epoch = 1, 2 do
      local l = data.DataLoader(opts)
      l:set_epoch(1)
      for i, bx, by in l:batches() do
        assert.equals('cuda:' .. require('dlua.cuda').current_device(), bx.device)
        assert.is_true(same(bx:cpu(), ref[i][1]), 'batch ' .. i .. ' images, pass ' .. epoch)
        assert.is_true(same(by:cpu(), ref[i][2]), 'batch ' .. i .. ' labels, pass ' .. epoch)
        n = n + 1
      end
    end
    assert.equals(2 * #ref, n)
    -- channels-last uint8 batches: normalized on the device, still (N, C, H, W) channels-last there
    tds.transform = data.ToTensor { memory_format = 'channels_last', dtype = 'uint8' }
    local m = 0
    for i, bx, by in data.DataLoader(opts):batches() do
      assert.equals('cuda:' .. require('dlua.cuda').current_device(), bx.device)
      assert.same(ref[i][1]:size(), bx:size())
      assert.is_true(bx:is_contiguous('channels_last'), 'batch ' .. i .. ' on the device')
      assert.is_true((bx:cpu() - ref[i][1]):abs():max():item() < 1e-5, 'batch ' .. i .. ' channels-last images')
      assert.is_true(same(by:cpu(), ref[i][2]), 'batch ' .. i .. ' channels-last labels')
      m = m + 1
    end
    assert.equals(#ref, m)
  end)

  it('rejects a bad normalize or device by name', function()
    local tds = data.TensorDataset(dlua.zeros(4, 3, 2, 2):byte(), dlua.arange(1, 5, { dtype = 'int64' }))
    local function err(opts)
      opts.dataset, opts.batch = tds, 2
      local ok, e = pcall(data.DataLoader, opts)
      assert.is_false(ok)
      return tostring(e)
    end
    assert.matches('normalize needs mean and std', err { normalize = { mean = { 1, 2 }, std = { 1 } } }, 1, true)
    assert.matches('normalize entry 1 needs a number mean and a non-zero std', err { normalize = { mean = 0, std = 0 } }, 1, true)
    local missing = 'cuda:' .. require('dlua.cuda').device_count() -- a device this machine does not have
    assert.matches("DataLoader: device '" .. missing .. "'", err { device = missing }, 1, true)
    local l = data.DataLoader { dataset = tds, batch = 2, normalize = { mean = { 1, 2 }, std = { 1, 1 } } }
    local ok, e = pcall(function() for _ in l:batches() do end end)
    assert.is_false(ok)
    assert.matches('normalize has 2 channels, the batch 2x3x2x2 has 3 in dimension 2', tostring(e), 1, true)
    -- 'auto' without a GPU stays on the CPU
    if not require('dlua.cuda').is_available() then
      local la = data.DataLoader { dataset = tds, batch = 2, device = 'auto' }
      for _, bx in la:batches() do assert.equals('cpu', bx.device) end
    end
  end)
end)

describe('DistributedSampler', function()
  -- torch's sizes: num_samples = ceil(n / R), or ceil((n - R) / R) with drop_last and n % R ~= 0.
  local function torch_num_samples(n, R, drop)
    if drop and n % R ~= 0 then return math.ceil((n - R) / R) end
    return math.ceil(n / R)
  end

  it('covers every sample exactly once per epoch across ranks, padding by wrapping or dropping', function()
    for _, case in ipairs({ { 12, 4 }, { 10, 4 }, { 10, 3 }, { 3, 4 }, { 7, 1 } }) do
      local n, R = case[1], case[2]
      for _, drop in ipairs({ false, true }) do
        for epoch = 1, 2 do
          local count, total, order0 = {}, 0, nil
          for rank = 0, R - 1 do
            local s = data.DistributedSampler { n = n, num_replicas = R, rank = rank, seed = 9, drop_last = drop }
            s:set_epoch(epoch)
            assert.equals(torch_num_samples(n, R, drop), s:len())
            local idx = s:indices()
            assert.equals(s:len(), idx:size(1))
            for k = 1, idx:size(1) do
              local v = idx[k]
              assert.is_true(v >= 1 and v <= n)
              count[v] = (count[v] or 0) + 1
              total = total + 1
            end
            order0 = order0 or data.order(n, { seed = 9, epoch = epoch })
            -- rank r takes positions r+1, r+1+R, ... of the (wrapped) epoch order
            if idx:size(1) > 0 then assert.equals(order0[(rank % n) + 1], idx[1]) end
          end
          local padded = torch_num_samples(n, R, drop) * R
          assert.equals(padded, total)
          local distinct = 0
          for v = 1, n do
            if count[v] then distinct = distinct + 1 end
            local want = drop and 1 or (v <= n and 1)
            if not drop and padded <= n then assert.equals(1, count[v]) end
            local _ = want
          end
          if drop then
            assert.equals(padded, distinct)                 -- dropped tail: each seen at most once
            for v = 1, n do assert.is_true((count[v] or 0) <= 1) end
          else
            assert.equals(n, distinct)                      -- all seen; extras are the wrap-around
            for v = 1, n do assert.is_true(count[v] >= 1 and count[v] <= math.ceil(padded / n)) end
          end
        end
      end
    end
    local a = data.DistributedSampler { n = 50, num_replicas = 2, rank = 0 }
    local e1 = a:indices(1)
    assert.is_false(same(e1, a:indices(2)))  -- order changes with the epoch
    assert.is_true(same(e1, a:indices(1)))   -- and is a function of it
  end)

  it('plugs into the DataLoader and takes world size and rank from dlua.dist', function()
    local x = dlua.arange(1, 22):view(21, 1)
    local tds = data.TensorDataset(x, dlua.arange(1, 22, { dtype = 'int64' }))
    local seen = {}
    for rank = 0, 2 do
      local s = data.DistributedSampler { dataset = tds, num_replicas = 3, rank = rank }
      local loader = data.DataLoader { dataset = tds, batch = 4, sampler = s, workers = 2 }
      assert.equals(2, #loader)  -- 7 samples per rank
      for _, _, y in loader:batches() do for k = 1, y:size(1) do seen[y[k]] = (seen[y[k]] or 0) + 1 end end
    end
    for v = 1, 21 do assert.equals(1, seen[v]) end
    local saved = package.loaded['dlua.dist']
    package.loaded['dlua.dist'] = { is_initialized = function() return true end, world_size = function() return 5 end,
      rank = function() return 3 end }
    local s = data.DistributedSampler { n = 20 }
    package.loaded['dlua.dist'] = saved
    assert.equals(5, s.num_replicas)
    assert.equals(3, s.rank)
    local ok, err = pcall(function() return data.DataLoader { dataset = tds, sampler = s, shuffle = true } end)
    assert.matches('mutually exclusive', err)
  end)
end)
