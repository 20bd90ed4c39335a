-- options.lua: Lua option tables -> kd_model_options / kd_seq_options (kdtree.h), and the old
-- environment variables mapped to option tables. The library reads no environment: the CLI and
-- the REPL call from_env() for compatibility (explicit flags win), kd.open_model does not.
local ffi = require("ffi")

local O = {}

-- the enums' names (kdtree.h); nil = the default
O.GRAPHS = { on = 1, off = 2, eager = 3 }
O.ROUND = { backend = 1, host = 2 }
O.MLA_KERNEL = { tensor_cores = 0, cuda_cores = 1 }
O.BACKENDS = { cpu = 0, cuda = 1 }

-- '"a", "b" or "c"'
local function names(map)
  local t = {}
  for k in pairs(map) do t[#t + 1] = '"' .. k .. '"' end
  table.sort(t)
  return #t == 1 and t[1] or table.concat(t, ", ", 1, #t - 1) .. " or " .. t[#t]
end
local function shown(v) return type(v) == "string" and string.format("%q", v) or tostring(v) end

local function fail(fn, fmt, ...) error("kdtree: " .. fn .. ": " .. string.format(fmt, ...), 4) end

local function enum(fn, field, map, v)
  if v == nil then return 0 end
  local x = map[v]
  if x == nil then fail(fn, "%s: expected %s, got %s", field, names(map), shown(v)) end
  return x
end

local function int(fn, field, v)
  if v == nil then return 0 end
  if type(v) ~= "number" or v ~= math.floor(v) then fail(fn, "%s: expected an integer, got %s", field, tostring(v)) end
  return v
end

local function known(fn, t, fields)
  for k in pairs(t) do
    if not fields[k] then fail(fn, "unknown option %s", tostring(k)) end
  end
end

local MODEL_FIELDS = { backend = true, tp = true, devices = true, progress = true, graphs = true, draft_graphs = true,
  graphs_verbose = true, ddtree_round = true, mla_kernel = true, mla_value_slices = true, mla_row_groups = true,
  shared_expert_branch = true, seq = true }
local SEQ_FIELDS = { max_rows = true, graphs = true, draft_graphs = true }

-- a kd_model_options from t (nil fields: defaults; backend nil: "cpu"), and the C callback made
-- for t.progress (nil without one), which the caller frees once kd_model_open returned
function O.model(t)
  local fn = "open_model"
  known(fn, t, MODEL_FIELDS)
  local o = ffi.new("kd_model_options")
  o.backend = enum(fn, "backend", O.BACKENDS, t.backend or "cpu")
  o.tp = int(fn, "tp", t.tp)
  if t.devices ~= nil then
    if type(t.devices) ~= "table" or #t.devices > 8 then fail(fn, "devices: expected a list of at most 8 device indices") end
    for i, d in ipairs(t.devices) do o.devices[i - 1] = int(fn, string.format("devices[%d]", i), d) end
    o.n_device_list = #t.devices
  end
  local cb
  if t.progress ~= nil then
    if type(t.progress) ~= "function" then
      fail(fn, "progress: expected a function(rank, done, total), got %s", type(t.progress))
    end
    local progress = t.progress
    -- called on this thread only (kd_model_options.progress), so a Lua callback is safe
    cb = ffi.cast("void (*)(void *, int, uint64_t, uint64_t)", function(_, rank, done, total)
      progress(rank, tonumber(done), tonumber(total))
    end)
    o.progress = cb
  end
  o.graphs = enum(fn, "graphs", O.GRAPHS, t.graphs)
  o.draft_graphs = enum(fn, "draft_graphs", O.GRAPHS, t.draft_graphs)
  if t.graphs_verbose ~= nil and type(t.graphs_verbose) ~= "boolean" then
    fail(fn, "graphs_verbose: expected a boolean, got %s", tostring(t.graphs_verbose))
  end
  o.graphs_verbose = t.graphs_verbose and 1 or 0
  o.ddtree_round = enum(fn, "ddtree_round", O.ROUND, t.ddtree_round)
  o.mla_kernel = enum(fn, "mla_kernel", O.MLA_KERNEL, t.mla_kernel)
  o.mla_value_slices = int(fn, "mla_value_slices", t.mla_value_slices)
  o.mla_row_groups = int(fn, "mla_row_groups", t.mla_row_groups)
  if t.shared_expert_branch ~= nil and type(t.shared_expert_branch) ~= "boolean" then
    fail(fn, "shared_expert_branch: expected a boolean, got %s", tostring(t.shared_expert_branch))
  end
  o.shared_expert_branch = t.shared_expert_branch == nil and 0 or (t.shared_expert_branch and 1 or -1)
  if t.seq ~= nil and type(t.seq) ~= "table" then fail(fn, "seq: expected a table of sequence options, got %s", type(t.seq)) end
  if t.seq then known(fn .. ": seq", t.seq, SEQ_FIELDS) end
  return o, cb
end

-- a kd_seq_options from t
function O.seq(t)
  local fn = "new_seq"
  known(fn, t, SEQ_FIELDS)
  local o = ffi.new("kd_seq_options")
  o.max_rows = int(fn, "max_rows", t.max_rows)
  o.graphs = enum(fn, "graphs", O.GRAPHS, t.graphs)
  o.draft_graphs = enum(fn, "draft_graphs", O.GRAPHS, t.draft_graphs)
  return o
end

-- The command line's flags for the enum options: flag, option, names, value name, help
O.FLAGS = {
  { "--graphs", "graphs", O.GRAPHS, "MODE", "step graphs: on | off | eager (default on where the backend has them)" },
  { "--draft-graphs", "draft_graphs", O.GRAPHS, "MODE", "the draft pass's graphs: on | off | eager (default: as --graphs)" },
  { "--ddtree-round", "ddtree_round", O.ROUND, "WHERE", "where the DDTree round runs: backend | host (default backend)" },
  { "--mla-kernel", "mla_kernel", O.MLA_KERNEL, "NAME", "CUDA attention: tensor_cores | cuda_cores (default tensor_cores)" },
}

-- The model options of parsed flags (o[option] = string), checked: returns the options table, or
-- nil and a message naming the flag
function O.from_flags(o)
  local t = { backend = o.backend }
  for _, f in ipairs(O.FLAGS) do
    local v = o[f[2]]
    if v ~= nil and f[3][v] == nil then
      return nil, string.format("%s: expected %s, got '%s'", f[1], names(f[3]), tostring(v))
    end
    t[f[2]] = v
  end
  return t
end

-- The environment variables the library read before these options (compatibility only):
-- KDTREE_BACKEND, KDTREE_CUDA_GRAPHS (0|off, 1|on, eager), KDTREE_CUDA_DRAFT_GRAPHS (0|off),
-- KDTREE_CUDA_GRAPHS_VERBOSE, KDTREE_DDTREE_DEVICE (0|off: host), KDTREE_MLA_TC (0: CUDA cores),
-- KDTREE_MLA_TC_VSPLIT (0: no split, 1|2|4), KDTREE_MLA_TC_RG (1|4), KDTREE_SEQ_ROWS (max_rows).
-- Returns t with every option it does not set taken from them (a new table).
function O.from_env(t, getenv)
  getenv = getenv or os.getenv
  local r = {}
  for k, v in pairs(t or {}) do r[k] = v end
  local function env(name) local v = getenv(name); if v and v ~= "" then return v end end
  local function set(k, v) if r[k] == nil and v ~= nil then r[k] = v end end
  set("backend", env("KDTREE_BACKEND"))
  local g = env("KDTREE_CUDA_GRAPHS")
  set("graphs", g and ((g == "1" or g == "on") and "on" or g == "eager" and "eager" or "off"))
  local dg = env("KDTREE_CUDA_DRAFT_GRAPHS")
  set("draft_graphs", (dg == "0" or dg == "off") and "off" or nil)
  local vb = env("KDTREE_CUDA_GRAPHS_VERBOSE")
  set("graphs_verbose", vb and vb ~= "0" or nil)
  local dd = env("KDTREE_DDTREE_DEVICE")
  set("ddtree_round", dd and ((dd == "0" or dd == "off") and "host" or "backend"))
  set("mla_kernel", env("KDTREE_MLA_TC") == "0" and "cuda_cores" or nil)
  local vs = env("KDTREE_MLA_TC_VSPLIT")
  set("mla_value_slices", vs == "0" and -1 or (vs == "1" or vs == "2" or vs == "4") and tonumber(vs) or nil)
  local rg = env("KDTREE_MLA_TC_RG")
  set("mla_row_groups", (rg == "1" or rg == "4") and tonumber(rg) or nil)
  local rows = tonumber(env("KDTREE_SEQ_ROWS") or "")
  if rows and rows > 0 and rows == math.floor(rows) then
    local seq = {}
    for k, v in pairs(r.seq or {}) do seq[k] = v end
    if seq.max_rows == nil then seq.max_rows = rows end
    r.seq = seq
  end
  return r
end

return O
