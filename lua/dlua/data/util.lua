-- dlua.data.util: what the dlua.data files share: the module table they fill, option checks and error helpers that name the caller's line.
local dlua = require 'dlua'

local U = {}
local format, floor = string.format, math.floor

-- The table `require 'dlua.data'` returns: each file of lua/dlua/data/ adds its public functions to it.
U.data = {}

-- Errors raised in the bindings under one of our functions carry our line; re-raise them at
-- the line of the user code that called the public function (`level` as for error()).
local function reraise(level, msg)
  if type(msg) == 'string' then msg = msg:gsub('^[^:\n]+:%d+: ', '', 1) end
  error(msg, level + 1)
end

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

local function shape(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

local function describe_value(v)
  if type(v) == 'string' then return "'" .. v .. "'" end
  return tostring(v)
end

-- Rejects option names a function does not know (a typo would otherwise be ignored).
local check_options = require('dlua.options').check

local function dataset_size(op, ds, level)
  if dlua.is_tensor(ds) then return ds:size(1) end
  if type(ds) == 'table' and dlua.is_tensor(ds.x) then return ds.x:size(1) end
  if type(ds) == 'number' and ds >= 0 and ds == floor(ds) then return ds end
  fail(level + 1, '%s: expected a dataset (with tensors x and y), got %s', op, type(ds))
end

local function batch_size(op, b, level)
  if type(b) ~= 'number' or b ~= floor(b) or b < 1 then
    fail(level + 1, '%s: batch must be a positive integer, got %s', op, describe_value(b))
  end
  return b
end

U.reraise, U.fail, U.shape, U.describe_value, U.check_options = reraise, fail, shape, describe_value, check_options
U.dataset_size, U.batch_size = dataset_size, batch_size
return U
