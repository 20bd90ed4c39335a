-- ddtree_round_spec.lua: whole DDTree rounds on a model (draft, build, verify, accept, commit) with
-- the round on the backend's ops and on the host (kd_model_options.ddtree_round), on both tiny
-- layouts (tiny-k2.6: INT4 experts, q_lora, a DFlash drafter; tiny-dsv3: bf16 experts, q_proj),
-- greedy and sampled, against two references that share no code with the round:
--   * each accept == the rule applied in Lua to the verify's logits (argmax / kd_sample_logits
--     at len + depth + 1 per node, the walk from the root);
--   * the tokens == autoregressive decoding on the same model (the round is lossless).
-- Every sampled row of a plain forward (kd_seq_sample) also equals kd_sample_logits on its row.
-- Runs on KDTREE_BACKEND (cpu in `make test`; `make test-gpu` runs it on CUDA).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local ffi, C = kd.ffi, kd.C

local BACKEND = os.getenv("KDTREE_BACKEND") or "cpu"
local LAYOUTS = {
  { dir = "models/tiny-k2.6", draft = "models/tiny-k2.6-dflash" },
  { dir = "spec/fixtures/tiny-dsv3" },
}
local SAMPLERS = { false, { temperature = 0.8, top_k = 50, top_p = 0.95, seed = 77 }, { temperature = 1.3, seed = 5 } }
local PROMPT = { 5, 77, 300, 12, 999, 77, 300 }

local lcg = require("helpers.lcg")

-- the rule on the host: the target of node i is drawn from its logits row with the key
-- (seed, len + depth + 1); the walk follows the child holding the target until none does
local function host_accept(s, t, sp, len)
  local V = s.model.info.vocab
  local out = ffi.new("int32_t[1]")
  local function target(node)
    local row = s:logits_cdata(node + 1, 1)
    local depth = node == 0 and 0 or t.depths[node]
    kd.check(C.kd_sample_logits(row, V, sp and kd.sampler(sp) or nil, len + depth + 1, out), "kd_sample_logits")
    return out[0]
  end
  local cur, nodes, toks = 0, {}, {}
  while true do
    nodes[#nodes + 1] = cur
    toks[#toks + 1] = cur == 0 and t.root or t.tokens[cur]
    local nxt, child = target(cur), nil
    for j = cur + 1, t.n do if t.parents[j] == cur and t.tokens[j] == nxt then child = j; break end end
    if not child then return { nodes = nodes, tokens = toks, tau = #nodes, bonus = nxt } end
    cur = child
  end
end

-- L x V log-probs with the future tokens planted at ranks 0..3 (or missing) among decoys
local function planted(V, future, r)
  local L = 7
  local a = ffi.new("float[?]", L * V)
  for d = 0, L - 1 do
    for i = 0, V - 1 do a[d * V + i] = -12 - r() * 10 end
    for k = 0, 3 do a[d * V + math.floor(r() * V)] = -0.5 - k - r() end
    if future[d + 1] and r() < 0.8 then a[d * V + future[d + 1]] = -0.3 - math.floor(r() * 4) * 0.7 end
  end
  return { data = a, L = L, V = V }
end

for _, LY in ipairs(LAYOUTS) do
for _, round in ipairs({ "backend", "host" }) do
describe(string.format("DDTree rounds on %s (%s), round on the %s", LY.dir, BACKEND, round), function()
  local m, d
  setup(function()
    m = kd.open_model(LY.dir, { backend = BACKEND, ddtree_round = round })
    if LY.draft then d = kd.open_drafter(LY.draft, m) end
  end)
  teardown(function()
    if d then d:close() end
    m:close()
  end)

  for _, sp in ipairs(SAMPLERS) do
    it((sp and "sampled" or "greedy") .. " rounds" .. (d and " (drafted and planted trees)" or " (planted trees)") ..
      ": each accept equals the rule on the host, the tokens equal autoregressive decoding", function()
      local N = 40
      local fut = gen.run(m, PROMPT, { policy = "ar", n = N + 10, sampler = sp or nil, eos = false }).tokens
      assert.are.equal(N + 10, #fut)
      local s = m:new_seq(256)
      if d then s:attach_drafter(d) end
      s:forward(PROMPT)
      local out = { gen.last_token(s, sp) }
      local t = kd.tree.new()
      local taus, r = {}, lcg(31)
      local round_no, deep = 0, 0
      while #out < N do
        round_no = round_no + 1
        local len, bonus = s:len(), out[#out]
        if d and round_no % 2 == 1 then
          s:draft(bonus, false)
          t:build_drafted(s, ({ 0, 1, 8, 32, 64 })[round_no % 5 + 1])
          assert.are.equal(bonus, t.root)
        else
          local f = {}
          for i = 1, 7 do f[i] = fut[#out + i] end
          t:build(planted(m.info.vocab, f, r), ({ 4, 16, 48, 100 })[round_no % 4 + 1], { logprobs = true, root = bonus })
        end
        s:verify(t)
        local want = host_accept(s, t, sp or nil, len)
        local got = s:accept(t, sp or nil)
        assert.are.same(want, got, "round " .. round_no)
        s:commit(t)
        assert.are.equal(len + got.tau, s:len())
        for i = 2, got.tau do out[#out + 1] = got.tokens[i] end
        out[#out + 1] = got.bonus
        taus[#taus + 1] = got.tau
        if got.tau > 2 then deep = deep + 1 end
      end
      for i = 1, N do assert.are.equal(fut[i], out[i], "token " .. i) end
      assert.is_true(deep > 0, "no round accepted more than one drafted token: the walk was not exercised")
      t:close(); s:close()
    end)
  end

  it("a host-built tree is accepted the same way on a second sequence after truncation", function()
    local s = m:new_seq(128)
    s:forward(PROMPT)
    local a = s:argmax()
    local lp = ffi.new("float[?]", 3 * m.info.vocab)
    for i = 0, 3 * m.info.vocab - 1 do lp[i] = -((i * 7919) % 1000) / 100 end
    local t = kd.tree.build({ data = lp, L = 3, V = m.info.vocab }, 40, { logprobs = true, root = a[#a] })
    local sp = { temperature = 0.9, seed = 3 }
    for _ = 1, 2 do
      local len = s:len()
      s:verify(t)
      assert.are.same(host_accept(s, t, sp, len), s:accept(t, sp))
      s:commit(t)
      s:truncate(len)
    end
    t:close(); s:close()
  end)

  it("sampling every row of a forward equals kd_sample_logits on each row", function()
    local s = m:new_seq(64)
    s:forward(PROMPT)
    local V, out = m.info.vocab, ffi.new("int32_t[1]")
    for _, sp in ipairs({ SAMPLERS[2], SAMPLERS[3], { temperature = 0.7, top_k = 3, seed = 11 } }) do
      local got = s:sample(sp)
      assert.are.equal(#PROMPT, #got)
      for i = 1, #PROMPT do
        kd.check(C.kd_sample_logits(s:logits_cdata(i, 1), V, kd.sampler(sp), i, out), "kd_sample_logits")
        assert.are.equal(out[0], got[i], "row " .. i)
      end
    end
    s:close()
  end)
end)
end
end

describe("the ddtree_round option", function()
  it("is refused with a message naming the field and its values", function()
    local ok, err = pcall(kd.open_model, "models/tiny-k2.6", { backend = BACKEND, ddtree_round = "gpu" })
    assert.is_false(ok)
    assert.matches('ddtree_round: expected "backend" or "host", got "gpu"', err, 1, true)
    local o = ffi.new("kd_model_options")
    o.backend = C.KD_BACKEND_CPU
    o.ddtree_round = 7
    local out = ffi.new("kd_model*[1]")
    assert.are.equal(C.KD_ERR_ARG, C.kd_model_open("models/tiny-k2.6", o, out))
    assert.matches("options.ddtree_round is 7: expected KD_ROUND_DEFAULT (0), KD_ROUND_BACKEND (1) or KD_ROUND_HOST (2)",
      kd.last_error(), 1, true)
  end)
end)
