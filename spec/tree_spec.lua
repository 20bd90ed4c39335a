-- tree_spec.lua: the DDTree tree builder (core/tree.c) against the independent Python
-- reference of Algorithm 1 (scripts/golden/tree_ref.py -> spec/fixtures/tree-*.json),
-- plus invariants that need no reference: pop order, parent/depth structure, the
-- ancestor-only visibility mask, optimality of the tree (Prop. 2), bad input.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local err_of = require("helpers.err_of")
local json = require("dkjson")
local ffi = require("ffi")

local FIX = "spec/fixtures/"

local function read_all(path, mode)
  local f = assert(io.open(path, mode or "r"))
  local s = f:read("*a")
  f:close()
  return s
end

local cases = json.decode(read_all(FIX .. "tree-cases.json")).cases
local blob = read_all(FIX .. "tree-logits.f32", "rb")
local all_scores = ffi.new("float[?]", #blob / 4)
ffi.copy(all_scores, blob, #blob)

local function case_scores(c)
  return { data = all_scores + c.offset, L = c.L, V = c.V }
end

-- per depth the log-probs of a case, in double (for scores and invariants)
local function log_probs(c)
  local rows = {}
  for d = 0, c.L - 1 do
    local x = all_scores + c.offset + d * c.V
    local r = {}
    if c.logprobs then
      for i = 0, c.V - 1 do r[i] = x[i] end
    else
      local m = -math.huge
      for i = 0, c.V - 1 do if x[i] > m then m = x[i] end end
      local s = 0
      for i = 0, c.V - 1 do s = s + math.exp(x[i] - m) end
      local lse = m + math.log(s)
      for i = 0, c.V - 1 do r[i] = x[i] - lse end
    end
    rows[d + 1] = r
  end
  return rows
end

-- the ancestor-only mask from parents, in Lua: row i sees j iff j is i or an ancestor of i
local function check_visibility(t)
  local vis, rows, words = t:visibility()
  assert.are.equal(t.n + 1, rows)
  assert.are.equal(math.floor((t.n + 1 + 63) / 64), words)
  local bit = require("bit")
  for i = 0, t.n do
    local anc = { [i] = true }
    local p = i > 0 and t.parents[i] or nil
    while p do
      anc[p] = true
      p = p > 0 and t.parents[p] or nil
    end
    for j = 0, t.n do
      local w = vis[i * words + math.floor(j / 64)]
      local set = bit.band(bit.rshift(w, j % 64), 1ULL) ~= 0ULL
      if set ~= (anc[j] == true) then
        error(string.format("visibility[%d][%d] = %s, expected %s", i, j, tostring(set), tostring(anc[j] == true)))
      end
    end
  end
end

local function check_structure(t, L)
  local seen = {}
  for i = 1, t.n do
    local p = t.parents[i]
    assert.is_true(p >= 0 and p < i, "node " .. i .. ": parent " .. p .. " must precede it")
    local pd = p == 0 and 0 or t.depths[p]
    assert.are.equal(pd + 1, t.depths[i], "node " .. i .. ": depth = parent depth + 1")
    assert.is_true(t.depths[i] <= L)
    local key = p .. ":" .. t.tokens[i]
    assert.is_nil(seen[key], "siblings must have distinct tokens (node " .. i .. ")")
    seen[key] = true
  end
end

describe("kd.tree.build vs the Python reference (tree_ref.py)", function()
  assert.is_true(#cases >= 20)
  for _, c in ipairs(cases) do
    it(string.format("%s: L=%d V=%d budget=%d%s", c.name, c.L, c.V, c.budget, c.logprobs and " (log-probs)" or ""),
      function()
        local t = kd.tree.build(case_scores(c), c.budget, { logprobs = c.logprobs })
        assert.are.equal(c.n, t.n)
        for i = 1, c.n do
          if t.tokens[i] ~= c.tokens[i] or t.parents[i] ~= c.parents[i] or t.depths[i] ~= c.depths[i] then
            error(string.format("node %d: got token %d parent %d depth %d, reference token %d parent %d depth %d",
              i, t.tokens[i], t.parents[i], t.depths[i], c.tokens[i], c.parents[i], c.depths[i]))
          end
        end
        check_structure(t, c.L)
        t:close()
      end)
  end

  it("the fixtures plant exact ties that the rank tuple must break", function()
    local ties = 0
    for _, c in ipairs(cases) do ties = ties + c.score_ties end
    assert.is_true(ties > 300, "equal-score pops in the fixtures: " .. ties)
  end)
end)

describe("tree invariants (no reference needed)", function()
  for _, name in ipairs({ "v1000_l7_b256", "v33_l13_b512", "ties_quarter_logprobs", "neg_inf_logits",
                          "v32_l2_b512", "v4_l3_b512_exhausted", "v48_l15_b256_logprobs" }) do
    local c
    for _, x in ipairs(cases) do if x.name == name then c = x end end
    it(name .. ": pop order, structure, visibility, optimality (top-B prefixes)", function()
      assert.is_not_nil(c)
      local t = kd.tree.build(case_scores(c), c.budget, { logprobs = c.logprobs })
      check_structure(t, c.L)
      check_visibility(t)
      local lp = log_probs(c)
      local score = { [0] = 0 }
      local tol = 1e-4
      for i = 1, t.n do
        score[i] = score[t.parents[i]] + lp[t.depths[i]][t.tokens[i]]
        if i > 1 and score[i] ~= -math.huge then
          assert.is_true(score[i] <= score[i - 1] + tol,
            string.format("pop order: node %d score %.9g > node %d score %.9g", i, score[i], i - 1, score[i - 1]))
        end
      end
      -- Prop. 2: no prefix left out beats the worst prefix kept (children of kept nodes)
      local worst = math.huge
      for i = 1, t.n do if score[i] < worst then worst = score[i] end end
      if worst ~= -math.huge and t.n == c.budget then
        local kids = {}
        for i = 1, t.n do kids[t.parents[i] .. ":" .. t.tokens[i]] = true end
        for node = 0, t.n do
          local d = node == 0 and 0 or t.depths[node]
          if d < c.L then
            for tok = 0, c.V - 1 do
              if not kids[node .. ":" .. tok] then
                local s = score[node] + lp[d + 1][tok]
                assert.is_true(s <= worst + tol,
                  string.format("prefix node %d + token %d (score %.9g) beats a kept one (%.9g)", node, tok, s, worst))
              end
            end
          end
        end
      end
      t:close()
    end)
  end

  it("a tree of more than 64 nodes has a multi-word visibility mask", function()
    local c
    for _, x in ipairs(cases) do if x.name == "v50_l9_b256" then c = x end end
    local t = kd.tree.build(case_scores(c), c.budget)
    assert.are.equal(256, t.n)
    check_visibility(t)
    t:close()
  end)

  it("budget 0 gives the root alone; the root token survives a build", function()
    local t = kd.tree.new()
    assert.are.equal(-1, t.root)
    t:set_root(42)
    t:build({ { 1, 2, 3 }, { 3, 2, 1 } }, 0)
    assert.are.equal(0, t.n)
    assert.are.equal(42, t.root)
    t:build({ { 1, 2, 3 }, { 3, 2, 1 } }, 2)
    assert.are.equal(42, t.root)
    assert.are.same({ 2, 0 }, t.tokens)        -- depth 1 best (id 2), then its best child (id 0)
    assert.are.same({ 0, 1 }, t.parents)
    assert.are.same({ 1, 2 }, t.depths)
    check_visibility(t)
    t:close()
  end)

  it("equal values rank the lower id first", function()
    local t = kd.tree.build({ { 0, 5, 5, 1, 5 } }, 3)
    assert.are.same({ 1, 2, 4 }, t.tokens)
    t:build({ { 5, 0, 5, 1, 5, 5 } }, 2)          -- a tie across the top-K boundary
    assert.are.same({ 0, 2 }, t.tokens)
    t:build({ { 9, 0, 0 }, { 3, 3, 3 } }, 4)       -- ties at depth 2: ids 0, 1, 2 in order
    assert.are.same({ 0, 0, 1, 2 }, t.tokens)
    assert.are.same({ 0, 1, 1, 1 }, t.parents)
    t:close()
  end)

  it("a -inf log-prob is the lowest value there is: every finite path pops before it", function()
    local ninf = -math.huge
    local t = kd.tree.build({ { -1, -2, ninf, ninf } }, 4, { logprobs = true })
    assert.are.same({ 0, 1, 2, 3 }, t.tokens)              -- siblings by rank
    -- depth 1's second entry is -inf: both depth-2 children of node 1 (scores -1.5, -1.7) pop
    -- before it
    t:build({ { -1, ninf }, { -0.5, -0.7 } }, 4, { logprobs = true })
    assert.are.same({ 0, 0, 1, 1 }, t.tokens)
    assert.are.same({ 0, 1, 1, 0 }, t.parents)
    assert.are.same({ 1, 2, 2, 1 }, t.depths)
    t:close()
    -- the same lists selected by the CPU backend's op (the kd_tree_build_drafted path: the
    -- backend's top-K keeps -inf as it is, and Algorithm 1 reads it)
    local C = require("helpers.testlib").cdef("kdtree_testing_ddtree.h").C
    local hp = ffi.new("kd_test_dd*[1]")
    assert.are.equal(0, C.kd_test_dd_new(C.KD_BACKEND_CPU, 0, hp))
    local h = ffi.gc(hp[0], C.kd_test_dd_free)
    local lp = ffi.new("float[4]", { -1, ninf, -0.5, -0.7 })
    local tok, par, dep = ffi.new("int32_t[5]"), ffi.new("int32_t[5]"), ffi.new("int32_t[5]")
    local vis, status, n = ffi.new("uint64_t[5]"), ffi.new("int32_t[4]"), ffi.new("int[1]")
    assert.are.equal(0, C.kd_test_dd_tree(h, lp, 2, 2, 4, n, tok, par, dep, vis, status))
    assert.are.equal(4, n[0])
    assert.are.same({ 0, 0, 1, 1 }, { tok[1], tok[2], tok[3], tok[4] })
    assert.are.same({ 0, 1, 1, 0 }, { par[1], par[2], par[3], par[4] })
  end)

  it("a chain: root -> tokens[1] -> tokens[2] ...", function()
    local t = kd.tree.chain(7, { 10, 11, 12, 13 })
    assert.are.equal(4, t.n)
    assert.are.equal(7, t.root)
    assert.are.same({ 10, 11, 12, 13 }, t.tokens)
    assert.are.same({ 0, 1, 2, 3 }, t.parents)
    assert.are.same({ 1, 2, 3, 4 }, t.depths)
    check_visibility(t)
    t:set_root(8)
    assert.are.equal(8, t.root)
    local e = kd.tree.chain(9, {})
    assert.are.equal(0, e.n)
    t:close(); e:close()
  end)

  it("builds at the real shape (L = 7 and 15, V = 163840, budget 1024)", function()
    local L, V = 15, 163840
    local x = ffi.new("float[?]", L * V)
    local seed = 12345
    for i = 0, L * V - 1 do
      seed = (seed * 1103515245 + 12345) % 2147483648
      x[i] = (seed / 2147483648 - 0.5) * 20
    end
    for _, l in ipairs({ 7, 15 }) do
      local t = kd.tree.build({ data = x, L = l, V = V }, 1024)
      assert.are.equal(1024, t.n)
      check_structure(t, l)
      t:close()
    end
  end)
end)

describe("tree build: bad input", function()
  local C = kd.C
  it("negative budget", function()
    local e = err_of(kd.tree.build, { { 1, 2 } }, -1)
    assert.matches("budget", e)
    assert.matches("%-1", e)
  end)

  it("wrong shapes: L <= 0, V <= 0, L > 64, NULL scores", function()
    local x = ffi.new("float[?]", 65 * 4)
    assert.matches("L %(depths", err_of(kd.tree.build, { data = x, L = 0, V = 4 }, 8))
    assert.matches("L %(depths", err_of(kd.tree.build, { data = x, L = -3, V = 4 }, 8))
    assert.matches("L %(depths.*65", err_of(kd.tree.build, { data = x, L = 65, V = 4 }, 8))
    assert.matches("V %(vocabulary", err_of(kd.tree.build, { data = x, L = 2, V = 0 }, 8))
    assert.matches("logits row 2: expected 3 values", err_of(kd.tree.build, { { 1, 2, 3 }, { 1, 2 } }, 4))
    local t = kd.tree.new()
    local st = C.kd_tree_build(t:handle(), nil, 2, 4, 8, 0)
    assert.are.equal(C.KD_ERR_ARG, st)
    assert.matches("scores is NULL", kd.last_error())
    assert.are.equal(C.KD_ERR_ARG, C.kd_tree_build(nil, x, 2, 4, 8, 0))
    t:close()
  end)

  it("NaN, +inf, and a logits row with no finite value name the row and column", function()
    assert.matches("logits%[1%]%[2%] is NaN", err_of(kd.tree.build, { { 1, 2, 3 }, { 1, 2, 0 / 0 } }, 4))
    assert.matches("logprobs%[0%]%[0%] is %+inf",
      err_of(kd.tree.build, { { math.huge, -1 } }, 1, { logprobs = true }))
    assert.matches("logits row 1 has no finite value",
      err_of(kd.tree.build, { { 0, 1 }, { -math.huge, -math.huge } }, 4))
  end)

  it("a failed build leaves the tree as it was, and usable", function()
    local t = kd.tree.chain(3, { 4, 5 })
    assert.matches("logits%[0%]%[1%] is NaN", err_of(t.build, t, { { 1, 0 / 0 } }, 2))
    t:_sync()
    assert.are.same({ 4, 5 }, t.tokens)
    t:build({ { 1, 2 } }, 1)
    assert.are.same({ 1 }, t.tokens)
    assert.are.equal(3, t.root)
    t:close()
  end)

  it("bad chain and root tokens", function()
    assert.matches("tokens%[1%].*%-2", err_of(kd.tree.chain, 1, { 5, -2 }))
    local t = kd.tree.new()
    assert.matches("token.*%-1", err_of(t.set_root, t, -1))
    t:close()
  end)
end)
