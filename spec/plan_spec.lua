-- plan_spec: the per-GPU plan of tensor parallelism (kd_plan, core/plan.c) and kd_inspect on a
-- directory holding only a config.json (models/kimi-k2.6-config, K2.6's real config).
-- References: an independent hand computation of every byte count from config.json's dims (read
-- here with dkjson, nothing taken from the engine); the tiny model's own safetensors headers
-- (kd_inspect) and its loaded weights (kd_model_memory); the invariant that the ranks' shares
-- add up to the whole model once the replicated tensors are counted once.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local ck = require("helpers.checkpoint")
local json = require("dkjson")

local K26CFG = "models/kimi-k2.6-config"
local KINDS = { "attention", "dense_mlp", "shared_experts", "routed_experts", "router", "embed", "lm_head", "norms" }
local GB = 1e9

local err_of = require("helpers.err_of")
-- the error of fn must hold every needle (plain text)
local function expect_error(fn, ...)
  local err = err_of(fn)
  for _, needle in ipairs({ ... }) do assert.truthy(err:find(needle, 1, true), needle .. " in: " .. err) end
end

local function text_config(dir)
  local c = json.decode(ck.read(dir .. "/config.json"))
  return c.text_config or c
end

-- one rank's bytes by kind for tp ranks, by hand from the config's dims (CUDA forms: bf16
-- matrices and norms, f32 router bias, INT4 experts as codes + bf16 scales, group g)
local function hand_rank(c, tp)
  local D, L, dense = c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace
  local H, rq, rkv = c.num_attention_heads / tp, c.q_lora_rank, c.kv_lora_rank
  local dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
  local I, Im, E, S = c.intermediate_size / tp, c.moe_intermediate_size / tp, c.n_routed_experts, c.n_shared_experts
  local V, moe = c.vocab_size, L - dense
  local q = c.quantization_config
  local g = q and q.config_groups.group_0.weights.group_size
  local attn_layer = rq * D + rq + H * (dn + dr) * rq + (rkv + dr) * D + rkv + H * (dn + dv) * rkv + D * H * dv
  local expert = 3 * Im * D * (g and (0.5 + 2 / g) or 2)   -- gate, up, down: INT4 codes + scales, or bf16
  return {
    attention = 2 * attn_layer * L,
    dense_mlp = 2 * 3 * I * D * dense,
    shared_experts = 2 * 3 * S * Im * D * moe,
    routed_experts = expert * E * moe,
    router = (2 * E * D + 4 * E) * moe,
    embed = 2 * V * D,
    lm_head = 2 * (V / tp) * D,
    norms = 2 * (2 * D * L + D),
    replicated = 2 * (rq * D + rq + (rkv + dr) * D + rkv) * L + (2 * E * D + 4 * E) * moe + 2 * V * D
      + 2 * (2 * D * L + D),
    kv_per_token = L * (rkv + dr) * 2,
  }
end

local function sum_weights(p)
  local t = 0
  for _, k in ipairs(KINDS) do t = t + p["weights_" .. k] end
  return t
end

describe("kd_inspect without weight files", function()
  teardown(function() ck.cleanup() end)

  it("K2.6's config alone: every byte count equals the hand computation from the dims", function()
    local c, r = text_config(K26CFG), kd.inspect(K26CFG)
    assert.are.equal(0, r.n_files)
    local h = hand_rank(c, 1)
    local shapes = 3 * 16 * c.n_routed_experts * (c.num_hidden_layers - c.first_k_dense_replace)   -- I64 [2] each
    for _, k in ipairs(KINDS) do
      local want = h[k] + (k == "routed_experts" and shapes or 0)
      assert.are.equal(want, r["bytes_" .. k], k)
    end
    -- kimi_k2.md's size arithmetic: the INT4 checkpoint is about 594 GB
    assert.is_true(math.abs(r.bytes_total / GB - 594.2) < 0.1, tostring(r.bytes_total))
    assert.are.equal(h.kv_per_token, r.bytes_per_token_kv)
    assert.are.equal(70272, r.bytes_per_token_kv)
  end)

  it("the tiny model's config alone gives the bytes its safetensors headers give", function()
    local d = ck.tempdir()
    ck.write(d .. "/config.json", ck.read(ck.K26 .. "/config.json"))
    local a, b = kd.inspect(ck.K26), kd.inspect(d)
    assert.are.equal(0, b.n_files)
    assert.is_true(a.n_files > 0)
    for _, k in ipairs(require("kdtree.util").REPORT_BYTES) do assert.are.equal(a[k], b[k], k) end
    assert.are.equal(a.n_tensors - a.n_skipped, b.n_tensors)
  end)
end)

describe("kd_plan", function()
  teardown(function() ck.cleanup() end)

  it("K2.6 at tp 1, 2, 4, 8: one rank's bytes equal the hand computation", function()
    local c = text_config(K26CFG)
    for _, tp in ipairs({ 1, 2, 4, 8 }) do
      local p, h = kd.plan(K26CFG, { tp = tp, device_bytes = 141 * GB, capacity = 32768 }), hand_rank(c, tp)
      for _, k in ipairs(KINDS) do assert.are.equal(h[k], p["weights_" .. k], k .. " at tp " .. tp) end
      assert.are.equal(sum_weights(p), p.weights_total)
      assert.are.equal(h.replicated, p.weights_replicated, "replicated at tp " .. tp)
      assert.are.equal(h.kv_per_token * 1024, p.kv_per_1k)
      assert.are.equal(h.kv_per_token * 32768, p.kv_cache)
      -- the rank's logits shard, and at tp > 1 two buffers of 32 whole rows (accept and sampling on rank 0)
      assert.are.equal(1024 * (c.vocab_size / tp) * 4 + (tp > 1 and 2 * 32 * c.vocab_size * 4 or 0), p.logits)
      assert.are.equal(p.weights_total + p.kv_cache + p.logits + p.scratch + p.workspace, p.total)
      assert.is_true(p.scratch > 0 and p.workspace > 0)
    end
  end)

  it("the ranks' shares add up to the tp-1 weights once the replicated tensors count once", function()
    -- the tps each model splits (tiny-k2.6: 4 heads, experts 64 wide in INT4 groups of 32)
    for dir, tps in pairs({ [K26CFG] = { 2, 4, 8 }, [ck.K26] = { 2 }, [ck.DSV3] = { 2, 4 } }) do
      local one = kd.plan(dir, { tp = 1 })
      for _, tp in ipairs(tps) do
        local p = kd.plan(dir, { tp = tp })
        -- the plan is every rank's share
        assert.are.equal(one.weights_total, tp * p.weights_total - (tp - 1) * p.weights_replicated,
          dir .. " tp " .. tp)
        assert.are.equal(one.weights_replicated, p.weights_replicated)
        assert.is_true(p.weights_replicated < p.weights_total)
      end
    end
  end)

  it("K2.6 fits one H200 (141 GB) and one RTX PRO 6000 (96 GB) at tp 8, not at tp 2 or 4", function()
    local p8 = kd.plan(K26CFG, { tp = 8, device_bytes = 141 * GB })
    assert.is_true(p8.fits)
    assert.truthy(p8.message:find("fits: each of 8 ranks needs", 1, true), p8.message)
    local pro = kd.plan(K26CFG, { tp = 8, device_bytes = 96 * GB, capacity = 32768 })
    assert.is_true(pro.fits)
    -- the longest sequence: it fits and one token more does not; its KV is what the device has
    -- left beside the rest at that capacity (the workspace bound steps with the capacity)
    local at = kd.plan(K26CFG, { tp = 8, device_bytes = 96 * GB, capacity = pro.max_capacity })
    local over = kd.plan(K26CFG, { tp = 8, device_bytes = 96 * GB, capacity = pro.max_capacity + 1 })
    assert.is_true(at.fits, at.message)
    assert.is_false(over.fits, over.message)
    local left = 96 * GB - at.margin - (at.total - at.kv_cache)
    assert.is_true(math.abs(at.max_capacity - left / (at.kv_per_1k / 1024)) < 1 + 1e-6, at.message)
    for _, tp in ipairs({ 2, 4 }) do
      local p = kd.plan(K26CFG, { tp = tp, device_bytes = 141 * GB })
      assert.is_false(p.fits)
      assert.is_true(p.total > 141 * GB)
      for _, needle in ipairs({ "each of " .. tp .. " ranks", string.format("%.0f bytes", p.total), "141000000000 bytes" }) do
        assert.truthy(p.message:find(needle, 1, true), needle .. " in " .. p.message)
      end
    end
    local unchecked = kd.plan(K26CFG, { tp = 8 })
    assert.is_nil(unchecked.fits)
    assert.are.equal(0, unchecked.max_capacity)
  end)

  it("tp 1 on the tiny model: inspect's headers and the loaded model's memory report", function()
    local p, r = kd.plan(ck.K26, { tp = 1 }), kd.inspect(ck.K26)
    local c = text_config(ck.K26)
    local shapes = 3 * 16 * c.n_routed_experts * (c.num_hidden_layers - c.first_k_dense_replace)
    local m = kd.open_model(ck.K26)
    local mem = m:memory()
    m:close()
    local memkey = { embed = "weights_embed" }
    for _, k in ipairs(KINDS) do
      -- no backend keeps the INT4 weight_shape tensors (I64 [2])
      assert.are.equal(r["bytes_" .. k] - (k == "routed_experts" and shapes or 0), p["weights_" .. k], k)
      assert.are.equal(mem[memkey[k] or ("weights_" .. k)], p["weights_" .. k], k .. " (memory report)")
    end
    assert.are.equal(mem.weights_total, p.weights_total)
    assert.are.equal(0, p.weights_total - sum_weights(p))
  end)

  it("refuses a tp that does not split, naming the field", function()
    expect_error(function() kd.plan(K26CFG, { tp = 3 }) end, "config.json", "tp 3", "num_attention_heads (64)")
    expect_error(function() kd.plan(K26CFG, { tp = 9 }) end, "tp 9", "expected 1..8")
    expect_error(function() kd.plan(K26CFG, { tp = 0 }) end, "tp 0", "expected 1..8")
    -- tiny K2.6: 64 / 4 = 16 columns per rank, half an INT4 scale group of 32
    expect_error(function() kd.plan(ck.K26, { tp = 4 }) end, "tp 4", "moe_intermediate_size 64", "group_size 32")
    -- a vocabulary that does not split
    local d = ck.copy(ck.DSV3)
    local c = ck.decode(ck.read(d .. "/config.json"))
    c.vocab_size = 1022
    ck.write(d .. "/config.json", ck.encode(c))
    os.remove(d .. "/model.safetensors")
    expect_error(function() kd.plan(d, { tp = 4 }) end, "tp 4", "vocab_size (1022)")
    expect_error(function() kd.plan(K26CFG, { tp = 8, capacity = 0 }) end, "capacity 0")
  end)
end)

describe("kdtree inspect --tp", function()
  local function run(args)
    local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
    local p = io.popen(env .. "luajit scripts/kdtree inspect --model " .. K26CFG .. " " .. args .. " 2>&1; echo \"__rc=$?\"")
    local out = p:read("*a")
    p:close()
    return tonumber(out:match("__rc=(%d+)%s*$")), out
  end

  it("prints K2.6's per-GPU plan at tp 8 and says when it does not fit", function()
    local p = kd.plan(K26CFG, { tp = 8, device_bytes = 141 * GB, capacity = 32768 })
    local rc, out = run("--tp 8")
    assert.are.equal(0, rc, out)
    for _, needle in ipairs({ "per-GPU plan: tp 8", "routed experts", "kv cache", "workspace", "fits: each of 8 ranks",
      (string.format("%.0f", p.total):reverse():gsub("(%d%d%d)", "%1 "):reverse():gsub("^ ", "")) }) do
      assert.truthy(out:find(needle, 1, true), needle .. " in\n" .. out)
    end
    rc, out = run("--tp 4 --gpu-mem 141")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("DOES NOT FIT: each of 4 ranks", 1, true), out)
    rc, out = run("--tp 8 --gpu-mem 96 --capacity 400000")
    assert.truthy(out:find("DOES NOT FIT: each of 8 ranks", 1, true), out)
    rc, out = run("--tp 3")
    assert.are.equal(1, rc, out)
    assert.truthy(out:find("num_attention_heads", 1, true), out)
    rc, out = run("--gpu-mem 96")
    assert.are.equal(2, rc, out)
  end)
end)

-- a sequence opened on the loaded tiny model holds what the plan says one rank's sequence holds at
-- tp 1: on CUDA (bf16 activations and KV, the plan's forms) exactly; on the CPU (fp32) the KV is
-- twice the plan's
describe("kd_plan against an open sequence", function()
  local function open_seq(backend, capacity)
    local m = kd.open_model(ck.K26, { backend = backend })
    local s = m:new_seq(capacity)
    local mem = m:memory()
    s:close()
    m:close()
    return mem
  end

  it("CPU: the KV cache of 2048 tokens is the plan's in fp32", function()
    local p, mem = kd.plan(ck.K26, { tp = 1, capacity = 2048 }), open_seq("cpu", 2048)
    assert.are.equal(2 * p.kv_cache, mem.kv_cache)
  end)

  it("CUDA: KV cache, logits + forward scratch of 2048 tokens equal the plan's #gpu", function()
    local p, mem = kd.plan(ck.K26, { tp = 1, capacity = 2048 }), open_seq("cuda", 2048)
    assert.are.equal(p.kv_cache, mem.kv_cache)
    assert.are.equal(p.logits + p.scratch, mem.activations)
    assert.are.equal(p.weights_total, mem.weights_total)
  end)
end)
