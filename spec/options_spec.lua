-- options_spec.lua: the engine's behaviour switches are options (kd_model_options,
-- kd_seq_options), not environment variables: each field is checked with a message naming it
-- (in C and in the Lua layer), each takes effect where it should, the options a backend cannot
-- act on are inert there (the same logits bits), and the old environment variables map to the
-- same options in Lua only (kdtree.options from_env, used by the CLI and the REPL). The parts about
-- the CPU backend pin it; the rest runs on KDTREE_BACKEND.
-- Alternative paths proven elsewhere: the host DDTree round (ddtree_round_spec), step graphs
-- on / eager / off per sequence (graphs_spec, draft_graphs_spec, emulated on the CPU), max_rows'
-- chunked prefill (forward_spec), the MLA kernel choices (mla_spec, #gpu: CUDA only).
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local Options = require("kdtree.options")
local G = require("helpers.graphs")
local ffi, C = kd.ffi, kd.C

local TARGET = "models/tiny-k2.6"

local function lua_error(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

describe("model and sequence options", function()
  it("the Lua layer names the option and its values", function()
    assert.matches('kdtree: open_model: graphs: expected "eager", "off" or "on", got "sometimes"',
      lua_error(kd.open_model, TARGET, { graphs = "sometimes" }), 1, true)
    assert.matches('ddtree_round: expected "backend" or "host", got "device"',
      lua_error(kd.open_model, TARGET, { ddtree_round = "device" }), 1, true)
    assert.matches('mla_kernel: expected "cuda_cores" or "tensor_cores", got 1',
      lua_error(kd.open_model, TARGET, { mla_kernel = 1 }), 1, true)
    assert.matches("kdtree: open_model: unknown option grpahs", lua_error(kd.open_model, TARGET, { grpahs = "off" }), 1, true)
    assert.matches("mla_row_groups: expected an integer, got 1.5",
      lua_error(kd.open_model, TARGET, { mla_row_groups = 1.5 }), 1, true)
    assert.matches("graphs_verbose: expected a boolean, got 1", lua_error(kd.open_model, TARGET, { graphs_verbose = 1 }), 1,
      true)
    assert.matches("shared_expert_branch: expected a boolean, got 1",
      lua_error(kd.open_model, TARGET, { shared_expert_branch = 1 }), 1, true)
    -- the C field's three values: nil -> 0 (by the step's rows), true -> 1 (always beside), false -> -1
    for v, want in pairs({ [true] = 1, [false] = -1 }) do
      assert.are.equal(want, Options.model({ shared_expert_branch = v }).shared_expert_branch)
    end
    assert.are.equal(0, Options.model({}).shared_expert_branch)
    assert.matches("open_model: seq: unknown option rows", lua_error(kd.open_model, TARGET, { seq = { rows = 4 } }), 1, true)
    local m = kd.open_model(TARGET)
    assert.matches("kdtree: new_seq: unknown option graph", lua_error(m.new_seq, m, 8, { graph = "off" }), 1, true)
    assert.matches('new_seq: draft_graphs: expected "eager", "off" or "on", got "no"',
      lua_error(m.new_seq, m, 8, { draft_graphs = "no" }), 1, true)
    m:close()
  end)

  it("the C API refuses each out-of-range field, naming it, and stays usable", function()
    local cases = {
      { "graphs", 4, "options.graphs is 4: expected KD_GRAPHS_DEFAULT (0), KD_GRAPHS_CAPTURE (1), KD_GRAPHS_OFF (2) or KD_GRAPHS_EAGER (3)" },
      { "draft_graphs", -1, "options.draft_graphs is -1" },
      { "ddtree_round", 3, "options.ddtree_round is 3" },
      { "mla_kernel", 2, "options.mla_kernel is 2: expected KD_MLA_DEFAULT (0) or KD_MLA_CUDA_CORES (1)" },
      { "mla_value_slices", 3, "options.mla_value_slices is 3: expected 0 (by the shape rule), -1 (no split), 1, 2 or 4" },
      { "mla_row_groups", 2, "options.mla_row_groups is 2: expected 0 (by the shape rule), 1 or 4" },
      { "shared_expert_branch", 2, "options.shared_expert_branch is 2: expected 0 (by the step's rows), 1 (beside the routed experts) or -1 (in line)" },
      { "shared_expert_branch", -2, "options.shared_expert_branch is -2" },
    }
    local out = ffi.new("kd_model*[1]")
    for _, c in ipairs(cases) do
      local o = ffi.new("kd_model_options")
      o[c[1]] = c[2]
      assert.are.equal(C.KD_ERR_ARG, C.kd_model_open(TARGET, o, out), c[1])
      assert.matches("kd_model_open: " .. c[3], kd.last_error(), 1, true)
    end
    kd.check(C.kd_model_open(TARGET, nil, out), "kd_model_open (NULL options)")
    local m = out[0]
    local s = ffi.new("kd_seq*[1]")
    for _, c in ipairs({ { "max_rows", -1, "options.max_rows is -1: expected 0 (the default) or a positive number of rows" },
                         { "graphs", 5, "options.graphs is 5" }, { "draft_graphs", 9, "options.draft_graphs is 9" } }) do
      local o = ffi.new("kd_seq_options")
      o[c[1]] = c[2]
      assert.are.equal(C.KD_ERR_ARG, C.kd_seq_new_opts(m, 16, o, s), c[1])
      assert.matches("kd_seq_new: " .. c[3], kd.last_error(), 1, true)
    end
    kd.check(C.kd_seq_new_opts(m, 16, nil, s), "kd_seq_new_opts (NULL options)")
    kd.check(C.kd_forward(s[0], ffi.new("int32_t[3]", { 5, 77, 300 }), 3, nil, nil), "kd_forward")
    assert.are.equal(3, C.kd_seq_len(s[0]))
    C.kd_seq_free(s[0])
    C.kd_model_close(m)
  end)

  it("max_rows bounds the rows of one forward; opts.seq gives every new_seq its defaults", function()
    local m = kd.open_model(TARGET, { backend = "cpu", seq = { max_rows = 4 } })
    local toks = { 5, 77, 300, 12, 999, 77, 300, 8, 9, 10 }
    local s = m:new_seq(32)
    s:forward(toks)                              -- chunks of 2 + 4 + 4
    assert.are.equal(10, s:len())
    assert.are.equal(4, s:out_rows())
    local whole = m:new_seq(32, { max_rows = 0 })   -- the call's options over the model's
    whole:forward(toks)
    assert.are.equal(10, whole:out_rows())
    assert.are.same(whole:logits(10), s:logits(4))
    local big = m:new_seq(32, { max_rows = 5000 })  -- above the 1024 bound: the bound
    big:forward(toks)
    assert.are.equal(10, big:out_rows())
    s:close(); whole:close(); big:close(); m:close()
  end)

  it("options the CPU backend cannot act on are inert there: the same logits bits", function()
    local toks = { 5, 77, 300, 12, 999 }
    local function run(opts)
      opts.backend = "cpu"
      local m = kd.open_model(TARGET, opts)
      local s = m:new_seq(16)
      s:forward(toks)
      local r = {}
      for i = 1, #toks do r[i] = s:logits(i) end
      local graphs = m:memory().graph_launches
      s:close(); m:close()
      return r, graphs
    end
    local ref = run({})
    for _, o in ipairs({ { mla_kernel = "cuda_cores" }, { mla_value_slices = -1, mla_row_groups = 4 },
                         { graphs = "on", draft_graphs = "eager", graphs_verbose = true },
                         { shared_expert_branch = true }, { shared_expert_branch = false } }) do
      local got, launches = run(o)
      assert.are.same(ref, got)
      assert.are.equal(0, launches)
    end
  end)

  it("the model's graphs options reach its sequences and drafter attachments (emulated graph ops)", function()
    local m = kd.open_model(TARGET, { backend = "cpu", graphs = "off", draft_graphs = "off" })
    G.emulate(m)
    local d = kd.open_drafter("models/tiny-k2.6-dflash", m)
    local prompt = { 5, 77, 300, 12 }
    local function decode(s, n)
      s:forward(prompt)
      local tok = s:argmax()[#prompt]
      for _ = 1, n do
        s:forward({ tok })
        tok = s:argmax()[1]
      end
    end
    local function drafts(s, n) for i = 1, n do s:draft(prompt[1 + i % #prompt], false) end end
    local before = m:memory()
    local s = m:new_seq(32)
    s:attach_drafter(d)
    decode(s, 6); drafts(s, 4)
    s:close()
    local after = m:memory()
    assert.are.equal(0, after.graph_captures - before.graph_captures, "graphs off: no capture")
    -- the sequence's option over the model's: steps captured; the draft pass follows the model's off
    s = m:new_seq(32, { graphs = "on" })
    s:attach_drafter(d)
    decode(s, 6)
    local steps = m:memory()
    assert.is_true(steps.graph_launches - after.graph_launches >= 4, "steps replayed")
    drafts(s, 4)
    local drafted = m:memory()
    assert.are.equal(steps.graph_captures, drafted.graph_captures, "draft_graphs off: the draft pass never captured")
    s:close()
    -- and with draft_graphs on for this sequence the draft pass captures too
    s = m:new_seq(32, { graphs = "off", draft_graphs = "on" })
    s:attach_drafter(d)
    s:forward(prompt)
    drafts(s, 4)
    assert.is_true(m:memory().graph_captures > drafted.graph_captures, "draft_graphs on: the draft pass captured")
    s:close(); d:close(); m:close()
  end)
end)

describe("graphs_verbose", function()
  -- a process that decodes on an emulated model whose first capture is refused; its stderr
  local function decode_refused(verbose)
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write(string.format([[
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local G = require("helpers.graphs")
local m = kd.open_model("%s", { backend = "cpu", graphs_verbose = %s })
G.emulate(m)
G.C.kd_testing_graphs_refuse(1)
local s = m:new_seq(16)
s:forward({ 5, 77, 300 })
for _ = 1, 4 do s:forward({ s:argmax()[1] }) end
s:close(); m:close()
]], TARGET, tostring(verbose)))
    f:close()
    local lib = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
    local p = io.popen(lib .. "luajit " .. script .. " 2>&1 >/dev/null; echo rc=$?")
    local out = p:read("*a")
    p:close()
    os.remove(script)
    return out
  end

  it("says on stderr why a capture failed, and only when on", function()
    local on = decode_refused(true)
    assert.matches("kdtree: step %(1 rows, causal, cache bound %d+%): graph capture failed, running eagerly: ", on)
    assert.matches("rc=0\n$", on)
    assert.are.equal("rc=0\n", decode_refused(false))
  end)
end)

describe("the old environment variables (kdtree.options from_env, Lua only)", function()
  local function env(t) return function(name) return t[name] end end

  it("map to the options, and explicit options win", function()
    assert.are.same({}, Options.from_env({}, env({})))
    assert.are.same({ backend = "cuda", graphs = "off", draft_graphs = "off", graphs_verbose = true,
      ddtree_round = "host", mla_kernel = "cuda_cores", mla_value_slices = -1, mla_row_groups = 4, seq = { max_rows = 8 } },
      Options.from_env({}, env({ KDTREE_BACKEND = "cuda", KDTREE_CUDA_GRAPHS = "0", KDTREE_CUDA_DRAFT_GRAPHS = "off",
        KDTREE_CUDA_GRAPHS_VERBOSE = "1", KDTREE_DDTREE_DEVICE = "0", KDTREE_MLA_TC = "0", KDTREE_MLA_TC_VSPLIT = "0",
        KDTREE_MLA_TC_RG = "4", KDTREE_SEQ_ROWS = "8" })))
    assert.are.same({ graphs = "on", ddtree_round = "backend", mla_value_slices = 2 },
      Options.from_env({}, env({ KDTREE_CUDA_GRAPHS = "1", KDTREE_DDTREE_DEVICE = "1", KDTREE_MLA_TC_VSPLIT = "2",
        KDTREE_MLA_TC = "1", KDTREE_MLA_TC_RG = "2", KDTREE_CUDA_GRAPHS_VERBOSE = "0", KDTREE_SEQ_ROWS = "x" })))
    assert.are.same({ graphs = "eager" }, Options.from_env({}, env({ KDTREE_CUDA_GRAPHS = "eager" })))
    assert.are.same({ graphs = "on", ddtree_round = "backend", seq = { max_rows = 2 } },
      Options.from_env({ graphs = "on", seq = { max_rows = 2 } },
        env({ KDTREE_CUDA_GRAPHS = "0", KDTREE_DDTREE_DEVICE = "1", KDTREE_SEQ_ROWS = "8" })))
  end)

  it("the command line's flags are checked, naming the flag", function()
    local t, err = Options.from_flags({ graphs = "off", ddtree_round = "host", mla_kernel = "cuda_cores" })
    assert.are.same({ graphs = "off", ddtree_round = "host", mla_kernel = "cuda_cores" }, t)
    assert.is_nil(err)
    t, err = Options.from_flags({ draft_graphs = "1" })
    assert.is_nil(t)
    assert.are.equal([[--draft-graphs: expected "eager", "off" or "on", got '1']], err)
  end)

  it("the CLI runs the DDTree round on the host under --ddtree-round host, and the same tokens come out", function()
    local lib = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
    local function gen(extra)
      local p = io.popen(lib .. "luajit scripts/kdtree generate --model models/tiny-k2.6 --prompt-ids 5,77,300 -n 12 --ids " ..
        "--draft models/tiny-k2.6-dflash --temperature 0.8 --seed 3 " .. extra .. " 2>&1; echo rc=$?")
      local out = p:read("*a")
      p:close()
      return out
    end
    local ref = gen("")
    assert.matches("^[%d ]+\nrc=0\n$", ref)
    assert.are.equal(ref, gen("--ddtree-round host --graphs off"))
    assert.are.equal(ref, gen("--ddtree-round=backend --draft-graphs eager"))
    assert.matches("%-%-ddtree%-round: expected \"backend\" or \"host\", got 'gpu'.*rc=2", gen("--ddtree-round gpu"))
  end)
end)
