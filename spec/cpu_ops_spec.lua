-- cpu_ops_spec.lua: every op of the CPU backend against a reference written here in Lua
-- (double precision, from the definitions in core/backend.h and the HF DeepseekV3 code),
-- on random data. Errors are reported as max |engine - ref| / max |ref|; the engine
-- computes in fp32, so 1e-5 relative is the bar (typical values are ~1e-7).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local B = require("helpers.backend")
local ffi, C = B.ffi, B.C

local TOL = 1e-5

local function randn()
  -- Box-Muller on math.random (seeded per test, deterministic under LuaJIT)
  local u1, u2 = math.random(), math.random()
  return math.sqrt(-2 * math.log(u1 + 1e-300)) * math.cos(2 * math.pi * u2)
end

local function floats(n, f)
  local a = ffi.new("float[?]", n)
  for i = 0, n - 1 do a[i] = f(i) end
  return a
end

-- relative error of engine floats e (cdata, ld) against a Lua ref table rows x cols
local function rel_err(e, ld, ref)
  local maxd, maxr = 0, 0
  for r = 1, #ref do
    for c = 1, #ref[r] do
      local d = math.abs(e[(r - 1) * ld + (c - 1)] - ref[r][c])
      if d ~= d then return math.huge end
      if d > maxd then maxd = d end
      if math.abs(ref[r][c]) > maxr then maxr = math.abs(ref[r][c]) end
    end
  end
  return maxd / math.max(maxr, 1e-30)
end

local function ok(be, st)
  if st ~= 0 then error(ffi.string(C.kd_last_error()), 2) end
end

-- x as a Lua table (exact fp32 values) and as cdata
local function rand_act(rows, cols, scale)
  scale = scale or 1
  local data = floats(rows * cols, function() return randn() * scale end)
  local t = {}
  for r = 1, rows do
    t[r] = {}
    for c = 1, cols do t[r][c] = tonumber(data[(r - 1) * cols + c - 1]) end
  end
  return data, t
end

-- ---- INT4 pack-quantized (compressed-tensors), written from the format notes ----
-- q in [-8, 7] -> u = q + 8; word j of a row holds elements 8j..8j+7, element 8j+i in bits [4i, 4i+3]
local function int4_weight(name, rows, cols, group)
  local words = ffi.new("int32_t[?]", rows * cols / 8)
  local scales = ffi.new("uint16_t[?]", rows * cols / group)
  local dense = {}
  for r = 0, rows - 1 do
    local row = {}
    local sc = {}
    for g = 0, cols / group - 1 do
      local h = B.f32_to_bf16(0.01 + 0.05 * math.random())
      scales[r * (cols / group) + g] = h
      sc[g] = B.bf16_to_f32(h)
    end
    for j = 0, cols / 8 - 1 do
      local word = 0
      for i = 0, 7 do
        local q = math.random(-8, 7)
        word = bit.bor(word, bit.lshift(q + 8, 4 * i))
        row[8 * j + i + 1] = q * sc[math.floor((8 * j + i) / group)]
      end
      words[r * (cols / 8) + j] = word
    end
    dense[r + 1] = row
  end
  local w = ffi.new("kd_weight")
  local cname = ffi.new("char[?]", #name + 1, name)
  w.name, w.format, w.rows, w.cols, w.group, w.src, w.src_scale = cname, C.KD_W_INT4, rows, cols, group, words, scales
  return { w = w, vals = dense, _keep = { words, scales, cname } }
end

local function matmul_t(x, wv)        -- x [T][k], wv [n][k] -> [T][n]
  local out = {}
  for t = 1, #x do
    out[t] = {}
    for o = 1, #wv do
      local s = 0
      for i = 1, #x[t] do s = s + x[t][i] * wv[o][i] end
      out[t][o] = s
    end
  end
  return out
end

describe("cpu backend ops", function()
  local be
  before_each(function()
    math.randomseed(1234)
    be = B.create("cpu")
  end)

  it("linear with bf16 weights matches a double reference", function()
    local T, k, n = 5, 37, 11
    local x, xt = rand_act(T, k)
    local W = B.bf16_weight("w.bf16", n, k, function() return randn() * 0.2 end)
    local out = ffi.new("float[?]", T * n)
    ok(be, be.ops.linear(be, B.act(x, T, k), W.w, B.act(out, T, n)))
    local e = rel_err(out, n, matmul_t(xt, W.vals))
    assert.is_true(e < TOL, "relative error " .. e)
  end)

  it("linear is batch-invariant: each row of a 5-row call is bit-identical to a 1-row call", function()
    for _, fmt in ipairs({ "bf16", "int4" }) do
      local T, k, n = 5, 128, 9
      local x = rand_act(T, k)
      local W = fmt == "bf16" and B.bf16_weight("w", n, k, function() return randn() end) or int4_weight("w", n, k, 32)
      local all, one = ffi.new("float[?]", T * n), ffi.new("float[?]", n)
      ok(be, be.ops.linear(be, B.act(x, T, k), W.w, B.act(all, T, n)))
      for t = 0, T - 1 do
        ok(be, be.ops.linear(be, B.act(x + t * k, 1, k), W.w, B.act(one, 1, n)))
        for o = 0, n - 1 do assert.are.equal(all[t * n + o], one[o]) end
      end
    end
  end)

  it("INT4 pack-quantized weights: a Lua packer round-trips through the engine's dequant", function()
    for _, case in ipairs({ { 24, 64, 32 }, { 9, 128, 32 }, { 7, 128, 64 }, { 5, 256, 128 } }) do
      local n, k, group = case[1], case[2], case[3]
      local T = 3
      local x, xt = rand_act(T, k)
      local W = int4_weight("w.int4", n, k, group)
      local out = ffi.new("float[?]", T * n)
      ok(be, be.ops.linear(be, B.act(x, T, k), W.w, B.act(out, T, n)))
      local e = rel_err(out, n, matmul_t(xt, W.vals))
      assert.is_true(e < TOL, ("group %d: relative error %g"):format(group, e))
      -- one-hot rows read single weights back exactly: (nibble - 8) * scale
      local eye = floats(k * k, function(i) return (i % (k + 1) == 0) and 1 or 0 end)
      local dq = ffi.new("float[?]", k * n)
      ok(be, be.ops.linear(be, B.act(eye, k, k), W.w, B.act(dq, k, n)))
      for r = 1, n do
        for c = 1, k do assert.are.equal(W.vals[r][c], dq[(c - 1) * n + (r - 1)]) end
      end
    end
  end)

  it("rejects an INT4 weight whose group does not divide its columns", function()
    local W = int4_weight("model.layers.1.mlp.experts.0.up_proj", 4, 64, 32)
    W.w.group = 24
    local x = floats(64, function() return 1 end)
    local out = ffi.new("float[4]")
    local st = be.ops.linear(be, B.act(x, 1, 64), W.w, B.act(out, 1, 4))
    assert.are_not.equal(0, tonumber(st))
    assert.matches("up_proj", ffi.string(C.kd_last_error()))
  end)

  it("linear_pair: out's columns are each weight's linear, bit for bit; a bad pair changes nothing", function()
    local T, K, N0, N1 = 3, 10, 4, 3
    local W0 = B.bf16_weight("gate", N0, K, function() return randn() end)
    local W1 = B.bf16_weight("up", N1, K, function() return randn() end)
    local x = floats(T * K, function() return randn() end)
    local out, a, b = ffi.new("float[?]", T * (N0 + N1)), ffi.new("float[?]", T * N0), ffi.new("float[?]", T * N1)
    ok(be, be.ops.linear_pair(be, B.act(x, T, K), W0.w, W1.w, B.act(out, T, N0 + N1)))
    ok(be, be.ops.linear(be, B.act(x, T, K), W0.w, B.act(a, T, N0)))
    ok(be, be.ops.linear(be, B.act(x, T, K), W1.w, B.act(b, T, N1)))
    for t = 0, T - 1 do
      for n = 0, N0 - 1 do assert.are.equal(a[t * N0 + n], out[t * (N0 + N1) + n]) end
      for n = 0, N1 - 1 do assert.are.equal(b[t * N1 + n], out[t * (N0 + N1) + N0 + n]) end
    end
    local W2 = B.bf16_weight("wide", N1, K + 1, function() return 1 end)
    for i = 0, T * (N0 + N1) - 1 do out[i] = 7.5 end
    local st = be.ops.linear_pair(be, B.act(x, T, K), W0.w, W2.w, B.act(out, T, N0 + N1))
    assert.are_not.equal(0, tonumber(st))
    assert.matches("linear_pair: weights 'gate' %[4, 10%] and 'wide' %[3, 11%]", ffi.string(C.kd_last_error()))
    for i = 0, T * (N0 + N1) - 1 do assert.are.equal(7.5, out[i]) end
  end)

  it("linear_swiglu: silu of the gate's product times the up's, bit for bit; a bad shape changes nothing", function()
    local T, K, I = 3, 10, 4
    local Wg = B.bf16_weight("gate", I, K, function() return randn() end)
    local Wu = B.bf16_weight("up", I, K, function() return randn() end)
    local x = floats(T * K, function() return randn() end)
    local out, gu, two = ffi.new("float[?]", T * I), ffi.new("float[?]", T * 2 * I), ffi.new("float[?]", T * I)
    ok(be, be.ops.linear_swiglu(be, B.act(x, T, K), Wg.w, Wu.w, B.act(out, T, I)))
    ok(be, be.ops.linear_pair(be, B.act(x, T, K), Wg.w, Wu.w, B.act(gu, T, 2 * I)))
    ok(be, be.ops.swiglu(be, B.act(gu, T, I, 2 * I), B.act(gu + I, T, I, 2 * I), B.act(two, T, I)))
    for i = 0, T * I - 1 do assert.are.equal(two[i], out[i]) end
    local W2 = B.bf16_weight("short", I - 1, K, function() return 1 end)
    for i = 0, T * I - 1 do out[i] = 7.5 end
    local st = be.ops.linear_swiglu(be, B.act(x, T, K), Wg.w, W2.w, B.act(out, T, I))
    assert.are_not.equal(0, tonumber(st))
    assert.matches("linear_swiglu: gate 'gate' %[4, 10%] and up 'short' %[3, 10%]", ffi.string(C.kd_last_error()))
    for i = 0, T * I - 1 do assert.are.equal(7.5, out[i]) end
  end)

  it("head_matmul, plain (heads strided in out) and transposed, matches per-head products", function()
    local T, H, k, oc, wstride = 3, 3, 5, 7, 12
    local os = oc + 3   -- the plain product's head stride in out: the 3 columns after each head stay as they were
    -- weight rows: per head wstride rows; plain uses rows [h*wstride+2, +k) (k x oc),
    -- transposed uses rows [h*wstride+2, +oc) of k cols
    local Wp = B.bf16_weight("kv_b", H * wstride, oc, function() return randn() end)
    local Wt = B.bf16_weight("kv_bt", H * wstride, k, function() return randn() end)
    local xstride = k + 2
    local x, xt = rand_act(T, H * xstride)
    local out = ffi.new("float[?]", T * H * os)
    for i = 0, T * H * os - 1 do out[i] = 7.5 end
    ok(be, be.ops.head_matmul(be, B.act(x, T, H * xstride), H, xstride, k, Wp.w, wstride, 2, false,
      B.act(out, T, H * os), oc, os))
    local ref = {}
    for t = 1, T do
      ref[t] = {}
      for h = 0, H - 1 do
        for c = 1, os do
          local s = 7.5
          if c <= oc then
            s = 0
            for i = 1, k do s = s + xt[t][h * xstride + i] * Wp.vals[h * wstride + 2 + i][c] end
          end
          ref[t][h * os + c] = s
        end
      end
    end
    local e = rel_err(out, H * os, ref)
    assert.is_true(e < TOL, "plain: relative error " .. e)
    for t = 0, T - 1 do
      for h = 0, H - 1 do
        for c = oc, os - 1 do assert.are.equal(7.5, out[t * H * os + h * os + c]) end
      end
    end
    ok(be, be.ops.head_matmul(be, B.act(x, T, H * xstride), H, xstride, k, Wt.w, wstride, 2, true,
      B.act(out, T, H * oc), oc, oc))
    ref = {}
    for t = 1, T do
      ref[t] = {}
      for h = 0, H - 1 do
        for c = 1, oc do
          local s = 0
          for i = 1, k do s = s + xt[t][h * xstride + i] * Wt.vals[h * wstride + 2 + c][i] end
          ref[t][h * oc + c] = s
        end
      end
    end
    e = rel_err(out, H * oc, ref)
    assert.is_true(e < TOL, "transposed: relative error " .. e)
  end)

  it("rmsnorm over whole rows and over head segments", function()
    local T, d = 4, 6
    for _, segs in ipairs({ 1, 3 }) do
      local cols = d * segs
      local x, xt = rand_act(T, cols, 3)
      local W = B.bf16_weight("norm", d, 1, function() return 0.5 + math.random() end)
      local out = ffi.new("float[?]", T * cols)
      local eps = 1e-5
      ok(be, be.ops.rmsnorm(be, B.act(x, T, cols), W.w, eps, B.act(out, T, cols)))
      local ref = {}
      for t = 1, T do
        ref[t] = {}
        for s = 0, segs - 1 do
          local ss = 0
          for i = 1, d do ss = ss + xt[t][s * d + i] ^ 2 end
          local inv = 1 / math.sqrt(ss / d + eps)
          for i = 1, d do ref[t][s * d + i] = W.vals[i][1] * xt[t][s * d + i] * inv end
        end
      end
      local e = rel_err(out, cols, ref)
      assert.is_true(e < TOL, segs .. " segments: relative error " .. e)
    end
  end)

  it("add_rmsnorm: x + y and its norm, bit for bit add followed by rmsnorm; a bad weight changes nothing", function()
    local T, d = 3, 8
    local x, xt = rand_act(T, d, 5)
    local y, yt = rand_act(T, d, 6)
    local W = B.bf16_weight("norm", d, 1, function() return 0.5 + math.random() end)
    local eps = 1e-6
    local out = ffi.new("float[?]", T * d)
    ok(be, be.ops.add_rmsnorm(be, B.act(x, T, d), B.act(y, T, d), W.w, eps, B.act(out, T, d)))
    local sum, ref = {}, {}
    for t = 1, T do
      sum[t], ref[t] = {}, {}
      local ss = 0
      for i = 1, d do
        sum[t][i] = xt[t][i] + yt[t][i]
        ss = ss + sum[t][i] ^ 2
      end
      local inv = 1 / math.sqrt(ss / d + eps)
      for i = 1, d do ref[t][i] = W.vals[i][1] * sum[t][i] * inv end
    end
    assert.is_true(rel_err(x, d, sum) < TOL)
    assert.is_true(rel_err(out, d, ref) < TOL)
    -- the unfused pair on the same inputs gives the same bits
    local x2, y2, out2 = ffi.new("float[?]", T * d), ffi.new("float[?]", T * d), ffi.new("float[?]", T * d)
    for t = 1, T do for i = 1, d do x2[(t - 1) * d + i - 1], y2[(t - 1) * d + i - 1] = xt[t][i], yt[t][i] end end
    ok(be, be.ops.add(be, B.act(x2, T, d), B.act(y2, T, d)))
    ok(be, be.ops.rmsnorm(be, B.act(x2, T, d), W.w, eps, B.act(out2, T, d)))
    local function same(a, b) for i = 0, T * d - 1 do if a[i] ~= b[i] then return false end end return true end
    assert.is_true(same(x, x2) and same(out, out2))
    -- a weight of the wrong width is refused before x changes
    local Wbad = B.bf16_weight("bad_norm", d - 1, 1, function() return 1 end)
    local before = ffi.new("float[?]", T * d)
    ffi.copy(before, x, T * d * 4)
    local st = be.ops.add_rmsnorm(be, B.act(x, T, d), B.act(y, T, d), Wbad.w, eps, B.act(out, T, d))
    assert.are_not.equal(0, st)
    local msg = ffi.string(C.kd_last_error())
    assert.truthy(msg:find("cpu add_rmsnorm: weight 'bad_norm' has 7 entries, expected the 8 cols of a row", 1, true), msg)
    assert.is_true(same(x, before))
  end)

  it("rope: interleaved pairs (MLA) and rotate-half, on an offset inside each head", function()
    local T, H, stride, off, dim = 3, 2, 10, 4, 6
    local inv = floats(dim / 2, function(i) return 1 / (50000 ^ (2 * i / dim)) * (i == 2 and 0.125 or 1) end)
    for _, interleaved in ipairs({ true, false }) do
      local x, xt = rand_act(T, H * stride)
      local pos = ffi.new("int32_t[3]", { 0, 7, 1234 })
      local r = ffi.new("kd_rope")
      r.dim, r.interleaved, r.attn_factor, r.inv_freq = dim, interleaved, 1.25, inv
      ok(be, be.ops.rope(be, B.act(x, T, H * stride), H, stride, off, pos, r))
      local ref = {}
      for t = 1, T do
        ref[t] = {}
        for c = 1, H * stride do ref[t][c] = xt[t][c] end
        for h = 0, H - 1 do
          for i = 0, dim / 2 - 1 do
            local ang = B.f32(pos[t - 1] * inv[i])          -- fp32 angle, as HF computes it
            local cs, sn = math.cos(ang) * 1.25, math.sin(ang) * 1.25
            local ia = interleaved and 2 * i or i
            local ib = interleaved and 2 * i + 1 or i + dim / 2
            local a, b = xt[t][h * stride + off + ia + 1], xt[t][h * stride + off + ib + 1]
            ref[t][h * stride + off + ia + 1] = a * cs - b * sn
            ref[t][h * stride + off + ib + 1] = b * cs + a * sn
          end
        end
      end
      local e = rel_err(x, H * stride, ref)
      assert.is_true(e < TOL, (interleaved and "interleaved" or "rotate-half") .. ": relative error " .. e)
    end
  end)

  it("mla_rope_store: the query's roped part beside its latent, the normed and roped latent rows in the cache", function()
    -- 2 heads of q [qnope 3 | qpe 4], qfull heads [lat 5 | pe 4], kva [c_kv 6 | k_pe 4], 9 cache rows
    local T, H, dn, r, c, d, rows = 3, 2, 3, 5, 6, 4, 9
    local qs, fs, kc = dn + d, r + d, c + d
    local inv = floats(d / 2, function(i) return 1 / (10000 ^ (2 * i / d)) end)
    local W = B.bf16_weight("kv_a_norm", c, 1, function() return 0.5 + math.random() end)
    local pos = ffi.new("int32_t[3]", { 5, 6, 6 })
    local rp = ffi.new("kd_rope")
    rp.dim, rp.interleaved, rp.attn_factor, rp.inv_freq = d, true, 1.1, inv
    local eps = 1e-6
    local function rot(src, i, p)   -- rope pair i of src (a Lua row slice table, 1-based) at position p
      local ang = B.f32(p * inv[i])
      local cs, sn = math.cos(ang) * 1.1, math.sin(ang) * 1.1
      local a, b = src[2 * i + 1], src[2 * i + 2]
      return a * cs - b * sn, b * cs + a * sn
    end
    for _, dev_len in ipairs({ false, true }) do
      local q, qt = rand_act(T, H * qs)
      local kva, kt = rand_act(T, kc, 2)
      local qfull = floats(T * H * fs, function() return 7.5 end)
      local cache = floats(rows * kc, function() return -3.25 end)
      local len = ffi.new("int32_t[1]", 4)
      local row0 = dev_len and 1 or 5      -- the rows start at 1 + *len = 5 either way
      ok(be, be.ops.mla_rope_store(be, B.act(q, T, H * qs), B.act(qfull, T, H * fs), H, B.act(kva, T, kc), W.w, eps,
        pos, rp, B.act(cache, rows, kc), row0, dev_len and len or nil))
      local qref, cref = {}, {}
      for t = 1, T do
        qref[t] = {}
        for h = 0, H - 1 do
          for j = 1, r do qref[t][h * fs + j] = 7.5 end
          local pe = {}
          for j = 1, d do pe[j] = qt[t][h * qs + dn + j] end
          for i = 0, d / 2 - 1 do
            qref[t][h * fs + r + 2 * i + 1], qref[t][h * fs + r + 2 * i + 2] = rot(pe, i, pos[t - 1])
          end
        end
      end
      for row = 1, rows do
        cref[row] = {}
        for j = 1, kc do cref[row][j] = -3.25 end
      end
      for t = 1, T do
        local row, ss = cref[5 + t], 0
        for j = 1, c do ss = ss + kt[t][j] ^ 2 end
        local invn = 1 / math.sqrt(ss / c + eps)
        for j = 1, c do row[j] = W.vals[j][1] * kt[t][j] * invn end
        local pe = {}
        for j = 1, d do pe[j] = kt[t][c + j] end
        for i = 0, d / 2 - 1 do row[c + 2 * i + 1], row[c + 2 * i + 2] = rot(pe, i, pos[t - 1]) end
      end
      local what = dev_len and "device length" or "host length"
      local e = rel_err(qfull, H * fs, qref)
      assert.is_true(e < TOL, what .. ": qfull relative error " .. e)
      e = rel_err(cache, kc, cref)
      assert.is_true(e < TOL, what .. ": cache relative error " .. e)
      for i = 0, 4 * kc - 1 do assert.are.equal(-3.25, cache[i]) end          -- rows before the new ones
      for i = 8 * kc, 9 * kc - 1 do assert.are.equal(-3.25, cache[i]) end    -- the row after them
    end
    -- rows past the cache: an error naming the op and the rows, nothing written
    local q = floats(T * H * qs, function() return 1 end)
    local kva = floats(T * kc, function() return 1 end)
    local qfull = floats(T * H * fs, function() return 7.5 end)
    local cache = floats(rows * kc, function() return -3.25 end)
    local st = be.ops.mla_rope_store(be, B.act(q, T, H * qs), B.act(qfull, T, H * fs), H, B.act(kva, T, kc), W.w, eps,
      pos, rp, B.act(cache, rows, kc), 7, nil)
    assert.are_not.equal(0, tonumber(st))
    assert.matches("mla_rope_store: rows %[7, 10%) outside the 9 cache rows", ffi.string(C.kd_last_error()))
    for i = 0, T * H * fs - 1 do assert.are.equal(7.5, qfull[i]) end
    for i = 0, rows * kc - 1 do assert.are.equal(-3.25, cache[i]) end
  end)

  -- attention reference: visibility exactly as backend.h states it
  local function attn_ref(qt, H, hd, kt, vt, vcols, Hkv, past, causal, vis, words, window, scale, dv)
    local T, S = #qt, #kt
    local kstride, vstride = #kt[1] / Hkv, vcols / Hkv
    local out = {}
    for t = 1, T do
      out[t] = {}
      for h = 0, H - 1 do
        local g = math.floor(h / (H / Hkv))
        local sc, m = {}, -math.huge
        for s = 0, S - 1 do
          local see
          if vis then
            if s < past then see = true
            elseif s - past >= T then see = false
            else
              local j = s - past
              local w = vis[(t - 1) * words + math.floor(j / 64)]
              see = bit.band(tonumber(bit.rshift(w, j % 64) % 2), 1) == 1
            end
          else
            see = (not causal) or s <= past + t - 1
          end
          if window > 0 and (past + t - 1) - s >= window then see = false end
          if see then
            local d = 0
            for i = 1, hd do d = d + qt[t][h * hd + i] * kt[s + 1][g * kstride + i] end
            sc[s] = d * scale
            if sc[s] > m then m = sc[s] end
          end
        end
        local sum, o = 0, {}
        for c = 1, dv do o[c] = 0 end
        for s = 0, S - 1 do
          if sc[s] then
            local e = math.exp(sc[s] - m)
            sum = sum + e
            for c = 1, dv do o[c] = o[c] + e * vt[s + 1][g * vstride + c] end
          end
        end
        for c = 1, dv do out[t][h * dv + c] = sum > 0 and o[c] / sum or 0 end
      end
    end
    return out
  end

  it("attention: causal, full, bitmask and sliding window, MQA with a narrower value and GQA", function()
    local cases = {
      -- H, Hkv, hd, kcols, vcols, dv, T, past, mode, window
      { 4, 1, 12, 12, 8, 8, 5, 3, "causal", 0 },     -- MLA-like: key = whole row, value = first 8 cols
      { 4, 2, 6, 12, 10, 5, 4, 0, "full", 0 },        -- GQA, non-causal (drafter)
      { 4, 1, 12, 12, 8, 8, 70, 2, "mask", 0 },       -- tree mask over >64 tokens (2 words per row)
      { 2, 2, 4, 8, 8, 4, 6, 5, "causal", 4 },        -- sliding window
      { 2, 1, 4, 4, 4, 4, 3, 2, "mask", 0 },          -- a token that sees only the past (empty mask row)
    }
    for ci, cs in ipairs(cases) do
      local H, Hkv, hd, kc, vc, dv, T, past, mode, window = unpack(cs)
      local S = past + T
      local q, qt = rand_act(T, H * hd)
      local kv, kvt = rand_act(S, kc)
      local v, vt = rand_act(S, vc)
      local vld = vc
      if ci == 1 or ci == 3 or ci == 5 then v, vt, vld = kv, kvt, kc end   -- value = the first cols of the key rows
      local words = math.ceil(T / 64)
      local vis = nil
      if mode == "mask" then
        vis = ffi.new("uint64_t[?]", T * words)
        local parent = {}
        for i = 0, T - 1 do
          parent[i] = i == 0 and -1 or math.random(0, i - 1)
          -- ancestors + self
          local a = i
          while a >= 0 do
            if not (ci == 5 and i == 1) then
              local wi = i * words + math.floor(a / 64)
              vis[wi] = bit.bor(vis[wi], bit.lshift(1ULL, a % 64))
            end
            a = parent[a]
          end
        end
      end
      local out = ffi.new("float[?]", T * H * dv)
      ok(be, be.ops.attention(be, B.act(q, T, H * hd), H, hd, B.act(kv, S, kc), B.act(v, S, vc, vld), Hkv, past,
        mode == "causal", vis, window, 0.3, B.act(out, T, H * dv)))
      local ref = attn_ref(qt, H, hd, kvt, vt, vc, Hkv, past, mode == "causal", vis, words, window, 0.3, dv)
      local e = rel_err(out, H * dv, ref)
      assert.is_true(e < TOL, ("case %d (%s): relative error %g"):format(ci, mode, e))
    end
  end)

  it("moe: sigmoid noaux_tc routing with group-limited top-k and the experts' weighted sum", function()
    local T, D, I, n, topk, ng, tg = 6, 8, 6, 16, 4, 4, 2
    local x, xt = rand_act(T, D)
    local router = B.bf16_weight("mlp.gate.weight", n, D, function() return randn() end)
    local bias = floats(n, function() return randn() * 0.3 end)
    local gate, up, down = ffi.new("kd_weight[?]", n), ffi.new("kd_weight[?]", n), ffi.new("kd_weight[?]", n)
    local keep, G, U, Dn = {}, {}, {}, {}
    for e = 0, n - 1 do
      G[e] = B.bf16_weight("g", I, D, function() return randn() * 0.3 end)
      U[e] = B.bf16_weight("u", I, D, function() return randn() * 0.3 end)
      Dn[e] = B.bf16_weight("d", D, I, function() return randn() * 0.3 end)
      gate[e], up[e], down[e] = G[e].w, U[e].w, Dn[e].w
    end
    for _, norm in ipairs({ true, false }) do
      local ex = ffi.new("kd_experts")
      ex.n, ex.top_k, ex.n_group, ex.topk_group = n, topk, ng, tg
      ex.norm_topk_prob, ex.routed_scaling_factor = norm, 2.5
      ex.router, ex.bias, ex.gate, ex.up, ex.down = router.w, bias, gate, up, down
      local out = ffi.new("float[?]", T * D)
      ok(be, be.ops.moe(be, B.act(x, T, D), ex, ffi.new("kd_act"), B.act(out, T, D)))
      -- reference (HF DeepseekV3TopkRouter + DeepseekV3Experts)
      local ref = {}
      for t = 1, T do
        local s, choice = {}, {}
        for e = 1, n do
          local l = 0
          for i = 1, D do l = l + xt[t][i] * router.vals[e][i] end
          s[e] = 1 / (1 + math.exp(-l))
          choice[e] = s[e] + bias[e - 1]
        end
        local per = n / ng
        local gsc = {}
        for g = 0, ng - 1 do
          local vals = {}
          for e = g * per + 1, (g + 1) * per do vals[#vals + 1] = choice[e] end
          table.sort(vals, function(a, b) return a > b end)
          gsc[g] = vals[1] + vals[2]
        end
        local order = {}
        for g = 0, ng - 1 do order[#order + 1] = g end
        table.sort(order, function(a, b) return gsc[a] > gsc[b] end)
        local kept = {}
        for j = 1, tg do kept[order[j]] = true end
        for e = 1, n do if not kept[math.floor((e - 1) / per)] then choice[e] = -math.huge end end
        local ids = {}
        for e = 1, n do ids[e] = e end
        table.sort(ids, function(a, b) return choice[a] > choice[b] end)
        local sel, wsum = {}, 0
        for j = 1, topk do sel[j] = ids[j]; wsum = wsum + s[ids[j]] end
        ref[t] = {}
        for c = 1, D do ref[t][c] = 0 end
        table.sort(sel)
        for _, e in ipairs(sel) do
          local w = s[e]
          if norm then w = w / (wsum + 1e-20) end
          w = w * 2.5
          local h = {}
          for j = 1, I do
            local g, u = 0, 0
            for i = 1, D do
              g = g + xt[t][i] * G[e - 1].vals[j][i]
              u = u + xt[t][i] * U[e - 1].vals[j][i]
            end
            h[j] = g / (1 + math.exp(-g)) * u
          end
          for c = 1, D do
            local d = 0
            for j = 1, I do d = d + h[j] * Dn[e - 1].vals[c][j] end
            ref[t][c] = ref[t][c] + w * d
          end
        end
      end
      local e = rel_err(out, D, ref)
      assert.is_true(e < TOL, (norm and "normalized" or "unnormalized") .. ": relative error " .. e)
    end
  end)

  it("moe: the shared expert's output added by the op has the bits of moe, then add; a bad shared changes nothing", function()
    local T, D, I, n = 3, 8, 6, 8
    local x = floats(T * D, function() return randn() end)
    local shared = floats(T * D, function() return randn() end)
    local router = B.bf16_weight("mlp.gate.weight", n, D, function() return randn() end)
    local gate, up, down = ffi.new("kd_weight[?]", n), ffi.new("kd_weight[?]", n), ffi.new("kd_weight[?]", n)
    local keep = {}
    for e = 0, n - 1 do
      keep[#keep + 1] = B.bf16_weight("g", I, D, function() return randn() * 0.3 end)
      keep[#keep + 1] = B.bf16_weight("u", I, D, function() return randn() * 0.3 end)
      keep[#keep + 1] = B.bf16_weight("d", D, I, function() return randn() * 0.3 end)
      gate[e], up[e], down[e] = keep[#keep - 2].w, keep[#keep - 1].w, keep[#keep].w
    end
    local ex = ffi.new("kd_experts")
    ex.n, ex.top_k, ex.n_group, ex.topk_group = n, 2, 1, 1
    ex.norm_topk_prob, ex.routed_scaling_factor = true, 2.5
    ex.router, ex.bias, ex.gate, ex.up, ex.down = router.w, nil, gate, up, down
    local plain, fused = ffi.new("float[?]", T * D), ffi.new("float[?]", T * D)
    ok(be, be.ops.moe(be, B.act(x, T, D), ex, ffi.new("kd_act"), B.act(plain, T, D)))
    ok(be, be.ops.add(be, B.act(plain, T, D), B.act(shared, T, D)))
    ok(be, be.ops.moe(be, B.act(x, T, D), ex, B.act(shared, T, D), B.act(fused, T, D)))
    for i = 0, T * D - 1 do
      assert.are.equal(plain[i], fused[i], "element " .. i)
    end
    -- a shared of another shape, or out itself: refused, out untouched
    local before = ffi.new("float[?]", T * D)
    ffi.copy(before, fused, ffi.sizeof(before))
    assert.are_not.equal(0, tonumber(be.ops.moe(be, B.act(x, T, D), ex, B.act(shared, T - 1, D), B.act(fused, T, D))))
    assert.matches("moe: shared: expected 3 x 8, got 2 x 8", ffi.string(C.kd_last_error()))
    assert.are_not.equal(0, tonumber(be.ops.moe(be, B.act(x, T, D), ex, B.act(fused, T, D), B.act(fused, T, D))))
    assert.matches("moe: shared must not alias out", ffi.string(C.kd_last_error()))
    for i = 0, T * D - 1 do assert.are.equal(before[i], fused[i]) end
  end)

  -- planted ties (the mutation run's M4 survived without them): equal router rows give equal
  -- scores, and the rule (cpu_moe.c, as CUDA's) takes the lower expert, and the lower group
  it("moe: equal router scores go to the lower expert, equal group scores to the lower group", function()
    local D, I, n = 8, 4, 8
    local x, xt = rand_act(1, D)
    local G, U, Dn = {}, {}, {}
    local gate, up, down = ffi.new("kd_weight[?]", n), ffi.new("kd_weight[?]", n), ffi.new("kd_weight[?]", n)
    for e = 0, n - 1 do
      G[e] = B.bf16_weight("g", I, D, function() return randn() * 0.5 end)
      U[e] = B.bf16_weight("u", I, D, function() return randn() * 0.5 end)
      Dn[e] = B.bf16_weight("d", D, I, function() return randn() * 0.5 end)
      gate[e], up[e], down[e] = G[e].w, U[e].w, Dn[e].w
    end
    -- expert e's output for the token, in Lua (its routing weight is 1: top-1, normalised)
    local function expert(e)
      local h, o = {}, {}
      for j = 1, I do
        local g, u = 0, 0
        for i = 1, D do g, u = g + xt[1][i] * G[e].vals[j][i], u + xt[1][i] * U[e].vals[j][i] end
        h[j] = g / (1 + math.exp(-g)) * u
      end
      for c = 1, D do
        o[c] = 0
        for j = 1, I do o[c] = o[c] + h[j] * Dn[e].vals[c][j] end
      end
      return { o }
    end
    -- router rows: a multiple of x, so row c * x scores sigmoid(c |x|^2); `tops` get the largest
    local function case(ng, tg, mult, want, other)
      local router = B.bf16_weight("mlp.gate.weight", n, D, function(e, i) return mult[e + 1] * xt[1][i + 1] end)
      local ex = ffi.new("kd_experts")
      ex.n, ex.top_k, ex.n_group, ex.topk_group = n, 1, ng, tg
      ex.norm_topk_prob, ex.routed_scaling_factor = true, 1.0
      ex.router, ex.bias, ex.gate, ex.up, ex.down = router.w, nil, gate, up, down
      local out = ffi.new("float[?]", D)
      ok(be, be.ops.moe(be, B.act(x, 1, D), ex, ffi.new("kd_act"), B.act(out, 1, D)))
      assert.is_true(rel_err(out, D, expert(want)) < TOL, "expert " .. want .. " expected")
      assert.is_true(rel_err(out, D, expert(other)) > 1e-2, "the tie's other side gives a different output")
    end
    -- one group: experts 2 and 5 tie at the top
    case(1, 1, { -1, -1, 2, -1, -1, 2, -1, -1 }, 2, 5)
    -- two groups of 4 with equal top-2 sums (experts 1 + 0 against 5 + 4): group 0, then expert 1
    case(2, 1, { 1, 2, -1, -1, 1, 2, -1, -1 }, 1, 5)
  end)

  it("log_softmax, argmax and top-k (equal values: lower id first)", function()
    local x = floats(2 * 7, function(i) return ({ 1, 5, 3, 5, -2, 0, 5, 2, 2, 9, 1, 9, 9, -1 })[i + 1] end)
    local ids = ffi.new("int32_t[2]")
    ok(be, be.ops.argmax(be, B.act(x, 2, 7), ids))
    assert.are.same({ 1, 2 }, { ids[0], ids[1] })
    local vals, tid = ffi.new("float[8]"), ffi.new("int32_t[8]")
    ok(be, be.ops.topk(be, B.act(x, 2, 7), 4, vals, tid))
    assert.are.same({ 1, 3, 6, 2, 2, 4, 5, 0 }, { tid[0], tid[1], tid[2], tid[3], tid[4], tid[5], tid[6], tid[7] })
    assert.are.same({ 5, 5, 5, 3 }, { vals[0], vals[1], vals[2], vals[3] })
    local big, bt = rand_act(3, 1000)
    local bv, bi = ffi.new("float[?]", 3 * 50), ffi.new("int32_t[?]", 3 * 50)
    ok(be, be.ops.topk(be, B.act(big, 3, 1000), 50, bv, bi))
    for r = 1, 3 do
      local order = {}
      for c = 1, 1000 do order[c] = c - 1 end
      table.sort(order, function(a, b) return bt[r][a + 1] > bt[r][b + 1] end)
      for j = 1, 50 do assert.are.equal(order[j], bi[(r - 1) * 50 + j - 1]) end
    end
    ok(be, be.ops.log_softmax(be, B.act(big, 3, 1000)))
    local ref = {}
    for r = 1, 3 do
      local m, s = -math.huge, 0
      for c = 1, 1000 do m = math.max(m, bt[r][c]) end
      for c = 1, 1000 do s = s + math.exp(bt[r][c] - m) end
      ref[r] = {}
      for c = 1, 1000 do ref[r][c] = bt[r][c] - m - math.log(s) end
    end
    local e = rel_err(big, 1000, ref)
    assert.is_true(e < TOL, "log_softmax relative error " .. e)
  end)

  it("copy converts to bf16 with round-to-nearest-even, gather_rows and move_rows move rows, embed looks rows up", function()
    local src = floats(4, function(i) return ({ 1.0, 1.00390625, 1.01171875, -3.3 })[i + 1] end)
    local dst = ffi.new("uint16_t[4]")
    local a = B.act(dst, 1, 4)
    a.dtype = C.KD_BF16
    ok(be, be.ops.copy(be, a, B.act(src, 1, 4)))
    for i = 0, 3 do assert.are.equal(B.f32_to_bf16(src[i]), dst[i]) end
    assert.are.equal(0x3f80, dst[1])            -- 1 + 2^-8 is a tie: rounds to even (1.0)
    assert.are.equal(0x3f82, dst[2])            -- 1 + 3*2^-8: tie, rounds up to even
    local back = ffi.new("float[4]")
    ok(be, be.ops.copy(be, B.act(back, 1, 4), a))
    assert.are.equal(B.bf16_to_f32(dst[3]), back[3])

    local m, mt = rand_act(5, 3)
    local g = ffi.new("float[9]")
    local rows = ffi.new("int32_t[3]", { 4, 0, 2 })
    ok(be, be.ops.gather_rows(be, B.act(g, 3, 3), B.act(m, 5, 3), rows, 3))
    for i = 0, 2 do for c = 0, 2 do assert.are.equal(mt[rows[i] + 1][c + 1], g[i * 3 + c]) end end
    rows[1] = 5
    assert.are_not.equal(0, tonumber(be.ops.gather_rows(be, B.act(g, 3, 3), B.act(m, 5, 3), rows, 3)))

    -- move_rows: in each of three caches rows 2 + i <- rows 3 + keep[i], in the order of i (rows 2, 3,
    -- 4 <- 4, 6, 9: row 4 is read before it is overwritten); the others stay
    local L, S, W = 3, 12, 5
    local caches, before = ffi.new("kd_act[3]"), {}
    local keep = ffi.new("int32_t[3]", { 1, 3, 6 })
    for l = 0, L - 1 do
      local cm, ct = rand_act(S, W)
      caches[l] = B.act(cm, S, W)
      before[l] = { data = cm, vals = ct }
    end
    ok(be, be.ops.move_rows(be, caches, L, 3, keep, 3, 2))
    for l = 0, L - 1 do
      for r = 0, S - 1 do
        local from = (r >= 2 and r <= 4) and 3 + keep[r - 2] or r
        for c = 0, W - 1 do assert.are.equal(before[l].vals[from + 1][c + 1], before[l].data[r * W + c]) end
      end
    end
    -- refused before any row moves: a row that would move away from row 0, rows not increasing,
    -- a source past the cache, caches of two shapes
    local moved = {}
    for l = 0, L - 1 do for i = 0, S * W - 1 do moved[#moved + 1] = before[l].data[i] end end
    for _, c in ipairs({ { { 0, 1 }, 3, 4, "row 3 -> 4" }, { { 2, 2 }, 0, 0, "rows[1] = 2" },
                         { { 5, 12 }, 0, 0, "row 12 -> 1" } }) do
      local rr = ffi.new("int32_t[2]", c[1])
      assert.are_not.equal(0, tonumber(be.ops.move_rows(be, caches, L, c[2], rr, 2, c[3])))
      assert.truthy(ffi.string(C.kd_last_error()):find(c[4], 1, true), ffi.string(C.kd_last_error()))
    end
    caches[2].rows = S - 1
    assert.are_not.equal(0, tonumber(be.ops.move_rows(be, caches, L, 3, keep, 3, 2)))
    assert.truthy(ffi.string(C.kd_last_error()):find("cache 2 is 11 x 5", 1, true))
    local k = 0
    for l = 0, L - 1 do for i = 0, S * W - 1 do k = k + 1; assert.are.equal(moved[k], before[l].data[i]) end end

    local E = B.bf16_weight("embed_tokens", 10, 4, function() return randn() end)
    local ids = ffi.new("int32_t[2]", { 7, 3 })
    local eo = ffi.new("float[8]")
    ok(be, be.ops.embed(be, E.w, ids, B.act(eo, 2, 4)))
    for c = 1, 4 do
      assert.are.equal(E.vals[8][c], eo[c - 1])
      assert.are.equal(E.vals[4][c], eo[4 + c - 1])
    end
  end)

  it("swiglu and scale_add", function()
    local g, gt = rand_act(2, 5)
    local u, ut = rand_act(2, 5)
    local o = ffi.new("float[10]")
    ok(be, be.ops.swiglu(be, B.act(g, 2, 5), B.act(u, 2, 5), B.act(o, 2, 5)))
    local ref = {}
    for r = 1, 2 do
      ref[r] = {}
      for c = 1, 5 do ref[r][c] = gt[r][c] / (1 + math.exp(-gt[r][c])) * ut[r][c] end
    end
    assert.is_true(rel_err(o, 5, ref) < TOL)
    ok(be, be.ops.scale_add(be, B.act(g, 2, 5), B.act(u, 2, 5), -0.5))
    for r = 1, 2 do for c = 1, 5 do ref[r][c] = gt[r][c] - 0.5 * ut[r][c] end end
    assert.is_true(rel_err(g, 5, ref) < TOL)
  end)
end)
