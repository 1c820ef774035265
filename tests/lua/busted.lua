-- Runs busted specs inside dlua: `dlua tests/lua/busted.lua spec.lua...` (as busted's own runner does).
-- Debian's busted lives under /usr/share/lua/5.1, its C helpers under the multiarch lib folder.
package.path = package.path .. ';/usr/share/lua/5.1/?.lua;/usr/share/lua/5.1/?/init.lua'
package.cpath = package.cpath .. ';/usr/lib/x86_64-linux-gnu/lua/5.1/?.so;/usr/local/lib/lua/5.1/?.so'
local ok, runner = pcall(require, 'busted.runner')
if not ok then
  io.stderr:write('dlua: busted is not installed (Debian package lua-busted): ', tostring(runner), '\n')
  os.exit(1)
end
-- busted ends a failing run under Lua 5.1 with error(nil) and lets the interpreter exit 1.
local ok2, err = pcall(runner, { standalone = false })
if not ok2 then
  if err ~= nil then io.stderr:write(tostring(err), '\n') end
  os.exit(1)
end
