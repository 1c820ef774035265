-- The REPL's value printer: readable, nested, bounded.
local pretty = require 'dlua.pretty'

describe('dlua.pretty', function()
  it('prints scalars like Lua, strings unquoted at the top', function()
    assert.equals('42', pretty.format(42))
    assert.equals('0.5', pretty.format(0.5))
    assert.equals('hello', pretty.format('hello'))
    assert.equals('nil', pretty.format(nil))
    assert.equals('true', pretty.format(true))
  end)

  it('prints arrays then sorted keys, strings quoted inside', function()
    assert.equals('{1, 2, "x", a = 1, b = {c = true}}', pretty.format({ 1, 2, 'x', b = { c = true }, a = 1 }))
    assert.equals('{[10] = 2, ["not an id"] = 1}', pretty.format({ ['not an id'] = 1, [10] = 2 }))
    assert.equals('{}', pretty.format({}))
  end)

  it('bounds depth, width and item count', function()
    local deep = { { { { { { 1 } } } } } }
    assert.equals('{{{{{...}}}}}', pretty.format(deep))
    local many = {}
    for i = 1, 100 do many[i] = i end
    local s = pretty.format(many)
    assert.truthy(s:find('... (60 more)', 1, true))
    local wide = {}
    for i = 1, 30 do wide['key' .. i] = 'value' end
    assert.truthy(pretty.format(wide):find('\n', 1, true))
  end)

  it('marks cycles instead of looping', function()
    local t = {}
    t.self = t
    assert.equals('{self = <cycle>}', pretty.format(t))
  end)

  it('uses __tostring for objects', function()
    local obj = setmetatable({}, { __tostring = function() return 'Obj<1>' end })
    assert.equals('Obj<1>', pretty.format(obj))
    assert.equals('{Obj<1>}', pretty.format({ obj }))
  end)
end)
