-- policy/ar.lua: autoregressive decoding, the reference every other policy must equal.
-- Prefill the prompt, then one kd_forward per token; greedy argmax, or a sample keyed by
-- (seed, absolute position) so that speculative policies can reproduce it token for token.
local kd = require("kdtree")
local G = require("kdtree.generate")

local P = {}

-- opts: n, sampler = {temperature=, top_k=, top_p=, min_p=, seed=}, eos (true | false | {ids}),
--       tokenizer and stop (stop strings), logprobs, on_round(round, out) callback
function P.generate(m, prompt, opts)
  local o = G.options(m, prompt, opts)
  local t_start = kd.now_ns()
  local s = m:new_seq(#prompt + o.n + 1)
  local out, rounds = {}, {}

  local tm = G.timer()
  s:forward(prompt)
  local tok, lps = G.first_token(s, o)
  tm("prefill")
  local prefill_ns = tm.ns.prefill
  local done = G.push(out, { tok }, o, lps)

  while not done do
    tm = G.timer()
    s:forward({ tok })
    tm("forward")
    tok = G.last_token(s, o.sampler)
    tm("sample")
    local r = { tau = 1, size = 0, tokens = { tok }, ns = tm.ns,
                logprobs = o.logprobs and { G.logprob(s, 1, tok, o.logprobs) } }
    rounds[#rounds + 1] = r
    done = G.end_round(r, out, o, G.push(out, r.tokens, o, r.logprobs))
  end
  s:close()
  return G.result(out, rounds, prefill_ns, t_start, o)
end

return P
