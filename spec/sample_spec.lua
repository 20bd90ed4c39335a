-- sample_spec.lua: the keyed sampling rule (core/sample.c, docs/ddtree.md):
-- softmax(logits / T) in double, top-k, min-p, then top-p, an inverse-CDF draw in id order
-- with u = uniform(seed, position). Frequencies over many positions/seeds must match
-- the distribution the rule defines (a chi-square bound), truncation must exclude
-- exactly the right tokens, and the draw must be a pure function of (seed, position).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local ffi = require("ffi")
local C = kd.C

local function row_of(list)
  local a = ffi.new("float[?]", #list)
  for i = 1, #list do a[i - 1] = list[i] end
  return a, #list
end

local out = ffi.new("int32_t[1]")
local function draw(row, V, sp, pos)
  kd.check(C.kd_sample_logits(row, V, sp, pos, out), "kd_sample_logits")
  return out[0]
end

local function sampler(t) return kd.sampler(t) end

-- the distribution the rule defines (Lua, double): softmax(x/T), top-k, top-p
local function target_probs(x, T, top_k, top_p)
  local V = #x
  local m = -math.huge
  for i = 1, V do if x[i] / T > m then m = x[i] / T end end
  local w = {}
  for i = 1, V do w[i] = math.exp(x[i] / T - m) end
  local order = {}
  for i = 1, V do order[i] = i end
  table.sort(order, function(a, b) if w[a] ~= w[b] then return w[a] > w[b] end return a < b end)
  local keep = {}
  local nk = V
  if top_k and top_k > 0 and top_k < V then nk = top_k end
  local S = 0
  for j = 1, nk do S = S + w[order[j]] end
  if top_p and top_p > 0 and top_p < 1 then
    local c = 0
    for j = 1, nk do
      c = c + w[order[j]]
      if c >= top_p * S then nk = j; break end
    end
  end
  local W = 0
  for j = 1, nk do keep[order[j]] = true; W = W + w[order[j]] end
  local p = {}
  for i = 1, V do p[i] = keep[i] and w[i] / W or 0 end
  return p
end

-- chi-square statistic over bins with expected count >= 5 (others pooled), and a
-- conservative critical value (Wilson-Hilferty, z = 4: p ~ 3e-5)
local function chi_square(counts, p, N)
  local chi, df, pool_o, pool_e = 0, -1, 0, 0
  for i = 1, #p do
    local e = p[i] * N
    if e >= 5 then
      chi = chi + (counts[i] - e) ^ 2 / e
      df = df + 1
    else
      pool_o = pool_o + counts[i]; pool_e = pool_e + e
    end
  end
  if pool_e >= 5 then chi = chi + (pool_o - pool_e) ^ 2 / pool_e; df = df + 1 end
  local z = 4
  local crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ^ 3
  return chi, crit, df
end

local function frequencies(x, sp_t, N, vary)
  local row, V = row_of(x)
  local counts = {}
  for i = 1, V do counts[i] = 0 end
  for k = 1, N do
    local sp, pos
    if vary == "seed" then
      sp = sampler({ temperature = sp_t.temperature, top_k = sp_t.top_k, top_p = sp_t.top_p, seed = k * 7919 })
      pos = 17
    else
      sp = sampler(sp_t)
      pos = k
    end
    local tok = draw(row, V, sp, pos)
    counts[tok + 1] = counts[tok + 1] + 1
  end
  return counts
end

local X = { 2.0, 1.0, 0.5, 0.5, -1.0, 3.0, 0.0, -0.5, 1.5, -2.0 }

describe("keyed sampling: distribution", function()
  for _, cfg in ipairs({
    { name = "T = 1", sp = { temperature = 1.0, seed = 1 } },
    { name = "T = 0.6", sp = { temperature = 0.6, seed = 2 } },
    { name = "T = 2.5", sp = { temperature = 2.5, seed = 3 } },
    { name = "top-k 4", sp = { temperature = 1.0, top_k = 4, seed = 4 } },
    { name = "top-p 0.8", sp = { temperature = 1.0, top_p = 0.8, seed = 5 } },
    { name = "top-k 6 + top-p 0.9, T = 1.3", sp = { temperature = 1.3, top_k = 6, top_p = 0.9, seed = 6 } },
  }) do
    for _, vary in ipairs({ "position", "seed" }) do
      it(cfg.name .. ": frequencies over many " .. vary .. "s match the rule's distribution", function()
        local N = 20000
        local counts = frequencies(X, cfg.sp, N, vary)
        local p = target_probs(X, cfg.sp.temperature, cfg.sp.top_k, cfg.sp.top_p)
        for i = 1, #X do
          if p[i] == 0 then
            assert.are.equal(0, counts[i], "token " .. (i - 1) .. " is outside top-k/top-p but was drawn")
          end
        end
        local chi, crit, df = chi_square(counts, p, N)
        assert.is_true(df >= 2)
        assert.is_true(chi < crit, string.format("chi-square %.2f >= %.2f (df %d)", chi, crit, df))
      end)
    end
  end

  it("top-k and top-p exclude exactly the tokens the rule excludes", function()
    -- probabilities at T = 1: token 5 (3.0) > 0 (2.0) > 8 (1.5) > 1 (1.0) > 2 = 3 (0.5) > ...
    local p = target_probs(X, 1.0, 3, nil)
    local kept = {}
    for i = 1, #X do if p[i] > 0 then kept[#kept + 1] = i - 1 end end
    assert.are.same({ 0, 5, 8 }, kept)
    -- tie at the top-k boundary: tokens 2 and 3 are equal; top_k = 5 keeps the lower id
    local counts = frequencies(X, { temperature = 1.0, top_k = 5, seed = 9 }, 4000, "position")
    assert.is_true(counts[3] > 0)            -- token 2 kept
    assert.are.equal(0, counts[4])           -- token 3 (same logit, higher id) excluded
    counts = frequencies({ 3, 2, 0, 0, 0, 0, 0, 1, 0, 1 }, { temperature = 1.0, top_k = 3, seed = 8 }, 4000, "position")
    assert.is_true(counts[8] > 0)            -- id 7 kept, id 9 (the same logit) not
    assert.are.equal(0, counts[10])
    -- top-p: mass of {5} is ~0.49 at T = 1, {5, 0} ~0.67: p = 0.6 keeps exactly {5, 0}
    counts = frequencies(X, { temperature = 1.0, top_p = 0.6, seed = 10 }, 4000, "position")
    for i = 1, #X do
      local tok = i - 1
      if tok == 5 or tok == 0 then assert.is_true(counts[i] > 0) else assert.are.equal(0, counts[i]) end
    end
    -- the nucleus always keeps at least the best token
    counts = frequencies(X, { temperature = 1.0, top_p = 1e-6, seed = 11 }, 200, "position")
    assert.are.equal(200, counts[6])
  end)

  it("tokens with -inf logits are never drawn", function()
    local x = { -math.huge, 0, -math.huge, 0.5, -math.huge }
    local counts = frequencies(x, { temperature = 1.0, seed = 12 }, 3000, "position")
    assert.are.equal(0, counts[1] + counts[3] + counts[5])
    assert.are.equal(3000, counts[2] + counts[4])
  end)

  it("the keyed uniform: equal logits over 4096 ids make the token floor(u * V); u is uniform and "
    .. "successive positions are uncorrelated", function()
    local V = 4096
    local row = ffi.new("float[?]", V)   -- all zero
    local sp = sampler({ temperature = 1.0, seed = 2026 })
    local N, B = 40000, 64
    local bins = {}
    for i = 1, B do bins[i] = 0 end
    local prev, sxy, sx, sy, sxx, syy = nil, 0, 0, 0, 0, 0
    for pos = 0, N - 1 do
      local u = (draw(row, V, sp, pos) + 0.5) / V
      local b = math.floor(u * B) + 1
      bins[b] = bins[b] + 1
      if prev then
        sxy = sxy + prev * u; sx = sx + prev; sy = sy + u; sxx = sxx + prev * prev; syy = syy + u * u
      end
      prev = u
    end
    local p = {}
    for i = 1, B do p[i] = 1 / B end
    local chi, crit = chi_square(bins, p, N)
    assert.is_true(chi < crit, string.format("uniformity chi-square %.1f >= %.1f", chi, crit))
    local n = N - 1
    local r = (n * sxy - sx * sy) / math.sqrt((n * sxx - sx * sx) * (n * syy - sy * sy))
    assert.is_true(math.abs(r) < 0.03, "lag-1 correlation " .. r)
  end)
end)

describe("keyed sampling: determinism", function()
  local row, V = row_of(X)

  it("the same (seed, position) gives the same token, call after call", function()
    local sp = sampler({ temperature = 1.0, seed = 77 })
    for pos = 0, 50 do
      local a = draw(row, V, sp, pos)
      for _ = 1, 3 do assert.are.equal(a, draw(row, V, sp, pos)) end
      local sp2 = sampler({ temperature = 1.0, seed = 77 })
      assert.are.equal(a, draw(row, V, sp2, pos))
    end
  end)

  it("different positions and different seeds give different draws", function()
    local uni = ffi.new("float[?]", 1000)
    local sp = sampler({ temperature = 1.0, seed = 5 })
    local seen, distinct = {}, 0
    for pos = 100, 199 do
      local t = draw(uni, 1000, sp, pos)
      if not seen[t] then seen[t] = true; distinct = distinct + 1 end
    end
    assert.is_true(distinct > 85, "distinct tokens over 100 positions: " .. distinct)
    local same = 0
    for seed = 1, 100 do
      local a = draw(uni, 1000, sampler({ temperature = 1.0, seed = seed }), 42)
      local b = draw(uni, 1000, sampler({ temperature = 1.0, seed = seed + 1000 }), 42)
      if a == b then same = same + 1 end
    end
    assert.is_true(same < 5, "seed changes left the token unchanged " .. same .. " times in 100")
  end)

  it("temperature <= 0 is greedy: the argmax, ties to the lower id, no draw", function()
    local r2, V2 = row_of({ 1, 7, 3, 7, -2 })
    for _, T in ipairs({ 0, -1 }) do
      for pos = 0, 20 do
        assert.are.equal(1, draw(r2, V2, sampler({ temperature = T, seed = pos }), pos))
      end
    end
    assert.are.equal(1, draw(r2, V2, nil, 3))
  end)

  it("a 163840-wide row samples with top-k and top-p", function()
    local V = 163840
    local big = ffi.new("float[?]", V)
    local s = 1
    for i = 0, V - 1 do
      s = (s * 1103515245 + 12345) % 2147483648
      big[i] = (s / 2147483648) * 4
    end
    big[99999] = 30
    big[123] = 29
    assert.are.equal(99999, draw(big, V, sampler({ temperature = 0 }), 0))
    local seen = {}
    for pos = 0, 60 do
      local t = draw(big, V, sampler({ temperature = 1.0, top_p = 0.9, seed = 3 }), pos)
      assert.is_true(t == 99999 or t == 123, "nucleus 0.9 holds only the two dominant ids, got " .. t)
      seen[t] = true
      t = draw(big, V, sampler({ temperature = 5.0, top_k = 2, seed = 3 }), pos)
      assert.is_true(t == 99999 or t == 123)
    end
    assert.is_true(seen[99999] and seen[123])
  end)
end)

describe("keyed sampling: the mass's arithmetic (core/sample_rule.h)", function()
  it("kd_rule_mass equals the rule written with division, libm's rint, ldexp and a conversion, value for value", function()
    local T = require("helpers.testlib")
    local checked = ffi.new("long[1]")
    local bad = T.C.kd_test_rule_mass_mismatches(3000000, 12345, checked)
    assert.is_true(tonumber(checked[0]) > 3000000, "values compared: " .. tonumber(checked[0]))
    assert.are.equal(0, tonumber(bad))
  end)
end)

describe("keyed sampling vs the Python reference (min_p_ref.py: top-k, min-p, top-p, ties, -inf)", function()
  local json = require("dkjson")
  local f = assert(io.open("spec/fixtures/sample-cases.json", "r"))
  local fix = json.decode(f:read("*a"), 1, json.null)   -- null (-inf) as json.null, not a hole
  f:close()
  local rows = {}
  for r, list in ipairs(fix.rows) do
    local a = ffi.new("float[?]", #list)
    for i = 1, #list do a[i - 1] = list[i] == json.null and -math.huge or list[i] end
    rows[r] = { a, #list }
  end
  it(#fix.cases .. " draws equal the reference's, and min-p changes some of them", function()
    assert.is_true(#fix.cases >= 1000)
    local changed = {}
    for n, c in ipairs(fix.cases) do
      local a, V = rows[c.row + 1][1], rows[c.row + 1][2]
      local sp = sampler({ temperature = c.temperature, top_k = c.top_k, top_p = c.top_p, min_p = c.min_p, seed = c.seed })
      local got = draw(a, V, sp, c.position)
      if got ~= c.token then
        error(string.format("case %d (row %d, V %d, T %.9g, top_k %d, top_p %.9g, min_p %.9g, seed %d, position %d): "
          .. "token %d, reference %d", n, c.row, V, c.temperature, c.top_k, c.top_p, c.min_p, c.seed, c.position, got,
          c.token))
      end
      if c.min_p > 0 then
        local off = draw(a, V, sampler({ temperature = c.temperature, top_k = c.top_k, top_p = c.top_p, seed = c.seed }),
          c.position)
        if off ~= got then changed[#changed + 1] = n end
      end
    end
    assert.is_true(#changed > 20, "min-p changed " .. #changed .. " draws")
  end)

  it("min-p 1 keeps only the tokens whose mass equals the top one's; min-p <= 0 is off", function()
    local row, V = row_of({ 1.0, 3.0, 3.0, 2.999, -1.0 })
    for pos = 0, 40 do
      local t = draw(row, V, sampler({ temperature = 1.0, min_p = 1.0, seed = 5 }), pos)
      assert.is_true(t == 1 or t == 2, "token " .. t)
      assert.are.equal(draw(row, V, sampler({ temperature = 1.0, seed = 5 }), pos),
        draw(row, V, sampler({ temperature = 1.0, min_p = -0.5, seed = 5 }), pos))
    end
  end)
end)

describe("keyed sampling: bad input", function()
  local row, V = row_of(X)
  it("NaN temperature / top_p, NaN or +inf logits, an all -inf row, vocab <= 0, NULL", function()
    local function fails(st, pat)
      assert.are.equal(C.KD_ERR_ARG, st)
      assert.matches(pat, kd.last_error())
    end
    fails(C.kd_sample_logits(row, V, sampler({ temperature = 0 / 0 }), 0, out), "temperature")
    fails(C.kd_sample_logits(row, V, sampler({ temperature = 1, top_p = 0 / 0 }), 0, out), "top_p")
    fails(C.kd_sample_logits(row, V, sampler({ temperature = 1, min_p = 0 / 0 }), 0, out), "min_p")
    fails(C.kd_sample_logits(row, V, sampler({ temperature = 1, min_p = 1.5 }), 0, out), "min_p")
    local bad = row_of({ 1, 0 / 0, 2 })
    fails(C.kd_sample_logits(bad, 3, sampler({ temperature = 1 }), 0, out), "logits%[1%] is NaN")
    fails(C.kd_sample_logits(bad, 3, sampler({ temperature = 0 }), 0, out), "logits%[1%] is NaN")
    local inf = row_of({ 1, math.huge })
    fails(C.kd_sample_logits(inf, 2, sampler({ temperature = 1 }), 0, out), "logits%[1%] is %+inf")
    local ninf = row_of({ -math.huge, -math.huge })
    fails(C.kd_sample_logits(ninf, 2, sampler({ temperature = 1 }), 0, out), "%-inf")
    fails(C.kd_sample_logits(row, 0, sampler({ temperature = 1 }), 0, out), "vocab")
    fails(C.kd_sample_logits(nil, V, sampler({ temperature = 1 }), 0, out), "logits is NULL")
    fails(C.kd_sample_logits(row, V, sampler({ temperature = 1 }), 0, nil), "dst is NULL")
  end)
end)

describe("kd_seq_sample on the tiny model", function()
  it("samples each output row with key (seed, row position + 1), the same rule as kd_sample_logits", function()
    local m = kd.open_model("models/tiny-k2.6")
    local s = m:new_seq(64)
    s:forward({ 5, 77, 300, 12, 900, 41 })
    local sp = { temperature = 0.9, top_k = 50, top_p = 0.95, seed = 31337 }
    local got = s:sample(sp)
    assert.are.equal(6, #got)
    local V = m.info.vocab
    for r = 1, 6 do
      local x = s:logits(r)
      local a = ffi.new("float[?]", V)
      for i = 1, V do a[i - 1] = x[i] end
      assert.are.equal(draw(a, V, sampler(sp), r), got[r])   -- row r sits at position r-1, produces r
    end
    -- raw C with positions = NULL uses the forward's own positions + 1
    local dst = ffi.new("int32_t[6]")
    kd.check(C.kd_seq_sample(s:handle(), sampler(sp), nil, dst), "kd_seq_sample")
    for r = 1, 6 do assert.are.equal(got[r], dst[r - 1]) end
    -- greedy is the argmax
    assert.are.same(s:argmax(), s:sample({ temperature = 0 }))
    s:close(); m:close()
  end)
end)
