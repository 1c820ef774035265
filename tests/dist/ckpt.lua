-- dlua.ckpt on several ranks: a DDP model, its optimizer, a sampler cursor and per-rank generators saved by N ranks (full, sharded, async) and loaded on M.
--   dlua --nproc N tests/dist/ckpt.lua save DIR full|sharded|async
--   dlua --nproc M tests/dist/ckpt.lua load DIR
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local data = require 'dlua.data'
local ckpt = require 'dlua.ckpt'
local dist = dlua.dist

local mode, dir, how = arg[1], arg[2], arg[3]
dist.init({ timeout = 60 })
local rank, world = dist.rank(), dist.world_size()
local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end

local N, B = 103, 4  -- samples, per-rank batch
local function model(seed)
  dlua.manual_seed(seed)
  -- batch-norm: running statistics of each rank's own batches (per-rank buffers)
  return dist.DDP(nn.Sequential({ nn.Linear(6, 16), nn.BatchNorm2d(16), nn.ReLU(), nn.Linear(16, 3) }))
end
local g = dlua.Generator(7)
local xs = dlua.randn(N, 6, { generator = g })
local ys = dlua.randint(1, 4, N, { generator = g, dtype = 'int64' })

local function setup(seed)
  local m = model(seed)
  local opt = optim.SGD(m, { lr = 0.1, momentum = 0.9 })
  local sampler = data.DistributedSampler({ n = N, seed = 3 })
  local rng = dlua.Generator(1000 + rank)  -- a stream of this rank's own
  return { model = m, optimizer = opt, sampler = sampler, rng = ckpt.per_rank(rng), progress = { step = 0 } }, rng
end

local function write(path, text)
  local f = assert(io.open(path, 'w'))
  f:write(text)
  f:close()
end
local function read(path)
  local f = assert(io.open(path))
  local s = f:read('*a')
  f:close()
  return s
end

if mode == 'save' then
  local st, rng = setup(11)
  local crit = nn.CrossEntropyLoss()
  st.sampler:set_epoch(2)
  local idx = st.sampler:indices()
  local steps = 5
  for s = 1, steps do
    local pick = idx:narrow(1, (s - 1) * B + 1, B)
    local x, y = xs:index_select(1, pick), ys:index_select(1, pick)
    st.optimizer:zero_grad()
    local out = st.model:forward(x)
    crit:forward(out, y)
    st.model:backward(x, crit:backward(out, y))
    st.optimizer:step()
    st.sampler:advance(B)
    st.progress.step = s
  end
  dlua.rand(rank + 1, { generator = rng })  -- the streams now differ between ranks
  local info = ckpt.save(dir, st, { step = steps, sharded = how == 'sharded', async = how == 'async' })
  if how == 'async' then ckpt.wait() end
  -- what the loads must find: the parameters and momentum, each rank's stream, the samples consumed
  local consumed = {}
  for k = 1, steps * B do consumed[#consumed + 1] = idx[k] end
  local all = dlua.zeros(world * steps * B, { dtype = 'int64' })
  local outs = {}
  for r = 1, world do outs[r] = all:narrow(1, (r - 1) * steps * B + 1, steps * B) end
  dist.all_gather(outs, dlua.tensor(consumed, { dtype = 'int64' }))
  write(dir .. '/expected.' .. rank, string.format('%s %s %s\n', ckpt.crc32(st.model),
    ckpt.crc32({ st.optimizer.state.float32.momentum }), tostring(rng:get_offset())))
  if rank == 0 then write(dir .. '/consumed', table.concat(all:totable(), ' ') .. '\n') end
  print(string.format('saved %s by %d ranks (%s): %d bytes written by rank %d', info.path, world, how, info.bytes, rank))
elseif mode == 'load' then
  local saved = ckpt.load(dir, { progress = {} }, { strict = false })
  local saved_world = saved.world_size
  local st, rng = setup(99)
  -- the same world: this rank's own buffers; another: rank 0's for every rank
  local exp = read(dir .. '/expected.' .. (world == saved_world and rank or 0))
  local want_model, want_mom = exp:match('^(%x+) (%x+)')
  if world ~= saved_world then
    -- each rank's own stream cannot be split over another number of ranks: said, and skipped on demand
    local ok, err = pcall(ckpt.load, dir, st)
    if ok or not tostring(err):find("state 'rng' is per%-rank and its " .. saved_world .. ' saved ranks hold different values') then
      fail('expected the per-rank error, got %s', tostring(err))
    end
    ckpt.load(dir, st, { skip = { 'rng' } })
  else
    ckpt.load(dir, st)
    local mine = read(dir .. '/expected.' .. rank):match(' (%d+)\n$')
    if tostring(rng:get_offset()) ~= mine then fail('generator offset %s, saved %s', tostring(rng:get_offset()), mine) end
  end
  if ckpt.crc32(st.model) ~= want_model then fail('model crc %s, saved %s', ckpt.crc32(st.model), want_model) end
  if ckpt.crc32({ st.optimizer.state.float32.momentum }) ~= want_mom then fail('momentum differs from the saved one') end
  if st.progress.step ~= 5 then fail('progress.step %s', tostring(st.progress.step)) end
  -- the cursor: what this rank still has to take in epoch 2, gathered; with what was consumed, every sample once
  st.sampler:set_epoch(2)
  local idx = st.sampler:indices()
  local rest = idx:narrow(1, st.sampler:skip() + 1, idx:size(1) - st.sampler:skip())
  local n = dlua.tensor({ rest:size(1) }, { dtype = 'int64' })
  dist.all_reduce(n, 'max')
  local padded = dlua.zeros(n[1], { dtype = 'int64' })
  if rest:size(1) > 0 then padded:narrow(1, 1, rest:size(1)):copy_(rest) end
  local lens = dlua.zeros(world, { dtype = 'int64' })
  local louts, outs = {}, {}
  local all = dlua.zeros(world * n[1], { dtype = 'int64' })
  for r = 1, world do
    louts[r] = lens:narrow(1, r, 1)
    outs[r] = all:narrow(1, (r - 1) * n[1] + 1, n[1])
  end
  dist.all_gather(louts, dlua.tensor({ rest:size(1) }, { dtype = 'int64' }))
  dist.all_gather(outs, padded)
  if lens:min():item() ~= lens:max():item() then fail('ranks got different numbers of samples: %s', tostring(lens)) end
  if rank == 0 then
    local seen = {}
    for v in read(dir .. '/consumed'):gmatch('%d+') do seen[tonumber(v)] = (seen[tonumber(v)] or 0) + 1 end
    for r = 1, world do
      local o = outs[r]:narrow(1, 1, lens[r]):totable()
      for _, v in ipairs(o) do seen[v] = (seen[v] or 0) + 1 end
    end
    local extra = 0
    for i = 1, N do
      if not seen[i] then fail('sample %d is in neither the consumed part nor the rest of the epoch', i) end
      extra = extra + seen[i] - 1
    end
    -- repeats come only from padding the last round (< world), and from the saved run's own padding (< saved world)
    if extra >= world + saved_world then fail('%d samples repeat', extra) end
    print(string.format('loaded %d-rank checkpoint on %d ranks: model, momentum and cursor agree (%d samples left per rank)',
      saved_world, world, lens[1]))
  end
else
  error('usage: ckpt.lua save DIR full|sharded|async | load DIR')
end
dist.destroy()
