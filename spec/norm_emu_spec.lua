-- norm_emu_spec: cuda/norm_rope.cu's fused kernels on the CPU, under the SIMT emulation of
-- scripts/bench/norm_emu (the kernels and the device helpers as the sources have them, one OS
-- thread per CUDA thread): add_rmsnorm_kernel must give the bits of scale_add_kernel followed by
-- rmsnorm_kernel at K2.6's width and at widths that do not fill a block, with bf16 and fp32
-- addends (an fp32 addend, a rank's partial sums, added as its bf16: the bits of a bf16 addend),
-- and the CPU twin's values within bf16 rounding; mla_rope_store_kernel the bits of
-- rmsnorm_kernel and rope_kernel (K2.6, a TP-8 rank's heads, tiny dims; host and device length),
-- written where the op says; move_rows_kernel the moves of a commit's compaction in the order of
-- their rows (16-byte words and bytes, a launch's 64 caches). This holds the kernels' logic and
-- reduction order in CI;
-- spec/cuda_ops_spec.lua checks the same on the GPU (#gpu).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local emu = require("helpers.emu")

describe("the fused norm kernels under emulation", function()
  it("give the bits of the ops they replace, and the CPU twin's values", function()
    local rc, out = emu("scripts/bench/norm_emu/run.sh")
    assert.are.equal(0, rc, out)
    local ok = 0
    for _ in out:gmatch("\nok ") do ok = ok + 1 end
    assert.are.equal(17, ok, out)
    assert.truthy(out:find("\n24 checks, 0 failed", 1, true), out)
  end)
end)
