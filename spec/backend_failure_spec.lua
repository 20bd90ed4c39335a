-- backend_failure_spec.lua: what a sequence is after a backend op fails partway through an
-- engine call (kd_test_fail_op makes one op of the model's backend fail on demand):
--   * a compaction whose slot moves fail after some rows have moved (its second chunk of two,
--     each one move_rows over every layer) drops the rows from `start` on, says so, and the
--     sequence then computes what a fresh one computes;
--   * a commit whose compaction fails ends the round at the committed length (a second
--     commit is a state error) and the next round matches the autoregressive reference;
--   * a commit whose drafter append fails changes nothing: retried, it gives the draft a
--     clean commit gives, bit for bit;
--   * a forward or a verify that fails in a middle layer, and a draft that fails, leave the
--     sequence and its drafter as they were: the same call again computes what a clean run does.
-- Runs on the suite's backend (KDTREE_BACKEND, default cpu).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local err_of = require("helpers.err_of")
local gen = require("kdtree.generate")
local O = require("helpers.ops")

local MODEL, DRAFTER = "models/tiny-k2.6", "models/tiny-k2.6-dflash"
local backend = os.getenv("KDTREE_BACKEND") or "cpu"
local PROMPT = { 5, 77, 300, 12, 999, 77, 300 }

-- n floats bit-identical, and no NaN among them
local function same_bits(a, b, n, what)
  local ok, i = O.same_bits(a, b, n)
  assert.is_true(ok, not ok and string.format("%s: element %d differs: %.9g against %.9g", what, i, a[i], b[i]) or nil)
  assert.is_false(O.has_nan(a, n), what .. ": NaN")
end

describe("after a failed backend op", function()
  local m, d, ar
  setup(function()
    m = kd.open_model(MODEL, { backend = backend })
    d = kd.open_drafter(DRAFTER, m)
    -- the greedy tokens after PROMPT (the first from the prompt's last row)
    ar = gen.run(m, PROMPT, { policy = "ar", n = 12, eos = false }).tokens
  end)
  -- op fails once `after` more calls of it have succeeded; heal() ends the injection
  local function fail(op, after) O.check(O.C.kd_test_fail_op(m:handle(), op, after), "kd_test_fail_op") end
  local function heal() O.check(O.C.kd_test_fail_op(m:handle(), nil, -1), "kd_test_fail_op(off)") end
  after_each(heal)
  -- a sequence with the drafter attached after PROMPT, and its twin that sees no failure
  local function twins()
    local s, fresh = m:new_seq(64), m:new_seq(64)
    for _, x in ipairs({ s, fresh }) do
      x:attach_drafter(d)
      x:forward(PROMPT)
    end
    return s, fresh
  end
  -- the chain of the true tokens ar[2..8] under ar[1]
  local function true_chain() return kd.tree.chain(ar[1], { ar[2], ar[3], ar[4], ar[5], ar[6], ar[7], ar[8] }) end
  -- a clean round of t (default: a new true_chain()) on s after PROMPT: accepted whole, ar[9] next
  local function exact_round(s, t)
    local len, own = s:len(), t == nil
    t = t or true_chain()
    s:verify(t)
    local r = s:accept(t)
    s:commit(t)
    assert.are.same({ ar[1], ar[2], ar[3], ar[4], ar[5], ar[6], ar[7], ar[8] }, r.tokens)
    assert.are.equal(ar[9], r.bonus)
    assert.are.equal(len + 8, s:len())
    if own then t:close() end
  end
  teardown(function()
    d:close()
    m:close()
  end)

  it("a compaction that fails after moving some rows drops the rows from start on and the sequence goes on", function()
    -- two rows a chunk: the first chunk's move succeeds, the second's fails, so slots start and
    -- start + 1 have moved and the rest have not
    local s = m:new_seq(64, { max_rows = 2 })
    s:forward(PROMPT)
    s:forward({ 1, 2, 3, 4, 5, 6 })
    local start = #PROMPT
    fail("move_rows", 1)
    local e = err_of(s.compact, s, start, { 1, 3, 5 })
    assert.matches("injected by kd_test_fail_op", e)
    assert.matches("rows from " .. start .. " on are dropped", e)
    assert.are.equal(start, s:len())
    heal()
    -- the sequence now computes exactly what one that never saw the extra rows computes
    local fresh = m:new_seq(64, { max_rows = 2 })
    fresh:forward(PROMPT)
    s:forward({ 9, 8, 7 })
    fresh:forward({ 9, 8, 7 })
    local a, n = s:logits_cdata()
    local b, nb = fresh:logits_cdata()
    assert.are.equal(nb, n)
    same_bits(a, b, n, "logits after the failed compaction")
    for l = 0, m.info.n_layers - 1 do
      local ca, cb = s:read_cache(l, 0, s:len()), fresh:read_cache(l, 0, fresh:len())
      assert.are.same(cb, ca)
    end
    s:close(); fresh:close()
  end)

  it("a commit whose compaction fails ends the round at the committed length; the next round is exact", function()
    local s = m:new_seq(64)
    s:forward(PROMPT)
    local t = kd.tree.chain(ar[1], { ar[2], ar[3], 17 })   -- accepts ar[1..3]: the compaction moves rows
    s:verify(t)
    local r = s:accept(t)
    assert.are.equal(3, r.tau)
    fail("move_rows", 0)
    local e = err_of(s.commit, s, t)
    assert.matches("kd_commit: compacting 3 accepted rows", e)
    assert.matches("rows from " .. #PROMPT .. " on are dropped", e)
    assert.are.equal(#PROMPT, s:len())
    heal()
    assert.matches("no accepted round", err_of(s.commit, s, t))
    exact_round(s)   -- the same round again, clean: the greedy tokens of the reference
    t:close(); s:close()
  end)

  it("a commit whose drafter append fails changes nothing; retried, it drafts what a clean commit drafts", function()
    local function round(with_failure)
      local s = m:new_seq(64)
      s:attach_drafter(d)
      s:forward(PROMPT)
      s:draft(ar[1])   -- the round's draft, which a failed commit must keep
      local drafted = s:draft_argmax()
      local t = kd.tree.chain(ar[1], { ar[2], ar[3], 17 })
      s:verify(t)
      local r = s:accept(t)
      if with_failure then
        fail("upload", 0)
        local e = err_of(s.commit, s, t)
        assert.matches("injected by kd_test_fail_op", e)
        assert.matches("appending 3 accepted rows to the drafter context", e)
        assert.are.equal(#PROMPT, s:len())
        assert.are.same(drafted, s:draft_argmax())
        heal()
      end
      s:commit(t)
      assert.are.equal(#PROMPT + 3, s:len())
      local lp = s:draft(r.bonus)
      t:close(); s:close()
      return lp
    end
    local clean, retried = round(false), round(true)
    same_bits(retried.data, clean.data, clean.L * clean.V, "draft after the retried commit")
  end)

  it("a forward that fails in a middle layer leaves the sequence as it was; the same forward again is exact", function()
    local s, fresh = twins()
    -- mla_rope_store runs once a layer (it writes the layer's new cache rows): its second call is
    -- in layer 1, with layer 0's cache rows already written
    fail("mla_rope_store", 1)
    assert.matches("injected by kd_test_fail_op", err_of(s.forward, s, { 9, 8, 7 }))
    assert.are.equal(#PROMPT, s:len())
    heal()
    s:forward({ 9, 8, 7 })
    fresh:forward({ 9, 8, 7 })
    local a, n = s:logits_cdata()
    local b = fresh:logits_cdata()
    same_bits(a, b, n, "logits after the failed forward")
    local da, db = s:draft(ar[1]), fresh:draft(ar[1])
    same_bits(da.data, db.data, db.L * db.V, "draft after the failed forward")
    s:close(); fresh:close()
  end)

  it("a verify that fails in a middle layer leaves no round open; verified again, the round is exact", function()
    local s = m:new_seq(64)
    s:forward(PROMPT)
    local t = true_chain()
    fail("mla_rope_store", 1)
    assert.matches("injected by kd_test_fail_op", err_of(s.verify, s, t))
    heal()
    assert.are.equal(#PROMPT, s:len())
    assert.matches("accept before verify", err_of(s.accept, s, t))
    exact_round(s, t)
    t:close(); s:close()
  end)

  it("a draft that fails leaves the drafter usable: the next draft is a clean one's", function()
    local s, fresh = twins()
    fail("upload", 0)
    assert.matches("injected by kd_test_fail_op", err_of(s.draft, s, ar[1]))
    heal()
    local da, db = s:draft(ar[1]), fresh:draft(ar[1])
    same_bits(da.data, db.data, db.L * db.V, "draft after the failed draft")
    s:close(); fresh:close()
  end)

  -- the walk's result is checked before anything is committed (the mutation run's A5 removed
  -- that check and survived until this case)
  it("a backend walk whose path does not start at the root is refused; the round then goes on exactly", function()
    local s = m:new_seq(64)
    s:forward(PROMPT)
    local t = true_chain()
    s:verify(t)
    fail("tree_walk", 0)
    local e = err_of(s.accept, s, t)
    assert.truthy(e:find("kd_accept: the backend's walk returned node 1 at step 0 (tree of 7 nodes)", 1, true), e)
    heal()
    assert.are.equal(#PROMPT, s:len())
    local r = s:accept(t)
    s:commit(t)
    assert.are.same({ ar[1], ar[2], ar[3], ar[4], ar[5], ar[6], ar[7], ar[8] }, r.tokens)
    assert.are.equal(ar[9], r.bonus)
    t:close(); s:close()
  end)

  it("names the op it was given, and only the ops it can fail", function()
    assert.matches("expected upload, copy, mla_rope_store, move_rows or tree_walk",
      err_of(O.check, O.C.kd_test_fail_op(m:handle(), "linear", 0), "kd_test_fail_op"))
  end)

  it("the graph emulation will not start over an injection (it would take the injection's table)", function()
    if backend ~= "cpu" then return end   -- the emulation is the CPU backend's
    local G = require("helpers.graphs")
    local m2 = kd.open_model(MODEL, { backend = "cpu" })
    finally(function() m2:close() end)   -- a failed assertion must not leave it emulated for later specs
    O.check(O.C.kd_test_fail_op(m2:handle(), "copy", 3), "kd_test_fail_op")
    assert.are.equal(1, O.C.kd_test_fault_active(m2:handle()))
    assert.matches("a fault injection is on: emulate first, then inject", err_of(G.emulate, m2))
    assert.are.equal(1, O.C.kd_test_fault_active(m2:handle()))   -- the refusal left the injection as it was
    O.check(O.C.kd_test_fail_op(m2:handle(), nil, -1), "kd_test_fail_op(off)")
    assert.are.equal(0, O.C.kd_test_fault_active(m2:handle()))
    G.emulate(m2)   -- now it may
  end)
end)
