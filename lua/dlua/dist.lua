-- dlua.dist: ranks, process groups and collectives, named as in torch.distributed (docs/dist.md).
local dlua = require 'dlua'
local binding = require 'bindings.dist'
local store_binding = require 'bindings.store'

local dist = {}
local format = string.format

-- Reduction names; dist.ReduceOp.SUM etc. exist for code written against torch.distributed.
dist.ReduceOp = { SUM = 'sum', AVG = 'avg', MAX = 'max', MIN = 'min', PRODUCT = 'product' }
local op_alias = { sum = 'sum', avg = 'avg', mean = 'avg', max = 'max', min = 'min', product = 'product',
                   prod = 'product' }

local S = nil  -- the initialised state: rank, world, store, groups...

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

local function need_init(op, level)
  if S == nil then fail(level + 1, '%s: dlua.dist is not initialised: call dlua.dist.init() first', op) end
end

---------------------------------------------------------------------------------------------
-- Where this process sits in a job: dlua's launcher and torchrun set RANK..., Slurm
-- SLURM_PROCID..., Open MPI OMPI_COMM_WORLD_*; none of them: a world of one.

local function num(name) return tonumber(os.getenv(name) or '') end

-- The first host of a Slurm node list: "gpu[07-09,12],cpu01" → "gpu07".
function dist._slurm_first_host(list)
  local head = list:match('^([^,%[]+)')
  if head == nil then return nil end
  local rest = list:sub(#head + 1)
  if rest:sub(1, 1) == '[' then
    local first = rest:match('^%[([^,%-%]]+)')
    return head .. first
  end
  return head
end

-- An MPI process manager started this process (mpirun, srun --mpi=pmix|pmi2), not just variables that say
-- so, and this build has MPI: MPI_Init then joins the real job rather than a world of one, and rank 0 can
-- tell the others where the store is. (Without MPI built, such a job needs MASTER_ADDR across nodes.)
local function mpi_process_manager()
  return (os.getenv('PMIX_RANK') ~= nil or os.getenv('PMI_RANK') ~= nil) and binding.mpi_unavailable() == nil
end

function dist._environment()
  local e = {}
  if num('RANK') and num('WORLD_SIZE') then
    e.source = os.getenv('DLUA_LAUNCHER') and 'dlua' or 'torchrun'
    e.rank, e.world = num('RANK'), num('WORLD_SIZE')
    e.local_rank = num('LOCAL_RANK') or 0
    e.local_world = num('LOCAL_WORLD_SIZE') or e.world
    e.host, e.port = os.getenv('MASTER_ADDR') or '127.0.0.1', num('MASTER_PORT') or 29500
    e.job = os.getenv('TORCHELASTIC_RUN_ID')
  elseif num('OMPI_COMM_WORLD_RANK') and num('OMPI_COMM_WORLD_SIZE') then
    e.source = 'Open MPI'
    e.rank, e.world = num('OMPI_COMM_WORLD_RANK'), num('OMPI_COMM_WORLD_SIZE')
    e.local_rank = num('OMPI_COMM_WORLD_LOCAL_RANK') or 0
    e.local_world = num('OMPI_COMM_WORLD_LOCAL_SIZE') or e.world
    e.mpi_launch = mpi_process_manager()
    e.host = os.getenv('MASTER_ADDR')
    if e.host == nil then
      if e.local_world ~= e.world and not e.mpi_launch then
        fail(3, 'dist.init: an Open MPI job over several nodes needs MASTER_ADDR (the host of rank 0)')
      end
      e.host = e.local_world == e.world and '127.0.0.1' or nil  -- nil: rank 0 says, over MPI
    end
    e.port = num('MASTER_PORT') or 29500
    e.job = os.getenv('OMPI_MCA_ess_base_jobid')
  elseif num('SLURM_PROCID') and num('SLURM_NTASKS') then
    e.source = 'Slurm'
    e.rank, e.world = num('SLURM_PROCID'), num('SLURM_NTASKS')
    e.local_rank = num('SLURM_LOCALID') or 0
    local per_node = (os.getenv('SLURM_NTASKS_PER_NODE') or os.getenv('SLURM_TASKS_PER_NODE') or ''):match('^(%d+)')
    e.local_world = tonumber(per_node or '') or e.world
    e.mpi_launch = mpi_process_manager()
    e.host = os.getenv('MASTER_ADDR')
    if e.host == nil then
      local list = os.getenv('SLURM_JOB_NODELIST') or os.getenv('SLURM_NODELIST')
      e.host = list and dist._slurm_first_host(list) or '127.0.0.1'
    end
    e.port = num('MASTER_PORT') or 29500
    e.job = os.getenv('SLURM_JOB_ID')
  else
    e.source = 'single process'
    e.rank, e.world, e.local_rank, e.local_world = 0, 1, 0, 1
    e.host, e.port = '127.0.0.1', 0
  end
  if e.rank < 0 or e.rank >= e.world then
    fail(3, 'dist.init: rank %d is outside 0..%d (from the %s environment)', e.rank, e.world - 1, e.source)
  end
  e.token = os.getenv('DLUA_JOB_TOKEN')
  if (e.token == nil or e.token == '') and e.host then
    -- ranks started by another launcher agree on a token without talking first
    e.token = format('dlua:%s:%d:%s', e.host, e.port, e.job or '')
  end
  return e
end

---------------------------------------------------------------------------------------------
-- init / destroy

local function is_loopback(host) return host == '127.0.0.1' or host == 'localhost' or host == '::1' end

-- 16 random bytes as hex: the job token rank 0 hands out over MPI.
local function random_token()
  local f = io.open('/dev/urandom', 'rb')
  local b = f and f:read(16) or tostring(os.time()) .. tostring(os.clock())
  if f then f:close() end
  return (b:gsub('.', function(c) return format('%02x', c:byte()) end))
end

-- Launched by mpirun or srun: rank 0 serves the store on any free port (MASTER_PORT if set) and tells the
-- others where, and the token, over MPI; so no MASTER_ADDR/MASTER_PORT is needed and jobs never collide.
local function store_over_mpi(e, timeout)
  local mrank, msize = binding.mpi_world()
  if e.source == 'single process' then
    e.rank, e.world, e.local_rank, e.local_world = mrank, msize, 0, msize
  elseif mrank ~= e.rank or msize ~= e.world then
    fail(3, 'dist.init: MPI says rank %d of %d, the %s variables rank %d of %d', mrank, msize, e.source, e.rank, e.world)
  end
  local single = e.local_world == e.world
  local server, msg
  if e.rank == 0 then
    local host = os.getenv('MASTER_ADDR') or (single and '127.0.0.1') or os.getenv('PMIX_HOSTNAME')
                 or os.getenv('SLURMD_NODENAME')
    if host == nil then
      local h = io.popen('hostname 2>/dev/null')
      host = h and h:read('*l') or 'localhost'
      if h then h:close() end
    end
    local token = os.getenv('DLUA_JOB_TOKEN')
    if token == nil or token == '' then token = random_token() end
    local ok, err = pcall(store_binding.serve, single and is_loopback(host) and '127.0.0.1' or '0.0.0.0',
                          num('MASTER_PORT') or 0, token)
    if ok then
      server = err
      msg = format('ok\t%s\t%d\t%s', host, server.port, token)
    else
      msg = 'error\t' .. tostring(err):sub(1, 400)  -- the others fail too, with rank 0's reason
    end
  end
  local got = binding.mpi_broadcast(msg, 0, 2048, timeout)
  local status, a, b, c = got:match('^(%a+)\t([^\t]*)\t?([^\t]*)\t?(.*)$')
  if status ~= 'ok' then
    if server then server:stop() end
    fail(3, 'dist.init: rank 0 could not start the store: %s', a or got)
  end
  e.host, e.port, e.token = a, tonumber(b), c
  return server
end

-- dist.init{backend='auto'|'gloo'|'nccl'|'mpi', timeout=seconds}: joins the job this process
-- belongs to. timeout (default DLUA_DIST_TIMEOUT or 300 s) bounds every collective. gloo runs
-- CPU tensors (and CUDA ones, staged through pinned memory); nccl runs CUDA tensors on the GPU
-- LOCAL_RANK % device_count; mpi runs what gloo does, over MPI (ranks started by mpirun or srun);
-- auto is mpi under mpirun/srun in a build with MPI, else gloo, and adds nccl when every local rank
-- has its own GPU.
function dist.init(opts)
  opts = opts or {}
  if type(opts) ~= 'table' then fail(2, 'dist.init: expected an options table, got %s', type(opts)) end
  for k in pairs(opts) do
    if k ~= 'backend' and k ~= 'timeout' and k ~= 'debug' then
      fail(2, "dist.init: unknown option '%s' (expected backend, timeout, debug)", tostring(k))
    end
  end
  if S ~= nil then fail(2, 'dist.init: already initialised (rank %d of %d)', S.rank, S.world) end
  local backend = opts.backend or 'auto'
  if backend ~= 'auto' and backend ~= 'gloo' and backend ~= 'nccl' and backend ~= 'mpi' then
    fail(2, "dist.init: unknown backend '%s' (expected 'auto', 'gloo', 'nccl' or 'mpi')", tostring(backend))
  end
  local timeout = opts.timeout or num('DLUA_DIST_TIMEOUT') or 300
  if type(timeout) ~= 'number' or timeout <= 0 then fail(2, 'dist.init: timeout must be a positive number of seconds') end
  local e = dist._environment()
  local mpi_why = binding.mpi_unavailable()
  if backend == 'mpi' then
    if mpi_why then fail(2, 'dist.init: backend mpi: %s', mpi_why) end
    if os.getenv('DLUA_LAUNCHER') then
      fail(2, 'dist.init: backend mpi needs ranks started by mpirun or srun; dlua --nproc starts its own (use gloo '
           .. "there, or run 'mpirun -np %d dlua script.lua')", e.world)
    end
    if e.source ~= 'single process' and not e.mpi_launch then
      fail(2, 'dist.init: backend mpi: the %s variables say rank %d of %d, but no MPI process manager started this '
           .. 'process (PMIX_RANK and PMI_RANK are unset): launch it with mpirun, or srun --mpi=pmix', e.source,
           e.rank, e.world)
    end
  end
  local use_mpi = backend == 'mpi' or (backend == 'auto' and e.mpi_launch and not mpi_why)
  -- NCCL needs the GPUs; auto uses them when there is one per local rank (else gloo/mpi stage CUDA tensors)
  local ndev = (backend == 'auto' or backend == 'nccl') and dlua.cuda.device_count() or 0
  if backend == 'nccl' and ndev == 0 then
    fail(2, 'dist.init: backend nccl: no CUDA device available (%s); use gloo, or auto',
         tostring(dlua.cuda.unavailable_reason()))
  end
  local server
  if e.mpi_launch and not mpi_why and not os.getenv('DLUA_LAUNCHER') then server = store_over_mpi(e, timeout) end
  local use_nccl = ndev > 0 and (backend == 'nccl' or e.local_world <= ndev)
  -- auto without a loadable NCCL (as PyTorch's default): each rank still takes its GPU, gloo stages CUDA tensors
  local nccl_why = use_nccl and backend == 'auto' and binding.nccl_unavailable() or nil
  if nccl_why then use_nccl = false end
  if backend == 'nccl' and not use_nccl then
    fail(2, "dist.init: backend nccl: %d ranks on this node share %d GPU%s; NCCL needs one per rank (backend='gloo' "
         .. 'stages CUDA tensors through host memory)', e.local_world, ndev, ndev == 1 and '' or 's')
  end
  local cpu = backend ~= 'nccl' and (use_mpi and 'mpi' or 'gloo') or nil
  local s = { rank = e.rank, world = e.world, local_rank = e.local_rank, local_world = e.local_world,
              source = e.source, timeout = timeout, groups = {}, next_group = 0, cpu = cpu,
              backend = cpu == nil and 'nccl' or use_nccl and cpu .. '+nccl' or cpu }
  -- dlua's launcher owns the store; otherwise rank 0 serves it, as torch's TCPStore does
  s.server = server
  if not server and not os.getenv('DLUA_LAUNCHER') and e.rank == 0 then
    local bind = is_loopback(e.host) and '127.0.0.1' or '0.0.0.0'
    s.server = store_binding.serve(bind, e.port, e.token)
    e.port = s.server.port
  end
  s.host, s.port, s.token = e.host, e.port, e.token
  s.store = store_binding.connect(e.host, e.port, e.token, timeout)
  if cpu then s.world_group = binding[cpu](e.host, e.port, e.token, 'pg0', e.rank, e.world, timeout) end
  if use_nccl or nccl_why then  -- this rank's GPU: LOCAL_RANK modulo the GPUs, made current
    s.device = e.local_rank % ndev
    dlua.cuda.set_device(s.device)
  end
  if use_nccl then s.world_nccl = binding.nccl(e.host, e.port, e.token, 'nccl0', e.rank, e.world, s.device, timeout) end
  if nccl_why and e.rank == 0 then
    io.stderr:write(string.format('dist.init: NCCL unavailable (%s): CUDA tensors go through %s\n', nccl_why, cpu))
  end
  s.next_group = 1
  local debug_on = opts.debug
  if debug_on == nil then debug_on = os.getenv('DLUA_DIST_DEBUG') == '1' end
  s.debug = debug_on and true or false
  if s.debug then
    if s.world_group then s.world_group:set_debug(true) end
    if s.world_nccl then s.world_nccl:set_debug(true) end
  end
  S = s
  return dist
end

function dist.is_initialized() return S ~= nil end
-- Whether this build has the MPI backend, and if not why: torch.distributed.is_mpi_available.
function dist.is_mpi_available()
  local why = binding.mpi_unavailable()
  return why == nil, why
end
-- Whether NCCL can be used (libnccl.so.2 loads, version 2.14 or newer), and if not why: torch.distributed.is_nccl_available.
function dist.is_nccl_available()
  local why = binding.nccl_unavailable()
  return why == nil, why
end
function dist.rank() need_init('rank', 2) return S.rank end
function dist.world_size() need_init('world_size', 2) return S.world end
function dist.local_rank() need_init('local_rank', 2) return S.local_rank end
function dist.local_world_size() need_init('local_world_size', 2) return S.local_world end
function dist.backend() need_init('backend', 2) return S.backend end
-- How the world group's CPU all-reduces travel: 'shm' (every rank on this host) or 'tcp' (gloo), and why;
-- 'nccl' under backend='nccl'.
function dist.transport()
  need_init('transport', 2)
  return (S.world_group or S.world_nccl):transport()
end
-- This rank's device: 'cuda:N' when it drives a GPU through NCCL (LOCAL_RANK modulo the GPUs), else 'cpu'.
function dist.device() need_init('device', 2) return S.device and ('cuda:' .. S.device) or 'cpu' end
-- The job's key-value store (set/get/add/wait/check/delete), for recipes that need one.
function dist.store() need_init('store', 2) return S.store end

-- Leaves the job: frees every group and the store. Rank 0, when it serves the store,
-- waits (bounded by the timeout) until every rank has left.
function dist.destroy()
  if S == nil then return end
  local s = S
  S = nil
  for _, g in ipairs(s.groups) do
    if g.pg then g.pg:free() end
    if g.nccl then g.nccl:free() end
  end
  if s.world_group then s.world_group:free() end
  if s.world_nccl then s.world_nccl:free() end
  pcall(function()
    s.store:add('dlua/dist/left', 1)
    if s.server then
      local deadline = dlua.perf_counter() + s.timeout
      while s.store:add('dlua/dist/left', 0) < s.world and dlua.perf_counter() < deadline do
        s.store:wait({ 'dlua/dist/never' }, 0.05)
      end
    end
  end)
  s.store:close()
  if s.server then s.server:stop() end
end

---------------------------------------------------------------------------------------------
-- Groups

local Group = {}
Group.__index = Group

-- A sub-group of the given ranks (0-based, as everywhere in dlua.dist). Every rank of the
-- world calls it, in the same order; a rank outside `ranks` gets a group it cannot use
-- (group:is_member() is false), as torch.distributed's new_group does.
function dist.new_group(ranks, opts)
  need_init('new_group', 2)
  local list = {}
  if ranks == nil then
    for r = 0, S.world - 1 do list[#list + 1] = r end
  else
    if type(ranks) ~= 'table' then fail(2, 'new_group: expected a list of ranks, got %s', type(ranks)) end
    local seen = {}
    for i, r in ipairs(ranks) do
      if type(r) ~= 'number' or r ~= math.floor(r) or r < 0 or r >= S.world then
        fail(2, 'new_group: ranks[%d] = %s is not a rank of this job (0..%d)', i, tostring(r), S.world - 1)
      end
      if seen[r] then fail(2, 'new_group: rank %d is listed twice', r) end
      seen[r] = true
      list[#list + 1] = r
    end
    if #list == 0 then fail(2, 'new_group: no ranks given') end
  end
  table.sort(list)
  local id = S.next_group
  S.next_group = id + 1
  local g = setmetatable({ ranks = list, id = id }, Group)
  for i, r in ipairs(list) do
    if r == S.rank then g.group_rank = i - 1 end
  end
  if g.group_rank ~= nil then
    local timeout = (opts and opts.timeout) or S.timeout
    if S.world_group then g.pg = binding[S.cpu](S.host, S.port, S.token, 'pg' .. id, g.group_rank, #list, timeout) end
    if S.world_nccl then
      g.nccl = binding.nccl(S.host, S.port, S.token, 'nccl' .. id, g.group_rank, #list, S.device, timeout)
    end
    if S.debug then
      if g.pg then g.pg:set_debug(true) end
      if g.nccl then g.nccl:set_debug(true) end
    end
  end
  S.groups[#S.groups + 1] = g
  return g
end

-- A group that only its members create (dist.new_group needs every rank of the world, in the same
-- order): `key`, the same on every member and unique in the job, names it in the store. A pipeline
-- makes one per pair of neighbouring stages and direction this way, while the other pipelines make
-- their own.
function dist.new_group_of(ranks, key, opts)
  need_init('new_group_of', 2)
  if type(ranks) ~= 'table' or #ranks == 0 then fail(2, 'new_group_of: expected a list of ranks') end
  if type(key) ~= 'string' or key == '' then fail(2, 'new_group_of: expected a key naming the group') end
  local list, seen = {}, {}
  for i, r in ipairs(ranks) do
    if type(r) ~= 'number' or r ~= math.floor(r) or r < 0 or r >= S.world then
      fail(2, 'new_group_of: ranks[%d] = %s is not a rank of this job (0..%d)', i, tostring(r), S.world - 1)
    end
    if seen[r] then fail(2, 'new_group_of: rank %d is listed twice', r) end
    seen[r] = true
    list[#list + 1] = r
  end
  table.sort(list)
  local g = setmetatable({ ranks = list, key = key }, Group)
  for i, r in ipairs(list) do
    if r == S.rank then g.group_rank = i - 1 end
  end
  if g.group_rank == nil then fail(2, 'new_group_of: rank %d is not in ranks %s (only members call it)', S.rank, table.concat(list, ',')) end
  local timeout = (opts and opts.timeout) or S.timeout
  if S.world_group then g.pg = binding.gloo(S.host, S.port, S.token, 'pgk/' .. key, g.group_rank, #list, timeout) end
  if S.world_nccl then
    g.nccl = binding.nccl(S.host, S.port, S.token, 'ncclk/' .. key, g.group_rank, #list, S.device, timeout)
  end
  if S.debug then
    if g.pg then g.pg:set_debug(true) end
    if g.nccl then g.nccl:set_debug(true) end
  end
  S.groups[#S.groups + 1] = g
  return g
end

function Group:is_member() return self.group_rank ~= nil end
function Group:rank() return self.group_rank end  -- nil outside the group
function Group:size() return #self.ranks end
-- The world rank of the group's rank r.
function Group:global_rank(r) return self.ranks[r + 1] end

-- The process group a collective on tensor t runs on (NCCL for CUDA tensors when it is live,
-- else gloo), its size and this rank's place in it.
local function pg_of(op, opts, t)
  need_init(op, 3)
  local g = opts and opts.group
  local gloo, nccl, size, me = S.world_group, S.world_nccl, S.world, S.rank
  if g ~= nil then
    if getmetatable(g) ~= Group then fail(3, '%s: group must come from dist.new_group', op) end
    if g.group_rank == nil then
      fail(3, '%s: rank %d is not a member of this group (ranks %s)', op, S.rank, table.concat(g.ranks, ','))
    end
    gloo, nccl, size, me = g.pg, g.nccl, #g.ranks, g.group_rank
  end
  if nccl ~= nil and (gloo == nil or (dlua.is_tensor(t) and t.is_cuda)) then return nccl, size, me end
  return gloo, size, me
end

local function check_opts(op, opts, extra)
  if opts == nil then return nil end
  if type(opts) ~= 'table' then fail(3, '%s: expected an options table, got %s', op, type(opts)) end
  for k in pairs(opts) do
    if k ~= 'group' and k ~= 'async' and not (extra and extra[k]) then
      fail(3, "%s: unknown option '%s'", op, tostring(k))
    end
  end
  return opts
end

-- dist.shared_zeros(numel, dtype, {group=}): a zeroed 1-D CPU tensor whose memory every rank of the group
-- maps, so all-reduces of its ranges read the peers' copies in place (DDP puts its gradient arena there);
-- nil and why when the ranks do not share a host (or DLUA_SHM=0). Every rank calls it alike.
function dist.shared_zeros(numel, dtype, opts)
  need_init('shared_zeros', 2)
  if type(numel) ~= 'number' or numel < 0 or numel ~= math.floor(numel) then
    fail(2, 'shared_zeros: numel must be a whole number >= 0, got %s', tostring(numel))
  end
  local pg = pg_of('shared_zeros', check_opts('shared_zeros', opts))  -- nccl-only: nil and why
  return pg:shared_zeros(numel, dtype or 'float32')
end

local function reduce_op(op, name)
  local o = op_alias[name or 'sum']
  if o == nil then
    fail(3, "%s: unknown reduce op '%s' (expected sum, avg, max, min or product)", op, tostring(name))
  end
  return o
end

local function peer(op, what, r, size)
  if type(r) ~= 'number' or r ~= math.floor(r) or r < 0 or r >= size then
    fail(3, '%s: %s %s is not a rank of the group (0..%d)', op, what, tostring(r), size - 1)
  end
  return r
end

---------------------------------------------------------------------------------------------
-- Collectives. Each takes an options table last: {group=, async=true}. With async the call
-- returns a work handle (work:wait(), work:is_completed()); without, it returns when done.

-- In place: every rank's t becomes the reduction over ranks (op: 'sum' default, 'avg',
-- 'max', 'min', 'product').
function dist.all_reduce(t, op, opts)
  if type(op) == 'table' then op, opts = nil, op end
  opts = check_opts('all_reduce', opts)
  local pg = pg_of('all_reduce', opts, t)
  return pg:all_reduce(t, reduce_op('all_reduce', op), opts and opts.async)
end

-- One collective that reduces every tensor of the list in place (NCCL: one grouped call), as
-- DDP does for its buckets. The group is chosen by the first tensor.
function dist.all_reduce_many(list, op, opts)
  if type(op) == 'table' then op, opts = nil, op end
  opts = check_opts('all_reduce_many', opts)
  if type(list) ~= 'table' then fail(2, 'all_reduce_many: expected a list of tensors, got %s', type(list)) end
  local pg = pg_of('all_reduce_many', opts, list[1])
  return pg:all_reduce_many(list, reduce_op('all_reduce_many', op), opts and opts.async)
end

-- In place: every rank's t becomes rank src's.
function dist.broadcast(t, src, opts)
  opts = check_opts('broadcast', opts)
  local pg, size = pg_of('broadcast', opts, t)
  return pg:broadcast(t, peer('broadcast', 'src', src or 0, size), opts and opts.async)
end

-- outs[r + 1] receives rank r's t. With outs = nil, the outputs are allocated: t's shape
-- when every rank's t has as many elements, else flat tensors of each rank's size.
function dist.all_gather(outs, t, opts)
  opts = check_opts('all_gather', opts)
  local pg, size = pg_of('all_gather', opts, t)
  if outs == nil then
    if not dlua.is_tensor(t) then fail(2, 'all_gather: expected a tensor to gather, got %s', type(t)) end
    local dev = t.device  -- the sizes travel where t does (an NCCL group takes only CUDA tensors)
    local n = dlua.tensor({ t:numel() }, { dtype = 'int64' }):to(dev)
    local ns = {}
    for r = 1, size do ns[r] = dlua.empty({ 1 }, { dtype = 'int64', device = dev }) end
    pg:all_gather(ns, n, false)
    local same = true
    for r = 1, size do
      ns[r] = ns[r]:to('cpu'):item()
      if ns[r] ~= t:numel() then same = false end
    end
    outs = {}
    for r = 1, size do
      outs[r] = dlua.empty(same and t:size() or { ns[r] }, { dtype = t.dtype, device = dev })
    end
  end
  return pg:all_gather(outs, t, opts and opts.async)
end

-- out = the reduction over ranks of their ins[rank + 1] (ins: one tensor per rank).
function dist.reduce_scatter(out, ins, op, opts)
  if type(op) == 'table' then op, opts = nil, op end
  opts = check_opts('reduce_scatter', opts)
  local pg = pg_of('reduce_scatter', opts, out)
  return pg:reduce_scatter(out, ins, reduce_op('reduce_scatter', op), opts and opts.async)
end

-- ins[r + 1] goes to rank r; outs[r + 1] receives what rank r sent here.
function dist.all_to_all(outs, ins, opts)
  opts = check_opts('all_to_all', opts)
  local pg = pg_of('all_to_all', opts, type(ins) == 'table' and ins[1] or nil)
  return pg:all_to_all(outs, ins, opts and opts.async)
end

function dist.barrier(opts)
  opts = check_opts('barrier', opts)
  local pg = pg_of('barrier', opts)
  return pg:barrier(opts and opts.async)
end

local tag_opt = { tag = true }

function dist.send(t, dst, opts)
  opts = check_opts('send', opts, tag_opt)
  local pg, size, me = pg_of('send', opts, t)
  peer('send', 'dst', dst, size)
  if dst == me then fail(2, 'send: rank %d cannot send to itself', me) end
  return pg:send(t, dst, opts and opts.tag or 0, opts and opts.async)
end

function dist.recv(t, src, opts)
  opts = check_opts('recv', opts, tag_opt)
  local pg, size, me = pg_of('recv', opts, t)
  peer('recv', 'src', src, size)
  if src == me then fail(2, 'recv: rank %d cannot receive from itself', me) end
  return pg:recv(t, src, opts and opts.tag or 0, opts and opts.async)
end

function dist.isend(t, dst, opts)
  opts = opts or {}
  opts.async = true
  return dist.send(t, dst, opts)
end

function dist.irecv(t, src, opts)
  opts = opts or {}
  opts.async = true
  return dist.recv(t, src, opts)
end

-- Data-parallel training (lua/dlua/ddp.lua, docs/ddp.md).
function dist.DDP(model, opts) return require('dlua.ddp').new(dist, model, opts) end
-- Gradient compression hooks for DDP (lua/dlua/compress.lua): dist.compress.fp16(), .topk{...}, .powersgd{...}, .from_spec(s).
dist.compress = require 'dlua.compress'
-- Sharded data parallelism, ZeRO stages 1-3 (lua/dlua/zero.lua, docs/zero.md).
function dist.ZeRO(model, opts) return require('dlua.zero').new(dist, model, opts) end

-- Pipeline parallelism (lua/dlua/pipeline.lua, docs/pipeline.md): dist.Pipeline(stages, opts),
-- dist.Pipeline.split(model, n), dist.Pipeline.groups(p).
dist.Pipeline = setmetatable({}, {
  __call = function(_, stages, opts)
    local p = require('dlua.pipeline').new(dist, stages, opts)
    return p  -- not a tail call: errors point at the caller's line
  end,
  __index = function(_, k) return require('dlua.pipeline')[k] end,
})

return dist
