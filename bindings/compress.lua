-- The Lua face of the gradient-compression kernels (front doors host/ops/compress.c, CPU kernels host/cpu/compress.c) for lua/dlua/compress.lua.
local core = require 'bindings.tensor_core'
local C = core.C
local handle, check = core.handle, core.check

local M = {}

local function opt_handle(op, t, what)
  if t == nil then return nil end
  return handle(op, t, what)
end

-- dst (f16/bf16) = src (f32) * scale
function M.to_half(dst, src, scale)
  check(C.dlua_compress_to_half(handle('compress_to_half', dst, 'the output'), handle('compress_to_half', src, 'the input'),
    scale or 1), 'compress_to_half')
end

-- dst (f32) = src (f16/bf16)
function M.from_half(dst, src)
  check(C.dlua_compress_from_half(handle('compress_from_half', dst, 'the output'),
    handle('compress_from_half', src, 'the input')), 'compress_from_half')
end

-- packed (2k int32) = the k largest |acc| (acc += grad first; with mom, DGC's momentum correction); acc, mom may be nil
function M.topk(packed, grad, acc, mom, momentum, k)
  local op = 'compress_topk'
  check(C.dlua_compress_topk(handle(op, packed, 'the packed buffer'), handle(op, grad, 'the gradient'),
    opt_handle(op, acc, 'the residual'), opt_handle(op, mom, 'the momentum buffer'), momentum or 0, k), op)
end

-- grad = (sum of the rows' values at their indices) / divisor
function M.topk_unpack(grad, gathered, rows, divisor)
  local op = 'compress_topk_unpack'
  check(C.dlua_compress_topk_unpack(handle(op, grad, 'the gradient'), handle(op, gathered, 'the gathered buffer'), rows,
    divisor or 1), op)
end

-- p (n, r) f32: orthonormal columns in place
function M.orthogonalize(p, eps)
  check(C.dlua_compress_orthogonalize(handle('compress_orthogonalize', p, 'the matrix'), eps or 0), 'compress_orthogonalize')
end

return M
