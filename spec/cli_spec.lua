-- cli_spec: scripts/kdtree as a user runs it: generate prints the ids the Lua API computes,
-- the speculative policies print the same ids, -h documents every flag, bad flags exit 2,
-- engine errors exit 1 with the engine's message, inspect agrees with kd.inspect.
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local kd = require("kdtree")
local gen = require("kdtree.generate")
local json = require("dkjson")

local MODEL = "models/tiny-k2.6"
local DRAFT = "models/tiny-k2.6-dflash"
local CLI = "scripts/kdtree"

local function tmpname() return os.tmpname() end

-- run the CLI; returns (exit code, stdout, stderr); input: what standard input reads
local function run(args, input)
  local out, err = tmpname(), tmpname()
  local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
  local stdin = "/dev/null"
  if input then
    stdin = tmpname()
    local f = io.open(stdin, "wb"); f:write(input); f:close()
  end
  local p = io.popen(string.format("%sluajit %s %s <%s >%s 2>%s; echo $?", env, CLI, args, stdin, out, err))
  local code = tonumber(p:read("*a"):match("(%d+)"))
  p:close()
  if input then os.remove(stdin) end
  local function slurp(f) local h = io.open(f); local s = h:read("*a"); h:close(); os.remove(f); return s end
  return code, slurp(out), slurp(err)
end

local function split_ids(s)
  local t = {}
  for w in s:gmatch("%S+") do t[#t + 1] = tonumber(w) end
  return t
end

-- the Lua API's greedy and sampled ar ids after 5,77,300 (backend nil: the default one)
local function references(backend)
  local m = kd.open_model(MODEL, { backend = backend })
  local greedy = gen.run(m, { 5, 77, 300 }, { policy = "ar", n = 24 }).tokens
  local sampled = gen.run(m, { 5, 77, 300 }, { policy = "ar", n = 24,
    sampler = { temperature = 0.8, top_p = 0.9, top_k = 40, seed = 7 } }).tokens
  m:close()
  return greedy, sampled
end

describe("kdtree generate", function()
  local ref_greedy, ref_sampled
  setup(function() ref_greedy, ref_sampled = references() end)

  it("prints the greedy ids, space-separated, with --ids", function()
    local code, out, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids")
    assert.are.equal(0, code, err)
    assert.truthy(out:match("^[%d ]+\n$"), out)
    assert.are.same(ref_greedy, split_ids(out))
  end)

  it("defaults to the shipped mini-code model", function()
    local code, out = run("generate --prompt-ids 5,77,300 -n 24 --ids")
    assert.are.equal(0, code)
    local m = kd.open_model("models/mini-code")
    local ref = gen.run(m, { 5, 77, 300 }, { policy = "ar", n = 24 }).tokens
    m:close()
    assert.are.same(ref, split_ids(out))
    assert.are_not.same(ref_greedy, ref)              -- the tiny model's ids would not pass
  end)

  it("ddtree and dflash print the same ids as ar", function()
    for _, extra in ipairs({ "--policy ddtree --budget 16", "--policy ddtree --budget 0", "--policy dflash",
                             "--draft-is-ngram" }) do
      local flags = extra == "--draft-is-ngram" and "--draft ngram --budget 8"
        or ("--draft " .. DRAFT .. " " .. extra)
      local code, out, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids " .. flags)
      assert.are.equal(0, code, err)
      assert.are.same(ref_greedy, split_ids(out))
    end
  end)

  -- Both sides on the CPU backend, where the split is exact (fp32 partials, fp32 sum): what this
  -- proves is the CLI's --tp plumbing, and exact equality is the sharpest check of it. On CUDA the
  -- ranks round their partials to bf16 before the sum, so TP-2's greedy tokens part from TP-1's
  -- at near-ties (spec/tp_cuda_spec.lua states and checks that rule); what holds exactly there is
  -- that --tp 2's ddtree prints --tp 2's ar ids, checked below when the CUDA backend is in use.
  it("--tp 2 prints the ids --tp 1 prints, greedy and sampled, ar and ddtree; a tp that does not split exits 1", function()
    local s = "--temperature 0.8 --top-p 0.9 --top-k 40 --seed 7"
    local cpu_greedy, cpu_sampled = references("cpu")
    for _, case in ipairs({ { "", cpu_greedy }, { s, cpu_sampled } }) do
      for _, policy in ipairs({ "", "--draft " .. DRAFT .. " --budget 8" }) do
        local args = "generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids --backend cpu " .. case[1] .. " " .. policy
        local code1, out1, err1 = run(args .. " --tp 1")
        local code2, out2, err2 = run(args .. " --tp 2")
        assert.are.equal(0, code1, err1)
        assert.are.equal(0, code2, err2)
        assert.are.same(case[2], split_ids(out1))
        assert.are.same(split_ids(out1), split_ids(out2))
      end
    end
    if os.getenv("KDTREE_BACKEND") == "cuda" then   -- two ranks on GPU 0 (the loopback)
      local args = "generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids --backend cuda --tp 2 --devices 0,0"
      local code1, out1, err1 = run(args)
      local code2, out2, err2 = run(args .. " --draft " .. DRAFT .. " --budget 8")
      assert.are.equal(0, code1, err1)
      assert.are.equal(0, code2, err2)
      assert.are.equal(24, #split_ids(out1), out1)
      assert.are.same(split_ids(out1), split_ids(out2))
    end
    local code, _, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 4 --ids --tp 3 --backend cpu")
    assert.are.equal(1, code)
    assert.truthy(err:find("tp 3 does not divide num_attention_heads (4)", 1, true), err)
  end)

  it("samples with --temperature/--top-p/--top-k/--seed, identically under ddtree", function()
    local s = "--temperature 0.8 --top-p 0.9 --top-k 40 --seed 7"
    local code, out = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids " .. s)
    assert.are.equal(0, code)
    assert.are.same(ref_sampled, split_ids(out))
    code, out = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids --draft " .. DRAFT .. " --budget 8 " .. s)
    assert.are.equal(0, code)
    assert.are.same(ref_sampled, split_ids(out))
  end)

  it("--stats prints a table of rounds with tau and a summary on stderr; stdout keeps the output alone", function()
    local code, out, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 16 --draft " .. DRAFT .. " --budget 16 --stats")
    assert.are.equal(0, code, err)
    assert.truthy(err:find("round", 1, true))
    assert.truthy(err:find("tau", 1, true))
    assert.truthy(err:match("mean tau %d"), err)
    local tok = kd.open_tokenizer(MODEL)
    local want = {}
    for i = 1, 16 do want[i] = ref_greedy[i] end
    assert.are.equal(tok:decode(want), out)   -- ids in, the model's tokenizer's text out
    tok:close()
    code, out, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 16 --draft " .. DRAFT .. " --stats --ids")
    assert.are.equal(0, code)
    assert.truthy(out:match("^[%d ]+\n$"))
    assert.truthy(err:find("mean tau", 1, true))
  end)

  it("accepts --flag=value", function()
    local code, out = run("generate --model " .. MODEL .. " --prompt-ids=5,77,300 -n 24 --ids --policy=ar")
    assert.are.equal(0, code)
    assert.are.same(ref_greedy, split_ids(out))
  end)

  it("takes a text prompt or a chat message through the checkpoint's tokenizer, and prints text", function()
    local tok = kd.open_tokenizer(MODEL)
    local m = kd.open_model(MODEL)
    local function ref(ids, eos) return gen.run(m, ids, { policy = "ar", n = 6, eos = eos }).tokens end
    local code, out = run("generate --model " .. MODEL .. " --prompt 'The quick brown fox' -n 6 --ids")
    assert.are.equal(0, code)
    assert.are.same(ref(tok:encode("The quick brown fox")), split_ids(out))
    local chat_ids = tok:chat({ { role = "user", content = "Hello! 你好" } })
    code, out = run("generate --model " .. MODEL .. " --chat 'Hello! 你好' -n 6 --ids --draft " .. DRAFT)
    assert.are.equal(0, code)
    local chat_eos = tok:chat_stops()   -- a chat turn's own stops too
    assert.are.same({ tok:special("<|im_end|>"), tok:special("[EOT]") }, chat_eos)
    for _, id in ipairs(m.info.eos) do chat_eos[#chat_eos + 1] = id end
    assert.are.same(ref(chat_ids, chat_eos), split_ids(out))
    -- sampled: the first seed whose turn (on this backend: where a sample lands depends on the
    -- backend's logits) produces one of the chat's stops before 24 tokens; the CLI with that seed
    -- prints the same ids and stops right after the stop it produced (the greedy run above meets
    -- no stop, so a CLI that stopped only at the model's eos would print more)
    local is_stop = {}
    for _, id in ipairs(chat_eos) do is_stop[id] = true end
    local function sampled_turn(seed)
      return gen.run(m, chat_ids, { policy = "ar", n = 24, eos = chat_eos,
        sampler = { temperature = 1.5, top_k = 0, top_p = 1, seed = seed } }).tokens
    end
    local seed, sampled
    for s = 1, 300 do
      local t = sampled_turn(s)
      if #t < 24 then seed, sampled = s, t; break end
    end
    assert.truthy(seed, "no seed in 1..300 ends the sampled turn at a stop")
    assert.is_true(is_stop[sampled[#sampled]], table.concat(sampled, " "))
    for i = 1, #sampled - 1 do assert.is_nil(is_stop[sampled[i]], "a stop before the end: " .. table.concat(sampled, " ")) end
    code, out = run("generate --model " .. MODEL .. " --chat 'Hello! 你好' -n 24 --ids --temperature 1.5 --seed " .. seed)
    assert.are.equal(0, code)
    assert.are.same(sampled, split_ids(out))
    local err
    code, out, err = run("generate --model " .. MODEL .. " --prompt 'The quick brown fox' -n 6")
    assert.are.equal(0, code, err)
    assert.are.equal(tok:decode(ref(tok:encode("The quick brown fox"))), out)   -- the raw text, nothing else
    code, out, err = run("generate --model " .. MODEL .. " --prompt hi --tokenizer /nonexistent/tok -n 2")
    assert.are.equal(1, code)
    assert.truthy(err:find("/nonexistent/tok/tiktoken.model: cannot open", 1, true), err)
    m:close()
    tok:close()
  end)
end)

describe("kdtree help and bad flags", function()
  it("-h documents every command and every generate flag", function()
    local code, out = run("-h")
    assert.are.equal(0, code)
    for _, c in ipairs({ "generate", "inspect", "repl" }) do assert.truthy(out:find(c, 1, true)) end
    code, out = run("generate --help")
    assert.are.equal(0, code)
    for _, f in ipairs({ "--model", "--prompt-ids", "-n", "--ids", "--policy", "--draft", "--budget",
                         "--temperature", "--top-p", "--top-k", "--seed", "--stats", "--backend" }) do
      assert.truthy(out:find("\n  " .. f .. " ", 1, true), "help lacks " .. f)
    end
    code, out = run("help inspect")
    assert.are.equal(0, code)
    assert.truthy(out:find("--model", 1, true))
  end)

  it("exits 2 with a message on a bad command line", function()
    local cases = {
      { "generate --prompt-ids 5,77 --bogus", "unknown flag --bogus" },
      { "generate --prompt-ids 5,x", "--prompt-ids: expected comma-separated token ids, got '5,x'" },
      { "generate --prompt-ids 5 -n", "-n needs a value" },
      { "generate --prompt-ids 5 -n two", "-n: expected an integer, got 'two'" },
      { "generate -n 3", "give the prompt once: --prompt-ids 5,77,300, --prompt TEXT, --prompt-file FILE or --chat TEXT" },
      { "generate --prompt-ids 5 --prompt-file /nonexistent/p.txt", "give the prompt once" },
      { "generate --prompt-file /nonexistent/p.txt", "--prompt-file: cannot open /nonexistent/p.txt" },
      { "generate --model --prompt-ids 5,77", "--model needs a value (DIR), got the flag --prompt-ids" },
      { "generate --prompt-ids 5 --system hi", "--system is for --chat" },
      { "generate --prompt-ids 5 --top-p 0.9", "--top-p is a sampling flag: give --temperature T > 0 too" },
      { "generate --prompt-ids 5 --seed 3 --temperature 0", "--seed is a sampling flag" },
      { "generate --prompt-ids 5 --min-p 0.1", "--min-p is a sampling flag" },
      { "generate --prompt-ids 5 --ids --json", "--ids and --json: choose one output" },
      -- checked before the model loads: the model named here does not exist
      { "generate --model /nonexistent/m --prompt-ids 5 --draft " .. DRAFT .. " --budget 2000",
        "--budget: expected 0..1023 (a tree and its root verify in one forward of at most 1024 rows), got 2000" },
      { "generate --model /nonexistent/m --prompt-ids 5 --draft ngram --depth 100", "--depth: expected 1..64, got 100" },
      { "generate --prompt-ids 5 --prompt hi", "give the prompt once" },
      { "generate --prompt ''", "--prompt: expected some text" },
      { "generate --prompt-ids 5 --ids --tokenizer models/tiny-k2.6", "--tokenizer does nothing with --prompt-ids and --ids" },
      { "generate --prompt-ids 5 --policy beam", "--policy: expected ar, dflash or ddtree, got 'beam'" },
      { "generate --prompt-ids 5 --policy ddtree", "--policy ddtree needs --draft" },
      { "generate --prompt-ids 5 --draft ngram --budget -4", "--budget: expected 0..1023" },
      { "generate --prompt-ids 5 --backend tpu", "--backend: expected cpu or cuda, got 'tpu'" },
      { "frobnicate", "unknown command 'frobnicate'" },
      { "inspect --ids", "unknown flag --ids" },
    }
    for _, c in ipairs(cases) do
      local code, out, err = run(c[1])
      assert.are.equal(2, code, c[1])
      assert.are.equal("", out, c[1])
      assert.truthy(err:find(c[2], 1, true), c[1] .. " -> " .. err)
    end
  end)

  it("exits 1 with the engine's message, without Lua source locations, when the model cannot load", function()
    local code, out, err = run("generate --model /nonexistent/model --prompt-ids 5 -n 2 --ids")
    assert.are.equal(1, code)
    assert.are.equal("", out)
    assert.are.equal("kdtree: kd_model_open(/nonexistent/model) failed (io): /nonexistent/model/config.json: "
      .. "cannot open: No such file or directory\n", err)
  end)

  it("--version names the library's version and the backends built in", function()
    local code, out = run("--version")
    assert.are.equal(0, code)
    local want = { "cpu" }
    if kd.backend_available("cuda") then want[2] = "cuda" end
    assert.are.equal(string.format("kdtree %s (backends: %s)\n", kd.version(), table.concat(want, ", ")), out)
  end)
end)

describe("kdtree inspect", function()
  it("prints layers, experts and bytes by kind, human-readable and exact", function()
    local r = kd.inspect(MODEL)
    local code, out, err = run("inspect --model " .. MODEL)
    assert.are.equal(0, code, err)
    assert.truthy(out:find(string.format("%d layers", r.info.n_layers), 1, true))
    assert.truthy(out:find(string.format("%d routed", r.info.n_experts), 1, true))
    assert.truthy(out:find("routed experts", 1, true))
    local exact = string.format("%.0f", r.bytes_total):reverse():gsub("(%d%d%d)", "%1 "):reverse():gsub("^ ", "")
    assert.truthy(out:find(exact, 1, true), "total " .. exact .. " not in\n" .. out)
  end)

  it("--json gives exactly kd.inspect's report", function()
    local r = kd.inspect(MODEL)
    local code, out = run("inspect --json --model " .. MODEL)
    assert.are.equal(0, code)
    local j = json.decode(out)
    assert.are.equal(MODEL, j.model)
    j.model = nil
    -- integers exactly; floats through JSON's decimal text (dkjson writes 15 digits)
    local function same(a, b, path)
      assert.are.equal(type(a), type(b), path)
      if type(a) == "table" then
        for k, v in pairs(a) do same(v, b[k], path .. "." .. tostring(k)) end
        for k in pairs(b) do assert.is_not_nil(a[k], path .. "." .. tostring(k)) end
      elseif type(a) == "number" and a ~= math.floor(a) then
        assert.is_true(math.abs(a - b) <= 1e-12 * math.abs(a), path)
      else
        assert.are.equal(a, b, path)
      end
    end
    same(r, j, "report")
  end)
end)

describe("kdtree repl", function()
  it("evaluates expressions with kd preloaded (plain input)", function()
    local f = os.tmpname()
    local h = io.open(f, "w")
    h:write("1 + 2\n", "kd.version()\n", "load('" .. MODEL .. "')\n", "prefill{5, 77, 300}\n", "x = \n 40 + 2\n", "x\n",
      "prefill'Hello'\n", "#tok:encode'Hello'\n")
    h:close()
    local p = io.popen("KDTREE_NO_READLINE=1 luajit " .. CLI .. " repl < " .. f .. " 2>&1")
    local out = p:read("*a")
    p:close()
    os.remove(f)
    assert.truthy(out:find("\n?kd> 3\n", 1, false), out)
    assert.truthy(out:find('"' .. kd.version() .. '"', 1, true), out)
    assert.truthy(out:find("next token (bonus) ", 1, true), out)
    assert.truthy(out:find("42", 1, true), out)
    local tok = kd.open_tokenizer(MODEL)
    local n = #tok:encode("Hello")
    tok:close()
    assert.truthy(out:find("len " .. (3 + n) .. ", next token (bonus) ", 1, true), out)   -- text through tok
    assert.truthy(out:find("kd> " .. n .. "\n", 1, true), out)
  end)
end)

describe("scripts/examples/adaptive_budget.lua (the tutorial's policy)", function()
  it("runs, matches ar token for token, and the policy stays under 40 lines", function()
    local code, out, err = (function()
      local o, e = os.tmpname(), os.tmpname()
      local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
      local p = io.popen(string.format("%sluajit scripts/examples/adaptive_budget.lua >%s 2>%s; echo $?", env, o, e))
      local c = tonumber(p:read("*a"):match("(%d+)"))
      p:close()
      local function slurp(f) local h = io.open(f); local s = h:read("*a"); h:close(); os.remove(f); return s end
      return c, slurp(o), slurp(e)
    end)()
    assert.are.equal(0, code, err)
    assert.truthy(out:find("matches ar    yes", 1, true), out)
    assert.truthy(out:match("budget:tau%s+%d+:%d+"), out)
    local src = assert(io.open("scripts/examples/adaptive_budget.lua")):read("*a")
    local body = src:match("\n(local function adaptive_ddtree.-\nend)\n")
    assert.is_string(body)
    local lines = select(2, body:gsub("\n", "")) + 1
    assert.is_true(lines < 40, "policy is " .. lines .. " lines")
  end)
end)

describe("kdtree generate: streaming, stops, log-probs, JSON, Ctrl-C", function()
  local m, tok, ref_greedy
  local function ar(ids, n, extra)
    local o = { policy = "ar", n = n }
    for k, v in pairs(extra or {}) do o[k] = v end
    return gen.run(m, ids, o)
  end
  setup(function()
    m = kd.open_model(MODEL)
    tok = kd.open_tokenizer(MODEL)
    ref_greedy = ar({ 5, 77, 300 }, 24).tokens
  end)
  teardown(function() tok:close(); m:close() end)

  it("reads the prompt from standard input (--prompt -) and from a file (--prompt-file)", function()
    local text = "line one\nline two: 你好\n"
    local want = tok:decode(ar(tok:encode(text), 8).tokens)
    local code, out, err = run("generate --model " .. MODEL .. " --prompt - -n 8", text)
    assert.are.equal(0, code, err)
    assert.are.equal(want, out)
    local f = os.tmpname()
    local h = io.open(f, "wb"); h:write(text); h:close()
    code, out, err = run("generate --model " .. MODEL .. " --prompt-file " .. f .. " -n 8 --draft " .. DRAFT)
    os.remove(f)
    assert.are.equal(0, code, err)
    assert.are.equal(want, out)
  end)

  it("--system sets the chat's system turn", function()
    local ids = tok:chat({ { role = "system", content = "Be brief." }, { role = "user", content = "Hi" } })
    local eos = tok:chat_stops()
    for _, id in ipairs(m.info.eos) do eos[#eos + 1] = id end
    local code, out, err = run("generate --model " .. MODEL .. " --chat Hi --system 'Be brief.' -n 8 --ids")
    assert.are.equal(0, code, err)
    assert.are.same(ar(ids, 8, { eos = eos }).tokens, split_ids(out))
  end)

  -- the stop string: three bytes from the middle of the greedy continuation's text, so the
  -- output must end just before its first occurrence; the ids end at the token completing it
  it("--stop cuts the text before the stop string, the same under ar and ddtree", function()
    local prompt = tok:encode("The quick brown fox")
    local full = ar(prompt, 24).tokens
    local text = tok:decode(full)
    local stop = text:sub(12, 14)
    local at = text:find(stop, 1, true)
    local k = 1
    while not tok:decode({ unpack(full, 1, k) }):find(stop, 1, true) do k = k + 1 end
    for _, pol in ipairs({ "", " --draft " .. DRAFT, " --draft " .. DRAFT .. " --policy dflash", " --draft ngram" }) do
      local code, out, err = run("generate --model " .. MODEL .. " --prompt 'The quick brown fox' -n 24 --stop " .. ("%q"):format(stop) .. pol)
      assert.are.equal(0, code, err)
      assert.are.equal(text:sub(1, at - 1), out, pol)
      code, out, err = run("generate --model " .. MODEL .. " --prompt 'The quick brown fox' -n 24 --ids --stop " .. ("%q"):format(stop) .. pol)
      assert.are.equal(0, code, err)
      assert.are.same({ unpack(full, 1, k) }, split_ids(out), pol)
    end
    -- a stop string that never comes changes nothing
    local code, out = run("generate --model " .. MODEL .. " --prompt 'The quick brown fox' -n 24 --stop 'no such text' --draft " .. DRAFT)
    assert.are.equal(0, code)
    assert.are.equal(text, out)
  end)

  it("--json prints one record per round and a summary whose tokens are the rounds' and AR's", function()
    local code, out, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --json --draft " .. DRAFT .. " --budget 8")
    assert.are.equal(0, code, err)
    local lines = {}
    for l in out:gmatch("[^\n]+") do lines[#lines + 1] = json.decode(l) end
    local final = table.remove(lines)
    local all, text = {}, {}
    for i, r in ipairs(lines) do
      assert.are.equal(i, r.round)
      assert.is_true(r.tau >= 1 and r.tree == 8, out)
      for _, t in ipairs(r.tokens) do all[#all + 1] = t end
      text[#text + 1] = r.text
    end
    assert.are.same(ref_greedy, all)
    assert.are.same(ref_greedy, final.tokens)
    assert.are.equal(tok:decode(ref_greedy), table.concat(text))
    assert.are.equal(#lines, final.summary.rounds)
    assert.are.equal(24, final.summary.tokens)
    assert.is_number(final.summary.mean_tau)
  end)

  -- log-probs: a greedy token is the likeliest (its log-prob tops the list), the whole list of
  -- V alternatives sums to probability 1, and DDTree reads the same rows AR does, bit for bit
  it("--logprobs gives the chosen tokens' log-probs and the likeliest, equal under DDTree and AR", function()
    local V = m.info.vocab
    local a = ar({ 5, 77, 300 }, 12, { logprobs = V })
    for i, lp in ipairs(a.logprobs) do
      assert.are.equal(a.tokens[i], lp.token)
      assert.are.equal(a.tokens[i], lp.top[1].token)
      assert.are.equal(lp.logprob, lp.top[1].logprob)
      local z = 0
      for _, alt in ipairs(lp.top) do z = z + math.exp(alt.logprob) end
      assert.is_true(math.abs(z - 1) < 1e-9, tostring(z))
    end
    local d = kd.open_drafter(DRAFT, m)
    local sp = { temperature = 0.9, top_k = 50, seed = 5 }
    for _, sampler in ipairs({ false, sp }) do
      local o = { logprobs = 3, sampler = sampler or nil }
      local want = ar({ 5, 77, 300 }, 20, o)
      for _, pol in ipairs({ "ddtree", "dflash" }) do
        local got = gen.run(m, { 5, 77, 300 }, { policy = pol, drafter = d, budget = 12, n = 20, logprobs = 3,
          sampler = sampler or nil })
        assert.are.same(want.tokens, got.tokens)
        assert.are.same(want.logprobs, got.logprobs)   -- exact: same rows, same arithmetic
      end
    end
    d:close()
    local code, out, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 12 --json --logprobs 2 --draft " .. DRAFT)
    assert.are.equal(0, code, err)
    local final, lps = nil, {}
    for l in out:gmatch("[^\n]+") do
      final = json.decode(l)
      for _, lp in ipairs(final.logprobs or {}) do lps[#lps + 1] = lp end
    end
    local want = ar({ 5, 77, 300 }, 12, { logprobs = 2 }).logprobs
    assert.are.equal(#want, #lps)
    for i = 1, #want do
      assert.are.equal(want[i].token, lps[i].token)
      assert.is_true(math.abs(want[i].logprob - lps[i].logprob) < 1e-12)
      assert.are.equal(want[i].top[2].token, lps[i].top[2].token)
    end
  end)

  it("--min-p samples identically under DDTree and AR", function()
    local s = "--temperature 0.9 --min-p 0.05 --seed 11"
    local code, out = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids " .. s)
    assert.are.equal(0, code)
    local want = ar({ 5, 77, 300 }, 24, { sampler = { temperature = 0.9, min_p = 0.05, seed = 11 } }).tokens
    assert.are.same(want, split_ids(out))
    code, out = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids --draft " .. DRAFT .. " " .. s)
    assert.are.equal(0, code)
    assert.are.same(want, split_ids(out))
  end)

  it("--compare-ar puts AR's tokens/s beside the policy's in one summary line", function()
    local code, out, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids --draft " .. DRAFT .. " --compare-ar")
    assert.are.equal(0, code, err)
    assert.are.same(ref_greedy, split_ids(out))
    assert.truthy(err:match("^kdtree: 24 tokens %(stop: n%), %d+ rounds, mean tau [%d.]+, [%d.]+ tokens/s; "
      .. "ar [%d.]+ tokens/s %([%d.]+x%), same tokens\n$"), err)
  end)

  it("ends the text's line before the summary when both go to one place (2>&1), and only then", function()
    local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
    local p = io.popen(env .. "luajit " .. CLI .. " generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --compare-ar 2>&1")
    local both = p:read("*a")
    p:close()
    local text = tok:decode(ref_greedy)
    assert.are.equal(text .. (text:sub(-1) == "\n" and "" or "\n"), both:sub(1, #both - #both:match("kdtree: [^\n]*\n$")))
    local code, out = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --compare-ar")
    assert.are.equal(0, code)
    assert.are.equal(text, out)
  end)

  -- Ctrl-C: a real SIGINT to the running CLI (kill -INT) once it has printed something
  it("stops after the current round on SIGINT, keeps what it printed, summarises and exits 130", function()
    local o, e = os.tmpname(), os.tmpname()
    local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
    local p = io.popen(string.format("%sluajit %s generate --model %s --prompt-ids 5,77,300 -n 5000 --no-eos --ids --draft %s >%s 2>%s & "
      .. "pid=$!; while [ ! -s %s ] && kill -0 $pid 2>/dev/null; do sleep 0.05; done; sleep 0.3; kill -INT $pid; wait $pid; echo $?",
      env, CLI, MODEL, DRAFT, o, e, o))
    local code = tonumber(p:read("*a"):match("(%d+)"))
    p:close()
    local out = assert(io.open(o)):read("*a")
    local err = assert(io.open(e)):read("*a")
    os.remove(o); os.remove(e)
    assert.are.equal(130, code, err)
    local got = split_ids(out)
    assert.is_true(#got > 0 and #got < 5000, #got)
    assert.truthy(out:match("^[%d ]+\n$"))   -- whole ids, the line ended
    assert.are.same(ar({ 5, 77, 300 }, #got, { eos = false }).tokens, got)
    assert.truthy(err:match("^kdtree: interrupted: " .. #got .. " tokens %(stop: interrupt%), %d+ rounds, mean tau"), err)
  end)
end)

describe("kdtree as a symlink, from another directory", function()
  it("finds its Lua modules, library and models through the link", function()
    local dir = os.tmpname()
    os.remove(dir)
    local root = io.popen("pwd"):read("*l")
    os.execute(string.format("mkdir -p %s && ln -s %s/%s %s/kdtree", dir, root, CLI, dir))
    local p = io.popen(string.format("cd / && env -u KDTREE_LIB -u LUA_PATH luajit %s/kdtree generate --prompt-ids 5,77,300 "
      .. "-n 24 --ids 2>&1; echo rc=$?", dir))
    local out = p:read("*a")
    p:close()
    os.execute("rm -rf " .. dir)
    local ref = gen.run(kd.open_model("models/mini-code"), { 5, 77, 300 }, { policy = "ar", n = 24 }).tokens
    assert.are.equal(table.concat(ref, " ") .. "\nrc=0\n", out)   -- the default model, found through the link
  end)
end)
