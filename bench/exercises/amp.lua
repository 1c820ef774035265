-- dlua experiment amp: float32 / bf16 / f16 img/s, peak memory and accuracy of a short recipes/fashion_mnist.lua run.
-- bf16 and f16 need mixed precision (#20: dlua.amp and the recipes' --amp); without it they are named, not run.
return function(ctx, E)
  local o = ctx.opts
  local model = o.model or 'resnet20'
  local batch = tonumber(o.batch) or (ctx.tiny and 32 or 128)
  local limit = tonumber(o.limit) or (ctx.tiny and 64 or 8192)
  local eval = ctx.tiny and 64 or 2000
  local has_amp = pcall(require, 'dlua.amp') and ctx:recipe_has_option('recipes/fashion_mnist.lua', 'amp')
  local rows, notes, runs = {}, {}, {}
  for _, p in ipairs({ { 'float32', 'off' }, { 'bfloat16', 'bf16' }, { 'float16', 'f16' } }) do
    local name, flag = p[1], p[2]
    if flag ~= 'off' and not has_amp then
      rows[#rows + 1] = { precision = name, status = ctx:missing('needs #20 (dlua.amp, --amp)') }
    else
      local args = { '--model', model, '--batch', tostring(batch), '--limit', tostring(limit), '--eval-limit', tostring(eval),
        '--epochs', '1', '--warmup', '0', '--print-every', '1000' }
      if has_amp then args[#args + 1] = '--amp'; args[#args + 1] = flag end
      local r, _, why = ctx:recipe('amp-' .. flag, 'recipes/fashion_mnist.lua', args)
      if r then
        local s = r.summary
        rows[#rows + 1] = { precision = name, status = 'ran', img_s = s.img_s_after_first or s.img_s,
          peak_mb = E.max_of(r, 'mem_peak_bytes') / 2 ^ 20, accuracy = s.test_accuracy, loss = s.loss, skipped = s.skipped }
        runs[#runs + 1] = { r = r, label = name }
      else
        rows[#rows + 1] = { precision = name, status = 'failed: ' .. tostring(why) }
      end
    end
  end
  local base = rows[1].img_s
  for _, r in ipairs(rows) do if base and r.img_s then r.speedup = r.img_s / base end end
  if not has_amp then notes[#notes + 1] = 'bf16, f16: mixed precision (#20: dlua.amp and --amp in the recipes) is not on this build.' end
  notes[#notes + 1] = ('%s, batch %d, one epoch of %d images, accuracy on %d test images; img/s leaves out the first step.')
    :format(model, batch, limit, eval)
  ctx:table({ title = 'mixed precision: speed, memory and accuracy of a short run', rows = rows, notes = notes,
    columns = { { 'precision', 'precision' }, { 'status', 'run' }, { 'img_s', 'img/s', '%.1f' }, { 'speedup', 'vs float32', '%.2f' },
      { 'peak_mb', 'peak MB', '%.1f' }, { 'accuracy', 'test accuracy', '%.4f' }, { 'loss', 'last loss', '%.4f' },
      { 'skipped', 'skipped steps', '%d' } } })
  local cats, ips, mem = {}, { label = 'img/s', y = {} }, { label = 'peak MB', y = {} }
  for i, r in ipairs(rows) do
    cats[i] = r.img_s and r.precision or (r.precision .. ' (not run)')
    ips.y[i], mem.y[i] = r.img_s, r.peak_mb
  end
  local loss = {}
  for _, run in ipairs(runs) do
    local x, y = {}, {}
    for i, s in ipairs(run.r.steps) do x[i], y[i] = s.step, s.loss end
    loss[#loss + 1] = { label = run.label, x = x, y = y }
  end
  ctx:figure({ title = ('mixed precision, %s batch %d'):format(model, batch), panels = {
    { title = 'throughput', ylabel = 'img/s', kind = 'bars', categories = cats, series = { ips } },
    { title = 'peak tensor memory', ylabel = 'MB', kind = 'bars', categories = cats, series = { mem } },
    { title = 'training loss', xlabel = 'step', ylabel = 'loss', series = loss },
  } })
end
