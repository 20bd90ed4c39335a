-- gpu_round_spec.lua: the DDTree round on the device (cuda/ddtree.cu) against the host
-- definitions it must reproduce exactly:
--   * tree selection (top-K per depth + Algorithm 1 on the backend) == kd_tree_build on the
--     host, node for node, mask word for word; planted ties (equal log-probs, equal scores),
--     -inf, B = 1..512 and the 4096 limit, L = 1..15, V up to 163840; NaN / +inf statuses; the
--     K2.6 drafter's shape through CUDA's parallel path (the others through either path);
--   * sample_rows == kd_sample_logits (the host rule) on many rows x seeds x settings:
--     temperatures, top-k, top-p, ties at both boundaries, -inf, V up to 163840, bad rows;
--   * the accept walk == the walk in Lua on random trees, greedy and sampled (failing rows).
-- Whole rounds on a model, with the round on the backend and on the host: ddtree_round_spec.lua.
-- Tagged #gpu: `make test-gpu` runs it against CUDA. KDTREE_OPS_OTHER=cpu runs it against the
-- CPU backend (a check of the spec and the CPU twins on a machine without a GPU).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local O = require("helpers.ops")
local K = require("kdtree.ffi")
local ffi, C = K.ffi, K.C
local bit = require("bit")
local check = O.check

require("helpers.testlib").cdef("kdtree_testing_ddtree.h")

local OTHER = O.other_kind()
local KIND = OTHER == "cpu" and C.KD_BACKEND_CPU or C.KD_BACKEND_CUDA

local lcg = require("helpers.lcg")

-- L x V log-probs; kind: "smooth" (distinct values), "ties" (few distinct values: equal
-- log-probs and equal path scores), "ninf" (some -inf)
local function scores(L, V, seed, kind)
  local r = lcg(seed)
  local a = ffi.new("float[?]", L * V)
  for i = 0, L * V - 1 do
    local v
    if kind == "ties" then v = -math.floor(r() * 6) * 0.5 - 0.25
    else v = -r() * 12 - (r() < 0.01 and 3 or 0) end
    if kind == "ninf" and r() < 0.3 then v = -math.huge end
    a[i] = v
  end
  -- a few peaked entries per row (a realistic draft)
  for d = 0, L - 1 do
    for k = 0, 2 do a[d * V + math.floor(r() * V)] = -0.1 - k * (kind == "ties" and 0 or 0.3) end
  end
  return a
end

describe("DDTree round ops on the " .. OTHER .. " backend against the host definitions #gpu", function()
  local h
  setup(function()
    local out = ffi.new("kd_test_dd*[1]")
    check(C.kd_test_dd_new(KIND, 0, out), "kd_test_dd_new")
    h = ffi.gc(out[0], C.kd_test_dd_free)
  end)

  -- the backend's tree from log-probs == kd_tree_build's, node for node and mask word for word
  local function same_tree(L, V, B, seed, kind, a)
    a = a or scores(L, V, seed, kind)
    local host = kd.tree.build({ data = a, L = L, V = V }, B, { logprobs = true })
    local cap = B + 1
    local words_cap = math.floor((cap + 63) / 64)
    local tok, par, dep = ffi.new("int32_t[?]", cap), ffi.new("int32_t[?]", cap), ffi.new("int32_t[?]", cap)
    local vis = ffi.new("uint64_t[?]", cap * words_cap)
    local status, n = ffi.new("int32_t[4]"), ffi.new("int[1]")
    local st = C.kd_test_dd_tree(h, a, L, V, B, n, tok, par, dep, vis, status)
    if st == C.KD_ERR_UNSUPPORTED then return false end
    check(st, string.format("kd_test_dd_tree L=%d V=%d B=%d", L, V, B))
    local what = string.format("L=%d V=%d B=%d %s", L, V, B, kind)
    assert.are.equal(0, status[0], what .. ": bad-value status")
    assert.are.equal(host.n, n[0], what .. ": node count")
    assert.are.equal(host.n, status[2], what .. ": node count (status)")
    for i = 1, host.n do
      if host.tokens[i] ~= tok[i] or host.parents[i] ~= par[i] or host.depths[i] ~= dep[i] then
        error(string.format("%s: node %d: host (token %d, parent %d, depth %d), backend (%d, %d, %d)", what, i,
          host.tokens[i], host.parents[i], host.depths[i], tok[i], par[i], dep[i]))
      end
    end
    assert.are.equal(-1, par[0]); assert.are.equal(0, dep[0])
    local hv, rows, words = host:visibility()
    for i = 0, rows * words - 1 do
      if hv[i] ~= vis[i] then error(string.format("%s: mask word %d differs", what, i)) end
    end
    host:close()
    return true, status[3]
  end

  it("tree selection: the backend's tree equals kd_tree_build's (B = 1..512, L = 1..15, V up to 163840)", function()
    local Bs = { 1, 8, 64, 256, 512 }
    local Vs = { 7, 1024, 163840 }
    for L = 1, 15 do
      local B, V = Bs[(L - 1) % #Bs + 1], Vs[(L - 1) % #Vs + 1]
      assert.is_true(same_tree(L, V, B, 1000 + L, "smooth"))
    end
    -- the K2.6 drafter's shape, where CUDA selects by its parallel path (status word 3 = 1; the
    -- CPU twin pops one node at a time: 0)
    local ok, path = same_tree(7, 163840, 256, 7, "smooth")
    assert.is_true(ok)
    assert.are.equal(OTHER == "cuda" and 1 or 0, path, "tree_select's path at L = 7, V = 163840, B = 256")
    assert.is_true(same_tree(2, 3, 64, 3, "smooth"))            -- the heap empties: 3 + 9 < 64 nodes
    assert.is_true(same_tree(3, 4, 64, 4, "smooth"))            -- 4 + 16 + 64 >= 64: the budget binds
  end)

  it("tree selection with planted ties (equal log-probs and equal path scores) and -inf", function()
    for _, c in ipairs({ { 4, 16, 512 }, { 8, 2048, 256 }, { 15, 64, 64 }, { 5, 163840, 512 }, { 1, 50, 8 } }) do
      assert.is_true(same_tree(c[1], c[2], c[3], 77 + c[1], "ties"))
    end
    assert.is_true(same_tree(6, 300, 128, 5, "ninf"))
    -- every value equal: the whole order is decided by ids and rank tuples
    local L, V = 5, 12
    local a = ffi.new("float[?]", L * V)
    for i = 0, L * V - 1 do a[i] = -1.5 end
    assert.is_true(same_tree(L, V, 512, 0, "all equal", a))
  end)

  it("tree selection at the budget limit of the backend (4096 nodes), or its refusal", function()
    local ok = same_tree(3, 64, 4096, 11, "smooth")
    if OTHER == "cpu" then assert.is_true(ok) end
    if not ok then io.stderr:write("\n[gpu_round] tree_select refused B = 4096 (shared memory)\n") end
  end)

  it("tree selection reports the first NaN / +inf list value (index into the [L, K] lists)", function()
    local L, V, B = 2, 4, 8
    local a = ffi.new("float[?]", L * V)
    for i = 0, L * V - 1 do a[i] = -1 - i * 0.1 end
    a[1 * V + 2] = 0 / 0                   -- NaN ranks last in its row: list index 1*4 + 3
    local tok, par, dep = ffi.new("int32_t[9]"), ffi.new("int32_t[9]"), ffi.new("int32_t[9]")
    local vis, status, n = ffi.new("uint64_t[9]"), ffi.new("int32_t[4]"), ffi.new("int[1]")
    check(C.kd_test_dd_tree(h, a, L, V, B, n, tok, par, dep, vis, status), "kd_test_dd_tree (NaN)")
    assert.are.same({ 1, 7 }, { status[0], status[1] })
    a[1 * V + 2] = -5
    a[0 * V + 3] = math.huge               -- +inf ranks first: list index 0
    check(C.kd_test_dd_tree(h, a, L, V, B, n, tok, par, dep, vis, status), "kd_test_dd_tree (+inf)")
    assert.are.same({ 2, 0 }, { status[0], status[1] })
  end)

  -- ---- sampling ----
  local function host_draw(row, V, sp, pos)
    local out = ffi.new("int32_t[1]")
    local st = C.kd_sample_logits(row, V, sp, pos, out)
    return st, out[0], ffi.string(C.kd_last_error())
  end

  -- rows x V logits by f(r, i); every sampler of `samplers` on the backend == the host rule
  local function same_draws(rows, V, f, samplers, what)
    local x = ffi.new("float[?]", rows * V)
    for r = 0, rows - 1 do for i = 0, V - 1 do x[r * V + i] = f(r, i) end end
    local pos = ffi.new("int32_t[?]", rows)
    local out, code = ffi.new("int32_t[?]", rows), ffi.new("int32_t[?]", rows)
    local checked = 0
    for si, s in ipairs(samplers) do
      for r = 0, rows - 1 do pos[r] = (r * 7919 + si * 104729) % 100000 end
      local sp = kd.sampler(s)
      check(C.kd_test_dd_sample(h, x, rows, V, sp, pos, out, code), "kd_test_dd_sample")
      for r = 0, rows - 1 do
        local st, tok, msg = host_draw(x + r * V, V, sp, pos[r])
        local tag = string.format("%s row %d sampler %d (T %g, top_k %d, top_p %g, min_p %g, seed %s, position %d)", what,
          r, si, s.temperature, s.top_k or 0, s.top_p or 0, s.min_p or 0, tostring(s.seed), pos[r])
        if st == 0 then
          assert.are.equal(0, code[r], tag .. ": the backend reports an error")
          if tok ~= out[r] then error(string.format("%s: host token %d, backend %d", tag, tok, out[r])) end
        else
          assert.are_not.equal(0, code[r], tag .. ": the host fails (" .. msg .. "), the backend does not")
          local kind, col = bit.band(code[r], 3), bit.rshift(code[r], 2)
          if kind == 3 then assert.matches("every logit is -inf", msg, 1, true)
          else
            assert.matches(string.format("logits[%d] is %s", col, kind == 1 and "NaN" or "+inf"), msg, 1, true)
          end
        end
        checked = checked + 1
      end
    end
    return checked
  end

  local function settings(V)
    local s = {}
    for _, T in ipairs({ 1.0, 0.6, 2.5, 1e-3, 40.0 }) do
      for _, k in ipairs({ 0, 1, 5, 50, V - 1, V }) do
        for _, p in ipairs({ 0, 0.3, 0.9, 0.999, 1 }) do
          for _, mp in ipairs({ 0, 0.05 }) do
            s[#s + 1] = { temperature = T, top_k = k, top_p = p, min_p = mp, seed = #s * 2654435761 % 4294967296 }
          end
        end
      end
    end
    return s
  end

  it("sampling: the backend draws the host's tokens (small vocabularies, every setting)", function()
    local X = { 2.0, 1.0, 0.5, 0.5, -1.0, 3.0, 0.0, -0.5, 1.5, -2.0 }
    local n = same_draws(1, #X, function(_, i) return X[i + 1] end, settings(#X), "X")
    local r = lcg(5)
    local big = {}
    for i = 1, 6 * 1000 do big[i] = (r() - 0.5) * 8 end
    n = n + same_draws(6, 1000, function(row, i) return big[row * 1000 + i + 1] end, settings(1000), "V=1000")
    -- ties: quantized logits (equal masses at both the top-k and the top-p boundaries)
    n = n + same_draws(4, 333, function(row, i) return math.floor(((i * 37 + row * 11) % 17) / 4) end,
      settings(333), "ties")
    io.stderr:write(string.format("\n[gpu_round] %d draws equal the host rule\n", n))
  end)

  it("sampling at V = 163840: flat and peaked rows, -inf, seeds and positions", function()
    local V = 163840
    local r = lcg(9)
    local x = {}
    for i = 1, 6 * V do x[i] = r() * 4 end
    for i = 1, 4 * V, 997 do x[i] = -math.huge end
    x[V + 99999 + 1] = 30; x[V + 124] = 29             -- row 1: two dominant ids
    for i = 2 * V + 1, 3 * V do x[i] = 0 end            -- row 2: all equal
    -- rows 4 and 5: ties at every cut: 400 and 40 distinct values (the device's bins below the
    -- max hold a few of them with ~1600 ids, or one with ~4100: its sort and its radix fallback)
    for i = 4 * V + 1, 5 * V do x[i] = math.floor(x[i] * 100) / 100 end
    for i = 5 * V + 1, 6 * V do x[i] = math.floor(x[i] * 10) / 10 end
    local samplers = {}
    for _, T in ipairs({ 1.0, 0.7, 3.0 }) do
      for _, k in ipairs({ 0, 40, 4096, V - 1 }) do
        for _, p in ipairs({ 0, 0.5, 0.95 }) do
          for _, seed in ipairs({ 3, 1234567 }) do
            samplers[#samplers + 1] = { temperature = T, top_k = k, top_p = p, min_p = seed == 3 and 0 or 0.05, seed = seed }
          end
        end
      end
    end
    -- top-k and top-p cuts inside a group of equal logits (row 5: ~4096 ids per value)
    for _, k in ipairs({ 4095, 4096, 4097, 6000, 20000 }) do
      samplers[#samplers + 1] = { temperature = 1.0, top_k = k, top_p = 0.9, seed = k }
    end
    for _, p in ipairs({ 0.02, 0.021, 0.3 }) do samplers[#samplers + 1] = { temperature = 1.0, top_p = p, seed = 11 } end
    local n = same_draws(6, V, function(row, i) return x[row * V + i + 1] end, samplers, "V=163840")
    io.stderr:write(string.format("[gpu_round] %d draws at V = 163840 equal the host rule\n", n))
  end)

  it("sampling: bad rows give the host's errors (NaN, +inf, every logit -inf), the other rows still draw", function()
    local V = 50
    local function f(row, i)
      if row == 0 and (i == 17 or i == 30) then return 0 / 0 end
      if row == 1 and i == 3 then return math.huge end
      if row == 1 and i == 9 then return 0 / 0 end
      if row == 2 then return -math.huge end
      return (i % 7) * 0.3
    end
    same_draws(4, V, f, { { temperature = 1.0, seed = 1 }, { temperature = 0.5, top_k = 3, top_p = 0.5, seed = 2 } },
      "bad rows")
  end)

  -- ---- the accept walk ----
  it("the accept walk: the backend's path equals the walk in Lua (greedy and sampled, failing rows)", function()
    local r = lcg(21)
    for case = 1, 60 do
      local L, V, B = 1 + case % 7, 3 + case % 5, 1 + (case * 13) % 200
      local t = kd.tree.build({ data = scores(L, V, case, case % 3 == 0 and "ties" or "smooth"), L = L, V = V }, B,
        { logprobs = true, root = case })
      local n = t.n
      local tok, par, dep = ffi.new("int32_t[?]", n + 1), ffi.new("int32_t[?]", n + 1), ffi.new("int32_t[?]", n + 1)
      tok[0], par[0], dep[0] = case, -1, 0
      for i = 1, n do tok[i], par[i], dep[i] = t.tokens[i], t.parents[i], t.depths[i] end
      -- targets: mostly a child's token (long paths), sometimes anything
      local targets, codes = ffi.new("int32_t[?]", n + 1), ffi.new("int32_t[?]", n + 1)
      local kids = {}
      for i = 1, n do kids[par[i]] = kids[par[i]] or {}; table.insert(kids[par[i]], i) end
      for i = 0, n do
        local ks = kids[i]
        if ks and r() < 0.8 then targets[i] = tok[ks[1 + math.floor(r() * #ks)]] else targets[i] = math.floor(r() * V) end
        codes[i] = (r() < 0.05) and (1 + 4 * math.floor(r() * V)) or 0
      end
      local sampled = case % 2
      local hdr, nodes, toks = ffi.new("int32_t[8]"), ffi.new("int32_t[?]", n + 1), ffi.new("int32_t[?]", n + 1)
      check(C.kd_test_dd_walk(h, tok, par, dep, n, targets, codes, sampled, hdr, nodes, toks), "kd_test_dd_walk")
      -- the walk in Lua
      local cur, path, status, bonus, fail = 0, {}, 0, -1, -1
      while true do
        if sampled == 1 and codes[cur] ~= 0 then status, fail = codes[cur], cur; break end
        path[#path + 1] = cur
        local nxt, child = targets[cur], nil
        for j = cur + 1, n do if par[j] == cur and tok[j] == nxt then child = j; break end end
        if not child then bonus = nxt; break end
        cur = child
      end
      local what = string.format("case %d (n %d, sampled %d)", case, n, sampled)
      assert.are.equal(status, hdr[0], what .. ": status")
      assert.are.equal(#path, hdr[3], what .. ": tau")
      assert.are.equal(n, hdr[5], what .. ": n")
      if status ~= 0 then
        assert.are.equal(fail, hdr[1], what .. ": failing node")
        assert.are.equal(100 + dep[fail] + 1, hdr[2], what .. ": failing position")
      else
        assert.are.equal(bonus, hdr[4], what .. ": bonus")
      end
      for i = 1, #path do
        assert.are.equal(path[i], nodes[i - 1], what .. ": node " .. i)
        assert.are.equal(tok[path[i]], toks[i - 1], what .. ": token " .. i)
      end
      t:close()
    end
  end)
end)
