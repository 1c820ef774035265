-- Lua face of the process groups (host/comm/pg.c): groups, collectives and work handles as Lua objects.
local capi = require 'bindings.capi'
local core = require 'bindings.tensor_core'
local ffi, C = capi.ffi, capi.C
local format = string.format

local M = {}

M.ops = {
  sum = C.DLUA_PG_REDUCE_SUM, avg = C.DLUA_PG_REDUCE_AVG, max = C.DLUA_PG_REDUCE_MAX,
  min = C.DLUA_PG_REDUCE_MIN, product = C.DLUA_PG_REDUCE_PRODUCT,
}

local function check(status, op)
  if status ~= 0 then core.check(status, op) end
end

local Group = {}
Group.__index = Group
M.Group = Group

-- Joins a gloo group (every member calls this with the same name and size).
function M.gloo(host, port, token, name, rank, size, timeout_s)
  local out = ffi.new('dlua_pg_t *[1]')
  check(C.dlua_pg_gloo_new(host, port, token, name, rank, size, math.floor(timeout_s * 1000 + 0.5), out),
        'dist.init')
  local self = setmetatable({ name = name }, Group)
  self.h = ffi.gc(out[0], C.dlua_pg_free)
  return self
end

-- nil when NCCL loads, else why not.
function M.nccl_unavailable()
  local why = C.dlua_pg_nccl_unavailable()
  return why ~= nil and ffi.string(why) or nil
end

-- Joins an NCCL group on CUDA device `device` (errors: no device, no libnccl.so.2, a rank missing).
function M.nccl(host, port, token, name, rank, size, device, timeout_s)
  local out = ffi.new('dlua_pg_t *[1]')
  check(C.dlua_pg_nccl_new(host, port, token, name, rank, size, device, math.floor(timeout_s * 1000 + 0.5), out),
        'dist.init')
  local self = setmetatable({ name = name, device = device }, Group)
  self.h = ffi.gc(out[0], C.dlua_pg_free)
  return self
end

-- nil when this build has MPI, else why not.
function M.mpi_unavailable()
  local why = C.dlua_pg_mpi_unavailable()
  return why ~= nil and ffi.string(why) or nil
end

-- This process' rank and size in MPI_COMM_WORLD (initialises MPI, once).
function M.mpi_world()
  local r, n = ffi.new('int[1]'), ffi.new('int[1]')
  check(C.dlua_mpi_world(r, n), 'dist.init')
  return tonumber(r[0]), tonumber(n[0])
end

-- Rank root's string s (nbytes at most) on every rank of MPI_COMM_WORLD.
function M.mpi_broadcast(s, root, nbytes, timeout_s)
  local buf = ffi.new('char[?]', nbytes + 1)
  if s then ffi.copy(buf, s, math.min(#s, nbytes)) end
  check(C.dlua_mpi_world_broadcast(buf, nbytes, root, math.floor(timeout_s * 1000 + 0.5)), 'dist.init')
  return ffi.string(buf)
end

-- Joins an MPI group (the members meet through the store, then make one communicator).
function M.mpi(host, port, token, name, rank, size, timeout_s)
  local out = ffi.new('dlua_pg_t *[1]')
  check(C.dlua_pg_mpi_new(host, port, token, name, rank, size, math.floor(timeout_s * 1000 + 0.5), out), 'dist.init')
  local self = setmetatable({ name = name }, Group)
  self.h = ffi.gc(out[0], C.dlua_pg_free)
  return self
end

function Group:backend() return ffi.string(C.dlua_pg_backend(self.h)) end
-- A zeroed 1-D CPU tensor whose memory every rank of the group maps (all-reduces of its ranges read the
-- peers' copies in place), or nil and why when the ranks do not share a host. Collective.
local shared_out, shared_why = ffi.new('dlua_tensor_t *[1]'), ffi.new('const char *[1]')
function Group:shared_zeros(numel, dtype)
  check(C.dlua_pg_shared_zeros(self.h, core.dtype('shared_zeros', dtype, C.DLUA_DTYPE_F32), numel, shared_out,
    shared_why), 'shared_zeros')
  if shared_out[0] == nil then return nil, ffi.string(shared_why[0]) end
  return core.wrap(shared_out[0])
end

-- How CPU all-reduces travel: 'shm', 'tcp' or 'nccl', and why.
function Group:transport()
  local why = ffi.new('const char *[1]')
  local t = ffi.string(C.dlua_pg_transport(self.h, why))
  return t, ffi.string(why[0])
end
function Group:rank() return tonumber(C.dlua_pg_rank(self.h)) end
function Group:size() return tonumber(C.dlua_pg_size(self.h)) end
function Group:seq() return tonumber(C.dlua_pg_seq(self.h)) end
function Group:set_timeout(s) check(C.dlua_pg_set_timeout(self.h, math.floor(s * 1000 + 0.5)), 'set_timeout') end
function Group:set_debug(on) check(C.dlua_pg_set_debug(self.h, on and 1 or 0), 'set_debug') end

function Group:free()
  if self.h ~= nil then
    C.dlua_pg_free(ffi.gc(self.h, nil))
    self.h = nil
  end
end

-- A pending collective: wait() raises its error, is_completed() polls. It holds the tensors
-- it works on, so they outlive it even if the caller drops them.
local Work = {}
Work.__index = Work
M.Work = Work

function Work:wait(timeout_s)
  if self.done then return self.result end
  local ms = timeout_s and math.floor(timeout_s * 1000 + 0.5) or -1
  local status = C.dlua_work_wait(self.h, ms)
  if status == C.DLUA_ERR_TIMEOUT and ms >= 0 and C.dlua_work_is_completed(self.h) == 0 then
    check(status, self.op)  -- only this wait gave up: the work itself goes on
  end
  self.done = true
  C.dlua_work_free(ffi.gc(self.h, nil))
  self.h = nil
  self.keep = nil
  check(status, self.op)
  return self.result
end

function Work:is_completed()
  if self.done then return true end
  return C.dlua_work_is_completed(self.h) ~= 0
end

local work_out = ffi.new('dlua_work_t *[1]')

-- "file.lua:42": the user's line that called the collective: the first caller outside dlua's own tree (bindings/,
-- lua/dlua/, models/), followed by the line in dlua that issued it when that is another ("train.lua:20 via ddp.lua:288":
-- a DDP bucket's all-reduce, started in backward).
local tree = (debug.getinfo(1, 'S').source or ''):match('^@(.*)bindings/dist%.lua$')
local function in_tree(source)
  if tree == nil or source:sub(1, 1) ~= '@' or source:sub(2, #tree + 1) ~= tree then return false end
  local rel = source:sub(#tree + 2)
  return rel:find('^lua/dlua/') ~= nil or rel:find('^bindings/') ~= nil or rel:find('^models/') ~= nil
end
-- While set (a message), every collective raises it instead of starting: dlua.monitor's NaN guard runs a forward
-- again on one rank only, and a collective there (SyncBatchNorm, ZeRO-3's gathers) would meet the other ranks' next one.
local forbidden
function M.forbid(msg) forbidden = msg end
function M.forbidden() return forbidden end  -- the message while collectives are forbidden, else nil

function M.site()
  if forbidden then error(forbidden, 3) end
  local issuer
  for level = 3, 64 do  -- a bucket started deep in backward is still traced to the user
    local info = debug.getinfo(level, 'Sl')
    if info == nil then break end
    local src = info.short_src or '?'
    if info.what ~= 'C' and not src:find('bindings[/\\]') and not src:find('dlua[/\\]dist%.lua$') then
      local here = format('%s:%d', src, info.currentline or 0)
      if not in_tree(info.source or '') then
        if issuer == nil then return here end
        return format('%s via %s', here, issuer)
      end
      issuer = issuer or format('%s:%d', src:match('[^/\\]+$') or src, info.currentline or 0)
    end
  end
  return issuer or '?'
end

local function finish(op, status, async, keep, result)
  if not async then
    check(status, op)
    return result
  end
  check(status, op)
  local w = setmetatable({ op = op, keep = keep, result = result }, Work)
  w.h = ffi.gc(work_out[0], C.dlua_work_free)
  return w
end

local function wptr(async)
  if async then
    work_out[0] = nil
    return work_out
  end
  return nil
end

local function handles(op, list, n, what)
  if type(list) ~= 'table' or #list ~= n then
    core.raise(format('%s: expected a list of %d tensors as %s, got %s', op, n, what,
                      type(list) == 'table' and #list .. ' entries' or type(list)))
  end
  local arr = ffi.new('dlua_tensor_t *[?]', n)
  for i = 1, n do arr[i - 1] = core.handle(op, list[i], format('%s[%d]', what, i)) end
  return arr
end

function Group:all_reduce(t, op, async)
  local code = M.ops[op]
  local p = core.handle('all_reduce', t)
  return finish('all_reduce', C.dlua_pg_all_reduce(self.h, p, code, M.site(), wptr(async)), async, { t }, t)
end

-- One work over a list of tensors, each reduced in place (NCCL: one grouped call).
function Group:all_reduce_many(list, op, async)
  if type(list) ~= 'table' then core.raise(format('all_reduce_many: expected a list of tensors, got %s', type(list))) end
  local n = #list
  local arr = ffi.new('dlua_tensor_t *[?]', math.max(n, 1))
  for i = 1, n do arr[i - 1] = core.handle('all_reduce_many', list[i], format('tensors[%d]', i)) end
  return finish('all_reduce_many', C.dlua_pg_all_reduce_many(self.h, arr, n, M.ops[op], M.site(), wptr(async)),
                async, { list, arr }, list)
end

function Group:broadcast(t, src, async)
  local p = core.handle('broadcast', t)
  return finish('broadcast', C.dlua_pg_broadcast(self.h, p, src, M.site(), wptr(async)), async, { t }, t)
end

function Group:all_gather(outs, t, async)
  local arr = handles('all_gather', outs, self:size(), 'outputs')
  local p = core.handle('all_gather', t)
  return finish('all_gather', C.dlua_pg_all_gather(self.h, arr, p, M.site(), wptr(async)), async,
                { outs, t, arr }, outs)
end

function Group:reduce_scatter(out, ins, op, async)
  local arr = handles('reduce_scatter', ins, self:size(), 'inputs')
  local p = core.handle('reduce_scatter', out)
  return finish('reduce_scatter', C.dlua_pg_reduce_scatter(self.h, p, arr, M.ops[op], M.site(), wptr(async)),
                async, { out, ins, arr }, out)
end

function Group:all_to_all(outs, ins, async)
  local n = self:size()
  local oa = handles('all_to_all', outs, n, 'outputs')
  local ia = handles('all_to_all', ins, n, 'inputs')
  return finish('all_to_all', C.dlua_pg_all_to_all(self.h, oa, ia, M.site(), wptr(async)), async,
                { outs, ins, oa, ia }, outs)
end

function Group:barrier(async)
  return finish('barrier', C.dlua_pg_barrier(self.h, M.site(), wptr(async)), async, nil, nil)
end

function Group:send(t, dst, tag, async)
  local p = core.handle('send', t)
  return finish('send', C.dlua_pg_send(self.h, p, dst, tag, M.site(), wptr(async)), async, { t }, nil)
end

function Group:recv(t, src, tag, async)
  local p = core.handle('recv', t)
  return finish('recv', C.dlua_pg_recv(self.h, p, src, tag, M.site(), wptr(async)), async, { t }, t)
end

return M
