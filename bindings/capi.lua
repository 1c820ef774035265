-- The C API as LuaJIT FFI declarations, and the one rule that turns a failed status into a Lua error.
local ffi = require 'ffi'
local host = require 'dlua.host'

-- The header is the one the binary was compiled with (embedded by the build), so Lua and
-- C can never disagree about a signature.
ffi.cdef(host.header)

local C = ffi.C
local M = { C = C, ffi = ffi, host = host }

-- Raises a Lua error for a failed status: "op: message (host/file.c:line)", reported at
-- the caller's line. `level` counts from the function that called check (default 2:
-- its caller, i.e. the user code that called the binding).
function M.check(status, op, level)
  if status == 0 then return end
  local msg = ffi.string(C.dlua_last_error())
  C.dlua_clear_error()
  if status == C.DLUA_ERR_INTERRUPTED then msg = 'interrupted' end
  -- C messages usually start with the op already ("add: shapes ..."): do not repeat it.
  if msg:sub(1, #op + 1) ~= op .. ':' then msg = op .. ': ' .. msg end
  error(msg, (level or 2) + 1)
end

function M.string(p)
  if p == nil then return nil end
  return ffi.string(p)
end

return M
