-- dlua.recipe.env: joins the job (dist.init, also alone: a world of one), picks and sets this rank's device, threads and seed.
local dlua = require 'dlua'

local env = {}
local format = string.format

-- The device a rank trains on. 'auto': the GPU dist.init gave this rank when every local rank has
-- one (as torchrun + NCCL), else the CPU; 'cuda': the GPU LOCAL_RANK % device_count (ranks may
-- share one); 'cpu'; 'cuda:N' exactly. Refuses a CUDA device on a machine without one, naming why.
function env.pick_device(want, dist)
  want = want or 'auto'
  if type(want) ~= 'string' then error(format('device: expected a string, got %s', type(want)), 0) end
  local device = want
  if want == 'auto' then device = dist.device() end
  if device == 'cpu' then return 'cpu' end
  if device ~= 'cuda' and not device:match('^cuda:%d+$') then
    error(format("device %s: expected 'auto', 'cpu', 'cuda' or 'cuda:N'", want), 0)
  end
  if not dlua.cuda.is_available() then
    error(format('device %s: no CUDA device available (%s)', want, tostring(dlua.cuda.unavailable_reason())), 0)
  end
  if device == 'cuda' then device = 'cuda:' .. (dist.local_rank() % dlua.cuda.device_count()) end
  return device
end

-- setup{device = 'auto', threads = 0, seed = nil, backend = nil}: the job this process belongs to,
-- of any size (dlua --nproc, torchrun, Slurm and Open MPI variables; one process alone is a world
-- of one, so the same code runs everywhere). Returns {rank, world, local_rank, local_world,
-- device, backend, transport}; the device is made current. Joins once: a second call returns the
-- same table.
local current
function env.setup(opts)
  opts = opts or {}
  if current then return current end
  local dist = dlua.dist
  if (opts.threads or 0) > 0 then dlua.set_num_threads(opts.threads) end
  local joined = not dist.is_initialized()
  if joined then dist.init(opts.backend and { backend = opts.backend } or nil) end
  local e = { rank = dist.rank(), world = dist.world_size(), local_rank = dist.local_rank(),
    local_world = dist.local_world_size(), backend = dist.backend() }
  e.device = env.pick_device(opts.device, dist)
  if e.device ~= 'cpu' then dlua.cuda.set_device(e.device) end
  -- CUDA gradients go through NCCL when every rank has a GPU; CPU ones through shared memory or TCP
  e.transport = e.device ~= 'cpu' and e.backend ~= 'gloo' and 'nccl' or dist.transport()
  e.joined = joined
  if opts.seed then dlua.manual_seed(opts.seed) end
  current = e
  return e
end

-- Leaves the job (dist.destroy) if setup joined it (a job the caller had joined is the caller's to leave).
function env.teardown()
  if current and current.joined and dlua.dist.is_initialized() then dlua.dist.destroy() end
  current = nil
end

return env
