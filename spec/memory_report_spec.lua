-- memory_report_spec.lua: scripts/bench/memory_report.lua (the memory-by-component tables `make
-- bench` prints). The script decodes for real (DDTree rounds with the native drafter, then
-- autoregressive steps) and checks itself: total = sum of parts, the KV cache formula, weights by
-- kind = kd_inspect's bytes by kind (exit 1 on a failed check). Here: it runs and passes its checks,
-- its table rows are the ones asked for, and (GPU) the step graphs and the draft graph are held
-- while the sequence is open and nothing fell back.
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path

local function run(args)
  local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
  local p = io.popen(env .. "luajit scripts/bench/memory_report.lua " .. args .. " 2>&1; echo \"__rc=$?\"")
  local out = p:read("*a")
  p:close()
  return tonumber(out:match("__rc=(%d+)%s*$")), out
end

local ROWS = { "weights: attention", "weights: routed experts", "**target weights**", "drafter weights", "KV cache",
  "scratch: per-sequence logits + forward scratch", "scratch: backend workspaces (shared)",
  "drafter per-sequence state", "**total**", "graphs held" }

local function row_bytes(out, name)
  local v = out:match("\n| " .. name:gsub("[%*%(%)%+%-%.%[%]]", "%%%0") .. "[^|]* | ([%d ]+) |")
  return v and tonumber((v:gsub(" ", "")), 10)
end

describe("scripts/bench/memory_report.lua", function()
  it("prints the tables and passes its checks (CPU)", function()
    local rc, out = run("--backend cpu --capacity 512 --tokens 16")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("Checks failed: 0.", 1, true), out)
    for _, r in ipairs(ROWS) do assert.truthy(out:find("\n| " .. r, 1, true), r) end
    assert.are.equal(512 * 4 * (32 + 8) * 4, row_bytes(out, "KV cache"))
    assert.truthy(out:find("| after decoding (", 1, true))
  end)

  it("a bad argument is an error, not a report", function()
    local rc, out = run("--capacity")
    assert.are.equal(2, rc)
    assert.truthy(out:find("unknown or incomplete argument", 1, true))
  end)
end)

describe("scripts/bench/memory_report.lua on the GPU #gpu", function()
  it("device memory at capacity 4096: drafter tallied, graphs held, checks pass", function()
    local rc, out = run("--backend cuda --capacity 4096")
    print(out)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("Checks failed: 0.", 1, true))
    assert.are.equal(4096 * 4 * (32 + 8) * 2, row_bytes(out, "KV cache"))
    assert.is_true(row_bytes(out, "drafter weights") > 0)
    assert.is_true(row_bytes(out, "drafter per-sequence state") >= 2 * 2 * (4096 + 8) * 64 * 2)
    -- held while the sequence is open: the verify step (one tree size), the decode step, the draft pass
    local held, cap, lau, fb = out:match("| graphs held %(step graphs %+ draft graph%) | (%d+) | | | captured (%d+), " ..
      "launched (%d+), fell back (%d+) |")
    assert.truthy(held, "graph row")
    assert.is_true(tonumber(held) >= 3, "graphs held: " .. held)
    assert.are.equal("0", fb)
    assert.is_true(tonumber(lau) > tonumber(cap))
  end)
end)
