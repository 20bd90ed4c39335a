-- policy_spec: the decoding policies are lossless. DDTree and DFlash (with the DFlash drafter
-- and with the Lua drafters) must emit exactly the tokens autoregressive decoding emits,
-- greedy and sampled with the same seed; the oracle drafter must reach tau = L + 1 every
-- round; out-of-order or malformed calls are Lua errors that leave the sequence usable.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local err_of = require("helpers.err_of")
local gen = require("kdtree.generate")
local Oracle = require("kdtree.drafters.oracle")
local Ngram = require("kdtree.drafters.ngram")

local MODEL = "models/tiny-k2.6"
local DRAFT = "models/tiny-k2.6-dflash"
local PROMPT = { 5, 77, 300, 12, 999, 77, 300 }
local N = 24
local BUDGETS = { 0, 1, 4, 32, 128 }
local SAMPLER = { temperature = 0.9, top_k = 64, top_p = 0.95, seed = 1234 }

local function ids(t) return table.concat(t, " ") end

describe("policies", function()
  local m, d
  local ar_greedy, ar_sampled
  setup(function()
    m = kd.open_model(MODEL)
    d = kd.open_drafter(DRAFT, m)
    -- eos = false: compare full-length runs
    ar_greedy = gen.run(m, PROMPT, { policy = "ar", n = N, eos = false })
    ar_sampled = gen.run(m, PROMPT, { policy = "ar", n = N, eos = false, sampler = SAMPLER })
  end)
  teardown(function() d:close(); m:close() end)

  it("ar produces n tokens, one round per token after the first", function()
    assert.are.equal(N, #ar_greedy.tokens)
    assert.are.equal(N - 1, #ar_greedy.rounds)
    for _, r in ipairs(ar_greedy.rounds) do assert.are.equal(1, r.tau) end
    -- ar greedy is the argmax chain: replay it by hand with forward + logits
    local s = m:new_seq(64)
    s:forward(PROMPT)
    for i = 1, N do
      local l = s:logits(s:out_rows())
      local best, arg = -math.huge, nil
      for j, v in ipairs(l) do if v > best then best, arg = v, j - 1 end end
      assert.are.equal(arg, ar_greedy.tokens[i])
      s:forward({ arg })
    end
    s:close()
  end)

  it("ar sampling is keyed by (seed, position): repeatable, and seed-dependent", function()
    local again = gen.run(m, PROMPT, { policy = "ar", n = N, eos = false, sampler = SAMPLER })
    assert.are.equal(ids(ar_sampled.tokens), ids(again.tokens))
    local differs = false
    for _, seed in ipairs({ 1, 2, 3 }) do
      local sp = { temperature = SAMPLER.temperature, top_k = SAMPLER.top_k, top_p = SAMPLER.top_p, seed = seed }
      local r = gen.run(m, PROMPT, { policy = "ar", n = N, eos = false, sampler = sp })
      if ids(r.tokens) ~= ids(ar_sampled.tokens) then differs = true end
    end
    assert.is_true(differs)
  end)

  for _, b in ipairs(BUDGETS) do
    it("ddtree greedy == ar greedy, budget " .. b, function()
      local r = gen.run(m, PROMPT, { policy = "ddtree", drafter = d, budget = b, n = N, eos = false })
      assert.are.equal(ids(ar_greedy.tokens), ids(r.tokens))
      for _, rd in ipairs(r.rounds) do
        assert.is_true(rd.tau >= 1 and rd.tau <= d.info.block_size)
        assert.is_true(rd.size <= b)
        if b == 0 then assert.are.equal(1, rd.tau) end
      end
    end)
  end

  it("dflash greedy == ar greedy", function()
    local r = gen.run(m, PROMPT, { policy = "dflash", drafter = d, n = N, eos = false })
    assert.are.equal(ids(ar_greedy.tokens), ids(r.tokens))
    for _, rd in ipairs(r.rounds) do assert.are.equal(d.info.block_size - 1, rd.size) end
  end)

  it("dflash with a budget verifies a chain of min(budget, bs - 1) nodes and stays == ar", function()
    for _, b in ipairs({ 0, 3 }) do
      local r = gen.run(m, PROMPT, { policy = "dflash", drafter = d, budget = b, n = N, eos = false,
                                     sampler = SAMPLER })
      assert.are.equal(ids(ar_sampled.tokens), ids(r.tokens))
      for _, rd in ipairs(r.rounds) do
        assert.are.equal(b, rd.size)
        assert.is_true(rd.tau <= b + 1)
      end
    end
    assert.has_error(function() gen.run(m, PROMPT, { policy = "dflash", drafter = d, budget = -1 }) end,
      "kdtree: dflash: budget: expected a non-negative integer, got -1")
  end)

  for _, b in ipairs({ 1, 4, 32 }) do
    it("ddtree sampled == ar sampled with the same seed, budget " .. b, function()
      local r = gen.run(m, PROMPT, { policy = "ddtree", drafter = d, budget = b, n = N, eos = false,
                                     sampler = SAMPLER })
      assert.are.equal(ids(ar_sampled.tokens), ids(r.tokens))
    end)
  end

  it("dflash sampled == ar sampled with the same seed", function()
    local r = gen.run(m, PROMPT, { policy = "dflash", drafter = d, n = N, eos = false, sampler = SAMPLER })
    assert.are.equal(ids(ar_sampled.tokens), ids(r.tokens))
  end)

  it("the ngram Lua drafter is lossless under ddtree and dflash", function()
    local ng = Ngram.new({ vocab = m.info.vocab, depth = 5 })
    for _, b in ipairs({ 0, 4, 32 }) do
      local r = gen.run(m, PROMPT, { policy = "ddtree", drafter = ng, budget = b, n = N, eos = false })
      assert.are.equal(ids(ar_greedy.tokens), ids(r.tokens))
    end
    local r = gen.run(m, PROMPT, { policy = "dflash", drafter = ng, n = N, eos = false, sampler = SAMPLER })
    assert.are.equal(ids(ar_sampled.tokens), ids(r.tokens))
  end)

  it("ngram rows are log-distributions that favour earlier continuations", function()
    local ng = Ngram.new({ vocab = 16, depth = 3 })
    -- context 1 2 3 4 1 2 and bonus 3: the suffix "1 2 3" matched earlier continues 4 1 2
    local rows = ng:draft({ 1, 2, 3, 4, 1, 2 }, 3)
    for dpt = 1, 3 do
      local z, best, arg = 0, -math.huge, nil
      for j = 0, 15 do
        local v = rows.data[(dpt - 1) * 16 + j]
        z = z + math.exp(v)
        if v > best then best, arg = v, j end
      end
      assert.is_true(math.abs(z - 1) < 1e-5)
      assert.are.equal(({ 4, 1, 2 })[dpt], arg)
    end
  end)

  it("the oracle drafter reaches tau = L + 1 every round", function()
    for _, L in ipairs({ 3, 7 }) do
      -- the future: the ar continuation, long enough for every round's full depth
      local ref = gen.run(m, PROMPT, { policy = "ar", n = N + L + 1, eos = false })
      local future = {}
      for _, t in ipairs(PROMPT) do future[#future + 1] = t end
      for _, t in ipairs(ref.tokens) do future[#future + 1] = t end
      local oracle = Oracle.new({ future = future, vocab = m.info.vocab, depth = L })
      for _, b in ipairs({ L, 32 }) do
        local r = gen.run(m, PROMPT, { policy = "ddtree", drafter = oracle, budget = b, n = N, eos = false })
        assert.are.equal(ids(ar_greedy.tokens), ids(r.tokens))
        assert.is_true(#r.rounds >= 1)
        for _, rd in ipairs(r.rounds) do assert.are.equal(L + 1, rd.tau) end
      end
    end
  end)

  it("stops at an eos id when asked", function()
    -- declare the 5th greedy token an eos: generation must end right after it
    local eos_tok = ar_greedy.tokens[5]
    local first = nil
    for i, t in ipairs(ar_greedy.tokens) do if t == eos_tok then first = i; break end end
    for _, p in ipairs({ "ar", "ddtree", "dflash" }) do
      local r = gen.run(m, PROMPT, { policy = p, drafter = d, budget = 8, n = N, eos = { eos_tok } })
      assert.are.equal(first, #r.tokens)
      assert.are.equal("eos", r.stop)
    end
  end)
end)

describe("policy primitives: bad input and call order", function()
  local m, d
  setup(function() m = kd.open_model(MODEL); d = kd.open_drafter(DRAFT, m) end)
  teardown(function() d:close(); m:close() end)

  local function fresh()
    local s = m:new_seq(64)
    s:attach_drafter(d)
    s:forward(PROMPT)
    local a = s:argmax()
    return s, a[#a]
  end

  it("a negative budget is an error (tree build, build_drafted, policy)", function()
    local s, bonus = fresh()
    s:draft(bonus, false)
    local ok, err = pcall(kd.tree.build_drafted, s, -1)
    assert.is_false(ok)
    assert.truthy(err:find("budget", 1, true))
    ok, err = pcall(kd.tree.build, { { 0, 1 } }, -3)
    assert.is_false(ok)
    assert.truthy(err:find("budget", 1, true))
    assert.matches("kdtree: ddtree: budget: expected a non-negative integer, got -1",
      err_of(gen.run, m, PROMPT, { policy = "ddtree", drafter = d, budget = -1 }), 1, true)
    s:close()
  end)

  it("logits with the wrong shape are errors", function()
    assert.has_error(function() kd.tree.build({ { 0, 1, 2 }, { 0, 1 } }, 4) end,
      "kdtree: tree.build: logits row 2: expected 3 values (the width of row 1), got 2")
    assert.has_error(function() kd.tree.build({ 1, 2, 3 }, 4) end,
      "kdtree: tree.build: logits: expected a list of rows (L x V), row 1 is a number")
    assert.has_error(function() kd.tree.build({ data = nil, L = 2 }, 4) end,
      "kdtree: tree.build: logits {data=, L=, V=}: data is missing (expected a float* cdata)")
    local ok, err = pcall(kd.tree.build, { data = require("ffi").new("float[4]"), L = 2, V = 0 }, 4)
    assert.is_false(ok)
    assert.truthy(err:find("kd_tree_build", 1, true))
  end)

  it("accept before verify is a state error", function()
    local s, bonus = fresh()
    local t = kd.tree.chain(bonus, { 1, 2 })
    local ok, err = pcall(s.accept, s, t)
    assert.is_false(ok)
    assert.truthy(err:find("(state)", 1, true))
    -- the sequence still runs a correct round afterwards
    s:verify(t)
    local acc = s:accept(t)
    s:commit(t)
    assert.are.equal(#PROMPT + acc.tau, s:len())
    s:close(); t:close()
  end)

  it("commit before accept, and commit twice, are state errors", function()
    local s, bonus = fresh()
    s:draft(bonus, false)
    local t = kd.tree.build_drafted(s, 8)
    assert.are.equal(bonus, t.root)
    s:verify(t)
    local ok, err = pcall(s.commit, s, t)
    assert.is_false(ok)
    assert.truthy(err:find("(state)", 1, true))
    local acc = s:accept(t)
    s:commit(t)
    local len = s:len()
    assert.are.equal(#PROMPT + acc.tau, len)
    ok, err = pcall(s.commit, s, t)
    assert.is_false(ok)
    assert.truthy(err:find("(state)", 1, true))
    assert.are.equal(len, s:len())
    s:close(); t:close()
  end)

  it("a generate call with a bad prompt or policy is a Lua error", function()
    assert.has_error(function() gen.run(m, {}, { n = 4 }) end,
      "kdtree: generate: prompt: expected a non-empty list of token ids")
    assert.has_error(function() gen.run(m, PROMPT, { policy = "nope" }) end,
      "kdtree: generate: policy: expected ar, dflash or ddtree, got nope")
    assert.matches("kdtree: ddtree: opts.drafter: expected a drafter", err_of(gen.run, m, PROMPT, { policy = "ddtree" }),
      1, true)
  end)
end)
