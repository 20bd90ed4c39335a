-- generate.lua: what every decoding policy shares: options, the first token after the
-- prefill, the stopping rules (n, eos, stop strings), the output's text and log-probs,
-- per-round stats, and a dispatcher.
--
--   local gen = require("kdtree.generate")
--   local r = gen.run(m, {5, 77, 300}, {policy = "ddtree", drafter = d, budget = 16, n = 32})
--   r.tokens    -- generated ids (the prompt excluded), at most n, ending at an eos id if one came
--   r.rounds    -- one entry per decoding step/round: {tau=, size=, ns = {stage = ns, ...}}
-- With opts.tokenizer the output is also text (r.text, and each round's r.rounds[i].text as it
-- becomes final), cut at the first of opts.stop's strings; opts.logprobs = N adds the
-- log-probabilities of each chosen token and of the N likeliest ones.
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
  if opts.logprobs ~= nil and (type(opts.logprobs) ~= "number" or opts.logprobs < 0
      or opts.logprobs ~= math.floor(opts.logprobs)) then
    error("kdtree: generate: logprobs: expected a non-negative integer (alternatives per token), got "
      .. tostring(opts.logprobs), 3)
  end
  if opts.stop ~= nil and not opts.tokenizer then
    error("kdtree: generate: stop: stop strings are matched on text: give opts.tokenizer too", 3)
  end
  if opts.tokenizer then o.text = G.text(opts.tokenizer, opts.stop) end
  return o
end

-- ---- text: the decoded output, released as it becomes final ----
-- A token may end inside a UTF-8 character, and the end of the text may be the start of a
-- stop string: both are held back until the next tokens decide them. push(id) adds a token
-- and says whether a stop string is now complete (the text is cut before it); take(final)
-- returns the text that is final since the last take (all of it when final).
local Text = {}
Text.__index = Text

function G.text(tok, stops)
  stops = stops or {}
  if type(stops) == "string" then stops = { stops } end
  if type(stops) ~= "table" then error("kdtree: generate: stop: expected a list of strings", 3) end
  for i, st in ipairs(stops) do
    if type(st) ~= "string" or st == "" then
      error(string.format("kdtree: generate: stop[%d]: expected a non-empty string", i), 3)
    end
  end
  return setmetatable({ tok = tok, stops = stops, pending = "", taken = {}, stopped = false }, Text)
end

function Text:push(id)
  if self.stopped then return true end
  self.pending = self.pending .. self.tok:decode({ id })
  local cut
  for _, st in ipairs(self.stops) do
    local at = self.pending:find(st, 1, true)
    if at and (not cut or at < cut) then cut = at end
  end
  if cut then
    self.pending = self.pending:sub(1, cut - 1)
    self.stopped = true
  end
  return self.stopped
end

-- bytes at the end of s that start a UTF-8 character not complete in s
local function incomplete_utf8(s)
  for back = 1, math.min(3, #s) do
    local b = s:byte(#s - back + 1)
    if b < 0x80 then return 0 end                     -- ASCII: complete
    if b >= 0xC0 then                                 -- a lead byte: its length decides
      local need = b >= 0xF0 and 4 or b >= 0xE0 and 3 or 2
      return need > back and back or 0
    end
  end
  return 0
end

function Text:take(final)
  local s = self.pending
  local hold = 0
  if not (final or self.stopped) then
    for _, st in ipairs(self.stops) do                -- a tail that may grow into a stop string
      for k = math.min(#st - 1, #s), 1, -1 do
        if k > hold and s:sub(-k) == st:sub(1, k) then hold = k; break end
      end
    end
    hold = math.max(hold, incomplete_utf8(s))
  end
  local out = s:sub(1, #s - hold)
  self.pending = s:sub(#s - hold + 1)
  if out ~= "" then self.taken[#self.taken + 1] = out end
  return out
end

function Text:all() return table.concat(self.taken) end

-- ---- log-probabilities from the target's logits rows ----
-- row (1-based) of the last forward produced `chosen`: its log-probability under the model
-- (softmax of the raw logits: before temperature, top-k, top-p) and the n likeliest tokens
-- ({token =, logprob =}, likeliest first, ties by lower id). The rows are the ones AR decoding
-- reads too (verify computes each node's row as a decode step would), so the values match AR's.
function G.logprob(s, row, chosen, n)
  local l, V = s:logits_cdata(row, 1)
  local mx = -math.huge
  for j = 0, V - 1 do if l[j] > mx then mx = l[j] end end
  local z = 0
  for j = 0, V - 1 do z = z + math.exp(l[j] - mx) end
  local lse = mx + math.log(z)
  local top = {}                                      -- insertion into a sorted list of n
  for j = 0, V - 1 do
    local v = l[j]
    if n > 0 and (#top < n or v > top[#top].v) then
      local k = math.min(#top + 1, n)
      while k > 1 and top[k - 1].v < v do top[k] = top[k - 1]; k = k - 1 end
      top[k] = { v = v, id = j }
    end
  end
  local alts = {}
  for i, e in ipairs(top) do alts[i] = { token = e.id, logprob = e.v - lse } end
  return { token = chosen, logprob = l[chosen] - lse, top = alts }
end

-- the token the last output row produces (greedy, or a keyed sample at its position)
function G.last_token(s, sampler)
  local ids = sampler and s:sample(sampler) or s:argmax()
  return ids[#ids]
end

-- append tokens to out (and their log-probs lps, when kept), honouring n, eos and stop
-- strings; returns true when generation is over
function G.push(out, toks, o, lps)
  for i, t in ipairs(toks) do
    if #out >= o.n then return true end
    out[#out + 1] = t
    if lps then out.logprobs = out.logprobs or {}; out.logprobs[#out] = lps[i] end
    if o.eos_set[t] then out.stop = "eos"; return true end
    if o.text and o.text:push(t) then out.stop = "stop"; return true end
  end
  return #out >= o.n
end

-- a round is over: its text, the callback (which may end generation by returning a reason,
-- e.g. "interrupt"); returns true when generation is over
function G.end_round(r, out, o, done)
  if o.text then r.text = o.text:take(done) end
  if o.on_round then
    local why = o.on_round(r, out)
    if why and not done then out.stop = type(why) == "string" and why or "callback"; return true end
  end
  return done
end

-- the first token, from the last row of the prefill (with its log-probs when kept)
function G.first_token(s, o)
  local tok = G.last_token(s, o.sampler)
  return tok, o.logprobs and { G.logprob(s, s:out_rows(), tok, o.logprobs) }
end

-- the target's half of a speculative round on a drafted tree: verify, accept, commit (timed
-- into tm). Returns the round's stats entry {tau, size, tokens, ns} (tokens: what is new
-- after the root, the bonus last) and the next bonus; context gets the accepted tokens.
function G.verify_round(s, tree, o, tm, context)
  s:verify(tree)
  tm("verify")
  local acc = s:accept(tree, o.sampler)
  tm("accept")
  local new = {}
  for i = 2, acc.tau do new[#new + 1] = acc.tokens[i] end
  new[#new + 1] = acc.bonus
  local lps
  if o.logprobs then        -- node acc.nodes[i]'s row (1-based: node + 1) chose new[i]
    lps = {}
    for i = 1, acc.tau do lps[i] = G.logprob(s, acc.nodes[i] + 1, new[i], o.logprobs) end
  end
  s:commit(tree)
  tm("commit")
  for _, t in ipairs(acc.tokens) do context[#context + 1] = t end
  return { tau = acc.tau, size = tree.n, tokens = new, logprobs = lps, ns = tm.ns }, acc.bonus
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
  local bonus, lps = G.first_token(s, o)
  tm("prefill")
  local prefill_ns = tm.ns.prefill
  local out, rounds = {}, {}
  local context = {}                                  -- committed tokens, for Lua drafters
  for i, t in ipairs(prompt) do context[i] = t end
  local done = G.push(out, { bonus }, o, lps)
  local tree = kd.tree.new()                          -- one tree, rebuilt every round (its device buffers stay)
  while not done do
    tm = G.timer()
    propose(s, tree, bonus, context, tm)
    local r
    r, bonus = G.verify_round(s, tree, o, tm, context)
    rounds[#rounds + 1] = r
    done = G.end_round(r, out, o, G.push(out, r.tokens, o, r.logprobs))
  end
  tree:close()
  s:close()
  return G.result(out, rounds, prefill_ns, t_start, o)
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

-- the result every policy returns: stop is "n", "eos", "stop" (a stop string), or the reason
-- an on_round callback gave ("interrupt")
function G.result(out, rounds, prefill_ns, t_start, o)
  local stop, logprobs = out.stop or "n", out.logprobs
  out.stop, out.logprobs = nil, nil
  local r = { tokens = out, rounds = rounds, stop = stop, prefill_ns = prefill_ns, logprobs = logprobs,
              total_ns = kd.now_ns() - t_start }
  if o and o.text then o.text:take(true); r.text = o.text:all() end
  return r
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
