-- dlua.options: the options-table check that dlua's Lua functions share (an unknown name is an error naming the call, not ignored).
local M = {}
local format, concat, sort = string.format, table.concat, table.sort

-- The keys of a table, sorted (keys of one type: names, or numbers).
function M.sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  sort(keys)
  return keys
end

-- check(op, opts, allowed, level) -> opts ({} for nil). allowed: a set {name = true}; level as for error(), counted
-- from the caller of check (2: the function that called the one calling check).
function M.check(op, opts, allowed, level)
  if opts == nil then return {} end
  if type(opts) ~= 'table' then error(format('%s: expected an options table, got %s', op, type(opts)), level + 1) end
  for k in pairs(opts) do
    if not allowed[k] then
      error(format("%s: unknown option '%s' (expected %s)", op, tostring(k), concat(M.sorted_keys(allowed), ', ')), level + 1)
    end
  end
  return opts
end

return M
