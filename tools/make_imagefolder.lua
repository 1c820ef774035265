-- Writes a JPEG ImageFolder (DIR/train/<class>/*.jpg, DIR/val/<class>/*.jpg) from Fashion-MNIST or synthetic images, for tests, demos and bench/loader.
local dlua = require 'dlua'
local data = require 'dlua.data'
local cli = require 'dlua.cli'

local opt = cli.parse(arg, { out = '', source = 'synthetic', size = '500x375', quality = 90, per_class = 100,
  classes = 10, val = 10, seed = 1 }, {
  description = 'Writes a JPEG ImageFolder: OUT/train/<class>/NNNNN.jpg and OUT/val/<class>/NNNNN.jpg.',
  help = {
    out = 'folder to write (created; existing files are overwritten)',
    source = "'fashion-mnist' (Debian dataset-fashion-mnist, grey -> RGB, resized) or 'synthetic'",
    size = 'image size WxH (500x375 is a typical ImageNet photo)',
    quality = 'JPEG quality 1..100',
    per_class = 'training images per class',
    classes = 'number of classes (at most 10 for fashion-mnist)',
    val = 'validation images per class',
    seed = 'seed of the synthetic images',
  },
  types = { quality = 'int', per_class = 'int', classes = 'int', val = 'int', seed = 'int' },
})

local function die(msg)
  io.stderr:write('make_imagefolder: ', msg, '\n')
  os.exit(2)
end

if opt.out == '' then die('--out DIR is required (see --help)') end
local W, H = opt.size:match('^(%d+)x(%d+)$')
W, H = tonumber(W), tonumber(H)
if not W or W < 1 or H < 1 then die("--size must be WxH, e.g. 500x375, got '" .. opt.size .. "'") end
if opt.source ~= 'fashion-mnist' and opt.source ~= 'synthetic' then
  die("--source must be 'fashion-mnist' or 'synthetic', got '" .. opt.source .. "'")
end
if opt.classes < 1 or (opt.source == 'fashion-mnist' and opt.classes > 10) then
  die('--classes must be 1..' .. (opt.source == 'fashion-mnist' and 10 or 'N') .. ', got ' .. opt.classes)
end

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
local function mkdir(path)
  if os.execute('mkdir -p ' .. sh_quote(path)) ~= 0 then die('cannot create ' .. path) end
end

local to_size = data.Compose { data.Resize { H, W }, data.ToTensor { memory_format = 'channels_last', dtype = 'uint8' } }

local class_names = {}
for c = 1, opt.classes do class_names[c] = string.format('class_%03d', c - 1) end

local written = 0
local t0 = dlua.perf_counter()

local function save(split, c, k, img)
  data.write_jpeg(img, string.format('%s/%s/%s/%05d.jpg', opt.out, split, class_names[c], k), { quality = opt.quality })
  written = written + 1
end

if opt.source == 'fashion-mnist' then
  for c, name in ipairs(data.FashionMNIST{}.classes) do
    if c <= opt.classes then class_names[c] = name:gsub('[^%w]+', '_') end
  end
  for _, split in ipairs({ { 'train', true, opt.per_class }, { 'val', false, opt.val } }) do
    local ds = data.FashionMNIST { train = split[2] }
    local count = {}
    for c = 1, opt.classes do
      count[c] = 0
      if split[3] > 0 then mkdir(opt.out .. '/' .. split[1] .. '/' .. class_names[c]) end
    end
    local need = split[3] * opt.classes
    local x, y = ds.x, ds.y
    for i = 1, ds:size() do
      if need == 0 then break end
      local c = y[i]
      if c <= opt.classes and count[c] < split[3] then
        count[c] = count[c] + 1
        need = need - 1
        local grey = x[i]:view(28, 28, 1)                  -- (H, W, 1)
        local big = to_size(grey):permute(2, 3, 1)          -- (H, W, 1) view of the (1, H, W) result, bilinear as Pillow
        save(split[1], c, count[c], big:expand(H, W, 3))    -- grey -> RGB
      end
    end
    if need > 0 then die(string.format('only %d %s images available', split[3] * opt.classes - need, split[1])) end
  end
else
  -- Photo-like content: a smooth field (a coarse random grid, bilinearly enlarged) plus fine
  -- noise, so files compress to about the size of real photos of that size.
  dlua.manual_seed(opt.seed)
  local coarse = data.Compose { data.Resize { H, W }, data.ToTensor { memory_format = 'channels_last', dtype = 'uint8' } }
  for _, split in ipairs({ { 'train', opt.per_class }, { 'val', opt.val } }) do
    for c = 1, opt.classes do
      if split[2] > 0 then mkdir(opt.out .. '/' .. split[1] .. '/' .. class_names[c]) end
      local tint = dlua.rand(1, 1, 3) * 0.5 + 0.25
      for k = 1, split[2] do
        local grid = ((dlua.rand(6, 8, 3) * 0.6 + tint) * 255):clamp(0, 255):byte()
        local img = coarse(grid):permute(2, 3, 1):float()  -- (3, H, W) channels-last -> (H, W, 3)
        img = (img + dlua.randn(H, W, 3) * 18):clamp(0, 255):byte()
        save(split[1], c, k, img)
      end
    end
  end
end

print(string.format('make_imagefolder: wrote %d images (%dx%d, quality %d, %d classes) under %s in %.1f s', written, W, H,
  opt.quality, opt.classes, opt.out, dlua.perf_counter() - t0))
