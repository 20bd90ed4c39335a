-- spec/helpers/backend.lua: the backend interface (core/backend.h) through the LuaJIT FFI,
-- for specs that call backend ops directly (CPU ops against Lua references; CUDA ops
-- against their CPU twins). The declarations come from backend.h itself: its preprocessor
-- lines are dropped and so is the tail of static inline helpers, which the FFI cannot parse.
local K = require("kdtree.ffi")
local ffi, C = K.ffi, K.C

local M = { ffi = ffi, C = C }

-- the compute ops of backend.h's X-macro list KD_BACKEND_OPS, in order: { name, params } each
-- (params with its parentheses, comments removed)
local function op_list(text)
  local body = assert(text:match("#define KD_BACKEND_OPS%(X%)(.-)\n\n"), "backend.h: no KD_BACKEND_OPS list")
  body = body:gsub("/%*.-%*/", " "):gsub("\\\n", " ")
  local ops = {}
  for name, params in body:gmatch("X%(%s*([%w_]+)%s*,%s*(%b())") do ops[#ops + 1] = { name = name, params = params } end
  return ops
end

-- backend.h for the FFI: preprocessor lines dropped, the op list's expansion in the op table
-- written out, the tail of static inline helpers cut
local function cdef_backend()
  local path = K.header:gsub("kdtree%.h$", "backend.h")   -- a source tree's core/
  local text = assert(io.open(path)):read("*a")
  M.ops = op_list(text)
  local entries = {}
  for _, op in ipairs(M.ops) do entries[#entries + 1] = "kd_status (*" .. op.name .. ")" .. op.params .. ";" end
  text = text:match("^(.-)/%* helpers shared by both backends") or text
  text = text:gsub("KD_BACKEND_OPS%(KD_OP_ENTRY%)", table.concat(entries, " "))
  local lines, continued = {}, false
  for line in (text .. "\n"):gmatch("(.-)\n") do
    local directive = continued or line:match("^%s*#")
    continued = directive and line:match("\\$") ~= nil
    if not directive then lines[#lines + 1] = line end
  end
  ffi.cdef(table.concat(lines, "\n"))
end
cdef_backend()
require("helpers.testlib")   -- the backend's creation is exported by the test library only

-- a backend by kind ("cpu" or "cuda"), freed by gc
function M.create(kind)
  local out = ffi.new("kd_backend*[1]")
  local k = kind == "cuda" and C.KD_BACKEND_CUDA or C.KD_BACKEND_CPU
  K.check(C.kd_test_raw_backend_new(k, 0, nil, out), "backend create (" .. tostring(kind) .. ")")
  return ffi.gc(out[0], function(be) be.ops.destroy(be) end)
end

-- an fp32 activation view over a Lua-owned float array (CPU backend: host memory)
function M.act(data, rows, cols, ld)
  local a = ffi.new("kd_act")
  a.data, a.rows, a.cols, a.ld, a.dtype = data, rows, cols, ld or cols, C.KD_F32
  return a
end

-- bf16 helpers: round to nearest even, exactly as the engine stores bf16
function M.f32_to_bf16(x)
  local f = ffi.new("float[1]", x)
  local u = ffi.cast("uint32_t*", f)[0]
  local r = bit.rshift(u + 0x7fff + bit.band(bit.rshift(u, 16), 1), 16)
  return bit.band(r, 0xffff)
end
function M.bf16_to_f32(h)
  local u = ffi.new("uint32_t[1]", bit.lshift(h, 16))
  return tonumber(ffi.cast("float*", u)[0])
end
-- round a Lua number to fp32
function M.f32(x) return tonumber(ffi.new("float", x)) end

-- a bf16 weight [rows, cols] from a Lua function f(r, c) (0-based); returns the weight
-- (its storage kept alive in w._keep) and the exact values it holds as a Lua table rows x cols
function M.bf16_weight(name, rows, cols, f)
  local buf = ffi.new("uint16_t[?]", rows * cols)
  local vals = {}
  for r = 0, rows - 1 do
    local row = {}
    for c = 0, cols - 1 do
      local h = M.f32_to_bf16(f(r, c))
      buf[r * cols + c] = h
      row[c + 1] = M.bf16_to_f32(h)
    end
    vals[r + 1] = row
  end
  local w = ffi.new("kd_weight")
  local cname = ffi.new("char[?]", #name + 1, name)
  w.name, w.format, w.rows, w.cols, w.src = cname, C.KD_W_BF16, rows, cols, buf
  return { w = w, vals = vals, _keep = { buf, cname } }
end

return M
