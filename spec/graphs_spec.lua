-- graphs_spec.lua: step graphs (docs/architecture.md "Step graphs"). On the CUDA backend a
-- decode step (T = 1) and a verify step (T = 1 + B) can run on the device-length path and be
-- captured as CUDA graphs (the graphs option of the model or the sequence, taken when a sequence
-- is created):
--   off    every step as before (the reference here)
--   eager  the device-length path, never captured (isolates the kernels from the capture)
--   on     the device-length path, captured on a shape's second use and replayed after
-- Every mode must give the same tokens and the same logits bits: autoregressive decoding,
-- DDTree rounds at several budgets (a native DFlash drafter and host-built trees), lengths
-- that move backwards (truncate) and across attention chunk boundaries, two sequences
-- interleaved on one model. Mode on must really replay graphs (counters of kd_model_memory).
-- The CPU part checks that the switch is inert on the CPU backend.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local G = require("helpers.graphs")
local with_mode, recorder, keep_logits, same_run, prompt_of =
  G.with_mode, G.recorder, G.keep_logits, G.same_run, G.prompt_of

local TARGETS = {
  { dir = "models/tiny-k2.6", draft = "models/tiny-k2.6-dflash" },   -- INT4 experts (W4A16)
  { dir = "spec/fixtures/tiny-dsv3" },                                -- bf16 experts, q_proj
}
local BUDGETS = { 4, 16, 40 }
local MODES = { "eager", "on" }   -- each compared with "off"

-- k pseudo-random rows of V scores (from the current math.random state)
local function random_rows(k, V)
  local rows = {}
  for i = 1, k do
    local r = {}
    for j = 1, V do r[j] = (math.random() - 0.5) * 6 end
    rows[i] = r
  end
  return rows
end

-- greedy autoregressive decoding of n tokens, one forward per token
local function ar_run(m, prompt, n)
  local rec = recorder()
  local s = m:new_seq(#prompt + n + 4)
  s:forward(prompt)
  local tok = s:argmax()[#prompt]
  for _ = 1, n do
    rec.tokens[#rec.tokens + 1] = tok
    s:forward({ tok })
    keep_logits(rec, s)
    tok = s:argmax()[1]
  end
  s:close()
  return rec
end

-- greedy DDTree rounds until n tokens: drafted by the native drafter d, or (d nil) trees
-- built on the host from pseudo-random rows (seeded per round: the same in every mode)
local function ddtree_run(m, d, prompt, budget, n)
  return G.rounds_run(m, d, prompt, budget, n, function(_, s, bonus, round)
    if d then
      s:draft(bonus, false)
      return kd.tree.build_drafted(s, budget)
    end
    math.randomseed(1000 * budget + round)
    return kd.tree.build(random_rows(4, m.info.vocab), budget, { root = bonus })
  end)
end

-- lengths that move: a prefill of 250 (decode then crosses the 256-key attention chunk), a
-- prefill to 505 and decode and verify past 512 rows (a step's cache bound, model.c: step_bound,
-- moves from 512 rows to the capacity, and its graphs are captured again), truncation back to
-- 100, verify of one tree shape at several lengths, two sequences interleaved
local function moving_run(m, V)
  local rec = recorder()
  local prompt = prompt_of(505, V, 11)
  local a, b = m:new_seq(600), m:new_seq(600)
  a:forward({ unpack(prompt, 1, 250) })
  b:forward({ unpack(prompt, 1, 37) })
  local ta, tb = a:argmax()[250], b:argmax()[37]
  for _ = 1, 20 do                                  -- interleaved decode; a crosses row 256
    rec.tokens[#rec.tokens + 1] = ta
    a:forward({ ta }); keep_logits(rec, a); ta = a:argmax()[1]
    rec.tokens[#rec.tokens + 1] = tb
    b:forward({ tb }); keep_logits(rec, b); tb = b:argmax()[1]
  end
  math.randomseed(5)
  local rows = random_rows(3, V)
  local function verify_here()                     -- one tree shape (T = 9) at the current length
    local t = kd.tree.build(rows, 8, { root = prompt[1 + a:len() % 200] })
    a:verify(t)
    keep_logits(rec, a)
    a:truncate(a:len())                              -- drop the pending tree rows
    t:close()
  end
  a:forward({ unpack(prompt, 271, 505) })            -- to row 505, then decode past row 512
  ta = a:argmax()[235]
  for _ = 1, 10 do
    rec.tokens[#rec.tokens + 1] = ta
    a:forward({ ta }); keep_logits(rec, a); ta = a:argmax()[1]
  end
  verify_here()                                      -- at row 515: bounded by the capacity
  a:truncate(100)                                    -- the captured T = 1 step at a shorter length
  ta = prompt[101]
  for _ = 1, 8 do
    rec.tokens[#rec.tokens + 1] = ta
    a:forward({ ta }); keep_logits(rec, a); ta = a:argmax()[1]
  end
  for _, len in ipairs({ 108, 90, 60, 30 }) do
    a:truncate(len)
    verify_here()
  end
  a:forward({ unpack(prompt, 31, 80) })              -- grow again (a causal prefill, not a step)
  keep_logits(rec, a)
  verify_here()
  a:close(); b:close()
  return rec
end

describe("step graphs on the GPU #gpu", function()
  for _, T in ipairs(TARGETS) do
    describe(T.dir, function()
      local m, d, V
      setup(function()
        m = kd.open_model(T.dir, { backend = "cuda", graphs_verbose = true })   -- a failed capture says why
        V = m.info.vocab
        if T.draft then d = kd.open_drafter(T.draft, m) end
      end)
      teardown(function()
        if d then d:close() end
        m:close()
      end)

      it("autoregressive decoding of 40 tokens: the same tokens and logits bits in every mode", function()
        local prompt = prompt_of(12, V, 3)
        local ref = with_mode(m, "off", function() return ar_run(m, prompt, 40) end)
        local c0 = m:memory()
        assert.are.equal(0, c0.graph_launches, "mode 0 never launches a graph")
        for _, mode in ipairs(MODES) do
          local before = m:memory()
          local t0 = kd.now_ns()
          local got = with_mode(m, mode, function() return ar_run(m, prompt, 40) end)
          local ms = (kd.now_ns() - t0) / 1e6
          same_run(ref, got, T.dir .. " ar, mode " .. mode)
          local after = m:memory()
          print(string.format("  %s ar mode %-5s: %d steps in %.1f ms; graphs captured %d, launched %d, fallbacks %d",
            T.dir, mode, 40, ms, after.graph_captures - before.graph_captures,
            after.graph_launches - before.graph_launches, after.graph_fallbacks - before.graph_fallbacks))
          assert.are.equal(0, after.graph_fallbacks - before.graph_fallbacks, "no capture fell back to eager")
          if mode == "on" then
            assert.is_true(after.graph_captures - before.graph_captures >= 1, "the decode step was captured")
            assert.is_true(after.graph_launches - before.graph_launches >= 38, "later steps replay the graph")
          else
            assert.are.equal(0, after.graph_launches - before.graph_launches)
          end
          assert.are.equal(0, after.graphs, "closing a sequence frees its graphs")
        end
      end)

      for _, B in ipairs(BUDGETS) do
        it(string.format("DDTree rounds at budget %d: the same tokens and logits bits in every mode", B), function()
          local prompt = prompt_of(9, V, 4)
          local ref = with_mode(m, "off", function() return ddtree_run(m, d, prompt, B, 40) end)
          for _, mode in ipairs(MODES) do
            local before = m:memory()
            local got = with_mode(m, mode, function() return ddtree_run(m, d, prompt, B, 40) end)
            same_run(ref, got, string.format("%s ddtree budget %d (%s trees), mode %s", T.dir, B,
              d and "drafted" or "host", mode))
            local after = m:memory()
            assert.are.equal(0, after.graph_fallbacks - before.graph_fallbacks, "no capture fell back to eager")
            if mode == "on" and #ref.bufs > 2 then
              assert.is_true(after.graph_launches - before.graph_launches >= 1, "verify steps replay a graph")
            end
          end
        end)
      end

      -- the shared expert beside the routed experts (a second stream; a fork and a join in a graph:
      -- the default at these steps of up to 32 rows) against in line (shared_expert_branch =
      -- false), in the reference mode and captured
      it("the shared expert in line or beside the routed experts: the same tokens and logits bits", function()
        local m2 = kd.open_model(T.dir, { backend = "cuda", graphs_verbose = true, shared_expert_branch = false })
        local d2 = T.draft and kd.open_drafter(T.draft, m2)
        assert.is_true(m.info.n_shared_experts > 0, T.dir .. " has a shared expert")
        local prompt = prompt_of(12, V, 6)
        for _, mode in ipairs({ "off", "on" }) do
          local beside = with_mode(m, mode, function() return ar_run(m, prompt, 24) end)
          local in_line = with_mode(m2, mode, function() return ar_run(m2, prompt, 24) end)
          same_run(in_line, beside, T.dir .. " ar, shared expert beside vs in line, mode " .. mode)
          beside = with_mode(m, mode, function() return ddtree_run(m, d, prompt, 16, 24) end)
          in_line = with_mode(m2, mode, function() return ddtree_run(m2, d2, prompt, 16, 24) end)
          same_run(in_line, beside, T.dir .. " ddtree, shared expert beside vs in line, mode " .. mode)
        end
        if d2 then d2:close() end
        m2:close()
      end)

      it("a graph replays at other lengths: chunk boundaries, truncation, interleaved sequences", function()
        local ref = with_mode(m, "off", function() return moving_run(m, V) end)
        for _, mode in ipairs(MODES) do
          local before = m:memory()
          local got = with_mode(m, mode, function() return moving_run(m, V) end)
          same_run(ref, got, T.dir .. " moving lengths, mode " .. mode)
          local after = m:memory()
          assert.are.equal(0, after.graph_fallbacks - before.graph_fallbacks)
          if mode == "on" then assert.is_true(after.graph_launches - before.graph_launches >= 30) end
        end
      end)
    end)
  end
end)

-- the host emulation of the graph ops (core/testing_graphs.h): a CPU model gets the ops a CUDA
-- backend has; a capture records op calls with their arguments and a launch replays them, so
-- a host value baked into a step (a length, a row offset) replays wrong. This proves the
-- core's graph path (model.c: staging, device length, warm-up, capture, replay, epochs,
-- fallback) on any machine; the #gpu part above proves the CUDA kernels and capture.
describe("step graphs emulated on the CPU (the core's graph path)", function()
  for _, TG in ipairs(TARGETS) do
    describe(TG.dir, function()
      local m, d, V
      setup(function()
        m = kd.open_model(TG.dir, { backend = "cpu" })
        G.emulate(m)
        V = m.info.vocab
        if TG.draft then d = kd.open_drafter(TG.draft, m) end
      end)
      teardown(function()
        if d then d:close() end
        m:close()
      end)

      it("decoding and DDTree rounds replay recorded steps with the same bits as mode 0", function()
        local prompt = prompt_of(10, V, 21)
        local ref = with_mode(m, "off", function() return ar_run(m, prompt, 24) end)
        local refs = {}
        for _, B in ipairs({ 4, 16 }) do
          refs[B] = with_mode(m, "off", function() return ddtree_run(m, d, prompt, B, 24) end)
        end
        assert.are.equal(0, m:memory().graph_launches)
        for _, mode in ipairs(MODES) do
          local before, ops0 = m:memory(), tonumber(G.C.kd_testing_graphs_replayed_ops())
          same_run(ref, with_mode(m, mode, function() return ar_run(m, prompt, 24) end), TG.dir .. " ar " .. mode)
          for _, B in ipairs({ 4, 16 }) do
            same_run(refs[B], with_mode(m, mode, function() return ddtree_run(m, d, prompt, B, 24) end),
              string.format("%s ddtree %d %s", TG.dir, B, mode))
          end
          local after, ops1 = m:memory(), tonumber(G.C.kd_testing_graphs_replayed_ops())
          assert.are.equal(0, after.graph_fallbacks - before.graph_fallbacks)
          if mode == "on" then
            -- ar: 1 warm-up, 1 capture, 22 replays; each budget: warm-up, capture, replays
            assert.is_true(after.graph_captures - before.graph_captures >= 3)
            assert.is_true(after.graph_launches - before.graph_launches >= 22 + 2)
            -- a replayed step is the whole forward: tens of ops per launch
            assert.is_true(ops1 - ops0 >= 20 * (after.graph_launches - before.graph_launches))
          else
            assert.are.equal(0, after.graph_launches - before.graph_launches)
            assert.are.equal(ops0, ops1)
          end
        end
      end)

      it("a recorded step replays at other lengths (chunk boundaries, truncation, two sequences)", function()
        local ref = with_mode(m, "off", function() return moving_run(m, V) end)
        for _, mode in ipairs(MODES) do
          local before = m:memory()
          same_run(ref, with_mode(m, mode, function() return moving_run(m, V) end), TG.dir .. " moving " .. mode)
          if mode == "on" then assert.is_true(m:memory().graph_launches - before.graph_launches >= 30) end
        end
      end)

      it("a stale workspace epoch recaptures; a failed capture runs eagerly with the same bits", function()
        local prompt = prompt_of(7, V, 31)
        local ref = with_mode(m, "off", function() return ar_run(m, prompt, 12) end)
        local before = m:memory()
        local got = with_mode(m, "on", function()
          local rec = recorder()
          local s = m:new_seq(#prompt + 16)
          s:forward(prompt)
          local tok = s:argmax()[#prompt]
          for i = 1, 12 do
            if i == 6 then G.C.kd_testing_graphs_bump_epoch(m:handle()) end
            rec.tokens[#rec.tokens + 1] = tok
            s:forward({ tok }); keep_logits(rec, s); tok = s:argmax()[1]
          end
          assert.are.equal(1, m:memory().graphs, "one graph held by the open sequence")
          s:close()
          return rec
        end)
        same_run(ref, got, "epoch bump")
        local mid = m:memory()
        assert.are.equal(2, mid.graph_captures - before.graph_captures, "captured at step 2 and again at step 6")
        assert.are.equal(11, mid.graph_launches - before.graph_launches)
        assert.are.equal(0, mid.graphs)
        -- two refused captures: the shape falls back to eager and stays there
        G.C.kd_testing_graphs_refuse(2)
        got = with_mode(m, "on", function() return ar_run(m, prompt, 12) end)
        same_run(ref, got, "refused captures")
        local after = m:memory()
        assert.are.equal(2, after.graph_fallbacks - mid.graph_fallbacks)
        assert.are.equal(0, after.graph_captures - mid.graph_captures)
        assert.are.equal(0, after.graph_launches - mid.graph_launches)
        -- one refused capture: step 1 warms up, step 2 falls back, step 3 captures and launches,
        -- steps 4..12 launch
        G.C.kd_testing_graphs_refuse(1)
        got = with_mode(m, "on", function() return ar_run(m, prompt, 12) end)
        same_run(ref, got, "one refused capture")
        local last = m:memory()
        assert.are.equal(1, last.graph_fallbacks - after.graph_fallbacks)
        assert.are.equal(1, last.graph_captures - after.graph_captures)
        assert.are.equal(10, last.graph_launches - after.graph_launches)
      end)
    end)
  end
end)

describe("step graphs on the plain CPU backend", function()
  it("the graphs option is inert: the same logits bits, no graphs", function()
    local m = kd.open_model("spec/fixtures/tiny-dsv3", { backend = "cpu" })
    local prompt = prompt_of(6, m.info.vocab, 8)
    local ref = with_mode(m, "off", function() return ar_run(m, prompt, 4) end)
    for _, mode in ipairs(MODES) do
      local got = with_mode(m, mode, function() return ar_run(m, prompt, 4) end)
      same_run(ref, got, "cpu mode " .. mode)
    end
    local r = m:memory()
    assert.are.equal(0, r.graphs + r.graph_captures + r.graph_launches + r.graph_fallbacks)
    m:close()
  end)
end)
