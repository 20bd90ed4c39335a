-- spec/helpers/ops.lua: the op test surface (spec/c/kdtree_testing.h) through the LuaJIT FFI,
-- for specs that run one backend op on the CPU and on CUDA and compare.
-- The declarations come from kdtree_testing.h itself (FFI-clean, read after kdtree.h).
local K = require("kdtree.ffi")
local ffi, C = K.ffi, K.C

local assert = require("luassert")   -- busted's assert (a module does not see the spec's environment)

local M = { ffi = ffi, C = C }

require("helpers.testlib")

function M.check(st, what)
  if st ~= 0 then
    error(string.format("%s failed (%s): %s", what, ffi.string(C.kd_status_name(st)), ffi.string(C.kd_last_error())), 2)
  end
end

-- a test backend by kind ("cpu" or "cuda"), freed by gc; opts: a kd_model_options (the CUDA MLA
-- kernel's choice) or nil for the defaults
function M.backend(kind, opts)
  local out = ffi.new("kd_test_backend*[1]")
  local k = kind == "cuda" and C.KD_BACKEND_CUDA or C.KD_BACKEND_CPU
  M.check(C.kd_test_backend_new(k, 0, opts, out), "kd_test_backend_new(" .. kind .. ")")
  return ffi.gc(out[0], C.kd_test_backend_free)
end

-- the backend compared with the CPU: KDTREE_OPS_OTHER=cpu runs the whole spec CPU vs CPU
-- (a check of the harness itself on machines without a GPU)
function M.other_kind() return os.getenv("KDTREE_OPS_OTHER") or "cuda" end
-- a note(fmt, ...) collecting measured lines, and the function that prints them to stderr under
-- `title` (a spec passes it to teardown: the spec's log of errors and bit-identity results)
function M.notes(title)
  local lines = {}
  local function note(fmt, ...) lines[#lines + 1] = string.format(fmt, ...) end
  local function print_notes()
    io.stderr:write("\n" .. title .. "\n")
    for _, l in ipairs(lines) do io.stderr:write("  ", l, "\n") end
  end
  return note, print_notes
end
function M.seed(s) math.randomseed(s) end
function M.randn()
  local u1, u2 = math.random(), math.random()
  return math.sqrt(-2 * math.log(u1 + 1e-300)) * math.cos(2 * math.pi * u2)
end
-- n floats, rounded to bf16 so both backends start from the same numbers
function M.rand_floats(n, scale)
  scale = scale or 1
  local a = ffi.new("float[?]", n)
  for i = 0, n - 1 do a[i] = M.randn() * scale end
  C.kd_test_round_bf16(a, n)
  return a
end
function M.floats(n) return ffi.new("float[?]", math.max(n, 1)) end
function M.ints(n, f)
  local a = ffi.new("int32_t[?]", math.max(n, 1))
  if f then for i = 0, n - 1 do a[i] = f(i) end end
  return a
end

-- a bf16 weight [rows, cols] with N(0, scale^2) values; returns kd_test_weight (storage anchored)
local anchors = setmetatable({}, { __mode = "k" })
function M.bf16_weight(rows, cols, scale)
  local n = rows * cols
  local f = M.rand_floats(n, scale or 1)
  local bits = ffi.new("uint16_t[?]", n)
  C.kd_test_to_bf16(f, bits, n)
  local w = ffi.new("kd_test_weight")
  w.format, w.rows, w.cols, w.group, w.data = 0, rows, cols, 0, bits
  anchors[w] = { bits }
  return w
end
function M.f32_weight(rows, cols, scale)
  local f = M.rand_floats(rows * cols, scale or 1)
  local w = ffi.new("kd_test_weight")
  w.format, w.rows, w.cols, w.group, w.data = 1, rows, cols, 0, f
  anchors[w] = { f }
  return w
end
-- INT4 compressed-tensors: random codes q in [-7, 7] (u = q + 8), bf16 scales ~ scale/7
function M.int4_weight(rows, cols, group, scale)
  scale = scale or 1
  local nw = rows * cols / 8
  local words = ffi.new("int32_t[?]", nw)
  local u32 = ffi.cast("uint32_t*", words)
  for i = 0, nw - 1 do
    local v = 0
    for j = 0, 7 do v = v + (math.random(1, 15)) * 2 ^ (4 * j) end
    u32[i] = v
  end
  local ns = rows * cols / group
  local sf = ffi.new("float[?]", ns)
  for i = 0, ns - 1 do sf[i] = scale / 7 * (0.5 + math.random()) end
  local sb = ffi.new("uint16_t[?]", ns)
  C.kd_test_to_bf16(sf, sb, ns)
  local w = ffi.new("kd_test_weight")
  w.format, w.rows, w.cols, w.group, w.data, w.scale = 2, rows, cols, group, words, sb
  anchors[w] = { words, sb }
  return w
end
-- an array of n weights (kd_test_weight[n]) built by f(i)
function M.weights(n, f)
  local arr = ffi.new("kd_test_weight[?]", n)
  local keep = {}
  for i = 0, n - 1 do
    local w = f(i)
    arr[i] = w
    keep[#keep + 1] = w
  end
  anchors[arr] = keep
  return arr
end

-- max |a - b| / max |b| over n entries; NaN or inf anywhere gives math.huge
function M.rel_err(a, b, n)
  local maxd, maxr = 0, 0
  for i = 0, n - 1 do
    local x, y = tonumber(a[i]), tonumber(b[i])
    if x ~= x or y ~= y or x == math.huge or x == -math.huge then return math.huge end
    local d = math.abs(x - y)
    if d > maxd then maxd = d end
    if math.abs(y) > maxr then maxr = math.abs(y) end
  end
  return maxd / math.max(maxr, 1e-30)
end
-- true when n floats are bit-identical (returns false and the first differing index otherwise)
function M.same_bits(a, b, n)
  local ua, ub = ffi.cast("uint32_t*", a), ffi.cast("uint32_t*", b)
  for i = 0, n - 1 do
    if ua[i] ~= ub[i] then return false, i end
  end
  return true
end
function M.has_nan(a, n)
  for i = 0, n - 1 do if a[i] ~= a[i] then return true end end
  return false
end
-- the compared backend's n outputs b against the CPU's a: the error is noted (note from M.notes),
-- b holds no NaN and max |b - a| / max |a| <= tol
function M.assert_close(note, name, a, b, n, tol)
  local err = M.rel_err(b, a, n)
  note("%-62s err %.2e (tol %.0e)", name, err, tol)
  assert.is_false(M.has_nan(b, n), name .. ": NaN in the CUDA output")
  assert.is_true(err <= tol, string.format("%s: relative error %.3e > %.0e", name, err, tol))
end

return M
