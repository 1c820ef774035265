-- A rank's side of the SPMD REPL (`dlua --nproc N -i`): runs each chunk the launcher sends and returns its output.
local store_binding = require 'bindings.store'
local pretty = require 'dlua.pretty'

local M = {}

local function env_number(name)
  local v = tonumber(os.getenv(name) or '')
  if v == nil then error('SPMD REPL: ' .. name .. ' is not set: this rank was not started by `dlua --nproc N -i`', 0) end
  return v
end

-- Compiles as the plain REPL does: an expression first (so `1+1` prints 2), then a statement.
local function compile(code, name)
  local src = code:sub(1, 1) == '=' and code:sub(2) or code
  local f, err = loadstring('return select(1, ' .. src .. '\n)', name)
  if f or code:sub(1, 1) == '=' then return f, err end
  return loadstring(code, name)
end

-- Runs one chunk with print and io.write captured (in env, when given: its globals); returns ok, text.
local function run(code, env, name)
  local out = {}
  local function emit(s) out[#out + 1] = s end
  local saved_print, saved_write = print, io.write
  _G.print = function(...)
    local n = select('#', ...)
    local parts = {}
    for i = 1, n do parts[i] = tostring((select(i, ...))) end
    emit(table.concat(parts, '\t') .. '\n')
  end
  io.write = function(...)
    for i = 1, select('#', ...) do emit(tostring((select(i, ...)))) end
    return io.stdout
  end
  local ok, err
  local f, cerr = compile(code, name or '=stdin')
  if f and env then setfenv(f, env) end
  if not f then
    ok, err = false, cerr
  else
    local results = { xpcall(f, function(e) return tostring(e) end) }
    ok = table.remove(results, 1)
    if ok then
      local n = #results
      if n > 0 then
        local parts = {}
        for i = 1, n do parts[i] = pretty.format(results[i]) end
        emit(table.concat(parts, '\t') .. '\n')
      end
    else
      err = results[1]
    end
  end
  _G.print, io.write = saved_print, saved_write
  if not ok then emit(tostring(err) .. '\n') end
  return ok, table.concat(out)
end

-- For `dlua attach` (dlua.monitor): the same, with the chunk's globals in env.
function M.run_chunk(code, env) return run(code, env, '=attach') end

function M.serve()
  local rank, world = env_number('RANK'), env_number('WORLD_SIZE')
  local host, port = os.getenv('MASTER_ADDR') or '127.0.0.1', env_number('MASTER_PORT')
  local store = store_binding.connect(host, port, os.getenv('DLUA_JOB_TOKEN') or '', 60)
  _G.dlua = _G.dlua or require 'dlua'
  -- collectives work from the first chunk: the process group is up before the prompt
  local ok_dist, dist = pcall(require, 'dlua.dist')
  if ok_dist then
    if not dist.is_initialized() then dist.init() end
    _G.dist = dist
  end
  local k = 0
  while true do
    k = k + 1
    local key, msg = 'dlua/repl/chunk/' .. k, nil
    while msg == nil do
      local ok, v = pcall(store.get, store, key, math.huge)
      if ok then
        msg = v
      elseif tostring(v):find('interrupted', 1, true) then
        store_binding.clear_interrupt()  -- a Ctrl-C that arrived between chunks: nothing to stop
      else
        error(v, 0)
      end
    end
    -- the last rank to read a chunk removes it: the launcher cannot, since for ':on R' it hears only
    -- from rank R, and another rank may not have read the chunk yet
    local read_key = 'dlua/repl/read/' .. k
    if store:add(read_key, 1) == world then
      store:delete(key)
      store:delete(read_key)
    end
    local target, code = msg:match('^(%w+)\n(.*)$')
    if target == 'exit' then break end
    if target == 'all' or tonumber(target) == rank then
      local ok, text = run(code)
      store_binding.clear_interrupt()
      store:set('dlua/repl/out/' .. k .. '/' .. rank, (ok and 'ok\n' or 'err\n') .. text)
    end
  end
  store:close()
  if ok_dist and dist.is_initialized() then dist.destroy() end
end

return M
