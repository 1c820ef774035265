-- dlua experiment accumulation: peak memory and img/s for accumulate 1/2/4/8 at one global batch (recipes/resnet50_ddp.lua, 2 ranks).
return function(ctx, E)
  local o = ctx.opts
  local ranks = tonumber(o.ranks) or 2
  local model = o.model or 'resnet18'
  local image = tonumber(o.image) or (ctx.tiny and 16 or 32)  -- micro-batches of 2 at least: batch-norm needs 2 values
  local per_rank = tonumber(o.batch) or (ctx.tiny and 16 or 64)  -- images per rank per optimizer step
  local steps = tonumber(o.steps) or (ctx.tiny and 2 or 6)
  local ks = { 1, 2, 4, 8 }
  local rows, runs, notes = {}, {}, {}
  for _, k in ipairs(ks) do
    if per_rank % k == 0 then
      local r = ctx:recipe(('accumulate-%d'):format(k), 'recipes/resnet50_ddp.lua', { '--model', model, '--image-size', tostring(image),
        '--batch', tostring(math.floor(per_rank / k)), '--accumulate', tostring(k), '--limit', tostring(ranks * per_rank * steps),
        '--epochs', '1', '--warmup', '0', '--eval-limit', tostring(ranks * 8), '--print-every', '1000' }, { nproc = ranks })
      if r then
        local s = r.summary
        rows[#rows + 1] = { accumulate = k, micro_batch = per_rank / k, img_s = s.img_s_after_first or s.img_s,
          peak_mb = E.max_of(r, 'mem_peak_backward_bytes') / 2 ^ 20, step_peak_mb = E.max_of(r, 'mem_peak_bytes') / 2 ^ 20, step_ms = (E.mean_after_first(r, 'time_s') or 0) * 1e3,
          comm_ms = (E.mean_after_first(r, 'comm_s') or 0) * 1e3, loss = s.loss }
        runs[#runs + 1] = r
      else
        rows[#rows + 1] = { accumulate = k, micro_batch = per_rank / k }
      end
    end
  end
  local base = rows[1] and rows[1].peak_mb
  for _, r in ipairs(rows) do
    if base and r.peak_mb then r.memory_vs_1 = r.peak_mb / base end
  end
  notes[#notes + 1] = ('global batch %d (%d ranks x %d per rank per step), %s at %dx%d, %d steps; img/s and step time '
    .. 'leave out the first step; peak: rank 0\'s tensor memory at its highest through backward (model, '
    .. 'gradients, optimizer state and activations; step peak: also the optimizer step\'s temporaries).'):format(ranks * per_rank, ranks,
    per_rank, model, image, image, steps)
  ctx:table({ title = ('gradient accumulation at a fixed global batch of %d'):format(ranks * per_rank),
    columns = { { 'accumulate', 'accumulate', '%d' }, { 'micro_batch', 'micro-batch', '%d' }, { 'img_s', 'img/s', '%.1f' },
      { 'step_ms', 'step ms', '%.0f' }, { 'comm_ms', 'comm wait ms', '%.1f' }, { 'peak_mb', 'peak MB', '%.1f' },
      { 'memory_vs_1', 'peak vs 1', '%.3f' }, { 'step_peak_mb', 'step peak MB', '%.1f' } },
    rows = rows, notes = notes })
  local cats, ips, mem = {}, { label = 'img/s', y = {} }, { label = 'peak MB', y = {} }
  for i, r in ipairs(rows) do
    cats[i] = ('accumulate %d'):format(r.accumulate)
    ips.y[i], mem.y[i] = r.img_s, r.peak_mb
  end
  ctx:figure({ title = ('gradient accumulation, global batch %d, %s %dpx'):format(ranks * per_rank, model, image), panels = {
    { title = 'throughput', ylabel = 'img/s', kind = 'bars', categories = cats, series = { ips } },
    { title = 'peak tensor memory through backward (rank 0)', ylabel = 'MB', kind = 'bars', categories = cats, series = { mem } },
  } })
end
