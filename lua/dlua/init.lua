-- The dlua module: `local dlua = require 'dlua'` (preloaded as the global `dlua` in -e and the REPL).
local runtime = require 'bindings.runtime'

local dlua = {}

dlua.version = runtime.version
dlua.versions = runtime.versions
dlua.set_num_threads = runtime.set_num_threads
dlua.get_num_threads = runtime.get_num_threads
dlua.root = require('dlua.host').root

return dlua
