-- dlua.plot: PNG figures drawn by gnuplot (Debian gnuplot-nox): curves and grouped bars, and `dlua plot` for metrics files.
--   plot.figure{ out = 'f.png', panels = { { title = 'loss', series = { { label = 'run', x = {1, 2}, y = {0.9, 0.7} } } } } }
local M = {}
local format = string.format

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
-- A gnuplot string: single quotes, '' for a quote; the terminal is noenhanced, so _ and ^ stay.
local function gp(s) return "'" .. tostring(s):gsub("'", "''") .. "'" end

local gnuplot_terminal  -- 'pngcairo' or 'png', once found
-- The gnuplot found on PATH and its PNG terminal, or nil and why.
function M.gnuplot()
  if gnuplot_terminal then return gnuplot_terminal end
  local p = io.popen('command -v gnuplot 2>/dev/null')
  local where = p and p:read('*l')
  if p then p:close() end
  if not where or where == '' then
    return nil, 'gnuplot is not installed (apt-get install gnuplot-nox, or bash scripts/deps.sh)'
  end
  p = io.popen('gnuplot -e "set terminal" 2>&1 </dev/null')
  local list = p and p:read('*a') or ''
  if p then p:close() end
  if list:find('pngcairo', 1, true) then gnuplot_terminal = 'pngcairo'
  elseif list:find('%f[%w]png%f[%W]') then gnuplot_terminal = 'png'
  else return nil, 'this gnuplot has no PNG terminal (pngcairo or png): install gnuplot-nox' end
  return gnuplot_terminal
end

local function num(v)
  if type(v) ~= 'number' or v ~= v or v == math.huge or v == -math.huge then return 'NaN' end
  return format('%.10g', v)
end

local function tmpdir()
  local p = io.popen('mktemp -d 2>/dev/null')
  local d = p and p:read('*l')
  if p then p:close() end
  if not d or d == '' then fail(3, 'plot: cannot make a temporary folder (mktemp -d)') end
  return d
end

-- The gnuplot lines of one panel; data files go in dir.
local function panel_script(panel, pi, dir, files)
  local L = {}
  local function add(fmt, ...) L[#L + 1] = format(fmt, ...) end
  add('set title %s', gp(panel.title or ''))
  add('set xlabel %s', gp(panel.xlabel or ''))
  add('set ylabel %s', gp(panel.ylabel or ''))
  add(panel.logx and 'set logscale x 2' or 'unset logscale x')
  add(panel.logy and 'set logscale y' or 'unset logscale y')
  add('set key %s', panel.key or 'top right')
  add('set grid')
  if panel.yrange then add('set yrange [%s:%s]', num(panel.yrange[1]):gsub('NaN', '*'), num(panel.yrange[2]):gsub('NaN', '*'))
  else add('set yrange [*:*]') end
  local series = panel.series or {}
  if #series == 0 then fail(4, 'plot: panel %d (%s) has no series', pi, tostring(panel.title)) end
  if panel.kind == 'bars' then
    local cats = panel.categories
    if type(cats) ~= 'table' or #cats == 0 then fail(4, 'plot: bar panel %d needs categories', pi) end
    local path = format('%s/p%d.dat', dir, pi)
    local f = assert(io.open(path, 'w'))
    for ci, c in ipairs(cats) do
      local row = { '"' .. tostring(c):gsub('"', "'") .. '"' }
      for _, s in ipairs(series) do row[#row + 1] = num(s.y[ci]) end
      f:write(table.concat(row, '\t'), '\n')
    end
    f:close()
    files[#files + 1] = path
    add('set style data histograms')
    add('set style histogram clustered gap 1')
    add('set style fill solid 0.8 border -1')
    add('set boxwidth 0.9')
    add('set xtics rotate by -20')
    add('set xrange [-0.6:%g]', #cats - 0.4)  -- every category in place, also those without a value
    add('set rmargin 6')
    add('set yrange [0:*]')
    local parts = {}
    for si, s in ipairs(series) do
      parts[si] = format('%s using %d%s title %s', si == 1 and gp(path) or "''", si + 1, si == 1 and ':xtic(1)' or '',
        gp(s.label or ('series ' .. si)))
    end
    add('plot %s', table.concat(parts, ', '))
    add('unset xtics; set xtics norotate; set xtics; set style data lines; set xrange [*:*]; unset rmargin')
    return L
  end
  local style = panel.kind or 'lines'
  local parts = {}
  for si, s in ipairs(series) do
    local x, y = s.x or {}, s.y or {}
    if #x ~= #y then fail(4, 'plot: series %s of panel %s has %d x and %d y values', tostring(s.label), tostring(panel.title), #x, #y) end
    local path = format('%s/p%d_s%d.dat', dir, pi, si)
    local f = assert(io.open(path, 'w'))
    local rows = 0
    for i = 1, #x do
      if num(x[i]) ~= 'NaN' and num(y[i]) ~= 'NaN' then
        f:write(num(x[i]), '\t', num(y[i]), '\n')
        rows = rows + 1
      end
    end
    if rows == 0 then f:write('NaN\tNaN\n') end  -- gnuplot refuses an empty file; NaN draws nothing
    f:close()
    files[#files + 1] = path
    parts[si] = format('%s using 1:2 with %s lw 2 title %s', gp(path), s.style or style, gp(s.label or ('series ' .. si)))
  end
  add('plot %s', table.concat(parts, ', '))
  return L
end

-- figure{out, title, width = 900, height (default 320 per panel, 440 at least), panels = {...}}: one PNG, the panels
-- stacked. A panel: title, xlabel, ylabel, logx, logy, yrange = {lo, hi}, key (gnuplot's `set key`
-- words), kind = 'lines' | 'linespoints' | 'points' | 'bars', series = {{label, x = {...}, y = {...}}}
-- (bars: categories = {...} and each series' y per category). Numbers that are nil or NaN are left out.
function M.figure(spec)
  if type(spec) ~= 'table' then fail(2, 'plot.figure: expected a table, got %s', type(spec)) end
  if type(spec.out) ~= 'string' or spec.out == '' then fail(2, 'plot.figure: out must name the PNG file') end
  if type(spec.panels) ~= 'table' or #spec.panels == 0 then fail(2, 'plot.figure: needs at least one panel') end
  local term, why = M.gnuplot()
  if not term then fail(2, 'plot: %s', why) end
  local n = #spec.panels
  local width, height = spec.width or 900, spec.height or math.max(440, 320 * n)
  local dir = tmpdir()
  local files = {}
  local ok, err = pcall(function()
    local L = {
      format('set terminal %s size %d,%d noenhanced%s', term, width, height, term == 'pngcairo' and " font 'sans,10'" or ''),
      format('set output %s', gp(spec.out)),
      'set datafile missing "NaN"',
      'set datafile separator "\\t"',
      format('set multiplot layout %d,1%s', n, spec.title and (' title ' .. gp(spec.title)) or ''),
    }
    for pi, panel in ipairs(spec.panels) do
      for _, line in ipairs(panel_script(panel, pi, dir, files)) do L[#L + 1] = line end
    end
    L[#L + 1] = 'unset multiplot'
    L[#L + 1] = 'set output'
    local script = dir .. '/plot.gp'
    local f = assert(io.open(script, 'w'))
    f:write(table.concat(L, '\n'), '\n')
    f:close()
    files[#files + 1] = script
    local p = io.popen('gnuplot ' .. shell_quote(script) .. ' 2>&1')
    local out = p:read('*a')
    local done, _, code = p:close()
    if not (done == true or done == 0) then
      error(format('plot: gnuplot failed (exit %s) drawing %s:\n%s', tostring(code), spec.out, out), 0)
    end
  end)
  for _, f in ipairs(files) do os.remove(f) end
  os.remove(dir)
  if not ok then error(err, 2) end
  return spec.out
end

---------------------------------------------------------------------------------------------
-- dlua plot FILE.jsonl [...] -o out.png

local function label_of(r)
  if r.run and type(r.run.label) == 'string' then return r.run.label end
  return (r.path:match('([^/]+)$'):gsub('%.jsonl$', ''):gsub('%.json$', ''))
end

-- A running mean over the last k values (the per-step loss is noisy).
local function smooth(y, k)
  if k <= 1 then return y end
  local r, sum, q = {}, 0, {}
  for i, v in ipairs(y) do
    q[#q + 1] = v
    sum = sum + v
    if #q > k then sum = sum - table.remove(q, 1) end
    r[i] = sum / #q
  end
  return r
end

-- The figure of metrics runs (dlua.metrics.read results): loss, learning rate and img/s against
-- the step (or wall time), one curve per run.
function M.metrics_figure(runs, out, opts)
  opts = opts or {}
  local xkey = opts.x or 'step'
  local fields = { { key = 'loss', title = 'training loss', ylabel = 'loss', smooth = opts.smooth or 1 },
    { key = 'lr', title = 'learning rate', ylabel = 'lr' },
    { key = 'img_s', title = 'throughput', ylabel = 'img/s' } }
  local panels = {}
  for pi, fd in ipairs(fields) do
    local series = {}
    for _, r in ipairs(runs) do
      local x, y = {}, {}
      for i, s in ipairs(r.steps) do
        local xv = s[xkey]
        if xkey == 'step' and type(xv) ~= 'number' then xv = i end
        local v = s[fd.key]
        if type(v) == 'number' and type(xv) == 'number' then x[#x + 1], y[#y + 1] = xv, v end
      end
      series[#series + 1] = { label = label_of(r), x = x, y = fd.smooth and smooth(y, fd.smooth) or y }
    end
    panels[pi] = { title = fd.title .. (fd.smooth and fd.smooth > 1 and format(' (mean of %d steps)', fd.smooth) or ''),
      xlabel = xkey == 'wall_s' and 'seconds' or xkey, ylabel = fd.ylabel, series = series,
      logy = fd.key == 'loss' and opts.log_loss or nil }
  end
  return M.figure({ out = out, title = opts.title, panels = panels, width = opts.width, height = opts.height })
end

local usage = [[
usage: dlua plot FILE.jsonl [FILE.jsonl ...] [-o out.png] [--x step|wall_s] [--smooth N] [--title T] [--log-loss]
Draws the training loss, learning rate and img/s of metrics files (a recipe's --metrics, dlua.metrics.Writer)
as one PNG, the runs overlaid (each labelled by its file name). Needs gnuplot (Debian gnuplot-nox).
]]

function M.main(args)
  local files, out, opts = {}, 'metrics.png', {}
  local i = 1
  local function value(name)
    i = i + 1
    if args[i] == nil then
      io.stderr:write(format('dlua plot: %s needs a value\n%s', name, usage))
      os.exit(2)
    end
    return args[i]
  end
  while i <= #args do
    local a = args[i]
    if a == '-h' or a == '--help' then io.stdout:write(usage); return
    elseif a == '-o' or a == '--out' then out = value(a)
    elseif a == '--x' then opts.x = value(a)
    elseif a == '--smooth' then opts.smooth = tonumber(value(a)) or 0
    elseif a == '--title' then opts.title = value(a)
    elseif a == '--log-loss' then opts.log_loss = true
    elseif a:sub(1, 1) == '-' then
      io.stderr:write(format("dlua plot: unknown option '%s'\n%s", a, usage))
      os.exit(2)
    else files[#files + 1] = a end
    i = i + 1
  end
  if #files == 0 then
    io.stderr:write('dlua plot: give at least one metrics file\n' .. usage)
    os.exit(2)
  end
  if opts.x and opts.x ~= 'step' and opts.x ~= 'wall_s' then
    io.stderr:write("dlua plot: --x takes 'step' or 'wall_s'\n")
    os.exit(2)
  end
  if opts.smooth ~= nil and not (opts.smooth >= 1) then
    io.stderr:write('dlua plot: --smooth takes a number >= 1\n')
    os.exit(2)
  end
  local metrics = require 'dlua.metrics'
  local runs = {}
  for k, f in ipairs(files) do
    local ok, r = pcall(metrics.read, f)
    if not ok then error('dlua plot: ' .. tostring(r):gsub('^[^:]*:%d+: ', ''), 0) end
    if #r.steps == 0 then error(format('dlua plot: %s has no step lines (kind = "step")', f), 0) end
    runs[k] = r
  end
  local ok, err = pcall(M.metrics_figure, runs, out, opts)
  if not ok then error('dlua ' .. tostring(err):gsub('^[^:]*:%d+: ', ''), 0) end
  local n = 0
  for _, r in ipairs(runs) do n = n + #r.steps end
  print(format('dlua plot: %s (%d run%s, %d steps)', out, #runs, #runs == 1 and '' or 's', n))
end

return M
