-- Lua face of the CUDA device layer: devices, streams, events, the caching allocator's statistics.
local capi = require 'bindings.capi'
local core = require 'bindings.tensor_core'
local ffi, C = capi.ffi, capi.C
local raise, check = core.raise, core.check
local format, floor = string.format, math.floor

ffi.cdef [[
struct dlua_cuda_stream_ref { dlua_cuda_stream_t *p; int owned; };
struct dlua_cuda_event_ref { dlua_cuda_event_t *p; int device; };
]]

local M = {}

function M.device_count() return tonumber(C.dlua_cuda_device_count()) end
function M.is_available() return C.dlua_cuda_device_count() > 0 end
-- Whether this binary's CUDA devices are the CPU emulator (built with -DDLUA_CUDA=EMU, docs/cuda.md#emulator).
function M.is_emulated() return C.dlua_cuda_emulated() ~= 0 end
-- Why there is no device (the driver's message, or "built without CUDA"); nil when there is one.
function M.unavailable_reason()
  local r = ffi.string(C.dlua_cuda_unavailable_reason())
  if r == '' then return nil end
  return r
end

-- A device argument as a CUDA ordinal: nil (the current device), n >= 0, 'cuda' or 'cuda:N'.
local function ordinal(op, d)
  if d == nil then return core.cuda_ordinal(op, 'cuda', -1) end
  if type(d) == 'number' then
    if d ~= floor(d) or d < 0 then raise(format('%s: expected a device number >= 0, got %s', op, tostring(d))) end
    return core.cuda_ordinal(op, 'cuda:' .. d, d)
  end
  local n = core.device(op, d)
  if n == C.DLUA_CPU then raise(op .. ": expected a CUDA device, got 'cpu'") end
  return n
end
M.ordinal = ordinal

-- torch.cuda.get_device_capability: (major, minor) of the device (default the current one).
function M.get_device_capability(d)
  local v = ffi.new('int[2]')
  check(C.dlua_cuda_get_device_capability(ordinal('get_device_capability', d), v, v + 1), 'get_device_capability')
  return tonumber(v[0]), tonumber(v[1])
end
-- torch.cuda.is_bf16_supported: a device (default the current one) with bfloat16 arithmetic (compute capability >= 8.0).
function M.is_bf16_supported(d)
  if not M.is_available() then return false end
  return (M.get_device_capability(d)) >= 8
end
function M.set_device(d) check(C.dlua_cuda_set_device(ordinal('set_device', d)), 'set_device') end
function M.current_device() return ordinal('current_device', nil) end
function M.synchronize(d) check(C.dlua_cuda_synchronize(ordinal('synchronize', d)), 'synchronize') end

---------------------------------------------------------------------------------------------
-- Memory

local stats_fields = { 'allocated', 'requested', 'reserved', 'peak_allocated', 'peak_reserved', 'num_allocs',
  'num_frees', 'num_raw_allocs', 'num_raw_frees', 'num_ooms', 'blocks', 'cached_blocks', 'pending_blocks',
  'segments', 'largest_free' }
M.stats_fields = stats_fields

local stats_buf = ffi.new('dlua_memory_stats_t')
-- The caching allocator's counters for a device (default: the current one), or 'pinned' for the
-- page-locked host allocator: a table of numbers (bytes, or counts for num_* and *blocks).
function M.memory_stats(d)
  local dev = d == 'pinned' and C.DLUA_CPU or ordinal('memory_stats', d)
  check(C.dlua_cuda_memory_stats(dev, stats_buf), 'memory_stats')
  local t = {}
  for _, k in ipairs(stats_fields) do t[k] = tonumber(stats_buf[k]) end
  return t
end

-- (and dlua.memory_peak's count of storage bytes for that device)
function M.reset_peak_memory_stats(d)
  local dev = ordinal('reset_peak_memory_stats', d)
  check(C.dlua_cuda_reset_peak_memory_stats(dev), 'reset_peak_memory_stats')
  C.dlua_memory_reset_peak(dev)
end

-- Gives cached, unused device memory (and unused pinned host memory) back to the driver.
function M.empty_cache(d) check(C.dlua_cuda_empty_cache(ordinal('empty_cache', d)), 'empty_cache') end

-- Whether f32 matmuls on CUDA may use TF32 (faster, ~1e-3 relative error); off by default, as
-- PyTorch's torch.backends.cuda.matmul.allow_tf32.
function M.set_allow_tf32(on) C.dlua_cuda_set_allow_tf32(on and 1 or 0) end
function M.allow_tf32() return C.dlua_cuda_get_allow_tf32() ~= 0 end

---------------------------------------------------------------------------------------------
-- Streams

local Stream, Event -- metatypes
local stream_methods, event_methods = {}, {}

local function stream_handle(op, s)
  if not ffi.istype(Stream, s) then raise(format('%s: expected a Stream, got %s', op, type(s))) end
  if s.p == nil then raise(op .. ': the stream was destroyed') end
  return s.p
end

local function event_handle(op, e)
  if not ffi.istype(Event, e) then raise(format('%s: expected an Event, got %s', op, type(e))) end
  if e.p == nil then raise(op .. ': the event was destroyed') end
  return e.p
end

Stream = ffi.metatype('struct dlua_cuda_stream_ref', {
  __index = function(s, k)
    if k == 'device' then return tonumber(C.dlua_cuda_stream_device(stream_handle('device', s))) end
    return stream_methods[k]
  end,
  __gc = function(s)
    if s.owned ~= 0 and s.p ~= nil then C.dlua_cuda_stream_destroy(s.p) end
  end,
  __eq = function(a, b)
    return ffi.istype(Stream, a) and ffi.istype(Stream, b) and a.p == b.p
  end,
  __tostring = function(s)
    if s.p == nil then return 'Stream(destroyed)' end
    return format('Stream(cuda:%d, %s)', tonumber(C.dlua_cuda_stream_device(s.p)),
      s.owned ~= 0 and 'created' or 'current')
  end,
})

-- A new stream on a device (default: the current one); its work runs concurrently with other
-- streams' and is ordered within it.
function M.Stream(d)
  local dev = ordinal('Stream', d)
  local out = ffi.new('dlua_cuda_stream_t *[1]')
  check(C.dlua_cuda_stream_create(out, dev), 'Stream')
  return Stream(out[0], 1)
end

-- The stream ops on a device queue on now (not owned: the Lua object does not destroy it).
function M.current_stream(d)
  local dev = ordinal('current_stream', d)
  return Stream(C.dlua_cuda_current_stream(dev), 0)
end

-- Makes s the current stream of its device; nil restores the default stream of device d.
function M.set_stream(s, d)
  if s == nil then
    check(C.dlua_cuda_set_current_stream(ordinal('set_stream', d), nil), 'set_stream')
  else
    local p = stream_handle('set_stream', s)
    check(C.dlua_cuda_set_current_stream(C.dlua_cuda_stream_device(p), p), 'set_stream')
  end
end

function stream_methods.synchronize(s)
  check(C.dlua_cuda_stream_synchronize(stream_handle('Stream:synchronize', s)), 'Stream:synchronize')
end

local done_buf = ffi.new('int[1]')
-- true when all work queued on the stream is done.
function stream_methods.query(s)
  check(C.dlua_cuda_stream_query(stream_handle('Stream:query', s), done_buf), 'Stream:query')
  return done_buf[0] ~= 0
end

-- Work queued on s from now on waits for `what`: an Event, or another Stream's work so far.
function stream_methods.wait(s, what)
  local p = stream_handle('Stream:wait', s)
  if ffi.istype(Stream, what) then
    local e = M.Event { device = tonumber(C.dlua_cuda_stream_device(stream_handle('Stream:wait', what))) }
    e:record(what)
    what = e
  end
  check(C.dlua_cuda_stream_wait_event(p, event_handle('Stream:wait', what)), 'Stream:wait')
end

-- Records a new event on the stream (PyTorch's record_event) and returns it.
function stream_methods.record_event(s, opts)
  local e = M.Event { device = tonumber(C.dlua_cuda_stream_device(stream_handle('Stream:record_event', s))),
    enable_timing = opts and opts.enable_timing }
  e:record(s)
  return e
end

function stream_methods.destroy(s)
  local p = stream_handle('Stream:destroy', s)
  if s.owned == 0 then raise('Stream:destroy: this stream belongs to the device (a current or default stream)') end
  s.p = nil
  C.dlua_cuda_stream_destroy(p)
end

---------------------------------------------------------------------------------------------
-- Events

Event = ffi.metatype('struct dlua_cuda_event_ref', {
  __index = function(e, k)
    if k == 'device' then return e.p ~= nil and e.device or nil end
    return event_methods[k]
  end,
  __gc = function(e)
    if e.p ~= nil then C.dlua_cuda_event_destroy(e.p) end
  end,
  __tostring = function(e)
    if e.p == nil then return 'Event(destroyed)' end
    return format('Event(cuda:%d)', e.device)
  end,
})

-- Event{ device = n, enable_timing = true }: a marker in a stream's work.
function M.Event(opts)
  opts = core.options('Event', opts, { device = true, enable_timing = true })
  local dev = ordinal('Event', opts.device)
  local out = ffi.new('dlua_cuda_event_t *[1]')
  check(C.dlua_cuda_event_create(out, dev, opts.enable_timing and 1 or 0), 'Event')
  return Event(out[0], dev)
end

-- Marks the work queued so far on `s` (default: the current stream).
function event_methods.record(e, s)
  local p = event_handle('Event:record', e)
  check(C.dlua_cuda_event_record(p, s ~= nil and stream_handle('Event:record', s) or nil), 'Event:record')
  return e
end

-- Makes stream `s` (default: the current stream) wait for this event's work.
function event_methods.wait(e, s)
  local p = event_handle('Event:wait', e)
  local sp = s ~= nil and stream_handle('Event:wait', s) or C.dlua_cuda_current_stream(e.device)
  check(C.dlua_cuda_stream_wait_event(sp, p), 'Event:wait')
end

function event_methods.query(e)
  check(C.dlua_cuda_event_query(event_handle('Event:query', e), done_buf), 'Event:query')
  return done_buf[0] ~= 0
end

function event_methods.synchronize(e)
  check(C.dlua_cuda_event_synchronize(event_handle('Event:synchronize', e)), 'Event:synchronize')
end

local ms_buf = ffi.new('double[1]')
-- Milliseconds from this event to `other` (both recorded, both created with enable_timing).
function event_methods.elapsed_time(e, other)
  check(C.dlua_cuda_event_elapsed(event_handle('Event:elapsed_time', e),
    event_handle('Event:elapsed_time', other), ms_buf), 'Event:elapsed_time')
  return tonumber(ms_buf[0])
end

-- A device name for `spec`: 'auto' is 'cuda:<current>' when a GPU is there, else 'cpu';
-- 'cpu', 'cuda', 'cuda:N' and N are checked ('cuda' without a GPU is an error saying why).
function M.resolve_device(spec)
  if spec == nil or spec == 'auto' then
    if M.is_available() then return 'cuda:' .. M.current_device() end
    return 'cpu'
  end
  if spec == 'cpu' then return 'cpu' end
  return 'cuda:' .. ordinal('resolve_device', spec)
end

-- record_stream(t, s): work queued on stream s uses CUDA tensor t (made on another stream), so its
-- memory is not reused before that work ends (PyTorch's t.record_stream(s)). t must start at its
-- allocation (a tensor fresh from to()/empty(), not a view into another).
function M.record_stream(t, s)
  local p = core.handle('record_stream', t)
  local dev = C.dlua_tensor_device(p)
  if dev < 0 then error('record_stream: expected a CUDA tensor, got one on the CPU', 2) end
  check(C.dlua_cuda_record_stream(dev, C.dlua_tensor_data(p), stream_handle('record_stream', s)), 'record_stream')
end

M.is_stream = function(x) return ffi.istype(Stream, x) end
M.is_event = function(x) return ffi.istype(Event, x) end

return M
