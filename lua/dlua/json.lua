-- dlua.json: encode/decode through cJSON (bindings/json.lua), and JSON Lines files read record by record.
local binding = require 'bindings.json'

local json = { null = binding.null, array = binding.array, encode = binding.encode, decode = binding.decode,
  available = binding.available }

-- json.read_lines(path): the records of a JSON Lines file (one value per non-blank line), in order.
-- A bad line is an error naming the file and the line.
function json.read_lines(path)
  local f, err = io.open(path, 'rb')
  if not f then error(('json.read_lines: cannot open %s'):format(err), 2) end
  local records, n = {}, 0
  for line in f:lines() do
    n = n + 1
    if line:find('%S') then
      local ok, v = pcall(binding.decode, line)
      if not ok then
        f:close()
        error(('json.read_lines: %s:%d: %s'):format(path, n, tostring(v):gsub('^json%.decode: ', '')), 2)
      end
      records[#records + 1] = v
    end
  end
  f:close()
  return records
end

return json
