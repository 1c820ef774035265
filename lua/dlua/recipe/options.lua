-- dlua.recipe.options: every train{} option as a command-line flag and in a `--config file.lua` table, and the flags turned into train{}'s table.
local cli = require 'dlua.cli'

local M = {}
local format = string.format

-- The flags train{} reads, their defaults and help. A recipe overrides defaults and adds its own.
M.defaults = {
  config = '', dry_run = false,
  data = '', limit = 0, eval_limit = 0, batch = 32, global_batch = 0, eval_batch = 0, image_size = 0, workers = 2,
  channels_last = true, label_smoothing = 0, augment = true, eval = true,
  epochs = 1, accumulate = 1, optimizer = 'sgd', lr = 0.1, lr_per = 0, momentum = 0.9, nesterov = false, weight_decay = 1e-4,
  warmup = 0, lr_schedule = 'warmup_cosine', warmup_start = 0.1, clip_grad = 0, amp = 'auto',
  bucket_mb = '25', zero = 0, offload = false, compress = 'none', sync_bn = false,
  pipeline = 0, chunks = 8, schedule = '1f1b', split = 'time', checkpoint_activations = 'none',
  save = '', save_every = 0, save_async = false, keep = 0, resume = '', stop_after = 0,
  threads = 0, device = 'auto', seed = 1, print_every = 10, nan_check = '', metrics = '',
}
M.help = {
  config = 'a Lua file returning a table of these options (by their names with _), read before the command line',
  dry_run = 'check the options and print the plan, then exit without training',
  data = 'ImageFolder root with train/ and val/ (default: the built-in Fashion-MNIST)',
  limit = 'train on the first N images only (0: all; an image folder: a fixed random N)',
  eval_limit = 'evaluate on the first N images only (0: all)',
  batch = 'images per rank per step (per micro-batch with --accumulate; per pipeline with --pipeline)',
  global_batch = 'images per optimizer step over every rank instead of --batch (must divide by ranks x --accumulate)',
  eval_batch = 'images per evaluation step (0: --batch)',
  image_size = 'training crop (ImageFolder) or resized side (Fashion-MNIST); 0: the data\'s own',
  workers = 'decoding threads of the ImageFolder loader',
  channels_last = 'keep activations in NHWC memory',
  label_smoothing = 'cross-entropy label smoothing',
  augment = 'training augmentation: random crops and flips (Fashion-MNIST: pad-2 crops)',
  eval = 'evaluate on the test set after each epoch',
  lr_schedule = 'warmup_cosine, cosine or constant',
  warmup_start = 'the warmup starts at this fraction of the peak learning rate',
  epochs = 'passes over the training set',
  accumulate = 'micro-batches per optimizer step (gradients reduced once per step)',
  optimizer = 'sgd, adamw, adam, lars or lamb',
  lr = 'peak learning rate (after warmup); with --lr-per N, per N images',
  lr_per = 'N: --lr is per N images, the peak lr * global batch / N (linear scaling rule); 0: --lr as given',
  nesterov = 'Nesterov momentum (SGD)',
  weight_decay = 'L2 decay on weights (none on batch-norm and bias)',
  warmup = 'epochs of linear warmup before the cosine decay (capped to the run)',
  clip_grad = 'clip the reduced gradients\' total 2-norm to N before each step (0: off)',
  amp = "mixed precision: auto (bf16 on a GPU that supports it, else off), off, bf16 or f16 (dlua.amp)",
  bucket_mb = "DDP gradient bucket size in MB, or 'auto': a few sizes timed in the first steps, the fastest kept",
  zero = 'ZeRO stage 1, 2 or 3 instead of DDP (optimizer state, gradients, parameters sharded); 0: DDP',
  offload = 'with --zero: optimizer state and step in pinned host memory (a no-op for CPU ranks, which says so)',
  compress = 'DDP gradient compression: none, fp16, bf16, topk:R[:noef][:warmup=S][:from=D][:mc=M] or powersgd:K (docs/ddp.md)',
  sync_bn = 'batch-norm statistics over all ranks (SyncBatchNorm) instead of per rank',
  pipeline = 'cut the model into N pipeline stages, one per rank; the ranks left over are data-parallel replicas (0: none)',
  chunks = 'with --pipeline: micro-batches per step',
  schedule = "with --pipeline: 'gpipe' or '1f1b'",
  split = "with --pipeline: balance the stages by measured 'time' or by 'params'",
  checkpoint_activations = 'none, blocks or stages: recompute those in backward instead of keeping their activations',
  save = 'checkpoint directory (dlua.ckpt: DIR/step-N/, DIR/latest)',
  save_every = 'save a checkpoint every N optimizer steps (0: only at the end, with --save)',
  save_async = 'write checkpoints on a background thread while training goes on',
  keep = 'keep the newest N checkpoints (0: all)',
  resume = "'auto' (the newest complete checkpoint in --save, or a fresh start) or a checkpoint directory",
  stop_after = 'stop after N optimizer steps, saving first (the schedule is the full run\'s)',
  threads = 'CPU threads per rank (0: the launcher\'s share of the cores)',
  device = "'auto' (this rank's GPU when each rank has one, else the CPU), 'cpu' or 'cuda'",
  print_every = 'steps between progress lines',
  nan_check = "loss: a non-finite loss stops the run, naming the step and the first module whose output went non-finite; "
    .. "modules: every module's output checked in every forward (slow); off (default: DLUA_NAN_CHECK, else loss)",
  metrics = 'write one JSON line per step (loss, lr, img/s, time by phase, memory), per epoch and a summary to FILE (rank 0)',
}

-- The table a --config file returns, checked against the options it may set.
local function read_config(path, defaults)
  local chunk, err = loadfile(path)
  if not chunk then error(format('--config %s: %s', path, err), 0) end
  local ok, t = pcall(chunk)
  if not ok then error(format('--config %s: %s', path, tostring(t)), 0) end
  if type(t) ~= 'table' then error(format('--config %s: the file must return a table of options, got %s', path, type(t)), 0) end
  local keys = {}
  for k in pairs(defaults) do keys[#keys + 1] = k end
  local out = {}
  for k, v in pairs(t) do
    local key = type(k) == 'string' and k:gsub('-', '_') or k
    if defaults[key] == nil or key == 'config' then
      local hint = type(key) == 'string' and cli.closest(key, keys)
      error(format("--config %s: unknown option '%s'%s", path, tostring(k), hint and format(" (did you mean '%s'?)", hint) or ''), 0)
    end
    local want = type(defaults[key])
    if want == 'string' and type(v) == 'number' then v = tostring(v) end
    if type(v) ~= want then
      error(format('--config %s: %s must be a %s (as its default %s), got %s', path, key, want, tostring(defaults[key]), type(v)), 0)
    end
    out[key] = v
  end
  return out
end

-- parse(arg, own, spec): the recipe's options. own: the recipe's extra options and its defaults for
-- the common ones; spec: cli.parse's (description, help for the recipe's own). A --config file's values
-- replace the defaults; the command line replaces both.
function M.parse(args, own, spec)
  local defaults, help = {}, {}
  for k, v in pairs(M.defaults) do defaults[k] = v end
  for k, v in pairs(own or {}) do defaults[k] = v end
  for k, v in pairs(M.help) do help[k] = v end
  for k, v in pairs(spec and spec.help or {}) do help[k] = v end
  local path
  for i = 1, #args do
    local a = args[i]
    if a == '--config' then path = args[i + 1] elseif type(a) == 'string' and a:match('^%-%-config=') then path = a:sub(10) end
  end
  if path and path ~= '' then
    for k, v in pairs(read_config(path, defaults)) do defaults[k] = v end
  end
  local s = {}
  for k, v in pairs(spec or {}) do s[k] = v end
  s.help = help
  return cli.parse(args, defaults, s)
end

-- The train{} table of parsed options `o` (a recipe adds model, loss and anything of its own).
function M.to_train(o)
  local bucket = o.bucket_mb
  if bucket ~= 'auto' then
    bucket = tonumber(bucket) or error(format("--bucket-mb %s: expected a number of MB or 'auto'", tostring(bucket)), 0)
  end
  return {
    epochs = o.epochs, accumulate = o.accumulate, clip_grad = o.clip_grad, amp = o.amp, activation_checkpoint = o.checkpoint_activations,
    device = o.device, threads = o.threads, seed = o.seed, print_every = o.print_every, metrics = o.metrics, nan_check = o.nan_check,
    dry_run = o.dry_run, eval = o.eval, options = o,
    data = { source = o.data ~= '' and o.data or 'fashion_mnist', batch = o.global_batch > 0 and 0 or o.batch,
      global_batch = o.global_batch, eval_batch = o.eval_batch, limit = o.limit, eval_limit = o.eval_limit, image_size = o.image_size,
      workers = o.workers, channels_last = o.channels_last, label_smoothing = o.label_smoothing, augment = o.augment },
    optim = { name = o.optimizer, lr = o.lr, scale_lr = o.lr_per, momentum = o.momentum, nesterov = o.nesterov,
      weight_decay = o.weight_decay },
    schedule = { name = o.lr_schedule, warmup = o.warmup, start_factor = o.warmup_start },
    parallel = { ddp = { bucket_mb = bucket }, zero = o.zero, offload = o.offload, compress = o.compress, sync_bn = o.sync_bn,
      pipeline = { stages = o.pipeline, chunks = o.chunks, schedule = o.schedule, split = o.split } },
    checkpoint = { dir = o.save, every = o.save_every, keep = o.keep, resume = o.resume, async = o.save_async, stop_after = o.stop_after },
  }
end

return M
