-- dlua.ckpt.load: a checkpoint back into the training state, everything checked (names, shapes, dtypes, checksums) before anything is loaded; resharding to another world size.
local dlua = require 'dlua'
local format, concat = string.format, table.concat

return function(ckpt, H)
  local B, J, fail = H.B, H.J, H.fail

  local function dist_info()
    local dist = package.loaded['dlua.dist']
    if type(dist) == 'table' and dist.is_initialized and dist.is_initialized() then return dist.rank(), dist.world_size() end
    return 0, 1
  end

  -- A step directory, or the newest complete one under a root.
  local function resolve(path, level)
    if type(path) ~= 'string' or path == '' then fail(level + 1, 'load: expected a checkpoint directory, got %s', tostring(path)) end
    path = path:gsub('/+$', '')
    if H.exists(path .. '/index.json') then return path end
    local root, name = path:match('^(.*)/(step%-%d+)$')
    if name and #B.list_dir(path, level + 1) > 0 then
      local newest = ckpt.latest(root)
      fail(level + 1, 'load: %s is incomplete (no index.json: its save was cut short)%s', path,
        newest and ('; the newest complete checkpoint there is ' .. newest) or '')
    end
    local newest = ckpt.latest(path)
    if not newest then fail(level + 1, 'load: no complete checkpoint in %s (expected step-*/index.json)', path) end
    return newest
  end

  -- The tensor references of a decoded tree, {__tensor = path}, replaced by fn(path).
  local function map_refs(tree, fn)
    if type(tree) ~= 'table' then return tree end
    if tree.__tensor ~= nil and next(tree, next(tree)) == nil then return fn(tree.__tensor) end
    local out = {}
    for k, v in pairs(tree) do out[k] = map_refs(v, fn) end
    return out
  end

  local function each_ref(tree, fn)
    if type(tree) ~= 'table' then return end
    if tree.__tensor ~= nil and next(tree, next(tree)) == nil then return fn(tree.__tensor) end
    for _, v in pairs(tree) do each_ref(v, fn) end
  end

  local function read_index(stepdir, level)
    local text, rerr = H.read_text(stepdir .. '/index.json')
    if not text then fail(level + 1, 'load: %s/index.json: %s', stepdir, tostring(rerr)) end
    local ok, index = pcall(J.decode, text, function(p) return { __tensor = p } end)
    if not ok then fail(level + 1, 'load: %s/index.json is corrupt: %s', stepdir, tostring(index)) end
    if type(index) ~= 'table' or index.format ~= ckpt.FORMAT or type(index.entries) ~= 'table' then
      fail(level + 1, 'load: %s/index.json is not a %s index (format %s)', stepdir, ckpt.FORMAT, tostring(type(index) == 'table' and index.format))
    end
    return index
  end

  -- info(path): what a checkpoint is, from its index alone: {path, step, world_size, sharded, entries}.
  function ckpt.info(path)
    H.need_available('info', 2)
    local stepdir = resolve(path, 2)
    local index = read_index(stepdir, 2)
    local names = {}
    for k in pairs(index.entries) do names[#names + 1] = k end
    table.sort(names)
    return { path = stepdir, step = index.step, world_size = index.world_size, sharded = index.sharded, entries = names }
  end

  -- For recipes: resume(spec, root, state, {skip_if_resharded = {names}}). spec '' starts fresh (nil);
  -- 'auto' loads the newest complete checkpoint under root, or starts fresh when there is none; anything
  -- else is a checkpoint (a step directory or a root). On another world size than the checkpoint's,
  -- the entries named in skip_if_resharded are left as they are. Returns load's info plus
  -- resharded = true/false, or nil.
  function ckpt.resume(spec, root, state, opts)
    if spec == nil or spec == '' then return nil end
    local path = spec
    if spec == 'auto' then
      if type(root) ~= 'string' or root == '' then fail(2, "resume: 'auto' needs the checkpoint directory (--save DIR)") end
      path = ckpt.latest(root)
      if not path then return nil end
    end
    local info = ckpt.info(path)
    local _, world = dist_info()
    local resharded = info.world_size ~= world
    local ok, r = pcall(ckpt.load, info.path, state, { skip = resharded and opts and opts.skip_if_resharded or nil })
    if not ok then error(r, 2) end
    r.resharded = resharded
    return r
  end

  local load_options = { strict = true, skip = true }

  -- load(path, state, {strict = true, skip = {names}}): path is a step directory or a root (its
  -- newest complete checkpoint). Every entry of state must be in the checkpoint (and, strict, the
  -- reverse); modules are loaded into their tensors (names, shapes and dtypes must match), other
  -- objects get load_state_dict(tree), tables are refilled in place, values come back in
  -- info.values. Nothing is loaded until every file, tensor and checksum has been checked.
  -- Returns {path, step, world_size, sharded, values}.
  function ckpt.load(path, state, opts)
    H.need_available('load', 2)
    local o = H.check_options('load', opts, load_options, 2)
    if type(state) ~= 'table' then fail(2, 'load: expected a state table (name -> object), got %s', type(state)) end
    ckpt.wait()
    local stepdir = resolve(path, 2)
    local index = read_index(stepdir, 2)
    local rank, world = dist_info()
    local skip = {}
    for _, n in ipairs(o.skip or {}) do skip[n] = true end
    -- What to load (objs) and from which entry (src): the state's entries, and the communication state of each DDP
    -- model whose hook keeps state. That was saved with the model as '<name>.comm', or (ckpt.comm_state(model) in
    -- the saved state) in the entry marked comm_of = name. A ckpt.comm_state(model) in the state loads it from either;
    -- else it loads as '<name>.comm' (skip = {'<name>.comm'} leaves it); a checkpoint with neither loads without it.
    local objs, src, explicit = {}, {}, {}
    for k, v in pairs(state) do
      objs[k], src[k] = v, k
      local d = type(v) == 'table' and rawget(v, 'comm_of')
      if d then explicit[d] = k end
    end
    local function comm_source(mname)
      local c = index.entries[mname .. '.comm']
      if c and c.kind == 'comm' then return mname .. '.comm' end
      for en, ie in pairs(index.entries) do
        if type(ie) == 'table' and ie.comm_of == mname then return en end
      end
    end
    for k, v in pairs(state) do
      if not skip[k] and H.stateful_ddp(v) then
        local from, ek = comm_source(k), explicit[v]
        if ek == nil then
          local cname = k .. '.comm'
          if from and not skip[cname] and not skip[from] then objs[cname], src[cname] = ckpt.comm_state(v), from end
        elseif index.entries[ek] == nil and from then
          src[ek] = from
        end
      end
    end
    local used = {}
    for k, from in pairs(src) do if not skip[k] then used[from] = true end end
    local names, missing, unexpected = {}, {}, {}
    for k in pairs(objs) do
      if not skip[k] then
        names[#names + 1] = k
        if index.entries[src[k]] == nil then missing[#missing + 1] = tostring(k) end
      end
    end
    for k, ie in pairs(index.entries) do
      local base = k:match('^(.*)%.buffers$') or k:match('^(.*)%.comm$')  -- a model's per-rank buffers and comm state go with the model
      if base and (ie.kind == 'buffers' or ie.kind == 'comm') then k = base end
      if state[k] == nil and not skip[k] and not used[k] then unexpected[#unexpected + 1] = k end
    end
    table.sort(names)
    table.sort(missing)
    table.sort(unexpected)
    local problems = {}
    if #missing > 0 then problems[#problems + 1] = 'not in the checkpoint: ' .. concat(missing, ', ') end
    if o.strict ~= false and #unexpected > 0 then
      problems[#problems + 1] = 'in the checkpoint but not in the state (strict = false ignores them): ' .. concat(unexpected, ', ')
    end
    if #problems > 0 then fail(2, 'load %s: %s', stepdir, concat(problems, '; ')) end

    -- Which tree and tensors each entry takes: its own, or this rank's of a per-rank entry.
    local plan = {}
    for _, name in ipairs(names) do
      local ie = index.entries[src[name]]
      local p = { name = name, obj = objs[name], kind = ie.kind, compare = {} }
      if ie.per_rank then
        local saved = #ie.ranks
        if saved == world then
          p.tree, p.locs = ie.ranks[rank + 1], ie.rank_tensors[rank + 1]
        else
          -- Another world size: only a value every saved rank had alike can go to every rank.
          local first = J.encode(ie.ranks[1], function(x) if type(x) == 'table' and x.__tensor then return '{"$tensor":' .. J.quote(x.__tensor) .. '}' end end)
          for r = 2, saved do
            local other = J.encode(ie.ranks[r], function(x) if type(x) == 'table' and x.__tensor then return '{"$tensor":' .. J.quote(x.__tensor) .. '}' end end)
            if other ~= first then
              fail(2, "load %s: state '%s' is per-rank and its %d saved ranks hold different values: it cannot be resharded to %d ranks (load it with skip = {'%s'} to start it afresh)",
                stepdir, name, saved, world, name)
            end
            p.compare[#p.compare + 1] = ie.rank_tensors[r]
          end
          p.tree, p.locs = ie.ranks[1], ie.rank_tensors[1]
        end
      else
        p.tree, p.locs = ie.tree, ie.tensors
      end
      -- A DDP model's buffers: this rank's own, or on another world size saved rank 0's (as PyTorch's
      -- broadcast_buffers would give every rank).
      local ib = index.entries[name .. '.buffers']
      if ib and ib.kind == 'buffers' then
        local r = #ib.ranks == world and rank + 1 or 1
        p.buffers = { tree = ib.ranks[r], locs = ib.rank_tensors[r] }
      end
      plan[#plan + 1] = p
    end

    -- Open every file needed and find every tensor (a missing shard or key is named here).
    local files = {}
    local function entry_of(loc, what, level)
      if type(loc) ~= 'table' or type(loc[1]) ~= 'string' or type(loc[2]) ~= 'string' then
        fail(level + 1, 'load: %s/index.json is corrupt: no location for %s', stepdir, what)
      end
      local f = files[loc[1]]
      if not f then
        local fpath = stepdir .. '/' .. loc[1]
        if not H.exists(fpath) then fail(level + 1, 'load: %s is missing (it holds %s)', fpath, what) end
        local okf, fr = pcall(B.open, fpath, 1)
        if not okf then error(fr, level + 1) end
        f = fr
        files[loc[1]] = f
      end
      local e = f.index[loc[2]]
      if not e then fail(level + 1, "load: %s does not hold tensor '%s' (%s): the checkpoint is corrupt", f.path, loc[2], what) end
      return f, e
    end
    local function close_all() for _, f in pairs(files) do f:close() end end
    local okp, perr = pcall(function()
      for _, p in ipairs(plan) do
        p.found = {}
        each_ref(p.tree, function(tp)
          local f, e = entry_of(p.locs and p.locs[tp], format("'%s' of state '%s'", tp, p.name), 4)
          p.found[tp] = { f = f, e = e }
        end)
        if p.buffers then
          each_ref(p.buffers.tree, function(tp)
            local f, e = entry_of(p.buffers.locs and p.buffers.locs[tp], format("buffer '%s' of state '%s'", tp, p.name), 4)
            p.found[tp] = { f = f, e = e }
          end)
        end
        for i, locs in ipairs(p.compare) do
          p.compare[i] = {}
          for tp, loc in pairs(locs) do
            local f, e = entry_of(loc, format("'%s' of state '%s'", tp, p.name), 4)
            p.compare[i][tp] = { f = f, e = e }
          end
        end
      end
      -- Modules: every parameter and buffer, by name, shape and dtype, before anything is copied.
      for _, p in ipairs(plan) do
        if H.is_module(p.obj) then
          local live = p.obj:state_dict()
          local miss, unexp, bad = {}, {}, {}
          for _, k in ipairs(getmetatable(live) and getmetatable(live).__index.keys and live:keys() or {}) do
            local x = p.found[k]
            local t = live[k]
            if not x then
              miss[#miss + 1] = k
            elseif x.e.dtype ~= t.dtype or concat(x.e.shape, ',') ~= concat(t:size(), ',') then
              bad[#bad + 1] = format('%s: the checkpoint has (%s) %s, the model (%s) %s', k, concat(x.e.shape, ', '), x.e.dtype,
                concat(t:size(), ', '), t.dtype)
            end
          end
          for k in pairs(p.found) do if live[k] == nil then unexp[#unexp + 1] = k end end
          table.sort(miss)
          table.sort(unexp)
          local pr = {}
          if #bad > 0 then pr[#pr + 1] = 'mismatched: ' .. concat(bad, '; ') end
          if #miss > 0 then pr[#pr + 1] = 'missing from the checkpoint: ' .. concat(miss, ', ') end
          if #unexp > 0 then pr[#pr + 1] = 'not in the model: ' .. concat(unexp, ', ') end
          if #pr > 0 then fail(4, "load %s: state '%s' (%s): %s", stepdir, p.name, tostring(p.obj.__name or 'module'), concat(pr, '; ')) end
          p.live = live
        elseif dlua.is_tensor(p.obj) then
          local x = p.found[p.tree and p.tree.__tensor]
          if not x then fail(4, "load %s: state '%s' is a tensor, the checkpoint holds no tensor for it", stepdir, p.name) end
          if x.e.dtype ~= p.obj.dtype or concat(x.e.shape, ',') ~= concat(p.obj:size(), ',') then
            fail(4, "load %s: state '%s': the checkpoint has (%s) %s, the tensor is (%s) %s", stepdir, p.name, concat(x.e.shape, ', '),
              x.e.dtype, concat(p.obj:size(), ', '), p.obj.dtype)
          end
        end
      end
      -- Every checksum, still before anything is loaded.
      for _, p in ipairs(plan) do
        for _, x in pairs(p.found) do x.f:verify(x.e, 3) end
        for _, other in ipairs(p.compare) do
          for tp, x in pairs(other) do
            local mine = p.found[tp]
            if not mine or B.crc32({ x.f:read(x.e, 3) }) ~= B.crc32({ mine.f:read(mine.e, 3) }) then
              fail(4, "load %s: state '%s' is per-rank and its saved ranks hold different tensors ('%s'): it cannot be resharded to %d ranks (load it with skip = {'%s'})",
                stepdir, p.name, tp, world, p.name)
            end
          end
        end
      end
    end)
    if not okp then
      close_all()
      error(perr, 2)
    end

    local values = {}
    local oka, aerr = pcall(function()
      for _, p in ipairs(plan) do
        local function fresh(tp)
          local x = p.found[tp]
          return x.f:read(x.e, 3)
        end
        if p.live then
          for k, x in pairs(p.found) do x.f:read_into(x.e, p.live[k], 3) end
        elseif dlua.is_tensor(p.obj) then
          local x = p.found[p.tree.__tensor]
          x.f:read_into(x.e, p.obj, 3)
        elseif p.kind == 'module' or p.kind == 'object' or p.kind == 'comm' then
          local okl, lerr = pcall(function() p.obj:load_state_dict(map_refs(p.tree, fresh)) end)
          if not okl then fail(4, "load %s: state '%s': load_state_dict failed: %s", stepdir, p.name, tostring(lerr)) end
        elseif p.kind == 'table' and type(p.obj) == 'table' then
          local tree = map_refs(p.tree, fresh)
          for k in pairs(p.obj) do p.obj[k] = nil end
          for k, v in pairs(tree) do p.obj[k] = v end
        else
          values[p.name] = map_refs(p.tree, fresh)
        end
        if values[p.name] == nil and p.kind ~= 'value' then values[p.name] = p.obj end
      end
    end)
    close_all()
    if not oka then error(aerr, 2) end
    return { path = stepdir, step = index.step, world_size = index.world_size, sharded = index.sharded, values = values }
  end
end
