-- Activation checkpointing under DDP: checkpointed blocks give bit-identical gradients to plain ones on every rank, each
-- module's gradients are marked ready once (PyTorch's "Expected to mark a variable ready only once" cannot happen),
-- buckets still start during backward; with SyncBatchNorm too (the recompute's statistics all-reduce again); ZeRO
-- stages 2 and 3 (one parameter gather per module per pass serves the recompute and the backward); pipeline stages.
-- Run: dlua --nproc N tests/dist/actckpt.lua
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local resnet = require 'models.resnet'
local dist = dlua.dist
dist.init{ timeout = 60 }
local rank, world = dist.rank(), dist.world_size()
local checks = 0
local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end

local function net(sync)
  dlua.manual_seed(21)
  local m = resnet.resnet20({ num_classes = 7 }):input_grad(false)
  m:walk(function(_, mod)
    if mod.running_mean then mod.weight:uniform_(0.5, 1.5); mod.bias:uniform_(-0.2, 0.2) end
  end)
  if sync then nn.SyncBatchNorm.convert(m) end
  return m
end

local B = 3
local function batch(s)  -- this rank's slice of step s's global batch
  local g = dlua.Generator(300 + s)
  local x = dlua.randn({ B * world, 3, 10, 10 }, { generator = g })
  local y = dlua.randint(1, 8, { B * world }, { generator = g, dtype = 'int64' })
  return x:narrow(1, rank * B + 1, B):contiguous(), y:narrow(1, rank * B + 1, B):contiguous()
end

-- modules with parameters: DDP marks each one's gradients ready after its backward
local function param_modules(m)
  local r = {}
  m:walk(function(_, mod) if #mod._params > 0 then r[#r + 1] = mod end end)
  return r
end

local function identical(a, b, what)
  if not a:eq(b):all():item() then
    fail('%s: not bit-identical (max |diff| %g)', what, (a:double() - b:double()):abs():max():item())
  end
end

-- 1. plain, 'blocks' before DDP, 'stages' after DDP: 3 SGD steps, gradients and parameters bit-identical
for _, sync in ipairs({ false, true }) do
  local what = sync and 'SyncBatchNorm' or 'BatchNorm2d'
  local runs = {}
  for i, policy in ipairs({ 'none', 'blocks', 'stages' }) do
    local m = net(sync)
    if policy == 'blocks' then m:checkpoint('blocks') end
    local ddp = dist.DDP(m, { first_bucket_mb = 0.01, bucket_mb = 0.05 })
    if policy == 'stages' then m:checkpoint('stages') end
    local during = 0
    ddp:register_comm_hook(nil, function(_, bucket)
      if ddp._in_backward then during = during + 1 end
      return dist.all_reduce(bucket.tensor, 'avg', { async = true })
    end)
    runs[i] = { policy = policy, model = m, ddp = ddp, opt = optim.SGD(ddp, { lr = 0.05, momentum = 0.9 }),
                crit = nn.CrossEntropyLoss(), mods = param_modules(m), during = function() return during end }
    if #ddp:bucket_plan() < 3 then fail('expected several buckets, got %d', #ddp:bucket_plan()) end
  end
  for s = 1, (sync and 1 or 3) do
    local x, y = batch(s)
    for _, r in ipairs(runs) do
      r.opt:zero_grad()
      local out = r.ddp:forward(x)
      r.loss = r.crit:forward(out, y):item()
      r.ddp:backward(x, r.crit:backward(out, y))
      for _, mod in ipairs(r.mods) do
        local n = r.ddp._module_calls[mod]
        if n ~= 1 then fail('%s %s step %d: a module\'s gradients were marked ready %s times', what, r.policy, s, tostring(n)) end
      end
      r.ddp:wait()
    end
    local g0 = runs[1].model:flatten().grads.float32
    for k = 2, #runs do
      local r = runs[k]
      if r.loss ~= runs[1].loss then fail('%s %s step %d: loss %.9g, plain %.9g', what, r.policy, s, r.loss, runs[1].loss) end
      identical(r.model:flatten().grads.float32, g0, string.format('%s %s step %d: gradients after DDP', what, r.policy, s))
      if r.during() < 1 then fail('%s %s: no bucket started during backward', what, r.policy) end
    end
    for _, r in ipairs(runs) do r.opt:step() end
  end
  for k = 2, #runs do
    identical(runs[k].model:flatten().params.float32, runs[1].model:flatten().params.float32,
      string.format('%s %s: parameters after training', what, runs[k].policy))
    local rb, pb = runs[k].model:named_buffers(), runs[1].model:named_buffers()
    for j, e in ipairs(rb) do identical(e.buffer, pb[j].buffer, what .. ' ' .. runs[k].policy .. ': ' .. e.name) end
  end
  checks = checks + 1
end

-- 2. ZeRO stages 2 and 3: checkpointed blocks train to the same parameters; under stage 3 every module's
-- parameters are gathered once per backward pass, for its recompute and its backward together
local function flat_params(model)
  local sd = model:state_dict()  -- gathers under stage 3
  local parts = {}
  for _, k in ipairs(sd:keys()) do
    if not k:find('running_') and not k:find('num_batches') then parts[#parts + 1] = sd[k]:contiguous():view(sd[k]:numel()) end
  end
  return dlua.cat(parts, 1)
end
local gg = dist.new_group()
for _, stage in ipairs({ 2, 3 }) do
  local want
  for _, policy in ipairs({ 'none', 'blocks' }) do
    local m = net(false)
    m:checkpoint(policy)
    local z = dist.ZeRO(m, { stage = stage, bucket_mb = 0.05, first_bucket_mb = 0.01, gather_group = stage == 3 and gg or nil })
    local opt = optim.SGD(z, { lr = 0.05, momentum = 0.9 })
    local crit = nn.CrossEntropyLoss()
    local issued = {}
    if stage == 3 then
      local issue = z._issue
      z._issue = function(zz, u, ph)
        local c = issued[ph.kind] or {}
        issued[ph.kind] = c
        c[u] = (c[u] or 0) + 1
        return issue(zz, u, ph)
      end
    end
    for s = 1, 2 do
      issued = {}
      local x, y = batch(s)
      opt:zero_grad()
      local out = z:forward(x)
      crit:forward(out, y)
      z:backward(x, crit:backward(out, y))
      opt:step()
      if stage == 3 then
        for _, kind in ipairs({ 'forward', 'backward' }) do
          local units = 0
          for _, c in pairs(issued[kind] or {}) do
            units = units + 1
            if c ~= 1 then fail('ZeRO-3 %s step %d: a module gathered %d times in its %s pass', policy, s, c, kind) end
          end
          if units ~= #z.units then fail('ZeRO-3 %s: %d of %d modules gathered in the %s pass', policy, units, #z.units, kind) end
        end
      end
    end
    local got = flat_params(z)
    if want == nil then want = got else identical(got, want, string.format('ZeRO-%d blocks: parameters after training', stage)) end
  end
  checks = checks + 1
end

-- 3. pipeline stages (dist.Pipeline) holding checkpointed blocks: several micro-batches' forwards before their
-- backwards, each one's fields kept aside and put back; gradients and running statistics as without checkpointing
for _, schedule in ipairs({ 'gpipe', '1f1b' }) do
  local got = {}
  for _, policy in ipairs({ 'none', 'blocks' }) do
    local m = net(false)
    m:checkpoint(policy)
    local pipe = dist.Pipeline(dist.Pipeline.split(m, world), { chunks = 3, schedule = schedule, loss = nn.CrossEntropyLoss() })
    local g = dlua.Generator(77)
    local x = dlua.randn({ 7, 3, 10, 10 }, { generator = g })
    local y = dlua.randint(1, 8, { 7 }, { generator = g, dtype = 'int64' })
    for _ = 1, 2 do
      pipe:zero_grad()
      pipe:step(rank == 0 and x or nil, rank == world - 1 and y or nil)
    end
    local r = {}
    for _, e in ipairs(pipe:named_parameters()) do r[e.name] = e.grad:clone() end
    for _, e in ipairs(pipe.module:named_buffers()) do r[e.name] = e.buffer:clone() end
    got[policy] = r
  end
  local n = 0
  for name, t in pairs(got.none) do
    identical(got.blocks[name], t, string.format('pipeline %s, blocks: %s', schedule, name))
    n = n + 1
  end
  if n == 0 then fail('pipeline %s: nothing compared', schedule) end
  checks = checks + 1
end

-- 4. the failure checkpointing avoids: a recompute that ran a module's backward a second time is refused
do
  dlua.manual_seed(5)
  local lin = nn.Linear(4, 3)
  local Twice = nn.Module:extend('Twice')
  function Twice:__init(m) self:add_module('m', m) end
  function Twice:forward(x) return self.m:forward(x) end
  function Twice:backward(x, g) self.m:backward(x, g); return self.m:backward(x, g) end
  local ddp = dist.DDP(nn.Sequential(Twice(lin)))
  local x = dlua.randn(2, 4)
  local out = ddp:forward(x)
  local ok, err = pcall(ddp.backward, ddp, x, dlua.ones(out:size()))
  if ok or not tostring(err):find('ran backward twice in one step', 1, true) then
    fail('a second backward of one module was not caught: %s', tostring(err))
  end
  checks = checks + 1
end

dist.barrier()
print(string.format('rank %d of %d: %d activation checkpointing checks passed', rank, world, checks))
dist.destroy()
