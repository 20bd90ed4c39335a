-- tree_emu_spec: cuda/tree.cu's argmax and top-k kernels on the CPU, under the SIMT emulation of
-- scripts/bench/tree_emu (the kernels and the device helpers as the sources have them, launched as
-- kd_cuda_argmax / kd_cuda_topk launch them, one OS thread per CUDA thread), against a plain sort:
-- rows split over several blocks (ties and bad columns in different ones), flat rows that take the
-- second histogram and the gather, rows of ties past every candidate slot (the radix select),
-- f32 and bf16. This holds the kernels' logic in CI; spec/cuda_ops_spec.lua checks them against
-- the CPU twin on the GPU (#gpu).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local sh = require("helpers.shell")

describe("the argmax and top-k kernels under emulation", function()
  it("give the plain sort's ids, values and bad-column codes", function()
    -- the engine's objects of the library under test; the toolchain runs without a sanitizer
    -- runtime preloaded (make test-asan preloads one into every process)
    local lib = (os.getenv("KDTREE_LIB") or "build/libkdtree_test.so"):match("^(.*)/[^/]+$") or "build"
    local dir = os.tmpname()
    os.remove(dir)
    local rc, out = sh(string.format("env -u LD_PRELOAD EMU_LIB='%s' EMU_BUILD='%s' scripts/bench/tree_emu/run.sh quick; "
      .. "s=$?; rm -rf '%s'; [ $s = 0 ]", lib, dir, dir))
    assert.are.equal(0, rc, out)
    assert.truthy(("\n" .. out):find("\nargmax: 36 checks, 0 fails", 1, true), out)
    assert.truthy(out:find("\nok: 139 checks, 0 fails", 1, true), out)
  end)
end)
