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

return dlua
