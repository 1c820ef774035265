-- dlua.data.sampler: DistributedSampler (torch's semantics), with a global cursor in its state_dict so a checkpoint resumes mid-epoch on any number of ranks.
local dlua = require 'dlua'
local U = require 'dlua.data.util'
require 'dlua.data.batches'  -- data.order

local data = U.data
local format, floor, ceil = string.format, math.floor, math.ceil
local fail, describe_value, check_options, dataset_size = U.fail, U.describe_value, U.check_options, U.dataset_size

local DistributedSampler = {}
DistributedSampler.__index = DistributedSampler

local function dist_defaults()
  local dist = package.loaded['dlua.dist']
  if type(dist) == 'table' and type(dist.is_initialized) == 'function' and dist.is_initialized() then
    local ws = dist.world_size or dist.get_world_size
    local rk = dist.rank or dist.get_rank
    if type(ws) == 'function' and type(rk) == 'function' then return ws(), rk() end
  end
  return 1, 0
end

-- DistributedSampler{n = or dataset =, num_replicas =, rank =, shuffle = true, seed = 0,
-- drop_last = false}: torch's semantics. Every rank orders 1..n the same way (a function of
-- (seed, epoch)), pads by wrapping around to a multiple of num_replicas (or drops the tail
-- with drop_last) and takes positions rank+1, rank+1+num_replicas, ... num_replicas and
-- rank (0-based, as torch's) default to dlua.dist's world size and rank once it is initialised.
-- pad = false (evaluation): neither pads nor drops, so every sample is counted exactly once over
-- the ranks (rank r takes r+1, r+1+num_replicas, ...; the first n % num_replicas ranks hold one
-- more); with it the ranks hold unequal shares, so it is for loops that all-reduce counts, not steps.
function data.DistributedSampler(opts)
  local o = check_options('DistributedSampler', opts, { n = true, dataset = true, num_replicas = true, rank = true,
    shuffle = true, seed = true, drop_last = true, pad = true }, 2)
  local n = o.n
  if n == nil and o.dataset ~= nil then
    local ds = o.dataset
    if type(ds) == 'table' and type(ds.n) == 'number' then n = ds.n else n = dataset_size('DistributedSampler', ds, 2) end
  end
  if type(n) ~= 'number' or n < 0 or n ~= floor(n) then
    fail(2, 'DistributedSampler: n must be a non-negative integer (or give dataset =), got %s', describe_value(n))
  end
  local dr, dk = dist_defaults()
  local R, rank = o.num_replicas or dr, o.rank or dk
  if type(R) ~= 'number' or R < 1 or R ~= floor(R) then
    fail(2, 'DistributedSampler: num_replicas must be a positive integer, got %s', describe_value(R))
  end
  if type(rank) ~= 'number' or rank < 0 or rank >= R or rank ~= floor(rank) then
    fail(2, 'DistributedSampler: rank must be in 0..%d (0-based, as torch), got %s', R - 1, describe_value(rank))
  end
  local drop_last = o.drop_last and true or false
  local pad = o.pad ~= false
  if not pad and drop_last then fail(2, 'DistributedSampler: pad = false and drop_last = true contradict each other (pad = false keeps every sample once)') end
  local num_samples
  if not pad then num_samples = n > rank and ceil((n - rank) / R) or 0
  elseif drop_last and n % R ~= 0 then num_samples = ceil((n - R) / R) else num_samples = ceil(n / R) end
  if num_samples < 0 then num_samples = 0 end
  return setmetatable({ n = n, num_replicas = R, rank = rank, shuffle = o.shuffle ~= false, seed = o.seed or 0,
    drop_last = drop_last, pad = pad, num_samples = num_samples, total_size = pad and num_samples * R or n, epoch = 1 },
    DistributedSampler)
end

function DistributedSampler:set_epoch(e)
  if type(e) ~= 'number' or e ~= floor(e) or e < 0 then fail(2, 'set_epoch: epoch must be a non-negative integer, got %s', describe_value(e)) end
  if e ~= self.epoch then self.consumed, self.resume = 0, nil end
  self.epoch = e
end

function DistributedSampler:len() return self.num_samples end

-- This rank's sample indices (int64, 1-based) for `epoch` (default: the one set_epoch gave).
-- In the epoch a checkpoint resumed, when its cursor does not fall on a multiple of the ranks
-- (another world size), the rest of the epoch's order, split over these ranks.
function DistributedSampler:indices(epoch)
  epoch = epoch or self.epoch
  local order = data.order(self.n, { seed = self.seed, epoch = epoch, shuffle = self.shuffle })
  local pos, R, n = {}, self.num_replicas, self.n
  local r, first, count = self.resume, 0, self.num_samples
  if r and r.epoch == epoch and r.consumed % R ~= 0 then
    local left = math.max(self.total_size - r.consumed, 0)
    first, count = r.consumed, self.drop_last and floor(left / R) or ceil(left / R)
  end
  if count == 0 or n == 0 then return dlua.empty(0, { dtype = 'int64' }) end
  for k = 0, count - 1 do pos[k + 1] = (first + self.rank + k * R) % n + 1 end
  return order:index_select(1, dlua.tensor(pos, { dtype = 'int64' }))
end

-- Checkpoints (dlua.ckpt). The cursor is global: the samples of the epoch consumed by all ranks
-- (positions 1..consumed of its order), so a run resumed on another number of ranks splits the
-- rest of the epoch over them. advance(k): this rank took k more samples (every rank does).
function DistributedSampler:advance(k) self.consumed = (self.consumed or 0) + k * self.num_replicas end
function DistributedSampler:state_dict()
  return { epoch = self.epoch, consumed = self.consumed or 0, n = self.n, num_replicas = self.num_replicas, seed = self.seed,
    shuffle = self.shuffle, drop_last = self.drop_last }
end
function DistributedSampler:load_state_dict(sd)
  for _, k in ipairs({ 'n', 'seed', 'shuffle' }) do
    if sd[k] ~= self[k] then
      fail(2, 'DistributedSampler: the checkpoint was saved with %s = %s, this sampler has %s: the data order would differ',
        k, describe_value(sd[k]), describe_value(self[k]))
    end
  end
  self.epoch, self.consumed = sd.epoch, sd.consumed
  self.resume = sd.consumed > 0 and { epoch = sd.epoch, consumed = sd.consumed } or nil
end
-- The leading samples of indices(epoch) already consumed (0 outside the resumed epoch).
function DistributedSampler:skip(epoch)
  local r = self.resume
  if r and r.epoch == (epoch or self.epoch) and r.consumed % self.num_replicas == 0 then
    return math.min(r.consumed / self.num_replicas, self.num_samples)
  end
  return 0
end

function DistributedSampler:__tostring()
  return format('DistributedSampler(n=%d, rank %d of %d, %d samples, shuffle=%s, drop_last=%s)', self.n, self.rank,
    self.num_replicas, self.num_samples, tostring(self.shuffle), tostring(self.drop_last))
end

return data
