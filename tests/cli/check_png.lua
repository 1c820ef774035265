-- Checks a PNG for the experiment tests: it decodes, it is not blank, and (optionally) given line colours cover enough pixels.
-- usage: dlua tests/cli/check_png.lua FILE.png [R,G,B ...]   prints `png W H colours=N ink=F` and one `colour R,G,B pixels=N` each
local dlua = require 'dlua'
local path = assert(arg[1], 'usage: check_png.lua FILE.png [R,G,B ...]')
local img = dlua.data.read_image(path):float()  -- (H, W, 3)
local h, w = img:size(1), img:size(2)
-- ink: pixels that are not the background white
local ink = img:lt(250):float():max(3):sum():item() / (h * w)
-- distinct colours, counted on a 1-in-7 sample of pixels (enough to tell a drawing from a flat image)
local flat = img:view(h * w, 3)
local seen, n = {}, 0
for i = 1, h * w, 7 do
  local key = flat[i][1] * 65536 + flat[i][2] * 256 + flat[i][3]
  if not seen[key] then seen[key], n = true, n + 1 end
end
print(('png %d %d colours=%d ink=%.4f'):format(w, h, n, ink))
for k = 2, #arg do
  local r, g, b = arg[k]:match('^(%d+),(%d+),(%d+)$')
  local c = dlua.tensor({ tonumber(r), tonumber(g), tonumber(b) })
  local near = (img - c):abs():max(3):le(24):float():sum():item()
  print(('colour %s pixels=%d'):format(arg[k], near))
end
