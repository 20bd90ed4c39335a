-- policy/dflash.lua: DFlash speculative decoding: per round the drafter's argmax chain of
-- depth bs-1 after the bonus token is verified causally (a chain is a tree with one branch)
-- and the longest matching prefix is accepted, plus the target's bonus token.
local kd = require("kdtree")
local G = require("kdtree.generate")

local P = {}

-- argmax of each row of an L x V log-prob block {data=, L=, V=} (ties: lowest id); NaN or
-- +inf is an error naming the row and column, as the backend's argmax reports it
local function argmax_rows(lp)
  local ids = {}
  for i = 0, lp.L - 1 do
    local base, best, arg = i * lp.V, -math.huge, 0
    for j = 0, lp.V - 1 do
      local v = lp.data[base + j]
      if v ~= v or v == math.huge then
        error(string.format("kdtree: dflash: draft log-prob row %d: logits[%d] is %s: expected finite values (or -inf)",
                            i, j, v ~= v and "NaN" or "+inf"), 0)
      end
      if v > best then best, arg = v, j end
    end
    ids[i + 1] = arg
  end
  return ids
end
P.argmax_rows = argmax_rows

-- opts: drafter (a DFlash drafter, or a Lua drafter), n, sampler, eos, on_round(round, out),
--       budget (nodes of the chain, at most the drafter's depth; default the whole depth): the
--       chain at DDTree's node budget, for a like-for-like comparison
function P.generate(m, prompt, opts)
  local o = G.options(m, prompt, opts)
  local d = o.drafter or error("kdtree: dflash: opts.drafter: expected a drafter", 2)
  local native = getmetatable(d) == kd.Drafter
  local depth = native and d.info.block_size - 1 or d.depth
  if o.budget ~= nil then
    if type(o.budget) ~= "number" or o.budget < 0 or o.budget ~= math.floor(o.budget) then
      error("kdtree: dflash: budget: expected a non-negative integer, got " .. tostring(o.budget), 2)
    end
    depth = math.min(depth, o.budget)
  end
  return G.speculate(m, prompt, o, native, 2 * depth + 4, function(s, tree, bonus, context, tm)
    local chain
    if native then                                  -- the argmax on the backend: bs-1 ids come back
      s:draft(bonus, false)
      tm("draft")
      chain = s:draft_argmax()
    else
      local lp = kd.tree.rows(d:draft(context, bonus))
      tm("draft")
      chain = argmax_rows(lp)
    end
    for i = #chain, depth + 1, -1 do chain[i] = nil end
    tree:set_chain(bonus, chain)
    tm("build")
  end)
end

return P
