-- minicode.lua: the mini-code pair (models/mini-code + models/mini-code-dflash) on its held-out prompts.
-- Run from the repository root (KDTREE_LIB=build/libkdtree.so):
--
--   luajit scripts/bench/minicode.lua tau   [flags]   mean tau by budget for ddtree, the dflash chain and ngram
--   luajit scripts/bench/minicode.lua speed [flags]   decode tokens/s of ar and ddtree at some budgets
--
-- Both print markdown tables (docs/mini-code.md has their output). Flags (defaults in brackets):
--   --model DIR [models/mini-code]   --draft DIR [models/mini-code-dflash]
--   --prompts JSON [spec/fixtures/mini-code/heldout_prompts.json]  (the recipe's 64-token held-out prompts)
--   --count K   first K prompts [tau 4, speed 32]      -n N   tokens generated per prompt [tau 32, speed 128]
--   --budgets LIST [tau 0,1,4,16,32,64,128,256; speed 16,32,64]   --policies LIST [ddtree,dflash,ngram]
--   --temperature T [0.7] (the sampled rows; keyed by --seed S [1])   --backend cpu|cuda [cpu]
--   --modes greedy,sampled [both]
-- Mean tau is pooled: tokens accepted (bonus included) over rounds, over all prompts. Tokens/s is the
-- decode's (prefill excluded): generated tokens after the first over the rounds' time; one prompt is
-- run first and not counted in speed (warm caches; step graphs on the GPU). The ngram drafter drafts depth 15,
-- the DFlash block's. Every speculative run's tokens are compared with ar's (same prompt, same
-- sampler): the tau table ends with a count of the runs that differ (0: every number is of exact
-- decoding), the speed table has a column of the prompts that match.
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local json = require("dkjson")

local function list(s, number)
  local t = {}
  for part in s:gmatch("[^,]+") do t[#t + 1] = number and assert(tonumber(part), "not a number: " .. part) or part end
  return t
end

local mode = arg[1]
if mode ~= "tau" and mode ~= "speed" then
  io.stderr:write("usage: luajit scripts/bench/minicode.lua tau|speed [--flag value ...] (see the header)\n")
  os.exit(2)
end
local o = {}
for i = 2, #arg, 2 do
  local k = arg[i]:match("^%-%-?([%w%-]+)$")
  if not k or arg[i + 1] == nil then io.stderr:write("minicode: bad flag or missing value at '" .. arg[i] .. "'\n"); os.exit(2) end
  o[k] = arg[i + 1]
end
local tau_mode = mode == "tau"
local model_dir = o.model or "models/mini-code"
local draft_dir = o.draft or "models/mini-code-dflash"
local count = tonumber(o.count or (tau_mode and 4 or 32))
local n = tonumber(o.n or (tau_mode and 32 or 128))
local budgets = list(o.budgets or (tau_mode and "0,1,4,16,32,64,128,256" or "16,32,64"), true)
local policies = list(o.policies or "ddtree,dflash,ngram")
local modes = list(o.modes or "greedy,sampled")
local sampler = { temperature = tonumber(o.temperature or 0.7), seed = tonumber(o.seed or 1) }

local f = assert(io.open(o.prompts or "spec/fixtures/mini-code/heldout_prompts.json", "rb"))
local prompts = assert(json.decode(f:read("*a")), "heldout prompts: not JSON").prompts
f:close()
assert(count >= 1 and count <= #prompts, ("--count: expected 1..%d"):format(#prompts))

local m = kd.open_model(model_dir, { backend = o.backend })
local d = kd.open_drafter(draft_dir, m)
local ngram = require("kdtree.drafters.ngram").new({ vocab = m.info.vocab, depth = d.info.block_size - 1 })

-- policy name -> generate options
local function run_opts(name, budget, smp)
  local t = { n = n, eos = false, sampler = smp, budget = budget, policy = name, drafter = d }
  if name == "ngram" then t.policy, t.drafter = "ddtree", ngram end
  if name == "ar" then t.drafter, t.budget = nil, nil end
  return t
end

local ar_tokens = {}   -- [mode][prompt index] = ar's tokens, the reference every run must equal
local function same(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- run one configuration over the prompts: pooled mean tau, decode tokens/s
local function measure(name, budget, mname)
  local smp = mname == "sampled" and sampler or nil
  local opts = run_opts(name, budget, smp)
  if not tau_mode then gen.run(m, prompts[1], opts) end  -- warm-up, not counted
  local tau, rounds, toks, ns, equal = 0, 0, 0, 0, 0
  for i = 1, count do
    local r = gen.run(m, prompts[i], opts)
    ar_tokens[mname] = ar_tokens[mname] or {}
    if name == "ar" then ar_tokens[mname][i] = r.tokens end
    if same(ar_tokens[mname][i], r.tokens) then equal = equal + 1 end
    local s = gen.summary(r)
    for _, rd in ipairs(r.rounds) do tau = tau + rd.tau end
    rounds = rounds + #r.rounds
    toks, ns = toks + s.tokens - 1, ns + s.decode_ns
  end
  return { tau = tau / rounds, tok_s = toks / (ns * 1e-9), equal = equal }
end

local out = io.stdout
out:write(("%s: %s + %s on %s, %d held-out prompts of %d tokens, %d tokens each, sampled = T %.2f seed %d\n\n")
  :format(mode, model_dir, draft_dir, m.info.backend, count, #prompts[1], n, sampler.temperature, sampler.seed))
local ar = {}                                                  -- first: ar's tokens are the reference
for _, mname in ipairs(modes) do ar[mname] = measure("ar", 0, mname) end

if tau_mode then
  local head = { "| drafter | mode |" }
  for _, b in ipairs(budgets) do head[#head + 1] = (" B=%d |"):format(b) end
  out:write(table.concat(head), "\n|---|---|", ("---:|"):rep(#budgets), "\n")
  local differ = 0
  for _, mname in ipairs(modes) do
    for _, name in ipairs(policies) do
      local row = { ("| %s | %s |"):format(name, mname) }
      for _, b in ipairs(budgets) do
        local r = measure(name, b, mname)
        row[#row + 1] = (" %.2f |"):format(r.tau)
        differ = differ + count - r.equal
      end
      out:write(table.concat(row), "\n")
      out:flush()
    end
  end
  out:write(("\nruns whose tokens differ from ar's: %d\n"):format(differ))
else
  out:write("| policy | budget | mode | tokens/s | mean tau | vs ar | tokens == ar |\n|---|---:|---|---:|---:|---:|---:|\n")
  for _, mname in ipairs(modes) do
    out:write(("| ar | - | %s | %.1f | 1.00 | 1.00x | - |\n"):format(mname, ar[mname].tok_s))
    for _, b in ipairs(budgets) do
      local r = measure("ddtree", b, mname)
      out:write(("| ddtree | %d | %s | %.1f | %.2f | %.2fx | %d/%d |\n"):format(b, mname, r.tok_s, r.tau,
        r.tok_s / ar[mname].tok_s, r.equal, count))
      out:flush()
    end
  end
end
d:close()
m:close()
