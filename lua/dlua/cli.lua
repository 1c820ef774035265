-- dlua.cli: a recipe's command-line options from a table of defaults: --name=value, --name value, --[no-]flag, --help.
local cli = {}
local format, floor = string.format, math.floor

-- Option names: `-` and `_` are the same character; tables use `_`, messages and help `-`.
local function key_of(name) return (name:gsub('-', '_')) end
local function flag_of(key) return '--' .. key:gsub('_', '-') end

-- Edit distance (insertions, deletions, substitutions), for "did you mean".
local function distance(a, b)
  local prev, cur = {}, {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    cur[0] = i
    local ca = a:byte(i)
    for j = 1, #b do
      local cost = ca == b:byte(j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev, cur = cur, prev
  end
  return prev[#b]
end

-- The known key closest to `key`, or nil when none is close enough to be a plausible typo.
local function closest(key, keys)
  local best, bestd
  for _, k in ipairs(keys) do
    local d = distance(key, k)
    -- A prefix ("--epoch" for "--epochs", "--lr-min" for "--lr") counts as close.
    if k:sub(1, #key) == key or key:sub(1, #k) == k then d = math.min(d, 1) end
    if bestd == nil or d < bestd or (d == bestd and k < best) then best, bestd = k, d end
  end
  if best and bestd <= math.max(2, floor(#key / 3)) then return best end
  return nil
end
cli.closest = closest

local kinds = { number = 'NUMBER', int = 'INT', string = 'STRING', boolean = 'BOOL', list = 'LIST' }

-- The kind of each option, from its default (or spec.types: 'int' for integer-only numbers).
local function kind_of(key, default, types)
  local t = types and types[key]
  if t ~= nil then
    if not kinds[t] then
      error(format("cli.parse: types.%s must be 'number', 'int', 'string', 'boolean' or 'list', got %s", key,
        tostring(t)), 3)
    end
    return t
  end
  local ty = type(default)
  if ty == 'number' or ty == 'string' or ty == 'boolean' then return ty end
  if ty == 'table' then return 'list' end
  error(format('cli.parse: the default of %s must be a number, string, boolean or list, got %s', key, ty), 3)
end

local function show(v)
  if type(v) == 'string' then return "'" .. v .. "'" end
  if type(v) == 'table' then
    local parts = {}
    for k, x in ipairs(v) do parts[k] = tostring(x) end
    return table.concat(parts, ',')
  end
  return tostring(v)
end

local truth = { ['true'] = true, yes = true, on = true, ['1'] = true,
  ['false'] = false, no = false, off = false, ['0'] = false }

-- The value of option `key` of kind `kind` from the text `v`; nil and a message if it is not one.
local function convert(key, kind, v, default)
  local flag = flag_of(key)
  if kind == 'string' then return v end
  if kind == 'boolean' then
    local b = truth[v:lower()]
    if b == nil then return nil, format("option %s expects true or false, got '%s'", flag, v) end
    return b
  end
  if kind == 'number' or kind == 'int' then
    local n = tonumber(v)
    if n == nil or n ~= n then return nil, format("option %s expects a number, got '%s'", flag, v) end
    if kind == 'int' and n ~= floor(n) then
      return nil, format("option %s expects an integer, got '%s'", flag, v)
    end
    return n
  end
  -- list: comma-separated, numbers if the default's first element is one
  local numeric = type(default) == 'table' and type(default[1]) == 'number'
  local r = {}
  if v ~= '' then
    for item in (v .. ','):gmatch('([^,]*),') do
      if numeric then
        local n = tonumber(item)
        if n == nil or n ~= n then
          return nil, format("option %s expects a comma-separated list of numbers, got '%s'", flag, v)
        end
        r[#r + 1] = n
      else
        r[#r + 1] = item
      end
    end
  end
  return r
end

local sorted_keys = require('dlua.options').sorted_keys

-- The --help text.
function cli.help(defaults, spec, program)
  spec = spec or {}
  local help = {}
  for k, v in pairs(spec.help or {}) do help[key_of(k)] = v end
  local lines = { format('usage: %s [options]', program or 'dlua script.lua') }
  if spec.description then lines[#lines + 1] = '\n' .. spec.description end
  lines[#lines + 1] = '\noptions:'
  local rows = {}
  for _, k in ipairs(sorted_keys(defaults)) do
    local kind = kind_of(k, defaults[k], spec.types)
    local left = kind == 'boolean' and '--[no-]' .. k:gsub('_', '-') or flag_of(k) .. ' ' .. kinds[kind]
    local right = (help[k] and help[k] .. ' ' or '') .. '(default: ' .. show(defaults[k]) .. ')'
    rows[#rows + 1] = { left, right }
  end
  rows[#rows + 1] = { '-h, --help', 'print this help and exit' }
  local width = 0
  for _, r in ipairs(rows) do width = math.max(width, #r[1]) end
  for _, r in ipairs(rows) do lines[#lines + 1] = format('  %-' .. width .. 's  %s', r[1], r[2]) end
  return table.concat(lines, '\n') .. '\n'
end

-- Reading an option that does not exist is a typo in the recipe: say so instead of giving nil.
local function strict(opt, keys)
  return setmetatable(opt, { __index = function(_, k)
    local hint = type(k) == 'string' and closest(key_of(k), keys)
    error(format("cli: no option '%s'%s", tostring(k), hint and format(" (did you mean '%s'?)", hint) or ''), 2)
  end })
end

-- cli.parse(arg, defaults, spec) -> a table of every option (defaults overridden by args).
-- args: a list (arg[1..]; arg[0] names the program). defaults: {name = value}; a value's
-- type is the option's type (number, string, boolean, or a list given as a,b,c). spec:
-- description, help = {name = text}, types = {name = 'int'} (integer-only numbers),
-- program (name in messages; default arg[0]), exit (default true: --help prints to stdout
-- and exits 0, a usage error prints to stderr and exits 2; false: returns nil, the text and
-- that exit code instead).
function cli.parse(args, defaults, spec)
  spec = spec or {}
  if type(args) ~= 'table' then error('cli.parse: expected the argument list (arg), got ' .. type(args), 2) end
  if type(defaults) ~= 'table' then error('cli.parse: expected a table of defaults, got ' .. type(defaults), 2) end
  local program = spec.program or args[0] or 'dlua script.lua'
  local opt, kind, dflt = {}, {}, {}
  for k, v in pairs(defaults) do
    if type(k) ~= 'string' then error('cli.parse: option names must be strings, got ' .. tostring(k), 2) end
    local key = key_of(k)
    kind[key] = kind_of(key, v, spec.types)
    dflt[key] = v
    if type(v) == 'table' then
      local c = {}
      for i, x in ipairs(v) do c[i] = x end
      v = c
    end
    opt[key] = v
  end
  for k in pairs(spec.help or {}) do
    if kind[key_of(k)] == nil then error(format("cli.parse: help for unknown option '%s'", k), 2) end
  end
  local keys = sorted_keys(opt)

  local function finish(code, text)
    if spec.exit == false then return nil, text, code end
    if code == 0 then
      io.stdout:write(text)
      io.stdout:flush()
    else
      io.stderr:write(text)
    end
    os.exit(code)
  end
  local function usage_error(msg)
    return finish(2, format('%s: %s\n(run with --help for the options)\n', program, msg))
  end

  local i, n = 1, #args
  while i <= n do
    local a = args[i]
    if type(a) ~= 'string' then a = tostring(a) end
    if a == '--help' or a == '-h' then
      return finish(0, cli.help(defaults, spec, program))
    elseif a == '--' then
      if i < n then return usage_error(format("unexpected argument '%s'", args[i + 1])) end
      break
    elseif a:sub(1, 2) == '--' then
      local name, value = a:match('^%-%-([^=]+)=(.*)$')
      name = name or a:sub(3)
      local key = key_of(name)
      local k = kind[key]
      if k == nil and key:sub(1, 3) == 'no_' and kind[key:sub(4)] == 'boolean' then
        if value ~= nil then return usage_error(format("option --%s takes no value, got '%s'", name, value)) end
        opt[key:sub(4)] = false
      elseif k == nil then
        local hint = closest(key, keys)
        return usage_error(format("unknown option '--%s'%s", name,
          hint and format(" (did you mean '%s'?)", flag_of(hint)) or ''))
      elseif k == 'boolean' and value == nil then
        opt[key] = true
      else
        if value == nil then
          value = args[i + 1]
          if value == nil or (type(value) == 'string' and value:sub(1, 2) == '--') then
            return usage_error(format('option %s needs a value', flag_of(key)))
          end
          i = i + 1
        end
        local v, err = convert(key, k, value, dflt[key])
        if err then return usage_error(err) end
        opt[key] = v
      end
    else
      local hint = ''
      local prev = args[i - 1]
      if i > 1 and type(prev) == 'string' and prev:sub(1, 2) == '--' and not prev:find('=', 1, true)
          and kind[key_of(prev:sub(3))] == 'boolean' and truth[a:lower()] ~= nil then
        hint = format(' (a boolean takes %s=%s or --no-%s)', prev, a, prev:sub(3))
      elseif a:sub(1, 1) == '-' and #a > 1 then
        hint = ' (options start with --)'
      end
      return usage_error(format("unexpected argument '%s'%s", a, hint))
    end
    i = i + 1
  end
  return strict(opt, keys)
end

return cli
