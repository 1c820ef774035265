-- dlua.cli: option syntaxes, types from the defaults, --help, unknown options with suggestions, exit codes.
local dlua = require 'dlua'
local cli = dlua.cli
local host = require 'dlua.host'

local defaults = { epochs = 10, lr = 0.1, data = '', nesterov = true, name = 'run', image_size = 28,
  milestones = { 30, 60 }, tags = { 'a' } }
local spec = { description = 'Trains a model.', help = { epochs = 'number of epochs', image_size = 'input side' },
  types = { epochs = 'int' }, exit = false, program = 'recipe.lua' }

local function parse(args) return cli.parse(args, defaults, spec) end

describe('dlua.cli.parse', function()
  it('fills every default when no arguments are given', function()
    local o = parse({})
    assert.equals(10, o.epochs); assert.equals(0.1, o.lr); assert.equals('', o.data)
    assert.is_true(o.nesterov); assert.equals('run', o.name); assert.equals(28, o.image_size)
    assert.same({ 30, 60 }, o.milestones)
    -- the defaults table itself is not modified, nor shared
    o.milestones[1] = 1
    assert.equals(30, defaults.milestones[1])
  end)

  it('accepts --name=value and --name value, with - and _ alike', function()
    local o = parse({ '--epochs=3', '--lr', '0.05', '--image-size', '32', '--data=/tmp/x=y', '--name', 'exp 1' })
    assert.equals(3, o.epochs); assert.equals(0.05, o.lr); assert.equals(32, o.image_size)
    assert.equals('/tmp/x=y', o.data); assert.equals('exp 1', o.name)
    assert.equals(64, parse({ '--image_size=64' }).image_size)
    -- negative numbers are values, not options; the last occurrence wins
    assert.equals(-0.5, parse({ '--lr', '-0.5' }).lr)
    assert.equals(2, parse({ '--epochs=1', '--epochs=2' }).epochs)
    assert.equals(1e-3, parse({ '--lr=1e-3' }).lr)
    -- an empty string is a value
    assert.equals('', parse({ '--name=' }).name)
  end)

  it('reads booleans as --flag, --no-flag and --flag=value', function()
    assert.is_false(parse({ '--no-nesterov' }).nesterov)
    assert.is_true(parse({ '--no-nesterov', '--nesterov' }).nesterov)
    assert.is_false(parse({ '--nesterov=false' }).nesterov)
    assert.is_false(parse({ '--nesterov=0' }).nesterov)
    assert.is_true(parse({ '--nesterov=yes' }).nesterov)
    local o, msg, code = parse({ '--nesterov=maybe' })
    assert.is_nil(o); assert.equals(2, code)
    assert.matches("option %-%-nesterov expects true or false, got 'maybe'", msg)
    o, msg = parse({ '--nesterov', 'false' })
    assert.is_nil(o)
    assert.matches("unexpected argument 'false' %(a boolean takes %-%-nesterov=false or %-%-no%-nesterov%)", msg)
    o, msg = parse({ '--no-nesterov=1' })
    assert.matches('option %-%-no%-nesterov takes no value', msg)
  end)

  it('parses lists as comma-separated values of the default element type', function()
    assert.same({ 5, 7.5 }, parse({ '--milestones=5,7.5' }).milestones)
    assert.same({}, parse({ '--milestones=' }).milestones)
    assert.same({ 'x', 'y z' }, parse({ '--tags', 'x,y z' }).tags)
    local o, msg = parse({ '--milestones=5,x' })
    assert.is_nil(o)
    assert.matches("option %-%-milestones expects a comma%-separated list of numbers, got '5,x'", msg)
  end)

  it('names the option and the value when a number does not parse', function()
    local o, msg, code = parse({ '--lr', 'fast' })
    assert.is_nil(o); assert.equals(2, code)
    assert.matches("^recipe.lua: option %-%-lr expects a number, got 'fast'", msg)
    o, msg = parse({ '--epochs=2.5' })
    assert.matches("option %-%-epochs expects an integer, got '2.5'", msg)
    o, msg = parse({ '--lr' })
    assert.matches('option %-%-lr needs a value', msg)
    o, msg = parse({ '--lr', '--epochs', '3' })
    assert.matches('option %-%-lr needs a value', msg)
    o, msg = parse({ '--lr=nan' })
    assert.is_nil(o)
  end)

  it('rejects unknown options by name, suggesting the closest', function()
    local o, msg, code = parse({ '--epoch', '3' })
    assert.is_nil(o); assert.equals(2, code)
    assert.matches("unknown option '%-%-epoch' %(did you mean '%-%-epochs'%?%)", msg)
    o, msg = parse({ '--imagesize=3' })
    assert.matches("did you mean '%-%-image%-size'%?", msg)
    o, msg = parse({ '--nestrov' })
    assert.matches("unknown option '%-%-nestrov' %(did you mean '%-%-nesterov'%?%)", msg)
    o, msg = parse({ '--batch-size=64' })
    assert.matches("unknown option '%-%-batch%-size'", msg)
    assert.is_nil(msg:find('did you mean', 1, true))  -- nothing is close
    o, msg = parse({ 'data.bin' })
    assert.matches("unexpected argument 'data.bin'", msg)
    o, msg = parse({ '-lr', '3' })
    assert.matches("unexpected argument '%-lr' %(options start with %-%-%)", msg)
    assert.equals('epochs', cli.closest('epoch', { 'epochs', 'lr' }))
  end)

  it('prints every option with its default and help for --help', function()
    local o, text, code = parse({ '--epochs', '3', '--help' })
    assert.is_nil(o); assert.equals(0, code)
    assert.matches('^usage: recipe.lua %[options%]', text)
    assert.truthy(text:find('Trains a model.', 1, true))
    assert.matches('\n  %-%-epochs INT +number of epochs %(default: 10%)\n', text)
    assert.matches('\n  %-%-image%-size NUMBER +input side %(default: 28%)\n', text)
    assert.matches("\n  %-%-name STRING +%(default: 'run'%)\n", text)
    assert.matches('\n  %-%-%[no%-%]nesterov +%(default: true%)\n', text)
    assert.matches('\n  %-%-milestones LIST +%(default: 30,60%)\n', text)
    assert.matches('\n  %-h, %-%-help +print this help and exit\n', text)
    assert.equals(0, select(3, parse({ '-h' })))
  end)

  it('gives an options table that rejects reading unknown names', function()
    local o = parse({})
    assert.has_error(function() return o.epoch end, "cli: no option 'epoch' (did you mean 'epochs'?)")
    assert.has_error(function() return o.zzzzzzzz end, "cli: no option 'zzzzzzzz'")
    o.extra = 1  -- writing is allowed (a recipe may add derived settings)
    assert.equals(1, o.extra)
  end)

  it('reports mistakes in the recipe itself as errors', function()
    assert.has_error(function() cli.parse({}, { f = function() end }, { exit = false }) end,
      'cli.parse: the default of f must be a number, string, boolean or list, got function')
    assert.has_error(function() cli.parse({}, { a = 1 }, { exit = false, help = { b = 'x' } }) end,
      "cli.parse: help for unknown option 'b'")
    assert.has_error(function() cli.parse({}, { a = 1 }, { exit = false, types = { a = 'float' } }) end)
  end)

  it('exits 0 after --help on stdout, 2 after a usage error on stderr', function()
    local dir = os.tmpname()
    local script = dir .. '.lua'
    local f = assert(io.open(script, 'w'))
    f:write([[
local cli = require('dlua').cli
local opt = cli.parse(arg, { epochs = 10, lr = 0.1 }, { help = { lr = 'learning rate' } })
print('epochs=' .. opt.epochs .. ' lr=' .. opt.lr)
]])
    f:close()
    local function run(args)
      local cmd = string.format("'%s' '%s' %s 2>%s.err; echo \"rc=$?\"", host.exe, script, args, dir)
      local p = assert(io.popen(cmd))
      local out = p:read('*a')
      p:close()
      local e = io.open(dir .. '.err')
      local err = e:read('*a')
      e:close()
      return out, err
    end
    local out, err = run('--epochs 3')
    assert.matches('epochs=3 lr=0.1\nrc=0', out)
    out, err = run('--help')
    assert.matches('%-%-lr NUMBER +learning rate %(default: 0.1%)', out)
    assert.matches('rc=0', out)
    assert.equals('', err)
    out, err = run('--epohcs 3')
    assert.matches('rc=2', out)
    assert.matches("unknown option '%-%-epohcs' %(did you mean '%-%-epochs'%?%)", err)
    os.remove(script); os.remove(dir); os.remove(dir .. '.err')
  end)
end)
