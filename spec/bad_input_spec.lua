-- bad_input_spec: broken checkpoints give a Lua error that names the file, tensor or
-- field and what was expected; nothing crashes, and the engine still opens the good
-- model afterwards. Every broken checkpoint is made here, at run time, from a temp copy
-- of a shipped tiny model (spec/helpers/checkpoint.lua), so no broken file is committed.
-- (Token ids out of range and capacity overflow are covered by the forward specs.)
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local ck = require("helpers.checkpoint")

local K26, DSV3 = ck.K26, ck.DSV3
local PROMPT = { 5, 77, 300 }

-- the good models' greedy ids for PROMPT, computed once
local baseline = {}
local function good_ids(dir)
  local m = kd.open_model(dir)
  local s = m:new_seq(16)
  s:forward(PROMPT)
  local ids = s:argmax()
  s:close()
  m:close()
  return ids
end

-- after an error: the engine still opens the good model and computes the same thing
local function still_works(dir)
  dir = dir or K26
  baseline[dir] = baseline[dir] or good_ids(dir)
  assert.are.same(baseline[dir], good_ids(dir))
end

-- fn must raise a Lua error whose message contains every needle (plain text)
local function expect_error(fn, ...)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error, got success")
  err = tostring(err)
  for _, needle in ipairs({ ... }) do
    assert(err:find(needle, 1, true), string.format("error message lacks %q:\n  %s", needle, err))
  end
  return err
end

local function open(dir) return function() return kd.open_model(dir) end end
local function inspect(dir) return function() return kd.inspect(dir) end end

local function shard_of(dir, name)
  local path = ck.shard_of(dir, name)
  return path, path:match("[^/]+$")
end

-- a tensor's header entry in its shard, edited by fn(entry, header, st)
local function edit_tensor(dir, name, fn)
  local path = shard_of(dir, name)
  ck.edit_st(path, function(h, st)
    assert(h[name], "fixture lacks " .. name)
    return fn(h[name], h, st)
  end)
  return path
end

describe("bad input", function()
  setup(function()
    baseline[K26] = good_ids(K26)
    baseline[DSV3] = good_ids(DSV3)
  end)
  teardown(function() ck.cleanup() end)

  describe("missing files", function()
    it("a directory that does not exist", function()
      local d = ck.tempdir() .. "/nope"
      expect_error(open(d), d, "config.json", "cannot open")
      still_works()
    end)

    it("no config.json", function()
      local d = ck.copy(K26)
      os.remove(d .. "/config.json")
      expect_error(open(d), d .. "/config.json", "cannot open")
      expect_error(inspect(d), d .. "/config.json")
      still_works()
    end)

    it("no model.safetensors and no index", function()
      local d = ck.copy(DSV3)
      os.remove(d .. "/model.safetensors")
      expect_error(open(d), d, "neither model.safetensors nor model.safetensors.index.json")
      still_works(DSV3)
    end)

    it("a shard the index names is missing", function()
      local d = ck.copy(K26)
      os.remove(d .. "/model-00002-of-00002.safetensors")
      expect_error(open(d), d .. "/model-00002-of-00002.safetensors", "cannot open")
      still_works()
    end)
  end)

  describe("truncated or malformed safetensors", function()
    it("a file shorter than the 8-byte header length", function()
      local d = ck.copy(DSV3)
      ck.write(d .. "/model.safetensors", "abc")
      expect_error(open(d), d .. "/model.safetensors", "truncated", "3 bytes")
      expect_error(inspect(d), d .. "/model.safetensors", "truncated")
      still_works(DSV3)
    end)

    it("a header length larger than the file", function()
      local d = ck.copy(DSV3)
      local path = d .. "/model.safetensors"
      local s = ck.read(path)
      ck.write(path, ck.u64le(#s) .. s:sub(9))
      expect_error(open(d), path, "truncated", "header declares " .. #s .. " bytes")
      still_works(DSV3)
    end)

    it("a header that is not JSON", function()
      local d = ck.copy(K26)
      local path = d .. "/model-00001-of-00002.safetensors"
      local s = ck.read(path)
      local n = 0
      for i = 8, 1, -1 do n = n * 256 + s:byte(i) end
      local bad = ('{"a": not json'):sub(1, n)
      ck.write(path, s:sub(1, 8) .. bad .. string.rep(" ", n - #bad) .. s:sub(9 + n))
      expect_error(open(d), path, "not valid JSON")
      expect_error(inspect(d), path, "not valid JSON")
      still_works()
    end)

    it("a header that is JSON but not an object", function()
      local d = ck.copy(DSV3)
      local path = d .. "/model.safetensors"
      local st = ck.read_st(path)
      local hdr = "[1, 2, 3]"
      ck.write(path, ck.u64le(#hdr) .. hdr .. st.data)
      expect_error(open(d), path, "expected a JSON object")
      still_works(DSV3)
    end)

    it("a data section cut short (offsets past the end of the file)", function()
      local d = ck.copy(DSV3)
      local path = d .. "/model.safetensors"
      local s = ck.read(path)
      ck.write(path, s:sub(1, math.floor(#s / 2)))
      expect_error(open(d), path, "out of range", "data_offsets")
      still_works(DSV3)
    end)

    it("offsets out of range", function()
      local d = ck.copy(K26)
      -- move the shard's last tensor far past the end (same size: only the range is wrong)
      local path = d .. "/model-00002-of-00002.safetensors"
      local last, lastend
      for name, t in pairs(ck.read_st_header(path)) do
        if name ~= "__metadata__" and (not lastend or t.data_offsets[2] > lastend) then last, lastend = name, t.data_offsets[2] end
      end
      edit_tensor(d, last, function(t)
        t.data_offsets = { t.data_offsets[1] + 1000000, t.data_offsets[2] + 1000000 }
      end)
      expect_error(open(d), path, last, "out of range")
      still_works()
    end)

    it("overlapping ranges", function()
      local d = ck.copy(DSV3)
      local a, b = "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"
      local path = edit_tensor(d, b, function(t, h) t.data_offsets = { h[a].data_offsets[1], h[a].data_offsets[2] } end)
      expect_error(open(d), path, a, b, "overlap")
      expect_error(inspect(d), path, "overlap")
      still_works(DSV3)
    end)

    it("a shape that does not match the byte range", function()
      local d = ck.copy(DSV3)
      local name = "model.layers.0.self_attn.kv_a_layernorm.weight"
      local path = edit_tensor(d, name, function(t) t.shape = { t.shape[1] + 1 } end)
      expect_error(open(d), path, name, "[49] of BF16 needs 98 bytes", "hold 96")
      still_works(DSV3)
    end)

    it("a tensor the index lists but its shard lacks", function()
      local d = ck.copy(K26)
      local name = "language_model.model.layers.3.mlp.experts.5.down_proj.weight_scale"
      local path, file = shard_of(d, name)
      ck.edit_st(path, function(h) h[name] = nil end)
      expect_error(open(d), "model.safetensors.index.json", name, "missing from shard", file)
      still_works()
    end)
  end)

  describe("tensors the model needs", function()
    it("a missing tensor", function()
      local d = ck.copy(DSV3)
      local name = "model.layers.2.mlp.experts.7.down_proj.weight"
      ck.edit_st(d .. "/model.safetensors", function(h) h[name] = nil end)
      expect_error(open(d), d, "tensor '" .. name .. "' is missing", "BF16 [128, 32]")
      expect_error(inspect(d), name, "is missing")
      still_works(DSV3)
    end)

    it("a missing tensor in a sharded checkpoint (gone from shard and index)", function()
      local d = ck.copy(K26)
      local name = "language_model.model.layers.1.self_attn.kv_a_layernorm.weight"
      local path = shard_of(d, name)
      ck.edit_st(path, function(h) h[name] = nil end)
      local idx = ck.read_json(d .. "/model.safetensors.index.json")
      idx.weight_map[name] = nil
      ck.write_json(d .. "/model.safetensors.index.json", idx)
      expect_error(open(d), "tensor '" .. name .. "' is missing", "[32]")
      still_works()
    end)

    it("a wrong dtype", function()
      local d = ck.copy(DSV3)
      local name = "model.layers.0.self_attn.o_proj.weight"
      local path = edit_tensor(d, name, function(t) t.dtype = "I16" end)   -- same size: the header is fine
      expect_error(open(d), path, name, "expected dtype BF16", "got I16")
      still_works(DSV3)
    end)

    it("a dtype the engine does not know, on a tensor it needs", function()
      local d = ck.copy(DSV3)
      local name = "model.norm.weight"
      local path = edit_tensor(d, name, function(t) t.dtype = "F8_E4M3"; t.shape = { t.shape[1] * 2 } end)
      expect_error(open(d), path, name, "got F8_E4M3")
      still_works(DSV3)
    end)

    it("a dtype the engine does not know, on a tensor it skips, is fine", function()
      local d = ck.copy(K26)
      local vision
      for name in pairs(ck.read_json(d .. "/model.safetensors.index.json").weight_map) do
        if name:match("^vision_tower%.") then vision = name break end
      end
      assert.is_truthy(vision)
      edit_tensor(d, vision, function(t) t.dtype = "Q9_WEIRD" end)
      local m = kd.open_model(d)
      m:close()
      assert.are.equal(kd.inspect(K26).n_skipped, kd.inspect(d).n_skipped)
    end)

    it("a wrong shape (transposed)", function()
      local d = ck.copy(K26)
      local name = "language_model.model.layers.1.self_attn.kv_b_proj.weight"
      local path = edit_tensor(d, name, function(t) t.shape = { t.shape[2], t.shape[1] } end)
      expect_error(open(d), path, name, "expected shape [128, 32]", "got [32, 128]")
      expect_error(inspect(d), name, "expected shape [128, 32]")
      still_works()
    end)

    it("an INT4 scale with the wrong dtype", function()
      local d = ck.copy(K26)
      local name = "language_model.model.layers.2.mlp.experts.3.up_proj.weight_scale"
      local path = edit_tensor(d, name, function(t) t.dtype = "F16" end)
      expect_error(open(d), path, name, "expected dtype BF16", "got F16")
      still_works()
    end)

    it("an INT4 weight_shape whose values disagree with the config", function()
      local d = ck.copy(K26)
      local name = "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_shape"
      local path = edit_tensor(d, name, function(t, h, st)
        local b = t.data_offsets[1]
        return st.data:sub(1, b) .. ck.u64le(63) .. st.data:sub(b + 9)
      end)
      expect_error(open(d), path, name, "expected the values [64, 128]", "got [63, 128]")
      still_works()
    end)

    it("an INT4 packed tensor with the wrong shape", function()
      local d = ck.copy(K26)
      local name = "language_model.model.layers.2.mlp.experts.9.down_proj.weight_packed"
      local path = edit_tensor(d, name, function(t) t.shape = { t.shape[1] / 2, t.shape[2] * 2 } end)
      expect_error(open(d), path, name, "expected shape [128, 8]", "got [64, 16]")
      still_works()
    end)

    it("an ignore list that disagrees with the checkpoint", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text)
        local keep = {}
        for _, p in ipairs(text.quantization_config.ignore) do
          if p ~= "re:.*self_attn.*" then keep[#keep + 1] = p end
        end
        text.quantization_config.ignore = keep
      end)
      expect_error(open(d), "language_model.model.layers.0.self_attn.q_a_proj.weight_packed", "is missing",
        "holds 'language_model.model.layers.0.self_attn.q_a_proj.weight'")
      still_works()
    end)
  end)

  describe("config.json", function()
    it("not JSON", function()
      local d = ck.copy(K26)
      ck.write(d .. "/config.json", '{"model_type": "kimi_k25", ')
      expect_error(open(d), d .. "/config.json", "not valid JSON")
      still_works()
    end)

    it("a required field missing", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.hidden_size = nil end)
      expect_error(open(d), "config.json", "text_config.hidden_size", "missing")
      expect_error(inspect(d), "config.json", "text_config.hidden_size", "missing")
      still_works()
    end)

    it("q_lora_rank missing (it must be a number or null)", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg, text) text.q_lora_rank = nil end)
      expect_error(open(d), "config.json", "q_lora_rank", "missing")
      still_works(DSV3)
    end)

    it("a field of the wrong type", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg, text) text.num_attention_heads = "4" end)
      expect_error(open(d), "config.json", "num_attention_heads", 'is "4": expected an integer')
      still_works(DSV3)
    end)

    it("a non-positive dimension", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg, text) text.kv_lora_rank = 0 end)
      expect_error(open(d), "config.json", "kv_lora_rank", "is 0: expected an integer in 1..")
      still_works(DSV3)
    end)

    it("heads not dividing: num_key_value_heads", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.num_key_value_heads = 3 end)
      expect_error(open(d), "config.json", "text_config.num_key_value_heads", "num_attention_heads (4)")
      still_works()
    end)

    it("n_group not dividing n_routed_experts", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg, text) text.n_group = 3 end)
      expect_error(open(d), "config.json", "n_group", "divisor of n_routed_experts (16)")
      still_works(DSV3)
    end)

    it("topk_group larger than n_group", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg, text) text.topk_group = 5 end)
      expect_error(open(d), "config.json", "topk_group", "1..n_group (4)")
      still_works(DSV3)
    end)

    it("num_experts_per_tok larger than the experts the groups keep", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg, text) text.num_experts_per_tok = 9 end)   -- 2 groups of 4 kept
      expect_error(open(d), "config.json", "num_experts_per_tok", "topk_group (2) groups of 4")
      still_works(DSV3)
    end)

    it("first_k_dense_replace past the layer count", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg, text) text.first_k_dense_replace = 7 end)
      expect_error(open(d), "config.json", "first_k_dense_replace", "num_hidden_layers (3)")
      still_works(DSV3)
    end)

    it("an unsupported model_type", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg) cfg.model_type = "llama" end)
      expect_error(open(d), "config.json", "model_type", "llama", "deepseek_v3")
      still_works(DSV3)
    end)

    it("an unsupported rope type", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.rope_scaling.type = "longrope"; text.rope_scaling.rope_type = nil end)
      expect_error(open(d), "config.json", "rope_scaling.type", "longrope", "yarn")
      still_works()
    end)

    it("generation_config.json eos of the wrong type", function()
      local d = ck.copy(K26)
      ck.write_json(d .. "/generation_config.json", { eos_token_id = "1001" })
      expect_error(open(d), "generation_config.json", "eos_token_id", '"1001"', "expected a token id")
      still_works()
    end)
  end)

  describe("quantization_config", function()
    it("an unknown quantization method", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.quantization_config.quant_method = "awq" end)
      local err = expect_error(open(d), "config.json", "quant_method", "awq", "compressed-tensors")
      assert.is_truthy(err:find("(unsupported)", 1, true))
      expect_error(inspect(d), "quant_method", "awq")
      still_works()
    end)

    it("fp8 block quantization (K2-Instruct) is refused by name", function()
      local d = ck.copy(DSV3)
      ck.edit_config(d, function(cfg, text)
        text.quantization_config = { quant_method = "fp8", fmt = "e4m3", weight_block_size = { 128, 128 } }
      end)
      expect_error(open(d), "config.json", "quantization_config.quant_method", "fp8")
      still_works(DSV3)
    end)

    it("a format other than pack-quantized", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.quantization_config.format = "float-quantized" end)
      expect_error(open(d), "config.json", "format", "float-quantized", "pack-quantized")
      still_works()
    end)

    it("8-bit weights", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.quantization_config.config_groups.group_0.weights.num_bits = 8 end)
      expect_error(open(d), "config.json", "config_groups.group_0.weights.num_bits", "supported: 4")
      still_works()
    end)

    it("a group size that does not divide hidden_size", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.quantization_config.config_groups.group_0.weights.group_size = 48 end)
      expect_error(open(d), "config.json", "group_size", "48", "hidden_size (128)")
      still_works()
    end)

    it("a group size that does not divide moe_intermediate_size", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.quantization_config.config_groups.group_0.weights.group_size = 128 end)
      expect_error(open(d), "config.json", "group_size", "128", "moe_intermediate_size (64)")
      still_works()
    end)

    it("a config group size that disagrees with the stored scales", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) text.quantization_config.config_groups.group_0.weights.group_size = 16 end)
      expect_error(open(d), "weight_scale", "expected shape [64, 8]", "got [64, 4]")
      still_works()
    end)

    it("an ignore pattern that is not a regular expression", function()
      local d = ck.copy(K26)
      ck.edit_config(d, function(cfg, text) table.insert(text.quantization_config.ignore, "re:.*(unclosed") end)
      expect_error(open(d), "config.json", "quantization_config.ignore", "re:.*(unclosed")
      still_works()
    end)
  end)

  it("options: more ranks than a model spans, a device list that does not match tp", function()
    local ok, err = pcall(kd.open_model, K26, { tp = 9 })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("options.tp is 9: expected 1..8", 1, true), tostring(err))
    ok, err = pcall(kd.open_model, K26, { tp = 2, devices = { 0 } })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("options.devices lists 1 devices for tp 2", 1, true), tostring(err))
    still_works()
  end)
end)
