-- dlua.flight: reads the flight recorder's dumps (DIR/flight-rank{r}.json) and says what hangs: who is behind, at which collective and Lua line, and where each rank is.
local json = require 'dlua.ckpt.json'

local M = {}
local format, concat = string.format, table.concat

local function read(path)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  return s
end

-- The dump of rank r in dir, or nil and why.
function M.load(dir, r)
  local path = format('%s/flight-rank%d.json', dir, r)
  local text = read(path)
  if not text then return nil, 'no dump' end
  local ok, d = pcall(json.decode, text)
  if not ok then return nil, format('%s: %s', path, tostring(d)) end
  return d
end

local function is_p2p(e) return e.op == 'send' or e.op == 'recv' end

local function describe(e)
  local where = e.site ~= '' and (' at ' .. e.site) or ''
  local what = e.op == 'barrier' and '' or (' on ' .. (e.desc or '?'))
  local bucket = e.bucket and format(' (bucket %d)', e.bucket) or ''
  return format('%s #%d%s%s%s', e.op, e.seq, what, bucket, where)
end

local function ago(t, now)
  if not t then return '' end
  return format('%.1f s', math.max(0, now - t))
end

local function ranks_text(list)
  table.sort(list)
  local parts, i = {}, 1
  while i <= #list do
    local j = i
    while j < #list and list[j + 1] == list[j] + 1 do j = j + 1 end
    parts[#parts + 1] = j > i and format('%d-%d', list[i], list[j]) or tostring(list[i])
    i = j + 1
  end
  return (#list == 1 and 'rank ' or 'ranks ') .. concat(parts, ',')
end

-- Per group: each rank's last issued collective and whether it is still in flight.
local function by_group(dumps)
  local groups, order = {}, {}
  for r, d in pairs(dumps) do
    for _, e in ipairs(d.entries or {}) do
      if not is_p2p(e) then
        local g = groups[e.group]
        if not g then
          g = { name = e.group, backend = e.backend, last = {}, inflight = {}, bySeq = {} }
          groups[e.group] = g
          order[#order + 1] = e.group
        end
        local last = g.last[r]
        if not last or e.seq > last.seq then g.last[r] = e end
        if e.state == 'queued' or e.state == 'started' then
          local f = g.inflight[r]
          if not f or e.seq < f.seq then g.inflight[r] = e end  -- the oldest: the one it waits for
        end
        g.bySeq[e.seq] = g.bySeq[e.seq] or {}
        g.bySeq[e.seq][r] = e
      end
    end
  end
  table.sort(order)
  return groups, order
end

-- dlua's own tree (lua/dlua, bindings, models), to find the first frame of a traceback that is the user's code.
local tree = (debug.getinfo(1, 'S').source or ''):match('^@(.*)lua/dlua/flight%.lua$')
local function is_library(frame)
  if frame:find('^%[') then return true end  -- [builtin#21], [C]
  if tree == nil or frame:sub(1, #tree) ~= tree then return false end
  local rel = frame:sub(#tree + 1)
  return rel:find('^lua/dlua/') ~= nil or rel:find('^bindings/') ~= nil or rel:find('^models/') ~= nil
end

-- The rank's newest entry of any group (its last collective), or nil.
local function newest(d)
  local best
  for _, e in ipairs(d.entries or {}) do
    if not best or (e.id or 0) > (best.id or 0) then best = e end
  end
  return best
end

-- Where rank r is, in a line or a few: in a collective, or its Lua traceback / C stack.
local function position(r, d, now, inflight)
  local lines = {}
  if inflight then
    lines[1] = format('rank %d: waiting in %s (%s in %s, issued %s ago)', r, describe(inflight), inflight.state,
      inflight.group, ago(inflight.issued, now))
    return lines
  end
  local w = d.where or {}
  local last = newest(d)
  if last and last.state == 'failed' then
    lines[1] = format('rank %d: its %s failed: %s', r, describe(last), last.error or '?')
    return lines
  end
  if w.state == 'lua' and w.traceback and #w.traceback > 0 then
    local user
    for _, f in ipairs(w.traceback) do
      if not is_library(f) then user = f break end
    end
    lines[1] = format('rank %d: not in a collective; running Lua at %s%s', r, w.traceback[1],
      user and user ~= w.traceback[1] and format(' (in %s)', user) or '')
    for i = 2, math.min(#w.traceback, 8) do lines[#lines + 1] = '    ' .. w.traceback[i] end
  elseif w.state == 'c' and w.c_stack and #w.c_stack > 0 then
    lines[1] = format('rank %d: not in a collective; inside a C call:', r)
    for i = 1, math.min(#w.c_stack, 8) do lines[#lines + 1] = '    ' .. w.c_stack[i] end
  elseif w.state == 'exiting' then
    lines[1] = format('rank %d: its program failed; it is exiting', r)
  else
    lines[1] = format('rank %d: not in a collective; where it is is unknown', r)
  end
  return lines
end

-- diagnose(dir, {first = 0, count = N, dump_id = id}) -> text (lines), findings
-- findings: {behind = {rank...}, missing = {rank...}, mismatch = {...}}
function M.diagnose(dir, opts)
  opts = opts or {}
  local first, count, want = opts.first or 0, opts.count, opts.dump_id
  if want == 0 then want = nil end
  local dumps, missing, stale, out = {}, {}, {}, {}
  local found = { behind = {}, missing = missing, mismatch = {} }
  if count == nil then  -- every flight-rank<r>.json from r = first on
    count = 0
    while M.load(dir, first + count) do count = count + 1 end
  end
  local now = 0
  for r = first, first + count - 1 do
    local d = M.load(dir, r)
    if not d then
      missing[#missing + 1] = r
    elseif want and d.dump_id ~= want then
      stale[#stale + 1] = r
    else
      dumps[r] = d
      now = math.max(now, d.time or 0)
    end
  end
  if #missing > 0 then out[#out + 1] = format('%s wrote no dump (exited, or not a dlua rank)', ranks_text(missing)) end
  if #stale > 0 then
    out[#out + 1] = format('%s did not answer in time (a thread that never reaches a safe point?)', ranks_text(stale))
    for _, r in ipairs(stale) do missing[#missing + 1] = r end
  end
  local groups, order = by_group(dumps)
  local told = {}
  for _, name in ipairs(order) do
    local g = groups[name]
    local top, top_rank = nil, nil
    for r, e in pairs(g.last) do
      if not top or e.seq > top.seq then top, top_rank = e, r end
    end
    -- behind: issued fewer collectives of this group than the furthest rank
    local behind, ahead = {}, {}
    for r, e in pairs(g.last) do
      if e.seq < top.seq then behind[#behind + 1] = r else ahead[#ahead + 1] = r end
    end
    table.sort(behind)
    for _, r in ipairs(behind) do
      local e = g.last[r]
      found.behind[#found.behind + 1] = r
      out[#out + 1] = format('group %s (%s): rank %d is behind: its last collective is %s (%s); %s issued %s',
        name, g.backend or '?', r, describe(e), e.state, ranks_text(ahead), describe(top))
    end
    -- the same number on every rank but another call: a mismatch (debug mode names its line too)
    for seq, per in pairs(g.bySeq) do
      local ref, refr
      for r, e in pairs(per) do
        if not ref then ref, refr = e, r
        elseif e.op ~= ref.op or e.desc ~= ref.desc then
          found.mismatch[#found.mismatch + 1] = seq
          out[#out + 1] = format('group %s: collective #%d differs: rank %d %s; rank %d %s', name, seq, refr,
            describe(ref), r, describe(e))
          break
        end
      end
    end
    if #behind == 0 then
      local waiting = {}
      for r, e in pairs(g.inflight) do if e.seq == top.seq then waiting[#waiting + 1] = r end end
      if #waiting > 0 then
        out[#out + 1] = format('group %s (%s): every rank issued %s; it has not completed on %s', name,
          g.backend or '?', describe(top), ranks_text(waiting))
      elseif #waiting == 0 then
        out[#out + 1] = format('group %s (%s): no rank is behind: %s issued %s, completed', name, g.backend or '?',
          ranks_text(ahead), describe(top))
      end
    end
  end
  -- where each rank is: the ones behind first
  local ranks = {}
  for r in pairs(dumps) do ranks[#ranks + 1] = r end
  table.sort(ranks, function(a, b)
    local ba, bb = false, false
    for _, x in ipairs(found.behind) do
      if x == a then ba = true end
      if x == b then bb = true end
    end
    if ba ~= bb then return ba end
    return a < b
  end)
  for _, r in ipairs(ranks) do
    if not told[r] then
      told[r] = true
      local inflight
      for _, name in ipairs(order) do
        local f = groups[name].inflight[r]
        if f and (not inflight or (f.issued or 0) < (inflight.issued or 0)) then inflight = f end
      end
      for _, line in ipairs(position(r, dumps[r], now, inflight)) do out[#out + 1] = line end
    end
  end
  if #order == 0 and next(dumps) then out[#out + 1] = 'no collective recorded yet' end
  return concat(out, '\n') .. (#out > 0 and '\n' or ''), found
end

local usage = [[
usage: dlua flight [DIR] [--dump-id N]
  The diagnosis of the flight-recorder dumps DIR/flight-rank{r}.json (DIR: DLUA_FLIGHT_DIR, else .), as the launcher
  prints it: per group who is behind at which collective and Lua line, and where each rank is. By default the newest
  dump's number: a rank whose file holds another dump is said not to have answered.
]]

-- The ranks that have a dump in dir, sorted.
local function ranks_in(dir)
  local r = {}
  for _, name in ipairs(require('bindings.ckpt').list_dir(dir, 3)) do
    local n = name:match('^flight%-rank(%d+)%.json$')
    if n then r[#r + 1] = tonumber(n) end
  end
  table.sort(r)
  return r
end

-- report(dir, {dump_id = N}) -> the heading and the diagnosis of the dumps in dir (ranks 0 to the world size), or nil and why.
function M.report(dir, opts)
  opts = opts or {}
  local ranks = ranks_in(dir)
  if #ranks == 0 then return nil, format('no flight-recorder dump (flight-rank<r>.json) in %s', dir) end
  local newest, world = nil, ranks[#ranks] + 1
  for _, r in ipairs(ranks) do
    local d, why = M.load(dir, r)
    if not d then return nil, why end
    if not newest or (d.time or 0) > (newest.time or 0) then newest = d end
    world = math.max(world, tonumber(d.world_size) or 0)
  end
  local want = opts.dump_id or newest.dump_id
  local why = newest.reason == 'job' and format("the launcher's dump %d", newest.dump_id or 0) or newest.reason or '?'
  local head = world == 1 and format('flight recorder (%s): %s/flight-rank0.json', why, dir)
    or format('flight recorder (%s): %s/flight-rank{0..%d}.json', why, dir, world - 1)
  local text, found = M.diagnose(dir, { first = 0, count = world, dump_id = want })
  return head .. '\n' .. text, found
end

-- `dlua flight [DIR]`
function M.main(args)
  local dir, want
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == '-h' or a == '--help' then io.stdout:write(usage) return end
    if a == '--dump-id' then
      i = i + 1
      want = tonumber(args[i])
      if not want then io.stderr:write('dlua flight: --dump-id needs a number\n' .. usage) os.exit(2) end
    elseif a:sub(1, 1) == '-' or dir then
      io.stderr:write(format("dlua flight: unexpected argument '%s'\n%s", a, usage))
      os.exit(2)
    else
      dir = a
    end
    i = i + 1
  end
  dir = dir or os.getenv('DLUA_FLIGHT_DIR') or '.'
  if dir == '' then dir = '.' end
  local text, why = M.report(dir, { dump_id = want })
  if not text then
    io.stderr:write('dlua flight: ' .. why .. '\n')
    os.exit(1)
  end
  io.stdout:write(text)
end

return M
