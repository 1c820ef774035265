-- Writes random images and labels in Fashion-MNIST's file format (uncompressed idx) into a folder, for
-- machines without Debian's dataset-fashion-mnist (the GPU machine): DLUA_FASHION_MNIST_ROOT=<dir>.
-- usage: dlua tests/data/fake_fashion_mnist.lua <dir> [train images, default 2048] [test images, default 512]
local dir = assert(arg[1], 'usage: fake_fashion_mnist.lua <dir> [ntrain] [ntest]')
local function be32(n)
  return string.char(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
end
math.randomseed(7)
for _, set in ipairs({ { 'train', tonumber(arg[2]) or 2048 }, { 't10k', tonumber(arg[3]) or 512 } }) do
  local name, n = set[1], set[2]
  local f = assert(io.open(dir .. '/' .. name .. '-images-idx3-ubyte', 'wb'))
  f:write(be32(2051), be32(n), be32(28), be32(28))
  for _ = 1, n do
    local px = {}
    for i = 1, 784 do px[i] = string.char(math.random(0, 255)) end
    f:write(table.concat(px))
  end
  f:close()
  f = assert(io.open(dir .. '/' .. name .. '-labels-idx1-ubyte', 'wb'))
  f:write(be32(2049), be32(n))
  local labels = {}
  for i = 1, n do labels[i] = string.char(i % 10) end
  f:write(table.concat(labels))
  f:close()
end
