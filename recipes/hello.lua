-- The smallest dlua program: versions, threads, and a bit of Lua (the main job until training lands).
local dlua = require 'dlua'

local v = dlua.versions()
print(string.format('dlua %s on %s, %s', v.dlua, v.luajit, v.cuda_build))
print(string.format('CPU threads: %d', dlua.get_num_threads()))

-- A tiny computation in Lua: the first primes, by a sieve.
local n, sieve, primes = 100, {}, {}
for i = 2, n do
  if not sieve[i] then
    primes[#primes + 1] = i
    for j = i * i, n, i do sieve[j] = true end
  end
end
print(string.format('%d primes below %d, the last %d', #primes, n, primes[#primes]))

-- And tensors, computed in C: fit y = X w by gradient descent on the squared error.
dlua.manual_seed(0)
local X = dlua.randn(256, 3)
local w_true = dlua.tensor({ 2.0, -1.0, 0.5 })
local y = X:matmul(w_true)
local w = dlua.zeros(3)
for _ = 1, 200 do
  local grad = X:t():matmul(X:matmul(w) - y) / 256
  w:sub_(grad, 0.5)
end
print('fitted weights', w, 'error', (w - w_true):norm():item())
