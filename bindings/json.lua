-- The Lua face of host/io/json.c: Lua values to one line of JSON and back, through cJSON.
local capi = require 'bindings.capi'
local ffi, C = capi.ffi, capi.C
local format, floor = string.format, math.floor

local M = {}

-- JSON's null where a Lua nil cannot stand (inside arrays, as a decoded value).
M.null = setmetatable({}, { __tostring = function() return 'json.null' end, __newindex = function()
  error('json.null is a constant', 2)
end })
-- json.array(t) marks t as an array, so that an empty one prints [] and not {}.
local array_mt = { __name = 'json.array' }
function M.array(t)
  return setmetatable(t or {}, array_mt)
end

local node_out = ffi.new('dlua_json_t *[1]')
local text_out = ffi.new('char *[1]')

-- A failed status as a Lua error without a position (the public functions add the caller's).
local function check(status)
  if status == 0 then return end
  local msg = ffi.string(C.dlua_last_error())
  C.dlua_clear_error()
  error('json.encode: ' .. msg, 0)
end

local function sequence_length(t)
  local n = 0
  for k in pairs(t) do
    if type(k) ~= 'number' or k < 1 or k ~= floor(k) then return nil end
    n = n + 1
  end
  for i = 1, n do if t[i] == nil then return nil end end
  return n
end

local function where(path) return path == '' and 'the value' or path end

-- The keys of an object: those of `order` first, in that order, then the others sorted, so
-- that a line's fields are always in the same place.
local function object_keys(t, order, path)
  local keys, first = {}, {}
  if order then
    for _, k in ipairs(order) do
      if t[k] ~= nil and not first[k] then keys[#keys + 1] = k; first[k] = true end
    end
  end
  local rest = {}
  for k in pairs(t) do
    if type(k) ~= 'string' then
      error(format('json.encode: %s has a key of type %s (JSON objects take string keys; a list must be 1..n)',
        where(path), type(k)), 0)
    end
    if not first[k] then rest[#rest + 1] = k end
  end
  table.sort(rest)
  for _, k in ipairs(rest) do keys[#keys + 1] = k end
  return keys
end

local function new(kind, number, text)
  check(C.dlua_json_new(node_out, kind, number or 0, text, text and #text or 0))
  return node_out[0]
end

-- The cJSON node for x (the caller frees it), or an error naming its path.
local function build(x, path, depth, order)
  if depth > 200 then error(format('json.encode: %s is nested more than 200 deep (a cycle?)', where(path)), 0) end
  local tx = type(x)
  if x == nil or x == M.null then return new(C.DLUA_JSON_NULL) end
  if tx == 'boolean' then return new(x and C.DLUA_JSON_TRUE or C.DLUA_JSON_FALSE) end
  if tx == 'number' then return new(C.DLUA_JSON_NUMBER, x) end  -- NaN and infinities print as null
  if tx == 'string' then
    if x:find('\0', 1, true) then error(format('json.encode: %s is a string holding a NUL byte', where(path)), 0) end
    return new(C.DLUA_JSON_STRING, nil, x)
  end
  if tx == 'cdata' and (ffi.istype('int64_t', x) or ffi.istype('uint64_t', x)) then return new(C.DLUA_JSON_NUMBER, tonumber(x)) end
  if tx ~= 'table' then error(format('json.encode: %s is a %s, which JSON cannot hold', where(path), tx), 0) end
  local n = sequence_length(x)
  local is_array = getmetatable(x) == array_mt or (n ~= nil and n > 0)
  if getmetatable(x) == array_mt and n == nil then
    error(format('json.encode: %s is marked json.array but has keys other than 1..n', where(path)), 0)
  end
  local node = new(is_array and C.DLUA_JSON_ARRAY or C.DLUA_JSON_OBJECT)
  local ok, err = pcall(function()
    if is_array then
      for i = 1, n do
        local child = build(x[i], format('%s[%d]', path, i), depth + 1)
        check(C.dlua_json_add(node, nil, 0, child))
      end
    else
      for _, k in ipairs(object_keys(x, depth == 0 and order or nil, path)) do
        if k:find('\0', 1, true) then error(format('json.encode: %s has a key holding a NUL byte', where(path)), 0) end
        local child = build(x[k], path == '' and k or (path .. '.' .. k), depth + 1)
        check(C.dlua_json_add(node, k, #k, child))
      end
    end
  end)
  if not ok then
    C.dlua_json_free(node)
    error(err, 0)
  end
  return node
end

-- encode(value, {order = {key, ...}}): one line of JSON. Tables with keys 1..n are arrays, others
-- objects (string keys, sorted; `order` puts those keys first at the top level); an empty table is
-- {} unless marked json.array. NaN and infinities become null.
function M.encode(value, opts)
  local order = opts and opts.order
  local ok, node = pcall(build, value, '', 0, order)
  if not ok then error(node, 2) end
  local st = C.dlua_json_print(node, text_out)
  C.dlua_json_free(node)
  if st ~= 0 then capi.check(st, 'json.encode', 2) end
  local s = ffi.string(text_out[0])
  C.dlua_json_free_text(text_out[0])
  return s
end

local function value_of(n)
  local k = C.dlua_json_kind(n)
  if k == C.DLUA_JSON_NULL then return M.null end
  if k == C.DLUA_JSON_FALSE then return false end
  if k == C.DLUA_JSON_TRUE then return true end
  if k == C.DLUA_JSON_NUMBER then return C.dlua_json_number(n) end
  if k == C.DLUA_JSON_STRING then return ffi.string(C.dlua_json_string(n)) end
  local r = k == C.DLUA_JSON_ARRAY and M.array({}) or {}
  local c = C.dlua_json_first(n)
  local i = 0
  while c ~= nil do
    i = i + 1
    if k == C.DLUA_JSON_ARRAY then r[i] = value_of(c) else r[ffi.string(C.dlua_json_key(c))] = value_of(c) end
    c = C.dlua_json_next(c)
  end
  return r
end

-- decode(text): the value; null is json.null, arrays come marked json.array. Errors give the byte position.
function M.decode(text)
  if type(text) ~= 'string' then error(format('json.decode: expected a string, got %s', type(text)), 2) end
  local st = C.dlua_json_parse(text, #text, node_out)
  if st ~= 0 then capi.check(st, 'json.decode', 2) end
  local root = node_out[0]
  local ok, v = pcall(value_of, root)
  C.dlua_json_free(root)
  if not ok then error(v, 2) end
  return v
end

function M.available() return C.dlua_json_available() ~= 0 end

return M
