-- lua_api_spec: the Lua wrappers (require "kdtree"): info tables against config.json,
-- close semantics, use-after-close errors, GC safety, error messages, and the
-- conversions between Lua lists and the C arrays.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local err_of = require("helpers.err_of")
local json = require("dkjson")
local ffi = require("ffi")
local bit = require("bit")

local MODEL = "models/tiny-k2.6"
local DRAFT = "models/tiny-k2.6-dflash"
local PROMPT = { 5, 77, 300, 12, 999 }

local function read_json(path)
  local f = assert(io.open(path, "r"), "missing fixture " .. path)
  local t = assert(json.decode(f:read("*a")))
  f:close()
  return t
end

local function argmax(list)
  local best, arg = -math.huge, nil
  for i, v in ipairs(list) do if v > best then best, arg = v, i - 1 end end
  return arg
end

local function max_abs_diff(a, b)
  assert.are.equal(#a, #b)
  local d = 0
  for i = 1, #a do d = math.max(d, math.abs(a[i] - b[i])) end
  return d
end

describe("kd module", function()
  it("reports a version and a monotonic clock", function()
    assert.is_string(kd.version())
    assert.truthy(kd.version():match("^%d+%.%d+"))
    local a = kd.now_ns(); local b = kd.now_ns()
    assert.is_true(b >= a and a > 0)
    assert.is_true(kd.backend_available("cpu"))
    assert.has_error(function() kd.backend_available("tpu") end, 'kdtree: backend_available: expected "cpu" or "cuda", got "tpu"')
  end)
end)

describe("kd.inspect", function()
  it("returns the config's shape as plain tables", function()
    local cfg = read_json(MODEL .. "/config.json")
    local tc = cfg.text_config or cfg
    local gen = read_json(MODEL .. "/generation_config.json")
    local r = kd.inspect(MODEL)
    assert.are.equal("table", type(r.info))
    assert.are.equal(tc.num_hidden_layers, r.info.n_layers)
    assert.are.equal(tc.hidden_size, r.info.hidden)
    assert.are.equal(tc.vocab_size, r.info.vocab)
    assert.are.equal(tc.n_routed_experts, r.info.n_experts)
    assert.are.equal(tc.num_experts_per_tok, r.info.n_experts_per_tok)
    assert.are.equal(tc.kv_lora_rank, r.info.kv_lora_rank)
    local eos = type(gen.eos_token_id) == "table" and gen.eos_token_id or { gen.eos_token_id }
    assert.are.same(eos, r.info.eos)
    assert.are.equal("number", type(r.bytes_total))
    assert.is_true(r.bytes_total > 0)
    local sum = r.bytes_attention + r.bytes_dense_mlp + r.bytes_shared_experts + r.bytes_routed_experts
      + r.bytes_router + r.bytes_embed + r.bytes_lm_head + r.bytes_norms
    assert.are.equal(r.bytes_total, sum)
  end)

  it("names the directory when it cannot read it", function()
    local ok, err = pcall(kd.inspect, "/nonexistent/kdtree-model")
    assert.is_false(ok)
    assert.truthy(err:find("kdtree:", 1, true))
    assert.truthy(err:find("/nonexistent/kdtree-model", 1, true))
  end)

  it("rejects a non-string directory with a Lua error", function()
    assert.has_error(function() kd.inspect(42) end,
      "kdtree: inspect: expected a directory path, got number")
  end)
end)

describe("model, seq and tree handles", function()
  local m
  setup(function() m = kd.open_model(MODEL, { backend = "cpu" }) end)
  teardown(function() if m then m:close() end end)

  it("exposes info as a plain table matching config.json", function()
    local tc = read_json(MODEL .. "/config.json").text_config
    assert.are.equal(tc.vocab_size, m.info.vocab)
    assert.are.equal(tc.num_attention_heads, m.info.n_heads)
    assert.are.equal(tc.q_lora_rank, m.info.q_lora_rank)
    assert.are.equal("cpu", m.info.backend)
    assert.are.equal("table", type(m.info.eos))
    assert.is_true(m.info.bytes_weights > 0)
    assert.truthy(tostring(m):match("^kdtree%.model%("))
  end)

  it("s:logits(row) is a Lua list agreeing with logits_cdata and argmax", function()
    local s = m:new_seq(32)
    s:forward(PROMPT)
    assert.are.equal(#PROMPT, s:len())
    assert.are.equal(#PROMPT, s:out_rows())
    assert.are.equal(32, s:capacity())
    local data, count, rows = s:logits_cdata()
    assert.are.equal(#PROMPT * m.info.vocab, count)
    assert.are.equal(#PROMPT, rows)
    local am = s:argmax()
    assert.are.equal(#PROMPT, #am)
    for r = 1, #PROMPT do
      local l = s:logits(r)
      assert.are.equal(m.info.vocab, #l)
      for j = 1, #l, 97 do assert.are.equal(l[j], data[(r - 1) * m.info.vocab + j - 1]) end
      assert.are.equal(argmax(l), am[r])
    end
    -- greedy sampling is argmax
    assert.are.same(am, s:sample({ temperature = 0, seed = 3 }))
    s:close()
  end)

  it("forward accepts cdata tokens, explicit positions and a causal visibility mask", function()
    local a = m:new_seq(16)
    a:forward(PROMPT)
    local ref = a:logits(#PROMPT)
    local b = m:new_seq(16)
    local toks = ffi.new("int32_t[?]", #PROMPT, PROMPT)
    local vis = ffi.new("uint64_t[?]", #PROMPT)
    for i = 0, #PROMPT - 1 do vis[i] = bit.lshift(1ULL, i + 1) - 1 end  -- row i sees 0..i
    b:forward(toks, #PROMPT, { positions = { 0, 1, 2, 3, 4 }, visible = vis })
    assert.is_true(max_abs_diff(ref, b:logits(#PROMPT)) <= 1e-5)
    a:close(); b:close()
  end)

  it("prefill then decode equals one long prefill", function()
    local a = m:new_seq(16)
    a:forward(PROMPT)
    local b = m:new_seq(16)
    b:forward({ PROMPT[1], PROMPT[2], PROMPT[3] })
    b:forward({ PROMPT[4] })
    b:forward({ PROMPT[5] })
    assert.is_true(max_abs_diff(a:logits(5), b:logits(1)) <= 1e-4)
    local ca, cb = a:read_cache(1, 0, 5), b:read_cache(1, 0, 5)
    assert.are.equal(5 * (m.info.kv_lora_rank + m.info.qk_rope_dim), #ca)
    assert.is_true(max_abs_diff(ca, cb) <= 1e-4)
    a:close(); b:close()
  end)

  it("truncate drops the tail; re-forwarding reproduces the logits", function()
    local s = m:new_seq(16)
    s:forward(PROMPT)
    local ref = s:logits(5)
    s:truncate(3)
    assert.are.equal(3, s:len())
    s:forward({ PROMPT[4], PROMPT[5] })
    assert.is_true(max_abs_diff(ref, s:logits(2)) <= 1e-4)
    s:close()
  end)

  it("close is idempotent and use after close is a Lua error, not a crash", function()
    local s = m:new_seq(8)
    s:close()
    s:close()
    assert.is_true(s:is_closed())
    assert.has_error(function() s:len() end, "kdtree: seq is closed")
    assert.has_error(function() s:forward({ 1 }) end, "kdtree: seq is closed")
    assert.has_error(function() s:logits(1) end, "kdtree: seq is closed")
    local t = kd.tree.chain(5, { 1, 2 })
    t:close()
    assert.has_error(function() t:dump() end, "kdtree: tree is closed")
    assert.has_error(function() t:visibility() end, "kdtree: tree is closed")
    assert.are.equal("kdtree.seq (closed)", tostring(s))
  end)

  it("a sequence keeps its model alive after m:close(), then frees it", function()
    local m2 = kd.open_model(MODEL)
    local st = m2._st
    local s = m2:new_seq(16)
    m2:close()
    assert.has_error(function() m2:new_seq(4) end, "kdtree: model is closed")
    assert.is_false(st.freed)                -- the seq still needs the weights
    s:forward(PROMPT)                         -- and still works
    assert.are.equal(5, s:len())
    s:close()
    assert.is_true(st.freed)                  -- freed with its last sequence
  end)

  -- objects are made in helper functions: LuaJIT's GC scans every slot of a live frame, so a
  -- local set to nil can still be held by a stale temporary slot of the same function
  it("garbage collection frees in a safe order, whatever becomes garbage first", function()
    local seq_holder = {}
    local function make()
      local m2 = kd.open_model(MODEL)
      seq_holder.s = m2:new_seq(16)
      return m2._st, seq_holder.s._st
    end
    local st_model, st_seq = make()       -- the model object is garbage now; the seq holds it
    collectgarbage(); collectgarbage()
    assert.is_false(st_model.freed)
    local function use() seq_holder.s:forward(PROMPT); return seq_holder.s:len() end
    assert.are.equal(5, use())             -- the weights are still there
    seq_holder.s = nil                     -- now both are garbage, collected in one cycle
    collectgarbage(); collectgarbage()
    assert.is_true(st_seq.freed)
    assert.is_true(st_model.freed)
  end)

  it("many handles dropped without close are reclaimed by the GC", function()
    local function make(i)
      local s = m:new_seq(8)
      s:forward({ i })
      local t = kd.tree.chain(i, { 1, 2, 3 })
      return s._st, t._st
    end
    local sts = {}
    for i = 1, 50 do
      local a, b = make(i)
      sts[#sts + 1] = a; sts[#sts + 1] = b
    end
    collectgarbage(); collectgarbage()
    for _, st in ipairs(sts) do assert.is_true(st.freed) end
    -- the model was never freed by its children going away
    assert.is_false(m._st.freed)
    assert.is_false(m:is_closed())
  end)
end)

describe("errors carry kd_last_error and leave the engine usable", function()
  local m
  setup(function() m = kd.open_model(MODEL) end)
  teardown(function() m:close() end)

  it("open_model names a missing directory", function()
    local ok, err = pcall(kd.open_model, "/nonexistent/kdtree-model")
    assert.is_false(ok)
    assert.truthy(err:find("kd_model_open", 1, true))
    assert.truthy(err:find("/nonexistent/kdtree-model", 1, true))
  end)

  it("open_model rejects an unknown backend before touching C", function()
    assert.has_error(function() kd.open_model(MODEL, { backend = "tpu" }) end,
      'kdtree: open_model: backend: expected "cpu" or "cuda", got "tpu"')
  end)

  it("a token id out of range is an argument error naming the id", function()
    local s = m:new_seq(8)
    local ok, err = pcall(s.forward, s, { 5, m.info.vocab + 7 })
    assert.is_false(ok)
    assert.truthy(err:find("kd_forward failed (argument)", 1, true))
    assert.truthy(err:find(tostring(m.info.vocab + 7), 1, true))
    -- the sequence is unchanged and still works
    assert.are.equal(0, s:len())
    s:forward(PROMPT)
    local fresh = m:new_seq(8)
    fresh:forward(PROMPT)
    assert.is_true(max_abs_diff(fresh:logits(5), s:logits(5)) == 0)
    s:close(); fresh:close()
  end)

  it("growing past capacity is a capacity error", function()
    local s = m:new_seq(4)
    local ok, err = pcall(s.forward, s, PROMPT)
    assert.is_false(ok)
    assert.truthy(err:find("(capacity)", 1, true))
    s:forward({ 1, 2, 3, 4 })
    assert.are.equal(4, s:len())
    s:close()
  end)

  it("a logits row out of range is an error", function()
    local s = m:new_seq(8)
    s:forward(PROMPT)
    assert.matches("kd_seq_logits: rows [5, 6): expected within the " .. #PROMPT .. " output rows of the last forward",
      err_of(s.logits, s, 6), 1, true)
    assert.matches("kd_seq_logits: rows [-1, 0): expected within the " .. #PROMPT .. " output rows of the last forward",
      err_of(s.logits, s, 0), 1, true)
    s:close()
  end)

  it("Lua-side argument checks name the argument", function()
    local s = m:new_seq(8)
    assert.has_error(function() s:forward({ 1, 2.5 }) end, "kdtree: forward: tokens[2]: expected an integer, got 2.5")
    assert.has_error(function() s:forward({ 1, 2 }, { positions = { 0 } }) end,
      "kdtree: forward: positions: expected 2 entries (one per token), got 1")
    assert.has_error(function() m:new_seq("big") end, "kdtree: new_seq: capacity: expected an integer, got big")
    s:close()
  end)
end)

describe("kd.tree", function()
  local rows = { { 0, 1, 2, 3 }, { 3, 2, 1, 0 }, { 1, 1, 1, 1 } }

  it("builds from a Lua table and from cdata identically", function()
    local a = kd.tree.build(rows, 6)
    local data = ffi.new("float[12]", { 0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 1, 1 })
    local b = kd.tree.build({ data = data, L = 3, V = 4 }, 6)
    assert.are.equal(6, a.n)
    assert.are.same(a.tokens, b.tokens)
    assert.are.same(a.parents, b.parents)
    assert.are.same(a.depths, b.depths)
    -- best-first: the first node is depth 1's best token (3), children follow their parents
    assert.are.equal(3, a.tokens[1])
    for i = 1, a.n do
      assert.is_true(a.parents[i] < i)
      assert.are.equal(a.parents[i] == 0 and 1 or a.depths[a.parents[i]] + 1, a.depths[i])
    end
    a:close(); b:close()
  end)

  it("budget 0 is the root alone; set_root and chain set the root token", function()
    local t = kd.tree.build(rows, 0)
    assert.are.equal(0, t.n)
    t:set_root(42)
    assert.are.equal(42, t.root)
    local c = kd.tree.chain(9, { 4, 5, 6 })
    assert.are.equal(3, c.n)
    assert.are.same({ 4, 5, 6 }, c.tokens)
    assert.are.same({ 0, 1, 2 }, c.parents)
    assert.are.same({ 1, 2, 3 }, c.depths)
    assert.are.equal(9, c.root)
    assert.truthy(c:dump():find("token 6 (depth 3)", 1, true))
    t:close(); c:close()
  end)

  it("visibility is the ancestor-only mask", function()
    local t = kd.tree.build(rows, 8)
    local v, n_rows, words = t:visibility()
    assert.are.equal(t.n + 1, n_rows)
    assert.are.equal(1, words)
    for i = 0, t.n do
      -- expected: the path root..i
      local want = 0ULL
      for _, node in ipairs(t:path(i)) do want = bit.bor(want, bit.lshift(1ULL, node)) end
      assert.are.equal(tonumber(want), tonumber(v[i]))
    end
    t:close()
  end)

  it("rejects a negative budget and ragged logits", function()
    local ok, err = pcall(kd.tree.build, rows, -1)
    assert.is_false(ok)
    assert.truthy(err:find("budget", 1, true))
    assert.has_error(function() kd.tree.build({ { 1, 2, 3 }, { 1, 2 } }, 4) end,
      "kdtree: tree.build: logits row 2: expected 3 values (the width of row 1), got 2")
    assert.has_error(function() kd.tree.build("x", 4) end,
      "kdtree: tree.build: logits: expected an L x V table or {data=, L=, V=}, got string")
  end)
end)

describe("drafter handle", function()
  it("opens with its info and stays alive while attached", function()
    local m = kd.open_model(MODEL)
    local d = kd.open_drafter(DRAFT, m)
    local cfg = read_json(DRAFT .. "/config.json")
    assert.are.equal(cfg.block_size, d.info.block_size)
    assert.are.same(cfg.dflash_config.target_layer_ids, d.info.taps)
    assert.are.equal(cfg.dflash_config.mask_token_id, d.info.mask_token_id)
    local s = m:new_seq(32)
    s:attach_drafter(d)
    local dst = d._st
    d:close()
    assert.has_error(function() kd.open_drafter(DRAFT, d) end,
      "kdtree: open_drafter: expected a target model (kd.open_model) as 2nd argument")
    assert.is_false(dst.freed)
    s:forward(PROMPT)
    local lp = s:draft(7)
    assert.are.equal(d.info.block_size - 1, lp.L)
    assert.are.equal(m.info.vocab, lp.V)
    -- each depth is a log-distribution
    for r = 1, lp.L do
      local z = 0
      for _, v in ipairs(lp:row(r)) do z = z + math.exp(v) end
      assert.is_true(math.abs(z - 1) < 1e-3)
    end
    s:close()
    assert.is_true(dst.freed)
    m:close()
  end)

  it("draft without a drafter is a Lua error", function()
    local m = kd.open_model(MODEL)
    local s = m:new_seq(8)
    assert.has_error(function() s:draft(1) end, "kdtree: draft: no drafter attached (use s:attach_drafter(d))")
    s:close(); m:close()
  end)
end)
