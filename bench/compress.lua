-- bench/compress's dlua side (run by bench/compress under dlua --nproc N): each compression hook over a model's gradient
-- buckets, random gradients, R timed rounds; prints RESULT lines (model, spec, payload bytes, collectives, ms) for the script.
-- usage: dlua --nproc 2 bench/compress.lua MODEL SPECS REPEAT [THREADS]   (MODEL: resnet20 | resnet18; SPECS: comma-separated)
local dlua = require 'dlua'
local resnet = require 'models.resnet'
local dist = dlua.dist
local compress = dist.compress
dist.init{ timeout = 120 }
local rank, world = dist.rank(), dist.world_size()
local model_name, specs, repeat_n = arg[1] or 'resnet20', arg[2] or 'none,fp16', tonumber(arg[3] or '10')
if tonumber(arg[4] or '') then dlua.set_num_threads(tonumber(arg[4])) end

local function build()
  dlua.manual_seed(1)
  if model_name == 'resnet18' then return resnet.resnet18({ num_classes = 1000 }) end
  return resnet.resnet20({ in_channels = 1, num_classes = 10 })
end

-- the hook of a spec, PowerSGD from its first step (the bench measures compression, not its start_step)
local function hook_of(spec)
  if spec == 'none' then return nil end
  local p = spec:match('^powersgd:(%d+)$')
  if p then return compress.powersgd{ rank = tonumber(p), start_step = 0 } end
  return compress.from_spec(spec)
end

-- collectives per bucket a spec issues (for the latency term of the projection)
local function collectives(spec, ddp)
  if spec:find('^powersgd') then
    local n = 0
    for _, b in ipairs(ddp.buckets) do
      local plan = ddp.hook_state._plans and ddp.hook_state:_plan(b)
      n = n + (plan and ((plan.nu > 0 and 1 or 0) + (#plan.mats > 0 and 2 or 0)) or 1)
    end
    return n
  end
  return #ddp.buckets
end

-- BENCH_SEQUENTIAL=1: each bucket's hook finished in wait() alone (no second stage started early), for an A/B
local sequential = os.getenv('BENCH_SEQUENTIAL') == '1'
local g = dlua.Generator(7 + rank)
for spec in specs:gmatch('[^,]+') do
  local ddp = dist.DDP(build(), { hook = hook_of(spec) })
  local grads = ddp.arena.grads.float32
  local source = dlua.randn({ grads:numel() }, { generator = g }) * 1e-2
  local times = dlua.zeros({ repeat_n }, { dtype = 'float64' })
  local function round()
    grads:copy_(source)
    local works = {}
    for i, b in ipairs(ddp.buckets) do works[i] = ddp.hook(ddp.hook_state, b) end
    for i, w in ipairs(works) do  -- DDP:wait's order: a two-stage hook's second stage for i and i+1, then wait i
      if not sequential then
        if w.progress then w.progress() end
        local nx = works[i + 1]
        if nx and nx.progress then nx.progress() end
      end
      w:wait()
    end
  end
  for _ = 1, 2 do round() end  -- buffers sized, PowerSGD's Q made
  ddp:comm_stats{ reset = true }
  local c0 = ddp.comm_counters.bytes
  for r = 1, repeat_n do
    dist.barrier()
    local t0 = dlua.perf_counter()
    round()
    times[r] = dlua.perf_counter() - t0
  end
  local bytes = (ddp.comm_counters.bytes - c0) / repeat_n
  local compress_s = ddp.comm_counters.compress_s / repeat_n
  dist.all_reduce(times, 'max')  -- a round lasts as long as its slowest rank
  local sorted = times:sort()
  local med = sorted[math.floor((repeat_n + 1) / 2)]
  local c = dlua.tensor({ compress_s }, { dtype = 'float64' })
  dist.all_reduce(c, 'max')
  if rank == 0 then
    print(string.format('RESULT %s %s %d %d %d %.3f %.3f', model_name, spec, grads:numel() * 4, bytes, collectives(spec, ddp),
      med * 1e3, c[1] * 1e3))
  end
  ddp = nil
  collectgarbage()
end
dist.destroy()
