-- dlua's subcommands (`dlua plot ...`, `dlua experiment ...`, `dlua flight DIR`): host/main.c hands a bare-word script name here.
local M = {}

-- name -> the module whose main(args) runs it, and one line for the list.
M.commands = {
  plot = { module = 'dlua.plot', help = 'loss, learning rate and img/s of metrics files (--metrics) as one PNG' },
  flight = { module = 'dlua.flight', help = 'the diagnosis of flight-recorder dumps (DIR/flight-rank{r}.json): who hangs where' },
  experiment = { module = 'dlua.experiment', help = 'the seed\'s exercises: a table and a PNG each (dlua experiment --list)' },
}

local function names()
  local r = {}
  for k in pairs(M.commands) do r[#r + 1] = k end
  table.sort(r)
  return r
end

-- run(name, ...): the subcommand's main with its arguments as a list (arg[0] says `dlua name`).
function M.run(name, ...)
  local c = M.commands[name]
  if not c then
    local hint = require('dlua.cli').closest(name, names())
    io.stderr:write(('dlua: cannot open %s (No such file or directory; nor is it a subcommand: %s%s)\n'):format(name,
      table.concat(names(), ', '), hint and ("; did you mean '" .. hint .. "'?") or ''))
    os.exit(1)
  end
  local args = { [0] = 'dlua ' .. name, ... }
  _G.arg = args
  return require(c.module).main(args)
end

return M
