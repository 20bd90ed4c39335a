-- mla_spec.lua: the tensor-core MLA attention (cuda/mla_tc.cuh) at Kimi K2.6 dims (64 query
-- heads, one latent KV head, key 576 = 512 + 64, value 512 = the first 512 cache columns),
-- through the op test surface (spec/c/kdtree_testing.h):
--   1. against the CPU twin (core/cpu/) on random bf16 inputs: decode T=1 over 4K context,
--      T=7 and T=64 causal across chunk boundaries (chunks of 512 ordinals), a 64-node tree
--      mask after 1100 committed rows (shared prefix chunks + per-query tail chunks), and
--      8 heads (8 queries share a block). Error = max |cuda - cpu| / max |cpu|, tolerance
--      5e-3 (bf16 outputs: one rounding is 2^-9 relative; P.V uses bf16 P, see mla_tc.cuh);
--      NaN never passes.
--   2. batch invariance on CUDA, bit for bit: a token's output decoded alone (T=1) == the
--      same token as row p of a T=64 causal prefill == the same token as a node of a 64-node
--      tree (its ancestors at scattered rows), at 64 heads and at 8 heads (after 1100 rows, and
--      after 8200, where the tree's shared chunks take 64-row blocks and its tail and the
--      decodes 16-row ones); and decode (16-row
--      blocks of 8 warps, value-split) == the same rows of a T=64 prefill (64-row blocks) at
--      1K, 20K and 40K context.
-- KDTREE_OPS_OTHER=cpu runs it CPU against CPU (a check of the harness on machines without a GPU).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local O = require("helpers.ops")
local ffi, C = O.ffi, O.C

local TOL = 5e-3
local HD, DV, SCALE = 576, 512, 0.1447

describe("MLA attention on tensor cores at K2.6 dims #gpu", function()
  local cpu, gpu
  local note, print_notes = O.notes("[mla] measured (cuda vs cpu twin; bit identity on cuda):")
  teardown(print_notes)
  setup(function()
    cpu = O.backend("cpu")
    gpu = O.backend(O.other_kind())
  end)

  -- attention of T queries (H heads) over S = past + T cache rows of the MLA layout
  local function att(tb, H, q, T, kv, S, past, causal, vis, out)
    return C.kd_test_attention(tb, q, T, H * HD, H, HD, kv, S, HD, nil, DV, 1, 1, past, causal, vis, 0, SCALE, H * DV, out)
  end

  -- visibility bits of a tree (parents[i] < i; -1: the root) and each node's path (node ids, ascending)
  local function tree(parents)
    local n = #parents
    local words = math.ceil(n / 64)
    local vis = ffi.new("uint64_t[?]", n * words)
    local paths = {}
    for i = 0, n - 1 do
      local p = parents[i + 1]
      local path = {}
      if p >= 0 then for _, j in ipairs(paths[p]) do path[#path + 1] = j end end
      path[#path + 1] = i
      paths[i] = path
      for _, j in ipairs(path) do
        local wi = i * words + math.floor(j / 64)
        vis[wi] = bit.bor(vis[wi], bit.lshift(1ULL, j % 64))
      end
    end
    return vis, paths
  end
  local function random_parents(n)
    local par = { -1 }
    for i = 1, n - 1 do
      par[i + 1] = (math.random() < 0.6) and (i - 1) or math.random(0, i - 1)
    end
    return par
  end

  local function compare(name, H, T, past, causal, vis, other)
    other = other or gpu
    local S = past + T
    local q = O.rand_floats(T * H * HD)
    local kv = O.rand_floats(S * HD)
    local n = T * H * DV
    local a, b = O.floats(n), O.floats(n)
    O.check(att(cpu, H, q, T, kv, S, past, causal, vis, a), "cpu")
    O.check(att(other, H, q, T, kv, S, past, causal, vis, b), "cuda")
    O.assert_close(note, string.format("%s (H=%d, T=%d, past=%d)", name, H, T, past), a, b, n, TOL)
  end

  it("matches the CPU twin: decode, causal across chunks, tree mask, 8 heads", function()
    O.seed(21)
    compare("decode over 4K context (8 chunks)", 64, 1, 4095, 1, nil)
    compare("causal T=7 across the chunk edge at 1536", 64, 7, 1530, 1, nil)
    compare("causal T=64 across the chunk edge at 2048", 64, 64, 1990, 1, nil)
    local vis = tree(random_parents(64))
    compare("tree mask, 64 nodes (2 shared chunks + tail)", 64, 64, 1100, 0, vis)
    compare("8 heads causal T=64 (8 queries per block)", 8, 64, 600, 1, nil)
    local vis8 = tree(random_parents(37))
    compare("8 heads tree mask, 37 nodes", 8, 37, 1500, 0, vis8)
  end)

  -- a token alone == row p of a T=64 prefill == a tree node (bit for bit, on the GPU), after P past rows
  local function invariance(H, P)
    local N = 64
    local parents = random_parents(N)
    local vis, paths = tree(parents)
    local pastrows = O.rand_floats(P * HD)
    local noderows = O.rand_floats(N * HD)
    local q = O.rand_floats(N * H * HD)
    local S = P + N
    local kv = ffi.new("float[?]", S * HD)
    ffi.copy(kv, pastrows, P * HD * 4)
    ffi.copy(kv + P * HD, noderows, N * HD * 4)
    -- the tree verify and the causal prefill of the same 64 rows
    local tree_out, pre_out = O.floats(N * H * DV), O.floats(N * H * DV)
    O.check(att(gpu, H, q, N, kv, S, P, 0, vis, tree_out), "tree")
    O.check(att(gpu, H, q, N, kv, S, P, 1, nil, pre_out), "prefill T=64")
    local checked = 0
    -- prefill rows: row p alone after P + p rows
    for _, p in ipairs({ 0, 1, 31, 37, 63 }) do
      local alone = O.floats(H * DV)
      O.check(att(gpu, H, q + p * H * HD, 1, kv, P + p + 1, P + p, 1, nil, alone), "alone")
      local same, at = O.same_bits(alone, pre_out + p * H * DV, H * DV)
      assert.is_true(same, string.format("H=%d: prefill row %d differs from decoding it alone at %s", H, p, tostring(at)))
      checked = checked + 1
    end
    -- tree nodes: the node alone after its ancestors, and as the last row of its path's prefill
    local deepest, dmax = 0, 0
    for i = 0, N - 1 do if #paths[i] > dmax then deepest, dmax = i, #paths[i] end end
    for _, i in ipairs({ 0, 5, 17, 40, N - 1, deepest }) do
      local path = paths[i]
      local d = #path
      local S2 = P + d
      local kv2 = ffi.new("float[?]", S2 * HD)
      ffi.copy(kv2, pastrows, P * HD * 4)
      for m, j in ipairs(path) do ffi.copy(kv2 + (P + m - 1) * HD, noderows + j * HD, HD * 4) end
      local alone = O.floats(H * DV)
      O.check(att(gpu, H, q + i * H * HD, 1, kv2, S2, S2 - 1, 1, nil, alone), "alone")
      local same, at = O.same_bits(alone, tree_out + i * H * DV, H * DV)
      assert.is_true(same, string.format("H=%d: tree node %d (depth %d) differs from decoding it alone at %s", H, i, d,
        tostring(at)))
      local qp = O.rand_floats(d * H * HD)
      ffi.copy(qp + (d - 1) * H * HD, q + i * H * HD, H * HD * 4)
      local pre = O.floats(d * H * DV)
      O.check(att(gpu, H, qp, d, kv2, S2, P, 1, nil, pre), "path prefill")
      same, at = O.same_bits(pre + (d - 1) * H * DV, tree_out + i * H * DV, H * DV)
      assert.is_true(same, string.format("H=%d: tree node %d differs from its path's prefill row at %s", H, i, tostring(at)))
      checked = checked + 2
    end
    note("%-62s bit-identical (%d checks, deepest node depth %d)",
      string.format("H=%d: alone == T=64 prefill row == tree node (past %d)", H, P), checked, dmax)
  end

  it("a token's output is bit-identical alone, in a T=64 prefill and as a tree node (64 heads)", function()
    O.seed(22)
    invariance(64, 1100)
  end)
  it("the same with 8 heads (several queries per block)", function()
    O.seed(23)
    invariance(8, 1100)
  end)
  -- on 132 SMs: the tree's shared chunks in 64-row blocks, its tail and the decodes (8 rows) in
  -- 16-row ones (mla_tc.cuh: tc_shape's half-full clause, tc_tail_shape)
  it("the same with 8 heads after an 8K past (64-row shared blocks, 16-row tail and decode blocks)", function()
    O.seed(26)
    invariance(8, 8200)
  end)

  -- every kernel choice of kd_model_options (the CUDA backend takes them at creation) matches
  -- the CPU twin on decode, a causal prefill and a tree mask
  it("each MLA kernel option (CUDA cores, value slices, row groups) matches the CPU twin", function()
    O.seed(25)
    local vis = tree(random_parents(40))
    for _, o in ipairs({ { mla_kernel = 1 }, { mla_value_slices = -1 }, { mla_value_slices = 1 },
                         { mla_value_slices = 2 }, { mla_value_slices = 4 }, { mla_row_groups = 1 },
                         { mla_row_groups = 4 } }) do
      local opts = ffi.new("kd_model_options")
      local what = {}
      for k, v in pairs(o) do opts[k] = v; what[#what + 1] = k .. "=" .. v end
      local alt = O.backend(O.other_kind(), opts)
      local tag = table.concat(what, " ")
      compare(tag .. ": decode over 2K context", 64, 1, 2047, 1, nil, alt)
      compare(tag .. ": causal T=64", 64, 64, 700, 1, nil, alt)
      compare(tag .. ": tree mask, 40 nodes", 8, 40, 900, 0, vis, alt)
    end
  end)

  -- decode takes 16-row blocks of 8 warps split into value slices (4 up to 16K context, 2 up
  -- to ~22K on 132 SMs; mla_value_slices = -1: the 2-warp blocks), then the 64-row blocks (the
  -- wide kernel), as a T=64 prefill does: a token alone == the same token as a prefill row, bit for bit
  it("decode at 1K / 20K / 40K context (4 / 2 value slices, 64-row blocks on 132 SMs) == the same rows of a T=64 prefill", function()
    O.seed(24)
    local H = 64
    for _, P in ipairs({ 1100, 20000, 40000 }) do
      local T = 64
      local S = P + T
      local q = O.rand_floats(T * H * HD)
      local kv = O.rand_floats(S * HD)
      local pre = O.floats(T * H * DV)
      O.check(att(gpu, H, q, T, kv, S, P, 1, nil, pre), "prefill T=64")
      for _, p in ipairs({ 0, 63 }) do
        local alone = O.floats(H * DV)
        O.check(att(gpu, H, q + p * H * HD, 1, kv, P + p + 1, P + p, 1, nil, alone), "alone")
        local same, at = O.same_bits(alone, pre + p * H * DV, H * DV)
        assert.is_true(same, string.format("past %d: prefill row %d differs from decoding it alone at %s", P, p,
          tostring(at)))
      end
      note("%-62s bit-identical (2 rows)", string.format("H=%d: decode alone == T=64 prefill row (past %d)", H, P))
    end
    compare("decode over 20K context (2 value slices)", H, 1, 20000, 1, nil)
  end)
end)
