-- tree_emu_spec: cuda/tree.cu's argmax and top-k kernels on the CPU, under the SIMT emulation of
-- scripts/bench/tree_emu (the kernels and the device helpers as the sources have them, launched as
-- kd_cuda_argmax / kd_cuda_topk launch them, one OS thread per CUDA thread), against a plain sort:
-- rows split over several blocks (ties and bad columns in different ones), each row kind through
-- both candidate passes (a small k's slices, and the histograms and the gather: flat rows take the
-- second histogram), rows of several slices, rows of ties past every candidate slot (the radix
-- select), f32 and bf16. This holds the kernels' logic in CI; spec/cuda_ops_spec.lua checks them against
-- the CPU twin on the GPU (#gpu).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local emu = require("helpers.emu")

describe("the argmax and top-k kernels under emulation", function()
  it("give the plain sort's ids, values and bad-column codes", function()
    local rc, out = emu("scripts/bench/tree_emu/run.sh", "quick")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("\nargmax: 36 checks, 0 fails", 1, true), out)
    assert.truthy(out:find("\nok: 263 checks, 0 fails", 1, true), out)
    -- both ends of topk_kernel ran: the rows whose candidates fit and those left to the radix select
    assert.truthy(out:find("\ntop-k rows: 203 sorted from their candidates, 24 by the radix select", 1, true), out)
  end)
end)
