-- route_emu_spec: cuda/moe.cu's router kernel on the CPU, under the SIMT emulation of
-- scripts/bench/route_emu (the kernel and the device helpers as the sources have them, one OS
-- thread per CUDA thread), against the host rule: the experts and weights of its one-warp top-k
-- (up to 512 experts: K2.6's 384, DeepSeek-V3's 256 in 8 groups) and of its block-wide one (640),
-- with tied choices, -inf choices, top 8 and top 32 and both normalisations, bit for bit. This
-- holds the kernel's logic in CI; spec/cuda_ops_spec.lua checks the MoE op against the CPU twin
-- on the GPU (#gpu).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local emu = require("helpers.emu")

describe("the router kernel under emulation", function()
  it("picks the host rule's experts and weights, one warp or the whole block", function()
    local rc, out = emu("scripts/bench/route_emu/run.sh")
    assert.are.equal(0, rc, out)
    local ok = 0
    for _ in out:gmatch("\nok ") do ok = ok + 1 end
    assert.are.equal(12, ok, out)
    assert.truthy(out:find("\n12 checks, 0 failed", 1, true), out)
  end)
end)
