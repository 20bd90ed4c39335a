-- draft_graphs_spec.lua: the DFlash draft pass as a graph (core/drafter.c, core/graph_step.h;
-- docs/architecture.md "Step graphs"). With the sequence's graphs option (the drafter takes it
-- when attached) the draft pass runs on the device-length path (the context length, ids and
-- positions go up in one copy; the block's K/V rows are stored at *dlen; attention_at):
--   off    the host-length pass as before (the reference here)
--   eager  the device-length pass, never captured
--   on     the device-length pass, captured on its second run and replayed after
-- draft_graphs = "off" puts the draft pass alone back on the host-length path.
-- Every mode must give the same draft log-prob bits, round after round, at lengths that move
-- (rounds, truncation, a prefill crossing the 256-key attention chunk), the same verify
-- logits and tokens; mode on must really replay (exact counter deltas of kd_model_memory on a
-- run of draft passes with no target step in between). The #gpu part runs on CUDA; the rest
-- runs the same checks on the CPU under the host emulation of the graph ops
-- (core/testing_graphs.h), which proves the core's draft-graph path on any machine.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local G = require("helpers.graphs")
local with_seq_options, with_mode, recorder, keep_draft, same_run, prompt_of =
  G.with_seq_options, G.with_mode, G.recorder, G.keep_draft, G.same_run, G.prompt_of

local TARGET, DRAFT = "models/tiny-k2.6", "models/tiny-k2.6-dflash"
local MODES = { "eager", "on" }   -- each compared with "off"

-- greedy DDTree rounds with the native drafter until n tokens: each round's draft log-probs
-- (copied) and verify logits are recorded
local function rounds_run(m, d, prompt, budget, n)
  return G.rounds_run(m, d, prompt, budget, n, function(rec, s, bonus)
    keep_draft(rec, s, bonus)
    return kd.tree.build_drafted(s, budget)
  end)
end

-- k draft passes in a row on one context (no target step between them): the counters of
-- this run are exactly the draft graph's
local function drafts_run(m, d, prompt, k, on_pass)
  local rec = recorder()
  local s = m:new_seq(#prompt + 2 * d.info.block_size)
  s:attach_drafter(d)
  s:forward(prompt)
  for i = 1, k do
    if on_pass then on_pass(i) end
    keep_draft(rec, s, prompt[1 + (7 * i) % #prompt])
  end
  s:close()
  return rec
end

-- the draft pass at lengths that move: a prefill of 250, past the 256-key attention chunk by
-- decoding, truncated back to 100 and 37, grown again by a prefill; two sequences interleaved
local function moving_run(m, d, V)
  local rec = recorder()
  local prompt = prompt_of(300, V, 11)
  local a, b = m:new_seq(600), m:new_seq(600)
  a:attach_drafter(d); b:attach_drafter(d)
  a:forward({ unpack(prompt, 1, 250) })
  b:forward({ unpack(prompt, 1, 37) })
  local ta, tb = a:argmax()[250], b:argmax()[37]
  for _ = 1, 10 do                                   -- a crosses row 256
    keep_draft(rec, a, ta); keep_draft(rec, b, tb)
    rec.tokens[#rec.tokens + 1] = ta
    a:forward({ ta }); ta = a:argmax()[1]
    rec.tokens[#rec.tokens + 1] = tb
    b:forward({ tb }); tb = b:argmax()[1]
  end
  for _, len in ipairs({ 100, 37 }) do
    a:truncate(len)
    keep_draft(rec, a, prompt[len + 1])
  end
  a:forward({ unpack(prompt, 38, 290) })
  keep_draft(rec, a, a:argmax()[253])
  keep_draft(rec, b, tb)
  a:close(); b:close()
  return rec
end

-- the checks shared by the CUDA and the emulated CPU runs
local function draft_graph_checks(backend, opts)
  local m, d, V
  setup(function()
    m = kd.open_model(TARGET, { backend = backend })
    if opts.setup then opts.setup(m) end
    d = kd.open_drafter(DRAFT, m)
    V = m.info.vocab
  end)
  teardown(function()
    d:close()
    m:close()
  end)

  it("draft passes in a row: the same log-prob bits in every mode; mode 1 captures once and replays", function()
    local prompt = prompt_of(20, V, 3)
    local K = 12
    local ref = with_mode(m, "off", function() return drafts_run(m, d, prompt, K) end)
    for _, mode in ipairs(MODES) do
      local before, ops0 = m:memory(), opts.replayed_ops and opts.replayed_ops()
      local got = with_mode(m, mode, function() return drafts_run(m, d, prompt, K) end)
      same_run(ref, got, backend .. " drafts, mode " .. mode)
      local after, ops1 = m:memory(), opts.replayed_ops and opts.replayed_ops()
      local cap, lau = after.graph_captures - before.graph_captures, after.graph_launches - before.graph_launches
      print(string.format("  %s draft passes mode %-5s: %d passes; graphs captured %d, launched %d, fallbacks %d",
        backend, mode, K, cap, lau, after.graph_fallbacks - before.graph_fallbacks))
      assert.are.equal(0, after.graph_fallbacks - before.graph_fallbacks, "no capture fell back to eager")
      assert.are.equal(0, after.graphs, "closing the sequence frees its draft graph")
      if mode == "on" then
        -- pass 1 warms up, pass 2 captures and launches, passes 3..K launch
        assert.are.equal(1, cap, "the draft pass was captured once")
        assert.are.equal(K - 1, lau, "every pass after the first ran as a graph")
        -- a replayed draft pass is the whole pass: tens of ops per launch (embed, ~19 per layer, head)
        if ops0 then assert.is_true(ops1 - ops0 >= (K - 1) * 10 * d.info.n_layers, "replayed ops") end
      else
        assert.are.equal(0, cap + lau)
        if ops0 then assert.are.equal(ops0, ops1) end
      end
    end
    -- draft_graphs = "off": the draft pass alone goes back to the host-length path
    local before = m:memory()
    local got = with_seq_options(m, { graphs = "on", draft_graphs = "off" },
      function() return drafts_run(m, d, prompt, K) end)
    same_run(ref, got, backend .. " drafts, draft graphs off")
    local after = m:memory()
    assert.are.equal(0, after.graph_captures - before.graph_captures)
    assert.are.equal(0, after.graph_launches - before.graph_launches)
  end)

  for _, B in ipairs({ 4, 16, 40 }) do
    it(string.format("DDTree rounds at budget %d: the same draft log-probs, logits and tokens in every mode", B),
      function()
        local prompt = prompt_of(9, V, 4)
        local ref = with_mode(m, "off", function() return rounds_run(m, d, prompt, B, 40) end)
        assert.is_true(#ref.bufs >= 8, "several rounds")
        for _, mode in ipairs(MODES) do
          local before = m:memory()
          local got = with_mode(m, mode, function() return rounds_run(m, d, prompt, B, 40) end)
          same_run(ref, got, string.format("%s ddtree budget %d, mode %s", backend, B, mode))
          local after = m:memory()
          assert.are.equal(0, after.graph_fallbacks - before.graph_fallbacks, "no capture fell back to eager")
          if mode == "on" then
            -- rounds: the draft graph launches from the second round on, verify graphs too
            assert.is_true(after.graph_launches - before.graph_launches >= #ref.bufs / 2 - 1)
          end
        end
      end)
  end

  it("the draft graph replays at other lengths (chunk boundary, truncation, two sequences)", function()
    local ref = with_mode(m, "off", function() return moving_run(m, d, V) end)
    for _, mode in ipairs(MODES) do
      local before = m:memory()
      local got = with_mode(m, mode, function() return moving_run(m, d, V) end)
      same_run(ref, got, backend .. " moving lengths, mode " .. mode)
      local after = m:memory()
      assert.are.equal(0, after.graph_fallbacks - before.graph_fallbacks)
      -- per sequence: 1 warm-up, then captured / launched; 25 passes over two sequences
      if mode == "on" then assert.is_true(after.graph_launches - before.graph_launches >= 23) end
    end
  end)

  it("greedy ddtree (native drafter) equals greedy ar with graphs on", function()
    for _, prompt in ipairs({ { 5, 77, 300 }, prompt_of(17, V, 9) }) do
      local ar = with_mode(m, "on", function() return gen.run(m, prompt, { policy = "ar", n = 48, eos = false }) end)
      for _, B in ipairs({ 4, 32 }) do
        local before = m:memory()
        local dt = with_mode(m, "on", function()
          return gen.run(m, prompt, { policy = "ddtree", drafter = d, budget = B, n = 48, eos = false })
        end)
        assert.are.same(ar.tokens, dt.tokens, "budget " .. B)
        assert.are.equal(48, #dt.tokens)
        local after = m:memory()
        assert.are.equal(0, after.graph_fallbacks - before.graph_fallbacks)
        assert.is_true(after.graph_launches - before.graph_launches >= 2)
      end
    end
  end)
end

describe("the draft pass as a CUDA graph #gpu", function()
  draft_graph_checks("cuda", {})

  it("times the draft pass in each mode (informative)", function()
    local m = kd.open_model(TARGET, { backend = "cuda" })
    local d = kd.open_drafter(DRAFT, m)
    local prompt = prompt_of(200, m.info.vocab, 5)
    local N = 200
    for _, mode in ipairs({ "off", "on" }) do
      with_mode(m, mode, function()
        local s = m:new_seq(#prompt + 16)
        s:attach_drafter(d)
        s:forward(prompt)
        for i = 1, 3 do s:draft(prompt[i]) end      -- warm-up, capture
        local t0 = kd.now_ns()
        for i = 1, N do s:draft(prompt[1 + i % #prompt], false) end
        s:draft(prompt[1])                          -- the download waits for the queue
        local us = (kd.now_ns() - t0) / 1e3 / (N + 1)
        print(string.format("  cuda draft pass, block %d, context %d, graphs %s: %.1f us per pass",
          d.info.block_size, #prompt, mode, us))
        s:close()
      end)
    end
    d:close()
    m:close()
  end)
end)

describe("the draft pass as a graph, emulated on the CPU (the core's draft-graph path)", function()
  draft_graph_checks("cpu", {
    setup = G.emulate,
    replayed_ops = function() return tonumber(G.C.kd_testing_graphs_replayed_ops()) end,
  })
end)

describe("draft graph recapture and fallback (emulated on the CPU)", function()
  local m, d, V
  setup(function()
    m = kd.open_model(TARGET, { backend = "cpu" })
    G.emulate(m)
    d = kd.open_drafter(DRAFT, m)
    V = m.info.vocab
  end)
  teardown(function()
    d:close()
    m:close()
  end)

  it("a stale workspace epoch recaptures; failed captures run eagerly with the same bits", function()
    local prompt = prompt_of(15, V, 31)
    local ref = with_mode(m, "off", function() return drafts_run(m, d, prompt, 8) end)
    local c0 = m:memory()
    local got = with_mode(m, "on", function()
      return drafts_run(m, d, prompt, 8, function(i) if i == 5 then G.C.kd_testing_graphs_bump_epoch(m:handle()) end end)
    end)
    same_run(ref, got, "epoch bump")
    local c1 = m:memory()
    -- pass 1 warms up, 2 captures, 3-4 launch, 5 finds the epoch stale and recaptures, 6-8 launch
    assert.are.equal(2, c1.graph_captures - c0.graph_captures)
    assert.are.equal(7, c1.graph_launches - c0.graph_launches)
    assert.are.equal(0, c1.graph_fallbacks - c0.graph_fallbacks)
    -- two refused captures: the draft pass falls back to eager and stays there
    G.C.kd_testing_graphs_refuse(2)
    got = with_mode(m, "on", function() return drafts_run(m, d, prompt, 8) end)
    same_run(ref, got, "refused captures")
    local c2 = m:memory()
    assert.are.equal(2, c2.graph_fallbacks - c1.graph_fallbacks)
    assert.are.equal(0, c2.graph_captures - c1.graph_captures)
    assert.are.equal(0, c2.graph_launches - c1.graph_launches)
    -- one refused capture: pass 2 falls back, pass 3 captures and launches, 4-8 launch
    G.C.kd_testing_graphs_refuse(1)
    got = with_mode(m, "on", function() return drafts_run(m, d, prompt, 8) end)
    same_run(ref, got, "one refused capture")
    local c3 = m:memory()
    assert.are.equal(1, c3.graph_fallbacks - c2.graph_fallbacks)
    assert.are.equal(1, c3.graph_captures - c2.graph_captures)
    assert.are.equal(6, c3.graph_launches - c2.graph_launches)
  end)
end)

describe("draft graphs on the plain CPU backend", function()
  it("the graphs option is inert for the draft pass: the same bits, no graphs", function()
    local m = kd.open_model(TARGET, { backend = "cpu" })
    local d = kd.open_drafter(DRAFT, m)
    local prompt = prompt_of(12, m.info.vocab, 8)
    local ref = with_mode(m, "off", function() return drafts_run(m, d, prompt, 4) end)
    for _, mode in ipairs(MODES) do
      same_run(ref, with_mode(m, mode, function() return drafts_run(m, d, prompt, 4) end), "cpu mode " .. mode)
    end
    local r = m:memory()
    assert.are.equal(0, r.graphs + r.graph_captures + r.graph_launches + r.graph_fallbacks)
    d:close()
    m:close()
  end)
end)
