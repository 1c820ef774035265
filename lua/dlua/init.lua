-- The dlua module: `local dlua = require 'dlua'` (preloaded as the global `dlua` in -e and the REPL).
local runtime = require 'bindings.runtime'
local tensor = require 'bindings.tensor'

local dlua = {}

dlua.version = runtime.version
dlua.versions = runtime.versions
dlua.set_num_threads = runtime.set_num_threads
dlua.get_num_threads = runtime.get_num_threads
dlua.perf_counter = runtime.perf_counter
dlua.root = require('dlua.host').root

-- Tensors: dlua.tensor, dlua.zeros, dlua.float32, dlua.matmul... (see bindings/tensor.lua).
for name, value in pairs(tensor) do dlua[name] = value end

-- Submodules loaded on first use (dlua.nn, dlua.optim, dlua.data, dlua.lr, dlua.cli, dlua.dist, dlua.ckpt, dlua.monitor,
-- dlua.flight, dlua.json, dlua.metrics, dlua.recipe, dlua.amp): `require 'dlua'` stays cheap, and a submodule may itself require 'dlua'.
local lazy = { data = true, lr = true, cli = true, nn = true, optim = true, dist = true, cuda = true, ckpt = true,
  monitor = true, flight = true, json = true, metrics = true, recipe = true, amp = true }
setmetatable(dlua, { __index = function(t, k)
  if not lazy[k] then return nil end
  local m = require('dlua.' .. k)
  rawset(t, k, m)
  return m
end })

return dlua
