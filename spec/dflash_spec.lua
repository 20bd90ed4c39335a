-- dflash_spec.lua: the DFlash drafter (core/drafter.c) against a float64 PyTorch reference
-- (scripts/golden/dflash_ref.py via scripts/golden/make_tiny_drafter.py ->
-- spec/fixtures/golden-dflash.json), plus config parsing and the load/attach/draft error paths.
--
-- Tolerance: max |log-prob - golden| over all (bs-1) x vocab entries of a case < 1e-4 on the CPU
-- backend (fp32 math from bf16 weights; the target's tap features come from the engine's own
-- target forward), and the argmax per depth equal to the golden's wherever the golden's top-2
-- margin exceeds 1e-3. On CUDA (bf16 activations) the max over the whole vocabulary is dominated
-- by far-tail tokens (log-prob -20 and below, where bf16's relative error is large in absolute
-- terms), so there the bound is on what a tree can use: |log-prob - golden| < 0.2 over entries
-- whose golden log-prob exceeds -10, KL(golden || engine) < 0.02 nats per depth, and the argmax
-- checked where the margin exceeds 0.5 (measured on an H200: the drafter alone, case "empty",
-- is off by at most 0.044 over all entries; the cases with a context add the error of the bf16
-- target forward that made the taps).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local err_of = require("helpers.err_of")
local json = require("dkjson")
local ffi = kd.ffi

local TARGET = "models/tiny-k2.6"
local DRAFTER = "models/tiny-k2.6-dflash"
local backend = os.getenv("KDTREE_BACKEND") or "cpu"
local TOL = backend == "cpu" and 1e-4 or 0.2
local LIKELY = backend == "cpu" and -math.huge or -10   -- entries compared (golden log-prob above)
local KL_TOL = 0.02                                        -- bf16 backends only
local MARGIN = backend == "cpu" and 1e-3 or 0.5

local function read_file(p)
  local f = assert(io.open(p, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end
local function write_file(p, s)
  local f = assert(io.open(p, "wb"))
  f:write(s)
  f:close()
end
local function tmpdir()
  local p = os.tmpname()
  os.remove(p)
  assert(os.execute("mkdir -p '" .. p .. "'"))
  return p
end
local function rmdir(p) os.execute("rm -rf '" .. p .. "'") end
local function abspath(p)
  local h = io.popen("cd '" .. p .. "' && pwd")
  local r = h:read("*l")
  h:close()
  return r
end

local golden = json.decode(read_file("spec/fixtures/golden-dflash.json"))
local base_cfg = json.decode(read_file(DRAFTER .. "/config.json"))
local cases = {}
for _, c in ipairs(golden.cases) do cases[c.name] = c end

-- a drafter directory with base_cfg changed by `over` (top-level keys replaced) and, unless
-- `weights` is false, the shipped weights linked in
local function variant_dir(over, weights)
  local dir = tmpdir()
  local cfg = json.decode(json.encode(base_cfg))
  for k, v in pairs(over or {}) do cfg[k] = v end
  write_file(dir .. "/config.json", json.encode(cfg, { indent = true }))
  if weights ~= false then
    assert(os.execute("ln -s '" .. abspath(DRAFTER) .. "/model.safetensors' '" .. dir .. "/model.safetensors'"))
  end
  return dir
end

-- compare one draft's log-probs with a golden case; returns max abs diff
local worst_seen = {}
local function compare(lp, case)
  local L, V = #case.logprobs, #case.logprobs[1]
  assert.are.equal(L, lp.L)
  assert.are.equal(V, lp.V)
  local worst = 0
  for i = 1, L do
    local g = case.logprobs[i]
    local best, arg, kl = -math.huge, -1, 0
    for j = 1, V do
      local x = lp.data[(i - 1) * V + j - 1]
      assert.is_true(x == x, "NaN at depth " .. i)
      local d = math.abs(x - g[j])
      if d > worst and g[j] > LIKELY then worst = d end
      if x > best then best, arg = x, j - 1 end
      kl = kl + math.exp(g[j]) * (g[j] - x)
    end
    if backend ~= "cpu" then
      assert.is_true(kl < KL_TOL, string.format("%s: KL(golden || engine) at depth %d = %.3g (tolerance %g)",
        case.name, i, kl, KL_TOL))
    end
    if case.top2_margin[i] > MARGIN then
      assert.are.equal(case.argmax[i], arg, string.format("%s: argmax at depth %d", case.name, i))
    end
  end
  assert.is_true(worst < TOL, string.format("%s: max |logprob - golden| = %.3g (tolerance %g)", case.name, worst, TOL))
  worst_seen[case.name] = math.max(worst_seen[case.name] or 0, worst)
  if os.getenv("KDTREE_SPEC_VERBOSE") then io.stderr:write(string.format("  %s: max |diff| %.3g\n", case.name, worst)) end
  return worst
end

-- zlib's adler32 of a file's bytes
local function adler32(path)
  local data = read_file(path)
  local a, b = 1, 0
  for i = 1, #data, 4096 do
    local chunk = { data:byte(i, math.min(i + 4095, #data)) }
    for j = 1, #chunk do
      a = a + chunk[j]
      b = b + a
    end
    a, b = a % 65521, b % 65521
  end
  return b * 65536 + a
end

describe("DFlash drafter", function()
  local m, d
  setup(function()
    m = kd.open_model(TARGET, { backend = backend })
    d = kd.open_drafter(DRAFTER, m)
  end)
  teardown(function()
    if d then d:close() end
    if m then m:close() end
  end)

  it("has a golden computed for the shipped target checkpoint", function()
    for fn, sum in pairs(golden.target_adler32) do
      assert.are.equal(sum, adler32(TARGET .. "/" .. fn),
        TARGET .. "/" .. fn .. " changed since spec/fixtures/golden-dflash.json was written: rerun "
        .. "python3 scripts/golden/make_tiny_drafter.py --no-weights")
    end
  end)

  it("reports the tiny drafter's shape", function()
    local i = d.info
    assert.are.same({ 2, 128, 4, 2, 32, 256, 8, 1020 },
      { i.n_layers, i.hidden, i.n_heads, i.n_kv_heads, i.head_dim, i.intermediate, i.block_size, i.mask_token_id })
    assert.are.same({ 1, 2 }, i.taps)
  end)

  it("matches the reference with no context (block at positions 0..7)", function()
    local s = m:new_seq(64)
    s:attach_drafter(d)
    compare(s:draft(cases.empty.bonus), cases.empty)
    s:close()
  end)

  it("matches the reference after a prompt, after the context grows, and after a truncate", function()
    local s = m:new_seq(64)
    s:attach_drafter(d)
    local c = cases.prompt
    s:forward(c.context_tokens)
    local am = s:argmax()
    assert.are.equal(c.bonus, am[#am])   -- the target agrees on the bonus (its greedy token)
    local lp = s:draft(c.bonus)
    compare(lp, c)
    -- a draft leaves the context alone: the same draft again gives the same numbers
    local again = s:draft(c.bonus)
    for k = 0, lp.L * lp.V - 1 do assert.are.equal(lp.data[k], again.data[k]) end
    -- the second round: the accepted path [bonus, g1, g2] joins the context
    local a = cases.accepted
    local path = {}
    for k = #c.context_tokens + 1, #a.context_tokens do path[#path + 1] = a.context_tokens[k] end
    s:forward(path)
    assert.are.equal(#a.context_tokens, s:len())
    compare(s:draft(a.bonus), a)
    -- truncating the sequence drops the drafter context too
    s:truncate(#c.context_tokens)
    compare(s:draft(cases.other.bonus), cases.other)
    s:close()
  end)

  -- after the prompt, verify/accept/commit the tree make_tree(bonus, g1, g2) builds, whose accepted
  -- path is bonus, g1, g2: the next draft must match the reference of that context
  local function through_commit(make_tree, check_accepted)
    local s = m:new_seq(64)
    s:attach_drafter(d)
    local c, a = cases.prompt, cases.accepted
    s:forward(c.context_tokens)
    local t = make_tree(c.bonus, a.context_tokens[#c.context_tokens + 2], a.context_tokens[#c.context_tokens + 3])
    s:verify(t)
    local r = s:accept(t)
    check_accepted(r)
    assert.are.equal(a.bonus, r.bonus)
    s:commit(t)
    assert.are.equal(#a.context_tokens, s:len())
    compare(s:draft(a.bonus), a)
    t:close()
    s:close()
  end

  it("matches the reference when the accepted path arrives through verify/accept/commit", function()
    through_commit(function(bonus, g1, g2)
      return kd.tree.chain(bonus, { g1, g2, (cases.accepted.bonus + 1) % golden.vocab })   -- the third draft misses
    end, function(r) assert.are.equal(3, r.tau) end)
  end)

  it("matches the reference when the accepted path skips drafted nodes (rows 0, 3, 4 of the verify)", function()
    through_commit(function(bonus, g1, g2)
      local V = golden.vocab
      local wrong = (g1 + 1) % V
      -- depth 1: wrong ahead of g1; depth 2: g2 first. Pop order: 1 wrong, 2 wrong>g2, 3 g1, 4 g1>g2
      local rows = { {}, {} }
      for j = 1, V do rows[1][j], rows[2][j] = -30, -30 end
      rows[1][wrong + 1], rows[1][g1 + 1], rows[2][g2 + 1] = -0.1, -0.3, -0.05
      local t = kd.tree.build(rows, 4, { logprobs = true, root = bonus })
      assert.are.equal(bonus, t.root)
      assert.are.same({ wrong, g2, g1, g2 }, t.tokens)
      assert.are.same({ 0, 1, 0, 3 }, t.parents)
      return t
    end, function(r) assert.are.same({ 0, 3, 4 }, r.nodes) end)
  end)

  for _, name in ipairs({ "window", "rope_no_mscale" }) do
    it("matches the reference for the config variant " .. name, function()
      local c = cases[name]
      local dir = variant_dir(c.config_overrides)
      local dv = kd.open_drafter(dir, m)
      local s = m:new_seq(64)
      s:attach_drafter(dv)
      s:forward(c.context_tokens)
      compare(s:draft(c.bonus), c)
      s:close()
      dv:close()
      rmdir(dir)
    end)
  end

  it("differs between the two RoPE amplitudes (the amplitude is applied)", function()
    -- HF: mscale = mscale_all_dim = 1 gives amplitude 1; without them 0.1*ln(64)+1
    assert.are.equal(1.0, cases.prompt.rope_attention_factor)
    assert.is_true(math.abs(cases.rope_no_mscale.rope_attention_factor - (0.1 * math.log(64) + 1)) < 1e-12)
    local x, y = cases.prompt.logprobs[1], cases.rope_no_mscale.logprobs[1]
    local diff = 0
    for j = 1, #x do diff = math.max(diff, math.abs(x[j] - y[j])) end
    assert.is_true(diff > 1e-3)
  end)

  it("rejects attaching to a non-empty sequence, drafting bad tokens, drafting unattached", function()
    local s = m:new_seq(32)
    s:forward({ 5, 6, 7 })
    assert.matches("must be empty", err_of(s.attach_drafter, s, d))
    s:close()
    s = m:new_seq(32)
    s:attach_drafter(d)
    assert.matches("already has a drafter", err_of(s.attach_drafter, s, d))
    assert.matches("bonus token 1024 is outside the vocabulary %[0, 1024%)", err_of(s.draft, s, 1024))
    assert.matches("bonus token %-1", err_of(s.draft, s, -1))
    -- the sequence still works after the errors
    compare(s:draft(cases.empty.bonus), cases.empty)
    s:close()
    local s2 = m:new_seq(16)
    local st = kd.C.kd_draft(s2:handle(), 5, nil)
    assert.are.equal(5, tonumber(st))   -- KD_ERR_STATE
    assert.matches("no drafter attached", kd.last_error())
    s2:close()
  end)

  it("takes each draft row's argmax on the backend: the host argmax of the same log-probs", function()
    local s = m:new_seq(64)
    s:attach_drafter(d)
    assert.matches("no draft since the context last changed", err_of(s.draft_argmax, s))
    local c = cases.prompt
    s:forward(c.context_tokens)
    local lp = s:draft(c.bonus)
    local ids = s:draft_argmax()
    assert.are.same(require("kdtree.policy.dflash").argmax_rows(lp), ids)
    -- the policy's path: a draft kept on the backend
    s:draft(c.bonus, false)
    assert.are.same(ids, s:draft_argmax())
    -- a truncate voids the draft
    s:truncate(#c.context_tokens - 1)
    assert.matches("no draft since the context last changed", err_of(s.draft_argmax, s))
    s:close()
    local s2 = m:new_seq(16)
    assert.matches("no drafter attached", err_of(s2.draft_argmax, s2))
    s2:close()
  end)

  it("keeps the context within the sequence capacity", function()
    local s = m:new_seq(8)
    s:attach_drafter(d)
    s:forward({ 1, 2, 3, 4, 5, 6, 7, 8 })
    local lp = s:draft(9)             -- block positions 8..15 lie past the capacity: still fine
    assert.are.equal(7, lp.L)
    s:close()
  end)
end)

describe("DFlash drafter config", function()
  local m
  setup(function() m = kd.open_model(TARGET, { backend = backend }) end)
  teardown(function() if m then m:close() end end)

  -- the K2.6 drafter as published (z-lab/Kimi-K2.6-DFlash shape)
  local K26 = {
    architectures = { "DFlashDraftModel" }, model_type = "qwen3",
    block_size = 8, num_target_layers = 61,
    dflash_config = { mask_token_id = 163838, target_layer_ids = { 1, 12, 24, 35, 47, 58 } },
    vocab_size = 163840, hidden_size = 7168, intermediate_size = 18432, num_hidden_layers = 6,
    num_attention_heads = 64, num_key_value_heads = 8, head_dim = 128, hidden_act = "silu",
    attention_bias = false, rms_norm_eps = 1e-5, rope_theta = 50000, max_position_embeddings = 262144,
    rope_scaling = { type = "yarn", factor = 64, beta_fast = 32, beta_slow = 1, mscale = 1,
                     mscale_all_dim = 1, original_max_position_embeddings = 4096 },
    tie_word_embeddings = false, torch_dtype = "bfloat16",
  }

  local function open_raw(dir, model)
    local out = ffi.new("kd_drafter*[1]")
    local st = kd.C.kd_drafter_open(dir, model and model:handle() or nil, out)
    return tonumber(st), out[0], kd.last_error()
  end

  it("parses the K2.6 drafter config (inspection: no target, no weights)", function()
    local dir = tmpdir()
    write_file(dir .. "/config.json", json.encode(K26))
    local st, h = open_raw(dir, nil)
    assert.are.equal(0, st)
    local ci = ffi.new("kd_drafter_info")
    assert.are.equal(0, tonumber(kd.C.kd_drafter_get_info(h, ci)))
    local i = require("kdtree.util").drafter_info(ci)
    assert.are.same({ 6, 7168, 64, 8, 128, 18432, 8, 163838 },
      { i.n_layers, i.hidden, i.n_heads, i.n_kv_heads, i.head_dim, i.intermediate, i.block_size, i.mask_token_id })
    assert.are.same({ 1, 12, 24, 35, 47, 58 }, i.taps)
    kd.C.kd_drafter_close(h)
    -- against the tiny target it is a clear mismatch, found before any weights are read
    local msg = err_of(kd.open_drafter, dir, m)
    assert.matches("hidden_size", msg)
    assert.matches("7168", msg)
    assert.matches("128", msg)
    rmdir(dir)
  end)

  it("derives default tap layers from num_target_layers when target_layer_ids is absent", function()
    local dir = tmpdir()
    local c = json.decode(json.encode(K26))
    c.dflash_config.target_layer_ids = nil
    c.num_target_layers = 36
    c.num_hidden_layers = 5
    write_file(dir .. "/config.json", json.encode(c))
    local st, h = open_raw(dir, nil)
    assert.are.equal(0, st)
    local ci = ffi.new("kd_drafter_info")
    kd.C.kd_drafter_get_info(h, ci)
    assert.are.same({ 1, 9, 17, 25, 33 }, require("kdtree.util").drafter_info(ci).taps)
    kd.C.kd_drafter_close(h)
    rmdir(dir)
  end)

  local mismatches = {
    { "vocab", { vocab_size = 2048 }, { "vocab_size", "2048", "1024" } },
    { "tap layer out of range", { dflash_config = { mask_token_id = 1020, target_layer_ids = { 1, 4 } } },
      { "target_layer_ids%[1%]", "layer 4", "4 layers" } },
    { "tap on the last layer", { dflash_config = { mask_token_id = 1020, target_layer_ids = { 1, 3 } } },
      { "target_layer_ids%[1%]", "layer 3", "final norm" } },
    { "mask id outside the vocabulary", { dflash_config = { mask_token_id = 1024, target_layer_ids = { 1, 2 } } },
      { "mask_token_id", "1024", "%[0, 1024%)" } },
    { "hidden size", { hidden_size = 64, head_dim = 16 }, { "hidden_size", "drafter 64", "target hidden_size 128" } },
    { "target layer count", { num_target_layers = 61 }, { "num_target_layers", "61", "4" } },
    { "architecture", { architectures = { "Qwen3ForCausalLM" } }, { "architectures", "DFlashDraftModel", "Qwen3ForCausalLM" } },
    { "missing dflash_config", { dflash_config = json.null }, { "dflash_config" } },
    { "missing block_size", { block_size = json.null }, { "block_size" } },
    { "heads not divisible", { num_key_value_heads = 3 }, { "num_key_value_heads", "3", "4" } },
    { "unknown rope type", { rope_scaling = { type = "longrope", factor = 4 } }, { "rope_scaling", "longrope" } },
    { "sliding layer without a window", { layer_types = { "full_attention", "sliding_attention" } }, { "sliding_window" } },
    { "attention bias", { attention_bias = true }, { "attention_bias" } },
  }
  for _, t in ipairs(mismatches) do
    it("names the field on a mismatch: " .. t[1], function()
      local dir = variant_dir(t[2])
      local msg = err_of(kd.open_drafter, dir, m)
      assert.matches(dir .. "/config.json", msg, 1, true)
      for _, pat in ipairs(t[3]) do assert.matches(pat, msg) end
      rmdir(dir)
    end)
  end

  -- a safetensors file with zero data for the given {name, shape} list (BF16)
  local function write_safetensors(path, tensors)
    local hdr, off = {}, 0
    for _, t in ipairs(tensors) do
      local n = (t[3] == "I32" or t[3] == "F32") and 4 or 2
      for _, x in ipairs(t[2]) do n = n * x end
      hdr[t[1]] = { dtype = t[3] or "BF16", shape = t[2], data_offsets = { off, off + n } }
      off = off + n
    end
    local h = json.encode(hdr)
    h = h .. string.rep(" ", (8 - #h % 8) % 8)
    local len = #h
    local le = {}
    for i = 1, 8 do le[i] = string.char(len % 256); len = math.floor(len / 256) end
    write_file(path, table.concat(le) .. h .. string.rep("\0", off))
  end

  it("names the tensor on a wrong shape, a wrong dtype or a missing tensor", function()
    local dir = variant_dir({}, false)
    write_safetensors(dir .. "/model.safetensors", { { "fc.weight", { 128, 128 } } })
    local msg = err_of(kd.open_drafter, dir, m)
    assert.matches("fc.weight", msg)
    assert.matches("expected shape %[128, 256%], got %[128, 128%]", msg)
    write_safetensors(dir .. "/model.safetensors", { { "fc.weight", { 128, 256 }, "I32" } })
    msg = err_of(kd.open_drafter, dir, m)
    assert.matches("fc.weight", msg)
    assert.matches("BF16 or F32", msg)
    write_safetensors(dir .. "/model.safetensors", { { "model.fc.weight", { 128, 256 } } })
    msg = err_of(kd.open_drafter, dir, m)
    assert.matches("hidden_norm.weight' is missing", msg)
    os.remove(dir .. "/model.safetensors")
    msg = err_of(kd.open_drafter, dir, m)
    assert.matches("model.safetensors", msg)
    -- after all that, the real drafter still opens and drafts
    local d = kd.open_drafter(DRAFTER, m)
    local s = m:new_seq(16)
    s:attach_drafter(d)
    compare(s:draft(cases.empty.bonus), cases.empty)
    s:close()
    d:close()
    rmdir(dir)
  end)
end)
