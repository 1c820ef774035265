-- Lua face of the runtime functions: versions and the CPU thread count.
local capi = require 'bindings.capi'
local C, check = capi.C, capi.check

local M = {}

function M.version() return capi.string(C.dlua_version()) end

-- Versions of everything dlua is made of: a table for programs, printed by `dlua -v`.
function M.versions()
  return {
    dlua = capi.string(C.dlua_version()),
    luajit = capi.host.luajit_version,
    cuda_build = capi.string(C.dlua_cuda_build_info()),
  }
end

function M.set_num_threads(n)
  if type(n) ~= 'number' or n ~= math.floor(n) then
    error('set_num_threads: expected an integer thread count, got ' .. tostring(n), 2)
  end
  check(C.dlua_set_num_threads(n), 'set_num_threads')
end

-- Seconds on a monotonic wall clock, like Python's time.perf_counter().
function M.perf_counter() return tonumber(C.dlua_wall_time()) end

function M.get_num_threads() return tonumber(C.dlua_get_num_threads()) end

return M
