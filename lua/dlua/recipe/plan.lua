-- dlua.recipe.plan: what train{} is about to do, as lines: world, batches, learning rate, parallelism, precision, memory per rank.
local M = {}
local format = string.format

local function mb(b) return format('%.1f MB', b / 2 ^ 20) end

-- Bytes of optimizer state per parameter (float32): SGD's momentum, Adam's two moments.
local state_words = { sgd = 1, lars = 1, adam = 2, adamw = 2, lamb = 2 }

-- The model states per rank (float32 parameters, gradients, optimizer state), as the ZeRO paper counts
-- them: stage 1 shards the optimizer state, 2 the gradients too, 3 the parameters too; a pipeline
-- holds about 1/stages of the model.
function M.memory(c, params)
  local p = c.parallel
  local words = state_words[c.optim.name] or 1
  if c.optim.name == 'sgd' and c.optim.momentum == 0 then words = 0 end
  local n = c.stages > 0 and params / c.stages or params
  local shards = c.stages > 0 and c.replicas or c.world
  local w, g, o = 4 * n, 4 * n, 4 * words * n
  if p.zero >= 1 then o = o / shards end
  if p.zero >= 2 then g = g / shards end
  if p.zero >= 3 then w = w / shards end
  return { parameters = w, gradients = g, optimizer = o, total = w + g + o }
end

-- lines(c, info): info = {params =, steps_per_epoch =, total =, warm =, peak =, device =, backend =,
-- data =, model =, threads =}
function M.lines(c, info)
  local p, d = c.parallel, c.data
  local L = {}
  local function add(fmt, ...) L[#L + 1] = format(fmt, ...) end
  add('plan: %s', c.name)
  add('  model      %s, %d parameters, %d classes', info.model, info.params, info.classes)
  if d.train then
    add('  data       %s, %d samples per replica', info.data, info.samples or 0)
  else
    add('  data       %s, %dx%d, %d channel%s%s', info.data, info.image_size, info.image_size, info.channels,
      info.channels == 1 and '' or 's', d.channels_last and ', channels-last' or '')
  end
  add('  world      %d rank%s (%d per node), %s, %s, %d threads per rank', c.world, c.world == 1 and '' or 's', c.local_world,
    info.backend, info.device == 'cpu' and 'CPU' or info.device, info.threads)
  if c.stages > 0 then
    add('  batch      %d pipelines x %d stages x batch %d in %d micro-batches (%s) = global batch %d', c.replicas, c.stages, d.batch,
      p.pipeline.chunks, p.pipeline.schedule, c.global_batch)
  else
    add('  batch      %d rank%s x batch %d x accumulate %d = global batch %d', c.replicas, c.replicas == 1 and '' or 's', d.batch,
      c.accumulate, c.global_batch)
  end
  add('  steps      %d steps of %d images, %d per epoch, %d epoch%s', info.total, c.global_batch, info.steps_per_epoch, c.epochs,
    c.epochs == 1 and '' or 's')
  local o = c.optim
  add('  lr         %s %.4g%s; %s', o.name, info.peak,
    o.scale_lr > 0 and format(' (%.3g per %d images x global batch %d, linear scaling rule)', o.lr, o.scale_lr, c.global_batch) or '',
    info.schedule)
  local par
  if c.stages > 0 then
    par = format('pipeline of %d stages (split by %s), %s across the %d replicas of each stage', c.stages, p.pipeline.split,
      p.zero == 1 and 'ZeRO-1' or 'DDP', c.replicas)
  elseif p.zero > 0 then
    par = format('ZeRO-%d over %d rank%s%s', p.zero, c.world, c.world == 1 and '' or 's', p.offload and ', optimizer state offloaded' or '')
  elseif c.world > 1 then
    par = format('DDP, buckets of %s MB', tostring(p.ddp.bucket_mb))
  else
    par = 'one rank: no gradient reduction'
  end
  if p.compress ~= 'none' then par = par .. ', gradients compressed ' .. p.compress end
  if p.sync_bn then par = par .. ', SyncBatchNorm' end
  add('  parallel   %s', par)
  add('  precision  %s%s', c.amp == 'off' and 'float32' or c.amp == 'bf16' and 'bf16 autocast, float32 master weights'
    or 'f16 autocast with loss scaling, float32 master weights', c.amp_why and ' (' .. c.amp_why .. ')' or '')
  local m = M.memory(c, info.params)
  add('  memory     %s model states per rank (parameters %s, gradients %s, optimizer %s), activations not counted', mb(m.total),
    mb(m.parameters), mb(m.gradients), mb(m.optimizer))
  if c.activation_checkpoint ~= 'none' then add('  activations recomputed in backward: %s', c.activation_checkpoint) end
  if c.clip_grad > 0 then add('  clip_grad  %g', c.clip_grad) end
  local k = c.checkpoint
  if k.dir ~= '' then
    add('  checkpoint %s, %s%s%s', k.dir, k.every > 0 and format('every %d steps', k.every) or 'at the end',
      k.keep > 0 and format(', keep %d', k.keep) or '', k.async and ', async' or '')
  end
  if k.resume ~= '' then add('  resume     %s', k.resume) end
  if k.stop_after > 0 then add('  stop after %d steps', k.stop_after) end
  return L
end

return M
