-- tp_cuda_spec: tensor parallelism on CUDA ranks that share one GPU (devices = {0, 0, ...}), so the
-- real CUDA split runs through the loopback communicator (cuda/comm.cu: a fixed-order fp32 sum of
-- the ranks' fp32 partials, written to every rank; model.c rounds the sum to bf16 once). spec/tp_spec.lua proves the split on CPU ranks;
-- here the same engine on the CUDA backend, against the one-rank CUDA model (TP-1):
--   * greedy dflash and ddtree give the split model's own greedy ar tokens exactly (DDTree is
--     exact; tiny-k2.6 at tp 2 with its DFlash drafter, tiny-dsv3 at tp 2 and 4 with the oracle
--     drafter given those ar tokens);
--   * the split model's greedy ar follows TP-1's up to a near-tie, not exactly: the ranks' fp32
--     partials are summed in another order than TP-1's GEMM accumulates, so a bf16 result can round
--     the other way (with bf16 partials, before fp32 partials, tokens parted on an H200: tiny-k2.6
--     tp 2 at step 15, tiny-dsv3 tp 2 at step 5; with fp32 partials the prompt logits stay within
--     0.0063 of the largest |logit|, H200 2026-12-04). The rule that holds and still catches a wrong split: at the first
--     differing step TP-1's own logits (for the shared prefix) rate the split model's token within
--     2 * REL_TOL * (largest |logit|) of their max (each of the two logits may move by REL_TOL), and
--     the split model's logits for that prefix are within REL_TOL of TP-1's; and on DECISIVE, a
--     prompt whose top-2 margin is large on both models (about 0.19 relative on the CPU), the first
--     greedy token is TP-1's exactly (a wrong split moves logits by far more than the margin);
--   * sampled dflash and ddtree give the split model's own ar tokens (speculative decoding stays
--     lossless at tp > 1: the loopback sum is elementwise, so a row's bits do not depend on the
--     rows beside it). Sampled tokens are not compared with TP-1's: the split's summation order
--     can move a bf16 logit by one rounding step, which can move a keyed draw that lands near a
--     boundary;
--   * the prompt's logits within REL_TOL of TP-1's, relative to their largest |logit| (golden_spec's
--     bound for the CUDA backend's bf16 activations against fp64), and the latent KV cache
--     bit-identical on every rank after the prefill (the all-reduce leaves the same bits everywhere);
--   * a rank that fails mid-forward while the other waits at the loopback's barrier: the error
--     reaches the caller (the waiting rank was released by abort), the sequence is unchanged and
--     the model goes on with the same tokens as before (the communicator was reset).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local Oracle = require("kdtree.drafters.oracle")
local ck = require("spec.helpers.checkpoint")

local K26, DSV3, DRAFT = ck.K26, ck.DSV3, "models/tiny-k2.6-dflash"
local REL_TOL = 2e-2
local PROMPT = { 5, 77, 300, 12, 999, 77, 300, 5, 77 }
local DECISIVE = { 165, 865, 357, 71 }   -- TP-1's top-2 margin ~0.19 of the largest |logit|, both models
local N = 24
local SAMPLED = {
  { name = "temperature", sampler = { temperature = 0.8, seed = 7 } },
  { name = "top-k + top-p", sampler = { temperature = 1.2, top_k = 40, top_p = 0.9, seed = 1234 } },
}
local LAYOUTS = {
  { dir = K26, tps = { 2 }, drafter = function(m) return kd.open_drafter(DRAFT, m) end },
  { dir = DSV3, tps = { 2, 4 }, drafter = function(m, future) return Oracle.new({ vocab = m.info.vocab, future = future }) end },
}

local function open(dir, tp)
  local devices = {}
  for r = 1, tp do devices[r] = 0 end
  return kd.open_model(dir, { backend = "cuda", tp = tp, devices = devices })
end

local function tokens(m, L, policy, sampler, future)
  local d = policy ~= "ar" and L.drafter(m, future) or nil
  local r = gen.run(m, PROMPT, { policy = policy, n = N, eos = false, sampler = sampler, drafter = d, budget = 8 })
  if d and d.close then d:close() end
  return table.concat(r.tokens, " "), r.tokens
end

-- the prompt followed by tokens (the oracle drafter's future)
local function future_of(toks)
  local f = {}
  for _, t in ipairs(PROMPT) do f[#f + 1] = t end
  for _, t in ipairs(toks) do f[#f + 1] = t end
  return f
end

-- the last output row of a prefill of ids: (logits list, largest |logit|, argmax token, top-2 margin)
local function logits_at(m, ids)
  local s = m:new_seq(64)
  s:forward(ids)
  local _, _, rows = s:logits_cdata(1)
  local l = s:logits(rows)
  s:close()
  local top, best, b1, b2 = 0, nil, -math.huge, -math.huge
  for i, v in ipairs(l) do
    top = math.max(top, math.abs(v))
    if v > b1 then b2, b1, best = b1, v, i - 1 elseif v > b2 then b2 = v end
  end
  return l, top, best, b1 - b2
end

describe("tensor parallel on one GPU through the loopback #gpu", function()
  for _, L in ipairs(LAYOUTS) do
    describe(L.dir, function()
      local ref_m, ref_list
      setup(function()
        ref_m = open(L.dir, 1)
        ref_list = select(2, tokens(ref_m, L, "ar"))
      end)
      teardown(function() ref_m:close() end)

      for _, tp in ipairs(L.tps) do
        it("tp " .. tp .. ": greedy dflash and ddtree give its own ar tokens; its ar follows TP-1's up to a near-tie", function()
          local m = open(L.dir, tp)
          local ar, ar_list = tokens(m, L, "ar")
          for _, pol in ipairs({ "dflash", "ddtree" }) do
            assert.are.equal(ar, (tokens(m, L, pol, nil, future_of(ar_list))), pol)
          end
          local k = nil
          for i = 1, N do if k == nil and ar_list[i] ~= ref_list[i] then k = i end end
          if k then
            local prefix = future_of({ unpack(ref_list, 1, k - 1) })
            local l1, top1, best1 = logits_at(ref_m, prefix)
            local ln = logits_at(m, prefix)
            local d = 0
            for i = 1, #l1 do d = math.max(d, math.abs(l1[i] - ln[i])) end
            local gap = l1[best1 + 1] - l1[ar_list[k] + 1]
            print(("\n  %s tp %d: greedy ar parts from TP-1's at step %d (%d vs %d): TP-1's logit gap %.3g, "
              .. "logits |diff| %.3g, largest |logit| %.3g"):format(L.dir, tp, k, ar_list[k], ref_list[k], gap, d, top1))
            assert.is_true(d <= REL_TOL * top1, "step " .. k .. ": logits differ by " .. d .. " (largest " .. top1 .. ")")
            assert.is_true(gap <= 2 * REL_TOL * top1, "step " .. k .. ": TP-1 rates token " .. ar_list[k]
              .. " " .. gap .. " below its max (largest |logit| " .. top1 .. "): not a near-tie")
          end
          local _, top1, best1, margin = logits_at(ref_m, DECISIVE)
          assert.is_true(margin > 4 * REL_TOL * top1, "DECISIVE's top-2 margin " .. margin .. " is not large")
          local _, _, best_n = logits_at(m, DECISIVE)
          assert.are.equal(best1, best_n, "the first greedy token after DECISIVE")
          m:close()
        end)

        it("tp " .. tp .. ": sampled dflash and ddtree give the split model's own ar tokens", function()
          local m = open(L.dir, tp)
          for _, sp in ipairs(SAMPLED) do
            local ar, ar_list = tokens(m, L, "ar", sp.sampler)
            for _, pol in ipairs({ "dflash", "ddtree" }) do
              assert.are.equal(ar, (tokens(m, L, pol, sp.sampler, future_of(ar_list))), pol .. " / " .. sp.name)
            end
          end
          m:close()
        end)

        it("tp " .. tp .. ": logits within " .. REL_TOL .. " of TP-1 (relative), the cache identical on every rank", function()
          local m = open(L.dir, tp)
          require("spec.helpers.tp_matches_tp1")(m, ref_m, PROMPT, { tp = tp, tol = REL_TOL, relative = true, name = L.dir })
          m:close()
        end)
      end
    end)
  end

  it("a rank that fails while the other waits at the loopback's barrier: the caller gets its error, the model goes on", function()
    local m = open(DSV3, 2)
    require("spec.helpers.rank_failure")(m, PROMPT)
    m:close()
  end)
end)
