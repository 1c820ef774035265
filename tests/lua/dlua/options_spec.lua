-- dlua.options.check: the options check of dlua.ckpt and dlua.data (unknown names and non-tables raised at the user's line).
local options = require 'dlua.options'
local ckpt = require 'dlua.ckpt'
local data = require 'dlua.data'

local function api(opts)
  local o = options.check('thing', opts, { alpha = true, beta = true }, 2)  -- no tail call: api keeps its frame
  return o
end

describe('dlua.options.check', function()
  it('returns the table, or {} for nil', function()
    local o = { alpha = 1 }
    assert.are.equal(o, api(o))
    assert.same({}, api(nil))
  end)

  it("names the call, the unknown option and the known ones, at the caller's line", function()
    local ok, err = pcall(function() api({ alpha = 1, gamma = 2 }) end)
    assert.is_false(ok)
    assert.matches("options_spec.lua:%d+: thing: unknown option 'gamma' %(expected alpha, beta%)$", err)
    ok, err = pcall(function() api(3) end)
    assert.matches('options_spec.lua:%d+: thing: expected an options table, got number$', err)
  end)

  it("is the check of dlua.ckpt's and dlua.data's functions", function()
    local ok, err = pcall(function() data.order(10, { seed = 1, shufle = true }) end)
    assert.is_false(ok)
    assert.matches("options_spec.lua:%d+: order: unknown option 'shufle' %(expected epoch, seed, shuffle%)$", err)
    if ckpt.available() then  -- without cJSON, save says that first
      ok, err = pcall(function() ckpt.save('/nonexistent/x', {}, { kep = 2 }) end)
      assert.is_false(ok)
      assert.matches("options_spec.lua:%d+: save: unknown option 'kep' %(expected ", err)
    end
  end)
end)
