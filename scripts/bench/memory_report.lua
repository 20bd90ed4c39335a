-- memory_report.lua: device memory by component (kd_model_memory, m:memory()) of a target model
-- and its DFlash drafter with one open sequence, after real decoding (DDTree rounds, then
-- autoregressive steps, so the step graphs and the draft graph exist), as markdown tables.
--
--   luajit scripts/bench/memory_report.lua [--backend cuda|cpu] [--model DIR] [--draft DIR]
--          [--capacity N] [--budget B] [--tokens N] [--md FILE]
--
-- Defaults: cuda, models/tiny-k2.6, models/tiny-k2.6-dflash, capacity 4096, budget 16, 64 tokens.
-- `make bench` runs it on the GPU machine (KDTREE_LIB=build/libkdtree.so). Tables:
--   1. the report after decoding, one row per component: weights by kind, the drafter's weights,
--      the KV cache (checked against capacity x layers x (kv_lora_rank + qk_rope_dim) x dtype
--      size), scratch (per-sequence logits and forward scratch; the backend's shared workspaces),
--      the drafter's per-sequence state (its K/V: the formula given beside it), other, total;
--      the graph counters;
--   2. the phases (model open, drafter open, sequence open, after decoding): the engine's total
--      and the driver's "in use", and what the driver shows that the engine does not tally
--      (the CUDA context, cuBLAS, graph executables, allocator rounding) as it grows.
-- Checks (exit 1 when one fails, after the tables): total = the sum of its parts; the KV cache
-- formula; weights by kind = kd_inspect's bytes by kind (less the INT4 weight_shape tensors).
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local kd = require("kdtree")

local o = { backend = "cuda", model = "models/tiny-k2.6", draft = "models/tiny-k2.6-dflash", capacity = 4096,
            budget = 16, tokens = 64 }
do
  local i = 1
  while i <= #arg do
    local a, v = arg[i], arg[i + 1]
    local key = a:match("^%-%-(%w+)$")
    if key and o[key] ~= nil and v then
      o[key] = type(o[key]) == "number" and assert(tonumber(v), a .. ": expected a number") or v
      i = i + 2
    elseif a == "--md" and v then
      o.md = v
      i = i + 2
    else
      io.stderr:write("memory_report: unknown or incomplete argument '", a, "'\n",
        "usage: luajit scripts/bench/memory_report.lua [--backend cuda|cpu] [--model DIR] [--draft DIR] ",
        "[--capacity N] [--budget B] [--tokens N] [--md FILE]\n")
      os.exit(2)
    end
  end
end

local out = {}
local function md(fmt, ...)
  local line = select("#", ...) > 0 and string.format(fmt, ...) or fmt
  out[#out + 1] = line
  io.stdout:write(line)
  io.stdout:flush()
end
local failed = 0
local function check(ok, what)
  md("- %s: %s\n", ok and "ok" or "FAIL", what)
  if not ok then failed = failed + 1 end
end

local function mib(b) return string.format("%.3f", b / 1048576) end
local function grouped(n)
  local s = string.format("%.0f", n)
  return (s:reverse():gsub("(%d%d%d)", "%1 "):reverse():gsub("^ ", ""))
end
local function used(r) return r.device_total > 0 and r.device_total - r.device_free or 0 end

-- the phases
local phases = {}
local m = kd.open_model(o.model, { backend = o.backend })
phases[#phases + 1] = { "model open", m:memory() }
local d = kd.open_drafter(o.draft, m)
phases[#phases + 1] = { "drafter open", m:memory() }
local s = m:new_seq(o.capacity)
s:attach_drafter(d)
phases[#phases + 1] = { string.format("sequence of capacity %d open (drafter attached)", o.capacity), m:memory() }

-- decoding: a prefill, greedy DDTree rounds until `tokens`, then 8 autoregressive steps
local info = m.info
local V = info.vocab
local prompt = {}
math.randomseed(7)
for i = 1, 64 do prompt[i] = math.random(3, math.min(990, V - 1)) end
local t0 = kd.now_ns()
s:forward(prompt)
local bonus = s:argmax()[#prompt]
local n, rounds, accepted = 0, 0, 0
while n < o.tokens and s:len() + o.budget + 2 + d.info.block_size < o.capacity do
  s:draft(bonus, false)
  local t = kd.tree.build_drafted(s, o.budget)
  s:verify(t)
  local acc = s:accept(t)
  s:commit(t)
  t:close()
  rounds = rounds + 1
  accepted = accepted + acc.tau
  n = n + acc.tau
  bonus = acc.bonus
end
for _ = 1, 8 do
  s:forward({ bonus })
  bonus = s:argmax()[1]
end
local decode_ms = (kd.now_ns() - t0) / 1e6
local r = m:memory()
phases[#phases + 1] = { string.format("after decoding (%d DDTree rounds, 8 steps)", rounds), r }

-- table 1: the report after decoding
md("## Device memory by component (%s, %s + %s)\n\n", r.backend == "cuda" and "CUDA" or "CPU host", o.model, o.draft)
md("One sequence of capacity %d with the drafter attached, after a 64-token prefill, %d greedy DDTree rounds at " ..
   "budget %d (mean tau %.2f) and 8 autoregressive steps (%.0f ms). kd_model_memory (`m:memory()`): bytes held " ..
   "on the %s now.\n\n", o.capacity, rounds, o.budget, rounds > 0 and accepted / rounds or 0, decode_ms,
   r.backend == "cuda" and "device" or "host")
local act = r.backend == "cuda" and 2 or 4
local kv_formula = o.capacity * info.n_layers * (info.kv_lora_rank + info.qk_rope_dim) * act
local di = d.info
local dkv = di.n_layers * 2 * (o.capacity + di.block_size) * di.n_kv_heads * di.head_dim * act
local ROWS = {
  { "weights: attention", "weights_attention" }, { "weights: dense MLP", "weights_dense_mlp" },
  { "weights: shared experts", "weights_shared_experts" }, { "weights: routed experts", "weights_routed_experts" },
  { "weights: router", "weights_router" }, { "weights: embedding", "weights_embed" },
  { "weights: lm_head", "weights_lm_head" }, { "weights: norms", "weights_norms" },
  { "**target weights**", "weights_total" },
  { "drafter weights", "drafter_weights" },
  { "KV cache", "kv_cache", string.format("capacity %d x %d layers x (%d + %d) x %d B = %s", o.capacity,
      info.n_layers, info.kv_lora_rank, info.qk_rope_dim, act, grouped(kv_formula)) },
  { "scratch: per-sequence logits + forward scratch", "activations" },
  { "scratch: backend workspaces (shared)", "workspace" },
  { "drafter per-sequence state (K/V, taps, draft scratch)", "drafter_cache",
    string.format("of which K/V %d layers x 2 x (%d + %d) x %d x %d B = %s", di.n_layers, o.capacity, di.block_size,
      di.n_kv_heads * di.head_dim, act, grouped(dkv)) },
  { "DDTree trees' backend copies", "trees" },
  { "other (RoPE tables, router bias)", "other" },
  { "**total**", "total" },
}
md("| component | bytes | MiB | of total | note |\n|---|---:|---:|---:|---|\n")
for _, row in ipairs(ROWS) do
  local b = r[row[2]]
  md("| %s | %s | %s | %.1f%% | %s |\n", row[1], grouped(b), mib(b), r.total > 0 and 100 * b / r.total or 0,
    row[3] or "")
end
md("| mapped checkpoint files (host, not in total) | %s | %s | | |\n", grouped(r.mapped), mib(r.mapped))
if r.device_total > 0 then
  md("| device in use (driver: all processes, CUDA context, libraries, graphs) | %s | %s | | of %s MiB |\n",
    grouped(used(r)), mib(used(r)), mib(r.device_total))
end
md("| graphs held (step graphs + draft graph) | %d | | | captured %d, launched %d, fell back %d |\n\n", r.graphs,
  r.graph_captures, r.graph_launches, r.graph_fallbacks)

-- table 2: the phases
md("| phase | engine total MiB | driver in use MiB | in use, not tallied by the engine, MiB | its growth MiB |\n" ..
   "|---|---:|---:|---:|---:|\n")
local prev
for _, p in ipairs(phases) do
  local pr = p[2]
  local dev = pr.device_total > 0
  local untallied = used(pr) - pr.total
  md("| %s | %s | %s | %s | %s |\n", p[1], mib(pr.total), dev and mib(used(pr)) or "-", dev and mib(untallied) or "-",
    (prev and dev) and mib(untallied - prev) or "")
  prev = untallied
end
md("\n")

-- checks
local sum = r.weights_total + r.drafter_weights + r.kv_cache + r.activations + r.drafter_cache + r.trees +
  r.workspace + r.other
check(sum == r.total, string.format("total %s = the sum of its parts %s", grouped(r.total), grouped(sum)))
check(r.kv_cache == kv_formula, string.format("KV cache %s = capacity x layers x (r + dr) x %d B = %s",
  grouped(r.kv_cache), act, grouped(kv_formula)))
local ins = kd.inspect(o.model)
local n_moe = info.n_layers - info.first_k_dense
local KINDS = { "attention", "dense_mlp", "shared_experts", "routed_experts", "router", "embed", "lm_head", "norms" }
local bad = {}
for _, k in ipairs(KINDS) do
  local want = ins["bytes_" .. k]
  -- INT4 experts: each expert matrix also has a weight_shape tensor (I64 [2]) no backend holds
  if k == "routed_experts" and info.expert_bits == 4 then want = want - 16 * 3 * info.n_experts * n_moe end
  if want ~= r["weights_" .. k] then bad[#bad + 1] = string.format("%s %s vs %s", k, grouped(r["weights_" .. k]), grouped(want)) end
end
check(#bad == 0, "weights by kind = kd_inspect's bytes by kind" .. (#bad > 0 and (": " .. table.concat(bad, "; ")) or ""))
if r.backend == "cuda" then
  check(r.drafter_weights > 0 and r.drafter_cache >= dkv, "the drafter's weights and per-sequence K/V are tallied")
  check(r.total <= used(r), "what the engine holds fits in what the driver reports in use")
end

s:close()
d:close()
m:close()
md("\nRun: `luajit scripts/bench/memory_report.lua --backend %s --capacity %d`. Checks failed: %d.\n", o.backend,
  o.capacity, failed)
if o.md then
  local f = assert(io.open(o.md, "w"))
  f:write(table.concat(out))
  f:close()
  print("(markdown written to " .. o.md .. ")")
end
os.exit(failed == 0 and 0 or 1)
