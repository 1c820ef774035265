-- The FFI face of the layer, loss and optimizer kernels (front doors in host/ops: loss, activation, optim, conv, batchnorm, pool) for dlua.nn and dlua.optim.
local ffi = require 'ffi'
local core = require 'bindings.tensor_core'
local C = core.C
local new, new2, call, handle = core.new, core.new2, core.call, core.handle

local M = {}

local reductions = { none = C.DLUA_LOSS_NONE, mean = C.DLUA_LOSS_MEAN, sum = C.DLUA_LOSS_SUM }
function M.reduction(op, r)
  local code = reductions[r or 'mean']
  if code == nil then core.raise(string.format("%s: reduction must be 'mean', 'sum' or 'none', got %s", op, tostring(r))) end
  return code
end

-- The optional generator object of dlua.Generator (nil: the default generator).
local function gen(op, g)
  if g == nil then return nil end
  return require('bindings.tensor_create').generator_handle(op, g)
end

---------------------------------------------------------------------------------------------
-- Losses and activations (labels counted from 1, as everything Lua sees)

-- -> loss (0-d or per target), log_probs (kept for backward)
function M.cross_entropy(logits, labels, weight, reduction, smoothing, ignore_index)
  return new2('CrossEntropyLoss', C.dlua_nn_cross_entropy, 7, logits, labels, weight,
    M.reduction('CrossEntropyLoss', reduction), smoothing or 0, ignore_index or -100, 1)
end

function M.cross_entropy_backward(grad_out, log_probs, labels, weight, reduction, smoothing, ignore_index)
  return new('CrossEntropyLoss.backward', C.dlua_nn_cross_entropy_backward, 8, grad_out, log_probs, labels, weight,
    M.reduction('CrossEntropyLoss', reduction), smoothing or 0, ignore_index or -100, 1)
end

function M.mse_loss(input, target, reduction)
  return new('MSELoss', C.dlua_nn_mse_loss, 3, input, target, M.reduction('MSELoss', reduction))
end

function M.mse_loss_backward(grad_out, input, target, reduction)
  return new('MSELoss.backward', C.dlua_nn_mse_loss_backward, 4, grad_out, input, target, M.reduction('MSELoss', reduction))
end

function M.softmax(x, dim0, log)
  return new(log and 'log_softmax' or 'softmax', C.dlua_nn_softmax, 3, x, dim0, log and 1 or 0)
end

function M.softmax_backward(grad, out, dim0, log)
  return new('softmax.backward', C.dlua_nn_softmax_backward, 4, grad, out, dim0, log and 1 or 0)
end

function M.relu(x) return new('ReLU', C.dlua_nn_threshold, 3, x, 0, 0) end
function M.relu_backward(grad, output) return new('ReLU.backward', C.dlua_nn_relu_backward, 2, grad, output) end

-- -> out, mask (mask nil in evaluation)
function M.dropout(x, p, train, g)
  if not train then return x, nil end
  return new2('Dropout', C.dlua_nn_dropout, 4, x, p, 1, gen('Dropout', g))
end

function M.dropout_backward(grad, mask, p)
  return new('Dropout.backward', C.dlua_nn_dropout_backward, 3, grad, mask, p)
end

---------------------------------------------------------------------------------------------
-- Convolution: c = {stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups}

local out1 = ffi.new('dlua_tensor_t *[1]')
local sizes4 = ffi.new('int64_t[4]')

-- Calls f(out1, ...) and wraps the new tensor; retries once after a full GC on OOM.
local function with_out(op, f, ...)
  out1[0] = nil
  local st = f(out1, ...)
  if st == C.DLUA_ERR_OOM then
    core.full_gc()
    out1[0] = nil
    st = f(out1, ...)
  end
  if st ~= 0 then core.check(st, op) end
  local p = out1[0]
  out1[0] = nil
  return core.wrap(p)
end

function M.conv2d(x, w, b, c)
  return with_out('Conv2d', C.dlua_conv2d_forward, handle('Conv2d', x), handle('Conv2d', w),
    b and handle('Conv2d', b) or nil, c[1], c[2], c[3], c[4], c[5], c[6], c[7])
end

-- -> the input gradient; with add_to (x's shape), added to it in place and add_to returned
function M.conv2d_backward_data(grad_y, w, x, c, add_to)
  local op = 'Conv2d.backward'
  local p = handle(op, x)
  local s = C.dlua_tensor_sizes(p)
  for i = 0, 3 do sizes4[i] = s[i] end
  if add_to == nil then
    return with_out(op, C.dlua_conv2d_backward_data, handle(op, grad_y), handle(op, w), sizes4, c[1], c[2], c[3], c[4],
      c[5], c[6], c[7], 0)
  end
  out1[0] = handle(op, add_to)
  local st = C.dlua_conv2d_backward_data(out1, handle(op, grad_y), handle(op, w), sizes4, c[1], c[2], c[3], c[4], c[5],
    c[6], c[7], 1)
  out1[0] = nil
  if st ~= 0 then core.check(st, op) end
  return add_to
end

function M.conv2d_backward_weights(grad_w, grad_b, x, grad_y, c)
  local st = C.dlua_conv2d_backward_weights(handle('Conv2d.backward', grad_w), grad_b and handle('Conv2d.backward', grad_b) or nil,
    handle('Conv2d.backward', x), handle('Conv2d.backward', grad_y), c[1], c[2], c[3], c[4], c[5], c[6], c[7], 1)
  if st ~= 0 then core.check(st, 'Conv2d.backward') end
end

---------------------------------------------------------------------------------------------
-- Batch-norm (optionally fused with a residual add and ReLU) and pooling

local outs3 = ffi.new('dlua_tensor_t *[3]')

local function status(op, f, ...)
  local st = f(...)
  if st == C.DLUA_ERR_OOM then
    core.full_gc()
    st = f(...)
  end
  if st ~= 0 then core.check(st, op) end
end

local function opt_handle(op, t) return t ~= nil and handle(op, t) or nil end

-- -> out, save_mean, save_invstd (saves nil when no backward follows: want_saves false)
function M.batch_norm(x, gamma, beta, skip, running_mean, running_var, train, momentum, eps, relu, want_saves)
  local op = 'BatchNorm2d'
  outs3[0], outs3[1], outs3[2] = nil, nil, nil
  status(op, C.dlua_nn_batch_norm_forward, outs3, want_saves and outs3 + 1 or nil, want_saves and outs3 + 2 or nil,
    handle(op, x), opt_handle(op, gamma), opt_handle(op, beta), opt_handle(op, skip), opt_handle(op, running_mean),
    opt_handle(op, running_var), train and 1 or 0, momentum, eps, relu and 1 or 0)
  local a, b, c = outs3[0], outs3[1], outs3[2]
  outs3[0], outs3[1], outs3[2] = nil, nil, nil
  return core.wrap(a), b ~= nil and core.wrap(b) or nil, c ~= nil and core.wrap(c) or nil
end

-- The outputs of the two backwards: `over` (optional) is grad_out itself, given up by the caller and
-- written over with grad_skip (when want_skip) or grad_input, which saves a fresh buffer's traffic.
local function bn_grads_begin(op, want_skip, over)
  outs3[0], outs3[1] = nil, nil
  if over ~= nil then outs3[want_skip and 1 or 0] = handle(op, over) end
end
local function bn_grads_end(want_skip, over)
  local a, b = outs3[0], outs3[1]
  outs3[0], outs3[1] = nil, nil
  local gi = (over ~= nil and not want_skip) and over or core.wrap(a)
  if not want_skip then return gi end
  return gi, over ~= nil and over or core.wrap(b)
end

-- -> grad_input, grad_skip (when want_skip); grad_gamma/grad_beta accumulate. beta: the forward's,
-- given only when it ran without a skip (the ReLU mask is then recomputed from x; dlua.h)
function M.batch_norm_backward(grad_out, x, output, gamma, beta, save_mean, save_invstd, grad_gamma, grad_beta, train,
                               relu, want_skip, over)
  local op = 'BatchNorm2d.backward'
  bn_grads_begin(op, want_skip, over)
  status(op, C.dlua_nn_batch_norm_backward, outs3, want_skip and outs3 + 1 or nil, opt_handle(op, grad_gamma),
    opt_handle(op, grad_beta), handle(op, grad_out), handle(op, x), opt_handle(op, output), opt_handle(op, gamma),
    opt_handle(op, beta), handle(op, save_mean), handle(op, save_invstd), train and 1 or 0, relu and 1 or 0, 1)
  return bn_grads_end(want_skip, over)
end

-- SyncBatchNorm's halves (docs/ddp.md). The packed (2C+1) float64 sums go into `into` when
-- given (reused across steps), else a new tensor; each returns it.
local function into_sums(op, into, f, ...)
  outs3[0] = into ~= nil and handle(op, into) or nil
  status(op, f, outs3, ...)
  local p = outs3[0]
  outs3[0] = nil
  if into ~= nil then return into end
  return core.wrap(p)
end

function M.batch_norm_stats(x, into)
  return into_sums('SyncBatchNorm', into, C.dlua_nn_batch_norm_stats, handle('SyncBatchNorm', x))
end

-- -> out, save_mean, save_invstd, from stats summed over the ranks
function M.batch_norm_apply(x, gamma, beta, skip, stats, running_mean, running_var, momentum, eps, relu)
  local op = 'SyncBatchNorm'
  outs3[0], outs3[1], outs3[2] = nil, nil, nil
  status(op, C.dlua_nn_batch_norm_apply, outs3, outs3 + 1, outs3 + 2, handle(op, x), opt_handle(op, gamma),
    opt_handle(op, beta), opt_handle(op, skip), handle(op, stats), opt_handle(op, running_mean),
    opt_handle(op, running_var), momentum, eps, relu and 1 or 0)
  local a, b, c = outs3[0], outs3[1], outs3[2]
  outs3[0], outs3[1], outs3[2] = nil, nil, nil
  return core.wrap(a), core.wrap(b), core.wrap(c)
end

-- -> this rank's backward sums; grad_gamma/grad_beta accumulate the local ones
function M.batch_norm_backward_reduce(grad_out, x, output, gamma, beta, save_mean, save_invstd, grad_gamma, grad_beta,
                                      relu, into)
  local op = 'SyncBatchNorm.backward'
  return into_sums(op, into, C.dlua_nn_batch_norm_backward_reduce, opt_handle(op, grad_gamma), opt_handle(op, grad_beta),
    handle(op, grad_out), handle(op, x), opt_handle(op, output), opt_handle(op, gamma), opt_handle(op, beta),
    handle(op, save_mean), handle(op, save_invstd), relu and 1 or 0, 1)
end

-- -> grad_input, grad_skip (when want_skip), from sums summed over the ranks
function M.batch_norm_backward_apply(grad_out, x, output, gamma, beta, save_mean, save_invstd, sums, relu, want_skip,
                                     over)
  local op = 'SyncBatchNorm.backward'
  bn_grads_begin(op, want_skip, over)
  status(op, C.dlua_nn_batch_norm_backward_apply, outs3, want_skip and outs3 + 1 or nil, handle(op, grad_out),
    handle(op, x), opt_handle(op, output), opt_handle(op, gamma), opt_handle(op, beta), handle(op, save_mean),
    handle(op, save_invstd), handle(op, sums), relu and 1 or 0)
  return bn_grads_end(want_skip, over)
end

-- Calls f(out1, ...) writing into a new gradient laid out like the forward input x when x is
-- channels-last (the pooling kernels follow a given output's layout); otherwise as with_out.
local function grad_like(op, x, grad_out, f, ...)
  if not core.has_memory_format(op, handle(op, x), 'channels_last') then return with_out(op, f, ...) end
  local gx = require('bindings.tensor_create').empty_channels_last(core.sizes(handle(op, x)),
    { dtype = grad_out.dtype, device = grad_out.device })
  out1[0] = handle(op, gx)
  local st = f(out1, ...)
  out1[0] = nil
  if st ~= 0 then core.check(st, op) end
  return gx
end

local function sizes_of(op, x)
  local p = handle(op, x)
  local s = C.dlua_tensor_sizes(p)
  for i = 0, 3 do sizes4[i] = s[i] end
  return sizes4
end

-- c = {kh, kw, sh, sw, ph, pw, dh, dw, ceil_mode}; -> out, indices (indices nil in inference)
function M.max_pool2d(x, c, want_indices)
  local op = 'MaxPool2d'
  outs3[0], outs3[1] = nil, nil
  status(op, C.dlua_nn_max_pool2d_forward, outs3, want_indices and outs3 + 1 or nil, handle(op, x), c[1], c[2], c[3],
    c[4], c[5], c[6], c[7], c[8], c[9] and 1 or 0)
  local a, b = outs3[0], outs3[1]
  outs3[0], outs3[1] = nil, nil
  return core.wrap(a), b ~= nil and core.wrap(b) or nil
end

function M.max_pool2d_backward(grad_out, indices, x)
  return grad_like('MaxPool2d.backward', x, grad_out, C.dlua_nn_max_pool2d_backward, handle('MaxPool2d.backward', grad_out),
    handle('MaxPool2d.backward', indices), sizes_of('MaxPool2d.backward', x))
end

-- c = {kh, kw, sh, sw, ph, pw, ceil_mode, count_include_pad, divisor_override}
function M.avg_pool2d(x, c)
  return with_out('AvgPool2d', C.dlua_nn_avg_pool2d_forward, handle('AvgPool2d', x), c[1], c[2], c[3], c[4], c[5], c[6],
    c[7] and 1 or 0, c[8] and 1 or 0, c[9] or 0)
end

function M.avg_pool2d_backward(grad_out, x, c)
  return grad_like('AvgPool2d.backward', x, grad_out, C.dlua_nn_avg_pool2d_backward, handle('AvgPool2d.backward', grad_out),
    sizes_of('AvgPool2d.backward', x), c[1], c[2], c[3], c[4], c[5], c[6], c[7] and 1 or 0, c[8] and 1 or 0, c[9] or 0)
end

function M.adaptive_avg_pool2d(x, oh, ow)
  return with_out('AdaptiveAvgPool2d', C.dlua_nn_adaptive_avg_pool2d_forward, handle('AdaptiveAvgPool2d', x), oh, ow)
end

function M.adaptive_avg_pool2d_backward(grad_out, x)
  return grad_like('AdaptiveAvgPool2d.backward', x, grad_out, C.dlua_nn_adaptive_avg_pool2d_backward,
    handle('AdaptiveAvgPool2d.backward', grad_out), sizes_of('AdaptiveAvgPool2d.backward', x))
end

---------------------------------------------------------------------------------------------
-- Optimizer steps over ranges of flat arenas (offsets count elements, from 0)

-- lowp (optional): the arena's 16-bit twin, written in the same pass (mixed precision's master weights).
function M.sgd_step(p, g, buf, offset, length, lr, momentum, dampening, wd, nesterov, maximize, first, scale, lowp)
  local b = buf and handle('SGD.step', buf) or nil
  local st
  if lowp then
    st = C.dlua_optim_sgd_step_lowp(handle('SGD.step', p), handle('SGD.step', g), b, offset, length, lr, momentum, dampening,
      wd, nesterov and 1 or 0, maximize and 1 or 0, first and 1 or 0, scale or 1, handle('SGD.step', lowp))
  else
    st = C.dlua_optim_sgd_step(handle('SGD.step', p), handle('SGD.step', g), b, offset, length, lr, momentum, dampening, wd,
      nesterov and 1 or 0, maximize and 1 or 0, first and 1 or 0, scale or 1)
  end
  if st ~= 0 then core.check(st, 'SGD.step') end
end

local function adam(name, decoupled, p, g, m, v, vmax, offset, length, lr, beta1, beta2, eps, wd, step, amsgrad, maximize,
                    scale, lowp)
  local vm = vmax and handle(name, vmax) or nil
  local st
  if lowp then
    st = C.dlua_optim_adam_step_lowp(decoupled, handle(name, p), handle(name, g), handle(name, m), handle(name, v), vm,
      offset, length, lr, beta1, beta2, eps, wd, step, amsgrad and 1 or 0, maximize and 1 or 0, scale or 1, handle(name, lowp))
  else
    local fn = decoupled == 1 and C.dlua_optim_adamw_step or C.dlua_optim_adam_step
    st = fn(handle(name, p), handle(name, g), handle(name, m), handle(name, v), vm, offset, length, lr, beta1, beta2, eps,
      wd, step, amsgrad and 1 or 0, maximize and 1 or 0, scale or 1)
  end
  if st ~= 0 then core.check(st, name) end
end

function M.adamw_step(...) return adam('AdamW.step', 1, ...) end
function M.adam_step(...) return adam('Adam.step', 0, ...) end

-- ranges: list of {offset, length, exclude} -> C arrays (kept alive by the caller's locals)
local function range_arrays(ranges)
  local n = #ranges
  local offs, lens, excl = ffi.new('int64_t[?]', n), ffi.new('int64_t[?]', n), ffi.new('int32_t[?]', n)
  for i, r in ipairs(ranges) do offs[i - 1], lens[i - 1], excl[i - 1] = r[1], r[2], r[3] and 1 or 0 end
  return n, offs, lens, excl
end

-- ranges: list of {offset, length, exclude}
function M.lamb_step(p, g, m, v, ranges, lr, beta1, beta2, eps, wd, step, bias_correction, scale)
  local n, offs, lens, excl = range_arrays(ranges)
  local st = C.dlua_optim_lamb_step(handle('LAMB.step', p), handle('LAMB.step', g), handle('LAMB.step', m),
    handle('LAMB.step', v), n, offs, lens, excl, lr, beta1, beta2, eps, wd, step, bias_correction and 1 or 0, scale or 1)
  if st ~= 0 then core.check(st, 'LAMB.step') end
end

-- ranges: list of {offset, length, exclude}
function M.lars_step(p, g, buf, ranges, lr, momentum, wd, trust, eps, first, scale)
  local n, offs, lens, excl = range_arrays(ranges)
  local st = C.dlua_optim_lars_step(handle('LARS.step', p), handle('LARS.step', g), handle('LARS.step', buf), n, offs,
    lens, excl, lr, momentum, wd, trust, eps, first and 1 or 0, scale or 1)
  if st ~= 0 then core.check(st, 'LARS.step') end
end

local nonfinite = ffi.new('int64_t[1]')
-- grad[offset, offset+length) *= inv_scale; returns the count of non-finite values.
function M.unscale(g, offset, length, inv_scale)
  local st = C.dlua_optim_unscale(handle('unscale', g), offset, length, inv_scale, nonfinite)
  if st ~= 0 then core.check(st, 'unscale') end
  return tonumber(nonfinite[0])
end

local norm_out = ffi.new('double[1]')
-- clip_grad_norm_'s pieces: the sum of |g|^p over grad[offset, offset+length) (max |g| for p = inf) ...
function M.grad_norm_partial(g, offset, length, norm_type)
  local st = C.dlua_optim_grad_norm_partial(handle('grad_norm_partial', g), offset, length, norm_type, norm_out)
  if st ~= 0 then core.check(st, 'grad_norm_partial') end
  return norm_out[0]
end

-- ... and grad[offset, offset+length) *= scale.
function M.grad_scale(g, offset, length, scale)
  local st = C.dlua_optim_grad_scale(handle('grad_scale', g), offset, length, scale)
  if st ~= 0 then core.check(st, 'grad_scale') end
end

return M
