-- progress_spec: the weight-load bar (kdtree.progress). Its text and throttling with a fake clock
-- and a fake writer; then `kdtree generate` end to end: on a terminal's stderr the bar ends in its
-- final state (all bytes, 100%) and a newline; with stderr piped nothing of it is written.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local P = require("kdtree.progress")
local Terminal = require("helpers.terminal")

local LIB = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""

local function fake(tp)
  local now, out = 0, {}
  local bar = P.new({ tp = tp, clock = function() return now end, write = function(s) out[#out + 1] = s end })
  return bar, function(t) now = t end, out
end

describe("kdtree.progress", function()
  it("writes human sizes and rates", function()
    assert.are.equal("512 B", P.human(512))
    assert.are.equal("1.5 KiB", P.human(1536))
    assert.are.equal("2.0 GiB", P.human(2 * 1024 ^ 3))
    assert.are.equal("850 MB/s", P.rate(850e6))
    assert.are.equal("1.23 GB/s", P.rate(1.234e9))
  end)

  it("redraws at most every 0.1 s and ends with its final state and a newline", function()
    local bar, at, out = fake(1)
    at(0.05); bar.update(0, 100e6, 400e6)       -- first call draws
    at(0.10); bar.update(0, 200e6, 400e6)       -- 0.05 s later: throttled
    assert.are.equal(1, #out)
    assert.are.equal("\r\27[Kloading weights: 95.4 MiB / 381.5 MiB  25% 2.00 GB/s", out[1])
    at(0.16); bar.update(0, 300e6, 400e6)       -- 0.11 s after the first draw
    assert.are.equal(2, #out)
    at(0.20); bar.update(0, 400e6, 400e6)
    bar.finish(true)
    assert.are.equal("\r\27[Kloading weights: 381.5 MiB / 381.5 MiB 100% 2.00 GB/s", out[3])
    assert.are.equal("\n", out[4])
  end)

  it("with tp > 1 shows rank 0's part and the finished ranks, then their sum", function()
    local bar, at, out = fake(2)
    at(1); bar.update(0, 50e6, 100e6)
    assert.are.equal("\r\27[Kloading weights: 47.7 MiB / 95.4 MiB  50% 50 MB/s, ranks 0/2 done", out[1])
    at(1.5); bar.update(1, 100e6, 100e6)
    at(2); bar.update(0, 100e6, 100e6)
    bar.finish(true)
    assert.are.equal("\r\27[Kloading weights: 190.7 MiB / 190.7 MiB 100% 100 MB/s, ranks 2/2 done", out[#out - 1])
  end)

  it("clears its line when the load fails, and writes nothing if it never drew", function()
    local bar, at, out = fake(1)
    bar.finish(false)
    assert.are.equal(0, #out)
    at(1); bar.update(0, 1, 2)
    bar.finish(false)
    assert.are.equal("\r\27[K", out[#out])
  end)
end)

describe("kdtree generate's load bar", function()
  local GEN = "luajit scripts/kdtree generate --prompt-ids 5,77 -n 2"
  it("is drawn on a terminal's stderr and ends at 100% with a newline", function()
    local stdout = os.tmpname()
    local code, _, raw = Terminal.run(GEN .. " > " .. stdout, {}, "TERM=xterm " .. LIB)
    os.remove(stdout)
    assert.are.equal(0, code)
    local last = raw:match(".*\r\27%[K(loading weights: [^\r\n]*)\r?\n")
    assert.is_truthy(last, raw)
    local done, total = last:match("loading weights: (%S+ %S+) / (%S+ %S+) 100%% %d")
    assert.is_truthy(done, last)
    assert.are.equal(done, total)
  end)

  it("writes nothing of it when stderr is not a terminal", function()
    local p = io.popen(LIB .. GEN .. " 2>&1 >/dev/null")
    local err = p:read("*a")
    p:close()
    assert.are.equal("", err)   -- (the summary line too is for a terminal only)
  end)
end)
