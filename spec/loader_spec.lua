-- loader_spec: checkpoint loading. The info of both tiny models against their config.json
-- (read here with dkjson, field by field), tensor counts and bytes by kind against the
-- safetensors headers (read here in Lua), INT4 detection, the quantization ignore list,
-- YaRN numbers against HF, kd_inspect on a full-size Kimi K2.6 layout (header-only shards)
-- against the arithmetic of shared/reference/kimi_k2.md section 5, memory mapping and the
-- deferred close of a model that still has sequences.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local ck = require("helpers.checkpoint")
local err_of = require("helpers.err_of")
local ffi = require("ffi")
local bit = require("bit")

local K26, DSV3 = ck.K26, ck.DSV3
local PROMPT = { 5, 77, 300, 12, 999 }

local function f32(x) return tonumber(ffi.new("float", x)) end

local function logits_of(dir, prompt)
  local m = kd.open_model(dir)
  local s = m:new_seq(32)
  s:forward(prompt)
  local rows = {}
  for r = 1, s:out_rows() do rows[r] = s:logits(r) end
  s:close()
  m:close()
  return rows
end

local function max_abs_diff(a, b)
  local d = 0
  for r = 1, #a do
    for j = 1, #a[r] do d = math.max(d, math.abs(a[r][j] - b[r][j])) end
  end
  return d
end

-- YaRN attention scale as HF computes it (yarn_get_mscale, yarn_apply_mscale)
local function expected_softmax_scale(t)
  local s = (t.qk_nope_head_dim + t.qk_rope_head_dim) ^ -0.5
  local rs = t.rope_parameters or t.rope_scaling
  if type(rs) == "table" and (rs.rope_type or rs.type) == "yarn" and (rs.mscale_all_dim or 0) ~= 0 and rs.factor > 1 then
    local m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1
    s = s * m * m
  end
  return s
end

-- bytes by kind from the headers, classified by name here (independently of the engine)
local function classify(t, name)
  local prefix = t._prefix
  if name:sub(1, #prefix) ~= prefix then return nil end
  local n = name:sub(#prefix + 1)
  if n == "model.embed_tokens.weight" then return "embed" end
  if n:match("^lm_head%.") then return "lm_head" end
  if n == "model.norm.weight" then return "norms" end
  local l, rest = n:match("^model%.layers%.(%d+)%.(.*)$")
  if not l or tonumber(l) >= t.num_hidden_layers then return nil end
  if rest:match("^self_attn%.") then return "attention" end   -- with the q_a/kv_a latent norms
  if rest:match("layernorm%.weight$") then return "norms" end
  if rest:match("^mlp%.gate%.") then return "router" end
  if rest:match("^mlp%.shared_experts%.") then return "shared_experts" end
  if rest:match("^mlp%.experts%.") then return "routed_experts", tonumber(l) end
  if rest:match("^mlp%.") then return "dense_mlp" end
  return nil
end

local KINDS = { "attention", "dense_mlp", "shared_experts", "routed_experts", "router", "embed", "lm_head", "norms" }

local function expected_bytes(dir)
  local t, cfg = ck.text_config(dir)
  t._prefix = cfg.model_type == "kimi_k25" and "language_model." or ""
  local tensors, files = ck.tensors(dir)
  local by, routed_layer, n, skipped = {}, {}, 0, 0
  for _, k in ipairs(KINDS) do by[k] = 0 end
  for name, e in pairs(tensors) do
    n = n + 1
    local nb = e.data_offsets[2] - e.data_offsets[1]
    local k, layer = classify(t, name)
    if k then
      by[k] = by[k] + nb
      if layer then routed_layer[layer] = (routed_layer[layer] or 0) + nb end
    else
      skipped = skipped + 1
    end
  end
  local total = 0
  for _, k in ipairs(KINDS) do total = total + by[k] end
  local read = total - by.embed - by.routed_experts + by.embed / t.vocab_size
  for _, b in pairs(routed_layer) do read = read + math.floor(b * t.num_experts_per_tok / t.n_routed_experts) end
  return {
    by = by, total = total, read = read, n = n, files = #files, skipped = skipped,
    kv = t.num_hidden_layers * (t.kv_lora_rank + t.qk_rope_head_dim) * 2,
  }
end

local function check_info(dir, info)
  local t, cfg = ck.text_config(dir)
  local eq = assert.are.equal
  eq(t.num_hidden_layers, info.n_layers)
  eq(t.first_k_dense_replace, info.first_k_dense)
  eq(t.hidden_size, info.hidden)
  eq(t.vocab_size, info.vocab)
  eq(t.num_attention_heads, info.n_heads)
  eq(t.q_lora_rank == ck.null and 0 or t.q_lora_rank, info.q_lora_rank)
  eq(t.kv_lora_rank, info.kv_lora_rank)
  eq(t.qk_nope_head_dim, info.qk_nope_dim)
  eq(t.qk_rope_head_dim, info.qk_rope_dim)
  eq(t.v_head_dim, info.v_head_dim)
  eq(t.intermediate_size, info.intermediate)
  eq(t.moe_intermediate_size, info.moe_intermediate)
  eq(t.n_routed_experts, info.n_experts)
  eq(t.num_experts_per_tok, info.n_experts_per_tok)
  eq(t.n_shared_experts, info.n_shared_experts)
  eq(t.n_group, info.n_group)
  eq(t.topk_group, info.topk_group)
  eq(t.norm_topk_prob, info.norm_topk_prob)
  eq(t.max_position_embeddings, info.max_positions)
  eq(f32(t.rms_norm_eps), info.rms_norm_eps)
  eq(f32(t.routed_scaling_factor), info.routed_scaling_factor)
  eq(f32(t.rope_theta), info.rope_theta)
  eq(f32(expected_softmax_scale(t)), info.softmax_scale)
  -- eos: generation_config.json wins over config.json
  local gen = ck.exists(dir .. "/generation_config.json") and ck.read_json(dir .. "/generation_config.json") or {}
  local eos = gen.eos_token_id or t.eos_token_id or cfg.eos_token_id
  if type(eos) ~= "table" then eos = { eos } end
  assert.are.same(eos, info.eos)
  eq(gen.bos_token_id or t.bos_token_id, info.bos)
end

describe("loader", function()
  teardown(function() ck.cleanup() end)

  describe("info matches config.json", function()
    it("tiny-k2.6 (kimi_k25 wrapper, text_config, INT4 experts)", function()
      local m = kd.open_model(K26)
      check_info(K26, m.info)
      assert.are.equal(4, m.info.expert_bits)
      assert.are.equal(32, m.info.expert_group)
      assert.are.equal(os.getenv("KDTREE_BACKEND") or "cpu", m.info.backend)
      m:close()
      check_info(K26, kd.inspect(K26).info)
    end)

    it("tiny-dsv3 (plain DeepSeek-V3, q_proj, bf16 experts, group-limited routing)", function()
      local m = kd.open_model(DSV3)
      check_info(DSV3, m.info)
      assert.are.equal(0, m.info.q_lora_rank)
      assert.are.equal(16, m.info.expert_bits)
      assert.are.equal(0, m.info.expert_group)
      m:close()
      check_info(DSV3, kd.inspect(DSV3).info)
    end)

    it("eos ids fall back to config.json without generation_config.json", function()
      local d = ck.copy(K26)
      os.remove(d .. "/generation_config.json")
      local t = ck.text_config(d)
      local info = kd.inspect(d).info
      assert.are.same(type(t.eos_token_id) == "table" and t.eos_token_id or { t.eos_token_id }, info.eos)
      check_info(d, info)
    end)

    it("rope_parameters (transformers 5 form) reads like rope_scaling", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, t)
        t.rope_parameters = t.rope_scaling
        t.rope_parameters.rope_theta = t.rope_theta
        t.rope_scaling, t.rope_theta = nil, nil
      end)
      local a, b = kd.inspect(K26).info, kd.inspect(d).info
      assert.are.equal(a.softmax_scale, b.softmax_scale)
      assert.are.equal(a.rope_theta, b.rope_theta)
      assert.are.same(logits_of(K26, PROMPT), logits_of(d, PROMPT))
    end)
  end)

  describe("tensors", function()
    for _, dir in ipairs({ K26, DSV3 }) do
      it("counts and bytes by kind of " .. dir, function()
        local r = kd.inspect(dir)
        local e = expected_bytes(dir)
        assert.are.equal(e.n, r.n_tensors)
        assert.are.equal(e.files, r.n_files)
        assert.are.equal(e.skipped, r.n_skipped)
        for _, k in ipairs(KINDS) do assert.are.equal(e.by[k], r["bytes_" .. k], k) end
        assert.are.equal(e.total, r.bytes_total)
        assert.are.equal(e.kv, r.bytes_per_token_kv)
        assert.are.equal(e.read, r.bytes_read_per_token)
      end)
    end

    it("tiny-k2.6 skips exactly the vision tower and projector", function()
      local n = 0
      for name in pairs(ck.read_json(K26 .. "/model.safetensors.index.json").weight_map) do
        if name:match("^vision_tower%.") or name:match("^mm_projector%.") then n = n + 1 end
      end
      assert.is_true(n > 0)
      assert.are.equal(n, kd.inspect(K26).n_skipped)
    end)

    it("INT4 experts: packed I32, bf16 scales per group, I64 shape; everything else dense", function()
      local t = ck.text_config(K26)
      local g = t.quantization_config.config_groups.group_0.weights.group_size
      local tensors = ck.tensors(K26)
      local n_int4 = 0
      for name, e in pairs(tensors) do
        local mod = name:match("^(language_model%.model%.layers%.%d+%.mlp%.experts%.%d+%.%a+_proj)%.weight_packed$")
        if mod then
          n_int4 = n_int4 + 1
          local sc, sh = tensors[mod .. ".weight_scale"], tensors[mod .. ".weight_shape"]
          assert.are.equal("I32", e.dtype)
          assert.are.equal("BF16", sc.dtype)
          assert.are.equal("I64", sh.dtype)
          assert.are.equal(e.shape[2] * 8 / g, sc.shape[2])
        elseif name:match("%.weight$") and name:match("^language_model%.") then
          assert.is_true(e.dtype == "BF16" or e.dtype == "F32", name)
        end
      end
      local moe_layers = t.num_hidden_layers - t.first_k_dense_replace
      assert.are.equal(moe_layers * t.n_routed_experts * 3, n_int4)
      -- the model holds what the files hold, less the 16-byte weight_shape of each INT4 linear
      local m = kd.open_model(K26)
      assert.are.equal(kd.inspect(K26).bytes_total - 16 * n_int4, m.info.bytes_weights)
      m:close()
      m = kd.open_model(DSV3)
      assert.are.equal(kd.inspect(DSV3).bytes_total, m.info.bytes_weights)
      m:close()
    end)
  end)

  describe("the quantization ignore list", function()
    local EXPERT = "model.layers.2.mlp.experts.5"

    -- a copy of tiny-k2.6 whose expert 5 of layer 2 is stored dequantized (F32, exact),
    -- listed in `ignore` by the given patterns
    local function dequantized_copy(patterns)
      local d = ck.copy(K26)
      local idx = ck.read_json(d .. "/model.safetensors.index.json")
      local t = ck.text_config(d)
      local g = t.quantization_config.config_groups.group_0.weights.group_size
      for _, proj in ipairs({ "gate_proj", "up_proj", "down_proj" }) do
        local mod = "language_model." .. EXPERT .. "." .. proj
        local path = d .. "/" .. idx.weight_map[mod .. ".weight_packed"]
        ck.edit_st(path, function(h, st)
          local p, s = h[mod .. ".weight_packed"], h[mod .. ".weight_scale"]
          local rows, cols = p.shape[1], p.shape[2] * 8
          -- the strings stay in locals: a pointer cast from a temporary string dangles once the GC
          -- takes it (this test once read freed memory: logits off by 0.026)
          local pstr = st.data:sub(p.data_offsets[1] + 1, p.data_offsets[2])
          local words = ffi.cast("const uint32_t*", pstr)
          local sstr = st.data:sub(s.data_offsets[1] + 1, s.data_offsets[2])
          local scales = ffi.cast("const uint16_t*", sstr)
          local out = ffi.new("float[?]", rows * cols)
          local bf = ffi.new("uint32_t[1]")
          for r = 0, rows - 1 do
            for c = 0, cols - 1 do
              local u = bit.band(bit.rshift(words[r * cols / 8 + bit.rshift(c, 3)], 4 * bit.band(c, 7)), 15)
              bf[0] = bit.lshift(scales[r * cols / g + math.floor(c / g)], 16)
              out[r * cols + c] = (u - 8) * ffi.cast("float*", bf)[0]
            end
          end
          assert(#pstr > 0 and #sstr > 0)   -- both alive to here
          for _, sfx in ipairs({ ".weight_packed", ".weight_scale", ".weight_shape" }) do
            h[mod .. sfx] = nil
            idx.weight_map[mod .. sfx] = nil
          end
          local b = #st.data
          h[mod .. ".weight"] = { dtype = "F32", shape = { rows, cols }, data_offsets = { b, b + 4 * rows * cols } }
          idx.weight_map[mod .. ".weight"] = path:match("[^/]+$")
          return st.data .. ffi.string(out, 4 * rows * cols)
        end)
      end
      ck.write_json(d .. "/model.safetensors.index.json", idx)
      ck.edit_config(d, function(cfg, text)
        for _, p in ipairs(patterns) do table.insert(text.quantization_config.ignore, p) end
      end)
      return d
    end

    it("modules it names load dense, and compute exactly what their INT4 form computes", function()
      -- plain names (with and without the language_model. prefix) and a re: pattern
      local d = dequantized_copy({
        "language_model." .. EXPERT .. ".gate_proj",
        EXPERT .. ".up_proj",
        "re:.*layers\\.2\\.mlp\\.experts\\.5\\.down_proj$",
      })
      local m = kd.open_model(d)
      assert.are.equal(4, m.info.expert_bits)   -- the other experts are still INT4
      m:close()
      local a, b = logits_of(K26, PROMPT), logits_of(d, PROMPT)
      if (os.getenv("KDTREE_BACKEND") or "cpu") == "cpu" then
        -- fp32 decode of (u - 8) * bf16 scale is exact, so the dense F32 copy gives the same bits
        assert.are.equal(0, max_abs_diff(a, b))
      else
        -- other backends may take a different kernel for a dense expert (bf16 activations)
        local amax = 0
        for r = 1, #a do for j = 1, #a[r] do amax = math.max(amax, math.abs(a[r][j])) end end
        assert.is_true(max_abs_diff(a, b) <= 2e-2 * amax)
      end
    end)

    it("without the ignore entries the dense expert is an error that says why", function()
      local d = dequantized_copy({})
      local err = err_of(kd.open_model, d)
      assert.is_truthy(err:find("language_model." .. EXPERT .. ".gate_proj.weight_packed' is missing", 1, true), err)
      assert.is_truthy(err:find("holds 'language_model." .. EXPERT .. ".gate_proj.weight'", 1, true), err)
    end)

    it("plain names match exactly and re: patterns match at the start (Python re.match)", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, t)
        local ign = t.quantization_config.ignore
        table.insert(ign, "language_model." .. EXPERT .. ".gate_pro")   -- a prefix of a name: no match
        table.insert(ign, EXPERT .. ".gate_proj.weight_packed")         -- a tensor, not a module: no match
        table.insert(ign, "re:experts")                                 -- matches inside, not at the start
        table.insert(ign, "re:model\\.layers\\.2\\.mlp\\.experts\\.5\\.x")
      end)
      assert.are.same(logits_of(K26, PROMPT), logits_of(d, PROMPT))
      -- and a pattern that does match (\d translated for POSIX) demands dense weights
      ck.edit_config(d, function(cfg, t)
        table.insert(t.quantization_config.ignore, "re:.*experts\\.\\d+\\.down_proj")
      end)
      local err = err_of(kd.open_model, d)
      assert.is_truthy(err:find("tensor 'language_model.model.layers.1.mlp.experts.0.down_proj.weight' is missing", 1, true), err)
      assert.is_truthy(err:find("ignore lists this module as unquantized", 1, true), err)
    end)
  end)

  describe("RoPE and softmax scale (HF transformers 5.x numbers)", function()
    -- the config reader's inverse frequencies, through the test surface (spec/c/kdtree_testing.h)
    local C = require("helpers.testlib").C
    local function inv_freq(dir, dim)
      local out = ffi.new("float[?]", dim / 2)
      kd.check(C.kd_test_rope_inv_freq(dir, dim, out), "kd_test_rope_inv_freq")
      local t = {}
      for i = 0, dim / 2 - 1 do t[i + 1] = tonumber(out[i]) end
      return t
    end
    local function full_k26_config(dir)
      local t = ck.text_config(K26)
      for k, v in pairs({ hidden_size = 7168, num_attention_heads = 64, num_key_value_heads = 64, q_lora_rank = 1536,
                          kv_lora_rank = 512, qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128,
                          intermediate_size = 18432, moe_intermediate_size = 2048, n_routed_experts = 384,
                          num_experts_per_tok = 8, vocab_size = 163840, num_hidden_layers = 61 }) do t[k] = v end
      ck.write_json(dir .. "/config.json", { model_type = "kimi_k25", text_config = t })
    end

    it("YaRN inverse frequencies at K2.6 dims equal HF _compute_yarn_parameters", function()
      local d = ck.tempdir()
      full_k26_config(d)
      local got = inv_freq(d, 64)
      -- HF transformers 5.x _compute_yarn_parameters (float32) for theta 50000, dim 64, factor 64,
      -- beta 32/1, original 4096 (printed with python3 -c ...; see docs/formats.md)
      local hf = { 1.0, 0.7131111025810242, 0.5085274577140808, 0.362636536359787, 0.2586001455783844,
        0.18441061675548553, 0.13150526583194733, 0.0937778577208519, 0.06687403470277786, 0.043776657432317734,
        0.028427958488464355, 0.018282955512404442, 0.011619159951806068, 0.007274119649082422,
        0.004465848673135042, 0.0026702038012444973, 0.0015372966881841421, 0.0008346550748683512,
        0.00040864606853574514, 0.00015837496903259307, 1.8070233636535704e-05, 1.2886083823104855e-05,
        9.189209777105134e-06, 6.5529270614206325e-06, 4.672965133067919e-06, 3.3323431125609204e-06,
        2.3763307126500877e-06, 1.6945878087426536e-06, 1.2084293530278956e-06, 8.61744410940446e-07,
        6.145194788587105e-07, 4.3822063844345394e-07 }
      for i = 1, 32 do
        assert.is_true(math.abs(got[i] - hf[i]) <= 4e-7 * hf[i], string.format("i=%d %.9g vs %.9g", i - 1, got[i], hf[i]))
      end
      -- kimi_k2.md section 3: low = 8, high = 20: i <= 8 unscaled, i >= 20 divided by the factor
      for i = 0, 31 do
        local plain = 50000 ^ (-2 * i / 64)
        if i <= 8 then assert.is_true(math.abs(got[i + 1] / plain - 1) < 1e-6, "i=" .. i)
        elseif i >= 20 then assert.is_true(math.abs(got[i + 1] * 64 / plain - 1) < 1e-6, "i=" .. i)
        else assert.is_true(got[i + 1] < plain and got[i + 1] > plain / 64, "i=" .. i) end
      end
    end)

    it("plain RoPE (no rope_scaling) is theta^(-2i/d)", function()
      local t = ck.text_config(DSV3)
      local got = inv_freq(DSV3, t.qk_rope_head_dim)
      for i = 0, t.qk_rope_head_dim / 2 - 1 do
        assert.are.equal(f32(1 / t.rope_theta ^ (2 * i / t.qk_rope_head_dim)), got[i + 1])
      end
    end)
  end)

  describe("kd_inspect on a full-size Kimi K2.6 layout", function()
    local dir, report, names
    local P = "language_model."

    setup(function()
      -- config.json: the real K2.6 text_config (kimi_k2.md section 1) and quantization (section 1.3)
      dir = ck.tempdir()
      local text = {
        model_type = "kimi_k2", vocab_size = 163840, hidden_size = 7168, intermediate_size = 18432,
        moe_intermediate_size = 2048, num_hidden_layers = 61, first_k_dense_replace = 1, moe_layer_freq = 1,
        num_attention_heads = 64, num_key_value_heads = 64, q_lora_rank = 1536, kv_lora_rank = 512,
        qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128, n_routed_experts = 384,
        num_experts_per_tok = 8, n_shared_experts = 1, n_group = 1, topk_group = 1, topk_method = "noaux_tc",
        scoring_func = "sigmoid", norm_topk_prob = true, routed_scaling_factor = 2.827, hidden_act = "silu",
        rms_norm_eps = 1e-5, rope_theta = 50000.0, max_position_embeddings = 262144, tie_word_embeddings = false,
        rope_scaling = { type = "yarn", factor = 64.0, beta_fast = 32.0, beta_slow = 1.0, mscale = 1.0,
                         mscale_all_dim = 1.0, original_max_position_embeddings = 4096 },
        bos_token_id = 163584, eos_token_id = 163586, num_nextn_predict_layers = 0,
        quantization_config = {
          quant_method = "compressed-tensors", format = "pack-quantized", quantization_status = "compressed",
          config_groups = { group_0 = { targets = { "Linear" }, input_activations = ck.null,
            weights = { num_bits = 4, type = "int", symmetric = true, strategy = "group", group_size = 32, dynamic = false } } },
          ignore = { "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                     "re:.*vision_tower.*", "re:.*mm_projector.*" },
        },
      }
      ck.write_json(dir .. "/config.json", { architectures = { "KimiK25ForConditionalGeneration" },
        model_type = "kimi_k25", text_config = text, vision_config = { model_type = "kimi_k25_vision" } })
      ck.write_json(dir .. "/generation_config.json", { eos_token_id = { 163586, 163585, 163593 } })

      -- 62 header-only shards: embed + layer 0 in shard 1, layer l in shard l+1, the rest in 62
      local shards = {}
      for i = 1, 62 do shards[i] = { n = 0, off = 0, parts = {} } end
      local weight_map = {}
      names = {}
      local SIZE = { BF16 = 2, F32 = 4, I32 = 4, I64 = 8 }
      local function add(shard, name, dtype, shape)
        local s = shards[shard]
        local nb = SIZE[dtype]
        for _, d in ipairs(shape) do nb = nb * d end
        s.parts[#s.parts + 1] = string.format('"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', name, dtype,
          table.concat(shape, ","), s.off, s.off + nb)
        s.off = s.off + nb
        weight_map[#weight_map + 1] = string.format('"%s":"model-%05d-of-000062.safetensors"', name, shard)
        names[#names + 1] = name
      end
      local H, D = 64, 7168
      add(1, P .. "model.embed_tokens.weight", "BF16", { 163840, D })
      for l = 0, 60 do
        local sh, b = l + 1, P .. "model.layers." .. l .. "."
        add(sh, b .. "input_layernorm.weight", "BF16", { D })
        add(sh, b .. "post_attention_layernorm.weight", "BF16", { D })
        add(sh, b .. "self_attn.q_a_proj.weight", "BF16", { 1536, D })
        add(sh, b .. "self_attn.q_a_layernorm.weight", "BF16", { 1536 })
        add(sh, b .. "self_attn.q_b_proj.weight", "BF16", { H * 192, 1536 })
        add(sh, b .. "self_attn.kv_a_proj_with_mqa.weight", "BF16", { 576, D })
        add(sh, b .. "self_attn.kv_a_layernorm.weight", "BF16", { 512 })
        add(sh, b .. "self_attn.kv_b_proj.weight", "BF16", { H * 256, 512 })
        add(sh, b .. "self_attn.o_proj.weight", "BF16", { D, H * 128 })
        if l == 0 then
          add(sh, b .. "mlp.gate_proj.weight", "BF16", { 18432, D })
          add(sh, b .. "mlp.up_proj.weight", "BF16", { 18432, D })
          add(sh, b .. "mlp.down_proj.weight", "BF16", { D, 18432 })
        else
          add(sh, b .. "mlp.gate.weight", "BF16", { 384, D })
          add(sh, b .. "mlp.gate.e_score_correction_bias", "F32", { 384 })
          add(sh, b .. "mlp.shared_experts.gate_proj.weight", "BF16", { 2048, D })
          add(sh, b .. "mlp.shared_experts.up_proj.weight", "BF16", { 2048, D })
          add(sh, b .. "mlp.shared_experts.down_proj.weight", "BF16", { D, 2048 })
          for j = 0, 383 do
            local e = b .. "mlp.experts." .. j .. "."
            for _, p in ipairs({ { "gate_proj", 2048, D }, { "up_proj", 2048, D }, { "down_proj", D, 2048 } }) do
              add(sh, e .. p[1] .. ".weight_packed", "I32", { p[2], p[3] / 8 })
              add(sh, e .. p[1] .. ".weight_scale", "BF16", { p[2], p[3] / 32 })
              add(sh, e .. p[1] .. ".weight_shape", "I64", { 2 })
            end
          end
        end
      end
      add(62, P .. "model.norm.weight", "BF16", { D })
      add(62, P .. "lm_head.weight", "BF16", { 163840, D })
      add(62, "vision_tower.patch_embed.proj.weight", "BF16", { 1152, 3, 14, 14 })
      add(62, "vision_tower.encoder.blocks.0.wqkv.weight", "BF16", { 3456, 1152 })
      add(62, "mm_projector.proj.0.weight", "BF16", { 4608, 4608 })
      for i = 1, 62 do
        local f = assert(io.open(string.format("%s/model-%05d-of-000062.safetensors", dir, i), "wb"))
        local h = "{" .. table.concat(shards[i].parts, ",") .. ',"__metadata__":{"format":"pt"}}'
        f:write(ck.u64le(#h), h)   -- the header only: the data section is absent
        f:close()
      end
      local f = assert(io.open(dir .. "/model.safetensors.index.json", "wb"))
      f:write('{"metadata":{},"weight_map":{', table.concat(weight_map, ","), "}}")
      f:close()
      report = kd.inspect(dir)
    end)

    it("reports the layout", function()
      local i = report.info
      assert.are.equal(61, i.n_layers)
      assert.are.equal(384, i.n_experts)
      assert.are.equal(8, i.n_experts_per_tok)
      assert.are.equal(7168, i.hidden)
      assert.are.equal(163840, i.vocab)
      assert.are.equal(4, i.expert_bits)
      assert.are.equal(32, i.expert_group)
      assert.are.same({ 163586, 163585, 163593 }, i.eos)
      assert.is_true(math.abs(i.softmax_scale - 0.1446796) < 1e-6)
      assert.are.equal(62, report.n_files)
      assert.are.equal(#names, report.n_tensors)
      assert.are.equal(3, report.n_skipped)
    end)

    it("bytes by kind match kimi_k2.md section 5", function()
      -- exact, from the shapes of section 1
      assert.are.equal(61 * 2 * 101124096, report.bytes_attention)        -- 12.34 GB (with the latent norms)
      assert.are.equal(60 * 384 * (24772608 + 3 * 16), report.bytes_routed_experts)   -- + weight_shape
      assert.are.equal(60 * 3 * 2048 * 7168 * 2, report.bytes_shared_experts)   -- 5.28 GB
      assert.are.equal(3 * 18432 * 7168 * 2, report.bytes_dense_mlp)     -- 0.79 GB
      assert.are.equal(60 * (384 * 7168 * 2 + 384 * 4), report.bytes_router)   -- 0.33 GB
      assert.are.equal(163840 * 7168 * 2, report.bytes_embed)
      assert.are.equal(163840 * 7168 * 2, report.bytes_lm_head)          -- 2.35 GB
      assert.are.equal(2 * 7168 * (61 * 2 + 1), report.bytes_norms)      -- input/post-attention + final
      local sum = 0
      for _, k in ipairs(KINDS) do sum = sum + report["bytes_" .. k] end
      assert.are.equal(sum, report.bytes_total)
      -- the section's rounded totals: ~594 GB checkpoint, ~33.0 GB read per decoded token
      assert.is_true(math.abs(report.bytes_total / 594e9 - 1) < 0.005, tostring(report.bytes_total))
      assert.is_true(math.abs(report.bytes_read_per_token / 33.0e9 - 1) < 0.01, tostring(report.bytes_read_per_token))
      assert.are.equal(70272, report.bytes_per_token_kv)                 -- 576 x 61 x 2
      -- read per token, exactly: all but the embedding table (one row) and 8 of 384 experts per layer
      local read = report.bytes_total - report.bytes_embed + 7168 * 2 - report.bytes_routed_experts
        + 60 * (384 * (24772608 + 48)) * 8 / 384
      assert.are.equal(read, report.bytes_read_per_token)
    end)
  end)

  describe("memory mapping and lifetime", function()
    local function mapped(path)
      local f = assert(io.open("/proc/self/maps"))
      local s = f:read("*a")
      f:close()
      return s:find(path, 1, true) ~= nil
    end

    it("maps the shards while the model is open and unmaps them at close", function()
      local d = ck.copy(K26)   -- a private path, so no other open model shares it
      local shard = d .. "/model-00001-of-00002.safetensors"
      assert.is_false(mapped(shard))
      local m = kd.open_model(d)
      assert.is_true(mapped(shard))
      m:close()
      assert.is_false(mapped(shard))
    end)

    it("kd_inspect maps nothing", function()
      local d = ck.copy(K26)
      kd.inspect(d)
      assert.is_false(mapped(d .. "/model-00001-of-00002.safetensors"))
    end)

    it("closing a model with an open sequence frees it when the sequence closes", function()
      local d = ck.copy(DSV3)
      local path = d .. "/model.safetensors"
      local m = kd.open_model(d)
      local s = m:new_seq(32)
      s:forward(PROMPT)
      local before = s:logits(#PROMPT)
      m:close()
      assert.is_true(mapped(path))            -- still held by the sequence
      s:truncate(0)
      s:forward(PROMPT)                       -- and still usable
      assert.are.same(before, s:logits(#PROMPT))
      s:close()
      assert.is_false(mapped(path))           -- the last reference freed it
    end)
  end)
end)
