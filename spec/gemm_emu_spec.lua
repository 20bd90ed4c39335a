-- gemm_emu_spec: cuda/gemm.cuh's dense GEMM kernel on the CPU, under the fiber SIMT emulation of
-- scripts/bench/gemm_emu (ldmatrix, mma.sync and cp.async from their PTX definitions; a copy lands
-- only when a wait retires its group), against a CPU sum of the same rounding: k-major and [K, N]
-- weights, batched and grouped launches, the cp.async and plain-load paths, 1 to 11 splits summed
-- in split order by the tile's last block or by the second kernel (kd_cuda_gemm's rule, and both
-- forced on three shapes), the tile counters back at zero, weight pairs (linear_pair: the second
-- weight apart in memory) giving the stacked weight's bits, SwiGLU launches (linear_swiglu: each
-- output silu(g) * u of its rounded gate and up sums, by the tile epilogue, the last blocks or the
-- second kernel), and rows of M = 1, 37 and 100 bit-identical inside M = 130. This holds the kernel's indexing, pipeline and split-K in CI;
-- spec/cuda_ops_spec.lua and spec/batch_invariance_spec.lua check it on the GPU (#gpu).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local emu = require("helpers.emu")

describe("the dense GEMM kernel under emulation", function()
  it("gives the reference's bits, split or not, at every M", function()
    local rc, out = emu("scripts/bench/gemm_emu/run.sh")
    assert.are.equal(0, rc, out)
    local ok = 0
    for _ in out:gmatch("\nok ") do ok = ok + 1 end
    assert.are.equal(74, ok, out)
    assert.truthy(out:find("\n74 checks, 0 failed", 1, true), out)
  end)
end)
