-- soak.lua: 10,000 DDTree rounds (greedy and sampled, alternating) on one model + drafter,
-- through generations of N tokens on fresh sequences, printing the host's RSS and the device
-- memory in use every 1,000 rounds; both must stay flat after the first block (a leak per
-- round or per sequence would grow them). Exits 1 when host RSS grows by more than --rss-mb
-- (default 8) or the device's used memory by more than --dev-mb (default 0: the engine's
-- allocations are all freed; the driver's pool does not grow) from the first report to the last.
--
--   KDTREE_LIB=build/libkdtree.so luajit scripts/bench/soak.lua [--backend cuda|cpu] [--rounds 10000]
--          [--model DIR] [--draft DIR] [--budget 16] [--tokens 64] [--rss-mb 8] [--dev-mb 0]
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")

local o = { backend = "cuda", rounds = 10000, model = "models/tiny-k2.6", draft = "models/tiny-k2.6-dflash",
            budget = 16, tokens = 64, ["rss-mb"] = 8, ["dev-mb"] = 0 }
for i = 1, #arg, 2 do
  local key = arg[i]:match("^%-%-([%w-]+)$")
  if not key or o[key] == nil or arg[i + 1] == nil then error("soak.lua: unknown or incomplete flag " .. arg[i]) end
  o[key] = type(o[key]) == "number" and tonumber(arg[i + 1]) or arg[i + 1]
end

local function rss_kb()
  local f = assert(io.open("/proc/self/status"))
  local kb = tonumber(f:read("*a"):match("VmRSS:%s*(%d+)"))
  f:close()
  return kb
end

local m = kd.open_model(o.model, { backend = o.backend })
local d = kd.open_drafter(o.draft, m)
local PROMPT = { 5, 77, 300, 12, 999, 77, 300 }
local rounds, gens, next_report, first, last = 0, 0, 0, nil, nil
print(string.format("%8s %6s %10s %12s %12s %10s", "rounds", "gens", "rss_MB", "dev_used_MB", "engine_MB", "s"))
local t0 = kd.now_ns()
while rounds < o.rounds do
  local sampler = gens % 2 == 1 and { temperature = 0.8, top_p = 0.95, seed = gens } or nil
  local res = gen.run(m, PROMPT, { policy = "ddtree", drafter = d, budget = o.budget, n = o.tokens, sampler = sampler })
  rounds = rounds + #res.rounds
  gens = gens + 1
  if rounds >= next_report or rounds >= o.rounds then
    collectgarbage()
    local mem = m:memory()
    local r = { rss = rss_kb() / 1024, dev = (mem.device_total - mem.device_free) / 2 ^ 20, engine = mem.total / 2 ^ 20 }
    print(string.format("%8d %6d %10.1f %12.1f %12.2f %10.1f", rounds, gens, r.rss, r.dev, r.engine,
                        (kd.now_ns() - t0) * 1e-9))
    first = first or r
    last = r
    next_report = next_report + 1000
  end
end
d:close()
m:close()
local grow_rss, grow_dev = last.rss - first.rss, last.dev - first.dev
print(string.format("growth from the first report to the last: host RSS %+.1f MB, device used %+.1f MB, engine %+.2f MB",
                    grow_rss, grow_dev, last.engine - first.engine))
if grow_rss > o["rss-mb"] or grow_dev > o["dev-mb"] or last.engine ~= first.engine then
  print("FAIL: memory grew")
  os.exit(1)
end
print("ok: flat")
