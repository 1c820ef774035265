-- dlua experiment buckets: DDP step time over bucket sizes and first-bucket sizes (one 2-rank job), then bucket_mb = 'auto' in a real run.
local dlua = require 'dlua'

return function(ctx, E)
  local o = ctx.opts
  local ranks = tonumber(o.ranks) or 2
  local model = o.model or 'resnet18'
  local image, batch = tonumber(o.image) or (ctx.tiny and 8 or 32), tonumber(o.batch) or (ctx.tiny and 2 or 16)
  local sizes = ctx.tiny and { 1, 16, 256 } or { 1, 2, 4, 8, 16, 32, 64, 128, 256 }
  local firsts = ctx.tiny and { 1 } or { 1, 4, 16 }
  local plans = {}
  for _, f in ipairs(firsts) do
    for _, s in ipairs(sizes) do plans[#plans + 1] = s .. ':' .. f end
  end
  ctx:log('- the sweep: %d plans, %s %dpx batch %d per rank', #plans, model, image, batch)
  local ok, out = ctx:run({ nproc = ranks, ranks_output = '0', args = { 'bench/exercises/ddp_worker.lua', '--sizes', '',
    '--model', model, '--image', tostring(image), '--batch', tostring(batch), '--steps', ctx.tiny and '1' or '5',
    '--plans', table.concat(plans, ',') } })
  if not ok then error('experiment buckets: the sweep failed (see above)', 0) end
  local rows, by_first, grad_mb, best = {}, {}, nil, nil
  for line in out:gmatch('[^\n]+') do
    local f = {}
    for c in line:gsub('^%[0%] ', ''):gmatch('[^\t]+') do f[#f + 1] = c end
    if f[1] == 'gradients' then grad_mb = tonumber(f[2]) end
    if f[1] == 'ddp' then
      local r = { plan = f[6] == 'same' and 'fixed (as above)' or 'fixed', bucket_mb = tonumber(f[2]), first_mb = tonumber(f[3]),
        buckets = tonumber(f[4]), step_ms = tonumber(f[5]) * 1e3 }
      rows[#rows + 1] = r
      by_first[r.first_mb] = by_first[r.first_mb] or { label = ('first bucket %g MB'):format(r.first_mb), x = {}, y = {} }
      local s = by_first[r.first_mb]
      s.x[#s.x + 1], s.y[#s.y + 1] = r.bucket_mb, r.step_ms
      if best == nil or r.step_ms < best.step_ms then best = r end
    end
  end
  if #rows == 0 then error('experiment buckets: the sweep printed no step times:\n' .. out, 0) end

  -- bucket_mb = 'auto' in the recipe: enough steps for every candidate (3 timed steps each after one
  -- warm-up step), and a few after the choice
  local steps = 6 * 3 + 1 + 4
  local limit = ranks * batch * steps
  local r, rout, why = ctx:recipe('auto', 'recipes/resnet50_ddp.lua', { '--model', model, '--image-size', tostring(image),
    '--batch', tostring(batch), '--limit', tostring(limit), '--epochs', '1', '--warmup', '0', '--eval-limit', tostring(ranks * 8),
    '--bucket-mb', 'auto', '--print-every', '100' }, { nproc = ranks })
  local notes = {}
  local choice = r and r.summary.bucket_choice
  if type(choice) == 'table' then
    rows[#rows + 1] = { plan = 'auto (recipe)', bucket_mb = choice.bucket_mb, first_mb = 1, buckets = choice.buckets,
      step_ms = choice.seconds * 1e3 }
    notes[#notes + 1] = ('bucket_mb = auto kept %g MB (%d buckets) after timing %d plans in steps %d-%d of the run; '
      .. 'the sweep\'s fastest plan was %g MB, first bucket %g MB (%.1f ms).'):format(choice.bucket_mb, choice.buckets,
      #choice.candidates, choice.first_step, choice.last_step, best.bucket_mb, best.first_mb, best.step_ms)
  else
    notes[#notes + 1] = 'bucket_mb = auto: ' .. (why or 'the run ended before it chose') .. (rout and ('\n' .. rout:sub(-400)) or '')
  end
  if grad_mb then notes[#notes + 1] = ('%s has %.1f MB of float32 gradients.'):format(model, grad_mb) end
  notes[#notes + 1] = '"as above": the plan cuts the arena as an earlier row\'s did, so it is that plan, timed once.'
  ctx:table({ title = ('DDP step time by bucket plan, %d ranks, %s %dpx batch %d per rank (fastest of %d steps)'):format(ranks,
    model, image, batch, ctx.tiny and 1 or 5),
    columns = { { 'plan', 'plan' }, { 'bucket_mb', 'bucket MB', '%g' }, { 'first_mb', 'first bucket MB', '%g' },
      { 'buckets', 'buckets', '%d' }, { 'step_ms', 'step ms', '%.1f' } },
    rows = rows, notes = notes })
  local series = {}
  for _, f in ipairs(firsts) do series[#series + 1] = by_first[f] end
  ctx:figure({ title = ('DDP step time by bucket size, %d ranks%s'):format(ranks,
    type(choice) == 'table' and (', auto kept %g MB'):format(choice.bucket_mb) or ''), panels = {
      { title = ('%s %dpx, batch %d per rank'):format(model, image, batch), xlabel = 'bucket_mb', ylabel = 'ms per step',
        logx = true, kind = 'linespoints', series = series },
    } })
end
