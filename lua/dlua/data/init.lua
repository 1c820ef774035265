-- dlua.data: IDX files, Fashion-MNIST, in-memory datasets, batches, image folders, transforms, samplers and the threaded DataLoader.
-- One file per concern under lua/dlua/data/; each adds its public functions to the one table returned here.
local U = require 'dlua.data.util'

require 'dlua.data.files'       -- read_idx, read_mnist, read_image, write_jpeg, write_png
require 'dlua.data.batches'     -- order, num_batches, batches, augment, normalize
require 'dlua.data.transforms'  -- RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip, Normalize, ToTensor, Compose
require 'dlua.data.datasets'    -- TensorDataset, FashionMNIST, ImageFolder, Synthetic
require 'dlua.data.sampler'     -- DistributedSampler
require 'dlua.data.loader'      -- DataLoader

return U.data
