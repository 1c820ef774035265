-- JSON for checkpoint state trees: exact numbers (doubles round-trip, 64-bit integers tagged), deterministic key order, strict parsing.
local format, concat, byte, char, floor, huge = string.format, table.concat, string.byte, string.char, math.floor, math.huge

local M = {}

-- Values JSON cannot hold travel as one-key objects: {"$num": "nan"}, {"$u64": "18446744073709551615"},
-- {"$i64": "-5"}, {"$pairs": [[k, v], ...]} (a table with non-string keys, or keys starting with $),
-- {"$tensor": "name"} (written by the caller's `tensor` hook).
local escapes = { ['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f', ['\n'] = '\\n', ['\r'] = '\\r',
  ['\t'] = '\\t' }

local function quote(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return escapes[c] or format('\\u%04x', byte(c)) end) .. '"'
end
M.quote = quote

local function is_sequence(t)
  local n = 0
  for k in pairs(t) do
    if type(k) ~= 'number' or k < 1 or k ~= floor(k) then return false end
    n = n + 1
  end
  for i = 1, n do if t[i] == nil then return false end end
  return n > 0
end

-- encode(v, hook): hook(value, path) may return a replacement for values JSON cannot hold
-- (tensors); anything else unknown is an error naming its path.
function M.encode(v, hook, path)
  local out = {}
  local function enc(x, p)
    local tx = type(x)
    if hook then
      local r = hook(x, p)
      if r ~= nil then
        out[#out + 1] = r
        return
      end
    end
    if tx == 'nil' then
      out[#out + 1] = 'null'
    elseif tx == 'boolean' then
      out[#out + 1] = x and 'true' or 'false'
    elseif tx == 'string' then
      out[#out + 1] = quote(x)
    elseif tx == 'number' then
      if x ~= x then
        out[#out + 1] = '{"$num":"nan"}'
      elseif x == huge or x == -huge then
        out[#out + 1] = x > 0 and '{"$num":"inf"}' or '{"$num":"-inf"}'
      elseif x == floor(x) and math.abs(x) < 2 ^ 53 then
        out[#out + 1] = format('%d', x)
      else
        out[#out + 1] = format('%.17g', x)
      end
    elseif tx == 'cdata' and tostring(x):match('^%-?%d+U?LL$') then  -- a 64-bit integer (seeds, offsets)
      local digits, u = tostring(x):match('^(%-?%d+)(U?)LL$')
      out[#out + 1] = format('{"$%s":"%s"}', u == 'U' and 'u64' or 'i64', digits)
    elseif tx == 'table' then
      if is_sequence(x) then
        out[#out + 1] = '['
        for i = 1, #x do
          if i > 1 then out[#out + 1] = ',' end
          enc(x[i], p .. '[' .. i .. ']')
        end
        out[#out + 1] = ']'
        return
      end
      local keys, plain = {}, true
      for k in pairs(x) do
        keys[#keys + 1] = k
        if type(k) ~= 'string' or k:sub(1, 1) == '$' then plain = false end
      end
      if plain then
        table.sort(keys)
        out[#out + 1] = '{'
        for i, k in ipairs(keys) do
          if i > 1 then out[#out + 1] = ',' end
          out[#out + 1] = quote(k)
          out[#out + 1] = ':'
          enc(x[k], p .. '.' .. k)
        end
        out[#out + 1] = '}'
        return
      end
      table.sort(keys, function(a, b)
        if type(a) == type(b) and (type(a) == 'number' or type(a) == 'string') then return a < b end
        return type(a) < type(b)
      end)
      out[#out + 1] = '{"$pairs":['
      for i, k in ipairs(keys) do
        if type(k) ~= 'string' and type(k) ~= 'number' and type(k) ~= 'boolean' then
          error(format('%s has a key of type %s (keys are strings, numbers or booleans)', p, type(k)), 0)
        end
        if i > 1 then out[#out + 1] = ',' end
        out[#out + 1] = '['
        enc(k, p .. '.<key>')
        out[#out + 1] = ','
        enc(x[k], p .. '[' .. tostring(k) .. ']')
        out[#out + 1] = ']'
      end
      out[#out + 1] = ']}'
    else
      error(format('%s is a %s (a state holds tensors, numbers, strings, booleans and tables of them)', p, tx), 0)
    end
  end
  enc(v, path or 'value')
  return concat(out)
end

---------------------------------------------------------------------------------------------
-- Decoding

local function utf8(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + floor(cp / 64), 0x80 + cp % 64) end
  if cp < 0x10000 then return char(0xE0 + floor(cp / 4096), 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64) end
  return char(0xF0 + floor(cp / 262144), 0x80 + floor(cp / 4096) % 64, 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
end

-- decode(text, tensor): tensor(name) resolves {"$tensor": name}. Errors say "byte N: ...".
function M.decode(s, tensor)
  local pos = 1
  local function fail(msg) error(format('byte %d: %s', pos, msg), 0) end
  local function ws() pos = s:find('[^ \t\r\n]', pos) or #s + 1 end
  local value
  local function str()
    local parts = {}
    pos = pos + 1
    while true do
      local a, b = s:find('^[^"\\%c]+', pos)
      if a then
        parts[#parts + 1] = s:sub(a, b)
        pos = b + 1
      end
      local c = s:sub(pos, pos)
      if c == '"' then
        pos = pos + 1
        return concat(parts)
      elseif c == '\\' then
        local e = s:sub(pos + 1, pos + 1)
        local simple = ({ ['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t' })[e]
        if simple then
          parts[#parts + 1] = simple
          pos = pos + 2
        elseif e == 'u' then
          local hex = s:match('^%x%x%x%x', pos + 2)
          if not hex then fail('bad \\u escape') end
          local cp = tonumber(hex, 16)
          pos = pos + 6
          if cp >= 0xD800 and cp <= 0xDBFF then
            local lo = s:match('^\\u(%x%x%x%x)', pos)
            if not lo then fail('lone surrogate') end
            cp = 0x10000 + (cp - 0xD800) * 1024 + (tonumber(lo, 16) - 0xDC00)
            pos = pos + 6
          end
          parts[#parts + 1] = utf8(cp)
        else
          fail('bad escape')
        end
      else
        fail(c == '' and 'unterminated string' or 'control character in a string')
      end
    end
  end
  local function tagged(o)
    local k, v = next(o)
    if k == nil or next(o, k) ~= nil or type(k) ~= 'string' or k:sub(1, 1) ~= '$' then return o end
    if k == '$num' then
      if v == 'nan' then return 0 / 0 elseif v == 'inf' then return huge elseif v == '-inf' then return -huge end
      fail('bad $num ' .. tostring(v))
    elseif k == '$u64' or k == '$i64' then
      if type(v) ~= 'string' or not v:match('^%-?%d+$') then fail('bad ' .. k) end
      local neg = v:sub(1, 1) == '-'
      local r = k == '$u64' and 0ULL or 0LL
      for d in v:gmatch('%d') do r = r * 10 + (byte(d) - 48) end
      if neg then r = -r end
      return r
    elseif k == '$pairs' then
      if type(v) ~= 'table' then fail('bad $pairs') end
      local t = {}
      for _, kv in ipairs(v) do
        if type(kv) ~= 'table' or kv[1] == nil then fail('bad $pairs entry') end
        t[kv[1]] = kv[2]
      end
      return t
    elseif k == '$tensor' then
      if not tensor then fail('a tensor reference where none is allowed') end
      return tensor(v)
    end
    return o
  end
  function value()
    ws()
    local c = s:sub(pos, pos)
    if c == '{' then
      pos = pos + 1
      local o = {}
      ws()
      if s:sub(pos, pos) == '}' then
        pos = pos + 1
        return o
      end
      while true do
        ws()
        if s:sub(pos, pos) ~= '"' then fail('expected a key') end
        local k = str()
        ws()
        if s:sub(pos, pos) ~= ':' then fail("expected ':'") end
        pos = pos + 1
        o[k] = value()
        ws()
        local d = s:sub(pos, pos)
        pos = pos + 1
        if d == '}' then return tagged(o) end
        if d ~= ',' then fail("expected ',' or '}'") end
      end
    elseif c == '[' then
      pos = pos + 1
      local a = {}
      ws()
      if s:sub(pos, pos) == ']' then
        pos = pos + 1
        return a
      end
      while true do
        a[#a + 1] = value()
        ws()
        local d = s:sub(pos, pos)
        pos = pos + 1
        if d == ']' then return a end
        if d ~= ',' then fail("expected ',' or ']'") end
      end
    elseif c == '"' then
      return str()
    elseif s:find('^true', pos) then
      pos = pos + 4
      return true
    elseif s:find('^false', pos) then
      pos = pos + 5
      return false
    elseif s:find('^null', pos) then
      pos = pos + 4
      return nil
    else
      local num = s:match('^-?%d+%.?%d*[eE]?[-+]?%d*', pos)
      if not num or num == '' or not tonumber(num) then fail(c == '' and 'unexpected end' or 'unexpected ' .. c) end
      pos = pos + #num
      return tonumber(num)
    end
  end
  local v = value()
  ws()
  if pos <= #s then fail('trailing characters') end
  return v
end

return M
