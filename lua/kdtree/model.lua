-- model.lua: the target model object (kd_model).
local K = require("kdtree.ffi")
local H = require("kdtree.handle")
local U = require("kdtree.util")
local Options = require("kdtree.options")
local ffi, C, check = K.ffi, K.C, K.check

local Model = {}
Model.__index = Model
Model.__tostring = function(m)
  if rawget(m, "_h") == nil then return "kdtree.model (closed)" end
  local i = m.info
  return string.format("kdtree.model(%s, %d layers, hidden %d, vocab %d, %s%s)", m.dir, i.n_layers,
    i.hidden, i.vocab, i.backend, i.tp > 1 and (" x " .. i.tp .. " ranks") or "")
end

local function free_model(p) C.kd_model_close(p) end

-- Model.open(dir, opts): opts.backend = "cpu" | "cuda" (default env KDTREE_BACKEND or "cpu"),
-- opts.tp = ranks (tensor parallel, 1..8), opts.devices = { device of each rank } (CUDA;
-- default 0..tp-1), opts.progress = function(rank, bytes_done, bytes_total) called while the
-- weights load (about every 1% of rank 0's part, and once per rank at the end), the behaviour
-- switches of kd_model_options (graphs, draft_graphs = "on" | "off" | "eager"; graphs_verbose; ddtree_round = "backend" | "host"; mla_kernel =
-- "cuda_cores"; mla_value_slices, mla_row_groups; docs/lua-api.md) and opts.seq: the options
-- every m:new_seq starts from (max_rows, graphs, draft_graphs)
function Model.open(dir, opts)
  opts = opts or {}
  if type(dir) ~= "string" then error("kdtree: open_model: expected a directory path, got " .. type(dir), 2) end
  if type(opts) ~= "table" then error("kdtree: open_model: options: expected a table, got " .. type(opts), 2) end
  local given = opts
  opts = {}
  for k, v in pairs(given) do opts[k] = v end
  opts.backend = opts.backend or os.getenv("KDTREE_BACKEND") or "cpu"
  local o, cb = Options.model(opts)
  local out = ffi.new("kd_model*[1]")
  local rc = C.kd_model_open(dir, o, out)
  if cb then cb:free() end
  check(rc, "kd_model_open(" .. dir .. ")")
  local st, h = H.own(out[0], "kd_model*", free_model, "model")
  local ci = ffi.new("kd_model_info")
  local m = setmetatable({ _h = h, _st = st, dir = dir, seq_options = opts.seq or {} }, Model)
  local ok, err = pcall(function() check(C.kd_model_get_info(h, ci), "kd_model_get_info") end)
  if not ok then H.close(m); error(err, 0) end
  m.info = U.model_info(ci)
  return m
end

function Model:handle() return H.get(self, "model") end
function Model:is_closed() return rawget(self, "_h") == nil end

-- a new sequence with room for `capacity` tokens (committed + pending tree nodes); opts: the
-- kd_seq_options fields (max_rows, graphs, draft_graphs), over m.seq_options (opts.seq at open)
function Model:new_seq(capacity, opts)
  local Seq = require("kdtree.seq")
  local o = {}
  for k, v in pairs(self.seq_options) do o[k] = v end
  for k, v in pairs(opts or {}) do o[k] = v end
  return Seq.new(self, capacity, o)
end

-- refresh info (bytes_weights may change as the backend allocates)
function Model:get_info()
  local ci = ffi.new("kd_model_info")
  check(C.kd_model_get_info(H.get(self, "model"), ci), "kd_model_get_info")
  self.info = U.model_info(ci)
  return self.info
end

-- memory by component (kd_model_memory_rank) on the device of rank (0-based; default 0, where
-- the drafters and trees live too): a table of byte counts (Lua numbers, exact below 2^53),
-- backend = "cpu" | "cuda", and the step-graph counters
local MEMORY_FIELDS = { "weights_attention", "weights_dense_mlp", "weights_shared_experts",
  "weights_routed_experts", "weights_router", "weights_embed", "weights_lm_head", "weights_norms",
  "weights_total", "weights_allocated", "drafter_weights", "kv_cache", "activations", "drafter_cache",
  "trees", "workspace", "other", "total", "mapped", "device_free", "device_total", "n_seqs", "graphs",
  "graph_captures", "graph_launches", "graph_fallbacks" }

function Model:memory(rank)
  local r = ffi.new("kd_memory_report")
  check(C.kd_model_memory_rank(H.get(self, "model"), rank or 0, r), "kd_model_memory")
  local t = {}
  for _, k in ipairs(MEMORY_FIELDS) do t[k] = tonumber(r[k]) end
  t.backend = U.BACKEND_NAMES[tonumber(r.backend)] or tostring(tonumber(r.backend))
  return t
end

-- closing marks the model closed for Lua; the weights are freed at once, or when
-- the last sequence / drafter using them is closed
function Model:close() H.close(self) end

return Model
