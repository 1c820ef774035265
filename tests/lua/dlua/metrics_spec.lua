-- dlua.metrics.Writer: a line per step with the phases' times adding up, DDP's communication wait split out, epochs, the summary.
local dlua = require 'dlua'
local metrics = require 'dlua.metrics'
local json = require 'dlua.json'

-- Busy-waits `s` seconds on the wall clock (sleep would need a C call; precision is what counts here).
local function spin(s)
  local t = dlua.perf_counter() + s
  while dlua.perf_counter() < t do end
end

local function lines_of(path)
  local r = {}
  for l in io.lines(path) do r[#r + 1] = json.decode(l) end
  return r
end

describe('dlua.metrics', function()
  it('writes a run line, a line per step whose phases add up to the step, epochs and a summary', function()
    local path = os.tmpname()
    -- a model whose communication wait grows as DDP's does (ddp.comm_wait_s)
    local fake = { comm_wait_s = 0 }
    local w = metrics.Writer(path, { model = fake, run = { recipe = 'spec', options = { batch = 4, name = 'x' } } })
    w:start_epoch(1)
    local t = dlua.zeros(1000)  -- memory held during the steps
    for s = 1, 3 do
      spin(0.004); w:phase('data')
      spin(0.006); w:phase('forward')
      spin(0.010); fake.comm_wait_s = fake.comm_wait_s + 0.003; spin(0.003); w:phase('backward')
      spin(0.002); w:phase('optimizer')
      w:step({ step = s, loss = 1 / s, lr = 0.1 * s, images = 8 })
    end
    w:epoch({ train_loss = 0.6, test_accuracy = 0.75 })
    w:close({ extra = 'yes' })
    t:free()
    local recs = lines_of(path)
    os.remove(path)
    assert.equals(6, #recs)
    assert.equals('run', recs[1].kind)
    assert.equals('spec', recs[1].recipe)
    assert.equals(4, recs[1].options.batch)
    assert.equals(dlua.get_num_threads(), recs[1].threads)
    for s = 1, 3 do
      local r = recs[1 + s]
      assert.equals('step', r.kind)
      assert.equals(s, r.step)
      assert.equals(1, r.epoch)
      assert.near(1 / s, r.loss, 1e-15)
      assert.near(0.1 * s, r.lr, 1e-15)
      -- the phases partition the step's time (other: what no phase claimed, here ~0)
      local sum = r.data_s + r.forward_s + r.backward_s + r.comm_s + r.optimizer_s + r.other_s
      assert.near(r.time_s, sum, 1e-9)
      assert.is_true(r.forward_s >= 0.006 and r.data_s >= 0.004 and r.optimizer_s >= 0.002)
      -- the 3 ms DDP counted went to comm, out of backward's 13 ms
      assert.near(0.003, r.comm_s, 1e-12)
      assert.is_true(r.backward_s >= 0.010)
      assert.near(8 / r.time_s, r.img_s, 1e-9)
      assert.is_true(r.mem_peak_bytes >= 4000 and r.mem_bytes >= 4000)
    end
    assert.equals('epoch', recs[5].kind)
    assert.equals(0.75, recs[5].test_accuracy)
    local s = recs[6]
    assert.equals('summary', s.kind)
    assert.equals(3, s.steps)
    assert.equals(24, s.images)
    local total = recs[2].time_s + recs[3].time_s + recs[4].time_s
    assert.near(total, s.seconds, 1e-9)
    assert.near(24 / total, s.img_s, 1e-9)
    assert.near(16 / (recs[3].time_s + recs[4].time_s), s.img_s_after_first, 1e-9)
    assert.near(0.003, s.comm_s, 1e-12)
    assert.equals(1, s.first_loss)
    assert.near(1 / 3, s.loss, 1e-15)
    assert.equals(0.75, s.test_accuracy)  -- the last epoch's fields
    assert.equals('yes', s.extra)
  end)

  it('measures each step\'s own memory peak', function()
    local path = os.tmpname()
    local w = metrics.Writer(path)
    w:start_epoch(1)
    local big = dlua.zeros(1048576)  -- 4 MiB alive only in step 1
    big:free()
    w:step({ step = 1 })
    w:step({ step = 2 })
    w:close()
    local recs = lines_of(path)
    os.remove(path)
    assert.is_true(recs[2].mem_peak_bytes - recs[3].mem_peak_bytes >= 4 * 2 ^ 20)
  end)

  it('gives ranks other than 0, and no file, a writer that writes nothing', function()
    local w = metrics.Writer('/nonexistent-dir/x.jsonl', { rank = 1 })
    assert.is_false(w.enabled)
    w:start_epoch(1); w:phase('data'); w:step({ loss = 1 }); w:epoch({}); w:close()
    assert.is_false(metrics.Writer('').enabled)
  end)

  it('names a bad phase, option or file', function()
    local path = os.tmpname()
    local w = metrics.Writer(path)
    assert.has_error(function() w:phase('fwd') end, nil)
    local ok, err = pcall(w.phase, w, 'fwd')
    assert.matches("unknown phase 'fwd'", err)
    w:close()
    os.remove(path)
    ok, err = pcall(metrics.Writer, path, { bogus = 1 })
    assert.matches("unknown option 'bogus'", err)
    ok, err = pcall(metrics.Writer, '/nonexistent-dir/x.jsonl')
    assert.is_false(ok)
    assert.matches('cannot write /nonexistent%-dir/x%.jsonl', err)
  end)

  it('reads a file back by kind', function()
    local path = os.tmpname()
    local w = metrics.Writer(path, { run = { label = 'L' } })
    w:step({ step = 1, loss = 2 })
    w:epoch({ epoch = 1 })
    w:close()
    local r = metrics.read(path)
    os.remove(path)
    assert.equals('L', r.run.label)
    assert.equals(1, #r.steps)
    assert.equals(2, r.steps[1].loss)
    assert.equals(1, #r.epochs)
    assert.equals(1, r.summary.steps)
  end)
end)
