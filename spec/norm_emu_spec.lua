-- norm_emu_spec: cuda/norm_rope.cu's add_rmsnorm_kernel on the CPU, under the SIMT emulation of
-- scripts/bench/norm_emu (the kernel and the device helpers as the sources have them, one OS
-- thread per CUDA thread): it must give the bits of scale_add_kernel followed by rmsnorm_kernel at
-- K2.6's width and at widths that do not fill a block, with bf16 and fp32 addends, and the CPU
-- twin's values within bf16 rounding. This holds the fused kernel's logic and reduction order in
-- CI; spec/cuda_ops_spec.lua checks the same on the GPU (#gpu).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local emu = require("helpers.emu")

describe("the fused residual + RMSNorm kernel under emulation", function()
  it("gives the bits of the add followed by the norm, and the CPU twin's values", function()
    local rc, out = emu("scripts/bench/norm_emu/run.sh")
    assert.are.equal(0, rc, out)
    local ok = 0
    for _ in out:gmatch("\nok ") do ok = ok + 1 end
    assert.are.equal(5, ok, out)
    assert.truthy(out:find("\n10 checks, 0 failed", 1, true), out)
  end)
end)
