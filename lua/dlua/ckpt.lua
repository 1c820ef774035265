-- dlua.ckpt: checkpoints as safetensors files: plain tensor files, and the whole training state saved atomically (optionally in the background, sharded over ranks) and resumed bit for bit.
local dlua = require 'dlua'
local B = require 'bindings.ckpt'
local J = require 'dlua.ckpt.json'

local ckpt = {}
local format, floor, concat = string.format, math.floor, table.concat

ckpt.FORMAT = 'dlua.ckpt/1'
ckpt.available = B.available

local function fail(level, fmt, ...) error(format(fmt, ...), level + 1) end

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end

local function read_text(path)
  local f, err = io.open(path, 'rb')
  if not f then return nil, err end
  local s = f:read('*a')
  f:close()
  return s
end

local function describe(v)
  if type(v) == 'string' then return "'" .. v .. "'" end
  return tostring(v)
end

local check_options = require('dlua.options').check

local function need_available(op, level)
  if not B.available() then
    fail(level + 1, '%s: checkpoints are off: dlua was built without cJSON (apt-get install libcjson-dev, then reconfigure)', op)
  end
end

-- The names of a state dict in a stable order: its keys() when it has one (a module's), else sorted.
local function sorted_keys(t)
  local mt = getmetatable(t)
  if mt and type(mt.__index) == 'table' and type(mt.__index.keys) == 'function' then return mt.__index.keys() end
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  return keys
end

---------------------------------------------------------------------------------------------
-- Plain tensor files

-- save_file(path, tensors, metadata): tensors is name -> tensor (a state_dict), metadata
-- string -> string. Written atomically: path is the old file or the whole new one.
function ckpt.save_file(path, tensors, metadata)
  need_available('save_file', 2)
  if type(path) ~= 'string' or path == '' then fail(2, 'save_file: expected a file name, got %s', describe(path)) end
  if type(tensors) ~= 'table' then fail(2, 'save_file: expected a table of name -> tensor, got %s', type(tensors)) end
  local names, list = {}, {}
  for _, k in ipairs(sorted_keys(tensors)) do
    local t = tensors[k]
    if type(k) ~= 'string' then fail(2, 'save_file: tensor names must be strings, got %s', describe(k)) end
    if not dlua.is_tensor(t) then fail(2, "save_file: '%s' is a %s, not a tensor", k, type(t)) end
    names[#names + 1], list[#list + 1] = k, t
  end
  local mk, mv = {}, {}
  for k, v in pairs(metadata or {}) do
    if type(k) ~= 'string' or type(v) ~= 'string' then
      fail(2, 'save_file: metadata is a string -> string map (safetensors allows no other), got %s = %s', describe(k), describe(v))
    end
    mk[#mk + 1], mv[#mv + 1] = k, v
  end
  B.save_file(path, names, list, mk, mv, 1)
end

-- load_file(path) -> tensors (name -> new CPU tensor, in file order by t:keys()), metadata.
-- Any safetensors file (PyTorch's too); dlua's checksums are checked.
function ckpt.load_file(path)
  need_available('load_file', 2)
  if type(path) ~= 'string' or path == '' then fail(2, 'load_file: expected a file name, got %s', describe(path)) end
  local f = B.open(path, 1)
  local out, order = {}, {}
  for _, e in ipairs(f.entries) do
    out[e.name] = f:read(e, 1)
    order[#order + 1] = e.name
  end
  local meta = f.metadata
  f:close()
  return setmetatable(out, { __index = { keys = function() return order end } }), meta
end

-- crc32(tensors) or crc32(module): zlib's CRC32 (8 hex digits) of the tensors' logical bytes in
-- turn; for a module, its parameters and buffers in state-dict order (the recipes print it, so
-- two runs can be compared bit for bit).
function ckpt.crc32(x)
  local list = {}
  if type(x) == 'table' and not dlua.is_tensor(x) and type(x.state_dict) == 'function' then
    local sd = x:state_dict()
    for _, k in ipairs(sorted_keys(sd)) do list[#list + 1] = sd[k] end
  elseif dlua.is_tensor(x) then
    list[1] = x
  elseif type(x) == 'table' then
    list = x
  else
    fail(2, 'crc32: expected a tensor, a list of tensors or a module, got %s', type(x))
  end
  return B.crc32(list, 1)
end

---------------------------------------------------------------------------------------------
-- State entries

-- Per-rank state (each rank's own RNG stream, compression residuals): ckpt.per_rank(obj) saves
-- every rank's value; objects may also say so with a field ckpt_per_rank = true.
local PerRank = {}
PerRank.__index = PerRank
function PerRank:state_dict() return self.inner:state_dict() end
function PerRank:load_state_dict(sd) return self.inner:load_state_dict(sd) end
function ckpt.per_rank(obj)
  if obj == nil or obj.state_dict == nil then fail(2, 'per_rank: expected an object with state_dict()/load_state_dict()') end
  return setmetatable({ inner = obj, ckpt_per_rank = true }, PerRank)
end

-- DDP's communication state (the hook's state, the accumulation counter), per rank. comm_of names the model, so
-- save and load know this entry holds that model's state.
function ckpt.comm_state(ddp)
  if type(ddp) ~= 'table' or type(ddp.comm_state_dict) ~= 'function' then
    fail(2, 'comm_state: expected a dlua.dist.DDP or ZeRO model')
  end
  return setmetatable({ inner = {
    state_dict = function() return ddp:comm_state_dict() end,
    load_state_dict = function(_, sd) ddp:load_comm_state_dict(sd) end,
  }, ckpt_per_rank = true, comm_of = ddp }, PerRank)
end

local function has_method(obj, name)
  local ok, f = pcall(function() return obj[name] end)
  return ok and type(f) == 'function'
end

-- A dlua.dist.DDP or ZeRO-1 model whose hook keeps state (a dlua.dist.compress hook, or any hook state with
-- state_dict() and load_state_dict()): save and load carry that state with the model, per rank, as the entry
-- '<name>.comm' (a name no state entry can have), so {model = ddp} alone does not drop the residuals (PyTorch did:
-- pytorch #75666).
local function stateful_ddp(obj)
  if type(obj) ~= 'table' then return false end
  local ddp, zero, mt = package.loaded['dlua.ddp'], package.loaded['dlua.zero'], getmetatable(obj)
  if not ((type(ddp) == 'table' and mt == ddp.DDP_methods) or (type(zero) == 'table' and mt == zero.methods)) then
    return false
  end
  local hs = rawget(obj, 'hook_state')
  return type(hs) == 'table' and has_method(hs, 'state_dict') and has_method(hs, 'load_state_dict')
end

local function is_module(obj)
  return type(obj) == 'table' and has_method(obj, 'named_parameters') and has_method(obj, 'state_dict')
end

-- {name, kind, obj, tree (JSON text with {"$tensor": path} refs), tensors {{path, t}}, per_rank}
local function collect(state, opts, world, level)
  if type(state) ~= 'table' then fail(level + 1, 'save: expected a state table (name -> object), got %s', type(state)) end
  local per_rank = {}
  for _, n in ipairs(opts.per_rank or {}) do per_rank[n] = true end
  local names = {}
  for k in pairs(state) do
    if type(k) ~= 'string' or not k:match('^[%w_%-]+$') then
      fail(level + 1, 'save: state entry names are letters, digits, _ and - (they name files), got %s', describe(k))
    end
    names[#names + 1] = k
  end
  table.sort(names)
  -- The models whose communication state the state names itself (ckpt.comm_state(model)): that entry holds it,
  -- marked comm_of = the model's name; the others' goes into '<name>.comm'.
  local comm_of, explicit = {}, {}
  for _, name in ipairs(names) do
    local d = type(state[name]) == 'table' and rawget(state[name], 'comm_of')
    if d then explicit[d] = name end
  end
  for _, name in ipairs(names) do
    local en = explicit[state[name]]
    if en and stateful_ddp(state[name]) then comm_of[en] = name end
  end
  local entries = {}
  -- e.tree: sd as JSON, its tensors as {"$tensor": path} refs listed in e.tensors
  local function encode(e, sd)
    local seen = {}
    local ok, tree = pcall(J.encode, sd, function(x, p)
      if dlua.is_tensor(x) then
        local path = p:gsub('^%.', '')
        if e.kind == 'module' then path = p:match('^%.(.*)$') or p end
        if path == '' then path = 'tensor' end
        local base, k = path, 1
        while seen[path] do
          k = k + 1
          path = base .. '#' .. k
        end
        seen[path] = true
        e.tensors[#e.tensors + 1] = { path = path, t = x }
        return '{"$tensor":' .. J.quote(path) .. '}'
      end
    end, '')
    if not ok then fail(level + 2, "save: state '%s': %s", e.name, (tostring(tree):gsub('^%.', ''))) end
    e.tree = tree
  end
  for _, name in ipairs(names) do
    local obj = state[name]
    local e = { name = name, obj = obj, tensors = {}, per_rank = per_rank[name] or false, comm_of = comm_of[name] }
    local sd
    if (type(obj) == 'table' or type(obj) == 'cdata') and not dlua.is_tensor(obj) and has_method(obj, 'state_dict') then
      e.kind = is_module(obj) and 'module' or 'object'
      local ok, r = pcall(function() return obj:state_dict() end)
      if not ok then fail(level + 1, "save: state '%s': state_dict() failed: %s", name, tostring(r)) end
      sd = r
      if type(obj) == 'table' and rawget(obj, 'ckpt_per_rank') then e.per_rank = true end
    elseif type(obj) == 'function' or type(obj) == 'userdata' or type(obj) == 'thread' then
      fail(level + 1, "save: state '%s' is a %s (expected an object with state_dict(), a table, a tensor or a value)", name, type(obj))
    else
      e.kind, sd = type(obj) == 'table' and 'table' or 'value', obj
    end
    encode(e, sd)
    entries[#entries + 1] = e
    -- Under DDP a model's parameters are equal on every rank, its buffers (batch-norm running
    -- statistics, computed from each rank's own batches) are not: each rank's are saved too, as a
    -- per-rank entry '<name>.buffers' (the model file keeps rank 0's, for PyTorch).
    if e.kind == 'module' and world > 1 then
      local b = { name = name .. '.buffers', kind = 'buffers', obj = obj, tensors = {}, per_rank = true }
      local parts = {}
      for _, nb in ipairs(obj:named_buffers()) do
        b.tensors[#b.tensors + 1] = { path = nb.name, t = nb.buffer }
        parts[#parts + 1] = J.quote(nb.name) .. ':{"$tensor":' .. J.quote(nb.name) .. '}'
      end
      b.tree = '{' .. concat(parts, ',') .. '}'
      entries[#entries + 1] = b
    end
    if stateful_ddp(obj) and not explicit[obj] then
      local c = { name = name .. '.comm', kind = 'comm', obj = obj, tensors = {}, per_rank = true }
      local ok, r = pcall(function() return obj:comm_state_dict() end)
      if not ok then fail(level + 1, "save: state '%s': comm_state_dict() failed: %s", c.name, tostring(r)) end
      encode(c, r)
      entries[#entries + 1] = c
    end
  end
  return entries
end

---------------------------------------------------------------------------------------------
-- Checkpoint directories: root/step-000123/{index.json, *.safetensors}, root/latest

local function step_name(step) return format('step-%06d', step) end
local function step_of(name) return tonumber(name:match('^step%-(%d+)$')) end

local function is_complete(stepdir) return exists(stepdir .. '/index.json') end

-- Every step directory under root: {step, name, path, complete}, oldest first.
function ckpt.list(root)
  local r = {}
  for _, name in ipairs(B.list_dir(root, 1)) do
    local s = step_of(name)
    if s then
      local p = root .. '/' .. name
      r[#r + 1] = { step = s, name = name, path = p, complete = is_complete(p) }
    end
  end
  table.sort(r, function(a, b) return a.step < b.step end)
  return r
end

-- The newest complete checkpoint under root (its directory), or nil. A checkpoint is complete
-- once its index.json exists: written after every file of it, and removed first.
function ckpt.latest(root)
  local best
  for _, c in ipairs(ckpt.list(root)) do
    if c.complete then best = c end
  end
  return best and best.path or nil, best and best.step or nil
end

---------------------------------------------------------------------------------------------
-- Saving

local pending      -- the save in flight: {job, path, step, started}
local save_count = 0

-- Waits for the save in flight (if any) and raises its error. Returns its stats, or nil.
function ckpt.wait()
  local p = pending
  if not p then return nil end
  pending = nil
  for _, g in ipairs(p.guards or {}) do
    if rawget(g.obj, 'step') ~= g.own then rawset(g.obj, 'step', g.own) end
  end
  local ok, err = pcall(function() p.job:wait(2) end)
  local stats = { path = p.path, step = p.step, seconds = p.job:seconds(), snapshot_bytes = p.job:snapshot_peak() }
  p.job:free()
  if not ok then error('ckpt: the save of ' .. p.path .. ' failed: ' .. tostring(err):gsub('^save: ', ''), 2) end
  return stats
end

-- Whether a background save is still writing.
function ckpt.busy() return pending ~= nil and not pending.job:done() end

-- An async save copies parameters and optimizer state on its thread, while forward and backward
-- run; the optimizer's next step waits for that copy by itself. Code that changes parameters
-- otherwise (an EMA, weight surgery) calls this first.
function ckpt.wait_snapshot() if pending then pending.job:wait_snapshot() end end

local function dist_info()
  local dist = package.loaded['dlua.dist']
  if type(dist) == 'table' and dist.is_initialized and dist.is_initialized() then
    return dist, dist.rank(), dist.world_size()
  end
  return nil, 0, 1
end

-- A distributed job must not leave before its saves are written: wait for them in dist.destroy.
local destroy_hooked = false
local function hook_destroy(dist)
  if destroy_hooked then return end
  destroy_hooked = true
  local orig = dist.destroy
  dist.destroy = function(...)
    local ok, err = pcall(ckpt.wait)
    local r = orig(...)
    if not ok then error(err, 2) end
    return r
  end
end

local function tensor_bytes(t) return t:numel() * t:element_size() end

-- Global tensors spread over ranks for a sharded save: biggest first, each to the least loaded
-- rank (ties: the lowest). Every rank computes the same plan from the same state.
local function shard_plan(entries, world)
  local all = {}
  for _, e in ipairs(entries) do
    if not e.per_rank then
      for _, it in ipairs(e.tensors) do all[#all + 1] = { e = e, it = it, bytes = tensor_bytes(it.t) } end
    end
  end
  table.sort(all, function(a, b)
    if a.bytes ~= b.bytes then return a.bytes > b.bytes end
    if a.e.name ~= b.e.name then return a.e.name < b.e.name end
    return a.it.path < b.it.path
  end)
  local load = {}
  for r = 0, world - 1 do load[r] = 0 end
  for _, x in ipairs(all) do
    local best = 0
    for r = 1, world - 1 do if load[r] < load[best] then best = r end end
    x.it.rank = best
    load[best] = load[best] + x.bytes
  end
end

local function shard_file(r, world) return format('shard-%05d-of-%05d.safetensors', r, world) end
local function rank_file(r) return format('rank-%05d.safetensors', r) end

-- What this rank writes: {file = {names, tensors}} and where every tensor goes.
local function file_plan(entries, rank, world, sharded)
  if sharded then shard_plan(entries, world) end
  local files, order = {}, {}
  local function add(file, key, t)
    if not files[file] then
      files[file] = { names = {}, tensors = {} }
      order[#order + 1] = file
    end
    local f = files[file]
    f.names[#f.names + 1], f.tensors[#f.tensors + 1] = key, t
  end
  for _, e in ipairs(entries) do
    for _, it in ipairs(e.tensors) do
      if e.per_rank then
        it.file = sharded and shard_file(rank, world) or rank_file(rank)
        it.key = e.name .. '@' .. rank .. '/' .. it.path
        add(it.file, it.key, it.t)
      elseif sharded then
        it.file, it.key = shard_file(it.rank, world), e.name .. '/' .. it.path
        if it.rank == rank then add(it.file, it.key, it.t) end
      else
        it.file, it.key = e.name .. '.safetensors', it.path
        if rank == 0 then add(it.file, it.key, it.t) end
      end
    end
  end
  -- Every rank of a sharded save writes its file, empty or not, so the index is uniform.
  if sharded and not files[shard_file(rank, world)] then add(shard_file(rank, world), nil, nil) end
  return files, order
end

-- The locations of an entry's tensors as JSON: {"path": ["file", "key"], ...}.
local function locations(e)
  local parts = {}
  for _, it in ipairs(e.tensors) do parts[#parts + 1] = J.quote(it.path) .. ':[' .. J.quote(it.file) .. ',' .. J.quote(it.key) .. ']' end
  return '{' .. concat(parts, ',') .. '}'
end

-- This rank's per-rank entries (their trees and tensor locations as JSON text, quoted) and a
-- fingerprint of its global tensors, for rank 0.
local function rank_info(entries)
  local per, fp = {}, {}
  for _, e in ipairs(entries) do
    if e.per_rank then
      per[#per + 1] = J.quote(e.name) .. ':{"tree":' .. J.quote(e.tree) .. ',"tensors":' .. J.quote(locations(e)) .. '}'
    else
      for _, it in ipairs(e.tensors) do
        fp[#fp + 1] = format('%s/%s %s %s', e.name, it.path, it.t.dtype, concat(it.t:size(), 'x'))
      end
    end
  end
  return '{"per_rank":{' .. concat(per, ',') .. '},"fingerprint":' .. J.quote(B.crc32_string(concat(fp, '\n'))) .. '}'
end

local function index_text(entries, step, world, sharded, infos, files_by_rank)
  local parts = {}
  for _, e in ipairs(entries) do
    local body
    if e.per_rank then
      local trees, locs = {}, {}
      for r = 0, world - 1 do
        local pr = infos[r].per_rank[e.name]
        trees[#trees + 1], locs[#locs + 1] = pr.tree, pr.tensors
      end
      body = format('{"kind":%s,"per_rank":true,%s"ranks":[%s],"rank_tensors":[%s]}', J.quote(e.kind),
        e.comm_of and '"comm_of":' .. J.quote(e.comm_of) .. ',' or '', concat(trees, ','), concat(locs, ','))
    else
      body = format('{"kind":%s,"per_rank":false,"tree":%s,"tensors":%s}', J.quote(e.kind), e.tree, locations(e))
    end
    parts[#parts + 1] = J.quote(e.name) .. ':' .. body
  end
  local files = {}
  for _, f in ipairs(files_by_rank) do files[#files + 1] = J.quote(f) end
  return format('{"format":%s,"step":%d,"world_size":%d,"sharded":%s,"dlua":%s,"files":[%s],"entries":{%s}}\n',
    J.quote(ckpt.FORMAT), step, world, sharded and 'true' or 'false', J.quote(dlua.version()), concat(files, ','), concat(parts, ','))
end

-- Rank 0, before anything is written: root and the step directory exist, a complete checkpoint
-- already at this step stops being complete (latest first moves to the newest other one), and
-- files left by a save that was cut short go.
local function prepare_dir(root, name, level)
  B.mkdirs(root, level + 1)
  local stepdir = root .. '/' .. name
  if is_complete(stepdir) then
    local latest = read_text(root .. '/latest')
    if latest and latest:match('^%s*(.-)%s*$') == name then
      local other
      for _, c in ipairs(ckpt.list(root)) do if c.complete and c.name ~= name then other = c end end
      if other then B.write_file(root .. '/latest', other.name .. '\n', level + 1) else os.remove(root .. '/latest') end
    end
    os.remove(stepdir .. '/index.json')
  end
  B.mkdirs(stepdir, level + 1)
  for _, f in ipairs(B.list_dir(stepdir, level + 1)) do
    if f:match('%.tmp%-%d+%-%d+$') then os.remove(stepdir .. '/' .. f) end
  end
end

-- Old checkpoints to remove once this one is complete: all but the newest `keep` complete ones
-- (this one among them), and incomplete ones older than this one (left by saves cut short).
local function rotation(root, step, keep)
  local complete, out = {}, {}
  for _, c in ipairs(ckpt.list(root)) do
    if c.step ~= step then
      if c.complete then complete[#complete + 1] = c elseif c.step < step then out[#out + 1] = c.path end
    end
  end
  if keep then
    local drop = #complete - (keep - 1)
    for i = 1, drop do out[#out + 1] = complete[i].path end
  end
  return out
end

local save_options = { step = true, keep = true, async = true, sharded = true, per_rank = true, timeout = true }

-- save(root, state, {step =, keep =, async = false, sharded = false, per_rank = {names}, timeout = 1800}):
-- writes root/step-<step>/ (index.json last), then root/latest, then removes old checkpoints
-- (keep = N: the newest N complete ones stay; latest's is always one of them). state maps names
-- to objects with state_dict()/load_state_dict() (modules, optimizers, schedules, samplers,
-- generators...), tables, tensors or values. Under dlua.dist every rank calls it: rank 0 writes
-- the full checkpoint, or with sharded = true each rank writes its share in parallel. async: the
-- tensors are copied to host memory now and a background thread writes; the next save (or
-- ckpt.wait()) waits for it. Returns {path, step, bytes, snapshot_bytes, seconds (sync)}.
function ckpt.save(root, state, opts)
  need_available('save', 2)
  local o = check_options('save', opts, save_options, 2)
  if type(root) ~= 'string' or root == '' then fail(2, 'save: expected a checkpoint directory, got %s', describe(root)) end
  local step = o.step
  if type(step) ~= 'number' or step < 0 or step ~= floor(step) then
    fail(2, 'save: opts.step (the step count, it names the checkpoint) must be an integer >= 0, got %s', describe(step))
  end
  if o.keep ~= nil and (type(o.keep) ~= 'number' or o.keep < 1 or o.keep ~= floor(o.keep)) then
    fail(2, 'save: keep must be a positive integer (checkpoints kept), got %s', describe(o.keep))
  end
  local t0 = dlua.perf_counter()
  ckpt.wait()
  root = root:gsub('/+$', '')
  local dist, rank, world = dist_info()
  local entries = collect(state, o, world, 2)
  local sharded = o.sharded and world > 1 or false
  local name = step_name(step)
  local stepdir = root .. '/' .. name
  local files, order = file_plan(entries, rank, world, sharded)
  save_count = save_count + 1
  local prefix = format('dlua.ckpt/%d/', save_count)
  local store = dist and dist.store() or nil
  local timeout = o.timeout or 1800
  local index, removals
  if world > 1 then
    hook_destroy(dist)
    store:set(prefix .. 'info/' .. rank, rank_info(entries))
    if rank == 0 then
      local infos, fp0 = {}, nil
      for r = 0, world - 1 do
        local text = store:get(prefix .. 'info/' .. r, timeout)
        local ok, info = pcall(J.decode, text)
        if not ok then fail(2, 'save: rank %d sent a bad description: %s', r, info) end
        for _, e in ipairs(entries) do
          if e.per_rank and not info.per_rank[e.name] then fail(2, "save: rank %d has no per-rank state '%s'", r, e.name) end
        end
        if sharded then
          if fp0 == nil then fp0 = info.fingerprint
          elseif info.fingerprint ~= fp0 then
            fail(2, 'save: rank %d holds other tensors than rank 0 (names, shapes or dtypes differ): a sharded save needs the same state on every rank', r)
          end
        end
        infos[r] = info
      end
      for r = 1, world - 1 do store:delete(prefix .. 'info/' .. r) end
      store:delete(prefix .. 'info/0')
      local all_files = {}
      if sharded then
        for r = 0, world - 1 do all_files[#all_files + 1] = shard_file(r, world) end
      else
        for _, f in ipairs(order) do all_files[#all_files + 1] = f end
        for r = 1, world - 1 do
          for _, e in ipairs(entries) do
            if e.per_rank and infos[r].per_rank[e.name].tensors ~= '{}' then
              all_files[#all_files + 1] = rank_file(r)
              break
            end
          end
        end
      end
      index = index_text(entries, step, world, sharded, infos, all_files)
      prepare_dir(root, name, 2)
      removals = rotation(root, step, o.keep)
      store:set(prefix .. 'go', 'ok')
      -- every rank read the previous save's 'go' before it could reach this save
      if save_count > 1 then store:delete(format('dlua.ckpt/%d/go', save_count - 1)) end
    else
      store:get(prefix .. 'go', timeout)  -- rank 0 has prepared the directory
    end
  else
    local infos = { [0] = { per_rank = {} } }
    for _, e in ipairs(entries) do
      if e.per_rank then infos[0].per_rank[e.name] = { tree = e.tree, tensors = locations(e) } end
    end
    index = index_text(entries, step, 1, false, infos, order)
    prepare_dir(root, name, 2)
    removals = rotation(root, step, o.keep)
  end

  -- async: what only an optimizer's step changes (its parameter arena, its state) is copied by the
  -- writer thread while forward and backward run; that optimizer's next step waits for the copy.
  -- Everything else (batch-norm statistics...) is copied now.
  local owners, deferrable = {}, {}
  if o.async then
    for _, e in ipairs(entries) do
      local obj = e.obj
      if e.kind == 'object' and type(obj) == 'table' and type(obj.arena) == 'table' and type(obj.arena.params) == 'table'
          and type(obj.state) == 'table' and has_method(obj, 'step') then
        owners[#owners + 1] = obj
        for _, p in pairs(obj.arena.params) do deferrable[#deferrable + 1] = p end
        for _, bufs in pairs(obj.state) do
          for _, t in pairs(bufs) do if dlua.is_tensor(t) then deferrable[#deferrable + 1] = t end end
        end
      end
    end
  end
  local function mode_of(t)
    if not o.async then return 0 end
    if t.device == 'cpu' then
      for _, d in ipairs(deferrable) do if t:same_storage(d) then return 2 end end
    end
    return 1
  end

  local job = B.job()
  local bytes = 0
  local ok, err = pcall(function()
    for _, f in ipairs(order) do
      local spec = files[f]
      local modes = {}
      for i, t in ipairs(spec.tensors) do
        bytes = bytes + tensor_bytes(t)
        modes[i] = mode_of(t)
      end
      job:add_file(stepdir .. '/' .. f, spec.names, spec.tensors, { 'dlua.step' }, { tostring(step) }, modes, 3)
    end
    if rank ~= 0 then
      job:add_signal(store, prefix .. 'done/' .. rank, 3)
    else
      if world > 1 then
        local keys = {}
        for r = 1, world - 1 do keys[#keys + 1] = prefix .. 'done/' .. r end
        job:add_wait(store, keys, timeout, 3)
      end
      job:add_text(stepdir .. '/index.json', index, 3)
      job:add_text(root .. '/latest', name .. '\n', 3)
      for _, d in ipairs(removals) do job:add_remove(d, 3) end
    end
  end)
  if not ok then
    job:free()
    error(err, 2)
  end
  local info = { path = stepdir, step = step, bytes = bytes, snapshot_bytes = job:snapshot_bytes() }
  if o.async then
    job:start(1)
    pending = { job = job, path = stepdir, step = step, guards = {} }
    for _, obj in ipairs(owners) do
      local own = rawget(obj, 'step')
      pending.guards[#pending.guards + 1] = { obj = obj, own = own }
      rawset(obj, 'step', function(self, ...)
        rawset(obj, 'step', own)
        job:wait_snapshot()
        return obj.step(self, ...)
      end)
    end
    info.stall = dlua.perf_counter() - t0
  else
    local rok, rerr = pcall(function() job:run(3) end)
    job:free()
    if not rok then error(rerr, 2) end
    info.seconds = dlua.perf_counter() - t0
  end
  return info
end

-- Loading lives in dlua/ckpt/load.lua (ckpt.load, and its helpers for the recipes).
require('dlua.ckpt.load')(ckpt, { B = B, J = J, fail = fail, check_options = check_options, need_available = need_available,
  read_text = read_text, is_module = is_module, exists = exists, stateful_ddp = stateful_ddp })

return ckpt
