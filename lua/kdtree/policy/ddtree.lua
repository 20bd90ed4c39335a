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

-- opts: drafter (required), budget (default 16), n, sampler, eos, on_round(round, out)
function P.generate(m, prompt, opts)
  local o = G.options(m, prompt, opts)
  local d = o.drafter or error("kdtree: ddtree: opts.drafter: expected a drafter", 2)
  local budget = o.budget or 16
  if type(budget) ~= "number" or budget < 0 then
    error("kdtree: ddtree: budget: expected a non-negative integer, got " .. tostring(budget), 2)
  end
  local native = getmetatable(d) == kd.Drafter
  return G.speculate(m, prompt, o, native, budget + 2 + (native and d.info.block_size or 0),
    function(s, tree, bonus, context, tm)
      if native then
        s:draft(bonus, false)                         -- log-probs stay on the backend
        tm("draft")
        tree:build_drafted(s, budget)
      else
        local rows = d:draft(context, bonus)
        tm("draft")
        tree:build(rows, budget, { logprobs = true, root = bonus })
      end
      tm("build")
    end)
end

return P
