-- require 'dlua.dist.compress': the same module as dlua.dist.compress (lua/dlua/compress.lua), by its dotted name.
return require 'dlua.compress'
