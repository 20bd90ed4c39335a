-- policy/ddtree.lua: DDTree speculative decoding. Each round:
--   draft   the drafter proposes per-depth distributions after the bonus token
--   build   best-first tree of `budget` nodes under the bonus (Algorithm 1)
--   verify  one target forward over the whole tree (ancestor-only mask)
--   accept  one target token per node, walk from the root; tau tokens accepted + a new bonus
--   commit  keep the accepted path's KV (and drafter context), advance by tau
-- The drafter is a DFlash drafter (kd.open_drafter) or a Lua drafter with
-- :draft(context, bonus) -> L x V log-prob rows (kdtree.drafters.ngram / oracle).
local kd = require("kdtree")
local G = require("kdtree.generate")

local P = {}

local function is_native(d) return getmetatable(d) == kd.Drafter end

-- opts: drafter (required), budget (default 16), n, sampler, eos, on_round(round, out)
function P.generate(m, prompt, opts)
  local o = G.options(m, prompt, opts)
  local d = o.drafter or error("kdtree: ddtree: opts.drafter: expected a drafter", 2)
  local budget = o.budget or 16
  if type(budget) ~= "number" or budget < 0 then
    error("kdtree: ddtree: budget: expected a non-negative integer, got " .. tostring(budget), 2)
  end
  local native = is_native(d)
  local t_start = kd.now_ns()
  local s = m:new_seq(#prompt + o.n + budget + 2 + (native and d.info.block_size or 0))
  if native then s:attach_drafter(d) end

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
    if native then
      s:draft(bonus, false)                           -- log-probs stay on the backend
      tm("draft")
      tree:build_drafted(s, budget)
    else
      local rows = d:draft(context, bonus)
      tm("draft")
      tree:build(rows, budget, { logprobs = true, root = bonus })
    end
    tm("build")
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

return P
