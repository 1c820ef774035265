-- DDP and ZeRO stages 1-3 trained a few steps; rank 0 prints a CRC32 of each case's parameters, which tests/dist/test_mpi.sh compares between backends (gloo under dlua --nproc, MPI under mpirun: at 2 ranks the same bits).
--   dlua --nproc 2 tests/dist/train_crc.lua        mpirun -np 2 dlua tests/dist/train_crc.lua
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local ckpt = require 'dlua.ckpt'
local dist = dlua.dist
dist.init{ timeout = 60 }
local rank, world = dist.rank(), dist.world_size()

-- 7 -> 11 -> 6 -> 3: 181 parameters, a prime, so ZeRO's shards (and its reduce-scatter parts) differ in size
local function mlp(seed)
  dlua.manual_seed(seed)
  return nn.Sequential{ nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 6), nn.ReLU(), nn.Linear(6, 3) }
end

local B = 5  -- rows per rank per micro-batch
local function batch(s, k)
  local g = dlua.Generator(1000 + 17 * s + k)
  local x = dlua.randn({ B * world, 7 }, { generator = g })
  local y = dlua.randint(1, 4, { B * world }, { generator = g, dtype = 'int64' })
  return x:narrow(1, rank * B + 1, B):contiguous(), y:narrow(1, rank * B + 1, B):contiguous()
end

-- stage 0: DDP. Each rank starts from other weights: the wrapper's broadcast from rank 0 must undo that.
local function case(stage, oname, accumulate)
  local net = mlp(rank == 0 and 7 or 50 + rank)
  -- buckets of ~200 bytes: several per arena, straddling the shard boundaries
  local opts = { bucket_mb = 0.0002, first_bucket_mb = 0.0001, accumulate = accumulate }
  local model
  if stage == 0 then model = dist.DDP(net, opts) else opts.stage = stage; model = dist.ZeRO(net, opts) end
  local opt = oname == 'sgd' and optim.SGD(model, { lr = 0.1, momentum = 0.9, weight_decay = 1e-3 })
              or optim.AdamW(model, { lr = 0.01, weight_decay = 0.01 })
  local crit = nn.CrossEntropyLoss()
  for s = 1, 6 do
    opt:zero_grad()
    for k = 1, accumulate or 1 do
      local x, y = batch(s, k)
      local out = model:forward(x)
      crit:forward(out, y)
      model:backward(x, crit:backward(out, y))
    end
    opt:step()
  end
  local crc = ckpt.crc32(model)  -- whole parameters (stage 3 gathers them for its state dict)
  if rank == 0 then print(string.format('crc %s stage %d%s: %s', oname, stage, accumulate and ' accumulate ' .. accumulate or '', crc)) end
end

case(0, 'sgd')
case(0, 'adamw')
case(0, 'adamw', 2)
for stage = 1, 3 do case(stage, 'adamw') end
case(2, 'sgd', 2)
dist.barrier()
if rank == 0 then print(string.format('trained over %s (%s)', dist.backend(), (dist.transport()))) end
dist.destroy()
