-- op_coverage_spec: the compute ops are listed once, in core/backend.h's KD_BACKEND_OPS, and every
-- backend implements every one of them. This spec holds the list to that promise: each backend's
-- table has an entry for each op, and each op has a place where the CUDA backend is compared with
-- its CPU twin (WHERE below). Adding an op to the list fails here until WHERE names that place;
-- a place that no longer holds its comparison fails too.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local B = require("helpers.backend")
local util = require("kdtree.util")

-- op -> the #gpu spec that compares CUDA with the CPU twin, and the text there that runs the op
-- (spec/c's kd_test_* wrappers call the op of the same name on the backend they are given)
local OPS_SPEC, ROUND_SPEC, GRAPHS_SPEC = "spec/cuda_ops_spec.lua", "spec/gpu_round_spec.lua", "spec/graphs_spec.lua"
local WHERE = {
  copy = { OPS_SPEC, "C.kd_test_copy(" },
  embed = { OPS_SPEC, "C.kd_test_embed(" },
  add = { OPS_SPEC, "C.kd_test_add(tb, x, y, r, c, 0, 0, out)" },
  scale_add = { OPS_SPEC, "C.kd_test_add(tb, x, y, r, c, 0.37, 1, out)" },
  swiglu = { OPS_SPEC, "C.kd_test_swiglu(" },
  rmsnorm = { OPS_SPEC, "C.kd_test_rmsnorm(" },
  add_rmsnorm = { OPS_SPEC, "C.kd_test_add_rmsnorm(" },
  rope = { OPS_SPEC, "C.kd_test_rope(" },
  mla_rope_store = { OPS_SPEC, "C.kd_test_mla_rope_store(" },
  gather_rows = { OPS_SPEC, "C.kd_test_gather_rows(" },
  move_rows = { OPS_SPEC, "C.kd_test_move_rows(" },
  linear = { OPS_SPEC, "C.kd_test_linear(" },
  linear_pair = { OPS_SPEC, "C.kd_test_linear_pair(" },
  linear_swiglu = { OPS_SPEC, "C.kd_test_linear_swiglu(" },
  head_matmul = { OPS_SPEC, "C.kd_test_head_matmul(" },
  attention = { OPS_SPEC, "C.kd_test_attention(" },
  moe = { OPS_SPEC, "C.kd_test_moe(" },
  log_softmax = { OPS_SPEC, "C.kd_test_log_softmax(" },
  argmax = { OPS_SPEC, "C.kd_test_argmax(" },
  topk = { OPS_SPEC, "C.kd_test_topk(" },
  -- the device-length ops: mode "eager" runs every step through them, against mode "off" (the
  -- host-length ops) with the same bits, on CUDA and on the CPU
  store_rows_at = { GRAPHS_SPEC, 'local MODES = { "eager", "on" }' },
  attention_at = { GRAPHS_SPEC, 'local MODES = { "eager", "on" }' },
  tree_select = { ROUND_SPEC, "C.kd_test_dd_tree(" },
  tree_stage = { ROUND_SPEC, "C.kd_test_dd_walk(" },
  sample_rows = { ROUND_SPEC, "C.kd_test_dd_sample(" },
  tree_walk = { ROUND_SPEC, "C.kd_test_dd_walk(" },
}

local function slurp(f) local h = assert(io.open(f, "rb")); local s = h:read("*a"); h:close(); return s end

local function check_table(be)
  local name = B.ffi.string(be.ops.name)
  for _, op in ipairs(B.ops) do assert.is_true(be.ops[op.name] ~= nil, name .. "'s table has no " .. op.name) end
end

describe("the op list of core/backend.h", function()
  -- the FFI's op table (spec/helpers/backend.lua parses the list) against the compiler's expansion:
  -- the same ops in the same order, so a table entry the FFI calls is the one C filled
  it("reads as the compiler expands it: the same ops in the same order, each once", function()
    local compiled, seen = {}, {}
    for i = 0, 99 do
      local p = B.C.kd_test_op_name(i)
      if p == nil then break end
      compiled[#compiled + 1] = B.ffi.string(p)
    end
    local parsed = {}
    for _, op in ipairs(B.ops) do
      assert.is_nil(seen[op.name], op.name .. " listed twice")
      seen[op.name] = true
      parsed[#parsed + 1] = op.name
    end
    assert.are.same(compiled, parsed)
    assert.is_true(#parsed >= 21)
  end)

  it("every op is in the CPU backend's table", function() check_table(B.create("cpu")) end)

  it("every op has a comparison of CUDA with its CPU twin, and WHERE names only listed ops", function()
    local listed = {}
    for _, op in ipairs(B.ops) do
      listed[op.name] = true
      local w = WHERE[op.name]
      assert.is_not_nil(w, op.name .. ": no spec compares it on CUDA (add it to WHERE)")
      local text = slurp(w[1])
      assert.truthy(text:find(w[2], 1, true), op.name .. ": '" .. w[2] .. "' is not in " .. w[1])
      assert.truthy(text:find("#gpu", 1, true), w[1] .. " has no #gpu part")
    end
    for name in pairs(WHERE) do assert.is_true(listed[name] == true, "WHERE names " .. name .. ", not an op") end
  end)
end)

describe("the op list on the GPU #gpu", function()
  it("every op is in the CUDA backend's table", function()
    assert.are_not.equal(0, B.C.kd_backend_available(util.BACKENDS.cuda), "no CUDA backend here")
    check_table(B.create("cuda"))
  end)
end)
