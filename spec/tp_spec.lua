-- tp_spec: tensor parallelism on CPU ranks (core/comm_cpu.c, core/ranks.c; docs/architecture.md
-- "Several devices"). A model opened with {tp = N} splits its weights over N in-process ranks
-- and all-reduces twice per layer; the claims checked here against the one-rank model (TP-1,
-- the reference: the same engine without any split):
--   * the same tokens, token for token, for the ar, dflash and ddtree policies, greedy and
--     sampled (temperature, top-k, top-p), on both tiny layouts (tiny-k2.6 with its DFlash
--     drafter at tp 2; tiny-dsv3 at tp 2 and 4 with the oracle drafter given TP-1's ar tokens,
--     so that its rounds accept several tokens);
--   * logits within TOL of TP-1 (measured: at most 6.9e-6 on logits up to 8.9 in magnitude;
--     the split changes only the fp32 summation order of o_proj, the MLPs and the experts);
--   * the latent KV cache bit-identical on every rank (the all-reduce leaves identical bits
--     everywhere, and the cache rows are computed from them), after a prefill and after a
--     committed DDTree round, and within TOL of TP-1;
--   * the DFlash drafter split as the target is (its heads, its MLP; its head over the
--     vocabulary shards): its log-probs at tp 2 within TOL of TP-1's, its memory on every rank;
--   * accept and sampling on rank 0 over rows gathered whole (41 rows: two gathers) giving TP-1's
--     and the host round's tokens, greedy and sampled;
--   * refusals naming the field where a width does not split (the drafter's too), and a rank's
--     failure reported on the caller's thread with the model and sequence still usable.
-- Always on the CPU backend (the CUDA ranks need the NCCL communicator: a #gpu spec of its own).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local Ngram = require("kdtree.drafters.ngram")
local Oracle = require("kdtree.drafters.oracle")
local ck = require("spec.helpers.checkpoint")
local err_of = require("spec.helpers.err_of")

local K26, DSV3, DRAFT = ck.K26, ck.DSV3, "models/tiny-k2.6-dflash"
local TOL = 1e-4
local PROMPT = { 5, 77, 300, 12, 999, 77, 300, 5, 77 }
local N = 24
local SAMPLERS = {
  { name = "greedy" },
  { name = "temperature", sampler = { temperature = 0.8, seed = 7 } },
  { name = "top-k", sampler = { temperature = 1.0, top_k = 5, seed = 3 } },
  { name = "top-p", sampler = { temperature = 0.9, top_p = 0.7, seed = 11 } },
  { name = "top-k + top-p", sampler = { temperature = 1.2, top_k = 40, top_p = 0.9, seed = 1234 } },
}
-- the layouts and the widths that split them (tiny-k2.6 at tp 4 is refused: INT4 groups);
-- drafter(m, future): future = the prompt and TP-1's ar tokens for the sampler at hand
local LAYOUTS = {
  { dir = K26, tps = { 2 }, drafter = function(m) return kd.open_drafter(DRAFT, m) end },
  { dir = DSV3, tps = { 2, 4 }, drafter = function(m, future) return Oracle.new({ vocab = m.info.vocab, future = future }) end },
}

local function open(dir, tp) return kd.open_model(dir, { backend = "cpu", tp = tp }) end

-- the largest |a[i] - b[i]| over i = first .. first + n - 1 (float* cdata: first 0; Lua lists: 1)
local function max_diff(a, b, n, first)
  local d = 0
  for i = first, first + n - 1 do d = math.max(d, math.abs(a[i] - b[i])) end
  if d ~= d then return math.huge end
  return d
end

-- every policy x sampler on model m of layout L: {key = tokens as a string}, and the mean tau
-- of the speculative runs; ar_ref: TP-1's ar tokens by sampler (nil: this is TP-1)
local function run_all(m, L, ar_ref)
  local out, taus, ar = {}, {}, {}
  for _, sp in ipairs(SAMPLERS) do
    ar[sp.name] = gen.run(m, PROMPT, { policy = "ar", n = N, eos = false, sampler = sp.sampler }).tokens
    out["ar / " .. sp.name] = table.concat(ar[sp.name], " ")
  end
  ar_ref = ar_ref or ar
  for _, pol in ipairs({ "dflash", "ddtree" }) do
    for _, sp in ipairs(SAMPLERS) do
      local future = {}
      for _, t in ipairs(PROMPT) do future[#future + 1] = t end
      for _, t in ipairs(ar_ref[sp.name]) do future[#future + 1] = t end
      local d = L.drafter(m, future)
      local r = gen.run(m, PROMPT, { policy = pol, n = N, eos = false, sampler = sp.sampler, drafter = d, budget = 8 })
      if d.close then d:close() end
      local key = pol .. " / " .. sp.name
      out[key] = table.concat(r.tokens, " ")
      taus[key] = gen.summary(r).mean_tau
    end
  end
  return out, taus, ar
end

describe("tensor parallel (CPU ranks)", function()
  for _, L in ipairs(LAYOUTS) do
    describe(L.dir, function()
      local ref, ref_ar, ref_m
      setup(function()
        ref_m = open(L.dir, 1)
        ref, _, ref_ar = run_all(ref_m, L)
      end)
      teardown(function() ref_m:close() end)

      for _, tp in ipairs(L.tps) do
        it("tp " .. tp .. ": m.info reports the split", function()
          local m = open(L.dir, tp)
          local i = m.info
          assert.are.equal(tp, i.tp)
          assert.are.same({ heads = i.n_heads / tp, intermediate = i.intermediate / tp,
            moe_intermediate = i.moe_intermediate / tp, vocab = i.vocab / tp }, i.split)
          m:close()
        end)

        it("tp " .. tp .. ": ar, dflash and ddtree give TP-1's tokens, greedy and sampled", function()
          local m = open(L.dir, tp)
          local got, taus = run_all(m, L, ref_ar)
          for key, toks in pairs(ref) do assert.are.equal(toks, got[key], key) end
          -- the greedy DDTree run accepted drafted tokens (not every round tau 1: measured 1.35 with
          -- the tiny DFlash drafter, which accepts less in its chain and in sampled rounds)
          assert.is_true(taus["ddtree / greedy"] > 1.2, "ddtree / greedy: mean tau " .. taus["ddtree / greedy"])
          m:close()
        end)

        it("tp " .. tp .. ": logits within " .. TOL .. " of TP-1, the cache identical on every rank", function()
          local m = open(L.dir, tp)
          require("spec.helpers.tp_matches_tp1")(m, ref_m, PROMPT, { tp = tp, tol = TOL, cache_tol = TOL, name = L.dir })
          m:close()
        end)

        if L.dir == K26 then
          it("tp " .. tp .. ": the draft's log-probs (its head over the vocabulary shards) within " .. TOL .. " of TP-1's",
            function()
              local function draft(model)
                local d = kd.open_drafter(DRAFT, model)
                local s = model:new_seq(64)
                s:attach_drafter(d)
                s:forward(PROMPT)
                local lp = s:draft(s:argmax()[#PROMPT])
                local out = {}
                for i = 0, lp.L * lp.V - 1 do out[i] = lp.data[i] end
                s:close(); d:close()
                return out, lp.L * lp.V
              end
              local a, n = draft(ref_m)
              local m = open(L.dir, tp)
              local b = draft(m)
              local worst = 0
              for i = 0, n - 1 do worst = math.max(worst, math.abs(a[i] - b[i])) end
              io.stderr:write(string.format("\n  %s tp %d: draft log-probs max |diff| %.3g\n", L.dir, tp, worst))
              assert.is_true(n == 7 * m.info.vocab and worst <= TOL, "largest difference " .. worst)
              m:close()
            end)
        end

        -- at tp > 1 accept and sampling run on rank 0 over the rows gathered whole, 32 at a time
        -- (kd_seq_gather_rows): 41 rows take two gathers
        it("tp " .. tp .. ": 41 rows sampled, and a 40-node tree accepted, as TP-1 and the host round do", function()
          local m = open(L.dir, tp)
          local mh = kd.open_model(L.dir, { backend = "cpu", tp = tp, ddtree_round = "host" })
          local sp = { temperature = 0.9, top_p = 0.8, seed = 5 }
          local toks = {}
          for i = 1, 41 do toks[i] = (i * 37) % m.info.vocab end
          local function sample_all(model)
            local s = model:new_seq(64)
            s:forward(toks)
            local r = s:sample(sp)
            s:close()
            return r
          end
          local want = sample_all(ref_m)
          assert.are.equal(41, #want)
          assert.are.same(want, sample_all(m))
          local function round(model, sampler)
            local s = model:new_seq(96)
            s:forward(PROMPT)
            local bonus = s:argmax()[#PROMPT]
            local t = kd.tree.new()
            t:build(Ngram.new({ vocab = model.info.vocab }):draft(PROMPT, bonus), 40, { logprobs = true, root = bonus })
            assert.are.equal(40, t.n)
            s:verify(t)
            local r = s:accept(t, sampler)
            s:commit(t)
            local out = { tokens = r.tokens, bonus = r.bonus, len = s:len(), next = s:argmax() }
            t:close(); s:close()
            return out
          end
          for _, sampler in ipairs({ false, sp }) do
            local ref_r = round(ref_m, sampler or nil)
            assert.are.same(ref_r, round(m, sampler or nil))
            assert.are.same(ref_r, round(mh, sampler or nil))
          end
          mh:close(); m:close()
        end)

        it("tp " .. tp .. ": after a committed DDTree round the cache is identical on every rank", function()
          local m = open(L.dir, tp)
          local function round(model)
            local s = model:new_seq(64)
            s:forward(PROMPT)
            local bonus = s:argmax()[#PROMPT]
            local t = kd.tree.new()
            local rows = Ngram.new({ vocab = model.info.vocab }):draft(PROMPT, bonus)
            t:build(rows, 12, { logprobs = true, root = bonus })
            s:verify(t)
            local r = s:accept(t)
            s:commit(t)
            t:close()
            return s, r
          end
          local s, r = round(m)
          local s1, r1 = round(ref_m)
          assert.are.same(r1.tokens, r.tokens)
          assert.are.equal(r1.bonus, r.bonus)
          assert.are.equal(s1:len(), s:len())
          for l = 0, m.info.n_layers - 1 do
            local c0 = s:read_cache(l, 0, s:len(), 0)
            for rk = 1, tp - 1 do assert.are.same(c0, s:read_cache(l, 0, s:len(), rk), "layer " .. l .. " rank " .. rk) end
            local c1 = s1:read_cache(l, 0, s1:len())
            local d = max_diff(c0, c1, #c1, 1)
            assert.is_true(d <= TOL, "layer " .. l .. ": cache differs from TP-1 by " .. d)
          end
          s:close(); s1:close()
          m:close()
        end)
      end
    end)
  end

  it("load progress: each rank's bytes reach its total, which adds up to the weights the ranks hold", function()
    local whole   -- tp 1's bytes
    for _, tp in ipairs({ 1, 2, 4 }) do
      local last, calls = {}, 0
      local m = kd.open_model(DSV3, { backend = "cpu", tp = tp, progress = function(rank, done, total)
        calls = calls + 1
        assert.is_true(done <= total, "rank " .. rank .. ": " .. done .. " of " .. total)
        last[rank] = { done, total }
      end })
      local sum = 0
      for r = 0, tp - 1 do
        assert.are.equal(last[r][2], last[r][1], "rank " .. r)
        sum = sum + last[r][2]
      end
      assert.are.equal(m.info.bytes_weights, sum)
      assert.is_true(calls > tp, "progress reported while loading, not only at the end")
      whole = whole or sum
      if tp > 1 then
        assert.is_true(last[1][2] < whole / 1.2, "rank 1 holds a part, not a copy")
        assert.are.equal(last[0][2], last[1][2], "every rank holds as much")
      end
      m:close()
    end
  end)

  -- per-rank memory against the plan (kd_plan: the loader's walk without loading) and the load
  -- progress: every rank the plan's share; the sequence's buffers on every rank alike; the
  -- drafter split over the ranks as the target is (its head is the target's lm_head: no rank
  -- holds a whole copy); the trees on rank 0
  it("memory by rank: each rank's weights are the plan's share, the sequence's buffers on every rank", function()
    local tp = 2
    local plan = kd.plan(K26, { tp = tp })
    local totals = {}
    local m = kd.open_model(K26, { backend = "cpu", tp = tp, progress = function(rank, _, total) totals[rank] = total end })
    local d = kd.open_drafter(DRAFT, m)
    local s = m:new_seq(64)
    s:attach_drafter(d)
    s:forward(PROMPT)
    local r0, r1 = m:memory(0), m:memory(1)
    assert.are.same(m:memory(), r0)
    assert.are.equal(plan.weights_total, r0.weights_total)
    assert.are.equal(plan.weights_total, r1.weights_total)
    assert.are.equal(totals[0], r0.weights_total)
    assert.are.equal(totals[1], r1.weights_total)
    for _, k in ipairs({ "kv_cache", "activations" }) do
      assert.is_true(r0[k] > 0, k)
      assert.are.equal(r0[k], r1[k], k)
    end
    -- the drafter's weights: every rank its heads, its part of the MLP and of fc, the norms whole
    assert.is_true(r0.drafter_weights > 0)
    assert.are.equal(r0.drafter_weights, r1.drafter_weights)
    -- its per-sequence buffers on every rank alike, and on rank 0 the [7, 1024] fp32 log-probs and
    -- their 7 argmax ids besides
    assert.is_true(r1.drafter_cache > 0)
    assert.are.equal(7 * 1024 * 4 + 7 * 4, r0.drafter_cache - r1.drafter_cache)
    assert.are.equal(0, r1.trees)
    assert.are.equal(r1.weights_total + r1.drafter_weights + r1.kv_cache + r1.activations + r1.drafter_cache +
      r1.workspace + r1.other, r1.total)
    for _, bad in ipairs({ -1, tp }) do
      local e = err_of(function() m:memory(bad) end)
      assert.truthy(e:find("kd_model_memory: rank " .. bad .. ": the model has ranks 0..1", 1, true), e)
    end
    s:close(); d:close(); m:close()
  end)

  it("the CPU all-reduce: rank 0 + 1 + ... in fp32 on every rank, identical bits; all_gather; abort and reset", function()
    local O = require("spec.helpers.ops")
    local ffi = O.ffi
    local rows, cols, ld = 5, 7, 9
    for _, n in ipairs({ 2, 3, 4, 8 }) do
      local bufs = ffi.new("float[?]", n * rows * ld)
      local gathered = ffi.new("float[?]", n * n * cols)
      local status = ffi.new("int32_t[?]", n + 1)
      -- magnitudes 1e-3 .. 1e7 with signs: the fp32 sum depends on the order
      local x = 7
      for i = 0, n * rows * ld - 1 do
        x = (x * 48271) % 2147483647
        bufs[i] = ((x % 2 == 0) and 1 or -1) * 10 ^ ((x % 11) - 3) * (1 + (x % 1000) / 1000)
      end
      local before = ffi.new("float[?]", n * rows * ld)
      ffi.copy(before, bufs, ffi.sizeof(before))
      O.check(O.C.kd_test_comm_cpu(n, rows, cols, ld, bufs, gathered, -1, status), "kd_test_comm_cpu")
      for r = 0, n - 1 do assert.are.equal(0, status[r]) end
      local acc = ffi.new("float[1]")
      for i = 0, rows - 1 do
        for c = 0, ld - 1 do
          if c < cols then
            acc[0] = before[i * ld + c]                               -- rank 0 + rank 1 + ..., rounded to fp32 each step
            for r = 1, n - 1 do acc[0] = acc[0] + before[(r * rows + i) * ld + c] end
          end
          for r = 0, n - 1 do
            local at = (r * rows + i) * ld + c
            local want = c < cols and acc[0] or before[at]            -- the padding past cols is left alone
            assert.is_true(bufs[at] == want, string.format("%d ranks: rank %d [%d, %d]", n, r, i, c))
          end
        end
      end
      for r = 0, n - 1 do                                            -- every rank got every rank's first row
        for k = 0, n - 1 do
          for c = 0, cols - 1 do assert.is_true(gathered[(r * n + k) * cols + c] == bufs[k * rows * ld + c]) end
        end
      end
      -- a rank that fails: the others return instead of waiting; after a reset all reduce again
      O.check(O.C.kd_test_comm_cpu(n, rows, cols, ld, bufs, gathered, n - 1, status), "kd_test_comm_cpu (abort)")
      for r = 0, n - 2 do assert.are.equal(tonumber(kd.C.KD_ERR_STATE), status[r]) end
      assert.are.equal(0, status[n])
    end
  end)

  it("keyed sampling over vocabulary shards draws the whole row's token (ties across shards, top-k, top-p)", function()
    local O = require("spec.helpers.ops")
    local ffi = O.ffi
    local V = 48
    local row = ffi.new("float[?]", V)
    local got, want = ffi.new("int32_t[1]"), ffi.new("int32_t[1]")
    local seed = 12345
    local function rnd()                              -- a small LCG: the spec's own numbers
      seed = (seed * 1103515245 + 12345) % 2147483648
      return seed / 2147483648
    end
    local samplers = {
      kd.sampler({ temperature = 1.0, seed = 1 }),
      kd.sampler({ temperature = 0.7, top_k = 5, seed = 2 }),
      kd.sampler({ temperature = 1.3, top_k = 13, seed = 3 }),
      kd.sampler({ temperature = 0.9, top_p = 0.6, seed = 4 }),
      kd.sampler({ temperature = 2.0, top_k = 30, top_p = 0.8, seed = 5 }),
      kd.sampler({ temperature = 0.5, top_p = 0.05, seed = 6 }),
    }
    local draws, distinct = 0, {}
    for trial = 1, 60 do
      -- values from a set of 4 (many ties, within and across shards), some -inf
      for i = 0, V - 1 do
        local u = rnd()
        row[i] = u < 0.1 and -math.huge or math.floor(rnd() * 4) * 0.75
      end
      for _, sp in ipairs(samplers) do
        for pos = 1, 6 do
          kd.check(kd.C.kd_sample_logits(row, V, sp, pos * 7 + trial, want), "kd_sample_logits")
          for _, n in ipairs({ 2, 3, 4, 6, 8 }) do
            O.check(O.C.kd_test_sample_shards(row, V, n, sp, pos * 7 + trial, got), "kd_test_sample_shards")
            assert.are.equal(want[0], got[0], string.format("trial %d, %d shards, position %d", trial, n, pos))
            draws = draws + 1
          end
          distinct[want[0]] = true
        end
      end
    end
    local nd = 0
    for _ in pairs(distinct) do nd = nd + 1 end
    assert.is_true(draws == 60 * 6 * 6 * 5 and nd > 20, "draws " .. draws .. ", distinct tokens " .. nd)
    -- errors name the whole row's column: a NaN in the third of four shards
    for i = 0, V - 1 do row[i] = 0 end
    row[29] = 0 / 0
    local e = err_of(function() O.check(O.C.kd_test_sample_shards(row, V, 4, samplers[1], 1, got), "shards") end)
    assert.matches("logits[29] is NaN", e, 1, true)
  end)

  it("greedy: equal logits in two shards go to the lower id, as on one rank", function()
    -- a copy of tiny-dsv3 whose lm_head row u (rank 0's shard at tp 2) equals row t (rank 1's),
    -- where t is the first generated token in rank 1's shard: from that step on the two logits
    -- are equal bit for bit, and the argmax must take u
    local V = 1024
    local m0 = open(DSV3, 1)
    local orig = gen.run(m0, PROMPT, { n = 16, eos = false }).tokens
    m0:close()
    local step, t
    for i, tok in ipairs(orig) do
      if tok >= V / 2 then step, t = i, tok; break end
    end
    assert.is_truthy(step, "a generated token in the second shard")
    local u = t - V / 2
    local d = ck.copy(DSV3)
    local info = ck.tensors(d)["lm_head.weight"]
    local row = info.shape[2] * 2
    ck.edit_st(d .. "/" .. info.file, function(_, st)
      local at = info.data_offsets[1]
      local src = st.data:sub(at + t * row + 1, at + (t + 1) * row)
      return st.data:sub(1, at + u * row) .. src .. st.data:sub(at + (u + 1) * row + 1)
    end)
    local m1, m2 = open(d, 1), open(d, 2)
    local one = gen.run(m1, PROMPT, { n = 16, eos = false }).tokens
    local two = gen.run(m2, PROMPT, { n = 16, eos = false }).tokens
    assert.are.equal(u, one[step])
    for i = 1, step - 1 do assert.are.equal(orig[i], one[i]) end
    assert.are.same(one, two)
    m1:close(); m2:close()
  end)

  describe("refusals", function()
    local function still_works()
      local m = open(DSV3, 2)
      local r = gen.run(m, PROMPT, { n = 4, eos = false })
      assert.are.equal(4, #r.tokens)
      m:close()
    end

    it("tp that does not divide the heads, or splits INT4 groups (tiny-k2.6)", function()
      -- the plan's rule (kd_plan_check_tp), the loader's too
      assert.matches("options.tp: tp 3 does not divide num_attention_heads (4)", err_of(open, K26, 3), 1, true)
      local e = err_of(open, K26, 4)
      assert.matches("moe_intermediate_size 64 / 4 = 16 columns per rank", e, 1, true)
      assert.matches("INT4 scale groups (group_size 32)", e, 1, true)
      still_works()
    end)

    it("tp that does not divide intermediate_size, moe_intermediate_size or vocab_size", function()
      for field, value in pairs({ intermediate_size = 190, moe_intermediate_size = 30, vocab_size = 1022 }) do
        local d = ck.copy(DSV3)
        ck.edit_config(d, function(cfg, text) text[field] = value end)
        assert.matches(string.format("options.tp: tp 4 does not divide %s (%d)", field, value), err_of(open, d, 4), 1, true)
      end
      still_works()
    end)

    it("a DFlash drafter whose KV heads or intermediate size do not split over the ranks", function()
      local m = open(K26, 2)
      for field, value in pairs({ num_key_value_heads = 1, intermediate_size = 255 }) do
        local d = ck.copy(DRAFT)
        ck.edit_config(d, function(cfg) cfg[field] = value end)
        assert.matches(string.format("field '%s': %d does not split over the target's 2 ranks", field, value),
          err_of(kd.open_drafter, d, m), 1, true)
      end
      -- the model and the shipped drafter still work
      local d = kd.open_drafter(DRAFT, m)
      local r = gen.run(m, PROMPT, { policy = "ddtree", n = 4, eos = false, drafter = d, budget = 8 })
      assert.are.equal(4, #r.tokens)
      d:close(); m:close()
    end)

    it("more than 8 ranks", function()
      assert.matches("options.tp is 9: expected 1..8 ranks", err_of(open, DSV3, 9), 1, true)
    end)
  end)

  it("a rank that fails mid-forward: the error reaches the caller, the model stays usable", function()
    local m = open(DSV3, 2)
    require("spec.helpers.rank_failure")(m, PROMPT)
    m:close()
  end)
end)
