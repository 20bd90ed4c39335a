-- forward_spec.lua: invariants of the target forward and the KV cache on the shipped tiny
-- K2.6-layout model: prefill + decode == one prefill, chunking invariance (by the caller
-- and inside the engine), the masked (tree) form == per-path causal runs, truncate and
-- re-decode, compaction == the cache built autoregressively, and bad input.
-- "Equal" means bit-identical: a token's logits and cache row must not depend on how many
-- tokens share the forward or whether it is a tree node (backends are batch-invariant;
-- issue: DDTree greedy == AR greedy bit for bit). KDTREE_FORWARD_TOL loosens this while a
-- backend is being brought up.
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local kd = require("kdtree")
local ffi = require("ffi")

local MODEL = "models/tiny-k2.6"
local TOL = tonumber(os.getenv("KDTREE_FORWARD_TOL") or "0")
local BACKEND = os.getenv("KDTREE_BACKEND") or "cpu"

local function maxdiff(a, b)
  assert(#a == #b, ("length %d vs %d"):format(#a, #b))
  local m = 0
  for i = 1, #a do
    local d = math.abs(a[i] - b[i])
    if d ~= d then return math.huge end
    if d > m then m = d end
  end
  return m
end

local function tokens(n, seed)
  local t, x = {}, seed or 7
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    t[i] = 2 + x % 998
  end
  return t
end

local function slice(t, a, b)
  local r = {}
  for i = a, b do r[#r + 1] = t[i] end
  return r
end

local function concat(a, b)
  local r = {}
  for _, v in ipairs(a) do r[#r + 1] = v end
  for _, v in ipairs(b) do r[#r + 1] = v end
  return r
end

-- visibility words for a tree given parent indices (0-based, -1 = root): ancestors + self
local function tree_mask(parent)
  local T = #parent
  local words = math.ceil(T / 64)
  local vis = ffi.new("uint64_t[?]", T * words)
  for i = 0, T - 1 do
    local a = i
    while a >= 0 do
      local w = i * words + math.floor(a / 64)
      vis[w] = bit.bor(vis[w], bit.lshift(1ULL, a % 64))
      a = parent[a + 1]
    end
  end
  return vis
end

describe("target forward (" .. BACKEND .. ")", function()
  local m
  setup(function() m = kd.open_model(MODEL, { backend = BACKEND }) end)
  teardown(function() if m then m:close() end end)

  it("prefill + decode steps give the logits of one long prefill", function()
    local toks = tokens(20, 3)
    local long = m:new_seq(32)
    long:forward(toks)
    assert.are.equal(20, long:out_rows())
    local s = m:new_seq(32)
    s:forward(slice(toks, 1, 12))
    local worst = maxdiff(s:logits(12), long:logits(12))
    for i = 13, 20 do
      s:forward({ toks[i] })
      assert.are.equal(1, s:out_rows())
      worst = math.max(worst, maxdiff(s:logits(1), long:logits(i)))
    end
    assert.are.equal(20, s:len())
    assert.is_true(worst <= TOL, "max |diff| " .. worst)
    -- and the cache rows agree
    for l = 0, m.info.n_layers - 1 do
      assert.is_true(maxdiff(s:read_cache(l, 0, 20), long:read_cache(l, 0, 20)) <= TOL)
    end
    s:close(); long:close()
  end)

  it("is invariant to how the caller chunks the tokens", function()
    local toks = tokens(23, 11)
    local one = m:new_seq(32)
    one:forward(toks)
    for _, cut in ipairs({ { 5, 7, 11 }, { 1, 22 }, { 16, 7 } }) do
      local s, at = m:new_seq(32), 0
      for _, n in ipairs(cut) do
        s:forward(slice(toks, at + 1, at + n))
        for r = 1, n do
          local d = maxdiff(s:logits(r), one:logits(at + r))
          assert.is_true(d <= TOL, ("chunks %s: row %d: max |diff| %g"):format(table.concat(cut, "+"), at + r, d))
        end
        at = at + n
      end
      s:close()
    end
    one:close()
  end)

  it("runs a prefill longer than its rows per forward in chunks, keeping the last rows' logits", function()
    local n = 1100                            -- out_cap is min(capacity, 1024): 76 + 1024 rows
    local toks = tokens(n, 5)
    local big = m:new_seq(n + 4)
    big:forward(toks)
    assert.are.equal(n, big:len())
    assert.are.equal(1024, big:out_rows())    -- the logits of tokens 77..1100
    local s = m:new_seq(n + 4)
    local at = 0
    while at < n do
      local k = math.min(100, n - at)
      s:forward(slice(toks, at + 1, at + k))
      at = at + k
    end
    -- s's last forward covered tokens 1001..1100, big's rows are tokens 77..1100
    for _, tok in ipairs({ 1001, 1050, 1100 }) do
      local d = maxdiff(big:logits(tok - 76), s:logits(tok - 1000))
      assert.is_true(d <= TOL, ("token %d: max |diff| %g"):format(tok, d))
    end
    for _, l in ipairs({ 0, m.info.n_layers - 1 }) do
      assert.is_true(maxdiff(big:read_cache(l, 0, n), s:read_cache(l, 0, n)) <= TOL)
    end
    -- decoding on top agrees too
    big:forward({ 42 }); s:forward({ 42 })
    assert.is_true(maxdiff(big:logits(1), s:logits(1)) <= TOL)
    big:close(); s:close()
  end)

  it("a chunked prefill hands every chunk's tap features to an attached drafter", function()
    local d = kd.open_drafter("models/tiny-k2.6-dflash", m)
    local toks = tokens(19, 31)
    local function draft_after_prefill(rows)
      local s = m:new_seq(40, { max_rows = rows })
      s:attach_drafter(d)
      s:forward(toks)                       -- rows = 4: chunks 3 + 4 + 4 + 4 + 4
      local out = s:draft(77)
      local r = {}
      for i = 0, out.L * out.V - 1 do r[#r + 1] = out.data[i] end
      local lg = s:logits(s:out_rows())
      s:close()
      return { r, lg }
    end
    local whole, chunked = draft_after_prefill(nil), draft_after_prefill(4)
    assert.is_true(maxdiff(whole[2], chunked[2]) <= TOL, "last-token logits")
    assert.is_true(maxdiff(whole[1], chunked[1]) <= TOL, "draft log-probs")
    d:close()
  end)

  it("the masked form with a chain mask equals a causal run", function()
    local toks = tokens(14, 21)
    local a, b = m:new_seq(32), m:new_seq(32)
    a:forward(slice(toks, 1, 6)); b:forward(slice(toks, 1, 6))
    local chain = slice(toks, 7, 14)
    local parent, pos = {}, {}
    for i = 1, #chain do parent[i] = i - 2; pos[i] = 6 + i - 1 end
    a:forward(chain)
    b:forward(chain, { positions = pos, visible = tree_mask(parent) })
    assert.are.equal(6, b:len())              -- masked rows are pending, not committed
    for r = 1, #chain do
      assert.is_true(maxdiff(a:logits(r), b:logits(r)) <= TOL, "row " .. r)
    end
    for l = 0, m.info.n_layers - 1 do
      assert.is_true(maxdiff(a:read_cache(l, 6, 8), b:read_cache(l, 6, 8)) <= TOL)
    end
    -- positions default to len, len+1, ... in the masked form too
    b:truncate(6)
    b:forward(chain, { visible = tree_mask(parent) })
    assert.is_true(maxdiff(a:logits(#chain), b:logits(#chain)) <= TOL)
    a:close(); b:close()
  end)

  it("the masked form with a tree mask equals one causal run per root-to-node path", function()
    local prefix = tokens(9, 4)
    -- a tree of 13 nodes in pop order (parents before children), node 0 = root
    local parent = { -1, 0, 0, 1, 1, 2, 3, 0, 4, 6, 6, 9, 2 }
    local tok = tokens(#parent, 99)
    local depth, pos = {}, {}
    for i = 1, #parent do
      depth[i] = parent[i] < 0 and 0 or depth[parent[i] + 1] + 1
      pos[i] = #prefix + depth[i]
    end
    local t = m:new_seq(64)
    t:forward(prefix)
    t:forward(tok, { positions = pos, visible = tree_mask(parent) })
    assert.are.equal(#parent, t:out_rows())
    local worst = 0
    for i = 1, #parent do
      local path, a = {}, i - 1
      while a >= 0 do table.insert(path, 1, tok[a + 1]); a = parent[a + 1] end
      local s = m:new_seq(64)
      s:forward(concat(prefix, path))
      worst = math.max(worst, maxdiff(s:logits(s:out_rows()), t:logits(i)))
      -- this node's cache row equals the causal run's last row
      for l = 0, m.info.n_layers - 1 do
        worst = math.max(worst, maxdiff(s:read_cache(l, s:len() - 1, 1), t:read_cache(l, #prefix + i - 1, 1)))
      end
      s:close()
    end
    assert.is_true(worst <= TOL, "max |diff| " .. worst)
    t:close()
  end)

  it("truncate then re-decode reproduces the same logits", function()
    local toks = tokens(16, 8)
    local s = m:new_seq(32)
    s:forward(slice(toks, 1, 10))
    local ref = {}
    for i = 11, 16 do s:forward({ toks[i] }); ref[i] = s:logits(1) end
    s:truncate(10)
    assert.are.equal(10, s:len())
    for i = 11, 16 do
      s:forward({ toks[i] })
      assert.is_true(maxdiff(s:logits(1), ref[i]) <= TOL, "token " .. i)
    end
    -- a different continuation after truncation, then back: still the same
    s:truncate(12)
    s:forward({ 500, 501 })
    s:truncate(12)
    s:forward(slice(toks, 13, 16))
    assert.is_true(maxdiff(s:logits(4), ref[16]) <= TOL)
    s:close()
  end)

  it("a compaction of more slots than a forward's rows moves them in chunks, to the same cache", function()
    local toks = tokens(20, 5)
    local keep = { 0, 2, 3, 5, 8, 9, 12, 15, 16 }          -- 9 slots of the 17 after slot 3
    local function compacted(rows)
      local s = m:new_seq(40, { max_rows = rows })
      s:forward(toks)
      s:compact(3, keep)
      assert.are.equal(3 + #keep, s:len())
      local c = {}
      for l = 0, m.info.n_layers - 1 do c[l + 1] = s:read_cache(l, 0, s:len()) end
      s:close()
      return c
    end
    local whole, chunked = compacted(nil), compacted(2)    -- chunks of 2 kept slots
    for l = 1, #whole do
      assert.is_true(maxdiff(whole[l], chunked[l]) <= TOL, "layer " .. (l - 1))
    end
  end)

  it("compaction to an accepted path gives the cache an autoregressive build gives", function()
    local prefix = tokens(7, 12)
    local parent = { -1, 0, 0, 1, 2, 3, 3, 5, 6 }
    local tok = tokens(#parent, 77)
    local depth, pos = {}, {}
    for i = 1, #parent do
      depth[i] = parent[i] < 0 and 0 or depth[parent[i] + 1] + 1
      pos[i] = #prefix + depth[i]
    end
    local s = m:new_seq(40)
    s:forward(prefix)
    s:forward(tok, { positions = pos, visible = tree_mask(parent) })
    -- accept the path root -> 1 -> 3 -> 6 (node ids 0, 1, 3, 6)
    local keep = { 0, 1, 3, 6 }
    s:compact(#prefix, keep)
    assert.are.equal(#prefix + 4, s:len())
    local path = {}
    for _, k in ipairs(keep) do path[#path + 1] = tok[k + 1] end
    local ar = m:new_seq(40)
    ar:forward(prefix)
    for _, t in ipairs(path) do ar:forward({ t }) end
    for l = 0, m.info.n_layers - 1 do
      local d = maxdiff(s:read_cache(l, 0, s:len()), ar:read_cache(l, 0, ar:len()))
      assert.is_true(d <= TOL, ("layer %d: max |diff| %g"):format(l, d))
    end
    -- and decoding continues identically
    s:forward({ 321 }); ar:forward({ 321 })
    assert.is_true(maxdiff(s:logits(1), ar:logits(1)) <= TOL)
    -- compaction inside the committed rows: drop slots 2 and 4 of the prefix
    s:compact(1, { 0, 2, 4, 5 })
    assert.are.equal(5, s:len())
    local sub = s:read_cache(0, 1, 4)
    local w = m.info.kv_lora_rank + m.info.qk_rope_dim
    local full = ar:read_cache(0, 0, 7)
    for i, k in ipairs({ 0, 2, 4, 5 }) do
      for c = 1, w do assert.are.equal(full[(1 + k) * w + c], sub[(i - 1) * w + c]) end
    end
    s:close(); ar:close()
  end)

  it("rejects bad input with messages that name it, and stays usable", function()
    local s = m:new_seq(8)
    local ok, err = pcall(s.forward, s, { 5, 1024, 7 })
    assert.is_false(ok)
    assert.matches("tokens%[1%] = 1024", err)
    assert.matches("1024%)", err)             -- the vocabulary [0, 1024)
    ok, err = pcall(s.forward, s, { -3 })
    assert.is_false(ok)
    assert.matches("tokens%[0%] = %-3", err)
    ok, err = pcall(s.forward, s, tokens(9))
    assert.is_false(ok)
    assert.matches("capacity", err)
    assert.matches("9 new tokens after 0", err)
    assert.matches("capacity of 8", err)
    ok, err = pcall(s.forward, s, { 5, 6 }, { positions = { 0, -1 } })
    assert.is_false(ok)
    assert.matches("positions%[1%] = %-1", err)
    ok, err = pcall(s.forward, s, {})
    assert.is_false(ok)
    assert.matches("kd_forward: 0 tokens: expected at least 1", err, 1, true)
    assert.are.equal(0, s:len())
    -- still usable
    s:forward({ 5, 6, 7 })
    assert.are.equal(3, s:len())
    ok, err = pcall(s.forward, s, tokens(6))
    assert.is_false(ok)
    assert.matches("6 new tokens after 3", err)
    -- pending masked rows block a new forward until committed or dropped
    s:forward({ 8, 9 }, { positions = { 3, 4 }, visible = tree_mask({ -1, 0 }) })
    ok, err = pcall(s.forward, s, { 10 })
    assert.is_false(ok)
    assert.matches("pending", err)
    ok, err = pcall(s.truncate, s, 4)
    assert.is_false(ok)
    assert.matches("length 4", err)
    ok, err = pcall(s.compact, s, 3, { 1, 0 })
    assert.is_false(ok)
    assert.matches("strictly increasing", err)
    ok, err = pcall(s.compact, s, 3, { 1, 1 })   -- a slot kept twice
    assert.is_false(ok)
    assert.matches("keep[1] = 1 after keep[0] = 1: expected strictly increasing", err, 1, true)
    ok, err = pcall(s.compact, s, 3, { 0, 2 })
    assert.is_false(ok)
    assert.matches("keep%[1%] = 2", err)
    ok, err = pcall(s.read_cache, s, m.info.n_layers, 0, 1)
    assert.is_false(ok)
    assert.matches("layer " .. m.info.n_layers, err)
    s:truncate(3)                              -- drops the pending rows
    s:forward({ 10 })
    assert.are.equal(4, s:len())
    ok, err = pcall(s.logits, s, 2)
    assert.is_false(ok)
    assert.matches("output rows", err)
    s:close()
    -- a masked forward larger than the rows per forward
    local big = m:new_seq(1100)
    local parent = {}
    for i = 1, 1025 do parent[i] = i - 2 end
    local pos = {}
    for i = 1, 1025 do pos[i] = i - 1 end
    ok, err = pcall(big.forward, big, tokens(1025), { positions = pos, visible = tree_mask(parent) })
    assert.is_false(ok)
    assert.matches("1025 tokens exceeds the 1024 rows", err)
    big:close()
  end)
end)
