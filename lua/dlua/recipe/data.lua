-- dlua.recipe.data: train{}'s data: the built-in Fashion-MNIST (resized, grey or RGB) or an ImageFolder, each rank's share through a DistributedSampler.
local dlua = require 'dlua'
local data = require 'dlua.data'
local loader = require 'dlua.recipe.loader'

local M = {}

-- build(c, replica, replicas, device) -> {train = loader (:batches(epoch), :len()), sampler, eval = loader,
-- train_len (samples per replica per epoch), classes, channels, image_size, name}. Augmentation and
-- the data order go by the replica (a pipeline's ranks share theirs).
function M.build(c, replica, replicas, device)
  local d = c.data
  local D = {}
  if d.train ~= nil then  -- the caller's own loaders
    D.name, D.classes, D.train, D.eval, D.sampler = 'data.train', d.classes, d.train, d.eval, d.sampler
    D.channels, D.image_size = d.channels > 0 and d.channels or 1, d.image_size
  elseif d.source == 'fashion_mnist' then
    local root = d.root ~= '' and d.root or nil
    local train = data.FashionMNIST({ root = root, train = true })
    local test = data.FashionMNIST({ root = root, train = false })
    if d.limit > 0 and d.limit < train:size() then train = train:narrow(1, d.limit) end
    if d.eval_limit > 0 and d.eval_limit < test:size() then test = test:narrow(1, d.eval_limit) end
    D.name, D.classes = 'Fashion-MNIST (built in)', 10
    D.channels = d.channels > 0 and d.channels or 1
    D.image_size = d.image_size > 0 and d.image_size or 28
    local size = D.image_size ~= 28 and D.image_size or nil
    local channels = D.channels ~= 1 and D.channels or nil
    local mf = d.channels_last and 'channels_last' or 'contiguous'
    D.sampler = data.DistributedSampler({ n = train:size(), shuffle = true, seed = c.seed, drop_last = true,
      num_replicas = replicas, rank = replica })
    D.train = loader.MemoryLoader({ dataset = train, sampler = D.sampler, batch = d.batch, drop_last = true,
      seed = c.seed * 1000 + replica, augment = d.augment and { crop_pad = 2, flip = true } or nil, size = size,
      channels = channels, memory_format = mf })
    -- evaluation: replica r takes samples r+1, r+1+replicas, ... (no padding, so nothing counts twice)
    local vs = data.DistributedSampler({ n = test:size(), shuffle = false, pad = false, num_replicas = replicas, rank = replica })
    D.eval = loader.MemoryLoader({ dataset = test, sampler = vs, batch = d.eval_batch, mean = train.mean, std = train.std,
      size = size, channels = channels, memory_format = mf })
  else
    D.name = d.source
    local size = d.image_size > 0 and d.image_size or 224
    D.image_size, D.channels = size, 3
    local mean, std = { 0.485, 0.456, 0.406 }, { 0.229, 0.224, 0.225 }
    -- (N, C, H, W) batches; channels-last memory straight from the loader's workers (no copy)
    local to_tensor = data.ToTensor({ memory_format = d.channels_last and 'channels_last' or 'contiguous' })
    local function centre() return data.Compose({ data.Resize(math.floor(size * 256 / 224 + 0.5)), data.CenterCrop(size), to_tensor,
      data.Normalize(mean, std) }) end
    local train = data.ImageFolder(d.source .. '/train', { transform = d.augment and data.Compose({
      data.RandomResizedCrop(size), data.RandomHorizontalFlip(), to_tensor, data.Normalize(mean, std) }) or centre() })
    local val = data.ImageFolder(d.source .. '/val', { transform = centre() })
    D.classes = #train.classes
    -- --limit: a fixed random part of the folder (its first N would hold only the first classes)
    local function part(ds, limit, seed, make)
      if limit <= 0 or limit >= ds.n then return make(ds.n), nil end
      local subset = data.order(ds.n, { seed = seed, epoch = 0, shuffle = true }):narrow(1, 1, limit)
      return loader.SubsetSampler(make(limit), subset, ds.n)
    end
    D.sampler = part(train, d.limit, c.seed, function(n)
      return data.DistributedSampler({ n = n, shuffle = true, seed = c.seed, drop_last = true, num_replicas = replicas, rank = replica })
    end)
    local vsampler = part(val, d.eval_limit, c.seed, function(n)
      return data.DistributedSampler({ n = n, shuffle = false, pad = false, num_replicas = replicas, rank = replica })
    end)
    local tl = data.DataLoader({ dataset = train, batch = d.batch, sampler = D.sampler, workers = d.workers,
      drop_last = true, seed = c.seed, pin_memory = true, device = device })
    local batch = d.batch
    D.train = {  -- the loader skips a resumed epoch's consumed samples; batch numbers go on
      len = function() return tl:len() end,
      batches = function(_, epoch)
        local first = math.floor(D.sampler:skip(epoch) / batch)
        tl:set_epoch(epoch)
        local it = tl:batches()
        return function()
          local i, x, y = it()
          if i == nil then return nil end
          return first + i, x, y
        end
      end,
    }
    local vl = data.DataLoader({ dataset = val, batch = d.eval_batch, sampler = vsampler, workers = d.workers, device = device })
    D.eval = { batches = function() return vl:batches() end }
  end
  D.train_len = D.sampler:len()
  return D
end

return M
