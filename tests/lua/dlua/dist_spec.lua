-- dlua.dist and DDP in one process (a world of one): environment parsing, the errors bad input gets, DDP's plan and arithmetic.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local dist = dlua.dist

local function err_of(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok, 'expected an error')
  return tostring(e)
end

local function has(msg, part)
  assert.is_truthy(msg:find(part, 1, true), string.format('%q does not contain %q', msg, part))
end

describe('dlua.dist before init', function()
  it('every query says init is needed', function()
    assert.is_false(dist.is_initialized())
    has(err_of(dist.rank), 'rank: dlua.dist is not initialised: call dlua.dist.init() first')
    has(err_of(dist.all_reduce, dlua.ones({ 2 })), 'all_reduce: dlua.dist is not initialised')
    has(err_of(dist.DDP, nn.Linear(2, 2)), 'DDP: dlua.dist is not initialised')
  end)

  it('init rejects bad options by name', function()
    has(err_of(dist.init, { backnd = 'gloo' }), "dist.init: unknown option 'backnd'")
    has(err_of(dist.init, { backend = 'ucc' }), "unknown backend 'ucc' (expected 'auto', 'gloo', 'nccl' or 'mpi')")
    if not dist.is_mpi_available() then  -- with MPI built, backend mpi in a world of one is fine (tests/dist/test_mpi.sh)
      has(err_of(dist.init, { backend = 'mpi' }), 'dist.init: backend mpi: built without MPI')
    end
    if not dlua.cuda.is_available() then  -- with a GPU, nccl in a world of one is fine
      has(err_of(dist.init, { backend = 'nccl' }), 'dist.init: backend nccl: no CUDA device available (')
    end
    has(err_of(dist.init, { timeout = -1 }), 'timeout must be a positive number')
    assert.is_false(dist.is_initialized())
  end)

  it('reads the first host of a Slurm node list', function()
    assert.equals('gpu07', dist._slurm_first_host('gpu[07-09,12],cpu01'))
    assert.equals('n1', dist._slurm_first_host('n1,n2'))
    assert.equals('solo', dist._slurm_first_host('solo'))
  end)
end)

describe('dlua.dist in a world of one', function()
  setup(function() dist.init({ timeout = 20 }) end)
  teardown(function() dist.destroy() end)

  it('is rank 0 of 1 and collectives are identities', function()
    assert.equals(0, dist.rank()); assert.equals(1, dist.world_size()); assert.equals(0, dist.local_rank())
    -- auto: NCCL beside gloo where there is a GPU and NCCL loads; the GPU either way
    assert.equals(dlua.cuda.is_available() and dist.is_nccl_available() and 'gloo+nccl' or 'gloo', dist.backend())
    assert.equals(dlua.cuda.is_available() and 'cuda:0' or 'cpu', dist.device())
    has(err_of(dist.init), 'already initialised (rank 0 of 1)')
    local t = dlua.tensor({ 1, 2, 3 })
    dist.all_reduce(t, 'avg')
    assert.same({ 1, 2, 3 }, t:totable())
    local parts = dist.all_gather(nil, t)
    assert.equals(1, #parts)
    assert.same({ 1, 2, 3 }, parts[1]:totable())
    local w = dist.all_reduce(t, dist.ReduceOp.MAX, { async = true })
    w:wait()
    assert.is_true(w:is_completed())
    dist.barrier()
  end)

  it('all_reduce_many reduces a list in one collective', function()
    local a, b = dlua.tensor({ 1, 2 }), dlua.tensor({ 5 }, { dtype = 'int64' })
    local out = dist.all_reduce_many({ a, b }, 'sum')
    assert.equals(a, out[1])
    assert.same({ 1, 2 }, a:totable()); assert.same({ 5 }, b:totable())
    dist.all_reduce_many({ a }, 'avg', { async = true }):wait()
    assert.same({ 1, 2 }, a:totable())
    has(err_of(dist.all_reduce_many, { a, b }, 'avg'), 'all_reduce_many: avg needs a floating dtype, got int64')
    has(err_of(dist.all_reduce_many, a), 'all_reduce_many: expected a list of tensors')
  end)

  it('names the thing at fault', function()
    has(err_of(dist.all_reduce, dlua.ones({ 2 }), 'median'), "all_reduce: unknown reduce op 'median'")
    has(err_of(dist.all_reduce, dlua.ones({ 2 }, { dtype = 'int64' }), 'avg'), 'avg')
    has(err_of(dist.broadcast, dlua.ones({ 2 }), 1), 'broadcast: src 1 is not a rank of the group (0..0)')
    has(err_of(dist.all_reduce, dlua.ones({ 2 }), 'sum', { grp = 1 }), "all_reduce: unknown option 'grp'")
    has(err_of(dist.all_gather, { dlua.ones({ 2 }), dlua.ones({ 2 }) }, dlua.ones({ 2 })), 'list of 1 tensors')
    has(err_of(dist.send, dlua.ones({ 1 }), 0), 'send: rank 0 cannot send to itself')
    has(err_of(dist.new_group, { 0, 3 }), 'new_group: ranks[2] = 3 is not a rank of this job (0..0)')
    has(err_of(dist.new_group, { 0, 0 }), 'rank 0 is listed twice')
    has(err_of(dist.all_reduce, 'x'), 'all_reduce: expected a tensor')
  end)

  it('DDP keeps one-process training unchanged and exposes its bucket plan', function()
    dlua.manual_seed(3)
    local a = nn.Sequential({ nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3) })
    dlua.manual_seed(3)
    local b = nn.Sequential({ nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3) })
    local ddp = dist.DDP(b, { bucket_mb = 1e-4, first_bucket_mb = 1e-4 })
    local oa, ob = optim.SGD(a, { lr = 0.1, momentum = 0.9 }), optim.SGD(ddp, { lr = 0.1, momentum = 0.9 })
    local crit = nn.CrossEntropyLoss()
    for s = 1, 3 do
      local g = dlua.Generator(s)
      local x = dlua.randn({ 5, 6 }, { generator = g })
      local y = dlua.randint(1, 4, { 5 }, { generator = g, dtype = 'int64' })
      for _, m in ipairs({ { a, oa }, { ddp, ob } }) do
        m[2]:zero_grad()
        local out = m[1]:forward(x)
        crit:forward(out, y)
        m[1]:backward(x, crit:backward(out, y))
        m[2]:step()
      end
    end
    local d = (a:flatten().params.float32 - b:flatten().params.float32):abs():max():item()
    assert.is_true(d == 0, 'DDP at world size 1 changed the result by ' .. d)
    local plan = ddp:bucket_plan()
    assert.is_true(#plan >= 2)
    assert.equals('2.bias', plan[1].names[1])
    assert.equals(0, plan[1].offset)
    assert.same(ddp:state_dict():keys(), b:state_dict():keys())
  end)

  it('DDP rejects bad options and plans', function()
    has(err_of(dist.DDP, nn.Linear(2, 2), { acumulate = 2 }), "DDP: unknown option 'acumulate'")
    has(err_of(dist.DDP, nn.Linear(2, 2), { accumulate = 0 }), 'accumulate must be a whole number >= 1')
    has(err_of(dist.DDP, nn.Linear(2, 2), { bucket_mb = -1 }), 'bucket_mb must be a positive number')
    has(err_of(dist.DDP, 42), 'DDP: expected a dlua.nn module')
    local ddp = dist.DDP(nn.Linear(3, 2))
    has(err_of(ddp.set_buckets, ddp, { { dtype = 'float32', offset = 0, numel = 2 } }), 'is in no bucket')
    has(err_of(ddp.register_comm_hook, ddp, nil, 'x'), 'expected a function')
  end)
end)
