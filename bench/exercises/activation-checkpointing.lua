-- dlua experiment activation-checkpointing: peak memory saved against step time added, per policy (recipes/fashion_mnist.lua).
return function(ctx, E)
  local o = ctx.opts
  local model = o.model or (ctx.tiny and 'resnet20' or 'resnet56')
  local batch = tonumber(o.batch) or (ctx.tiny and 32 or 128)
  local steps = tonumber(o.steps) or (ctx.tiny and 2 or 8)
  local rows, runs = {}, {}
  for _, policy in ipairs({ 'none', 'blocks', 'stages' }) do
    local r, _, why = ctx:recipe('policy-' .. policy, 'recipes/fashion_mnist.lua', { '--model', model, '--batch', tostring(batch),
      '--limit', tostring(batch * steps), '--eval-limit', tostring(ctx.tiny and 64 or 500), '--epochs', '1', '--warmup', '0',
      '--checkpoint-activations', policy, '--print-every', '1000' })
    if r then
      rows[#rows + 1] = { policy = policy, step_ms = E.mean_after_first(r, 'time_s') * 1e3,
        forward_ms = E.mean_after_first(r, 'forward_s') * 1e3, backward_ms = E.mean_after_first(r, 'backward_s') * 1e3,
        peak_mb = E.max_of(r, 'mem_peak_backward_bytes') / 2 ^ 20, step_peak_mb = E.max_of(r, 'mem_peak_bytes') / 2 ^ 20 }
      runs[#runs + 1] = r
    else
      rows[#rows + 1] = { policy = policy, note = why }
    end
  end
  local base = rows[1]
  for _, r in ipairs(rows) do
    if base.peak_mb and r.peak_mb then
      r.saved_mb = base.peak_mb - r.peak_mb
      r.memory_ratio = base.peak_mb / r.peak_mb
      r.time_added = r.step_ms / base.step_ms - 1
    end
  end
  ctx:table({ title = ('activation checkpointing, %s batch %d (one rank, %d steps)'):format(model, batch, steps), rows = rows,
    columns = { { 'policy', 'policy' }, { 'peak_mb', 'peak MB', '%.1f' }, { 'saved_mb', 'saved MB', '%.1f' },
      { 'memory_ratio', 'x lower peak', '%.2f' }, { 'step_ms', 'step ms', '%.0f' }, { 'forward_ms', 'forward ms', '%.0f' },
      { 'backward_ms', 'backward ms', '%.0f' }, { 'time_added', 'time added', '%+.2f' }, { 'step_peak_mb', 'step peak MB', '%.1f' } },
    notes = { 'peak: tensor memory at its highest through backward (model, optimizer state, data and activations); '
      .. 'step times leave out the first step. "blocks" recomputes each residual block in backward, "stages" each stage.' } })
  local cats, mem, t = {}, { label = 'peak MB', y = {} }, { label = 'step ms', y = {} }
  for i, r in ipairs(rows) do
    cats[i] = r.policy
    mem.y[i], t.y[i] = r.peak_mb, r.step_ms
  end
  ctx:figure({ title = ('activation checkpointing, %s batch %d'):format(model, batch), panels = {
    { title = 'peak tensor memory', ylabel = 'MB', kind = 'bars', categories = cats, series = { mem } },
    { title = 'step time', ylabel = 'ms', kind = 'bars', categories = cats, series = { t } },
  } })
end
