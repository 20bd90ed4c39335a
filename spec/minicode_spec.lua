-- minicode_spec: the shipped trained pair (models/mini-code + models/mini-code-dflash, issue 16).
-- Its tokenizer encodes and decodes every string of the run's tiktoken goldens exactly as tiktoken
-- did (spec/fixtures/mini-code/tokenizer_goldens.json, written by scripts/train/tokenize_corpus.py);
-- DDTree decodes the held-out prompts token for token as AR does, greedy and sampled; and the
-- drafter's mean tau at B = 32 on fixed held-out prompts stays at or above what it measured
-- (tau is a function of the weights and the prompts: a drafter, tree or acceptance change that
-- loses accepted tokens fails here). docs/mini-code.md has the full tau table.
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local ck = require("spec.helpers.checkpoint")

local MODEL, DRAFT = "models/mini-code", "models/mini-code-dflash"
local FIX = "spec/fixtures/mini-code/"
local N = 32                                   -- tokens per prompt, as scripts/bench/minicode.lua tau
local PROMPTS = 4                              -- the first 4 held-out prompts, as the tau table's
local BUDGET = 32
local SAMPLER = { temperature = 0.7, seed = 1 }
-- measured 2026-12-04 on these prompts with the drafter of scripts/train/runs/2026-12-04-drafter:
-- pooled mean tau 3.43 at B = 32, greedy (the drafter before it: 2.25); the floor sits a little
-- under it, above the issue's 2.5 minimum.
local TAU_MIN = 3.3

local function ids(t) return table.concat(t, " ") end

describe("the mini-code tokenizer", function()
  local golden = ck.read_json(FIX .. "tokenizer_goldens.json")
  local tok = kd.open_tokenizer(MODEL)

  it("has the goldens' base ranks and special ids", function()
    assert.are.equal(3838, golden.n_base)
    assert.are.equal(golden.n_base, tok.n_base)
    local n = 0
    for name, id in pairs(golden.special) do
      assert.are.equal(id, tok:special(name), name)
      n = n + 1
    end
    assert.are.equal(23, n)
  end)

  it("encodes and decodes all 87 golden strings as tiktoken did", function()
    assert.are.equal(87, #golden.cases)
    for i, c in ipairs(golden.cases) do
      assert.are.equal(ids(c.ids), ids(tok:encode(c.text)), "case " .. i)
      assert.are.equal(ids(c.ids_special), ids(tok:encode(c.text, { special = true })), "case " .. i .. " (special)")
      assert.are.equal(c.text, tok:decode(c.ids), "case " .. i .. " (decode)")
    end
  end)
end)

describe("the mini-code pair", function()
  local m, d, prompts
  setup(function()
    m = kd.open_model(MODEL)
    d = kd.open_drafter(DRAFT, m)
    prompts = ck.read_json(FIX .. "heldout_prompts.json").prompts
  end)
  teardown(function() d:close(); m:close() end)

  it("ddtree (B = 32) == ar greedy on 4 held-out prompts, with mean tau >= " .. TAU_MIN, function()
    local tau, rounds = 0, 0
    for i = 1, PROMPTS do
      local ar = gen.run(m, prompts[i], { policy = "ar", n = N, eos = false })
      local r = gen.run(m, prompts[i], { policy = "ddtree", drafter = d, budget = BUDGET, n = N, eos = false })
      assert.are.equal(ids(ar.tokens), ids(r.tokens), "prompt " .. i)
      for _, rd in ipairs(r.rounds) do tau = tau + rd.tau end
      rounds = rounds + #r.rounds
    end
    assert.is_true(tau / rounds >= TAU_MIN, ("mean tau %.3f < %.2f"):format(tau / rounds, TAU_MIN))
  end)

  it("ddtree (B = 32) == ar sampled (T 0.7, same seed) on 2 held-out prompts", function()
    for i = 1, 2 do
      local ar = gen.run(m, prompts[i], { policy = "ar", n = N, eos = false, sampler = SAMPLER })
      local r = gen.run(m, prompts[i], { policy = "ddtree", drafter = d, budget = BUDGET, n = N, eos = false,
                                         sampler = SAMPLER })
      assert.are.equal(ids(ar.tokens), ids(r.tokens), "prompt " .. i)
    end
  end)
end)
