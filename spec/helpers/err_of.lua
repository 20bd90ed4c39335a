-- spec/helpers/err_of.lua: err_of(f, ...) calls f(...), asserts that it raised, and returns the
-- error as a string (for the specs that match engine messages).
local assert = require("luassert")   -- busted's assert (a module does not see the spec's environment)

return function(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok, "expected an error")
  return tostring(e)
end
