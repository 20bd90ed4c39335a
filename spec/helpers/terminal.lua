-- terminal: run a command on a pseudo-terminal (util-linux's `script`, which every Debian has),
-- typing each step's input once its cue has appeared. T.run(command, steps, env): `command` runs
-- under `script -qfec` with the environment assignments `env` (a string) and a 60 s limit; each
-- step waits until its `after` text (default "kd> ") has appeared `count` times in the output
-- (default: the step's index), and with `streamed` until that many more bytes follow its last
-- appearance, then types `send`. Returns (exit code, output without terminal escapes and
-- carriage returns, the raw output). `script` starts `$SHELL -c command`; the command is exec'd
-- so that it is the terminal's foreground process alone: dash (/bin/sh, what `script` uses where
-- SHELL is unset, as under CI) would otherwise wait in the same process group, die of a Ctrl-C
-- typed for the command, and make the status 130 whatever the command returned.
local T = {}

local function slurp(f) local h = assert(io.open(f, "rb")); local s = h:read("*a"); h:close(); return s end

function T.run(command, steps, env)
  local out = os.tmpname()
  local sh = { "wait_for() { n=0; while [ \"$(grep -a -o -F -- \"$1\" " .. out .. " | wc -l)\" -lt \"$2\" ]; do",
    "  n=$((n+1)); [ $n -gt 600 ] && exit 1; sleep 0.05; done; }",
    "wait_bytes() { at=$(grep -a -b -o -F -- \"$1\" " .. out .. " | tail -n 1 | cut -d: -f1); n=0;",
    "  while [ \"$(stat -c %s " .. out .. ")\" -lt $((at + ${#1} + $2)) ]; do",
    "  n=$((n+1)); [ $n -gt 600 ] && exit 1; sleep 0.05; done; }", "(" }
  for i, st in ipairs(steps) do
    local octal = st.send:gsub(".", function(c) return string.format("\\%03o", c:byte()) end)
    local after = st.after or "kd> "
    sh[#sh + 1] = string.format("wait_for %q %d; %sprintf '%s'", after, st.count or i,
      st.streamed and string.format("wait_bytes %q %d; ", after, st.streamed) or "", octal)
  end
  sh[#sh + 1] = "true ) | " .. (env or "") .. " timeout 60 script -qfec 'exec " .. command .. "' /dev/null > " .. out
    .. "; echo $?"
  local f = os.tmpname()
  local h = io.open(f, "w"); h:write(table.concat(sh, "\n"), "\n"); h:close()
  local p = io.popen("bash " .. f)
  local code = tonumber(p:read("*a"):match("(%d+)%s*$"))
  p:close()
  os.remove(f)
  local raw = slurp(out)
  os.remove(out)
  return code, (raw:gsub("\27%[[%?%d;]*%a", ""):gsub("\r", "")), raw
end

return T
