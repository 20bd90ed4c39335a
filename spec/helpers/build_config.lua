-- spec/helpers/build_config.lua: the make variables that reproduce the configuration of a build
-- directory (its config.stamp: CUDA and the sanitizers), so that a spec that runs make against the
-- build under test finds it up to date instead of rebuilding it in another configuration (under
-- `make test-asan`, a plain `make BUILD=build/asan` would replace the instrumented library mid-suite)
return function(build)
  local f = assert(io.open(build .. "/config.stamp"), "no " .. build .. "/config.stamp: run make")
  local stamp = f:read("*l")
  f:close()
  local cuda = assert(stamp:match("^CUDA=(%d)"), "config.stamp: no CUDA= field: " .. stamp)
  local san = assert(stamp:match(" SAN=(.-) CFLAGS="), "config.stamp: no SAN= field: " .. stamp)
  return string.format("CUDA=%s SAN='%s'", cuda, san)
end
