-- repl_spec: `kdtree repl` as a person uses it. On a terminal (a pseudo-terminal from
-- util-linux's `script`, which every Debian has): Ctrl-C at the prompt clears the line and keeps
-- the session and its model, Ctrl-C interrupts running Lua, Tab completes globals and methods,
-- history survives the session, help/exit/quit work. Through a pipe (plain input): chat turns
-- that equal the Lua API's decode, reset, helpful errors before a model, tree DOT output, the
-- tau histogram, and --draft without --model.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local Terminal = require("helpers.terminal")
local sh = require("helpers.shell")
local kd = require("kdtree")
local gen = require("kdtree.generate")

local MODEL, DRAFT, CLI = "models/tiny-k2.6", "models/tiny-k2.6-dflash", "scripts/kdtree"
local LIB = os.getenv("KDTREE_LIB") and ("KDTREE_LIB='" .. os.getenv("KDTREE_LIB") .. "' ") or ""

local function slurp(f) local h = assert(io.open(f, "rb")); local s = h:read("*a"); h:close(); return s end

-- drive the REPL on a pseudo-terminal (helpers.terminal: each step waits for its cue, then types)
local function on_terminal(home, args, steps, state, preload)
  local env = "env -u XDG_STATE_HOME HOME=" .. home .. (state and (" XDG_STATE_HOME=" .. state) or "")
    .. " TERM=xterm " .. LIB .. (preload or "")
  return Terminal.run("luajit " .. CLI .. " repl " .. (args or ""), steps, env)
end

-- plain input through a pipe
local function piped(args, lines)
  local f = os.tmpname()
  local h = io.open(f, "w"); h:write(table.concat(lines, "\n"), "\n"); h:close()
  local p = io.popen(LIB .. "luajit " .. CLI .. " repl " .. (args or "") .. " < " .. f .. " 2>&1")
  local out = p:read("*a")
  p:close()
  os.remove(f)
  return out
end

local function count(s, needle)
  local n, at = 0, 1
  while true do
    local i = s:find(needle, at, true)
    if not i then return n end
    n, at = n + 1, i + #needle
  end
end

describe("kdtree repl on a terminal", function()
  local home
  setup(function()
    home = os.tmpname()
    os.remove(home)
    os.execute("mkdir -p " .. home)
  end)
  teardown(function() os.execute("rm -rf " .. home) end)

  it("keeps the session through Ctrl-C, completes names, and has help, show and exit", function()
    local code, out = on_terminal(home, "--model " .. MODEL, {
      { send = "x = 1 +" },
      { after = "x = 1 +", count = 1, send = "\3" },                 -- Ctrl-C mid-line
      { count = 2, send = "m.info.vocab\n" },                       -- the model is still there
      { count = 3, send = "kd.open_mo\t" },
      { after = "kd.open_model", count = 1, send = "\n" },
      { count = 4, send = "m:new_s\t" },
      { after = "m:new_seq", count = 1, send = "(8):capacity()\n" },
      { count = 5, send = "i = 0 while true do i = i + 1 end\n" },
      { after = "i + 1 end", count = 1, send = "" },
      { count = 5, send = "\3" },                                   -- Ctrl-C while Lua runs
      { count = 6, send = "i > 0\n" },
      { count = 7, send = "help\n" },
      { count = 8, send = "show{1, 2}\n" },
      { count = 9, send = "drafter'" .. DRAFT .. "'\n" },
      -- Ctrl-C during a reply: with no stops it cannot end by itself before n (on the GPU a
      -- reply that could stop ended at 437 tokens in 0.2 s), and the Ctrl-C goes as soon as the
      -- reply prints (40 bytes past the echoed line: its newline, terminal modes, a few tokens)
      { count = 10, send = "chat('Hello!', {n = 5000, stops = {}})\n" },
      { after = "stops = {}})", count = 1, streamed = 40, send = "\3" },
      { count = 11, send = "#messages\n" },
      { count = 12, send = "exit\n" },
    })
    assert.are.equal(0, code, out)
    assert.truthy(out:find("kd> x = 1 +^C\nkd> m.info.vocab\n1024\n", 1, true), out)
    assert.truthy(out:find("kd> kd.open_model\nfunction: ", 1, true), out)
    assert.truthy(out:find("kd> m:new_seq(8):capacity()\n8\n", 1, true), out)
    assert.truthy(out:find("interrupted\nkd> i > 0\ntrue\n", 1, true), out)
    assert.truthy(out:find('chat("Hello!")', 1, true), out)
    assert.are.equal(1, count(out, "\n{1, 2}\n"), out)            -- show prints once
    local n = tonumber(out:match("\n%((%d+) tokens, interrupted, ddtree, mean tau [%d.]+, [%d.]+ tokens/s%)\nkd> #messages\n2\n"))
    assert.is_true(n ~= nil and n > 0 and n < 5000, out)          -- the reply ends, and stays in the chat
    local hist = slurp(home .. "/.kdtree_history")
    assert.truthy(hist:find("m.info.vocab\n", 1, true), hist)
    assert.falsy(hist:find("x = 1 +", 1, true), hist)              -- the cleared line is not history

    -- a second session: the up arrow brings back the last session's lines
    code, out = on_terminal(home, "", {
      { send = "\27[A\27[A\n" },                                    -- exit, then #messages
      { count = 2, send = "quit\n" },
    })
    assert.are.equal(0, code, out)
    assert.truthy(out:find("#messages\n0\nkd> quit", 1, true), out)   -- a new session's chat is empty

    -- with XDG_STATE_HOME set, the history lives under it
    code, out = on_terminal(home, "", { { send = "6 * 7\n" }, { count = 2, send = "exit\n" } }, home .. "/state")
    assert.are.equal(0, code, out)
    assert.are.equal("6 * 7\nexit\n", slurp(home .. "/state/kdtree/history"))
  end)

  -- Ctrl-C typed together with a line is pending while that line runs (no reply, no Lua long
  -- enough for the hook): it must be dropped, not left to end the session at exit with 130
  -- (on the GPU, where CUDA's threads exist, it did)
  it("drops a Ctrl-C that came while idle: the line still runs and exit returns 0", function()
    local code, out = on_terminal(home, "--model " .. MODEL, {
      { send = "\0036 * 7\n" },
      { count = 2, send = "\3exit\n" },
    })
    assert.are.equal(0, code, out)
    assert.truthy(out:find("kd> 6 * 7\n42\nkd> exit", 1, true), out)
  end)

  -- a Ctrl-C typed after exit, while the process tears down (on CUDA the context teardown takes
  -- about a second, and a thread that does not block SIGINT exists then), must not turn the
  -- status into 130: spec/helpers/slow_teardown.c, preloaded, gives this process such an exit
  it("ends with 0 when a Ctrl-C comes while the session tears down after exit", function()
    local so = os.tmpname()
    local rc, msg = sh("cc -shared -fPIC -std=c11 -D_GNU_SOURCE -Wall -o " .. so .. " spec/helpers/slow_teardown.c -lpthread")
    assert.are.equal(0, rc, msg)
    local code, out = on_terminal(home, "--model " .. MODEL, {
      { send = "6 * 7\n" },
      { count = 2, send = "exit\n" },
      { after = "kd> exit", count = 1, send = "\3" },              -- the process is in its teardown
    }, nil, 'LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD }' .. so .. '" ')
    os.remove(so)
    assert.are.equal(0, code, out)
    assert.truthy(out:find("kd> 6 * 7\n42\nkd> exit", 1, true), out)
  end)
end)

describe("kdtree repl, plain input", function()
  it("explains what is missing before a model is loaded", function()
    local out = piped("", { "round(4)", "chat'hi'", "dot()", "hist()" })
    assert.are.equal(2, count(out, "no model loaded: load(dir) first"), out)
    assert.truthy(out:find("no tree: tree(budget) or round() first", 1, true), out)
    assert.truthy(out:find("no rounds yet", 1, true), out)
    assert.falsy(out:find("nil value", 1, true), out)
  end)

  it("chats over several turns as the Lua API decodes, and reset() starts over", function()
    -- the model defaults as generate's does: to the shipped mini-code
    local model, draft = "models/mini-code", "models/mini-code-dflash"
    local out = piped("--draft " .. draft, {
      "m.dir:match'mini%-code$' ~= nil", "chat('Hello!', {n = 12})", "chat('And then?', {n = 12})", "#messages",
      "reset()", "#messages", "s:len()" })
    assert.truthy(out:find("kd> true\n", 1, true), out)
    local m = kd.open_model(model)
    local tok = kd.open_tokenizer(model)
    local d = kd.open_drafter(draft, m)
    local eos = tok:chat_stops()
    for _, id in ipairs(m.info.eos) do eos[#eos + 1] = id end
    local msgs = {}
    for _, text in ipairs({ "Hello!", "And then?" }) do
      msgs[#msgs + 1] = { role = "user", content = text }
      local ar = gen.run(m, tok:chat(msgs), { policy = "ar", n = 12, eos = eos, tokenizer = tok })
      assert.truthy(out:find(ar.text .. "\n(" .. #ar.tokens .. " tokens, ddtree, mean tau", 1, true), out)
      msgs[#msgs + 1] = { role = "assistant", content = require("kdtree.repl").clean_utf8(ar.text) }
    end
    assert.truthy(out:find("kd> 4\n", 1, true), out)
    assert.truthy(out:find("chat history cleared\nkd> 0\nkd> 0\n", 1, true), out)
    d:close(); tok:close(); m:close()
  end)

  it("chats with stops = {} to n tokens, as the Lua API decodes with no stops", function()
    local out = piped("--model " .. MODEL .. " --draft " .. DRAFT,
      { "chat('Hello!', {n = 40, stops = {}})", "chat('Hi', {stops = 3})" })
    local m = kd.open_model(MODEL)
    local tok = kd.open_tokenizer(MODEL)
    local ar = gen.run(m, tok:chat({ { role = "user", content = "Hello!" } }),
      { policy = "ar", n = 40, eos = {}, tokenizer = tok })
    assert.are.equal(40, #ar.tokens)
    assert.truthy(out:find(ar.text .. "\n(40 tokens, ddtree, mean tau", 1, true), out)
    assert.truthy(out:find("chat: expected stops as a list of token ids ({} = none)", 1, true), out)
    tok:close(); m:close()
  end)

  it("draws the last tree as DOT with the accepted path, and a tau histogram", function()
    local dot = os.tmpname()
    local out = piped("--model " .. MODEL .. " --draft " .. DRAFT, {
      "prefill{5, 77, 300}", "round(6)", "round(6)", "dot'" .. dot .. "'", "hist()" })
    local taus = {}
    for t in out:gmatch("tau (%d+): tokens") do taus[#taus + 1] = tonumber(t) end
    assert.are.equal(2, #taus, out)
    local text = slurp(dot)
    os.remove(dot)
    local nodes, accepted, edges = 0, {}, {}
    for id, attrs in text:gmatch("\n  n(%d+) %[(.-)%];") do
      nodes = nodes + 1
      if attrs:find("filled", 1, true) then accepted[#accepted + 1] = tonumber(id) end
    end
    for a, b in text:gmatch("\n  n(%d+) %-> n(%d+)") do edges[tonumber(b)] = tonumber(a) end
    assert.are.equal(7, nodes, text)                  -- root + budget 6
    assert.are.equal(taus[2], #accepted, text)        -- the second round's path: tau nodes
    for i = 2, #accepted do assert.are.equal(accepted[i - 1], edges[accepted[i]], text) end
    assert.are.equal(0, accepted[1])
    local mean = (taus[1] + taus[2]) / 2
    assert.truthy(out:find(string.format("mean tau %.2f over 2 rounds", mean), 1, true), out)
  end)
end)

describe("tree:dot", function()
  it("has one node per tree node and one edge per parent link, the accepted path marked", function()
    local m = kd.open_model(MODEL)
    local d = kd.open_drafter(DRAFT, m)
    local s = m:new_seq(64)
    s:attach_drafter(d)
    s:forward({ 5, 77, 300 })
    s:draft(s:argmax()[3], false)
    local t = kd.tree.build_drafted(s, 10)
    s:verify(t)
    local acc = s:accept(t)
    local text = t:dot(acc.nodes)
    assert.truthy(text:match("^digraph ddtree {\n.*}\n$"), text)
    local labels, edges, marked = {}, {}, {}
    for id, label, attrs in text:gmatch('\n  n(%d+) %[label="(%-?%d+)"(.-)%];') do
      labels[tonumber(id)] = tonumber(label)
      if attrs:find("filled", 1, true) then marked[#marked + 1] = tonumber(id) end
    end
    for a, b in text:gmatch("\n  n(%d+) %-> n(%d+)") do edges[tonumber(b)] = tonumber(a) end
    assert.are.equal(t.root, labels[0])
    for i = 1, t.n do
      assert.are.equal(t.tokens[i], labels[i])
      assert.are.equal(t.parents[i], edges[i])
    end
    table.sort(marked)
    assert.are.same(acc.nodes, marked)
    t:close(); s:close(); d:close(); m:close()
  end)
end)

describe("the REPL's completion", function()
  it("offers globals, fields and methods, trees' too", function()
    local R = require("kdtree.repl")
    local m = kd.open_model(MODEL)
    local E = R.env({})
    E.m, E.t = m, kd.tree.chain(1, { 2, 3 })
    assert.are.same({ "kd.open_drafter", "kd.open_model", "kd.open_tokenizer" }, R.complete(E, "kd.open_"))
    assert.are.same({ "m:get_info" }, R.complete(E, "m:get_"))
    assert.are.same({ "t:dot", "t:dump" }, R.complete(E, "t:d"))
    assert.are.same({ "m.info" }, R.complete(E, "m.inf"))   -- a field, not a method
    assert.are.same({ "m.info.vocab" }, R.complete(E, "m.info.voc"))
    local g = R.complete(E, "re")
    for _, want in ipairs({ "repeat", "require", "reset", "return" }) do
      assert.truthy(table.concat(g, " "):find(want, 1, true), want)
    end
    assert.are.same({}, R.complete(E, "nosuch.x"))
    E.t:close(); m:close()
  end)
end)
