-- batch_invariance_spec.lua: on the CUDA backend a token's logits are bit-identical whether
-- it is computed alone (decode), inside a prefill (any chunking), or as a node of a verified
-- tree; hence greedy DDTree reproduces greedy autoregressive decoding bit for bit.
-- (KDTREE_BI_BACKEND=cpu runs the same checks on the CPU backend, which is invariant too.)
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local ffi = require("ffi")

local MODEL = "models/tiny-k2.6"
-- the K2.6 layout (INT4 experts, W4A16 kernels) and the plain DeepSeek-V3 layout (bf16 experts)
local TARGETS = { "models/tiny-k2.6", "spec/fixtures/tiny-dsv3" }
local DRAFT = "models/tiny-k2.6-dflash"
local BACKEND = os.getenv("KDTREE_BI_BACKEND") or "cuda"

local function row_bits_equal(a, ai, b, bi, V)
  local ua, ub = ffi.cast("uint32_t*", a), ffi.cast("uint32_t*", b)
  for j = 0, V - 1 do
    if ua[ai * V + j] ~= ub[bi * V + j] then
      return false, string.format("vocab %d: %.9g vs %.9g", j, a[ai * V + j], b[bi * V + j])
    end
  end
  return true
end

describe("batch invariance on the GPU #gpu", function()
 for _, TARGET in ipairs(TARGETS) do
 describe(TARGET, function()
  local m, V
  local prompt = {}
  setup(function()
    m = kd.open_model(TARGET, { backend = BACKEND })
    V = m.info.vocab
    math.randomseed(42)
    for i = 1, 40 do prompt[i] = math.random(3, math.min(990, V - 1)) end
  end)
  teardown(function() m:close() end)

  it("a token alone, in a prefill and in a chunked prefill has the same logits bits", function()
    local s = m:new_seq(128)
    s:forward(prompt)
    local full = s:logits_cdata()
    s:close()
    -- decode alone after a prefix
    for _, p in ipairs({ 0, 1, 7, 20, 39 }) do
      local t = m:new_seq(128)
      if p > 0 then t:forward({ unpack(prompt, 1, p) }) end
      t:forward({ prompt[p + 1] })
      local one = t:logits_cdata()
      local ok, why = row_bits_equal(one, 0, full, p, V)
      assert.is_true(ok, string.format("position %d alone vs in the prefill: %s", p, tostring(why)))
      t:close()
    end
    -- chunked prefill: 13 + 27 tokens
    local c = m:new_seq(128)
    c:forward({ unpack(prompt, 1, 13) })
    local first = c:logits_cdata()
    c:forward({ unpack(prompt, 14, 40) })
    local second = c:logits_cdata()
    for i = 0, 12 do assert.is_true(row_bits_equal(first, i, full, i, V), "chunk 1 row " .. i) end
    for i = 0, 26 do assert.is_true(row_bits_equal(second, i, full, 13 + i, V), "chunk 2 row " .. i) end
    c:close()
  end)

  it("a tree node's logits equal the same tokens decoded autoregressively", function()
    local prefix = { unpack(prompt, 1, 20) }
    -- a tree from random draft logits: depth 4, budget 12, root = the next prompt token
    local L = 4
    local rows = {}
    math.randomseed(7)
    for d = 1, L do
      local r = {}
      for j = 1, V do r[j] = (math.random() - 0.5) * 8 end
      rows[d] = r
    end
    local t = kd.tree.build(rows, 12, { root = prompt[21] })
    assert.are.equal(12, t.n)
    local s = m:new_seq(128)
    s:forward(prefix)
    s:verify(t)
    local tree_logits = s:logits_cdata()
    for i = 0, t.n do
      local path = t:path(i)
      local toks = {}
      for k, node in ipairs(path) do toks[k] = node == 0 and t.root or t.tokens[node] end
      -- the path as a causal prefill after the prefix
      local a = m:new_seq(128)
      a:forward(prefix)
      a:forward(toks)
      local pre = a:logits_cdata()
      local ok, why = row_bits_equal(pre, #toks - 1, tree_logits, i, V)
      assert.is_true(ok, string.format("node %d (depth %d) vs the path prefilled: %s", i, #toks - 1, tostring(why)))
      a:close()
      -- the path decoded token by token
      local b = m:new_seq(128)
      b:forward(prefix)
      local last
      for _, tok in ipairs(toks) do b:forward({ tok }); last = b:logits_cdata() end
      ok, why = row_bits_equal(last, 0, tree_logits, i, V)
      assert.is_true(ok, string.format("node %d vs decoding its path alone: %s", i, tostring(why)))
      b:close()
    end
    s:close()
    t:close()
  end)

  end)
 end
 end)

describe("lossless speculative decoding on the GPU #gpu", function()
  local m
  setup(function() m = kd.open_model(MODEL, { backend = BACKEND }) end)
  teardown(function() m:close() end)

  it("greedy DDTree and DFlash reproduce greedy AR token for token", function()
    local d = kd.open_drafter(DRAFT, m)
    local p = { 5, 77, 300, 12, 999, 77, 300 }
    local ar = gen.run(m, p, { policy = "ar", n = 32, eos = false })
    for _, B in ipairs({ 0, 1, 4, 32, 128 }) do
      local dd = gen.run(m, p, { policy = "ddtree", n = 32, eos = false, drafter = d, budget = B })
      assert.are.same(ar.tokens, dd.tokens, "ddtree budget " .. B)
    end
    local df = gen.run(m, p, { policy = "dflash", n = 32, eos = false, drafter = d })
    assert.are.same(ar.tokens, df.tokens, "dflash")
    local samp = { temperature = 0.9, top_k = 64, top_p = 0.95, seed = 99 }
    local ars = gen.run(m, p, { policy = "ar", n = 32, eos = false, sampler = samp })
    local dds = gen.run(m, p, { policy = "ddtree", n = 32, eos = false, drafter = d, budget = 16, sampler = samp })
    assert.are.same(ars.tokens, dds.tokens, "sampled ddtree")
    d:close()
  end)
end)
