-- spec/helpers/emu.lua: run one of the CUDA kernels' CPU emulations (scripts/bench/*_emu/run.sh)
-- against the engine's objects of the library under test, in a scratch folder removed after;
-- returns its exit status and its output, with a leading newline so that every line of it can
-- be found as "\n" .. line. The toolchain runs without a sanitizer runtime preloaded (make
-- test-asan preloads one into every process).
local sh = require("helpers.shell")

return function(script, mode)
  local lib = (os.getenv("KDTREE_LIB") or "build/libkdtree_test.so"):match("^(.*)/[^/]+$") or "build"
  local dir = os.tmpname()
  os.remove(dir)
  local rc, out = sh(string.format("env -u LD_PRELOAD EMU_LIB='%s' EMU_BUILD='%s' %s %s; s=$?; rm -rf '%s'; [ $s = 0 ]",
    lib, dir, script, mode or "", dir))
  return rc, "\n" .. out
end
