-- dlua side of bench/loader: ImageFolder + RandomResizedCrop(224) + flip + normalise through the threaded DataLoader.
-- usage: dlua bench/loader.lua run ROOT WORKERS BATCH EPOCHS   -> prints img/s<TAB>best<TAB>worker wall s/img<TAB>
--                                                                 dct-scaled<TAB>process CPU s/img (best epoch)
--        dlua bench/loader.lua dump ROOT COUNT OUT              -> pixels for bench/loader.py check
local dlua = require 'dlua'
local data = require 'dlua.data'

local mode, root = arg[1], arg[2]
local mean, std = { 0.485, 0.456, 0.406 }, { 0.229, 0.224, 0.225 }

if mode == 'run' then
  local workers, batch, epochs = tonumber(arg[3]), tonumber(arg[4]), tonumber(arg[5] or 2)
  local ds = data.ImageFolder(root, { transform = data.Compose {
    data.RandomResizedCrop(224), data.RandomHorizontalFlip(), data.ToTensor(), data.Normalize(mean, std) } })
  local loader = data.DataLoader { dataset = ds, batch = batch, workers = workers, shuffle = true, seed = 1,
    dct_scaling = os.getenv('DCT') ~= '0' }
  local best, best_cpu = 0, math.huge
  for _ = 1, epochs do
    -- os.clock: CPU time of the whole process (every thread), which a shared machine's
    -- load does not inflate the way it does wall time.
    local t0, c0, n = dlua.perf_counter(), os.clock(), 0
    for _, x in loader:batches() do n = n + x:size(1) end
    local rate = n / (dlua.perf_counter() - t0)
    if rate > best then best = rate end
    best_cpu = math.min(best_cpu, (os.clock() - c0) / n)
  end
  local st = loader.stats
  io.write(string.format('img/s\t%.1f\t%.6f\t%d\t%.6f\n', best, st.work_s / st.decoded, st.dct_scaled, best_cpu))
elseif mode == 'dump' then
  -- Pixels (uint8, HWC) for the first COUNT files, full-size decodes (no DCT scaling):
  -- Resize(256) + CenterCrop(224), then RandomResizedCrop(224) with the boxes written next
  -- to them, so torchvision can redo exactly the same crops.
  local count, out = tonumber(arg[3]), arg[4]
  local u8 = data.ToTensor { memory_format = 'channels_last', dtype = 'uint8' }
  local center = data.ImageFolder(root, { transform = data.Compose { data.Resize(256), data.CenterCrop(224), u8 } })
  local rrc_t = data.RandomResizedCrop(224)
  local rrc = data.ImageFolder(root, { transform = data.Compose { rrc_t, u8 } })
  local f = assert(io.open(out, 'wb'))
  local boxes = assert(io.open(out .. '.txt', 'w'))
  for i = 1, math.min(count, center.n) do
    local path = center:path(i)
    local img = data.read_image(path)
    f:write(center:get(i):permute(2, 3, 1):to_bytes())  -- (C, H, W) samples, written as (H, W, C) pixels
    f:write(rrc:get(i):permute(2, 3, 1):to_bytes())
    local top, left, h, w = rrc_t:get_params(img:size(1), img:size(2), { index = i })
    boxes:write(string.format('%s\t%d\t%d\t%d\t%d\n', path, top - 1, left - 1, h, w))
  end
  f:close()
  boxes:close()
else
  io.stderr:write('usage: dlua bench/loader.lua run ROOT WORKERS BATCH EPOCHS | dump ROOT COUNT OUT\n')
  os.exit(2)
end
