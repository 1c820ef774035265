-- dlua.recipe: training recipes as one checked table (train{}), custom loops (trainer{}), and the pieces both are made of.
local recipe = {}

local env = require 'dlua.recipe.env'
local log = require 'dlua.recipe.log'
local loader = require 'dlua.recipe.loader'

recipe.setup, recipe.teardown, recipe.pick_device = env.setup, env.teardown, env.pick_device
recipe.Logger = log.Logger
recipe.MemoryLoader = loader.MemoryLoader

-- The larger pieces load on first use.
local lazy = { trainer = 'dlua.recipe.trainer', train = 'dlua.recipe.train', validate = 'dlua.recipe.validate',
  plan = 'dlua.recipe.plan', options = 'dlua.recipe.options' }
setmetatable(recipe, { __index = function(t, k)
  local m = lazy[k]
  if not m then return nil end
  local v = require(m)
  if type(v) == 'table' and v[k] ~= nil then v = v[k] end
  rawset(t, k, v)
  return v
end })

return recipe
