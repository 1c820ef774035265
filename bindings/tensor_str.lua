-- tostring(t): PyTorch's printed form of a tensor (same widths, modes and summarising), with dlua dtype names.
local core = require 'bindings.tensor_core'
local create = require 'bindings.tensor_create'
local C = core.C
local format, rep, floor, abs = string.format, string.rep, math.floor, math.abs

-- PyTorch's print options: precision 4, 3 edge items when summarising more than 1000
-- elements, 80 columns.
local PRECISION, EDGE, THRESHOLD, LINEWIDTH = 4, 3, 1000, 80

local function finite(v) return v == v and v ~= math.huge and v ~= -math.huge end

-- Python's spelling of non-finite floats (C's printf may write "-nan").
local function nonfinite_str(v)
  if v ~= v then return 'nan' end
  return v > 0 and 'inf' or '-inf'
end

-- The formatter PyTorch builds from the shown values: for floats an integer mode (all
-- integral: "1."), a fixed mode ("0.1000") or a scientific one ("1.0000e-05"), and one
-- width for every element.
local function formatter(values, floating)
  local width = 1
  if not floating then
    for k = 1, #values do
      local v = values[k]
      local s = type(v) == 'boolean' and (v and 'True' or 'False') or format('%d', v)
      if #s > width then width = #s end
    end
    return function(v)
      local s = type(v) == 'boolean' and (v and 'True' or 'False') or format('%d', v)
      return rep(' ', width - #s) .. s
    end, width
  end
  local int_mode, sci = true, false
  local lo, hi, any = math.huge, 0, false
  for k = 1, #values do
    local v = values[k]
    if finite(v) and v ~= 0 then
      any = true
      local a = abs(v)
      if a < lo then lo = a end
      if a > hi then hi = a end
      if v ~= math.ceil(v) then int_mode = false end
    end
  end
  if any then
    local pattern
    if int_mode then
      sci = hi / lo > 1000 or hi > 1e8
    else
      sci = hi / lo > 1000 or hi > 1e8 or lo < 1e-4
    end
    pattern = sci and ('%.' .. PRECISION .. 'e') or (int_mode and '%.0f' or ('%.' .. PRECISION .. 'f'))
    local extra = (int_mode and not sci) and 1 or 0
    for k = 1, #values do
      local v = values[k]
      if finite(v) and v ~= 0 then
        local n = #format(pattern, v) + extra
        if n > width then width = n end
      end
    end
  end
  return function(v)
    local s
    if not finite(v) then
      s = nonfinite_str(v)
    elseif sci then
      s = format('%.' .. PRECISION .. 'e', v)
    elseif int_mode then
      s = format('%.0f', v) .. '.'
    else
      s = format('%.' .. PRECISION .. 'f', v)
    end
    return rep(' ', width - #s) .. s
  end, width
end

local function tensor_str(t, p)
  local tp, sizes, strides, code, keep = create.host_elements(p)
  local read = create.read
  local n = #sizes
  local numel = 1
  for k = 1, n do numel = numel * sizes[k] end
  local summarize = numel > THRESHOLD

  -- The positions shown along a dim of `size`: all, or the first and last EDGE with a gap.
  local function shown(size)
    if summarize and size > 2 * EDGE then
      local r = {}
      for k = 0, EDGE - 1 do r[#r + 1] = k end
      r[#r + 1] = false
      for k = size - EDGE, size - 1 do r[#r + 1] = k end
      return r
    end
    local r = {}
    for k = 0, size - 1 do r[k + 1] = k end
    return r
  end

  local values = {}
  local function collect(depth, off)
    if depth > n then
      values[#values + 1] = read(code, tp, off)
      return
    end
    for _, k in ipairs(shown(sizes[depth])) do
      if k then collect(depth + 1, off + k * strides[depth]) end
    end
  end
  collect(1, 0)
  local fmt, width = formatter(values, core.is_floating(code))

  local function build(depth, off, indent)
    if depth > n then return fmt(read(code, tp, off)) end
    local items = {}
    local last = depth == n
    for _, k in ipairs(shown(sizes[depth])) do
      if k then
        items[#items + 1] = build(depth + 1, off + k * strides[depth], indent + 1)
      else
        items[#items + 1] = last and ' ...' or '...'
      end
    end
    if last then
      local per_line = math.max(1, floor((LINEWIDTH - indent) / (width + 2)))
      local lines = {}
      for k = 1, #items, per_line do
        lines[#lines + 1] = table.concat(items, ', ', k, math.min(k + per_line - 1, #items))
      end
      return '[' .. table.concat(lines, ',\n' .. rep(' ', indent + 1)) .. ']'
    end
    return '[' .. table.concat(items, ',' .. rep('\n', n - depth) .. rep(' ', indent + 1)) .. ']'
  end
  local s = build(1, 0, #'tensor(')
  core.keepalive(t, 'tostring')
  core.keepalive(keep)
  return s
end

-- Python's repr of a shape tuple.
local function tuple(sizes)
  if #sizes == 1 then return '(' .. sizes[1] .. ',)' end
  return '(' .. table.concat(sizes, ', ') .. ')'
end

function core.__tostring(t)
  local p = t.p
  if p == nil then return 'tensor(<freed>)' end
  local code = core.dtype_of(p)
  local dev = C.dlua_tensor_device(p)
  local indent = #'tensor('
  local suffixes = {}
  if dev ~= C.DLUA_CPU then suffixes[#suffixes + 1] = "device='" .. core.device_name(dev) .. "'" end
  local body
  if C.dlua_tensor_numel(p) == 0 then
    if C.dlua_tensor_ndim(p) ~= 1 then suffixes[#suffixes + 1] = 'size=' .. tuple(core.sizes(p)) end
    if code ~= core.F32 then suffixes[#suffixes + 1] = 'dtype=dlua.' .. core.dtype_names[code] end
    body = '[]'
  else
    if code ~= core.F32 and code ~= core.I64 and code ~= core.BOOL then
      suffixes[#suffixes + 1] = 'dtype=dlua.' .. core.dtype_names[code]
    end
    body = tensor_str(t, p)
  end
  local out = { 'tensor(' .. body }
  local s = out[1]
  local nl = s:match('.*()\n')
  local last_len = #s - (nl and nl - 1 or -1) + 1
  for _, suffix in ipairs(suffixes) do
    if last_len + #suffix + 2 > LINEWIDTH then
      out[#out + 1] = ',\n' .. rep(' ', indent) .. suffix
      last_len = indent + #suffix
    else
      out[#out + 1] = ', ' .. suffix
      last_len = last_len + #suffix + 2
    end
  end
  out[#out + 1] = ')'
  return table.concat(out)
end

return {}
