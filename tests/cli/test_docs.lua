-- The documentation is right: every relative link in README.md and docs/*.md resolves, and the README's one-liners print what it says.
-- usage: dlua tests/cli/test_docs.lua path/to/dlua
--
-- Links: `[text](path)` and `[text](path#anchor)` outside code; the file must exist (relative to the page)
-- and the anchor must be a heading of it, slugged as GitHub does. Examples: a `build/dlua ...` command in a
-- ```sh block of README.md is run from the tree's root (with `build/dlua` replaced by the dlua under test)
-- when the README says what it prints, either as the `# ...` lines right below it (the whole standard
-- output; lines tagged `[r]` may interleave between ranks, so each tag's lines are compared in order) or
-- as a trailing comment "# prints `X`" (the whole output is X). A .lua path a command names must exist.
local dlua_bin = assert(arg[1], 'usage: dlua tests/cli/test_docs.lua path/to/dlua')
local root = arg[0]:match('^(.*)/tests/cli/[^/]*$') or '.'

local passed, failed = 0, 0
local function ok(name) passed = passed + 1; print('ok   - ' .. name) end
local function fail(name, ...)
  failed = failed + 1
  print('FAIL - ' .. name)
  for _, l in ipairs({ ... }) do print('       ' .. tostring(l):gsub('\n', '\n       ')) end
end

local function read(path)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  return s
end

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local function lines_of(text)
  local t = {}
  for l in (text .. '\n'):gmatch('(.-)\r?\n') do t[#t + 1] = l end
  if t[#t] == '' then t[#t] = nil end
  return t
end

-- ---- markdown ------------------------------------------------------------------------------------

-- Walks a page: calls on_text(line, n) for lines outside fenced code, on_code(line, n, lang) inside.
local function walk(text, on_text, on_code)
  local fence, lang = nil, nil
  for n, line in ipairs(lines_of(text)) do
    local f = line:match('^%s*(```+)') or line:match('^%s*(~~~+)')
    if fence then
      if f and f:sub(1, 1) == fence:sub(1, 1) and #f >= #fence and line:match('^%s*[`~]+%s*$') then
        fence = nil
      elseif on_code then
        on_code(line, n, lang)
      end
    elseif f then
      fence, lang = f, line:match('^%s*[`~]+%s*([%w_+-]*)')
    elseif on_text then
      on_text(line, n)
    end
  end
end

-- GitHub's heading anchor: the heading's text as rendered (no markup), lower case, punctuation dropped
-- (letters, digits, '-', '_' and spaces stay), each space a '-'; a repeated slug gets -1, -2, ...
local function slug(heading)
  local s = heading:gsub('%s+#+%s*$', '')
  s = s:gsub('!?%[([^%]]*)%]%b()', '%1')      -- links and images: their text
  s = s:gsub('[`*]', '')
  s = s:lower()
  local out = {}
  local i = 1
  while i <= #s do
    local c = s:byte(i)
    local len = c < 0x80 and 1 or c >= 0xF0 and 4 or c >= 0xE0 and 3 or 2
    local ch = s:sub(i, i + len - 1)
    if len == 1 then
      if ch:match('[%w_%-]') then out[#out + 1] = ch
      elseif ch == ' ' then out[#out + 1] = '-' end
    elseif c < 0xE2 or c > 0xE2 then
      out[#out + 1] = ch                      -- letters of other alphabets (é, ß, ...)
    end                                       -- U+2000..U+2FFF: dashes, quotes, arrows, symbols
    i = i + len
  end
  return table.concat(out)
end

local anchors_cache = {}
local function anchors_of(path)
  if anchors_cache[path] then return anchors_cache[path] end
  local set, seen = {}, {}
  walk(read(path) or '', function(line)
    local h = line:match('^#+%s+(.-)%s*$')
    if h and line:match('^#######') == nil then
      local s = slug(h)
      local k = seen[s]
      seen[s] = (k or -1) + 1
      set[k and (s .. '-' .. (k + 1)) or s] = true
    end
  end)
  anchors_cache[path] = set
  return set
end

local function dirname(p) return p:match('^(.*)/[^/]*$') or '.' end

local function normalize(p)
  local parts = {}
  for part in p:gmatch('[^/]+') do
    if part == '..' and #parts > 0 and parts[#parts] ~= '..' then parts[#parts] = nil
    elseif part ~= '.' then parts[#parts + 1] = part end
  end
  return (p:sub(1, 1) == '/' and '/' or '') .. table.concat(parts, '/')
end

-- ---- links ----------------------------------------------------------------------------------------

local pages = { 'README.md' }
do
  local p = io.popen('cd ' .. shell_quote(root) .. ' && ls docs/*.md 2>/dev/null')
  for l in p:lines() do pages[#pages + 1] = l end
  p:close()
end

local nlinks = 0
for _, page in ipairs(pages) do
  local path = root .. '/' .. page
  local text = assert(read(path), 'cannot read ' .. path)
  walk(text, function(line, n)
    line = line:gsub('``.-``', ''):gsub('`[^`]*`', '')   -- code spans are not links
    for target in line:gmatch('%]%(([^%s%)]+)[^%)]*%)') do
      if not target:match('^%a[%w+.-]*:') then           -- http:, https:, mailto: are not checked here
        nlinks = nlinks + 1
        local file, anchor = target:match('^([^#]*)#?(.*)$')
        local where = string.format('%s:%d: (%s)', page, n, target)
        local resolved = file == '' and path or normalize(dirname(path) .. '/' .. file)
        if not exists(resolved) then
          fail(where .. ' resolves', 'no such file: ' .. resolved)
        elseif anchor ~= '' and resolved:match('%.md$') then
          if anchors_of(resolved)[anchor] then
            ok(where .. ' resolves')
          else
            local have = {}
            for a in pairs(anchors_of(resolved)) do have[#have + 1] = a end
            table.sort(have)
            fail(where .. ' resolves', 'no heading of ' .. resolved .. ' has the anchor #' .. anchor,
                 'anchors there: ' .. table.concat(have, ' '))
          end
        else
          ok(where .. ' resolves')
        end
      end
    end
  end)
end
if nlinks < 10 then fail('found the pages\' links', 'only ' .. nlinks .. ' relative links: is the parser broken?') end

-- ---- methods the Lua examples call ---------------------------------------------------------------

-- Every `x:name(` in a ```lua block names a method defined somewhere in the Lua tree (or a Lua string or
-- file method): a cheap net for examples that call what does not exist (`x:bfloat()` for `x:bfloat16()`).
do
  local known = {}
  local p = io.popen('cd ' .. shell_quote(root) .. ' && find lua bindings models recipes -name "*.lua"')
  for f in p:lines() do
    local src = read(root .. '/' .. f) or ''
    for n in src:gmatch('function%s+[%w_.:]-[.:]([%w_]+)%s*%(') do known[n] = true end
    for n in src:gmatch('([%w_]+)%s*=%s*function') do known[n] = true end
    for n in src:gmatch('[%w_%]]%.([%w_]+)%s*=') do known[n] = true end
    for n in src:gmatch('[\'"]([%w_]+)[\'"]') do known[n] = true end   -- names bound in loops: methods[name] = ...
  end
  p:close()
  for _, lib in ipairs({ string, table }) do for k in pairs(lib) do known[k] = true end end
  for k in pairs(getmetatable(io.stdout).__index) do known[k] = true end
  local calls = 0
  for _, page in ipairs(pages) do
    walk(read(root .. '/' .. page), nil, function(line, n, lang)
      if lang ~= 'lua' then return end
      local code = line:gsub("'[^']*'", "''"):gsub('"[^"]*"', '""'):gsub('%-%-.*$', '')
      for m in code:gmatch('[%w_%)%]]:([%a_][%w_]*)%s*[%(\'"{]') do
        calls = calls + 1
        if not known[m] then
          fail(string.format('%s:%d: the example calls :%s(), which exists', page, n, m), line)
        end
      end
    end)
  end
  if calls < 50 then fail('found the examples\' method calls', 'only ' .. calls) else ok(calls .. ' method calls in the Lua examples name defined methods') end
end

-- ---- the help's pointers to pages ----------------------------------------------------------------

do
  local p = io.popen(shell_quote(dlua_bin) .. ' -h')
  local help = p:read('*a')
  p:close()
  local n = 0
  for doc in help:gmatch('docs/[%w_%-]+%.md') do
    n = n + 1
    if exists(root .. '/' .. doc) then ok('dlua -h names ' .. doc .. ', which exists')
    else fail('dlua -h names ' .. doc .. ', which exists', 'no such file: ' .. root .. '/' .. doc) end
  end
  if n == 0 then fail('dlua -h points to a docs page', help) end
end

-- ---- the README's one-liners ---------------------------------------------------------------------

-- The command and its trailing comment: the first '#' outside quotes that follows a blank.
local function split_comment(line)
  local q, i = nil, 1
  while i <= #line do
    local c = line:sub(i, i)
    if q then
      if c == q then q = nil elseif c == '\\' and q == '"' then i = i + 1 end
    elseif c == "'" or c == '"' then
      q = c
    elseif c == '#' and (i == 1 or line:sub(i - 1, i - 1):match('%s')) then
      return (line:sub(1, i - 1):gsub('%s+$', '')), (line:sub(i + 1):gsub('^%s+', ''))
    end
    i = i + 1
  end
  return line, nil
end

-- Lines tagged "[r] " by rank (in order within a tag), the others in order, for comparing outputs.
local function by_tag(ls)
  local groups, order = {}, {}
  for _, l in ipairs(ls) do
    l = l:gsub('%s+$', '')
    local tag = l:match('^(%[[%d,%-]+%]) ') or ''
    if not groups[tag] then groups[tag] = {}; order[#order + 1] = tag end
    table.insert(groups[tag], l)
  end
  table.sort(order)
  local out = {}
  for _, tag in ipairs(order) do
    for _, l in ipairs(groups[tag]) do out[#out + 1] = l end
  end
  return table.concat(out, '\n')
end

local examples = {}   -- {cmd=, line=, want=lines or nil}
do
  local block, last = nil, nil
  walk(read(root .. '/README.md'), function() last = nil end, function(line, n, lang)
    if lang ~= 'sh' then last = nil; return end
    local expected = line:match('^#%s?(.*)$')
    if expected and last then
      last.want = last.want or {}
      table.insert(last.want, expected)
      return
    end
    local cmd, comment = split_comment(line)
    if cmd:match('^%S*build/dlua') or cmd:match('[|;&]%s*build/dlua') or cmd:match('^[%w_]+=%S*%s+build/dlua') then
      last = { cmd = cmd, line = n }
      local value = comment and comment:match('^prints `(.-)`')
      if value then last.want = { value }; last.trailing = true end
      examples[#examples + 1] = last
    elseif not expected then
      last = nil
    end
  end)
end

local ran = 0
local out_file = os.tmpname()
for _, ex in ipairs(examples) do
  local where = string.format('README.md:%d: %s', ex.line, ex.cmd)
  -- the scripts it names exist
  local unquoted = ex.cmd:gsub("'[^']*'", ''):gsub('"[^"]*"', '')
  for word in unquoted:gmatch('%S+') do
    if word:match('^[%w_.-]+/[%w_./-]*%.lua$') then
      if exists(root .. '/' .. word) then ok(where .. ': ' .. word .. ' exists')
      else fail(where .. ': ' .. word .. ' exists', 'no such file: ' .. root .. '/' .. word) end
    end
  end
  if ex.want then
    ran = ran + 1
    local cmd = ex.cmd:gsub('build/dlua', (shell_quote(dlua_bin):gsub('%%', '%%%%')))
    local sh = string.format('cd %s && timeout 120 bash -c %s </dev/null 2>%s; echo "rc=$?"',
                             shell_quote(root), shell_quote(cmd), shell_quote(out_file))
    local p = io.popen(sh)
    local got = p:read('*a')
    p:close()
    local rc = got:match('rc=(%d+)\n?$')
    got = got:gsub('rc=%d+\n?$', '')
    local err = read(out_file) or ''
    local want_s, got_s = by_tag(ex.want), by_tag(lines_of(got))
    if rc ~= '0' then
      fail(where, 'exit code ' .. tostring(rc), 'stdout: ' .. got, 'stderr: ' .. err)
    elseif want_s ~= got_s then
      fail(where, 'the README says it prints:', want_s, 'it printed:', got_s, 'stderr: ' .. err)
    else
      ok(where .. ' prints what the README says')
    end
  end
end
os.remove(out_file)
if ran < 4 then fail('the README\'s examples with outputs were found', 'only ' .. ran .. ' found') end

print(string.format('%d passed, %d failed', passed, failed))
os.exit(failed == 0 and 0 or 1)
