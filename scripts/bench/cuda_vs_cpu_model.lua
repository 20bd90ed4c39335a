-- cuda_vs_cpu_model.lua: a diagnostic, not a spec. Runs a golden prompt through a model on the
-- CPU and on CUDA and prints, per prompt row, the CUDA and CPU logits' distance to HF float64
-- (max |diff| / max |golden|) and whether the argmax agrees. With bf16 activations a row can
-- drift when a routing decision sits closer than the bf16 noise (see the golden's stats).
-- usage: luajit scripts/bench/cuda_vs_cpu_model.lua spec/fixtures/golden-tiny-k2.6.json
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local kd = require("kdtree")
local json = require("dkjson")

local path = arg[1] or "spec/fixtures/golden-tiny-k2.6.json"
local g = json.decode(assert(io.open(path)):read("*a"))
print(("golden %s: model %s, %d prompt tokens, stats: min routing gap %s, min greedy margin %s"):format(
  path, g.model_dir, #g.prompt, tostring(g.stats and g.stats.min_routing_gap), tostring(g.stats and g.stats.min_greedy_margin)))

local function rows_of(backend)
  local m = kd.open_model(g.model_dir, { backend = backend })
  local s = m:new_seq(64)
  s:forward(g.prompt)
  local out = {}
  for r = 1, #g.prompt do out[r] = s:logits(r) end
  s:close()
  m:close()
  return out
end

local function dist(a, ref)
  local md, mr = 0, 0
  for i = 1, #ref do
    md = math.max(md, math.abs(a[i] - ref[i]))
    mr = math.max(mr, math.abs(ref[i]))
  end
  return md / mr
end
local function argmax(a)
  local b = 1
  for i = 2, #a do if a[i] > a[b] then b = i end end
  return b - 1
end

local cpu, cuda = rows_of("cpu"), rows_of("cuda")
for r = 1, #g.prompt do
  local ref = g.prompt_logits[r]
  print(("row %2d  cpu %.2e  cuda %.2e  cuda-vs-cpu %.2e  argmax gold %4d cpu %4d cuda %4d"):format(
    r, dist(cpu[r], ref), dist(cuda[r], ref), dist(cuda[r], cpu[r]), argmax(ref), argmax(cpu[r]), argmax(cuda[r])))
end
