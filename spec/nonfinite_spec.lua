-- nonfinite_spec: a NaN in the logits is an error naming where it appeared (the op, the row
-- or tree node, the column), on every path that turns logits into tokens: greedy argmax
-- (kd_seq_argmax, the AR policy, the CLI), the greedy and the sampled DDTree accept, the
-- sampler, the drafter's argmax and the trees built from its log-probs (on the backend and on
-- the host). The fixture is made here the real way: a temp copy of the
-- tiny K2.6 checkpoint whose lm_head row 3 holds one NaN (bf16 0x7FC0) in its safetensors
-- data, so every logits row has NaN at column 3. Runs on the backend the suite runs on
-- (KDTREE_BACKEND: CPU in `make test`, CUDA in `make test-gpu`). After each error the
-- sequence and the engine stay usable.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local ck = require("helpers.checkpoint")
local err_of = require("helpers.err_of")
local ffi = require("ffi")

local LM_HEAD = "language_model.lm_head.weight"
local PROMPT = { 5, 77, 300 }

-- a copy of K26 with lm_head[row][col] = bf16 `bits`
local function poisoned(row, col, bits)
  local dir = ck.copy(ck.K26)
  local path = ck.shard_of(dir, LM_HEAD)
  ck.edit_st(path, function(h, st)
    local t = h[LM_HEAD]
    assert.are.equal("BF16", t.dtype)
    local at = t.data_offsets[1] + (row * t.shape[2] + col) * 2     -- 0-based byte in the data section
    local b = ffi.new("uint16_t[1]", bits)
    return st.data:sub(1, at) .. ffi.string(b, 2) .. st.data:sub(at + 3)
  end)
  return dir
end

local function matches_all(err, ...)
  for _, needle in ipairs({ ... }) do
    assert(err:find(needle, 1, true), string.format("error message lacks %q:\n  %s", needle, err))
  end
end

describe("NaN in the logits (lm_head row 3 holds a NaN)", function()
  local dir, m
  setup(function()
    dir = poisoned(3, 0, 0x7FC0)
    m = kd.open_model(dir)
  end)
  teardown(function()
    if m then m:close() end
    ck.cleanup()
  end)

  it("greedy argmax names the output row and column, and the sequence stays usable", function()
    local s = m:new_seq(32)
    s:forward(PROMPT)
    matches_all(err_of(s.argmax, s), "kd_seq_argmax: the target forward's output row 0",
                "argmax: logits[3] is NaN")
    -- the logits themselves are readable and hold the NaN where the message says
    local row = s:logits(1)
    assert.is_true(row[4] ~= row[4])
    s:truncate(0)
    s:forward(PROMPT)
    assert.are.equal(3, s:len())
    s:close()
  end)

  it("the AR policy (greedy and sampled) fails instead of printing tokens", function()
    matches_all(err_of(gen.run, m, PROMPT, { policy = "ar", n = 4 }), "logits[3] is NaN")
    matches_all(err_of(gen.run, m, PROMPT, { policy = "ar", n = 4, sampler = { temperature = 0.7, seed = 1 } }),
                "sample: logits[3] is NaN")
  end)

  it("greedy and sampled DDTree accept name the tree node", function()
    local s = m:new_seq(32)
    s:forward(PROMPT)
    local tree = kd.tree.chain(7, { 8, 9 })
    s:verify(tree)
    -- node 0 produces the token at position 4 (3 cached tokens, depth 0, + 1)
    matches_all(err_of(s.accept, s, tree), "kd_accept", "node 0", "position 4", "argmax: logits[3] is NaN")
    matches_all(err_of(s.accept, s, tree, { temperature = 0.8, seed = 3 }), "kd_accept: node 0 (position 4)",
                "logits[3] is NaN")
    s:truncate(3)                     -- ends the round: the sequence takes a new forward
    s:forward({ 7 })
    assert.are.equal(4, s:len())
    s:close()
  end)

  it("the drafter's argmax and the DDTree and DFlash policies fail with a NaN message", function()
    local d = kd.open_drafter("models/tiny-k2.6-dflash", m)
    local s = m:new_seq(64)
    s:attach_drafter(d)
    s:forward(PROMPT)
    s:draft(7, false)
    matches_all(err_of(s.draft_argmax, s), "kd_draft_argmax: the drafter forward's log-prob row 0", "is NaN")
    -- the tree built on the backend from those log-probs: accept names the depth and rank
    local tree = kd.tree.new()
    tree:build_drafted(s, 16)
    s:verify(tree)
    matches_all(err_of(s.accept, s, tree), "kd_accept", "draft log-prob that is NaN (depth 1 rank 0)")
    -- a tree built on the host from the downloaded log-probs (a Lua drafter's path)
    s:truncate(3)
    matches_all(err_of(kd.tree.build, s:draft(7), 16, { logprobs = true }), "kd_tree_build: logprobs[0][0] is NaN")
    s:close()
    for _, policy in ipairs({ "ddtree", "dflash" }) do
      local e = err_of(gen.run, m, PROMPT, { policy = policy, drafter = d, n = 6, budget = 8 })
      assert(e:find("NaN", 1, true), policy .. ": " .. e)
    end
    d:close()
  end)

  it("the CLI exits 1 with the engine's message instead of printing ids", function()
    local err = os.tmpname()
    local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
    local p = io.popen(string.format("%sluajit scripts/kdtree generate --model '%s' --prompt-ids 5,77,300 -n 4 --ids "
                                     .. "2>%s; echo \"rc=$?\"", env, dir, err))
    local out = p:read("*a")
    p:close()
    local msg = ck.read(err)
    os.remove(err)
    assert.truthy(out:find("rc=1", 1, true), out)
    assert.is_nil(out:match("%d+ %d+ %d+"), "no ids printed: " .. out)
    matches_all(msg, "logits[3] is NaN")
  end)
end)

describe("NaN in the second rank's shard of the vocabulary (tp 2)", function()
  teardown(function() ck.cleanup() end)
  it("greedy and sampled name the vocabulary's column, as with one rank", function()
    local dir = poisoned(700, 0, 0x7FC0)              -- vocab 1024: rank 1 holds ids 512..1023
    for _, tp in ipairs({ 1, 2 }) do
      -- on CUDA both ranks share device 0 (the loopback): the suite's GPU machine may have one
      local devices = os.getenv("KDTREE_BACKEND") == "cuda" and tp == 2 and { 0, 0 } or nil
      local m = kd.open_model(dir, { tp = tp, devices = devices })
      local s = m:new_seq(16)
      s:forward(PROMPT)
      matches_all(err_of(s.argmax, s), "kd_seq_argmax: the target forward's output row 0",
                  "argmax: logits[700] is NaN")
      matches_all(err_of(s.sample, s, { temperature = 0.9, seed = 5 }), "logits[700] is NaN")
      s:close()
      m:close()
    end
  end)
end)

describe("+inf in the logits", function()
  it("the argmax op reports the first NaN / +inf column of a row as its code; -inf is a logit like any", function()
    local B = require("helpers.backend")
    local be = B.create("cpu")   -- the CUDA op is compared with this one in cuda_ops_spec
    local x = ffi.new("float[12]", { 1, -math.huge, 3, 2,   1, 0 / 0, math.huge, 5,   -math.huge, 1 / 0, 0 / 0, 9 })
    local ids = ffi.new("int32_t[3]")
    assert.are.equal(0, be.ops.argmax(be, B.act(x, 3, 4), ids))
    -- codes (core/sample_rule.h): kind | column << 2 with kind 1 NaN, 2 +inf
    assert.are.same({ 2, -(1 + 1 * 4), -(2 + 1 * 4) }, { ids[0], ids[1], ids[2] })
  end)
end)
