-- ddtree_emu_spec: cuda/ddtree.cu's sampling kernels on the CPU, under the SIMT emulation of
-- scripts/bench/ddtree_emu (the kernels as the source has them, launched as kd_cuda_sample_rows
-- launches them), against the host rule kd_sample_row_code: rows of 8193 and 20000 ids, so the
-- max, mass and bins passes run over several blocks a row and the draw searches one slice; with
-- and without top-k / top-p (counts by bin, and masses by bin for top-p), min-p, ties, -inf, NaN
-- rows. spec/gpu_round_spec.lua checks the same
-- kernels on the GPU (#gpu); `scripts/bench/ddtree_emu/run.sh full` runs every setting by hand.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local sh = require("helpers.shell")

describe("the sampling kernels under emulation", function()
  it("draw the host rule's tokens on rows of several slices", function()
    local lib = (os.getenv("KDTREE_LIB") or "build/libkdtree_test.so"):match("^(.*)/[^/]+$") or "build"
    local dir = os.tmpname()
    os.remove(dir)
    local rc, out = sh(string.format("env -u LD_PRELOAD EMU_LIB='%s' EMU_BUILD='%s' scripts/bench/ddtree_emu/run.sh slices; "
      .. "s=$?; rm -rf '%s'; [ $s = 0 ]", lib, dir, dir))
    assert.are.equal(0, rc, out)
    assert.truthy(("\n" .. out):find("\nok: 100 checks, 0 fails", 1, true), out)
  end)
end)
