#!/usr/bin/env luajit
-- adaptive_budget.lua: a DDTree policy whose node budget follows the acceptance rate.
-- Deep acceptance (tau near the depth limit) means the drafter is right: spend more nodes.
-- Shallow acceptance means the verify pass is mostly wasted: spend fewer.
--   luajit scripts/examples/adaptive_budget.lua [MODEL_DIR] [DRAFT_DIR]
-- (docs/tutorial-decode-script.md builds this file step by step)
local root = (arg[0]:match("^(.*)/scripts/examples/[^/]*$") or ".")
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local kd = require("kdtree")

-- the policy (27 lines)
local function adaptive_ddtree(m, d, prompt, n, opts)
  opts = opts or {}
  local budget, lo, hi = opts.budget or 8, opts.min_budget or 2, opts.max_budget or 64
  local L = d.info.block_size - 1
  local s = m:new_seq(#prompt + n + hi + d.info.block_size + 2)
  s:attach_drafter(d)                     -- the prompt's features become drafter context
  s:forward(prompt)
  local ids = s:argmax()
  local out, budgets = { ids[#ids] }, {}
  while #out < n do
    s:draft(out[#out], false)             -- draft after the bonus (the last token out)
    local tree = kd.tree.build_drafted(s, budget)
    s:verify(tree)
    local acc = s:accept(tree)            -- greedy; pass a sampler table to sample
    s:commit(tree)
    tree:close()
    for i = 2, acc.tau do out[#out + 1] = acc.tokens[i] end
    out[#out + 1] = acc.bonus
    budgets[#budgets + 1] = string.format("%d:%d", budget, acc.tau)
    -- the adaptive part: double on deep acceptance, halve on shallow
    if acc.tau > L / 2 then budget = math.min(hi, budget * 2)
    elseif acc.tau <= 2 then budget = math.max(lo, math.floor(budget / 2)) end
  end
  while #out > n do out[#out] = nil end   -- the last round may overshoot n
  s:close()
  return out, budgets
end

-- run it on the shipped tiny models and check it against autoregressive decoding
local model_dir = arg[1] or root .. "/models/tiny-k2.6"
local draft_dir = arg[2] or root .. "/models/tiny-k2.6-dflash"
local m = kd.open_model(model_dir)
local d = kd.open_drafter(draft_dir, m)
local prompt, n = { 5, 77, 300 }, 32
local out, budgets = adaptive_ddtree(m, d, prompt, n)
local ar = require("kdtree.generate").run(m, prompt, { policy = "ar", n = n, eos = false }).tokens
print("tokens        " .. table.concat(out, " "))
print("budget:tau    " .. table.concat(budgets, " "))
local same = table.concat(out, " ") == table.concat(ar, " ")
print(same and "matches ar    yes" or ("DIFFERS from ar: " .. table.concat(ar, " ")))
d:close(); m:close()
os.exit(same and 0 or 1)
