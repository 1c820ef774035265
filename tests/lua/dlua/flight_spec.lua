-- dlua.flight: the diagnosis of flight-recorder dumps written by hand (who is behind, at which collective and line, a
-- mismatch, a rank stuck in Lua or in C, ranks that wrote no dump or an old one).
local flight = require 'dlua.flight'
local json = require 'dlua.ckpt.json'

local dir = os.tmpname()
os.remove(dir)
os.execute("mkdir -p '" .. dir .. "'")

local function entry(id, seq, op, state, extra)
  local e = { id = id, group = 'pg0', backend = 'gloo', group_rank = 0, group_size = 2, seq = seq, op = op,
    dtype = 'float32', shape = { 4 }, desc = '(4) float32', site = 'train.lua:' .. (10 + seq), state = state,
    issued = 100 + seq, started = 100 + seq, ended = state == 'completed' and 100.5 + seq or nil }
  for k, v in pairs(extra or {}) do e[k] = v end
  return e
end

local function write(rank, dump_id, entries, where, extra)
  local f = assert(io.open(string.format('%s/flight-rank%d.json', dir, rank), 'wb'))
  local d = { format = 'dlua.flight/1', rank = rank, world_size = 2, dump_id = dump_id, time = 110,
    where = where or { state = 'unknown', traceback = {}, c_stack = {} }, capacity = 1024, recorded = #entries,
    entries = entries }
  for k, v in pairs(extra or {}) do d[k] = v end
  f:write(json.encode(d))
  f:close()
end

local function clear()
  for r = 0, 3 do os.remove(string.format('%s/flight-rank%d.json', dir, r)) end
end

local function has(text, s) assert.truthy(text:find(s, 1, true), '"' .. s .. '" not in:\n' .. text) end

describe('dlua.flight diagnose', function()
  after_each(clear)
  teardown(function() os.remove(dir) end)

  it('names the rank behind, its last collective, the furthest one, and where each rank is', function()
    write(0, 7, { entry(1, 1, 'all_reduce', 'completed'), entry(2, 2, 'all_reduce', 'completed'),
      entry(3, 3, 'all_reduce', 'started') })
    write(1, 7, { entry(1, 1, 'all_reduce', 'completed'), entry(2, 2, 'all_reduce', 'completed') },
      { state = 'lua', traceback = { 'stall.lua:8', 'train.lua:40' }, c_stack = {} })
    local text, found = flight.diagnose(dir, { first = 0, count = 2, dump_id = 7 })
    has(text, 'group pg0 (gloo): rank 1 is behind: its last collective is all_reduce #2 on (4) float32 at train.lua:12 (completed); rank 0 issued all_reduce #3 on (4) float32 at train.lua:13')
    has(text, 'rank 1: not in a collective; running Lua at stall.lua:8\n    train.lua:40')
    has(text, 'rank 0: waiting in all_reduce #3 on (4) float32 at train.lua:13 (started in pg0, issued 7.0 s ago)')
    assert.same({ 1 }, found.behind)
    -- the rank behind is told first
    assert.is_true(text:find('rank 1: not in') < text:find('rank 0: waiting'))
  end)

  it('finds the same sequence number issued as different calls, and a rank inside a C call', function()
    write(0, 0, { entry(1, 1, 'all_reduce', 'started') })
    write(1, 0, { entry(1, 1, 'broadcast', 'started', { desc = '(8) float32' }) },
      { state = 'c', traceback = {}, c_stack = { 'wait4+0x55 (libc.so.6)', 'main+0x12 (dlua)' } })
    local text, found = flight.diagnose(dir, { first = 0, count = 2 })
    has(text, 'group pg0: collective #1 differs: rank')
    assert.same({ 1 }, found.mismatch)
    has(text, 'every rank issued')
    assert.is_nil(text:find('behind', 1, true))
  end)

  it('says which ranks wrote no dump or one of an earlier dump', function()
    write(0, 3, { entry(1, 1, 'barrier', 'completed') })
    write(1, 2, { entry(1, 1, 'barrier', 'completed') })
    local text, found = flight.diagnose(dir, { first = 0, count = 3, dump_id = 3 })
    has(text, 'rank 2 wrote no dump')
    has(text, 'rank 1 did not answer in time')
    assert.same({ 2, 1 }, found.missing)
    has(text, 'group pg0 (gloo): no rank is behind: rank 0 issued barrier #1 at train.lua:11, completed')
  end)

  it('reports a failed collective as the rank\'s position', function()
    write(0, 0, { entry(1, 1, 'all_reduce', 'failed', { error = 'timed out after 3000 ms' }) })
    local text = flight.diagnose(dir, { first = 0, count = 1 })
    has(text, 'rank 0: its all_reduce #1 on (4) float32 at train.lua:11 failed: timed out after 3000 ms')
  end)

  it("names the first frame of the user's own code when the rank is inside dlua's", function()
    local tree = debug.getinfo(flight.diagnose, 'S').source:match('^@(.*)lua/dlua/flight%.lua$')
    write(0, 0, {}, { state = 'lua', traceback = { tree .. 'bindings/nn.lua:75', tree .. 'lua/dlua/nn/init.lua:240',
      '[builtin#21]', 'recipes/train.lua:149', 'recipes/train.lua:300' }, c_stack = {} })
    local text = flight.diagnose(dir, { first = 0, count = 1 })
    has(text, 'rank 0: not in a collective; running Lua at ' .. tree .. 'bindings/nn.lua:75 (in recipes/train.lua:149)')
    has(text, 'no collective recorded yet')
  end)
end)

describe('dlua.flight report (`dlua flight DIR`)', function()
  setup(function() os.execute("mkdir -p '" .. dir .. "'") end)
  after_each(clear)
  teardown(function() os.remove(dir) end)

  it('diagnoses the newest dump, over the world size the dumps give, under the launcher\'s heading', function()
    local why = 'a collective timed out on rank 0'
    write(0, 41, { entry(1, 1, 'all_reduce', 'started') }, nil, { world_size = 3, time = 120, reason = why })
    write(1, 40, { entry(1, 1, 'all_reduce', 'completed') }, nil, { world_size = 3, time = 90, reason = 'earlier' })
    local text, found = flight.report(dir)
    assert.are.equal(string.format('flight recorder (%s): %s/flight-rank{0..2}.json', why, dir), text:match('^[^\n]*'))
    has(text, 'rank 2 wrote no dump')
    has(text, 'rank 1 did not answer in time')
    assert.same({ 2, 1 }, found.missing)
    -- an older dump asked for by number: rank 1's, rank 0's now the stale one
    text = flight.report(dir, { dump_id = 40 })
    has(text, 'rank 0 did not answer in time')
  end)

  it("names a dump the launcher asked for by its number", function()
    write(0, 3, { entry(1, 1, 'barrier', 'completed') }, nil, { world_size = 1, reason = 'job' })
    assert.are.equal(string.format("flight recorder (the launcher's dump 3): %s/flight-rank0.json", dir),
      flight.report(dir):match('^[^\n]*'))
  end)

  it('says when the directory holds no dump', function()
    local text, why = flight.report(dir .. '/none')
    assert.is_nil(text)
    assert.are.equal('no flight-recorder dump (flight-rank<r>.json) in ' .. dir .. '/none', why)
  end)

  it('runs as `dlua flight DIR`', function()
    write(0, 5, { entry(1, 1, 'barrier', 'completed') }, nil, { world_size = 1, reason = 'signal' })
    local p = io.popen(string.format("'%s' flight '%s' 2>&1; echo rc=$?", arg[-1], dir))
    local out = p:read('*a')
    p:close()
    assert.are.equal(string.format('flight recorder (signal): %s/flight-rank0.json\n', dir) ..
      'group pg0 (gloo): no rank is behind: rank 0 issued barrier #1 at train.lua:11, completed\n' ..
      'rank 0: not in a collective; where it is is unknown\nrc=0\n', out)
  end)
end)
