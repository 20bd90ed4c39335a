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

-- run the CLI; returns (exit code, stdout, stderr)
local function run(args)
  local out, err = tmpname(), tmpname()
  local env = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""
  local p = io.popen(string.format("%sluajit %s %s >%s 2>%s; echo $?", env, CLI, args, out, err))
  local code = tonumber(p:read("*a"):match("(%d+)"))
  p:close()
  local function slurp(f) local h = io.open(f); local s = h:read("*a"); h:close(); os.remove(f); return s end
  return code, slurp(out), slurp(err)
end

local function split_ids(s)
  local t = {}
  for w in s:gmatch("%S+") do t[#t + 1] = tonumber(w) end
  return t
end

describe("kdtree generate", function()
  local ref_greedy, ref_sampled
  setup(function()
    local m = kd.open_model(MODEL)
    ref_greedy = gen.run(m, { 5, 77, 300 }, { policy = "ar", n = 24 }).tokens
    ref_sampled = gen.run(m, { 5, 77, 300 }, { policy = "ar", n = 24,
      sampler = { temperature = 0.8, top_p = 0.9, top_k = 40, seed = 7 } }).tokens
    m:close()
  end)

  it("prints the greedy ids, space-separated, with --ids", function()
    local code, out, err = run("generate --model " .. MODEL .. " --prompt-ids 5,77,300 -n 24 --ids")
    assert.are.equal(0, code, err)
    assert.truthy(out:match("^[%d ]+\n$"), out)
    assert.are.same(ref_greedy, split_ids(out))
  end)

  it("defaults to the shipped tiny model", function()
    local code, out = run("generate --prompt-ids 5,77,300 -n 24 --ids")
    assert.are.equal(0, code)
    assert.are.same(ref_greedy, split_ids(out))
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

  it("samples with --temperature/--top-p/--top-k/--seed, identically under ddtree", function()
    local s = "--temperature 0.8 --top-p 0.9 --top-k 40 --seed 7"
    local code, out = run("generate --prompt-ids 5,77,300 -n 24 --ids " .. s)
    assert.are.equal(0, code)
    assert.are.same(ref_sampled, split_ids(out))
    code, out = run("generate --prompt-ids 5,77,300 -n 24 --ids --draft " .. DRAFT .. " --budget 8 " .. s)
    assert.are.equal(0, code)
    assert.are.same(ref_sampled, split_ids(out))
  end)

  it("--stats prints a table of rounds with tau and a summary; --ids keeps stdout clean", function()
    local code, out, err = run("generate --prompt-ids 5,77,300 -n 16 --draft " .. DRAFT .. " --budget 16 --stats")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("round", 1, true))
    assert.truthy(out:find("tau", 1, true))
    assert.truthy(out:find("mean tau", 1, true))
    assert.truthy(out:match("output%s+[%d ]+"))
    code, out, err = run("generate --prompt-ids 5,77,300 -n 16 --draft " .. DRAFT .. " --stats --ids")
    assert.are.equal(0, code)
    assert.truthy(out:match("^[%d ]+\n$"))
    assert.truthy(err:find("mean tau", 1, true))
  end)

  it("accepts --flag=value", function()
    local code, out = run("generate --prompt-ids=5,77,300 -n 24 --ids --policy=ar")
    assert.are.equal(0, code)
    assert.are.same(ref_greedy, split_ids(out))
  end)

  it("takes a text prompt or a chat message through the checkpoint's tokenizer, and prints text", function()
    local tok = kd.open_tokenizer(MODEL)
    local m = kd.open_model(MODEL)
    local function ref(ids, eos) return gen.run(m, ids, { policy = "ar", n = 6, eos = eos }).tokens end
    local code, out = run("generate --prompt 'The quick brown fox' -n 6 --ids")
    assert.are.equal(0, code)
    assert.are.same(ref(tok:encode("The quick brown fox")), split_ids(out))
    local chat_ids = tok:chat({ { role = "user", content = "Hello! 你好" } })
    code, out = run("generate --chat 'Hello! 你好' -n 6 --ids --draft " .. DRAFT)
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
    code, out = run("generate --chat 'Hello! 你好' -n 24 --ids --temperature 1.5 --seed " .. seed)
    assert.are.equal(0, code)
    assert.are.same(sampled, split_ids(out))
    local err
    code, out, err = run("generate --prompt 'The quick brown fox' -n 6")
    assert.are.equal(0, code, err)
    local want = tok:decode(ref(tok:encode("The quick brown fox")))
    assert.truthy(out:find("\ntext     " .. string.format("%q", want):gsub("%p", "%%%0"), 1), out)
    code, out, err = run("generate --prompt hi --tokenizer /nonexistent/tok -n 2")
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
      { "generate -n 3", "give the prompt once: --prompt-ids 5,77,300, --prompt TEXT or --chat TEXT" },
      { "generate --prompt-ids 5 --prompt hi", "give the prompt once" },
      { "generate --prompt ''", "--prompt: expected some text" },
      { "generate --prompt-ids 5 --tokenizer models/tiny-k2.6", "--tokenizer is for --prompt or --chat" },
      { "generate --prompt-ids 5 --policy beam", "--policy: expected ar, dflash or ddtree, got 'beam'" },
      { "generate --prompt-ids 5 --policy ddtree", "--policy ddtree needs --draft" },
      { "generate --prompt-ids 5 --draft ngram --budget -4", "--budget: expected >= 0, got -4" },
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

  it("exits 1 with the engine's message when the model cannot load", function()
    local code, out, err = run("generate --model /nonexistent/model --prompt-ids 5 -n 2 --ids")
    assert.are.equal(1, code)
    assert.are.equal("", out)
    assert.truthy(err:find("^kdtree: error: "))
    assert.truthy(err:find("/nonexistent/model", 1, true))
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

describe("README.md's Lua example", function()
  it("runs as written and accepts at least the root", function()
    local readme = assert(io.open("README.md")):read("*a")
    local code = readme:match("## Lua in ten lines%s+```lua\n(.-)```")
    assert.is_string(code)
    assert.is_true(select(2, code:gsub("\n", "")) <= 10)
    local printed = {}
    local env = setmetatable({ print = function(...) printed[#printed + 1] = table.concat({ ... }, " ") end },
      { __index = _G })
    local f = assert(loadstring(code, "=README"))
    setfenv(f, env)
    f()
    assert.truthy(printed[1]:match("^tree: 16 nodes, root token %d+"), printed[1])
    assert.truthy(printed[2]:match("^accepted %d+.* tau %d+ next %d+$"), printed[2])
  end)
end)
