-- dlua.json (cJSON): what it writes Python's json module reads back as the same value, and what Python writes it reads.
local json = require 'dlua.json'

local python = '/usr/bin/python3'
local function have_python()
  local f = io.open(python, 'rb')
  if f then f:close() end
  return f ~= nil
end

-- Python's reading of `text`, printed back by Python in a canonical form (sorted keys, repr floats).
local function python_canonical(text)
  local path = os.tmpname()
  local f = assert(io.open(path, 'wb'))
  f:write(text)
  f:close()
  local p = io.popen(python .. [[ -c "import json,sys; v=json.load(open(sys.argv[1], encoding='utf-8')); print(json.dumps(v, sort_keys=True, ensure_ascii=True))" ]] .. path .. ' 2>&1')
  local out = p:read('*a')
  p:close()
  os.remove(path)
  return (out:gsub('\n$', ''))
end

describe('dlua.json', function()
  it('writes one line that Python reads back as the same value', function()
    if not have_python() then
      print('skip: /usr/bin/python3 is missing, no reference to compare with')
      return
    end
    local v = { kind = 'step', step = 12, loss = 2.302585092994046, lr = 1e-4, neg = -0.5, big = 2 ^ 53, tiny = 5e-324,
      flag = true, off = false, list = { 1, 2.5, 'x', { a = 1 } }, empty = {}, empty_list = json.array(),
      text = 'quote " backslash \\ tab \t newline \n bell \7 unicode \u{e9}\u{1f600}' }
    local line = json.encode(v)
    assert.is_nil(line:find('\n', 1, true))
    local expected = [[{"big": 9007199254740992, "empty": {}, "empty_list": [], "flag": true, "kind": "step", ]]
      .. [["list": [1, 2.5, "x", {"a": 1}], "loss": 2.302585092994046, "lr": 0.0001, "neg": -0.5, "off": false, "step": 12, ]]
      .. [["text": "quote \" backslash \\ tab \t newline \n bell \u0007 unicode \u00e9\ud83d\ude00", "tiny": 5e-324}]]
    assert.equals(expected, python_canonical(line))
  end)

  it('reads what Python writes', function()
    if not have_python() then
      print('skip: /usr/bin/python3 is missing')
      return
    end
    local p = io.popen(python .. [[ -c "import json; print(json.dumps({'a': [1, 2.25, None, True], 'b': {'c': 'caf\u00e9 \n'}, 'd': -1e300}))"]])
    local text = p:read('*a')
    p:close()
    local v = json.decode(text)
    assert.equals(1, v.a[1])
    assert.equals(2.25, v.a[2])
    assert.equals(json.null, v.a[3])
    assert.is_true(v.a[4])
    assert.equals(4, #v.a)
    assert.equals('caf\u{e9} \n', v.b.c)
    assert.equals(-1e300, v.d)
  end)

  it('round-trips doubles exactly', function()
    for _, x in ipairs({ 0.1, 1 / 3, math.pi, 1e-300, 123456789.123456789, -2 ^ 60, 0.30000000000000004 }) do
      assert.equals(x, json.decode(json.encode({ x }))[1])
    end
  end)

  it('writes NaN and infinities as null, and keeps keys in the given order first', function()
    assert.equals('[null,null,null]', json.encode({ 0 / 0, math.huge, -math.huge }))
    assert.equals('{"kind":"step","step":1,"a":2,"z":3}', json.encode({ z = 3, a = 2, step = 1, kind = 'step' },
      { order = { 'kind', 'step' } }))
  end)

  it('refuses what JSON cannot hold, naming where it is', function()
    local cyc = {}
    cyc.self = cyc
    assert.has_error(function() json.encode(cyc) end)
    local ok, err = pcall(json.encode, { a = { b = print } })
    assert.is_false(ok)
    assert.matches('a%.b is a function', err)
    ok, err = pcall(json.encode, { [true] = 1 })
    assert.is_false(ok)
    assert.matches('key of type boolean', err)
    ok, err = pcall(json.encode, { 'nul\0inside' })
    assert.matches('%[1%] is a string holding a NUL byte', err)
    ok, err = pcall(json.encode, { [1] = 1, [3] = 3 })
    assert.matches('key of type number', err)
  end)

  it('says where bad text goes wrong', function()
    local ok, err = pcall(json.decode, '{"a": [1, 2,, 3]}')
    assert.is_false(ok)
    assert.matches('json.decode: invalid JSON at byte %d+', err)
    ok, err = pcall(json.decode, '{"a": 1} x')
    assert.matches('unexpected text after the value at byte 10', err)
    ok, err = pcall(json.decode, '[1, 2')
    assert.is_false(ok)
    assert.has_error(function() json.decode(42) end, nil)
  end)

  it('reads JSON Lines files, naming the file and line of a bad one', function()
    local path = os.tmpname()
    local f = assert(io.open(path, 'w'))
    f:write('{"a": 1}\n\n[2]\n{"b": }\n')
    f:close()
    local ok, err = pcall(json.read_lines, path)
    assert.is_false(ok)
    assert.matches(path:gsub('%p', '%%%0') .. ':4: invalid JSON', err)
    f = assert(io.open(path, 'w'))
    f:write('{"a": 1}\n\n[2]\n')
    f:close()
    local recs = json.read_lines(path)
    os.remove(path)
    assert.equals(2, #recs)
    assert.equals(1, recs[1].a)
    assert.equals(2, recs[2][1])
  end)
end)
