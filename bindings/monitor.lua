-- Lua face of a running job's C API (host/comm/control.c, flight.c): the launcher's control page and the flight recorder.
local capi = require 'bindings.capi'
local ffi, C = capi.ffi, capi.C

local M = {}

-- Whether this rank shares a control page with a launcher (`dlua --nproc`), so `dlua attach` reaches it.
function M.available() return C.dlua_control_available() ~= 0 end

-- This rank finished `step`: true when a command is to run here now.
function M.boundary(step) return C.dlua_control_boundary(step) ~= 0 end

local every, at = ffi.new('int[1]'), ffi.new('int64_t[1]')
-- The command to run now: its code, whether it runs on every rank, the step it runs at.
function M.command()
  local p = C.dlua_control_command(every, at)
  if p == nil then return nil end
  return ffi.string(p), every[0] ~= 0, tonumber(at[0])
end

function M.done(ok, text) C.dlua_control_done(ok and 1 or 0, text or '') end

-- The bucket (1-based; nil/0: none) the next collectives of this thread belong to, for the flight recorder.
function M.set_bucket(b) C.dlua_flight_set_bucket(b or 0) end
function M.flight_capacity() return tonumber(C.dlua_flight_capacity()) end
function M.flight_dump(dir, reason, traceback) capi.check(C.dlua_flight_dump(dir, reason, traceback), 'flight_dump', 2) end

return M
