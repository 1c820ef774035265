-- The runtime bindings: versions, threads, and the status-to-error rule of bindings/capi.
local dlua = require 'dlua'
local capi = require 'bindings.capi'

describe('dlua runtime', function()
  it('reports its version and the build', function()
    assert.matches('^%d+%.%d+%.%d+$', dlua.version())
    local v = dlua.versions()
    assert.equals(dlua.version(), v.dlua)
    assert.matches('^LuaJIT 2%.', v.luajit)
    assert.is_true(v.cuda_build == 'no CUDA' or v.cuda_build:match('^CUDA %d+%.%d+[^,]*, cuDNN') ~= nil)
  end)

  it('sets and gets the thread count', function()
    local before = dlua.get_num_threads()
    dlua.set_num_threads(1)
    assert.equals(1, dlua.get_num_threads())
    dlua.set_num_threads(before)
    assert.equals(before, dlua.get_num_threads())
  end)

  it('turns a failed C status into an error naming the op, the C line and the caller', function()
    local ok, err = pcall(function() dlua.set_num_threads(-2) end)
    assert.is_false(ok)
    assert.matches('runtime_spec.lua:%d+: set_num_threads: expected a positive thread count, got %-2', err)
    assert.matches('host/core/runtime.c:%d+', err)
    -- the message is consumed: the next call starts clean
    assert.equals('', capi.string(capi.C.dlua_last_error()))
  end)

  it('rejects a non-integer thread count before reaching C', function()
    assert.has_error(function() dlua.set_num_threads(1.5) end,
      'set_num_threads: expected an integer thread count, got 1.5')
  end)

  it('embeds the header that declares the API', function()
    local host = require 'dlua.host'
    assert.truthy(host.header:find('dlua_last_error', 1, true))
    assert.truthy(host.root:find('/', 1, true))
  end)
end)
