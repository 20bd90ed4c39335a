-- argmax_ties_spec: equal logits end to end. A temp copy of the tiny K2.6 checkpoint whose
-- lm_head row 2k+1 is a copy of row 2k (for every k) gives logits with logits[2k] ==
-- logits[2k+1] bit for bit at every position, so every greedy token is a tie, and the rule
-- (docs/ddtree.md: equal values, the lower id wins) says it is even. Checked against a
-- reference outside the engine's argmax: the greedy AR tokens equal the lowest-id maximum that
-- Lua computes from the downloaded logits at each step, and the greedy DDTree and DFlash
-- policies (the drafter reads the same lm_head, so its draft has the ties too) produce the
-- same tokens. Runs on the suite's backend (CPU in `make test`, CUDA in `make test-gpu`).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local ck = require("helpers.checkpoint")

local LM_HEAD = "language_model.lm_head.weight"
local PROMPT = { 5, 77, 300, 12, 999 }
local N = 24

local function tied_checkpoint()
  local dir = ck.copy(ck.K26)
  ck.edit_st(ck.shard_of(dir, LM_HEAD), function(h, st)
    local t = h[LM_HEAD]
    local V, D = t.shape[1], t.shape[2]
    local base, row = t.data_offsets[1], D * 2
    local parts = { st.data:sub(1, base) }
    for k = 0, V / 2 - 1 do
      local even = st.data:sub(base + 2 * k * row + 1, base + (2 * k + 1) * row)
      parts[#parts + 1] = even .. even
    end
    parts[#parts + 1] = st.data:sub(base + V * row + 1)
    return table.concat(parts)
  end)
  return dir
end

-- the lowest id holding the row's maximum (the reference rule, in Lua)
local function lowest_max(row)
  local best, arg = -math.huge, nil
  for i = 1, #row do
    if row[i] > best then best, arg = row[i], i - 1 end
  end
  return arg
end

describe("equal logits: the lower id wins, end to end", function()
  local dir, m, d
  setup(function()
    dir = tied_checkpoint()
    m = kd.open_model(dir)
    d = kd.open_drafter("models/tiny-k2.6-dflash", m)
  end)
  teardown(function()
    d:close(); m:close()
    ck.cleanup()
  end)

  it("every logit has its twin, and greedy AR takes the lowest-id maximum of the logits at every step", function()
    local s = m:new_seq(64)
    s:forward(PROMPT)
    local ref = {}
    for step = 1, N do
      local row = s:logits(s:out_rows())
      for k = 0, #row / 2 - 1 do
        assert.are.equal(row[2 * k + 1], row[2 * k + 2], "logits " .. 2 * k .. " and " .. 2 * k + 1)
      end
      ref[step] = lowest_max(row)
      assert.are.equal(0, ref[step] % 2, "the winner of a tie is the even (lower) id")
      local am = s:argmax()
      assert.are.equal(ref[step], am[#am], "step " .. step)
      if step < N then s:forward({ ref[step] }) end
    end
    s:close()
    local out = gen.run(m, PROMPT, { policy = "ar", n = N }).tokens
    assert.are.same(ref, out)
  end)

  it("greedy DDTree and DFlash rounds produce the same tokens", function()
    local ar = gen.run(m, PROMPT, { policy = "ar", n = N }).tokens
    for _, budget in ipairs({ 4, 16, 64 }) do
      local dd = gen.run(m, PROMPT, { policy = "ddtree", drafter = d, budget = budget, n = N }).tokens
      assert.are.same(ar, dd, "ddtree budget " .. budget)
    end
    assert.are.same(ar, gen.run(m, PROMPT, { policy = "dflash", drafter = d, n = N }).tokens, "dflash")
  end)
end)
