-- Lua face of the rendezvous store (host/comm/store_*.c: table, server, client): a server and clients as Lua objects.
local capi = require 'bindings.capi'
local ffi, C, check = capi.ffi, capi.C, capi.check

local M = {}

local Store = {}
Store.__index = Store

local function ms(seconds, default)
  if seconds == nil then return default end
  if type(seconds) ~= 'number' or seconds ~= seconds then error('store: timeout must be a number of seconds', 3) end
  if seconds == math.huge then return 2^62 end
  return math.floor(seconds * 1000 + 0.5)
end

local function handle(self, op)
  if self.h == nil then error('store ' .. op .. ': the store is closed', 3) end
  return self.h
end

-- Connects to the store at host:port with the job token, retrying until `timeout` seconds.
function M.connect(host, port, token, timeout)
  local out = ffi.new('dlua_store_t *[1]')
  check(C.dlua_store_connect(host, port, token, ms(timeout, 60000), out), 'store connect', 2)
  local self = setmetatable({ host = host, port = port }, Store)
  self.h = ffi.gc(out[0], C.dlua_store_close)
  return self
end

function Store:set(key, value)
  value = tostring(value)
  check(C.dlua_store_set(handle(self, 'set'), key, value, #value), 'store set', 2)
end

-- Waits (timeout in seconds; nil: the client's default) until the key exists; its value.
function Store:get(key, timeout)
  local v, n = ffi.new('void *[1]'), ffi.new('size_t[1]')
  check(C.dlua_store_get(handle(self, 'get'), key, ms(timeout, -1), v, n), 'store get', 2)
  local s = ffi.string(v[0], n[0])
  C.dlua_store_free_value(v[0])
  return s
end

function Store:add(key, delta)
  local v = ffi.new('int64_t[1]')
  check(C.dlua_store_add(handle(self, 'add'), key, delta or 0, v), 'store add', 2)
  return tonumber(v[0])
end

function Store:wait(keys, timeout)
  local arr = ffi.new('const char *[?]', #keys)
  for i, k in ipairs(keys) do arr[i - 1] = k end
  check(C.dlua_store_wait(handle(self, 'wait'), arr, #keys, ms(timeout, -1)), 'store wait', 2)
end

-- Which of the keys exist now (a table of booleans, in order), without waiting.
function Store:check(keys)
  local arr = ffi.new('const char *[?]', #keys)
  for i, k in ipairs(keys) do arr[i - 1] = k end
  local ex = ffi.new('int[?]', #keys)
  check(C.dlua_store_check(handle(self, 'check'), arr, #keys, ex), 'store check', 2)
  local r = {}
  for i = 1, #keys do r[i] = ex[i - 1] ~= 0 end
  return r
end

function Store:delete(key)
  local d = ffi.new('int[1]')
  check(C.dlua_store_delete(handle(self, 'delete'), key, d), 'store delete', 2)
  return d[0] ~= 0
end

function Store:set_timeout(seconds)
  check(C.dlua_store_set_timeout(handle(self, 'set_timeout'), ms(seconds, 60000)), 'store set_timeout', 2)
end

function Store:close()
  if self.h ~= nil then
    C.dlua_store_close(ffi.gc(self.h, nil))
    self.h = nil
  end
end

local Server = {}
Server.__index = Server

-- Starts a store server on host:port (port 0: any free port; see server.port).
function M.serve(host, port, token)
  local out = ffi.new('dlua_store_server_t *[1]')
  check(C.dlua_store_server_start(host, port or 0, token, out), 'store server', 2)
  local self = setmetatable({}, Server)
  self.h = ffi.gc(out[0], C.dlua_store_server_stop)
  self.port = tonumber(C.dlua_store_server_port(self.h))
  return self
end

function Server:stop()
  if self.h ~= nil then
    C.dlua_store_server_stop(ffi.gc(self.h, nil))
    self.h = nil
  end
end

-- Ctrl-C bookkeeping for loops that wait on the store and must survive an interrupt.
function M.interrupt_pending() return C.dlua_interrupt_pending() ~= 0 end
function M.clear_interrupt() C.dlua_interrupt_set(0) end

return M
