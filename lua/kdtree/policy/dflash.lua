-- policy/dflash.lua: DFlash speculative decoding: per round the drafter's argmax chain of
-- depth bs-1 after the bonus token is verified causally (a chain is a tree with one branch)
-- and the longest matching prefix is accepted, plus the target's bonus token.
local kd = require("kdtree")
local G = require("kdtree.generate")

local P = {}

-- argmax of each row of an L x V log-prob block {data=, L=, V=} (ties: lowest id)
local function argmax_rows(lp)
  local ids = {}
  for i = 0, lp.L - 1 do
    local base, best, arg = i * lp.V, -math.huge, 0
    for j = 0, lp.V - 1 do
      local v = lp.data[base + j]
      if v > best then best, arg = v, j end
    end
    ids[i + 1] = arg
  end
  return ids
end
P.argmax_rows = argmax_rows

-- opts: drafter (a DFlash drafter, or a Lua drafter), n, sampler, eos, on_round(round, out)
function P.generate(m, prompt, opts)
  local o = G.options(m, prompt, opts)
  local d = o.drafter or error("kdtree: dflash: opts.drafter: expected a drafter", 2)
  local native = getmetatable(d) == kd.Drafter
  local depth = native and d.info.block_size - 1 or d.depth
  local t_start = kd.now_ns()
  local s = m:new_seq(#prompt + o.n + 2 * depth + 4)
  if native then s:attach_drafter(d) end

  local tm = G.timer()
  s:forward(prompt)
  local bonus = G.last_token(s, o.sampler)
  tm("prefill")
  local prefill_ns = tm.ns.prefill
  local out, rounds, context = {}, {}, {}
  for i, t in ipairs(prompt) do context[i] = t end
  local done = G.push(out, { bonus }, o)
  local tree = kd.tree.new()                          -- one tree, reset to a chain every round

  while not done do
    tm = G.timer()
    local lp = native and s:draft(bonus) or kd.tree.rows(d:draft(context, bonus))
    tm("draft")
    tree:set_chain(bonus, argmax_rows(lp))
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
