-- dlua.data.files: IDX and MNIST files, JPEG and PNG images read and written.
local binding = require 'bindings.data'
local U = require 'dlua.data.util'

local data = U.data
local reraise, check_options = U.reraise, U.check_options

---------------------------------------------------------------------------------------------
-- Files

-- An IDX file (gzipped or not) as a tensor: uint8 (N, H, W) for MNIST images, (N) for labels
-- (the file's values: label files hold 0-based classes).
data.read_idx = binding.read_idx
-- An MNIST pair (images file, labels file): images uint8 (N, H, W), labels int64 (N) counted from 1.
data.read_mnist = binding.read_mnist

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

return data
