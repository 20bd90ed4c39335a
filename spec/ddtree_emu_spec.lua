-- ddtree_emu_spec: cuda/ddtree.cu's kernels on the CPU, under the SIMT emulation of
-- scripts/bench/ddtree_emu (the kernels as the source has them, launched as kd_cuda_sample_rows
-- launches them), against the host rule kd_sample_row_code: rows of 8193 and 20000 ids, so the
-- max, mass and bins passes run over several blocks a row and the draw searches one slice; with
-- and without top-k / top-p (counts by bin, and masses by bin for top-p), min-p, ties, -inf, NaN
-- rows; the bins pass's counts and masses by bin against a host count (a wrong bin sum only sends
-- the cut to its radix fallback, so the draws alone would not show it); and the tree selection
-- (both of its paths: the parallel one, and one node at a time where the parallel one's
-- conditions fail) and the accept walk against kd_tree_select_host and the CPU walk.
-- spec/gpu_round_spec.lua checks the same kernels on the GPU (#gpu);
-- `scripts/bench/ddtree_emu/run.sh full` runs every setting by hand.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local emu = require("helpers.emu")

describe("the DDTree round kernels under emulation", function()
  it("draw the host rule's tokens on rows of several slices", function()
    local rc, out = emu("scripts/bench/ddtree_emu/run.sh", "slices")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("\nok: 120 checks, 0 fails", 1, true), out)
    assert.truthy(out:find("\nbins checked against the host: 66 rows", 1, true), out)
  end)

  it("select the host's trees (both selection paths) and walk them as the host does", function()
    local rc, out = emu("scripts/bench/ddtree_emu/run.sh", "trees")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("\nok: 432 checks, 0 fails", 1, true), out)
    -- most list kinds go through the parallel path; those that break its conditions (rounded sums,
    -- children above their parent, crowded ties) and the runs with it off go one node at a time
    local parallel = tonumber(out:match("\ntrees built by the parallel path: (%d+)"))
    assert.is_true(parallel ~= nil and parallel >= 55, out)
  end)
end)
