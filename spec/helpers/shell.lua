-- spec/helpers/shell.lua: run a shell command, returning its exit status and its output
-- (stdout and stderr together)
return function(cmd)
  local p = io.popen(cmd .. " 2>&1; echo \"__rc=$?\"")
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return rc, (out:gsub("__rc=%d+%s*$", ""))
end
