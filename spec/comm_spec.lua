-- comm_spec.lua: the CUDA communicator (cuda/comm.cu) through scripts/bench/comm_bench.c --check, built by
-- `make build/bench/comm_bench` from the library's objects. The program's checks (each an "ok:" or
-- "FAIL:" line): the loopback with 2, 4 and 8 ranks sharing device 0, one thread each, every rank
-- bit-identical to a host fp32 left fold of the inputs at three arrival orders (bf16 and f32), its
-- all-gather, a shape mismatch, abort/reset and its refusal inside a graph capture; NCCL with 1 rank
-- (and with every GPU when there are several); NCCL captured in a graph and replayed with new inputs.
-- Needs CUDA and NCCL: #gpu.

local sh = require("spec.helpers.shell")

local function count(text, pattern)
  local n = 0
  for _ in text:gmatch(pattern) do n = n + 1 end
  return n
end

describe("the CUDA communicator #gpu", function()
  it("loopback sums bit-identical to the host fold on every rank; NCCL with 1 rank, eager and in a graph", function()
    local lib = os.getenv("KDTREE_LIB") or "build/libkdtree.so"
    local build = lib:match("^(.*)/[^/]+$") or "build"
    local rc, out = sh("make -s BUILD=" .. build .. " " .. build .. "/bench/comm_bench")
    assert(rc == 0, "building comm_bench failed:\n" .. out)
    local md = os.tmpname()
    rc, out = sh(build .. "/bench/comm_bench --check --md '" .. md .. "'")
    local f = io.open(md)
    local text = f and f:read("*a") or ""
    if f then f:close() end
    os.remove(md)
    assert(rc == 0, "comm_bench --check failed (rc " .. tostring(rc) .. "):\n" .. out)
    assert.is_nil(text:find("FAIL", 1, true), text)
    assert.is_truthy(text:find("Checks failed: 0.", 1, true), text)
    for _, n in ipairs({2, 4, 8}) do
      local function has(pattern)
        assert.are.equal(1, count(text, "\n%- ok: " .. (pattern:gsub("{n}", tostring(n)))), pattern .. " (" .. n .. ")")
      end
      has("loopback all%-reduce, {n} ranks on device 0: 5 shapes [^\n]*bit%-identical to the host fp32 fold\n")
      has("loopback all%-gather, {n} ranks:")
      has("loopback, {n} ranks: ranks that disagree on the shape all fail with KD_ERR_ARG")
      has("loopback, {n} ranks: abort wakes a rank waiting at the barrier with KD_ERR_STATE")
      has("loopback, {n} ranks: inside a graph capture every rank is refused with KD_ERR_UNSUPPORTED")
    end
    assert.are.equal(1, count(text, "\n%- ok: bad input refused with KD_ERR_ARG naming it"))
    assert.are.equal(1, count(text, "\n%- ok: NCCL all%-reduce, 1 rank on device 0: bf16 and f32"))
    assert.are.equal(1, count(text, "\n%- ok: NCCL all%-gather, 1 rank:"))
    assert.are.equal(1, count(text, "\n%- ok: NCCL 1 rank in a CUDA graph: copy %-> all%-reduce %-> all%-gather captured"))
  end)
end)
