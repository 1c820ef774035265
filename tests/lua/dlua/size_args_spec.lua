-- Shape arguments of the creation functions under the JIT: hot loops mixing every calling form.
local dlua = require 'dlua'

-- LuaJIT 2.1 before 2023-08 (Debian's 2.1.0~beta3+git20220320 included) miscompiled a single-value
-- read of varargs (`local first = ...`, LuaJIT issue #1046): once the shape parser was traced,
-- dlua.empty({ n }, { dtype = ... }) now and then read the options table as the shape and made a
-- 0-d tensor. dist's collectives then saw 1 element where n were meant (tests/dist/collectives.lua
-- failed 2 runs in 3, and a rank died in gloo on a 2-byte receive meeting a 2018-byte message).
describe('shape arguments', function()
  it('keep their meaning in a hot loop that mixes the calling forms', function()
    local bad = {}
    -- Which traces form varies between runs; each round starts from none, for eight chances.
    for round = 1, 8 do
    jit.flush()
    for it = 1, 5000 do
      local k, n = it % 7, it % 3
      local t, want
      if k == 0 then t, want = dlua.empty({ n }, { dtype = 'float32' }), { n }
      elseif k == 1 then t, want = dlua.empty(3, 4), { 3, 4 }
      elseif k == 2 then t, want = dlua.empty({ 2, 3 }), { 2, 3 }
      elseif k == 3 then t, want = dlua.empty(5, { dtype = 'int64' }), { 5 }
      elseif k == 4 then t, want = dlua.empty({ 1009 }, { dtype = 'int64' }), { 1009 }
      elseif k == 5 then t, want = dlua.empty({}), {}
      else t, want = dlua.zeros(7), { 7 } end
      local got = t:size()
      if #got ~= #want or (got[1] or -1) ~= (want[1] or -1) or (got[2] or -1) ~= (want[2] or -1) then
        bad[#bad + 1] = string.format('round %d iteration %d (form %d): got (%s), expected (%s)', round, it, k,
          table.concat(got, ', '), table.concat(want, ', '))
      end
    end
    end
    assert.same({}, bad)
  end)
end)
