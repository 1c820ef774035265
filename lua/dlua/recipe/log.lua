-- dlua.recipe.log: rank 0's messages and its progress line (a redrawn bar on a terminal, periodic lines otherwise).
local log = {}
local format = string.format

local Logger = {}
Logger.__index = Logger

local function is_tty()
  local st = os.execute('test -t 1')  -- LuaJIT has no isatty
  return st == true or st == 0
end

-- Logger{rank = 0, every = 10, tty = auto, out = io.stdout}: log:print(fmt, ...) prints on rank 0
-- only; log:progress(epoch, i, n, loss, img_s, eta_s) redraws a bar on a terminal, else prints
-- every `every` steps and the last one of the epoch.
function log.Logger(opts)
  opts = opts or {}
  local self = setmetatable({ rank = opts.rank or 0, every = opts.every or 10, out = opts.out or io.stdout }, Logger)
  if opts.tty ~= nil then self.tty = opts.tty else self.tty = self.rank == 0 and is_tty() end
  if self.out.setvbuf then self.out:setvbuf('line') end
  return self
end

function Logger:print(fmt, ...)
  if self.rank ~= 0 then return end
  local s = select('#', ...) > 0 and format(fmt, ...) or tostring(fmt)
  if self.drawn then self.out:write('\n'); self.drawn = false end
  self.out:write(s, '\n')
end

-- One progress line; extra (optional) is appended, e.g. '  grad norm 1.2'.
function Logger:progress(epoch, i, n, loss, ips, eta, extra)
  if self.rank ~= 0 then return end
  local line = format('epoch %d  %5d/%d  loss %.4f  %6.0f img/s  ETA %ds%s', epoch, i, n, loss, ips, eta, extra or '')
  if self.tty then
    local width = 20
    local done = math.floor(width * i / n)
    self.out:write('\r[' .. string.rep('=', done) .. string.rep(' ', width - done) .. '] ' .. line)
    self.out:flush()
    self.drawn = true
  elseif i % self.every == 0 or i == n then
    self.out:write(line, '\n')
  end
end

-- Ends a drawn bar's line (before the epoch's summary).
function Logger:finish_line()
  if self.drawn then self.out:write('\n'); self.drawn = false end
end

return log
