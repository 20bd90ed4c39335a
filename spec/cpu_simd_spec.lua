-- cpu_simd_spec: the CPU backend's AVX2 forms (core/cpu/cpu_avx2.c) give the bits of its portable C.
-- The backend takes the AVX2 forms wherever the CPU has AVX2, so every other CPU spec runs them;
-- this one runs both forms on the same inputs and compares bit for bit: the products at every
-- path of kd_cpu_matmul_wt (T = 1, 2: straight from bf16 / INT4 storage; T >= 3: decoded rows in
-- 4 x 2 tiles, with row, weight-row and k tails) and the decoding of bf16 and INT4 rows. A form
-- that reordered a sum, fused a multiply-add or rounded a scale differently fails here. The
-- portable result is also held to a float64 dot product, so both forms are right, not only equal.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local O = require("helpers.ops")
local ffi, C = O.ffi, O.C

local function has_avx2()
  local w = O.f32_weight(1, 8)
  local a, b = O.floats(8), O.floats(8)
  local st = C.kd_test_cpu_decode_forms(w, a, b)
  if st == C.KD_ERR_UNSUPPORTED then
    assert.matches("no AVX2", ffi.string(C.kd_last_error()), 1, true)
    return false
  end
  O.check(st, "kd_test_cpu_decode_forms")
  return true
end

-- float64 dot of x row t with weight row r decoded by the portable form
local function ref_dot(x, t, dec, r, k)
  local s = 0
  for i = 0, k - 1 do s = s + x[t * k + i] * dec[r * k + i] end
  return s
end

describe("the CPU backend's AVX2 forms", function()
  local avx2 = has_avx2()

  it("are taken on this CPU, or refused with a message where it has no AVX2", function()
    -- CI's and the dev machines' CPUs have AVX2: there the forms must run
    local uname = io.popen("uname -m"):read("*l")
    if uname == "x86_64" then
      local f = io.open("/proc/cpuinfo")
      local info = f and f:read("*a") or ""
      if f then f:close() end
      assert.are.equal(info:find(" avx2") ~= nil, avx2, "the CPU's avx2 flag and the backend's choice")
    else
      assert.is_false(avx2)
    end
  end)

  if not avx2 then return end

  local cases = {
    { "bf16 13 x 37", function() return O.bf16_weight(13, 37, 0.5) end },
    { "bf16 16 x 64", function() return O.bf16_weight(16, 64, 0.5) end },
    { "f32 10 x 61", function() return O.f32_weight(10, 61, 0.5) end },
    { "int4 g32 11 x 64", function() return O.int4_weight(11, 64, 32, 0.5) end },
    { "int4 g8 9 x 40", function() return O.int4_weight(9, 40, 8, 0.5) end },
  }

  it("products: every T and shape, bit for bit, and within 1e-5 of float64", function()
    O.seed(31)
    local n = 0
    for _, c in ipairs(cases) do
      local w = c[2]()
      local rows, k = tonumber(w.rows), tonumber(w.cols)
      local dc, ds = O.floats(rows * k), O.floats(rows * k)
      O.check(C.kd_test_cpu_decode_forms(w, dc, ds), "decode " .. c[1])
      for _, T in ipairs({ 1, 2, 3, 4, 5, 8, 9, 17 }) do
        local x = O.rand_floats(T * k)
        local oc, os_ = O.floats(T * rows), O.floats(T * rows)
        O.check(C.kd_test_cpu_matmul_forms(x, T, w, oc, os_), "matmul " .. c[1])
        local same, at = O.same_bits(oc, os_, T * rows)
        assert.is_true(same, string.format("%s, T = %d: the forms differ at output %s", c[1], T, tostring(at)))
        for t = 0, T - 1 do
          for r = 0, rows - 1 do
            local ref = ref_dot(x, t, dc, r, k)
            assert.is_true(math.abs(oc[t * rows + r] - ref) <= 1e-5 * (1 + math.abs(ref)),
              string.format("%s, T = %d: out[%d, %d] = %.9g, float64 %.9g", c[1], T, t, r, oc[t * rows + r], ref))
          end
        end
        n = n + 1
      end
    end
    assert.are.equal(#cases * 8, n)
  end)

  it("decoding of bf16 and INT4 rows, bit for bit", function()
    O.seed(32)
    for _, c in ipairs(cases) do
      local w = c[2]()
      local cnt = tonumber(w.rows * w.cols)
      local dc, ds = O.floats(cnt), O.floats(cnt)
      O.check(C.kd_test_cpu_decode_forms(w, dc, ds), "decode " .. c[1])
      local same, at = O.same_bits(dc, ds, cnt)
      assert.is_true(same, string.format("%s: the decoded rows differ at %s", c[1], tostring(at)))
    end
  end)
end)
