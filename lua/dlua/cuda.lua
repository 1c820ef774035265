-- dlua.cuda: GPUs, streams and events, memory statistics, and choosing a device ('auto' falls back to the CPU).
local b = require 'bindings.cuda'

local M = {}
for k, v in pairs(b) do M[k] = v end

-- Runs fn(...) with stream s current on its device, restoring the previous current stream after,
-- also when fn raises (the error goes on). Returns fn's results.
local function restore(prev, ok, ...)
  b.set_stream(prev)
  if not ok then error((...), 0) end
  return ...
end

function M.with_stream(s, fn, ...)
  if not b.is_stream(s) then error('with_stream: expected a Stream, got ' .. type(s), 2) end
  if type(fn) ~= 'function' then error('with_stream: expected a function, got ' .. type(fn), 2) end
  local prev = b.current_stream(s.device)
  b.set_stream(s)
  return restore(prev, pcall(fn, ...))
end

return M
