-- memory_spec.lua: kd_model_memory / m:memory(), the model's memory by component.
-- References: kd_inspect's bytes by kind (read from the safetensors headers by the loader,
-- independently of the loaded weights), the file sizes and tensor bytes of the checkpoints,
-- and the KV cache formula capacity x layers x (kv_lora_rank + qk_rope_dim) x activation
-- dtype size.
-- Runs on the suite's backend (KDTREE_BACKEND, default cpu): both backends tally drafter weights
-- and caches and their workspaces; the CUDA one also reports the device totals.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local err_of = require("helpers.err_of")
local ffi = require("ffi")
local ck = require("helpers.checkpoint")

local BACKEND = os.getenv("KDTREE_BACKEND") or "cpu"
local ACT = BACKEND == "cuda" and 2 or 4   -- bytes of an activation: bf16 / f32
local TARGETS = {
  -- INT4 experts: each expert matrix also has a weight_shape tensor (I64 [2], 16 bytes) that
  -- inspect counts and no backend holds
  { dir = "models/tiny-k2.6", files = { "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors" },
    int4 = true },
  { dir = "spec/fixtures/tiny-dsv3", files = { "model.safetensors" } },
}
local WEIGHT_KINDS = {
  { "weights_attention", "bytes_attention" }, { "weights_dense_mlp", "bytes_dense_mlp" },
  { "weights_shared_experts", "bytes_shared_experts" }, { "weights_routed_experts", "bytes_routed_experts" },
  { "weights_router", "bytes_router" }, { "weights_embed", "bytes_embed" },
  { "weights_lm_head", "bytes_lm_head" }, { "weights_norms", "bytes_norms" },
}

local function file_size(path)
  local f = assert(io.open(path, "rb"))
  local n = f:seek("end")
  f:close()
  return n
end

local function parts(r)
  return r.weights_total + r.drafter_weights + r.kv_cache + r.activations + r.drafter_cache + r.trees + r.workspace +
    r.other
end

local function kv_bytes(info, capacity)
  return capacity * info.n_layers * (info.kv_lora_rank + info.qk_rope_dim) * ACT
end

describe("memory by component (kd_model_memory)", function()
  for _, T in ipairs(TARGETS) do
    describe(T.dir .. " on " .. BACKEND, function()
      local m, ins
      setup(function()
        m = kd.open_model(T.dir, { backend = BACKEND })
        ins = kd.inspect(T.dir)
      end)
      teardown(function() if not m:is_closed() then m:close() end end)

      it("weights by kind are the checkpoint's bytes by kind", function()
        local r = m:memory()
        local i = m.info
        local n_moe = i.n_layers - i.first_k_dense
        local sum = 0
        for _, k in ipairs(WEIGHT_KINDS) do
          local want = ins[k[2]]
          if k[1] == "weights_routed_experts" and T.int4 then want = want - 16 * 3 * i.n_experts * n_moe end
          assert.are.equal(want, r[k[1]], k[1])
          assert.is_true(r[k[1]] > 0, k[1] .. " is not empty")
          sum = sum + r[k[1]]
        end
        assert.are.equal(sum, r.weights_total)
        assert.are.equal(r.backend, BACKEND)
        if BACKEND == "cuda" then
          assert.are.equal(r.weights_total, r.weights_allocated, "every weight is a device copy")
        else
          assert.is_true(r.weights_allocated <= r.weights_total)
        end
        -- the small model buffers: RoPE inverse frequencies and each MoE layer's f32 router bias
        assert.are.equal(i.qk_rope_dim / 2 * 4 + n_moe * i.n_experts * 4, r.other)
      end)

      it("KV cache and activations follow the open sequences", function()
        local i = m.info
        local r0 = m:memory()
        assert.are.equal(0, r0.kv_cache)
        assert.are.equal(0, r0.activations)
        assert.are.equal(0, r0.n_seqs)
        local a = m:new_seq(100)
        local r1 = m:memory()
        assert.are.equal(kv_bytes(i, 100), r1.kv_cache)
        assert.is_true(r1.activations >= 100 * i.vocab * 4, "at least the fp32 logits of 100 rows")
        assert.are.equal(1, r1.n_seqs)
        local b = m:new_seq(2000)                -- 1024 rows per forward at most
        local r2 = m:memory()
        assert.are.equal(kv_bytes(i, 2100), r2.kv_cache)
        assert.is_true(r2.activations - r1.activations >= 1024 * i.vocab * 4)
        a:forward({ 5, 77, 300 })                -- a forward allocates nothing
        local r3 = m:memory()
        assert.are.equal(r2.kv_cache, r3.kv_cache)
        assert.are.equal(r2.activations, r3.activations)
        a:close()
        local r4 = m:memory()
        assert.are.equal(kv_bytes(i, 2000), r4.kv_cache)
        assert.are.equal(r2.activations - r1.activations, r4.activations)
        b:close()
        local r5 = m:memory()
        assert.are.equal(0, r5.kv_cache)
        assert.are.equal(0, r5.activations)
        assert.are.equal(0, r5.n_seqs)
      end)

      it("total is the sum of its parts; mapped is the checkpoint's size", function()
        local s = m:new_seq(64)
        local r = m:memory()
        assert.are.equal(parts(r), r.total)
        local mapped = 0
        for _, f in ipairs(T.files) do mapped = mapped + file_size(T.dir .. "/" .. f) end
        assert.are.equal(mapped, r.mapped)
        if BACKEND == "cpu" then
          assert.are.equal(0, r.device_total)
          assert.are.equal(0, r.graphs)
        end
        s:close()
      end)

      it("bad arguments and a closed model are errors", function()
        local C = kd.C
        local r = ffi.new("kd_memory_report")
        assert.are.equal(C.KD_ERR_ARG, C.kd_model_memory(nil, r))
        assert.truthy(kd.last_error():find("model is NULL", 1, true))
        assert.are.equal(C.KD_ERR_ARG, C.kd_model_memory(m:handle(), nil))
        assert.truthy(kd.last_error():find("out is NULL", 1, true))
        local m2 = kd.open_model(T.dir, { backend = BACKEND })
        m2:close()
        assert.matches("kdtree: model is closed", err_of(m2.memory, m2), 1, true)
      end)
    end)
  end
end)

describe("kdtree generate --stats", function()
  it("prints the memory table while decoding", function()
    local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
    local p = io.popen(env .. "luajit scripts/kdtree generate --prompt-ids 5,77,300 -n 4 --stats --backend " ..
      BACKEND .. " 2>&1")
    local out = p:read("*a")
    p:close()
    assert.truthy(out:find("memory by component", 1, true), out)
    for _, row in ipairs({ "routed experts", "kv cache", "activations", "workspace", "total", "step graphs" }) do
      assert.truthy(out:find("\n  " .. row, 1, true), row)
    end
    -- every row is a count on both backends (the CPU backend tallies its allocations too)
    assert.is_nil(out:find("not tallied", 1, true), out)
    assert.truthy(out:find("\n  workspace%s+[%d%.]+ %a+%s+[%d%.]+%%"), out)
    -- whatever capacity the policy gives its sequence, the exact kv bytes are
    -- capacity x layers x (r + dr) x dtype size: a positive multiple of layers x (r + dr) x size
    local kv = tonumber((out:match("\n  kv cache%s+[%d%.]+ %a+%s+[%d%.]+%%%s+([%d ]+)\n") or ""):gsub(" ", ""), 10)
    local m = kd.open_model("models/tiny-k2.6", { backend = BACKEND })
    local per = m.info.n_layers * (m.info.kv_lora_rank + m.info.qk_rope_dim) * ACT
    m:close()
    assert.truthy(kv and kv > 0 and kv % per == 0, "kv cache exact bytes: " .. tostring(kv))
  end)
end)

describe("the backend's own tallies on " .. BACKEND, function()
  local T = TARGETS[1]
  it("drafter weights and caches, workspaces" .. (BACKEND == "cuda" and " and the device totals" or ""), function()
    local m = kd.open_model(T.dir, { backend = BACKEND })
    local i = m.info
    local r0 = m:memory()
    assert.are.equal(BACKEND, r0.backend)
    -- no more weight than the walk counts (the report clamps at 0, so a backend that tallies
    -- less shows below, in the drafter's weights)
    assert.are.equal(0, r0.drafter_weights, "the backend tallies no weight beyond the model's")
    assert.are.equal(0, r0.drafter_cache)
    if BACKEND == "cuda" then
      assert.is_true(r0.device_total > 0 and r0.device_free > 0 and r0.device_free < r0.device_total)
      assert.is_true(r0.total <= r0.device_total - r0.device_free, "what we hold fits in what the device has in use")
    end
    local d = kd.open_drafter("models/tiny-k2.6-dflash", m)
    local r1 = m:memory()
    assert.are.equal(d.info.head_dim / 2 * 4, r1.drafter_cache, "before a sequence: only the drafter's RoPE table")
    -- the drafter's weights as its checkpoint stores them (bf16 and f32 are held as stored; its
    -- lm_head / embedding are the target's, not in its file)
    local stored = 0
    for name, t in pairs(ck.read_st_header("models/tiny-k2.6-dflash/model.safetensors")) do
      if name ~= "__metadata__" then stored = stored + t.data_offsets[2] - t.data_offsets[1] end
    end
    assert.are.equal(stored, r1.drafter_weights)
    local s = m:new_seq(300)
    s:attach_drafter(d)
    local r2 = m:memory()
    assert.are.equal(kv_bytes(i, 300), r2.kv_cache)
    assert.is_true(r2.drafter_cache > 0, "the drafter's per-sequence K/V and taps")
    s:forward({ 5, 77, 300, 12, 9 })
    s:draft(s:argmax()[5], false)
    local r3 = m:memory()
    assert.is_true(r3.workspace > 0, "the forward's workspaces")
    assert.are.equal(parts(r3), r3.total)
    assert.are.equal(0, r3.trees)
    local t = kd.tree.build_drafted(s, 16)
    local rt = m:memory()
    assert.is_true(rt.trees > 0, "the tree's backend copy")
    assert.are.equal(r3.drafter_cache, rt.drafter_cache, "a tree is not counted as the drafter's")
    assert.are.equal(parts(rt), rt.total)
    t:close()
    assert.are.equal(0, m:memory().trees, "closing the tree frees its backend copy")
    s:close()
    local r4 = m:memory()
    assert.are.equal(0, r4.kv_cache)
    assert.are.equal(r1.drafter_cache, r4.drafter_cache, "closing the sequence frees the drafter's state")
    assert.are.equal(r1.drafter_weights, r4.drafter_weights)
    d:close()
    local r5 = m:memory()
    assert.are.equal(0, r5.drafter_weights)
    assert.are.equal(0, r5.drafter_cache, "the drafter's own buffers (RoPE table) are freed with it")
    m:close()
  end)
end)
