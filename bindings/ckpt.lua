-- The Lua face of host/io: safetensors files (write, open, read), checkpoint jobs (background writes), directory helpers.
local core = require 'bindings.tensor_core'
local ffi, C = core.ffi, core.C
local format = string.format

local M = {}

-- C errors raised at the level of the dlua.ckpt function the user called (`level` counts from
-- the caller of the binding function, as error() does).
local function check(status, op, level)
  if status == 0 then return end
  local msg = ffi.string(C.dlua_last_error())
  C.dlua_clear_error()
  if status == C.DLUA_ERR_INTERRUPTED then msg = 'interrupted' end
  error(op .. ': ' .. msg, (level or 1) + 2)
end
M.check = check

function M.available() return C.dlua_ckpt_available() ~= 0 end

local function cstrings(list)
  local arr = ffi.new('const char *[?]', math.max(#list, 1))
  for i, s in ipairs(list) do arr[i - 1] = s end
  return arr
end

local function handles(op, list)
  local arr = ffi.new('dlua_tensor_t *[?]', math.max(#list, 1))
  for i, t in ipairs(list) do arr[i - 1] = core.handle(op, t, 'tensor ' .. i) end
  return arr
end

-- Writes a safetensors file: names[i] -> tensors[i]; meta_keys[i] -> meta_values[i] (strings).
function M.save_file(path, names, tensors, meta_keys, meta_values, level)
  local st = C.dlua_st_save(path, #names, cstrings(names), handles('save_file', tensors), #meta_keys,
    cstrings(meta_keys), cstrings(meta_values))
  core.keepalive(tensors, 'save_file')
  check(st, 'save_file', level)
end

---------------------------------------------------------------------------------------------
-- Reading

local File = {}
File.__index = File

local function fh(self, op)
  if self.h == nil then error(op .. ': the file ' .. self.path .. ' is closed', 3) end
  return self.h
end

-- Opens and checks a safetensors file; f.entries lists {name, dtype, shape, crc} in file order.
function M.open(path, level)
  local out = ffi.new('dlua_st_file_t *[1]')
  check(C.dlua_st_open(out, path), 'load', level)
  local h = ffi.gc(out[0], C.dlua_st_close)
  local self = setmetatable({ h = h, path = path, entries = {}, index = {}, metadata = {} }, File)
  for i = 0, tonumber(C.dlua_st_count(h)) - 1 do
    local nd = C.dlua_st_ndim(h, i)
    local sz, shape = C.dlua_st_sizes(h, i), {}
    for d = 0, nd - 1 do shape[d + 1] = tonumber(sz[d]) end
    local e = { name = ffi.string(C.dlua_st_name(h, i)), dtype = core.dtype_names[tonumber(C.dlua_st_dtype(h, i))],
      shape = shape, i = i, has_crc = C.dlua_st_has_crc(h, i) ~= 0 }
    self.entries[#self.entries + 1] = e
    self.index[e.name] = e
  end
  for k = 0, tonumber(C.dlua_st_metadata_count(h)) - 1 do
    self.metadata[ffi.string(C.dlua_st_metadata_key(h, k))] = ffi.string(C.dlua_st_metadata_value(h, k))
  end
  self.bytes = tonumber(C.dlua_st_file_bytes(h))
  return self
end

function File:verify(e, level) check(C.dlua_st_verify(fh(self, 'load'), e.i), 'load', level) end

-- A new CPU tensor holding entry e (checksum checked).
function File:read(e, level)
  local out = ffi.new('dlua_tensor_t *[1]')
  check(C.dlua_st_read(fh(self, 'load'), e.i, out), 'load', level)
  return core.wrap(out[0])
end

-- Copies entry e into the tensor dst (same dtype and shape; any layout or device).
function File:read_into(e, dst, level)
  check(C.dlua_st_read_into(fh(self, 'load'), e.i, core.handle('load', dst, e.name)), 'load', level)
  core.keepalive(dst, 'load')
end

function File:close()
  if self.h ~= nil then
    C.dlua_st_close(ffi.gc(self.h, nil))
    self.h = nil
  end
end

---------------------------------------------------------------------------------------------
-- Jobs

local Job = {}
Job.__index = Job

local function jh(self, op)
  if self.h == nil then error('checkpoint ' .. op .. ': the job was freed', 3) end
  return self.h
end

function M.job()
  local out = ffi.new('dlua_ckpt_job_t *[1]')
  check(C.dlua_ckpt_job_new(out), 'checkpoint')
  -- The Lua objects a running job uses (the store client) stay referenced by it.
  return setmetatable({ h = ffi.gc(out[0], C.dlua_ckpt_job_free), keep = {} }, Job)
end

-- A safetensors file of names[i] -> tensors[i] with string metadata; modes[i] (nil: all 0): 0 write
-- the live tensor, 1 copy it now, 2 copy it on the job's thread before writing (see dlua.h).
function Job:add_file(path, names, tensors, meta_keys, meta_values, modes, level)
  local m = nil
  if modes then
    m = ffi.new('int[?]', math.max(#modes, 1))
    for i, v in ipairs(modes) do m[i - 1] = v end
  end
  local st = C.dlua_ckpt_job_add_file(jh(self, 'save'), path, #names, cstrings(names), handles('save', tensors),
    #meta_keys, cstrings(meta_keys), cstrings(meta_values), m)
  core.keepalive(tensors, 'save')
  check(st, 'save', level)
end

function Job:add_text(path, text, level)
  check(C.dlua_ckpt_job_add_text(jh(self, 'save'), path, text, #text), 'save', level)
end

local function store_handle(store)
  if type(store) ~= 'table' or store.h == nil then error('checkpoint: the store is closed', 4) end
  return store.h
end

function Job:add_signal(store, key, level)
  self.keep[#self.keep + 1] = store
  check(C.dlua_ckpt_job_add_signal(jh(self, 'save'), store_handle(store), key), 'save', level)
end

function Job:add_wait(store, keys, timeout_s, level)
  self.keep[#self.keep + 1] = store
  check(C.dlua_ckpt_job_add_wait(jh(self, 'save'), store_handle(store), #keys, cstrings(keys),
    timeout_s and math.floor(timeout_s * 1000) or -1), 'save', level)
end

function Job:add_remove(dir, level) check(C.dlua_ckpt_job_add_remove(jh(self, 'save'), dir), 'save', level) end
function Job:run(level) check(C.dlua_ckpt_job_run(jh(self, 'save')), 'save', level) end
function Job:start(level) check(C.dlua_ckpt_job_start(jh(self, 'save')), 'save', level) end
function Job:done() return self.h == nil or C.dlua_ckpt_job_done(self.h) ~= 0 end
function Job:wait_snapshot() if self.h ~= nil then C.dlua_ckpt_job_wait_snapshot(self.h) end end
function Job:wait(level) check(C.dlua_ckpt_job_wait(jh(self, 'wait')), 'save', level) end
function Job:snapshot_bytes() return self.h and tonumber(C.dlua_ckpt_job_snapshot_bytes(self.h)) or 0 end
function Job:snapshot_peak() return self.h and tonumber(C.dlua_ckpt_job_snapshot_peak(self.h)) or 0 end
function Job:seconds() return self.h and tonumber(C.dlua_ckpt_job_seconds(self.h)) or 0 end

function Job:free()
  if self.h ~= nil then
    C.dlua_ckpt_job_free(ffi.gc(self.h, nil))
    self.h = nil
  end
  self.keep = {}
end

---------------------------------------------------------------------------------------------
-- Directories and checksums

function M.mkdirs(path, level) check(C.dlua_io_mkdirs(path), 'checkpoint', level) end
function M.write_file(path, text, level) check(C.dlua_io_write_file(path, text, #text), 'checkpoint', level) end
function M.remove_dir(path, level) check(C.dlua_io_remove_dir(path), 'checkpoint', level) end

-- The names in a directory (an empty list when it does not exist), sorted.
function M.list_dir(path, level)
  local names, len = ffi.new('char *[1]'), ffi.new('size_t[1]')
  check(C.dlua_io_list_dir(path, names, len), 'checkpoint', level)
  local r = {}
  if names[0] ~= nil then
    local s = ffi.string(names[0], len[0])
    C.dlua_io_free(names[0])
    for name in s:gmatch('([^%z]+)%z') do r[#r + 1] = name end
  end
  table.sort(r)
  return r
end

-- zlib's CRC32 of tensors' logical bytes, in turn, as 8 hex digits.
function M.crc32(tensors, level)
  local crc = ffi.new('uint32_t[1]')
  check(C.dlua_tensors_crc32(#tensors, handles('crc32', tensors), crc), 'crc32', level)
  core.keepalive(tensors, 'crc32')
  return format('%08x', tonumber(crc[0]))
end

function M.crc32_string(s) return format('%08x', tonumber(C.dlua_crc32(0, s, #s))) end

return M
