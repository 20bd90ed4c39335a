-- model_slice_bench_spec.lua: the model-slice bench's construction path (scripts/bench/model_slice_bench.c)
-- at the tiny model's dims: the program is compiled against the library under test, builds a random
-- model in memory through the backend's weight_load (INT4 experts included), decodes 10 steps feeding
-- back the argmax (every logit finite), verifies a 17-node tree and checks three of its rows against
-- the same paths prefilled causally (bit-identical: the engine's batch invariance), counts the routed
-- experts of each step (exactly top-k for one token, top-k..min(n, T*top-k) for T tokens), times decode
-- and verify rows, times the DFlash draft pass of a random drafter it writes as a checkpoint
-- (slice_draft.c) and writes the markdown tables `make bench` produces at K2.6 dims.
-- The CPU case runs in CI; the #gpu case runs the same program on the CUDA backend. The same for
-- --k26-rank 2 (the TP projection's mode) at tiny dims: plan first, rank-0 dims built and equal
-- to the plan's weights, the checks, and the projection table's arithmetic.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path

local sh = require("helpers.shell")

local function abs_lib()
  local lib = os.getenv("KDTREE_LIB") or "build/libkdtree.so"
  local rc, out = sh("realpath '" .. lib .. "'")
  assert(rc == 0, "cannot find the library " .. lib .. ": " .. out)
  return (out:gsub("%s+$", ""))
end

-- compile the bench (plain C: host clock between syncs) against the objects of the library under
-- test (the bench reaches inside the engine; the shared library exports only kdtree.h)
local function build()
  local dir = abs_lib():match("^(.*)/[^/]+$")
  local exe = os.tmpname()
  local rc, out = sh(string.format(
    "cc -O2 -std=c11 -D_GNU_SOURCE -Wall -Icore scripts/bench/model_slice_bench.c '%s/libkdtree_internal.a' " ..
    "$(cat '%s/engine.flags') -lm -o '%s'", dir, dir, exe))
  assert(rc == 0, "compiling scripts/bench/model_slice_bench.c failed:\n" .. out)
  return exe
end

-- build the bench and run it on a backend: (exit status, its output, the markdown it wrote)
local function run(backend, extra)
  local exe, md = build(), os.tmpname()
  local rc, out = sh(string.format("'%s' --tiny --backend %s --steps 3 --md '%s' %s", exe, backend, md, extra or ""))
  os.remove(exe)
  local f = io.open(md)
  local text = f and f:read("*a") or ""
  if f then f:close() end
  os.remove(md)
  return rc, out, text
end

-- the draft pass rows (slice_draft.c): a random drafter at models/tiny-k2.6-dflash's dims, written
-- as a checkpoint of exactly the shipped one's tensor bytes, timed with graphs off and `second`
-- (eager on the CPU, which has no graphs; captured on CUDA) at ctx 64 and 300, the same log-probs
-- bits in both modes, and the bytes read a pass computed here from the dims (2 layers, hidden 128,
-- q 4 x 32, kv 2 x 32, intermediate 256, block 8, vocab 1024)
local function check_draft_rows(md, second)
  assert.is_truthy(md:find("### The draft pass (DFlash), tiny (models/tiny-k2.6-dflash dims)", 1, true), md)
  local f = assert(io.open("models/tiny-k2.6-dflash/model.safetensors", "rb"))
  local size = f:seek("end")
  f:seek("set", 0)
  local b = { f:read(8):byte(1, 8) }
  f:close()
  local hlen = 0
  for i = 8, 1, -1 do hlen = hlen * 256 + b[i] end
  assert.is_truthy(md:find(string.format("random bf16 weights (%.3f MB)", (size - 8 - hlen) / 1e6), 1, true), md)
  local D, q, kv, inter, hd, V = 128, 128, 64, 256, 32, 1024
  local layer = 2 * (D * q * 2 + D * kv * 2 + 3 * D * inter + 2 * D + 2 * hd)
  local rows = 0
  for ctx, mode, mb, roof, ms in md:gmatch("\n| (%d+) | (%a+) | ([%d.]+) MB | ([%d.]+) | %*%*([%d.]+)%*%* |") do
    rows = rows + 1
    ctx = tonumber(ctx)
    local bytes = 2 * (layer + 2 * 2 * kv * (ctx + 8)) + 2 * D + 2 * V * D
    assert.are.equal(string.format("%.3f", bytes / 1e6), mb, "ctx " .. ctx)
    assert.is_true(mode == "off" or mode == second, mode)
    assert.is_true(tonumber(roof) > 0 and tonumber(ms) > 0)
  end
  assert.are.equal(4, rows, md)
  assert.is_truthy(md:find("- ok: the draft pass's log-probs with graphs off and " .. second
    .. ", bit for bit at every context", 1, true), md)
  -- one profiled pass at ctx 64: the backend calls it makes (2 layers' projections, attention, MLP)
  local at = md:find("#### Where a draft pass's time goes", 1, true)
  assert.is_truthy(at, md)
  local ops = tonumber(md:sub(at):match("\n| 64 | (%d+) | [%d.]+ |"))
  assert.is_true(ops ~= nil and ops >= 2 * 5, md)
end

local function check_output(second, rc, out, md)
  assert(rc == 0, "model_slice_bench failed (rc " .. tostring(rc) .. "):\n" .. out)
  assert.is_truthy(md:find("## Decode step, K2.6-dims slice", 1, true), "markdown header missing")
  assert.is_truthy(md:find("Checks failed: 0.", 1, true))
  assert.is_nil(md:find("FAIL", 1, true))
  -- 10 decode steps with finite logits
  assert.is_truthy(md:find("10 decode steps after 40 random latent rows, argmax fed back: all 1024 logits finite", 1, true))
  -- three tree rows bit-identical to their causal paths
  local n_ok = 0
  for _ in md:gmatch("%- ok: tree node %d+ %(depth %d+%) of a 17%-node verify vs its path prefilled causally " ..
                     "at context 40: bit%-identical") do n_ok = n_ok + 1 end
  assert.are.equal(3, n_ok)
  -- the roofline table: 2 contexts x (decode + 3 budgets), every time positive, decode reads top-4 per layer
  local rows = 0
  for step, ctx, T, ex, roof, ms in md:gmatch(
      "\n| ([%w =]+) | (%d+) | (%d+) | ([%d/]+) | [%d.]+ [MG]B | [%d.]+ [MG]B | ([%d.]+) | %*%*([%d.]+)%*%* |") do
    rows = rows + 1
    ctx, T, roof, ms = tonumber(ctx), tonumber(T), tonumber(roof), tonumber(ms)
    assert.is_true(ctx == 64 or ctx == 300)
    assert.is_true(roof > 0 and ms > 0, "row " .. step .. ": times must be positive")
    local counts = {}
    for n in ex:gmatch("%d+") do counts[#counts + 1] = tonumber(n) end
    assert.are.equal(3, #counts)             -- three MoE layers
    for _, n in ipairs(counts) do
      if step == "decode" then
        assert.are.equal(1, T)
        assert.are.equal(4, n)
      else
        assert.is_true(n >= 4 and n <= math.min(16, 4 * T), "experts " .. n .. " for T = " .. T)
      end
    end
  end
  assert.are.equal(8, rows)
  -- the profile table and the MLA rows (2 head counts x 2 query counts x 2 contexts)
  assert.is_truthy(md:find("### Where a step's time goes", 1, true))
  local mla = 0
  for _ in md:gmatch("\n| %d+ | %d+ | %d+ | [%d.]+ | [%d.]+ | [%d.]+%% | [%d.]+ |") do mla = mla + 1 end
  assert.are.equal(8, mla)
  check_draft_rows(md, second)
end

describe("model slice bench: random model in memory, tiny dims, CPU", function()
  it("builds, decodes with finite logits, tree rows equal causal rows, writes the tables", function()
    check_output("eager", run("cpu"))
  end)
end)

describe("model slice bench: random model in memory, tiny dims, CUDA #gpu", function()
  it("builds (INT4 experts through the W4A16 repack), decodes, tree rows bit-identical, writes the tables", function()
    check_output("captured", run("cuda"))
  end)
end)

-- --k26-rank N: the TP-N projection's program (rank-0 dims of every layer, plan first, step-graph
-- rows, the projection table); at tiny dims on the CPU there is no NCCL and no CUDA events, so the
-- all-reduce columns stay empty and the estimate column is filled
local function check_projection(rc, out, md, tp)
  assert(rc == 0, "model_slice_bench --k26-rank failed (rc " .. tostring(rc) .. "):\n" .. out)
  assert.is_truthy(md:find("## TP projection", 1, true), md)
  assert.is_truthy(md:find("Checks failed: 0.", 1, true), md)
  assert.is_nil(md:find("FAIL", 1, true), md)
  -- the plan before building, and the built weights equal to it
  assert.is_truthy(md:find("each of " .. tp .. " ranks needs", 1, true), md)
  assert.is_truthy(md:find("%- ok: weights built (%d+) bytes %(kd_model_memory%), the plan's rank %1 bytes"), md)
  assert.is_truthy(md:find("2 of 4 heads, lm_head 512 of 1024 vocab rows", 1, true), md)
  assert.is_truthy(md:find("### PROJECTION: " .. tp .. " GPUs in tensor parallel", 1, true))
  -- a rank's share of the drafter (its heads, KV heads and MLP part; its lm_head rows): the draft rows
  assert.is_truthy(md:find("### The draft pass (DFlash), tiny (models/tiny-k2.6-dflash dims), rank dims of TP-" .. tp, 1,
    true), md)
  local rows = 0
  for step, ctx, T, ms, est in md:gmatch("\n| ([%w =]+) | (%d+) | (%d+) | ([%d.]+) | %d+ | %d+/%d+ | [^|]+ | [^|]+ | [^|]+ | ([%d.]+) %a+/s |") do
    rows = rows + 1
    ctx, T, ms, est = tonumber(ctx), tonumber(T), tonumber(ms), tonumber(est)
    assert.is_true(ctx == 64 or ctx == 300)
    assert.is_true(ms > 0)
    -- 1 / (step + 8 all-reduces (4 layers) at the estimate): 8 us up to 8 tokens, else 17 us
    local ar = (T <= 8 and 8 or 17) * 8 * 1e-3
    -- ms is printed to 3 decimals: its rounding (up to 0.0005 ms) moves 1e3 / ms by est * 0.0005 / ms
    assert.is_true(math.abs(est - 1e3 / (ms + ar)) <= 0.05 + est * (1e-3 + 0.0005 / ms), step .. ": " .. est)
  end
  assert.are.equal(6, rows, md)
  -- where a rank step's time goes: decode and verify B = 16 profiled op by op, the same op
  -- sequence (T aside), at least the 4 layers' projections
  local at = md:find("### Where a rank step's time goes", 1, true)
  assert.is_truthy(at, md)
  local prof = md:sub(at)
  local dec = tonumber(prof:match("\n| decode | 64 | (%d+) | [%d.]+ |"))
  local ver = tonumber(prof:match("\n| verify B=16 | 64 | (%d+) | [%d.]+ |"))
  assert.is_truthy(dec and ver, md)
  assert.are.equal(dec, ver, md)
  assert.is_true(dec >= 4 * 5, md)
end

describe("model slice bench --k26-rank: the TP projection's program, tiny dims, CPU", function()
  it("plans, builds rank-0 dims, checks, times decode and verify, prints the projection", function()
    local rc, out, md = run("cpu", "--k26-rank 2")
    check_projection(rc, out, md, 2)
  end)
end)

describe("model slice bench --k26-rank: the TP projection's program, tiny dims, CUDA #gpu", function()
  it("plans, builds rank-0 dims (INT4 experts of width 32), checks bit-identical rows, times under step graphs", function()
    local rc, out, md = run("cuda", "--k26-rank 2")
    check_projection(rc, out, md, 2)
    -- every timed step after the two warm-up steps replayed a captured graph
    for n, r in md:gmatch("\n| [%w =]+ | %d+ | %d+ | [%d.]+ | (%d+) | (%d+)/%d+ |") do assert.are.equal(n, r) end
  end)
end)
