-- cuda_ops_spec.lua: every CUDA op against its CPU twin (core/cpu/) on random inputs, through
-- the op test surface (spec/c/kdtree_testing.h), at small, odd and real Kimi K2.6 shapes
-- (7168 hidden, 64 heads, 512 + 64 latent, 2048 expert width, 384 experts top-8).
--
-- Inputs are rounded to bf16 first, so both backends see the same numbers; the CPU computes
-- in fp32, CUDA stores activations in bf16 and accumulates in fp32. Error = max |cuda - cpu|
-- / max |cpu| over the output (NaN or inf anywhere fails). Tolerances:
--   exact ops (copy, embed, gather, argmax, top-k)                bit-identical
--   fp32 outputs (linear to f32)                                  1e-4 (seen: < 1e-6)
--   log_softmax (fp32; the CPU sums 163840 exps in one sequential
--   fp32 chain, which alone drifts ~1e-5 of the row's range)      3e-5
--   bf16 outputs (one rounding, 2^-9 relative per element)        5e-3
--   linear_swiglu (bf16 gate and up products, then the bf16
--   SwiGLU: three roundings)                                      1e-2
--   MoE (bf16 gate/up/SwiGLU intermediates, then down)            1e-2
-- Batch invariance of the ops (a row's bits independent of the batch) is checked on CUDA.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local O = require("helpers.ops")
local ffi, C = O.ffi, O.C

local TOL_F32, TOL_LSM, TOL_BF16, TOL_GLU, TOL_MOE = 1e-4, 3e-5, 5e-3, 1e-2, 1e-2
-- KDTREE_OPS_SMALL=1: skip the K2.6-sized cases (for compute-sanitizer runs)
local SMALL = os.getenv("KDTREE_OPS_SMALL") == "1"
local function big(f) if not SMALL then f() end end

describe("CUDA ops against the CPU twins #gpu", function()
  local cpu, gpu
  local note, print_notes = O.notes("[cuda_ops] measured errors (cuda vs cpu):")
  teardown(print_notes)
  setup(function()
    cpu = O.backend("cpu")
    gpu = O.backend(O.other_kind())
  end)

  -- run f(tb, out) on both backends; returns (cpu out, gpu out)
  local function both(n, f, ctype)
    local a = ffi.new((ctype or "float") .. "[?]", math.max(n, 1))
    local b = ffi.new((ctype or "float") .. "[?]", math.max(n, 1))
    O.check(f(cpu, a), "cpu")
    O.check(f(gpu, b), "cuda")
    return a, b
  end
  local function close(name, n, f, tol)
    local a, b = both(n, f)
    O.assert_close(note, name, a, b, n, tol)
    return a, b
  end
  local function exact(name, n, f, ctype)
    local a, b = both(n, f, ctype)
    for i = 0, n - 1 do
      if a[i] ~= b[i] then
        error(string.format("%s: entry %d differs: cpu %s, cuda %s", name, i, tostring(a[i]), tostring(b[i])))
      end
    end
    note("%-58s identical", name)
  end

  it("copy converts f32 <-> bf16 / f16 exactly as the CPU does", function()
    O.seed(1)
    for _, dt in ipairs({ 2, 1 }) do
      local rows, cols = 3, 1001
      local x = ffi.new("float[?]", rows * cols)
      for i = 0, rows * cols - 1 do x[i] = O.randn() * 3 end    -- not pre-rounded: the rounding is tested
      exact("copy f32 -> " .. (dt == 2 and "bf16" or "f16") .. " -> f32 3x1001", rows * cols,
        function(tb, out) return C.kd_test_copy(tb, x, rows, cols, dt, out) end)
    end
  end)

  it("embed gathers table rows exactly", function()
    O.seed(2)
    local V, H, n = 1000, 7168, 6
    local w = O.bf16_weight(V, H)
    local ids = O.ints(n, function(i) return ({ 0, 999, 5, 5, 512, 77 })[i + 1] end)
    exact("embed 1000x7168, 6 ids", n * H, function(tb, out) return C.kd_test_embed(tb, w, ids, n, out) end)
  end)

  it("add, scale_add and swiglu", function()
    O.seed(3)
    for _, s in ipairs({ { 1, 7168 }, { 5, 7168 }, { 3, 129 } }) do
      local r, c = s[1], s[2]
      local x, y = O.rand_floats(r * c), O.rand_floats(r * c)
      close(string.format("add %dx%d", r, c), r * c, function(tb, out) return C.kd_test_add(tb, x, y, r, c, 0, 0, out) end, TOL_BF16)
      close(string.format("scale_add %dx%d (s=0.37)", r, c), r * c,
        function(tb, out) return C.kd_test_add(tb, x, y, r, c, 0.37, 1, out) end, TOL_BF16)
      close(string.format("swiglu %dx%d", r, c), r * c, function(tb, out) return C.kd_test_swiglu(tb, x, y, r, c, out) end, TOL_BF16)
    end
  end)

  it("rmsnorm over rows and over heads", function()
    O.seed(4)
    for _, s in ipairs({ { 3, 7168, 7168, 1e-5 }, { 5, 512, 512, 1e-6 }, { 2, 1536, 1536, 1e-6 }, { 3, 128, 32, 1e-6 },
                          { 7, 100, 100, 1e-5 }, { 1, 64 * 128, 128, 1e-6 }, { 2, 9000, 9000, 1e-6 } }) do
      local r, c, d, eps = s[1], s[2], s[3], s[4]
      local x = O.rand_floats(r * c, 2)
      local w = O.bf16_weight(d, 1)
      close(string.format("rmsnorm %dx%d (width %d, eps %g)", r, c, d, eps), r * c,
        function(tb, out) return C.kd_test_rmsnorm(tb, x, r, c, w, eps, out) end, TOL_BF16)
    end
  end)

  it("add_rmsnorm: the residual sum and its norm (K2.6 and drafter widths)", function()
    O.seed(14)
    for _, s in ipairs({ { 3, 7168, 1e-6 }, { 17, 7168, 1e-6 }, { 5, 128, 1e-5 }, { 2, 100, 1e-5 }, { 2, 9000, 1e-6 } }) do
      local r, c, eps = s[1], s[2], s[3]
      local x, y = O.rand_floats(r * c, 2), O.rand_floats(r * c, 2)
      local w = O.bf16_weight(c, 1)
      local xs, outs = {}, {}
      for _, tb in ipairs({ cpu, gpu }) do
        local xo, o = ffi.new("float[?]", r * c), ffi.new("float[?]", r * c)
        O.check(C.kd_test_add_rmsnorm(tb, x, y, r, c, w, eps, xo, o), tb == cpu and "cpu" or "cuda")
        xs[#xs + 1], outs[#outs + 1] = xo, o
      end
      local name = string.format("add_rmsnorm %dx%d (eps %g)", r, c, eps)
      O.assert_close(note, name .. ": x + y", xs[1], xs[2], r * c, TOL_BF16)
      -- the CUDA norm reads the sum as stored (rounded to bf16) and rounds its output again: two
      -- roundings against the CPU's fp32 chain; against the CPU norm of the stored sum, one
      O.assert_close(note, name .. ": norm", outs[1], outs[2], r * c, 2 * TOL_BF16)
      local ref = ffi.new("float[?]", r * c)
      O.check(C.kd_test_rmsnorm(cpu, xs[2], r, c, w, eps, ref), "cpu rmsnorm of the stored sum")
      O.assert_close(note, name .. ": norm of the stored sum", ref, outs[2], r * c, TOL_BF16)
      -- on CUDA the bits of add followed by rmsnorm (the forward's results do not move)
      local xa, oa = ffi.new("float[?]", r * c), ffi.new("float[?]", r * c)
      O.check(C.kd_test_add(gpu, x, y, r, c, 0, 0, xa), "cuda add")
      O.check(C.kd_test_rmsnorm(gpu, xa, r, c, w, eps, oa), "cuda rmsnorm")
      assert.is_true(O.same_bits(xs[2], xa, r * c) and O.same_bits(outs[2], oa, r * c), name .. ": not add + rmsnorm's bits")
    end
  end)

  it("rope: interleaved (MLA q and k_pe, tiny) and rotate-half (drafter)", function()
    O.seed(5)
    local cases = {
      { "q_pe K2.6", 3, 64 * 192, 64, 192, 128, 64, 1, 1.0 },
      { "k_pe K2.6", 5, 576, 1, 576, 512, 64, 1, 1.0 },
      { "tiny q_pe", 3, 4 * 24, 4, 24, 16, 8, 1, 1.0 },
      { "rotate-half drafter", 4, 4 * 32, 4, 32, 0, 32, 0, 1.2 },
    }
    for _, cs in ipairs(cases) do
      local name, rows, cols, nh, stride, off, dim, inter, amp = unpack(cs)
      local x = O.rand_floats(rows * cols)
      local pos = O.ints(rows, function(i) return ({ 0, 17, 262000, 4095, 1 })[i + 1] end)
      local inv = ffi.new("float[?]", dim / 2)
      for i = 0, dim / 2 - 1 do inv[i] = 50000 ^ (-2 * i / dim) end
      close(string.format("rope %s %dx%d", name, rows, cols), rows * cols,
        function(tb, out) return C.kd_test_rope(tb, x, rows, cols, nh, stride, off, pos, dim, inter, amp, inv, out) end,
        TOL_BF16)
    end
  end)

  it("mla_rope_store: MLA's rope parts and new latent rows, with rope's and rmsnorm's bits", function()
    O.seed(15)
    -- name, T, heads, q_nope, latent, rope dim, cache rows, first new row
    local cases = { { "K2.6 decode", 1, 64, 128, 512, 64, 40, 9 }, { "K2.6 TP-8 verify", 17, 8, 128, 512, 64, 64, 30 },
                    { "tiny", 5, 4, 16, 32, 8, 12, 2 } }
    for _, cs in ipairs(cases) do
      local name, T, H, dn, r, d, rows, start = unpack(cs)
      local qs, fs, kc = dn + d, r + d, r + d
      local q, kva = O.rand_floats(T * H * qs), O.rand_floats(T * kc, 2)
      local qf0, cache0 = O.rand_floats(T * H * fs), O.rand_floats(rows * kc)
      local w = O.bf16_weight(r, 1)
      local pos = O.ints(T, function(i) return start + 1000 * i end)
      local inv = ffi.new("float[?]", d / 2)
      for i = 0, d / 2 - 1 do inv[i] = 50000 ^ (-2 * i / d) end
      local nq, n = T * H * fs, T * H * fs + rows * kc
      for _, dev_len in ipairs({ -1, start - 2 }) do
        local row0 = dev_len < 0 and start or 2
        local run = function(tb, out)
          ffi.copy(out, qf0, nq * 4)
          ffi.copy(out + nq, cache0, rows * kc * 4)
          return C.kd_test_mla_rope_store(tb, q, T, H * qs, H, out, H * fs, kva, kc, w, 1e-6, pos, d, 1, 1.0, inv,
            out + nq, rows, row0, dev_len)
        end
        local label = string.format("mla_rope_store %s T=%d (%s length)", name, T, dev_len < 0 and "host" or "device")
        local _, g = close(label, n, run, TOL_BF16)
        -- on CUDA the bits of the ops it replaces: rope of q and of k_pe, rmsnorm of c_kv
        local rq, lat = ffi.new("float[?]", T * H * qs), ffi.new("float[?]", T * r)
        local nrm, rk = ffi.new("float[?]", T * r), ffi.new("float[?]", T * kc)
        O.check(C.kd_test_rope(gpu, q, T, H * qs, H, qs, dn, pos, d, 1, 1.0, inv, rq), "cuda rope q")
        for t = 0, T - 1 do ffi.copy(lat + t * r, kva + t * kc, r * 4) end
        O.check(C.kd_test_rmsnorm(gpu, lat, T, r, w, 1e-6, nrm), "cuda rmsnorm c_kv")
        O.check(C.kd_test_rope(gpu, kva, T, kc, 1, kc, r, pos, d, 1, 1.0, inv, rk), "cuda rope k_pe")
        for t = 0, T - 1 do
          for h = 0, H - 1 do
            assert.is_true(O.same_bits(g + t * H * fs + h * fs + r, rq + t * H * qs + h * qs + dn, d),
              label .. ": q_pe not rope's bits")
            assert.is_true(O.same_bits(g + t * H * fs + h * fs, qf0 + t * H * fs + h * fs, r), label .. ": q_lat moved")
          end
          local row = g + nq + (start + t) * kc
          assert.is_true(O.same_bits(row, nrm + t * r, r), label .. ": c_kv not rmsnorm's bits")
          assert.is_true(O.same_bits(row + r, rk + t * kc + r, d), label .. ": k_pe not rope's bits")
        end
        assert.is_true(O.same_bits(g + nq, cache0, start * kc), label .. ": rows before the new ones moved")
        assert.is_true(O.same_bits(g + nq + (start + T) * kc, cache0 + (start + T) * kc, (rows - start - T) * kc),
          label .. ": rows after the new ones moved")
      end
    end
  end)

  it("gather_rows, also in place (KV compaction)", function()
    O.seed(6)
    local S, c = 30, 576
    local src = O.rand_floats(S * c)
    local idx = O.ints(5, function(i) return ({ 29, 3, 3, 0, 17 })[i + 1] end)
    exact("gather_rows 5 of 30x576", 5 * c, function(tb, out) return C.kd_test_gather_rows(tb, src, S, c, idx, 5, 0, 0, out) end)
    local keep = O.ints(5, function(i) return ({ 10, 12, 13, 17, 25 })[i + 1] end)
    exact("gather_rows in place (rows 10..14 <- 10,12,13,17,25)", S * c,
      function(tb, out) return C.kd_test_gather_rows(tb, src, S, c, keep, 5, 1, 10, out) end)
  end)

  it("move_rows: the KV compaction of every layer in one op", function()
    O.seed(61)
    -- 70 caches (two launches: 64 a launch), 9 rows (two load batches of 8), rows 5.. <- 5 + keep;
    -- then a later chunk's move (rows 7.. <- 5 + {3, 4, 9}) and rows of 37 columns (not 16-byte
    -- multiples: the byte path)
    local L, S, c = 70, 40, 576
    local src = O.rand_floats(L * S * c)
    local keep = O.ints(9, function(i) return ({ 0, 2, 3, 7, 8, 9, 15, 21, 30 })[i + 1] end)
    exact("move_rows 70 caches of 40x576, 9 rows", L * S * c,
      function(tb, out) return C.kd_test_move_rows(tb, src, L, S, c, 5, keep, 9, 5, out) end)
    local later = O.ints(3, function(i) return ({ 3, 4, 9 })[i + 1] end)
    exact("move_rows, a later chunk (rows 7.. <- 8, 9, 14)", L * S * c,
      function(tb, out) return C.kd_test_move_rows(tb, src, L, S, c, 5, later, 3, 7, out) end)
    local odd = O.rand_floats(3 * S * 37)
    exact("move_rows 3 caches of 40x37 (byte path)", 3 * S * 37,
      function(tb, out) return C.kd_test_move_rows(tb, odd, 3, S, 37, 5, keep, 9, 5, out) end)
  end)

  describe("linear", function()
    local shapes = SMALL and { { 37, 256, 128 }, { 5, 33, 40 }, { 3, 7, 1000 }, { 2, 64, 4096 } } or {
      { 1, 1536, 7168 }, { 3, 1536, 7168 }, { 2, 576, 7168 }, { 4, 7168, 2048 }, { 2, 2048, 7168 },
      { 1, 12288, 1536 }, { 37, 256, 128 }, { 5, 33, 40 }, { 130, 384, 7168 }, { 3, 7, 1000 },
    }
    it("bf16 weights, bf16 and f32 outputs", function()
      O.seed(7)
      for _, s in ipairs(shapes) do
        local M, N, K = s[1], s[2], s[3]
        local x = O.rand_floats(M * K)
        local w = O.bf16_weight(N, K, 1 / math.sqrt(K))
        for _, f32 in ipairs({ 1, 0 }) do
          close(string.format("linear bf16 M=%d N=%d K=%d -> %s", M, N, K, f32 == 1 and "f32" or "bf16"), M * N,
            function(tb, out) return C.kd_test_linear(tb, x, M, w, f32, out) end, f32 == 1 and TOL_F32 or TOL_BF16)
        end
      end
    end)
    it("f32 weights", function()
      O.seed(8)
      local M, N, K = 3, 64, 200
      local x, w = O.rand_floats(M * K), O.f32_weight(N, K)
      close("linear f32-weight M=3 N=64 K=200 -> f32", M * N,
        function(tb, out) return C.kd_test_linear(tb, x, M, w, 1, out) end, TOL_F32)
    end)
    it("a row's bits do not depend on M (CUDA)", function()
      O.seed(9)
      local g = gpu
      for _, s in ipairs(SMALL and { { 64, 4096 }, { 96, 256 } } or
                         { { 1536, 7168 }, { 576, 7168 }, { 4096, 512 }, { 7168, 2048 }, { 2560, 7168 } }) do
        local N, K = s[1], s[2]
        local Mmax = 130
        local x = O.rand_floats(Mmax * K)
        local w = O.bf16_weight(N, K, 1 / math.sqrt(K))
        for _, f32 in ipairs({ 1, 0 }) do
          local full = ffi.new("float[?]", Mmax * N)
          O.check(C.kd_test_linear(g, x, Mmax, w, f32, full), "linear M=130")
          for _, M in ipairs({ 1, 37, 64, 65 }) do
            local part = ffi.new("float[?]", M * N)
            O.check(C.kd_test_linear(g, x, M, w, f32, part), "linear M=" .. M)
            local same, at = O.same_bits(part, full, M * N)
            assert.is_true(same, string.format("linear N=%d K=%d: M=%d differs from M=130 at %s", N, K, M, tostring(at)))
          end
        end
        note("%-58s bit-identical for M = 1, 37, 64, 65, 130", string.format("linear batch invariance N=%d K=%d", N, K))
      end
    end)
    it("weight pairs (q_a with kv_a, gate with up): against the CPU, and a row's bits do not depend on M", function()
      O.seed(16)
      local pairs = SMALL and { { 96, 40, 256, "tiny" } } or
                    { { 1536, 576, 7168, "q_a + kv_a" }, { 256, 256, 7168, "TP-8 shared gate + up" },
                      { 100, 36, 264, "odd widths" } }
      for _, s in ipairs(pairs) do
        local N0, N1, K, name = unpack(s)
        local w0, w1 = O.bf16_weight(N0, K, 1 / math.sqrt(K)), O.bf16_weight(N1, K, 1 / math.sqrt(K))
        local Mmax = 65
        local x = O.rand_floats(Mmax * K)
        for _, M in ipairs({ 1, 17 }) do
          close(string.format("linear_pair %s M=%d [%d; %d] x %d -> bf16", name, M, N0, N1, K), M * (N0 + N1),
            function(tb, out) return C.kd_test_linear_pair(tb, x, M, w0, w1, 0, out) end, TOL_BF16)
        end
        local N = N0 + N1
        local full = ffi.new("float[?]", Mmax * N)
        O.check(C.kd_test_linear_pair(gpu, x, Mmax, w0, w1, 1, full), "linear_pair M=65")
        for _, M in ipairs({ 1, 17, 64 }) do
          local part = ffi.new("float[?]", M * N)
          O.check(C.kd_test_linear_pair(gpu, x, M, w0, w1, 1, part), "linear_pair M=" .. M)
          local same, at = O.same_bits(part, full, M * N)
          assert.is_true(same, string.format("linear_pair %s: M=%d differs from M=65 at %s", name, M, tostring(at)))
        end
        note("%-58s bit-identical for M = 1, 17, 64, 65", "linear_pair batch invariance " .. name)
      end
    end)
    it("linear_swiglu (an MLP's gate, up and SwiGLU in one launch): against the CPU, the bits of linear_pair + " ..
       "swiglu on the GPU, and a row's bits do not depend on M", function()
      O.seed(17)
      -- split-K summed in the GEMM (M = 1) and by the second kernel (M = 17, 65 at K = 7168), none
      -- (K = 96: the tiles' own epilogue), widths that end inside a 32-column group (100, 40)
      local shapes = SMALL and { { 40, 256, "tiny" }, { 100, 96, "one split, odd width" } } or
                     { { 256, 7168, "TP-8 shared expert" }, { 2304, 7168, "TP-8 dense MLP" },
                       { 100, 264, "odd width" }, { 100, 96, "one split, odd width" } }
      for _, s in ipairs(shapes) do
        local I, K, name = unpack(s)
        local wg, wu = O.bf16_weight(I, K, 1 / math.sqrt(K)), O.bf16_weight(I, K, 1 / math.sqrt(K))
        local Mmax = 130
        local x = O.rand_floats(Mmax * K)
        for _, M in ipairs({ 1, 17 }) do
          close(string.format("linear_swiglu %s M=%d [%d] x %d -> bf16", name, M, I, K), M * I,
            function(tb, out) return C.kd_test_linear_swiglu(tb, x, M, wg, wu, 0, out) end, TOL_GLU)
        end
        local full = ffi.new("float[?]", Mmax * I)
        O.check(C.kd_test_linear_swiglu(gpu, x, Mmax, wg, wu, 0, full), "linear_swiglu M=130")
        for _, M in ipairs({ 1, 17, 64, 65 }) do
          local fused, gu = ffi.new("float[?]", M * I), ffi.new("float[?]", M * 2 * I)
          local g, u, two = ffi.new("float[?]", M * I), ffi.new("float[?]", M * I), ffi.new("float[?]", M * I)
          O.check(C.kd_test_linear_swiglu(gpu, x, M, wg, wu, 0, fused), "linear_swiglu M=" .. M)
          local same, at = O.same_bits(fused, full, M * I)
          assert.is_true(same, string.format("linear_swiglu %s: M=%d differs from M=130 at %s", name, M, tostring(at)))
          -- the two launches it replaces: their bf16 products are exact in the f32 buffers
          O.check(C.kd_test_linear_pair(gpu, x, M, wg, wu, 0, gu), "linear_pair M=" .. M)
          for t = 0, M - 1 do
            for j = 0, I - 1 do
              g[t * I + j], u[t * I + j] = gu[t * 2 * I + j], gu[t * 2 * I + I + j]
            end
          end
          O.check(C.kd_test_swiglu(gpu, g, u, M, I, two), "swiglu M=" .. M)
          same, at = O.same_bits(fused, two, M * I)
          assert.is_true(same, string.format("linear_swiglu %s M=%d: differs from linear_pair + swiglu at %s", name, M,
            tostring(at)))
        end
        note("%-58s bit-identical for M = 1, 17, 64, 65, 130 and to linear_pair + swiglu",
          "linear_swiglu " .. name)
      end
      -- weights the fused GEMM does not take (INT4, f32): two linears into a workspace and swiglu
      local I, K = 96, 512
      local x = O.rand_floats(17 * K)
      for _, f in ipairs({ "int4", "f32" }) do
        local function w()
          if f == "int4" then return O.int4_weight(I, K, 32, 1 / math.sqrt(K)) end
          return O.f32_weight(I, K, 1 / math.sqrt(K))
        end
        local wg, wu = w(), w()
        for _, M in ipairs({ 1, 17 }) do
          close(string.format("linear_swiglu %s weights M=%d [%d] x %d -> bf16", f, M, I, K), M * I,
            function(tb, out) return C.kd_test_linear_swiglu(tb, x, M, wg, wu, 0, out) end, TOL_GLU)
        end
      end
    end)
  end)

  it("head_matmul (MLA absorption), K2.6 and tiny dims", function()
    O.seed(10)
    -- K2.6: q_lat = q_nope W_UK (plain) and o = o_lat W_UV^T (transposed), kv_b [64*256, 512]
    local H, dn, dr, r, dv, T = 64, 128, 64, 512, 128, 3
    if SMALL then H = 2 end
    local kvb = O.bf16_weight(H * (dn + dv), r, 1 / math.sqrt(r))
    local q = O.rand_floats(T * H * (dn + dr))
    -- written into the absorbed query's layout: head h at columns h*(r+dr) + [0, r), the rope part untouched
    close("head_matmul K2.6 q_nope W_UK (64 heads, 128 -> 512, head stride 576)", T * H * (r + dr),
      function(tb, out) return C.kd_test_head_matmul(tb, q, T, H * (dn + dr), H, dn + dr, dn, kvb, dn + dv, 0, 0, r, r + dr, H * (r + dr), out) end,
      TOL_BF16)
    local lat = O.rand_floats(T * H * r)
    close("head_matmul K2.6 o_lat W_UV^T (64 heads, 512 -> 128)", T * H * dv,
      function(tb, out) return C.kd_test_head_matmul(tb, lat, T, H * r, H, r, r, kvb, dn + dv, dn, 1, dv, dv, H * dv, out) end,
      TOL_BF16)
    -- tiny: H 4, dn 16, dr 8, r 32, dv 16, odd T
    local h2, dn2, dr2, r2, dv2, T2 = 4, 16, 8, 32, 16, 7
    local kvb2 = O.bf16_weight(h2 * (dn2 + dv2), r2, 0.3)
    local q2 = O.rand_floats(T2 * h2 * (dn2 + dr2))
    close("head_matmul tiny plain (4 heads, 16 -> 32), T=7", T2 * h2 * r2,
      function(tb, out) return C.kd_test_head_matmul(tb, q2, T2, h2 * (dn2 + dr2), h2, dn2 + dr2, dn2, kvb2, dn2 + dv2, 0, 0, r2, r2, h2 * r2, out) end,
      TOL_BF16)
    local lat2 = O.rand_floats(T2 * h2 * r2)
    close("head_matmul tiny transposed (4 heads, 32 -> 16), T=7", T2 * h2 * dv2,
      function(tb, out) return C.kd_test_head_matmul(tb, lat2, T2, h2 * r2, h2, r2, r2, kvb2, dn2 + dv2, dn2, 1, dv2, dv2, h2 * dv2, out) end,
      TOL_BF16)
  end)

  describe("attention", function()
    -- visibility bits of a tree given parents (node 0 = root, parents[i] < i)
    local function tree_mask(parents)
      local n = #parents
      local words = math.ceil(n / 64)
      local vis = ffi.new("uint64_t[?]", n * words)
      local anc = {}
      for i = 0, n - 1 do
        local a = { [i] = true }
        local p = parents[i + 1]
        if p >= 0 then for k in pairs(anc[p]) do a[k] = true end end
        anc[i] = a
        for j in pairs(a) do
          local wi = i * words + math.floor(j / 64)
          vis[wi] = bit.bor(vis[wi], bit.lshift(1ULL, j % 64))
        end
      end
      return vis, anc
    end

    local function mla(name, T, past, causal, vis, H, hd, dv, scale)
      local S = past + T
      local q = O.rand_floats(T * H * hd)
      local kv = O.rand_floats(S * hd)
      close(string.format("attention %s (H=%d, dk=%d, dv=%d, T=%d, past=%d)", name, H, hd, dv, T, past), T * H * dv,
        function(tb, out)
          return C.kd_test_attention(tb, q, T, H * hd, H, hd, kv, S, hd, nil, dv, 1, 1, past, causal, vis, 0, scale, H * dv, out)
        end, TOL_BF16)
    end

    it("MLA at K2.6 dims: decode, prefill, chunks, tree", function()
      O.seed(11)
      local H = SMALL and 2 or 64
      mla("MLA decode", 1, 300, 1, nil, H, 576, 512, 0.1447)
      mla("MLA decode over 4 chunks", 1, 1000, 1, nil, H, 576, 512, 0.1447)
      mla("MLA causal", 4, 300, 1, nil, H, 576, 512, 0.1447)
      mla("MLA prefill", 37, 0, 1, nil, H, 576, 512, 0.1447)
      local vis = tree_mask({ -1, 0, 0, 1, 1, 2, 3, 6, 0 })
      mla("MLA tree mask (9 nodes)", 9, 50, 0, vis, H, 576, 512, 0.1447)
      mla("tiny MLA causal", 5, 3, 1, nil, 4, 40, 32, 0.25)
    end)

    it("GQA (drafter): full, causal, sliding window; separate values", function()
      O.seed(12)
      local function gqa(name, Hq, Hkv, hd, T, past, causal, window)
        local S = past + T
        local q = O.rand_floats(T * Hq * hd)
        local k = O.rand_floats(S * Hkv * hd)
        local v = O.rand_floats(S * Hkv * hd)
        close(string.format("attention %s (Hq=%d, Hkv=%d, d=%d, T=%d, past=%d, window=%d)", name, Hq, Hkv, hd, T, past, window),
          T * Hq * hd, function(tb, out)
            return C.kd_test_attention(tb, q, T, Hq * hd, Hq, hd, k, S, Hkv * hd, v, Hkv * hd, 0, Hkv, past, causal, nil,
              window, 1 / math.sqrt(hd), Hq * hd, out)
          end, TOL_BF16)
      end
      gqa("GQA full", 4, 2, 32, 8, 20, 0, 0)
      gqa("GQA causal", 4, 2, 32, 6, 10, 1, 0)
      gqa("GQA window", 4, 2, 32, 6, 10, 1, 5)
      gqa("GQA odd dims (unaligned, scalar tile loads)", 3, 1, 36, 5, 7, 1, 0)
      big(function() gqa("GQA K2.6 drafter dims full", 64, 8, 128, 8, 300, 0, 0) end)
    end)

    it("a tree node's output is bit-identical to decoding it alone and to a prefill (CUDA)", function()
      O.seed(13)
      local H, hd, dv, P = SMALL and 2 or 64, 576, 512, 300
      local parents = { -1, 0, 0, 1, 1, 2, 3, 6, 0, 7 }
      local n = #parents
      local vis, anc = tree_mask(parents)
      local past = O.rand_floats(P * hd)
      local noderows = O.rand_floats(n * hd)
      local q = O.rand_floats(n * H * hd)
      -- tree: cache = past rows then node rows in node order
      local S = P + n
      local kv = ffi.new("float[?]", S * hd)
      ffi.copy(kv, past, P * hd * 4)
      ffi.copy(kv + P * hd, noderows, n * hd * 4)
      local tree_out = ffi.new("float[?]", n * H * dv)
      O.check(C.kd_test_attention(gpu, q, n, H * hd, H, hd, kv, S, hd, nil, dv, 1, 1, P, 0, vis, 0, 0.1447, H * dv, tree_out), "tree")
      for i = 0, n - 1 do
        local path = {}
        for j in pairs(anc[i]) do path[#path + 1] = j end
        table.sort(path)                       -- ancestors in node order = depth order, then i
        local d = #path
        local S2 = P + d
        local kv2 = ffi.new("float[?]", S2 * hd)
        ffi.copy(kv2, past, P * hd * 4)
        for m, j in ipairs(path) do ffi.copy(kv2 + (P + m - 1) * hd, noderows + j * hd, hd * 4) end
        -- alone: one query after P + d - 1 past rows
        local alone = ffi.new("float[?]", H * dv)
        O.check(C.kd_test_attention(gpu, q + i * H * hd, 1, H * hd, H, hd, kv2, S2, hd, nil, dv, 1, 1, S2 - 1, 1, nil, 0,
          0.1447, H * dv, alone), "alone")
        local same, at = O.same_bits(alone, tree_out + i * H * dv, H * dv)
        assert.is_true(same, string.format("node %d: tree output differs from decoding alone at %s", i, tostring(at)))
        -- prefill: the path's queries (other rows random) causal from P; the last row is node i
        local qp = O.rand_floats(d * H * hd)
        ffi.copy(qp + (d - 1) * H * hd, q + i * H * hd, H * hd * 4)
        local pre = ffi.new("float[?]", d * H * dv)
        O.check(C.kd_test_attention(gpu, qp, d, H * hd, H, hd, kv2, S2, hd, nil, dv, 1, 1, P, 1, nil, 0, 0.1447, H * dv, pre), "prefill")
        same, at = O.same_bits(pre + (d - 1) * H * dv, tree_out + i * H * dv, H * dv)
        assert.is_true(same, string.format("node %d: tree output differs from the prefill row at %s", i, tostring(at)))
      end
      note("%-58s bit-identical (10 nodes, K2.6 dims)", "attention tree node == alone == prefill row")
    end)
  end)

  describe("moe", function()
    -- shared: the shared expert's output the op adds (nil: none)
    local function moe_case(name, T, H, n, top_k, I, ng, tg, fmt, group, tol, shared)
      local x = O.rand_floats(T * H)
      local router = O.bf16_weight(n, H, 1 / math.sqrt(H))
      local bias = ffi.new("float[?]", n)
      for i = 0, n - 1 do bias[i] = O.randn() * 0.05 end
      local mk = function(r, c, i)
        local f = fmt
        if fmt == "mixed" then f = ({ 2, 0, 2, 1 })[i % 4 + 1] end   -- INT4, bf16, INT4, f32
        if f == 2 then return O.int4_weight(r, c, group, 1 / math.sqrt(c)) end
        if f == 1 then return O.f32_weight(r, c, 1 / math.sqrt(c)) end
        return O.bf16_weight(r, c, 1 / math.sqrt(c))
      end
      local gate = O.weights(n, function(i) return mk(I, H, i) end)
      local up = O.weights(n, function(i) return mk(I, H, i) end)
      local down = O.weights(n, function(i) return mk(H, I, i) end)
      close(string.format("moe %s (T=%d, H=%d, %d experts top-%d, I=%d, groups %d/%d)", name, T, H, n, top_k, I, ng, tg),
        T * H, function(tb, out)
          return C.kd_test_moe(tb, x, T, H, n, top_k, ng, tg, 1, 2.827, router, bias, gate, up, down, shared, out)
        end, tol)
      return x, router, bias, gate, up, down
    end

    it("bf16 experts with group-limited routing (tiny-dsv3 shape)", function()
      O.seed(14)
      moe_case("bf16", 5, 128, 16, 4, 64, 4, 2, 0, 0, TOL_MOE)
    end)
    it("bf16 experts, 384 experts top-8 (K2.6 router)", function()
      O.seed(15)
      moe_case("bf16 K2.6 router", 3, 256, 384, 8, SMALL and 16 or 64, 1, 1, 0, 0, TOL_MOE)
    end)
    it("a token's MoE output does not depend on the batch (CUDA)", function()
      O.seed(16)
      local T, H, n, k, I = 9, 128, 16, 4, 64
      local x, router, bias, gate, up, down = moe_case("bf16 batch", T, H, n, k, I, 4, 2, 0, 0, TOL_MOE)
      local full = ffi.new("float[?]", T * H)
      O.check(C.kd_test_moe(gpu, x, T, H, n, k, 4, 2, 1, 2.827, router, bias, gate, up, down, nil, full), "moe T=9")
      for _, t in ipairs({ 0, 4, 8 }) do
        local one = ffi.new("float[?]", H)
        O.check(C.kd_test_moe(gpu, x + t * H, 1, H, n, k, 4, 2, 1, 2.827, router, bias, gate, up, down, nil, one), "moe T=1")
        local same, at = O.same_bits(one, full + t * H, H)
        assert.is_true(same, string.format("moe: token %d alone differs from the batch at %s", t, tostring(at)))
      end
      note("%-58s bit-identical", "moe batch invariance (token alone == in T=9)")
    end)
    it("experts of mixed formats in one layer (quantization ignore list)", function()
      O.seed(21)
      moe_case("mixed int4/bf16/f32", 7, 128, 16, 4, 64, 1, 1, "mixed", 32, TOL_MOE)
    end)
    it("INT4 experts: many tokens per expert at tiny-k2.6 dims, and batch invariance (CUDA)", function()
      O.seed(22)
      local T, H, n, k, I = 40, 128, 16, 4, 64
      local x, router, bias, gate, up, down = moe_case("int4 tiny-k2.6 dims", T, H, n, k, I, 1, 1, 2, 32, TOL_MOE)
      local full = ffi.new("float[?]", T * H)
      O.check(C.kd_test_moe(gpu, x, T, H, n, k, 1, 1, 1, 2.827, router, bias, gate, up, down, nil, full), "moe T=40")
      for _, t in ipairs({ 0, 17, 39 }) do
        local one = ffi.new("float[?]", H)
        O.check(C.kd_test_moe(gpu, x + t * H, 1, H, n, k, 1, 1, 1, 2.827, router, bias, gate, up, down, nil, one), "moe T=1")
        local same, at = O.same_bits(one, full + t * H, H)
        assert.is_true(same, string.format("int4 moe: token %d alone differs from the batch at %s", t, tostring(at)))
      end
      note("%-58s bit-identical", "int4 moe batch invariance (token alone == in T=40)")
    end)
    it("the shared expert's output added by the op: against the CPU, and the bits of moe, then add (CUDA)", function()
      local T, H, n, k, I = 5, 128, 16, 4, 64
      for _, c in ipairs({ { "bf16", 0, 0 }, { "int4", 2, 32 }, { "mixed", "mixed", 32 } }) do
        O.seed(23)
        local shared = O.rand_floats(T * H)
        local x, router, bias, gate, up, down = moe_case(c[1] .. " + shared", T, H, n, k, I, 1, 1, c[2], c[3], TOL_MOE,
                                                         shared)
        local plain, fused, want = O.floats(T * H), O.floats(T * H), O.floats(T * H)
        O.check(C.kd_test_moe(gpu, x, T, H, n, k, 1, 1, 1, 2.827, router, bias, gate, up, down, nil, plain), "moe")
        O.check(C.kd_test_add(gpu, plain, shared, T, H, 0, 0, want), "add")
        O.check(C.kd_test_moe(gpu, x, T, H, n, k, 1, 1, 1, 2.827, router, bias, gate, up, down, shared, fused), "moe+")
        local same, at = O.same_bits(fused, want, T * H)
        assert.is_true(same, string.format("%s moe with shared differs from moe, then add, at %s", c[1], tostring(at)))
        note("%-58s bit-identical", c[1] .. " moe + shared == moe, then add")
      end
    end)
    it("INT4 experts at K2.6 expert shape (W4A16 kernels)", function()
      O.seed(17)
      big(function() moe_case("int4 g32 K2.6 expert", 3, 7168, 8, 2, 2048, 1, 1, 2, 32, TOL_MOE) end)
      moe_case("int4 g32 small", 6, 256, 16, 4, 64, 1, 1, 2, 32, TOL_MOE)
    end)
  end)

  describe("vocabulary reductions", function()
    it("log_softmax over 163840 and odd widths", function()
      O.seed(18)
      for _, s in ipairs({ { SMALL and 1 or 3, 163840 }, { 2, 1000 }, { 4, 33 } }) do
        local r, c = s[1], s[2]
        local x = O.rand_floats(r * c, 4)
        close(string.format("log_softmax %dx%d", r, c), r * c,
          function(tb, out) return C.kd_test_log_softmax(tb, x, r, c, out) end, TOL_LSM)
      end
    end)
    it("argmax with planted ties (lower id wins), across the blocks a row is split into", function()
      O.seed(19)
      -- widths: the vocabulary (20 blocks of 8192 ids), one id past a block, under one block
      for _, c in ipairs({ 163840, 8193, 33 }) do
        local r = 6
        local x = O.rand_floats(r * c)
        local far, near = math.floor(c * 0.43), math.floor(c * 0.06)
        x[0 * c + far] = 50; x[0 * c + near] = 50          -- tie in two blocks: near wins
        x[1 * c + c - 1] = 60                              -- last column
        for i = 0, c - 1 do x[2 * c + i] = 1.5 end          -- all equal: 0
        x[3 * c + 5] = 0 / 0; x[3 * c + 9] = 1 / 0          -- the first NaN / +inf column: -code
        x[4 * c + far] = 1 / 0; x[4 * c + near] = 0 / 0     -- the first bad column in an earlier block
        x[5 * c + far] = 0 / 0; x[5 * c + c - 1] = 1 / 0    -- NaN before +inf, blocks apart
        exact(string.format("argmax %dx%d (ties, NaN, +inf)", r, c), r,
          function(tb, out) return C.kd_test_argmax(tb, x, r, c, out) end, "int32_t")
      end
    end)
    it("topk with planted ties: values desc, equal values lower id first", function()
      O.seed(20)
      for _, s in ipairs(SMALL and { { 1, 163840, 256 }, { 2, 32, 32 }, { 3, 1000, 512 } } or
                         { { 3, 163840, 1 }, { 3, 163840, 8 }, { 2, 163840, 256 }, { 2, 163840, 1024 }, { 2, 32, 32 },
                           { 3, 1000, 512 }, { 7, 163840, 64 } }) do
        local r, c, k = s[1], s[2], s[3]
        local x = O.rand_floats(r * c)
        -- ties: copy some values around (bf16-rounded floats repeat often anyway)
        for i = 0, r - 1 do
          for j = 0, 20 do x[i * c + math.random(0, c - 1)] = x[i * c + math.random(0, c - 1)] end
          x[i * c + (c - 1)] = x[i * c]
        end
        local v1, v2 = ffi.new("float[?]", r * k), ffi.new("float[?]", r * k)
        local i1, i2 = ffi.new("int32_t[?]", r * k), ffi.new("int32_t[?]", r * k)
        O.check(C.kd_test_topk(cpu, x, r, c, k, v1, i1), "cpu topk")
        O.check(C.kd_test_topk(gpu, x, r, c, k, v2, i2), "cuda topk")
        for i = 0, r * k - 1 do
          assert.are.equal(i1[i], i2[i], string.format("topk %dx%d k=%d: id %d differs", r, c, k, i))
          assert.are.equal(v1[i], v2[i])
        end
        note("%-58s identical", string.format("topk %dx%d k=%d", r, c, k))
      end
    end)
    it("topk of flat rows (thousands of ids in the k-th's bin; bf16 rows: hundreds of ties at the cut)", function()
      O.seed(21)
      local r, c = 2, 163840
      for _, k in ipairs(SMALL and { 16 } or { 1, 16, 256, 1024 }) do
        for _, round in ipairs({ false, true }) do
          local x = ffi.new("float[?]", r * c)
          for i = 0, r * c - 1 do x[i] = math.random() * 16 end
          if round then C.kd_test_round_bf16(x, r * c) end
          local v1, v2 = ffi.new("float[?]", r * k), ffi.new("float[?]", r * k)
          local i1, i2 = ffi.new("int32_t[?]", r * k), ffi.new("int32_t[?]", r * k)
          O.check(C.kd_test_topk(cpu, x, r, c, k, v1, i1), "cpu topk")
          O.check(C.kd_test_topk(gpu, x, r, c, k, v2, i2), "cuda topk")
          for i = 0, r * k - 1 do
            assert.are.equal(i1[i], i2[i], string.format("flat topk %dx%d k=%d%s: id %d differs", r, c, k,
              round and " bf16" or "", i))
            assert.are.equal(v1[i], v2[i])
          end
          note("%-58s identical", string.format("topk flat%s %dx%d k=%d", round and " bf16" or "", r, c, k))
        end
      end
    end)
  end)
end)
