-- sample_golden_spec: known answers for the keyed sampling rule, computed by an independent
-- reference (scripts/golden/sample_ref.py: plain Python from the documented rule, exact big
-- integers and rationals) into spec/fixtures/sample_golden.json:
--   * the keyed RNG: for (seed, position) pairs over the whole 64-bit seed range, the top 20
--     bits of U (the 53-bit keyed word), read through the public API as the draw from 2^20
--     equal logits;
--   * draws from random rows (equal logits and -inf among them) under temperatures, top-k,
--     top-p and both, 12 keys each;
--   * boundaries with exact masses: top-p goals that land exactly on a prefix's mass (reached
--     counts as kept), one float32 step above and below, top-k cuts inside runs of equal
--     logits (the lower ids are kept), -inf never drawn.
-- Checked on the host rule (kd_sample_logits) and on the backend op sample_rows of the CPU
-- backend; the #gpu block runs the same cases through the same Lua call on CUDA
-- (KDTREE_OPS_OTHER=cpu runs that block on the CPU twin).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local ck = require("helpers.checkpoint")
local O = require("helpers.ops")
local K = require("kdtree.ffi")
local ffi, C = K.ffi, K.C

require("helpers.testlib").cdef("kdtree_testing_ddtree.h")

local golden = ck.read_json("spec/fixtures/sample_golden.json")

local function row_of(list)
  local a = ffi.new("float[?]", #list)
  for i = 1, #list do
    local v = list[i]
    a[i - 1] = v == "-inf" and -math.huge or v
  end
  return a, #list
end

local function sampler_of(case, d)
  local sp = ffi.new("kd_sampler")
  sp.temperature = case.temperature
  sp.top_k = case.top_k
  sp.top_p = case.top_p
  sp.seed = ffi.cast("uint64_t", d.seed_hi) * 0x100000000ULL + d.seed_lo
  return sp
end

-- a drawing function: host(row, V, sp, pos) -> token
local function host_draw(row, V, sp, pos)
  local out = ffi.new("int32_t[1]")
  O.check(C.kd_sample_logits(row, V, sp, pos, out), "kd_sample_logits")
  return out[0]
end

local function op_draw(kind)
  local h
  return function(row, V, sp, pos)
    if not h then
      local out = ffi.new("kd_test_dd*[1]")
      O.check(C.kd_test_dd_new(kind, 0, out), "kd_test_dd_new")
      h = ffi.gc(out[0], C.kd_test_dd_free)
    end
    local p, tok, code = ffi.new("int32_t[1]", pos), ffi.new("int32_t[1]"), ffi.new("int32_t[1]")
    O.check(C.kd_test_dd_sample(h, row, 1, V, sp, p, tok, code), "kd_test_dd_sample")
    assert.are.equal(0, code[0])
    return tok[0]
  end
end

-- every golden case through draw; returns how many draws were checked
local function check_all(draw)
  local n = 0
  -- the keyed RNG: 2^20 equal logits, no truncation: the draw is U's top 20 bits
  local V = 2 ^ 20
  local flat = ffi.new("float[?]", V)
  for _, c in ipairs(golden.u53) do
    local sp = sampler_of({ temperature = 1, top_k = 0, top_p = 1 }, c)
    assert.are.equal(c.token, draw(flat, V, sp, c.position),
      string.format("seed %08x%08x position %d", c.seed_hi, c.seed_lo, c.position))
    n = n + 1
  end
  for _, group in ipairs({ golden.rows, golden.boundaries }) do
    for ci, case in ipairs(group) do
      local row, RV = row_of(case.logits)
      for _, d in ipairs(case.draws) do
        local what = string.format("%s: T %.9g top_k %d top_p %.9g seed %08x%08x position %d",
          case.name or ("row " .. ci .. " (V " .. RV .. ")"), case.temperature, case.top_k, case.top_p,
          d.seed_hi, d.seed_lo, d.position)
        assert.are.equal(d.token, draw(row, RV, sampler_of(case, d), d.position), what)
        n = n + 1
      end
    end
  end
  return n
end

-- the fixture as the reference wrote it: 8 RNG keys, 24 rows x 12 draws, 11 boundaries x 48
local EXPECTED_DRAWS = 8 + 24 * 12 + 11 * 48

describe("keyed sampling against the Python reference (sample_golden.json)", function()
  it("the host rule (kd_sample_logits) draws every golden token", function()
    assert.are.equal(EXPECTED_DRAWS, check_all(host_draw))
  end)
  it("the CPU backend's sample_rows op draws every golden token", function()
    assert.are.equal(EXPECTED_DRAWS, check_all(op_draw(C.KD_BACKEND_CPU)))
  end)
  it("the boundary cases keep what their names say (top-p goal reached = kept, top-k ties to lower ids)", function()
    local want = {
      ["top-p 0.5 of 4 equal"] = { 0, 1 }, ["top-p 0.75 of 4 equal"] = { 0, 1, 2 },
      ["top-p 0.25 of 4 equal"] = { 0 }, ["top-p one float32 step above 0.5"] = { 0, 1, 2 },
      ["top-p one float32 step below 0.5"] = { 0, 1 }, ["top-p 0.2 (float32"] = { 0, 1 },
      ["top-k 2 inside"] = { 1, 2 }, ["top-k 4 inside"] = { 1, 2, 3, 5 }, ["top-k 1 on ties"] = { 1 },
      ["top-k 3 then top-p 0.5"] = { 1, 2 }, ["a -inf token is never drawn"] = { 0, 1, 2, 4, 5, 6, 7 },
    }
    local seen = 0
    for _, case in ipairs(golden.boundaries) do
      for prefix, ids in pairs(want) do
        if case.name:sub(1, #prefix) == prefix then
          assert.are.same(ids, case.drawn, case.name)
          seen = seen + 1
        end
      end
    end
    assert.are.equal(11, seen)
  end)
end)

describe("keyed sampling against the Python reference on the " .. O.other_kind() .. " backend #gpu", function()
  it("sample_rows draws every golden token", function()
    local kind = O.other_kind() == "cpu" and C.KD_BACKEND_CPU or C.KD_BACKEND_CUDA
    assert.are.equal(EXPECTED_DRAWS, check_all(op_draw(kind)))
  end)
end)
