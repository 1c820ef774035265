-- Checkpoint speed: a synchronous save of ResNet-50's parameters and momentum against dd's sequential write to the same disk, and the training step's stall under async = true.
--   dlua bench/ckpt.lua DIR [rounds] [batch] [image]   (bench/ckpt runs it; rank-0-only, one process)
-- Each round runs dd, a sync save and an async save back to back (the disk is shared: its speed moves
-- between rounds, so each round's save is compared with its own dd). Prints `key<TAB>value` lines,
-- one `round` line per round.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local ckpt = require 'dlua.ckpt'
local resnet = require 'models.resnet'

local dir, rounds = arg[1], tonumber(arg[2]) or 3
local batch, image = tonumber(arg[3]) or 4, tonumber(arg[4]) or 64
os.execute("mkdir -p '" .. dir .. "'")
dlua.manual_seed(0)
local net = resnet.resnet50({ num_classes = 1000 }):input_grad(false)
local opt = optim.SGD(net, { lr = 0.01, momentum = 0.9 })
local crit = nn.CrossEntropyLoss()
local x = dlua.randn(batch, 3, image, image):contiguous('channels_last')
local y = dlua.randint(1, 1001, batch)
local function step()
  opt:zero_grad()
  local out = net:forward(x)
  crit:forward(out, y)
  net:backward(x, crit:backward(out, y))
  opt:step()
end
step()  -- momentum exists from here
local state = { model = net, optimizer = opt, progress = { step = 0 } }

local function du(path)  -- bytes of the files of a checkpoint
  local h = io.popen("du -sb '" .. path .. "' | cut -f1")
  local n = tonumber(h:read('*l'))
  h:close()
  return n
end

local bytes, snap
local s = 0
for _ = 1, rounds do
  -- dd: as many bytes as a checkpoint, to a fresh file in the same directory, flushed
  local size = bytes or 210e6
  local t0 = dlua.perf_counter()
  os.execute(string.format("dd if=/dev/zero of='%s/dd.bin' bs=8M count=%d conv=fsync status=none", dir, math.ceil(size / 2 ^ 23)))
  local dd = math.ceil(size / 2 ^ 23) * 2 ^ 23 / (dlua.perf_counter() - t0)
  os.remove(dir .. '/dd.bin')
  local round = { dd = dd }
  -- a synchronous save (keep = 1: the previous one goes after it, as in training)
  s = s + 1
  state.progress.step = s
  local info = ckpt.save(dir .. '/ck', state, { step = s, keep = 1 })
  bytes = du(info.path)
  round.sync = bytes / info.seconds
  round.sync_s = info.seconds
  -- training steps alone, then with an async save in flight: the save call, and the steps' slowdown
  local plain = {}
  for k = 1, 3 do
    local t = dlua.perf_counter()
    step()
    plain[k] = dlua.perf_counter() - t
  end
  table.sort(plain)
  local t_step = plain[2]
  s = s + 1
  state.progress.step = s
  local t = dlua.perf_counter()
  local ai = ckpt.save(dir .. '/ck', state, { step = s, keep = 1, async = true })
  local call = dlua.perf_counter() - t
  snap = ai.snapshot_bytes
  local during, n = 0, 0
  while ckpt.busy() do
    t = dlua.perf_counter()
    step()
    during, n = during + dlua.perf_counter() - t, n + 1
  end
  t = dlua.perf_counter()
  ckpt.wait()
  local tail = dlua.perf_counter() - t
  round.call, round.extra, round.step = call, math.max(0, during - n * t_step) + tail, t_step
  print(string.format('round\t%.1f\t%.1f\t%.4f\t%.4f\t%.4f\t%.4f', round.dd / 1e6, round.sync / 1e6, round.sync_s, round.call,
    round.extra, round.step))
end
print('model\tResNet-50 parameters, buffers and SGD momentum; batch ' .. batch .. ' at ' .. image .. 'x' .. image)
print(string.format('bytes\t%d', bytes))
print(string.format('snapshot\t%d', snap))
