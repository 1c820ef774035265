-- Readable, bounded printing of Lua values: what the REPL shows for results.
local M = {}

-- Bounds keep a huge or cyclic table from flooding the terminal.
M.max_depth = 4      -- nested tables deeper than this print as {...}
M.max_items = 40     -- entries shown per table before "... (N more)"
M.max_width = 78     -- a table that fits on one line this wide prints on one line

local keywords = {}
for w in ([[and break do else elseif end false for function goto if in local nil not or
  repeat return then true until while]]):gmatch('%a+') do keywords[w] = true end

local function is_identifier(k)
  return type(k) == 'string' and k:match('^[%a_][%w_]*$') and not keywords[k]
end

local function has_tostring(v)
  local mt = getmetatable(v)
  return type(mt) == 'table' and rawget(mt, '__tostring') ~= nil
end

local function scalar(v)
  local t = type(v)
  if t == 'string' then return string.format('%q', v):gsub('\\\n', '\\n') end
  if t == 'number' then
    if v == math.floor(v) and math.abs(v) < 2^53 then return string.format('%d', v) end
    return string.format('%.14g', v)
  end
  return tostring(v)
end

local function key_order(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return ta < tb end
  if ta == 'number' or ta == 'string' then return a < b end
  return tostring(a) < tostring(b)
end

local format

local function format_table(t, depth, seen, indent)
  if seen[t] then return '<cycle>' end
  if depth > M.max_depth then return '{...}' end
  seen[t] = true
  local parts, n = {}, #t
  local shown = 0
  local function add(s)
    shown = shown + 1
    parts[#parts + 1] = s
  end
  for i = 1, n do
    if shown >= M.max_items then break end
    add(format(t[i], depth + 1, seen, indent .. '  '))
  end
  local keys = {}
  for k in pairs(t) do
    if not (type(k) == 'number' and k >= 1 and k <= n and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, key_order)
  for _, k in ipairs(keys) do
    if shown >= M.max_items then break end
    local ks = is_identifier(k) and k or ('[' .. format(k, depth + 1, seen, indent) .. ']')
    add(ks .. ' = ' .. format(t[k], depth + 1, seen, indent .. '  '))
  end
  local total = n + #keys
  if total > shown then parts[#parts + 1] = string.format('... (%d more)', total - shown) end
  seen[t] = nil
  if #parts == 0 then return '{}' end
  local one = '{' .. table.concat(parts, ', ') .. '}'
  if #one + #indent <= M.max_width and not one:find('\n') then return one end
  local inner = indent .. '  '
  return '{\n' .. inner .. table.concat(parts, ',\n' .. inner) .. '\n' .. indent .. '}'
end

format = function(v, depth, seen, indent)
  if type(v) == 'table' and not has_tostring(v) then return format_table(v, depth, seen, indent) end
  if type(v) == 'string' then return scalar(v) end
  if has_tostring(v) or type(v) == 'cdata' or type(v) == 'userdata' then return tostring(v) end
  return scalar(v)
end

-- The text the REPL shows for one value: strings unquoted at the top level (as Lua's own
-- REPL does), tables nested and bounded, objects through __tostring.
function M.format(v)
  if type(v) == 'string' then return v end
  return format(v, 1, {}, '')
end

function M.print_values(...)
  local n = select('#', ...)
  local out = {}
  for i = 1, n do out[i] = M.format((select(i, ...))) end
  io.stdout:write(table.concat(out, '\t'), '\n')
end

return M
