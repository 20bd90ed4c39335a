-- util.lua: conversions between Lua tables and the C structs/arrays of kdtree.h.
local ffi = require("ffi")

local U = {}

local MODEL_INFO_INT = { "n_layers", "first_k_dense", "hidden", "vocab", "n_heads", "q_lora_rank",
  "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim", "intermediate", "moe_intermediate",
  "n_experts", "n_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
  "expert_bits", "expert_group", "max_positions", "n_eos", "bos", "tp" }
local MODEL_INFO_FLOAT = { "rms_norm_eps", "routed_scaling_factor", "rope_theta", "softmax_scale" }
local BACKEND_NAMES = { [0] = "cpu", [1] = "cuda" }
U.BACKENDS = { cpu = 0, cuda = 1 }
U.BACKEND_NAMES = BACKEND_NAMES

function U.model_info(ci)
  local t = {}
  for _, k in ipairs(MODEL_INFO_INT) do t[k] = tonumber(ci[k]) end
  for _, k in ipairs(MODEL_INFO_FLOAT) do t[k] = tonumber(ci[k]) end
  t.norm_topk_prob = t.norm_topk_prob ~= 0
  t.eos = {}
  for i = 0, t.n_eos - 1 do t.eos[#t.eos + 1] = tonumber(ci.eos[i]) end
  t.backend = BACKEND_NAMES[tonumber(ci.backend)] or tostring(tonumber(ci.backend))
  t.bytes_weights = tonumber(ci.bytes_weights)
  -- the tensor-parallel split: what each of the tp ranks holds
  t.split = { heads = tonumber(ci.heads_per_rank), intermediate = tonumber(ci.intermediate_per_rank),
    moe_intermediate = tonumber(ci.moe_intermediate_per_rank), vocab = tonumber(ci.vocab_per_rank) }
  return t
end

local REPORT_INT = { "n_tensors", "n_files", "n_skipped" }
local REPORT_BYTES = { "bytes_attention", "bytes_dense_mlp", "bytes_shared_experts",
  "bytes_routed_experts", "bytes_router", "bytes_embed", "bytes_lm_head", "bytes_norms",
  "bytes_total", "bytes_per_token_kv", "bytes_read_per_token" }
U.REPORT_BYTES = REPORT_BYTES

function U.inspect_report(cr)
  local t = { info = U.model_info(cr.info) }
  t.info.bytes_weights = nil -- nothing is loaded by inspect
  for _, k in ipairs(REPORT_INT) do t[k] = tonumber(cr[k]) end
  -- uint64 -> Lua number: exact below 2^53 bytes (8 PiB)
  for _, k in ipairs(REPORT_BYTES) do t[k] = tonumber(cr[k]) end
  return t
end

local PLAN_BYTES = { "device_bytes", "margin", "weights_attention", "weights_dense_mlp", "weights_shared_experts",
  "weights_routed_experts", "weights_router", "weights_embed", "weights_lm_head", "weights_norms", "weights_total",
  "weights_replicated", "kv_per_1k", "kv_cache", "logits", "scratch", "workspace", "total", "max_capacity" }
U.PLAN_BYTES = PLAN_BYTES

function U.plan_report(cr)
  local t = { tp = tonumber(cr.tp), capacity = tonumber(cr.capacity), out_cap = tonumber(cr.out_cap),
    message = ffi.string(cr.message) }
  local f = tonumber(cr.fits)
  if f >= 0 then t.fits = f == 1 end
  for _, k in ipairs(PLAN_BYTES) do t[k] = tonumber(cr[k]) end
  return t
end

local DRAFTER_INT = { "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate",
  "block_size", "mask_token_id", "n_taps" }
function U.drafter_info(ci)
  local t = {}
  for _, k in ipairs(DRAFTER_INT) do t[k] = tonumber(ci[k]) end
  t.taps = {}
  for i = 0, t.n_taps - 1 do t.taps[#t.taps + 1] = tonumber(ci.taps[i]) end
  return t
end

-- int32 array from a Lua list (or pass through cdata with an explicit n)
function U.int32s(list, n, what)
  if type(list) == "cdata" then
    if not n then error("kdtree: " .. what .. ": a cdata array needs its length", 3) end
    return list, n
  end
  if type(list) ~= "table" then
    error("kdtree: " .. what .. ": expected a list of integers, got " .. type(list), 3)
  end
  n = n or #list
  local a = ffi.new("int32_t[?]", math.max(n, 1))
  for i = 1, n do
    local v = list[i]
    if type(v) ~= "number" or v ~= math.floor(v) then
      error(string.format("kdtree: %s[%d]: expected an integer, got %s", what, i, tostring(v)), 3)
    end
    if v < -2147483648 or v > 2147483647 then   -- an int32_t store would wrap it silently
      error(string.format("kdtree: %s[%d]: %.0f does not fit in 32 bits", what, i, v), 3)
    end
    a[i - 1] = v
  end
  return a, n
end

function U.list_from(arr, n, offset)
  local t = {}
  offset = offset or 0
  for i = 0, n - 1 do t[i + 1] = tonumber(arr[offset + i]) end
  return t
end

-- a kd_sampler from a Lua table {temperature=, top_k=, top_p=, min_p=, seed=}; nil -> nil
function U.sampler(sp)
  if sp == nil then return nil end
  if type(sp) == "cdata" then return sp end
  if type(sp) ~= "table" then error("kdtree: sampler: expected a table, got " .. type(sp), 3) end
  local c = ffi.new("kd_sampler")
  c.temperature = sp.temperature or 0
  c.top_k = sp.top_k or 0
  c.top_p = sp.top_p or 1
  c.seed = sp.seed or 0
  c.min_p = sp.min_p or 0
  return c
end

-- the path of a checkpoint shipped with kdtree ("mini-code"): models/ beside lua/ in the source
-- tree, PREFIX/share/kdtree/models beside PREFIX/share/lua/5.1 when installed
local lua_dir = debug.getinfo(1, "S").source:match("^@(.*)/kdtree/util%.lua$") or "."
function U.shipped(name)
  if type(name) ~= "string" then error("kdtree: shipped: expected a checkpoint name, got " .. type(name), 2) end
  local tried = {}
  for _, root in ipairs({ lua_dir .. "/../models", lua_dir .. "/../../kdtree/models" }) do
    local dir = root .. "/" .. name
    repeat local prev = dir; dir = dir:gsub("[^/%.][^/]*/%.%./", "", 1) until dir == prev   -- lua/../m -> m
    local f = io.open(dir .. "/config.json")
    if f then f:close(); return dir end
    tried[#tried + 1] = dir
  end
  error("kdtree: shipped: no checkpoint '" .. name .. "' (looked in " .. table.concat(tried, ", ") .. ")", 2)
end

return U
