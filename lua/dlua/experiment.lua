-- `dlua experiment NAME`: the seed's exercises (bench/exercises/NAME.lua), each a table printed and written, and a PNG.
local dlua = require 'dlua'
local json = require 'dlua.json'
local metrics = require 'dlua.metrics'
local plot = require 'dlua.plot'

local M = {}
local format = string.format

M.names = { 'accumulation', 'backends', 'amp', 'activation-checkpointing', 'buckets' }
M.about = {
  accumulation = 'memory and img/s for accumulate 1/2/4/8 at a fixed global batch (DDP, 2 ranks)',
  backends = 'gloo TCP vs shared memory vs MPI (vs NCCL) all-reduce bandwidth and DDP step time',
  amp = 'float32 / bf16 / f16: speed, memory and accuracy of a short run',
  ['activation-checkpointing'] = 'memory saved against time added, per policy',
  buckets = "DDP step time over bucket sizes 1-256 MB and first-bucket sizes; bucket_mb = 'auto'",
}

-- Each experiment's own options (--name value), with what they set.
M.options = {
  accumulation = { model = 'resnet18', image = 'image side (32; tiny 16)', batch = 'images per rank per step (64; tiny 16)',
    steps = 'optimizer steps per run (6; tiny 2)', ranks = 'ranks (2)' },
  backends = { model = 'resnet18', image = 'image side (32; tiny 8)', batch = 'images per rank (16; tiny 2)', ranks = 'ranks (2)' },
  amp = { model = 'resnet20', batch = 'images per step (128; tiny 32)', limit = 'training images (8192; tiny 64)' },
  ['activation-checkpointing'] = { model = 'resnet56 (tiny resnet20)', batch = 'images per step (128; tiny 32)',
    steps = 'steps per policy (8; tiny 2)' },
  buckets = { model = 'resnet18', image = 'image side (32; tiny 8)', batch = 'images per rank (16; tiny 2)', ranks = 'ranks (2)' },
}

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
M.shell_quote = shell_quote

local Ctx = {}
Ctx.__index = Ctx

function Ctx:log(fmt, ...)
  io.stdout:write(format(fmt, ...), '\n')
  io.stdout:flush()
end

function Ctx:path(name) return self.out .. '/' .. name end

-- Runs dlua (nproc ranks through the launcher when > 1) with args (a list) and env (a table); returns
-- ok, the output (stdout and stderr) and the exit code. A run that fails is logged with its last lines.
function Ctx:run(spec)
  local cmd = {}
  for k, v in pairs(spec.env or {}) do cmd[#cmd + 1] = k .. '=' .. shell_quote(v) end
  cmd[#cmd + 1] = 'timeout ' .. (spec.timeout or self.timeout)
  if spec.mpirun then
    -- the MPI backend needs ranks started by mpirun (root here needs its two consent variables)
    cmd[#cmd + 1] = 'env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np ' .. (spec.nproc or 1)
      .. ' --oversubscribe --bind-to none'
    cmd[#cmd + 1] = shell_quote(self.exe)
  else
    cmd[#cmd + 1] = shell_quote(self.exe)
    if (spec.nproc or 1) > 1 then cmd[#cmd + 1] = '--nproc ' .. spec.nproc end
    if spec.ranks_output then cmd[#cmd + 1] = '--ranks-output ' .. spec.ranks_output end
  end
  for _, a in ipairs(spec.args) do cmd[#cmd + 1] = shell_quote(a) end
  local line = table.concat(cmd, ' ')
  if self.verbose then self:log('  $ %s', line) end
  local p = io.popen('cd ' .. shell_quote(self.root) .. ' && ' .. line .. ' 2>&1')
  local out = p:read('*a')
  local done, _, code = p:close()
  local ok = done == true or done == 0
  if not ok and not spec.quiet then
    local tail = {}
    for l in out:gmatch('[^\n]+') do tail[#tail + 1] = l end
    self:log('  failed (exit %s): %s', tostring(code), line)
    for i = math.max(1, #tail - 6), #tail do self:log('    %s', tail[i]) end
  end
  return ok, out, code
end

-- A recipe run with --metrics; returns its metrics (dlua.metrics.read) or nil, the output and why.
function Ctx:recipe(label, recipe, args, spec)
  spec = spec or {}
  local file = self:path(label .. '.jsonl')
  os.remove(file)
  local full = { recipe }
  for _, a in ipairs(args) do full[#full + 1] = a end
  full[#full + 1] = '--metrics'
  full[#full + 1] = file
  local env = spec.env or {}
  if self.data_root and env.DLUA_FASHION_MNIST_ROOT == nil then env.DLUA_FASHION_MNIST_ROOT = self.data_root end
  self:log('- %s', label)
  local ok, out = self:run({ args = full, nproc = spec.nproc, env = env, timeout = spec.timeout })
  if not ok then return nil, out, 'the run failed' end
  local r = metrics.read(file)
  if not r.summary then return nil, out, 'no summary line in ' .. file end
  return r, out
end

-- Prints the table and writes NAME.md (markdown) and NAME.json ({name, columns, rows, notes}).
-- columns: {{key, title, fmt}}; a row's missing value prints as '-'; notes: lines under the table.
function Ctx:table(t)
  local cols, rows = t.columns, t.rows
  local cells, widths = {}, {}
  for ci, c in ipairs(cols) do widths[ci] = #c[2] end
  for ri, r in ipairs(rows) do
    cells[ri] = {}
    for ci, c in ipairs(cols) do
      local v = r[c[1]]
      local s
      if v == nil or v == json.null then s = '-'
      elseif type(v) == 'number' and c[3] then s = format(c[3], v)
      else s = tostring(v) end
      cells[ri][ci] = s
      widths[ci] = math.max(widths[ci], #s)
    end
  end
  local function line(vals, sep)
    local parts = {}
    -- padded by hand: Lua's %-Ns takes widths up to 99 only, and a cell may hold a long reason
    for ci, v in ipairs(vals) do parts[ci] = v .. string.rep(' ', widths[ci] - #v) end
    return table.concat(parts, sep)
  end
  local titles = {}
  for ci, c in ipairs(cols) do titles[ci] = c[2] end
  self:log('')
  self:log('%s', t.title or self.name)
  self:log('%s', line(titles, '  '))
  for _, r in ipairs(cells) do self:log('%s', line(r, '  ')) end
  for _, n in ipairs(t.notes or {}) do self:log('%s', n) end
  -- markdown
  local md = { '| ' .. table.concat(titles, ' | ') .. ' |' }
  local dashes = {}
  for ci in ipairs(cols) do dashes[ci] = '---' end
  md[#md + 1] = '|' .. table.concat(dashes, '|') .. '|'
  for _, r in ipairs(cells) do md[#md + 1] = '| ' .. table.concat(r, ' | ') .. ' |' end
  if t.notes and #t.notes > 0 then
    md[#md + 1] = ''
    for _, n in ipairs(t.notes) do md[#md + 1] = n end
  end
  local f = assert(io.open(self:path(self.name .. '.md'), 'w'))
  f:write((t.title and ('**' .. t.title .. '**\n\n') or ''), table.concat(md, '\n'), '\n')
  f:close()
  local keys = {}
  for ci, c in ipairs(cols) do keys[ci] = c[1] end
  f = assert(io.open(self:path(self.name .. '.json'), 'w'))
  f:write(json.encode({ name = self.name, title = t.title, tiny = self.tiny, columns = keys, rows = rows,
    notes = json.array(t.notes or {}) }), '\n')
  f:close()
end

-- The experiment's PNG (dlua.plot.figure spec without out).
function Ctx:figure(spec)
  spec.out = self:path(self.name .. '.png')
  plot.figure(spec)
  self:log('wrote %s, %s and %s', self:path(self.name .. '.md'), self:path(self.name .. '.json'), spec.out)
end

-- What a feature that has not landed on this build looks like in a table: "needs #20 (dlua.amp), not on this build".
function Ctx:missing(what) return what .. ', not on this build' end

-- Whether a recipe's --help mentions an option (a feature another branch adds).
function Ctx:recipe_has_option(recipe, option)
  local ok, out = self:run({ args = { recipe, '--help' }, quiet = true })
  return ok and out:find('%-%-' .. option:gsub('%-', '%%-') .. '[%s=]') ~= nil
end

-- The Fashion-MNIST the recipes read: the Debian package, DLUA_FASHION_MNIST_ROOT, or (tiny runs
-- without either) random images in its format, so the exercise still runs.
local function data_root(ctx)
  local env = os.getenv('DLUA_FASHION_MNIST_ROOT')
  if env and env ~= '' then return env end
  local f = io.open('/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz', 'rb')
  if f then f:close(); return nil end
  local dir = ctx:path('fake-fashion-mnist')
  os.execute('mkdir -p ' .. shell_quote(dir))
  ctx:log('dataset-fashion-mnist is not installed: random images in %s (the runs learn nothing)', dir)
  local ok = ctx:run({ args = { 'tests/data/fake_fashion_mnist.lua', dir, '2048', '512' } })
  if not ok then error('experiment: cannot write the stand-in Fashion-MNIST into ' .. dir, 0) end
  return dir
end

-- One step's numbers from a metrics run: the mean over the steps after the first (warm-up) of
-- a step field, or nil.
function M.mean_after_first(r, key)
  local sum, n = 0, 0
  for i, s in ipairs(r.steps) do
    if (i > 1 or #r.steps == 1) and type(s[key]) == 'number' then sum, n = sum + s[key], n + 1 end
  end
  return n > 0 and sum / n or nil
end
function M.max_of(r, key)
  local m
  for _, s in ipairs(r.steps) do
    if type(s[key]) == 'number' then m = math.max(m or s[key], s[key]) end
  end
  return m
end

-- A usage error: the message on stderr, exit status 2 (as cli.parse does for a recipe's options).
local function usage_error(fmt, ...)
  io.stderr:write('dlua experiment: ', format(fmt, ...), '\n')
  os.exit(2)
end

local usage = [[
usage: dlua experiment NAME [--tiny] [--out DIR] [--verbose] [NAME's own options: --help after the name]
       dlua experiment --list
Runs one of the seed's exercises on this machine: prints a table, writes DIR/NAME.md, DIR/NAME.json
and DIR/NAME.png (default DIR: experiments/NAME in the working directory). --tiny: seconds, for CI.
]]

function M.main(args)
  local name = args[1]
  if name == nil or name == '-h' or name == '--help' then
    io.stdout:write(usage)
    return
  end
  if name == '--list' then
    for _, n in ipairs(M.names) do print(format('%-26s %s', n, M.about[n])) end
    return
  end
  if not M.about[name] then
    local hint = require('dlua.cli').closest(name, M.names)
    usage_error("no experiment '%s'%s (%s)", name, hint and format(" (did you mean '%s'?)", hint) or '', table.concat(M.names, ', '))
  end
  local host = require 'dlua.host'
  local ctx = setmetatable({ name = name, tiny = false, out = 'experiments/' .. name, verbose = false, timeout = 1800,
    exe = host.exe, root = dlua.root, opts = {} }, Ctx)
  local i = 2
  while i <= #args do
    local a = args[i]
    if a == '-h' or a == '--help' then ctx.opts.help = true
    elseif a == '--tiny' then ctx.tiny = true
    elseif a == '--verbose' then ctx.verbose = true
    elseif a == '--out' or a == '-o' then
      i = i + 1
      ctx.out = args[i] or usage_error('--out needs a folder')
    elseif a:match('^%-%-[%w-]+=') then
      local k, v = a:match('^%-%-([%w-]+)=(.*)$')
      ctx.opts[k] = v
    elseif a:match('^%-%-[%w-]+$') and args[i + 1] ~= nil and not args[i + 1]:match('^%-%-') then
      ctx.opts[a:sub(3)] = args[i + 1]
      i = i + 1
    else usage_error("%s: unexpected argument '%s' (--tiny, --out DIR, --verbose, --help)", name, a) end
    i = i + 1
  end
  local known = M.options[name]
  if ctx.opts.help then
    print(format('usage: dlua experiment %s [--tiny] [--out DIR] [--verbose] [options]\n%s\n\noptions:', name, M.about[name]))
    local keys = {}
    for k in pairs(known) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do print(format('  --%-8s %s', k, known[k])) end
    return
  end
  for k in pairs(ctx.opts) do
    if not known[k] then
      local names = {}
      for n in pairs(known) do names[#names + 1] = n end
      table.sort(names)
      local hint = require('dlua.cli').closest(k, names)
      usage_error("%s: unknown option '--%s'%s (--%s)", name, k, hint and format(" (did you mean '--%s'?)", hint) or '',
        table.concat(names, ', --'))
    end
  end
  if ctx.out:sub(1, 1) ~= '/' then  -- the runs start in the tree's root: keep the folder where the user is
    local p = io.popen('pwd')
    ctx.out = p:read('*l') .. '/' .. ctx.out
    p:close()
  end
  local okp, why = plot.gnuplot()
  if not okp then error('dlua experiment: ' .. why, 0) end
  os.execute('mkdir -p ' .. shell_quote(ctx.out))
  local run = dofile(dlua.root .. '/bench/exercises/' .. name .. '.lua')
  ctx.data_root = name ~= 'backends' and data_root(ctx) or nil
  ctx:log('dlua experiment %s%s: %s', name, ctx.tiny and ' (tiny)' or '', M.about[name])
  run(ctx, M)
end

return M
