-- tests/dist/collectives.lua on CUDA tensors: every collective's tensors go to this rank's GPU and back, so the same checks cover NCCL and gloo's pinned staging.
-- Run: [dlua --nproc N] dlua tests/gpu/nccl_collectives.lua nccl|gloo|auto [quick]
local dlua = require 'dlua'
local dist = require 'dlua.dist'

local backend = table.remove(arg, 1)
local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local orig = {}
for k, v in pairs(dist) do orig[k] = v end

-- 'cpu-check' runs the same wrapping with CPU copies (no GPU needed): it tests this file itself.
local dev
function dist.init(opts)
  opts = opts or {}
  opts.backend = backend == 'cpu-check' and 'gloo' or backend
  orig.init(opts)
  if backend == 'cpu-check' then
    dev = 'cpu'
  else
    -- nccl/auto made LOCAL_RANK % device_count current; gloo leaves it to us (ranks may share a GPU)
    if backend == 'gloo' then dlua.cuda.set_device(dist.local_rank() % dlua.cuda.device_count()) end
    dev = 'cuda:' .. dlua.cuda.current_device()
  end
  return dist
end

local function up(t) return t:to(dev) end
local function up_list(list)
  local out = {}
  for i, t in ipairs(list) do out[i] = up(t) end
  return out
end
-- Writes the device copies back into the caller's CPU tensors (after the work ends).
local function back(pairs_)
  for _, p in ipairs(pairs_) do p[1]:copy_(p[2]:cpu()) end
end

-- Runs f on the device copies; sync calls copy back at once, async ones when waited for.
local function run(opts, pairs_, f)
  local r = f()
  if opts and opts.async then
    local w = r
    return { wait = function() w:wait(); back(pairs_) end, is_completed = function() return w:is_completed() end }
  end
  back(pairs_)
  return r
end

local function zip(a, b)
  local p = {}
  for i = 1, #a do p[i] = { a[i], b[i] } end
  return p
end

function dist.all_reduce(t, op, opts)
  if type(op) == 'table' then op, opts = nil, op end
  local c = up(t)
  return run(opts, { { t, c } }, function() return orig.all_reduce(c, op, opts) end)
end

function dist.all_reduce_many(list, op, opts)
  if type(op) == 'table' then op, opts = nil, op end
  local cs = up_list(list)
  return run(opts, zip(list, cs), function() return orig.all_reduce_many(cs, op, opts) end)
end

function dist.broadcast(t, src, opts)
  local c = up(t)
  return run(opts, { { t, c } }, function() return orig.broadcast(c, src, opts) end)
end

function dist.all_gather(outs, t, opts)
  if outs == nil then
    local got = orig.all_gather(nil, up(t), opts)
    local res = {}
    for i, g in ipairs(got) do
      if g.device ~= dev then error('all_gather allocated a ' .. g.device .. ' tensor for a ' .. dev .. ' input') end
      res[i] = g:cpu()
    end
    return res
  end
  local cs = up_list(outs)
  return run(opts, zip(outs, cs), function() return orig.all_gather(cs, up(t), opts) end)
end

function dist.reduce_scatter(out, ins, op, opts)
  if type(op) == 'table' then op, opts = nil, op end
  local c = up(out)
  return run(opts, { { out, c } }, function() return orig.reduce_scatter(c, up_list(ins), op, opts) end)
end

function dist.all_to_all(outs, ins, opts)
  local cs = up_list(outs)
  return run(opts, zip(outs, cs), function() return orig.all_to_all(cs, up_list(ins), opts) end)
end

function dist.send(t, dst, opts) return orig.send(up(t), dst, opts) end

function dist.recv(t, src, opts)
  local c = up(t)
  return run(opts, { { t, c } }, function() return orig.recv(c, src, opts) end)
end

dofile(here .. '/../dist/collectives.lua')
