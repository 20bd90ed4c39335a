-- policy/ar.lua: autoregressive decoding, the reference every other policy must equal.
-- Prefill the prompt, then one kd_forward per token; greedy argmax, or a sample keyed by
-- (seed, absolute position) so that speculative policies can reproduce it token for token.
local kd = require("kdtree")
local G = require("kdtree.generate")

local P = {}

-- opts: n, sampler = {temperature=, top_k=, top_p=, min_p=, seed=}, eos (true | false | {ids}),
--       on_round(round, out) callback
function P.generate(m, prompt, opts)
  local o = G.options(m, prompt, opts)
  local t_start = kd.now_ns()
  local s = m:new_seq(#prompt + o.n + 1)
  local out, rounds = {}, {}

  local tm = G.timer()
  s:forward(prompt)
  local tok = G.last_token(s, o.sampler)
  tm("prefill")
  local prefill_ns = tm.ns.prefill
  local done = G.push(out, { tok }, o)

  while not done do
    tm = G.timer()
    s:forward({ tok })
    tm("forward")
    tok = G.last_token(s, o.sampler)
    tm("sample")
    done = G.push(out, { tok }, o)
    local r = { tau = 1, size = 0, tokens = { tok }, ns = tm.ns }
    rounds[#rounds + 1] = r
    if o.on_round then o.on_round(r, out) end
  end
  s:close()
  return G.result(out, rounds, prefill_ns, t_start)
end

return P
