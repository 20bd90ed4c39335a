-- device_oom_spec: device memory that does not fit is an error that leaves the engine usable.
-- A sequence whose KV cache needs terabytes (capacity 2^31 - 1) fails with KD_ERR_NOMEM naming
-- the allocation; the model's memory report is what it was before (nothing half-allocated is
-- kept), and a sequence that fits then decodes the same tokens as before the failure, three
-- times over. Tagged #gpu (`make test-gpu`, KDTREE_BACKEND=cuda): on the CPU such a request may
-- be granted by the kernel's overcommit and fail later instead.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local err_of = require("helpers.err_of")

local BACKEND = os.getenv("KDTREE_BACKEND") or "cpu"
local PROMPT = { 5, 77, 300, 12, 999 }

describe("device out of memory #gpu", function()
  it("a capacity that does not fit is KD_ERR_NOMEM and the engine stays usable", function()
    local m = kd.open_model("models/tiny-k2.6", { backend = BACKEND })
    local d = kd.open_drafter("models/tiny-k2.6-dflash", m)
    local want = gen.run(m, PROMPT, { policy = "ddtree", drafter = d, budget = 16, n = 16 }).tokens
    local before = m:memory()
    for _ = 1, 3 do
      local e = err_of(m.new_seq, m, 2 ^ 31 - 1)
      assert.matches("(out of memory)", e, 1, true)
      assert.matches("cannot allocate", e, 1, true)
      local now = m:memory()
      for _, k in ipairs({ "kv_cache", "activations", "total", "n_seqs" }) do
        assert.are.equal(before[k], now[k], k .. " after the failed sequence")
      end
      assert.are.same(want, gen.run(m, PROMPT, { policy = "ddtree", drafter = d, budget = 16, n = 16 }).tokens)
    end
    d:close()
    m:close()
  end)
end)
