-- dlua.cuda: the no-device behaviour everywhere, and devices, streams, events and memory where a GPU is.
local dlua = require 'dlua'
local H = require 'tests.lua.dlua.tensor_helpers'

local cuda = dlua.cuda
local have = cuda.is_available()
local skip_reason = not have and ('no CUDA device available (' .. tostring(cuda.unavailable_reason()) .. ')') or nil
if not have then print('cuda_spec: device tests skipped: ' .. skip_reason) end

-- A device test: runs only with a GPU, else shows as pending with the reason.
local function gpu_it(name, fn)
  if have then it(name, fn) else pending(name .. ' (skipped: ' .. skip_reason .. ')') end
end

describe('dlua.cuda without a device', function()
  if have then
    pending('a CUDA device is present: the no-device behaviour cannot be observed here')
    return
  end

  it('loads lazily and reports no devices', function()
    assert.equals(cuda, require('dlua').cuda)
    assert.equals(cuda, require 'dlua.cuda')
    assert.is_false(cuda.is_available())
    assert.equals(0, cuda.device_count())
    assert.is_string(cuda.unavailable_reason())
    assert.is_true(#cuda.unavailable_reason() > 0)
  end)

  it("resolves device 'auto' to the CPU", function()
    assert.equals('cpu', cuda.resolve_device('auto'))
    assert.equals('cpu', cuda.resolve_device())
    assert.equals('cpu', cuda.resolve_device('cpu'))
    H.raises(function() cuda.resolve_device('cuda') end, "no CUDA device available for device 'cuda'", true)
  end)

  it('says why for every device call, at the caller', function()
    H.raises(function() cuda.set_device(0) end, 'set_device: no CUDA device available', true)
    H.raises(function() cuda.current_device() end, 'current_device: no CUDA device available', true)
    H.raises(function() cuda.synchronize() end, 'synchronize: no CUDA device available', true)
    H.raises(function() cuda.memory_stats() end, 'memory_stats: no CUDA device available', true)
    H.raises(function() cuda.memory_stats('pinned') end, 'memory_stats: no CUDA device available', true)
    H.raises(function() cuda.empty_cache() end, 'empty_cache: no CUDA device available', true)
    H.raises(function() cuda.Stream() end, 'Stream: no CUDA device available', true)
    H.raises(function() cuda.Event() end, 'Event: no CUDA device available', true)
    H.raises(function() cuda.current_stream() end, 'current_stream: no CUDA device available', true)
    -- the reason is the driver's or the build's, not a generic text
    H.raises(function() cuda.synchronize() end, cuda.unavailable_reason(), true)
  end)

  it('refuses to move tensors to CUDA', function()
    local t = dlua.tensor { 1, 2, 3 }
    H.raises(function() t:cuda() end, "cuda: no CUDA device available for device 'cuda'", true)
    H.raises(function() t:cuda(1) end, "no CUDA device available for device 'cuda:1'", true)
    H.raises(function() t:to('cuda:0') end, "to: no CUDA device available for device 'cuda:0'", true)
    H.raises(function() t:to { device = 'cuda' } end, 'to: no CUDA device available', true)
    H.raises(function() dlua.zeros(2, { device = 'cuda' }) end, 'zeros: no CUDA device available', true)
    H.raises(function() t:pin_memory() end, 'pin_memory: no CUDA device available', true)
    H.raises(function() t:to('gpu') end, "to: unknown device 'gpu'", true)
    -- the CPU paths are unchanged
    assert.equals(t, t:cpu())
    assert.equals(t, t:to('cpu'))
    assert.equals('cpu', t.device)
    assert.is_false(t.is_cuda)
  end)

  it('checks its arguments before the device', function()
    H.raises(function() cuda.with_stream(42, function() end) end, 'with_stream: expected a Stream, got number', true)
    H.raises(function() cuda.set_device(-1) end, 'set_device: expected a device number >= 0, got -1', true)
    H.raises(function() cuda.Event { colour = 1 } end, "Event: unknown option 'colour'", true)
  end)
end)

describe('dlua.cuda with a device', function()
  gpu_it('counts devices and switches between them', function()
    local n = cuda.device_count()
    assert.is_true(n >= 1)
    local cur = cuda.current_device()
    cuda.set_device(n - 1)
    assert.equals(n - 1, cuda.current_device())
    cuda.set_device(cur)
    assert.equals('cuda:' .. cur, cuda.resolve_device('auto'))
    H.raises(function() cuda.set_device(n) end, 'no device', true)
    cuda.synchronize()
  end)

  gpu_it('moves tensors to the device and back exactly', function()
    local t = dlua.arange(0, 1000, 1, { dtype = 'float32' }):view(10, 100)
    local g = t:cuda()
    assert.equals('cuda:' .. cuda.current_device(), g.device)
    assert.is_true(g.is_cuda)
    assert.equals(g, g:cuda())
    local back = g:cpu()
    assert.equals('cpu', back.device)
    for i = 1, 10 do
      for j = 1, 100 do assert.equals(t[i][j], back[i][j]) end
    end
    -- a transposed CPU tensor moves as it is (dense: its strides kept); dtype converts on the way
    local tt = t:t():to { device = 'cuda', dtype = 'float64' }:cpu()
    assert.equals('float64', tt.dtype)
    assert.equals(t[3][7], tt[7][3])
    local p = t:pin_memory()
    assert.equals(t[10][100], p[10][100])
    assert.is_true(cuda.memory_stats('pinned').allocated >= 4000)
  end)

  gpu_it("keeps the memory format, as PyTorch's .to() (preserve_format)", function()
    local function same_values(a, b)
      local d = (a:cpu():to('float64') - b:cpu():to('float64')):abs():max():item()
      assert.equals(0, d)
    end
    -- strides as torch 1.13 gives them for (2, 3, 4, 5) made channels-last, its slices, a transpose
    local x = dlua.randn(2, 3, 4, 5):contiguous('channels_last')
    for _, moved in ipairs({ x:cuda(), x:to('cuda'), x:to { device = 'cuda', non_blocking = true }, x:cuda():cuda(0) }) do
      cuda.synchronize()
      assert.same({ 60, 1, 15, 3 }, moved:stride())
      assert.is_true(moved:is_contiguous('channels_last'))
      same_values(x, moved)
    end
    local g = x:cuda()
    local back = g:cpu()
    assert.same({ 60, 1, 15, 3 }, back:stride())
    same_values(x, back)
    -- a dtype change on the way (on the CPU before the move, on the device after it): still channels-last
    local h = x:to { device = 'cuda', dtype = 'float16' }
    assert.equals('float16', h.dtype)
    assert.same({ 60, 1, 15, 3 }, h:stride())
    assert.same({ 60, 1, 15, 3 }, g:to { device = 'cpu', dtype = 'float64' }:stride())
    assert.same({ 60, 1, 15, 3 }, g:half():stride())
    assert.same({ 60, 1, 15, 3 }, g:to { copy = true }:stride())
    -- slices of a channels-last tensor (not dense): a channels-last copy of their own size
    local v = x:narrow(3, 2, 2)
    assert.same({ 30, 1, 15, 3 }, v:cuda():stride())
    same_values(v, v:cuda())
    local c = x:narrow(2, 2, 2)
    assert.same({ 40, 1, 10, 2 }, c:cuda():stride())
    assert.same({ 40, 1, 10, 2 }, c:cuda():cpu():stride())
    same_values(c, c:cuda())
    -- a transpose keeps its strides; a strided slice of a row-major tensor becomes row-major
    local t = dlua.randn(10, 100):t()
    assert.same({ 1, 100 }, t:cuda():stride())
    same_values(t, t:cuda())
    local r = dlua.randn(4, 6):narrow(2, 2, 3)
    assert.same({ 3, 1 }, r:cuda():stride())
    same_values(r, r:cuda())
    -- a row-major tensor stays row-major, a 0-d one and an empty one move too
    assert.same({ 60, 20, 5, 1 }, dlua.randn(2, 3, 4, 5):cuda():stride())
    assert.equals(3, dlua.tensor(3):cuda():cpu():item())
    assert.same({ 0, 3 }, dlua.empty(0, 3):cuda():size())
  end)

  gpu_it('creates tensors on the device that device= names, as torch.tensor(..., device=) does', function()
    local want = 'cuda:' .. cuda.current_device()
    local made = {
      tensor = dlua.tensor({ { 1, 2 }, { 3, 4 } }, { device = 'cuda' }),
      copy = dlua.tensor(dlua.ones(3), { device = 'cuda' }),
      arange = dlua.arange(5, { device = 'cuda' }),
      linspace = dlua.linspace(0, 1, 5, { device = 'cuda' }),
      eye = dlua.eye(3, { device = 'cuda' }),
      randperm = dlua.randperm(6, { device = 'cuda' }),
    }
    for name, t in pairs(made) do assert.equals(want, t.device, name) end
    assert.equals(4, made.tensor:cpu()[2][2])
    assert.equals(0.75, made.linspace:cpu()[4])
    assert.equals(1, made.eye:cpu()[3][3])
    -- a tensor of a tensor stays on its device unless device= says another
    assert.equals(want, dlua.tensor(made.arange).device)
    assert.equals('cpu', dlua.tensor(made.arange, { device = 'cpu' }).device)
  end)

  gpu_it('caches device memory: steady state needs no cudaMalloc', function()
    cuda.synchronize()
    local x = dlua.zeros(1) -- warm up the allocator for the CPU side
    for _ = 1, 3 do
      local a = dlua.empty(1024, 1024, { device = 'cuda' })
      a:free()
    end
    local before = cuda.memory_stats()
    for _ = 1, 50 do
      local a = dlua.empty(1024, 1024, { device = 'cuda' })
      local b = dlua.empty(3, 5, { device = 'cuda' })
      a:free(); b:free()
    end
    local after = cuda.memory_stats()
    assert.equals(before.num_raw_allocs, after.num_raw_allocs)
    assert.equals(before.num_allocs + 100, after.num_allocs)
    assert.is_true(after.reserved >= 4 * 2 ^ 20)
    cuda.empty_cache()
    assert.is_true(cuda.memory_stats().reserved <= after.reserved)
    x:free()
  end)

  gpu_it('reports out of memory with the request and the statistics', function()
    local err = H.raises(function() dlua.empty(2 ^ 50, { dtype = 'uint8', device = 'cuda' }) end, 'out of memory', true)
    assert.truthy(err:find('reserved', 1, true))
    assert.truthy(err:find('after emptying the cache', 1, true))
  end)

  gpu_it('moves a model with to(\'cuda\'): arena, optimizer state and a training step match the CPU', function()
    local nn, optim = require 'dlua.nn', require 'dlua.optim'
    dlua.manual_seed(3)
    local function net() return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)) end
    local a, b = net(), net()
    b:load_state_dict(a:state_dict())
    b:to('cuda')
    assert.equals('cuda:0', b:device())
    local oa = optim.SGD(a, { lr = 0.1, momentum = 0.9, weight_decay = 1e-2 })
    local ob = optim.SGD(b, { lr = 0.1, momentum = 0.9, weight_decay = 1e-2 })
    assert.equals('cuda:0', b:flatten().device)
    local x, y = dlua.randn(4, 6), dlua.randn(4, 3)
    local ca, cb = nn.MSELoss(), nn.MSELoss()
    for _ = 1, 3 do
      oa:zero_grad(); ob:zero_grad()
      local ya = a:forward(x)
      a:backward(x, ca:backward(ya, y))
      local yb = b:forward(x:cuda())
      b:backward(x:cuda(), cb:backward(yb, y:cuda()))
      oa:step(); ob:step()
    end
    for i, e in ipairs(a:named_parameters()) do
      local got = b:named_parameters()[i].param
      assert.equals('cuda:0', got.device)
      assert.is_true((got:cpu() - e.param):abs():max():item() < 1e-5, e.name)
    end
  end)

  -- Memory used by work on another stream is not handed out again before that work ran, without the
  -- record_stream calls PyTorch needs. (On the emulator streams run only when waited for, so a block reused too
  -- early gives a wrong value every time; on a GPU it is a race.)
  gpu_it('keeps freed memory from reuse while another stream may still use it', function()
    local n = 2 ^ 20
    local s = cuda.Stream()
    -- made on the default stream, read on s, freed, and the default stream allocates again
    local a = dlua.ones(n, { device = 'cuda' })
    cuda.synchronize()
    local b
    cuda.with_stream(s, function() b = a * 2 end)
    a:free()
    local c = dlua.full({ n }, 5, { device = 'cuda' })
    cuda.current_stream():synchronize() -- the default stream's fill runs before s's product
    s:synchronize()
    assert.equals(2, b:max():item())
    assert.equals(2, b:min():item())
    -- made on s (a prefetched batch), read on the default stream, freed, and s allocates again
    local p
    cuda.with_stream(s, function() p = dlua.full({ n }, 3, { device = 'cuda' }) end)
    s:synchronize()
    local q = p * 2
    p:free()
    local r
    cuda.with_stream(s, function() r = dlua.full({ n }, 7, { device = 'cuda' }) end)
    s:synchronize() -- s's fill runs before the default stream's product
    cuda.synchronize()
    assert.equals(6, q:max():item())
    assert.equals(6, q:min():item())
    b:free(); c:free(); q:free(); r:free()
    s:destroy()
  end)

  gpu_it('runs streams and events', function()
    local s = cuda.Stream()
    local e = cuda.Event { enable_timing = true }
    local e2 = cuda.Event { enable_timing = true }
    e:record(s)
    e2:record(s)
    e2:synchronize()
    assert.is_true(e:query())
    assert.is_true(e:elapsed_time(e2) >= 0)
    s:synchronize()
    assert.is_true(s:query())
    local s2 = cuda.Stream()
    s2:wait(s)
    s2:wait(e)
    local default = cuda.current_stream()
    local inside = cuda.with_stream(s, function(a) return cuda.current_stream() == s and a end, 7)
    assert.equals(7, inside)
    assert.equals(default, cuda.current_stream())
    -- an error inside restores the stream too
    assert.has_error(function() cuda.with_stream(s, function() error('boom') end) end)
    assert.equals(default, cuda.current_stream())
    s:destroy()
    H.raises(function() s:synchronize() end, 'the stream was destroyed', true)
  end)
end)
