-- generate.lua: what every decoding policy shares: options, the first token after the
-- prefill, the stopping rule, per-round stats, and a dispatcher.
--
--   local gen = require("kdtree.generate")
--   local r = gen.run(m, {5, 77, 300}, {policy = "ddtree", drafter = d, budget = 16, n = 32})
--   r.tokens    -- generated ids (the prompt excluded), at most n, ending at an eos id if one came
--   r.rounds    -- one entry per decoding step/round: {tau=, size=, ns = {stage = ns, ...}}
local kd = require("kdtree")

local G = {}

-- normalise a policy's options: n, sampler (nil = greedy), eos set, capacity
function G.options(m, prompt, opts)
  opts = opts or {}
  if type(prompt) ~= "table" or #prompt == 0 then
    error("kdtree: generate: prompt: expected a non-empty list of token ids", 3)
  end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.n = opts.n or 16
  if type(o.n) ~= "number" or o.n < 0 or o.n ~= math.floor(o.n) then
    error("kdtree: generate: n: expected a non-negative integer, got " .. tostring(opts.n), 3)
  end
  local sp = opts.sampler
  if sp and (sp.temperature or 0) > 0 then o.sampler = sp else o.sampler = nil end
  -- eos: true (default) = the model's eos ids, false = none, or a list of ids
  o.eos_set = {}
  local eos = opts.eos
  if eos == nil or eos == true then eos = m.info.eos elseif eos == false then eos = {} end
  for _, id in ipairs(eos) do o.eos_set[id] = true end
  return o
end

-- the token the last output row produces (greedy, or a keyed sample at its position)
function G.last_token(s, sampler)
  local ids = sampler and s:sample(sampler) or s:argmax()
  return ids[#ids]
end

-- append tokens to out, honouring n and eos; returns true when generation is over
function G.push(out, toks, o)
  for _, t in ipairs(toks) do
    if #out >= o.n then return true end
    out[#out + 1] = t
    if o.eos_set[t] then out.stop = "eos"; return true end
  end
  return #out >= o.n
end

-- the target's half of a speculative round on a drafted tree: verify, accept, commit (timed
-- into tm). Returns the round's stats entry {tau, size, tokens, ns} (tokens: what is new
-- after the root, the bonus last) and the next bonus; context gets the accepted tokens.
function G.verify_round(s, tree, o, tm, context)
  s:verify(tree)
  tm("verify")
  local acc = s:accept(tree, o.sampler)
  tm("accept")
  s:commit(tree)
  tm("commit")
  local new = {}
  for i = 2, acc.tau do new[#new + 1] = acc.tokens[i] end
  new[#new + 1] = acc.bonus
  for _, t in ipairs(acc.tokens) do context[#context + 1] = t end
  return { tau = acc.tau, size = tree.n, tokens = new, ns = tm.ns }, acc.bonus
end

-- the loop of a tree-speculative policy: prefill, then rounds until n tokens or an eos.
-- A round is propose(s, tree, bonus, context, tm), which fills `tree` under `bonus` from the
-- drafter (timing its stages with tm), then verify_round. The drafter is attached to the
-- sequence when it is a DFlash drafter (native); the sequence holds the prompt, n tokens and
-- `spare` more rows (one tree of pending nodes and the drafter's block).
function G.speculate(m, prompt, o, native, spare, propose)
  local t_start = kd.now_ns()
  local s = m:new_seq(#prompt + o.n + spare)
  if native then s:attach_drafter(o.drafter) end
  local tm = G.timer()
  s:forward(prompt)
  local bonus = G.last_token(s, o.sampler)
  tm("prefill")
  local prefill_ns = tm.ns.prefill
  local out, rounds = {}, {}
  local context = {}                                  -- committed tokens, for Lua drafters
  for i, t in ipairs(prompt) do context[i] = t end
  local done = G.push(out, { bonus }, o)
  local tree = kd.tree.new()                          -- one tree, rebuilt every round (its device buffers stay)
  while not done do
    tm = G.timer()
    propose(s, tree, bonus, context, tm)
    local r
    r, bonus = G.verify_round(s, tree, o, tm, context)
    rounds[#rounds + 1] = r
    done = G.push(out, r.tokens, o)
    if o.on_round then o.on_round(r, out) end
  end
  tree:close()
  s:close()
  return G.result(out, rounds, prefill_ns, t_start)
end

-- a tiny stage timer: local tm = G.timer(); ...; tm("draft"); ...; tm("verify"); tm.ns
function G.timer()
  local t0 = kd.now_ns()
  local ns = {}
  return setmetatable({ ns = ns }, { __call = function(self, stage)
    local t1 = kd.now_ns()
    ns[stage] = (ns[stage] or 0) + (t1 - t0)
    t0 = t1
  end })
end

-- the result every policy returns
function G.result(out, rounds, prefill_ns, t_start)
  local stop = out.stop or "n"
  out.stop = nil
  return { tokens = out, rounds = rounds, stop = stop, prefill_ns = prefill_ns,
           total_ns = kd.now_ns() - t_start }
end

-- aggregate stats: rounds, mean tau, ns per stage, decode tokens/s
function G.summary(res)
  local s = { rounds = #res.rounds, tokens = #res.tokens, ns = {}, prefill_ns = res.prefill_ns }
  local tau_sum, size_sum, decode_ns = 0, 0, 0
  for _, r in ipairs(res.rounds) do
    tau_sum = tau_sum + (r.tau or 1)
    size_sum = size_sum + (r.size or 0)
    for k, v in pairs(r.ns or {}) do
      s.ns[k] = (s.ns[k] or 0) + v
      decode_ns = decode_ns + v
    end
  end
  s.mean_tau = #res.rounds > 0 and tau_sum / #res.rounds or 0
  s.mean_size = #res.rounds > 0 and size_sum / #res.rounds or 0
  s.decode_ns = decode_ns
  s.tok_per_s = decode_ns > 0 and (#res.tokens - 1) / (decode_ns * 1e-9) or 0
  return s
end

-- run a policy by name ("ar", "dflash", "ddtree") or policy table
function G.run(m, prompt, opts)
  opts = opts or {}
  local p = opts.policy or "ar"
  if type(p) == "string" then
    local ok, mod = pcall(require, "kdtree.policy." .. p)
    if not ok then error("kdtree: generate: policy: expected ar, dflash or ddtree, got " .. p, 2) end
    p = mod
  end
  return p.generate(m, prompt, opts)
end

return G
