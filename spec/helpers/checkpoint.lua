-- spec/helpers/checkpoint.lua: read, edit and write checkpoint directories in plain Lua,
-- so that specs can make broken or altered copies of the shipped tiny models at run time
-- (fixtures stay tiny: nothing broken is committed).
--
--   local ck = require("spec.helpers.checkpoint")    -- or dofile
--   local dir = ck.copy(ck.K26)                       -- a temp copy; ck.cleanup() removes them all
--   ck.edit_config(dir, function(cfg, text) text.hidden_size = nil end)
--   ck.edit_st(dir .. "/model-00001-of-00002.safetensors", function(h) h["x"] = nil end)
local json = require("dkjson")
local ffi = require("ffi")

local M = {}

-- the shipped tiny models (override the root with KDTREE_FIXTURE_ROOT, e.g. a regenerated tree)
local root = os.getenv("KDTREE_FIXTURE_ROOT") or "."
M.K26 = root .. "/models/tiny-k2.6"
M.DSV3 = root .. "/spec/fixtures/tiny-dsv3"

local function sh(cmd)
  local ok = os.execute(cmd)
  assert(ok == true or ok == 0, "command failed: " .. cmd)
end
local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

function M.read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end
function M.write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end
function M.exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

function M.decode(s) return json.decode(s, 1, json.null) end
function M.encode(t) return json.encode(t) end
M.null = json.null

-- temp directories, removed by cleanup()
local temps = {}
function M.tempdir()
  local name = os.tmpname()
  os.remove(name)
  sh("mkdir -p " .. q(name))
  temps[#temps + 1] = name
  return name
end
function M.cleanup()
  for _, d in ipairs(temps) do os.execute("rm -rf " .. q(d)) end
  temps = {}
end
function M.copy(src)
  local d = M.tempdir()
  sh("cp -r " .. q(src) .. "/. " .. q(d))
  return d
end

-- ---- JSON files ----
function M.read_json(path) return M.decode(M.read(path)) end
function M.write_json(path, t) M.write(path, M.encode(t)) end

-- config.json; fn(cfg, text) where text is cfg.text_config (kimi_k25) or cfg itself
function M.edit_config(dir, fn)
  local cfg = M.read_json(dir .. "/config.json")
  local text = type(cfg.text_config) == "table" and cfg.text_config or cfg
  fn(cfg, text)
  M.write_json(dir .. "/config.json", cfg)
end
function M.text_config(dir)
  local cfg = M.read_json(dir .. "/config.json")
  return type(cfg.text_config) == "table" and cfg.text_config or cfg, cfg
end

-- ---- safetensors ----
-- u64 little endian <-> Lua number (exact below 2^53)
local function u64le(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end
local function le64(s, at)
  local n = 0
  for i = at + 7, at, -1 do n = n * 256 + s:byte(i) end
  return n
end
M.u64le = u64le

-- {header = table, data = string (the data section), hlen = number}
function M.read_st(path)
  local s = M.read(path)
  local n = le64(s, 1)
  return { header = M.decode(s:sub(9, 8 + n)), data = s:sub(9 + n), hlen = n }
end
-- the header alone, for files whose data section may be absent
function M.read_st_header(path)
  local f = assert(io.open(path, "rb"))
  local len = f:read(8)
  local n = le64(len, 1)
  local h = f:read(n)
  f:close()
  return M.decode(h)
end

function M.header_bytes(header)
  local h = json.encode(header)
  h = h .. string.rep(" ", (8 - #h % 8) % 8)   -- pad, as the safetensors writer does
  return u64le(#h) .. h
end
function M.write_st(path, header, data)
  M.write(path, M.header_bytes(header) .. (data or ""))
end
-- rewrite a file's header with fn(header, st); fn may also return new data
function M.edit_st(path, fn)
  local st = M.read_st(path)
  local data = fn(st.header, st) or st.data
  M.write_st(path, st.header, data)
end

-- the shard that holds `name` in dir (sharded or single-file)
function M.shard_of(dir, name)
  local ipath = dir .. "/model.safetensors.index.json"
  if M.exists(ipath) then return dir .. "/" .. M.read_json(ipath).weight_map[name] end
  return dir .. "/model.safetensors"
end

-- every tensor of a checkpoint: name -> {dtype, shape, data_offsets, file}
function M.tensors(dir)
  local out, files = {}, {}
  local ipath = dir .. "/model.safetensors.index.json"
  if M.exists(ipath) then
    local seen = {}
    for _, f in pairs(M.read_json(ipath).weight_map) do
      if not seen[f] then seen[f] = true; files[#files + 1] = f end
    end
  else
    files[1] = "model.safetensors"
  end
  for _, f in ipairs(files) do
    for name, t in pairs(M.read_st_header(dir .. "/" .. f)) do
      if name ~= "__metadata__" then t.file = f; out[name] = t end
    end
  end
  return out, files
end

-- element sizes of the dtypes the engine knows
M.DTYPE_SIZE = { F32 = 4, F16 = 2, BF16 = 2, I32 = 4, I64 = 8, F64 = 8, I16 = 2, I8 = 1, U8 = 1, F8_E4M3 = 1 }

-- bytes <-> numbers
function M.f32_bytes(values)
  local n = #values
  local buf = ffi.new("float[?]", n)
  for i = 1, n do buf[i - 1] = values[i] end
  return ffi.string(buf, 4 * n)
end
function M.i32_at(s, i)   -- i-th int32 (0-based) of a byte string
  return ffi.cast("const int32_t*", s)[i]
end

return M
