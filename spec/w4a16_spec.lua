-- w4a16_spec.lua: the W4A16 kernels (cuda/w4a16.cu) against the CPU twin's INT4 linear and MoE,
-- through the op test surface (spec/c/kdtree_testing.h), and their batch invariance on CUDA.
--
-- Weights: random compressed-tensors INT4 (codes 1..15, bf16 scales), groups 32, 64 and 128,
-- at Kimi K2.6 expert shapes (gate/up 2048 x 7168, down 7168 x 2048), a tensor-parallel slice
-- (256 x 7168) and odd shapes (N not a multiple of 16, K not a multiple of 64).
-- Inputs are rounded to bf16 first, so both backends see the same numbers. The CPU computes
-- W = q * scale in fp32 and sums in fp32; CUDA sums the exact q * x products in fp32 per scale
-- group and scales in fp32. Error = max |cuda - cpu| / max |cpu| (NaN or inf fails).
-- Tolerances: f32 output 1e-4 (both sides are fp32 sums of the same exact products: seen
-- ~1e-6); bf16 output 5e-3 (one rounding, 2^-9 relative per element); MoE 1e-2 (the bf16
-- SwiGLU intermediate, as the backend's MoE).
-- Batch invariance (CUDA): a row's output bits do not depend on M, on the row's place in the
-- batch, or (MoE) on which other tokens share the launch.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local O = require("helpers.ops")
local ffi, C = O.ffi, O.C

local TOL_F32, TOL_BF16, TOL_MOE = 1e-4, 5e-3, 1e-2
local SMALL = os.getenv("KDTREE_OPS_SMALL") == "1"

describe("W4A16 INT4 kernels against the CPU twin #gpu", function()
  local cpu, gpu
  local note, print_notes = O.notes("[w4a16] measured errors (cuda vs cpu):")
  teardown(print_notes)
  setup(function()
    cpu = O.backend("cpu")
    gpu = O.backend(O.other_kind())
  end)

  local function linear(tb, x, M, w, f32)
    local out = ffi.new("float[?]", M * tonumber(w.rows))
    O.check(C.kd_test_linear(tb, x, M, w, f32, out), string.format("linear M=%d", M))
    return out
  end

  it("INT4 linear: K2.6 expert shapes, odd shapes, groups 32/64/128, M = 1..256, f32 and bf16 out", function()
    O.seed(41)
    local cases = {
      -- N, K, group, { M ... }
      { 2048, 7168, 32, { 1, 5, 16, 37 } },
      { 7168, 2048, 32, { 1, 8, 17 } },
      { 2048, 7168, 128, { 3 } },
      { 7168, 2048, 64, { 4 } },
      { 256, 7168, 32, { 1, 9 } },
      { 300, 1024, 32, { 1, 9, 64, 256 } },
      { 64, 128, 32, { 1, 7, 256 } },
      { 128, 64, 64, { 2, 33 } },
      { 24, 96, 32, { 1, 5 } },
      { 40, 384, 128, { 3, 100 } },
    }
    for _, cs in ipairs(cases) do
      local N, K, g, Ms = cs[1], cs[2], cs[3], cs[4]
      if not (SMALL and N * K > 1e6) then
        local w = O.int4_weight(N, K, g, 1 / math.sqrt(K))
        local Mmax = 0
        for _, M in ipairs(Ms) do Mmax = math.max(Mmax, M) end
        local x = O.rand_floats(Mmax * K)
        for _, M in ipairs(Ms) do
          for _, f32 in ipairs({ 1, 0 }) do
            local a, b = linear(cpu, x, M, w, f32), linear(gpu, x, M, w, f32)
            local name = string.format("int4 linear N=%d K=%d g%d M=%d -> %s", N, K, g, M, f32 == 1 and "f32" or "bf16")
            O.assert_close(note, name, a, b, M * N, f32 == 1 and TOL_F32 or TOL_BF16)
          end
        end
      end
    end
  end)

  it("INT4 linear: a row's bits do not depend on M or on its place in the batch (CUDA)", function()
    O.seed(42)
    local shapes = SMALL and { { 300, 1024, 64 }, { 64, 128, 32 } } or
                   { { 2048, 7168, 32 }, { 7168, 2048, 32 }, { 300, 1024, 64 }, { 256, 7168, 128 } }
    for _, s in ipairs(shapes) do
      local N, K, g = s[1], s[2], s[3]
      local w = O.int4_weight(N, K, g, 1 / math.sqrt(K))
      local M = 37
      local x = O.rand_floats(256 * K)
      -- the same 37 rows in reverse order, and inside a batch of 256
      local xr = ffi.new("float[?]", M * K)
      for r = 0, M - 1 do ffi.copy(xr + (M - 1 - r) * K, x + r * K, K * 4) end
      for _, f32 in ipairs({ 1, 0 }) do
        local fwd, rev, big = linear(gpu, x, M, w, f32), linear(gpu, xr, M, w, f32), linear(gpu, x, 256, w, f32)
        for _, r in ipairs({ 0, 1, 18, 36 }) do
          local one = linear(gpu, x + r * K, 1, w, f32)
          local same, at = O.same_bits(one, fwd + r * N, N)
          assert.is_true(same, string.format("N=%d K=%d: row %d alone differs from row %d of M=37 at col %s",
            N, K, r, r, tostring(at)))
          same, at = O.same_bits(one, rev + (M - 1 - r) * N, N)
          assert.is_true(same, string.format("N=%d K=%d: row %d differs when placed at %d (reversed batch) at col %s",
            N, K, r, M - 1 - r, tostring(at)))
          same, at = O.same_bits(one, big + r * N, N)
          assert.is_true(same, string.format("N=%d K=%d: row %d differs inside M=256 at col %s", N, K, r, tostring(at)))
        end
      end
      note("%-56s bit-identical (M = 1, 37 fwd/rev, 256)", string.format("int4 linear batch invariance N=%d K=%d g%d", N, K, g))
    end
  end)

  local function moe_setup(T, H, n, I, group)
    local x = O.rand_floats(T * H)
    local router = O.bf16_weight(n, H, 1 / math.sqrt(H))
    local bias = ffi.new("float[?]", n)
    for i = 0, n - 1 do bias[i] = O.randn() * 0.05 end
    local gate = O.weights(n, function() return O.int4_weight(I, H, group, 1 / math.sqrt(H)) end)
    local up = O.weights(n, function() return O.int4_weight(I, H, group, 1 / math.sqrt(H)) end)
    local down = O.weights(n, function() return O.int4_weight(H, I, group, 1 / math.sqrt(I)) end)
    return x, router, bias, gate, up, down
  end
  local function moe(tb, x, T, H, n, k, router, bias, gate, up, down)
    local out = ffi.new("float[?]", T * H)
    O.check(C.kd_test_moe(tb, x, T, H, n, k, 1, 1, 1, 2.827, router, bias, gate, up, down, nil, out), "moe T=" .. T)
    return out
  end

  it("INT4 MoE: grouped kernels vs the CPU twin (tiny, a split-K slice, group 128)", function()
    O.seed(43)
    local cases = {
      -- T, H, experts, top-k, I, group
      { 9, 128, 16, 4, 64, 32 },
      { 37, 512, 32, 4, 1024, 128 },
      { 5, 7168, 16, 8, 256, 32 },     -- the TP8 slice width: split-K in the fused gate/up
    }
    for _, cs in ipairs(cases) do
      local T, H, n, k, I, g = (table.unpack or unpack)(cs)
      if not (SMALL and H > 1024) then
        local x, router, bias, gate, up, down = moe_setup(T, H, n, I, g)
        local a = moe(cpu, x, T, H, n, k, router, bias, gate, up, down)
        local b = moe(gpu, x, T, H, n, k, router, bias, gate, up, down)
        local name = string.format("int4 moe T=%d H=%d %d experts top-%d I=%d g%d", T, H, n, k, I, g)
        O.assert_close(note, name, a, b, T * H, TOL_MOE)
      end
    end
  end)

  it("INT4 MoE: a token's output does not depend on the batch (CUDA)", function()
    O.seed(44)
    local T, H, n, k, I, g = 37, 256, 16, 4, 128, 32
    local x, router, bias, gate, up, down = moe_setup(T, H, n, I, g)
    local full = moe(gpu, x, T, H, n, k, router, bias, gate, up, down)
    for _, t in ipairs({ 0, 17, 36 }) do
      local one = moe(gpu, x + t * H, 1, H, n, k, router, bias, gate, up, down)
      local same, at = O.same_bits(one, full + t * H, H)
      assert.is_true(same, string.format("int4 moe: token %d alone differs from the batch of %d at %s", t, T, tostring(at)))
    end
    note("%-56s bit-identical", "int4 moe batch invariance (token alone == in T=37)")
  end)
end)
