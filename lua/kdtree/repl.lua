-- repl.lua: an interactive LuaJIT prompt for the engine: chat with a model, or take a DDTree
-- round apart step by step. On a terminal the line editor is GNU readline through the FFI
-- (history in a file, completion of Lua names and kdtree methods); otherwise lines are read
-- plainly. Expressions print their values; `help` lists the helpers (R.helptext below).
--
-- Ctrl-C: SIGINT stays blocked (kdtree.interrupt) and is polled: at the prompt it clears the
-- line, while Lua runs it raises "interrupted" inside the protected call, during chat() it ends
-- the reply after the current round. Nothing a user types can end the session but exit/Ctrl-D.
local kd = require("kdtree")
local gen = require("kdtree.generate")
local interrupt = require("kdtree.interrupt")
local ffi = require("ffi")

local R = {}

-- ---------------------------------------------------------------- values
local function show(v, depth)
  depth = depth or 0
  if type(v) == "string" then return string.format("%q", v) end
  if type(v) ~= "table" or getmetatable(v) ~= nil or depth > 1 then return tostring(v) end
  local n, parts = #v, {}
  for i = 1, math.min(n, 32) do parts[#parts + 1] = show(v[i], depth + 1) end
  if n > 32 then parts[#parts + 1] = string.format("... (%d items)", n) end
  local keys = {}
  for k in pairs(v) do
    if not (type(k) == "number" and k >= 1 and k <= n and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do parts[#parts + 1] = tostring(k) .. " = " .. show(v[k], depth + 1) end
  return "{" .. table.concat(parts, ", ") .. "}"
end
R.show = show

-- text with each byte that is not part of a valid UTF-8 character replaced by U+FFFD: a reply
-- may end inside a character or (from an untrained model) hold stray bytes, and the chat
-- history it joins is encoded as text again
function R.clean_utf8(s)
  local out, i = {}, 1
  while i <= #s do
    local c = s:match("^[%z\1-\127]", i) or s:match("^[\194-\223][\128-\191]", i)
      or s:match("^[\224-\239][\128-\191][\128-\191]", i) or s:match("^[\240-\244][\128-\191][\128-\191][\128-\191]", i)
    out[#out + 1] = c or "\239\191\189"
    i = i + (c and #c or 1)
  end
  return table.concat(out)
end

-- a histogram of tau values, one bar per tau (the bars scale to 40 columns)
function R.histogram(taus)
  if #taus == 0 then return "no rounds yet: chat(), round() or generate something first" end
  local count, hi, most, sum = {}, 0, 0, 0
  for _, t in ipairs(taus) do
    count[t] = (count[t] or 0) + 1
    hi = math.max(hi, t)
    most = math.max(most, count[t])
    sum = sum + t
  end
  local lines = { "tau  rounds" }
  for t = 1, hi do
    local c = count[t] or 0
    lines[#lines + 1] = string.format("%3d  %-40s %d", t, string.rep("#", math.ceil(40 * c / most)), c)
  end
  lines[#lines + 1] = string.format("mean tau %.2f over %d rounds", sum / #taus, #taus)
  return table.concat(lines, "\n")
end

-- ---------------------------------------------------------------- the helpers (globals)
function R.env(opts)
  opts = opts or {}
  local E = setmetatable({ kd = kd, ffi = ffi, taus = {}, messages = {} }, { __index = _G })
  local function need_model()
    if not E.m then error("no model loaded: load(dir) first (or start with kdtree repl --model DIR)", 0) end
  end
  local function need_tokenizer()
    need_model()
    if not E.tok then error("this model directory has no tokenizer (tiktoken.model): give token ids", 0) end
  end
  local function need(field, what)
    if E[field] == nil then error(what, 0) end
  end

  function E.show(v) print(show(v)) end
  function E.exit() E._exit = true end
  E.quit = E.exit
  function E.help() print((R.helptext:gsub("^%s+", ""))) end

  -- a fresh sequence s (the drafter attached when there is one); the chat starts over
  function E.reset()
    need_model()
    if E.s then E.s:close() end
    E.s = E.m:new_seq(E.capacity)
    if E.d then E.s:attach_drafter(E.d) end
    E.messages, E.bonus, E.acc, E.lp = {}, nil, nil, nil
    if E.t then E.t:close(); E.t = nil end
    print(string.format("new sequence s (capacity %d); chat history cleared", E.capacity))
  end

  function E.load(dir, o)
    o = o or {}
    local mo = {}   -- the start's model options (flags, environment), then load's own
    for k, v in pairs(opts.options or { backend = opts.backend, tp = opts.tp, devices = opts.devices }) do mo[k] = v end
    for _, k in ipairs({ "backend", "tp", "devices" }) do
      if o[k] ~= nil then mo[k] = o[k] end
    end
    local m = require("kdtree.progress").open_model(kd, dir, mo)
    for _, k in ipairs({ "t", "s", "d", "tok", "m" }) do
      if E[k] then E[k]:close(); E[k] = nil end
    end
    E.m, E.capacity = m, o.capacity or 4096
    local f = io.open(dir .. "/tiktoken.model")
    if f then
      f:close()
      local ok, t = pcall(kd.open_tokenizer, dir)   -- a bad tokenizer leaves the model usable
      if ok then E.tok = t else print("no tokenizer: " .. tostring(t)) end
    end
    E.taus = {}
    E.reset()
    return E.m
  end
  function E.drafter(dir)
    need_model()
    local d = kd.open_drafter(dir, E.m)
    if E.d then E.d:close() end
    E.d = d
    E.reset()       -- a drafter joins a sequence before its prefill
    return E.d
  end
  function E.prefill(ids)
    need_model()
    if type(ids) == "string" then
      need_tokenizer()
      ids = E.tok:encode(ids)
    end
    E.s:forward(ids)
    local a = E.s:argmax()
    E.bonus = a[#a]
    print(string.format("len %d, next token (bonus) %d", E.s:len(), E.bonus))
  end
  function E.top(k, row)
    need_model()
    k, row = k or 5, row or E.s:out_rows()
    local l = E.s:logits(row)
    local mx = -math.huge
    for _, v in ipairs(l) do if v > mx then mx = v end end
    local z = 0
    for _, v in ipairs(l) do z = z + math.exp(v - mx) end
    local idx = {}
    for i = 1, #l do idx[i] = i end
    table.sort(idx, function(a, b) return l[a] > l[b] or (l[a] == l[b] and a < b) end)
    local res = {}
    for i = 1, math.min(k, #idx) do
      local j = idx[i]
      res[i] = { token = j - 1, logit = l[j], prob = math.exp(l[j] - mx) / z }
      print(string.format("  %2d. token %6d  logit %9.4f  p %.4f", i, j - 1, l[j], res[i].prob))
    end
    E.tops = res
  end
  function E.draft(bonus)
    need_model()
    need("d", "no drafter: drafter(dir) first")
    bonus = bonus or E.bonus
    if not bonus then error("no bonus token yet: prefill{...} first", 0) end
    E.lp = E.s:draft(bonus)
    print(string.format("draft: %d x %d log-probs after bonus %d (lp)", E.lp.L, E.lp.V, bonus))
  end
  function E.tree(budget, scores)
    need_model()
    budget = budget or 16
    local t
    if scores then
      t = kd.tree.build(scores, budget, { logprobs = true, root = E.bonus })
    else
      need("lp", "nothing drafted: draft() first")
      t = kd.tree.build_drafted(E.s, budget)
    end
    if E.t then E.t:close() end
    E.t, E.acc = t, nil
    print(E.t:dump())
  end
  function E.verify()
    need("t", "no tree: tree(budget) first")
    E.s:verify(E.t)
    print(string.format("verified %d nodes", E.t.n + 1))
  end
  function E.accept(sampler)
    need("t", "no tree: tree(budget) first")
    E.acc = E.s:accept(E.t, sampler or E.sampler)
    E.taus[#E.taus + 1] = E.acc.tau
    print(string.format("tau %d: tokens %s, bonus %d", E.acc.tau, table.concat(E.acc.tokens, " "), E.acc.bonus))
  end
  function E.commit()
    need("acc", "nothing accepted: accept() first")
    E.s:commit(E.t)
    E.bonus = E.acc.bonus
    print(string.format("len %d, bonus %d", E.s:len(), E.bonus))
  end
  function E.round(budget)
    E.draft()
    E.tree(budget)
    E.verify()
    E.accept()
    E.commit()
  end
  -- the last tree as Graphviz DOT, its accepted path marked; to a file when given a path
  function E.dot(path)
    need("t", "no tree: tree(budget) or round() first")
    local text = E.t:dot(E.acc and E.acc.nodes, E.tok)
    if not path then io.write(text); return end
    local f, err = io.open(path, "w")
    if not f then error("dot: " .. err, 0) end
    f:write(text)
    f:close()
    print("wrote " .. path .. " (render: dot -Tsvg " .. path .. " > tree.svg)")
  end
  function E.hist() print(R.histogram(E.taus)) end

  -- one chat turn: the reply streams as rounds are accepted (DDTree with the drafter when one
  -- is loaded); Ctrl-C ends it after the current round. sampler (a global): nil = greedy.
  -- o: n (most tokens, 256), budget (16), sampler, stops (the ids that end the reply: by default
  -- the chat's end-of-turn ids and the model's EOS; {} = none, the reply runs to n or Ctrl-C)
  function E.chat(text, o)
    need_tokenizer()
    o = o or {}
    if type(text) ~= "string" then error("chat: expected the message as a string", 0) end
    local msgs = { unpack(E.messages) }
    msgs[#msgs + 1] = { role = "user", content = text }
    local ids = E.tok:chat(msgs)
    local eos = o.stops
    if eos == nil then
      eos = E.tok:chat_stops()
      for _, id in ipairs(E.m.info.eos) do eos[#eos + 1] = id end
    elseif type(eos) ~= "table" then
      error("chat: expected stops as a list of token ids ({} = none)", 0)
    end
    local hook = { debug.gethook() }
    debug.sethook()               -- Ctrl-C ends the reply between rounds, not mid-round
    local ok, res = pcall(gen.run, E.m, ids, { policy = E.d and "ddtree" or "ar", drafter = E.d,
      budget = o.budget or 16, n = o.n or 256, eos = eos, sampler = o.sampler or E.sampler, tokenizer = E.tok,
      on_round = function(r)
        io.write(r.text); io.flush()
        if E.d then E.taus[#E.taus + 1] = r.tau end
        if interrupt.take() then return "interrupt" end
      end })
    debug.sethook(unpack(hook))
    if not ok then error(res, 0) end
    local shown = 0
    for _, r in ipairs(res.rounds) do shown = shown + #r.text end
    io.write(res.text:sub(shown + 1), "\n")
    local s = gen.summary(res)
    print(string.format("(%d tokens%s, %s, mean tau %.2f, %.1f tokens/s)", s.tokens,
      res.stop == "interrupt" and ", interrupted" or "", E.d and "ddtree" or "ar", s.mean_tau, s.tok_per_s))
    msgs[#msgs + 1] = { role = "assistant", content = R.clean_utf8(res.text) }
    E.messages = msgs
  end
  return E
end

R.helptext = [[
  chat("Hello!")        one chat turn with the loaded model (streams; DDTree when a drafter is loaded;
                        Ctrl-C ends the reply); the conversation continues until reset()
  sampler = {temperature = 0.8, seed = 1}    sample chat() and accept(); nil = greedy
  load(dir)             open a target model as m, with a sequence s (and its tokenizer as tok, if any)
  drafter(dir)          open a DFlash drafter as d, attached to a fresh s
  reset()               a fresh sequence s; the chat starts over
  prefill{5, 77, 300}   forward a prompt (prefill"text": through tok); sets bonus (the greedy next token)
  top(k, row)           top-k tokens of an output row of the last forward (default: last row) -> tops
  draft()               one draft pass after bonus -> lp (L x V log-probs, lp:row(i))
  tree(budget)          DDTree from the drafted log-probs -> t (printed); tree(budget, rows): from any rows
  verify()  accept()  commit()    the rest of a round, step by step (accept -> acc)
  round(budget)         a whole round
  dot()  dot"t.dot"     the last tree as Graphviz DOT, the accepted path marked (to a file: dot -Tsvg)
  hist()                a histogram of the session's tau values
  show(v)               print a table readably
  kd                    the kdtree module (docs/lua-api.md); m:memory() for memory by component
  help                  this text          exit, quit or Ctrl-D: leave    Tab: complete names
]]

-- ---------------------------------------------------------------- completion
local KEYWORDS = { "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in",
  "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while", "help", "exit", "quit" }

-- the names that may complete `text`: globals, a table's fields after `a.b.`, an object's
-- methods after `obj:` (its metatable's __index table)
function R.complete(E, text)
  local head, sep, prefix = text:match("^(.-)([%.:])([%w_]*)$")
  local sources = {}
  if head then
    local v = E
    for name in head:gmatch("[^%.:]+") do
      local ok, nv = pcall(function() return v[name] end)
      if not ok or nv == nil then return {} end
      v = nv
    end
    if type(v) == "table" and sep == "." then sources[#sources + 1] = v end
    local mt = getmetatable(v)
    while type(mt) == "table" do
      if type(mt.__index) == "table" then
        sources[#sources + 1] = mt.__index
        mt = getmetatable(mt.__index)
      else                        -- an __index function (kdtree.tree): the methods sit in mt itself
        sources[#sources + 1] = mt
        break
      end
    end
    if type(v) == "string" then sources[#sources + 1] = string end
  else
    head, sep, prefix = "", "", text
    sources = { E, _G, KEYWORDS }
  end
  local seen, out = {}, {}
  for _, src in ipairs(sources) do
    for k, v in pairs(src) do
      local name = src == KEYWORDS and v or k
      if type(name) == "string" and name:match("^[%a_][%w_]*$") and name:sub(1, #prefix) == prefix
          and not name:match("^_") and not seen[name] and (sep ~= ":" or type(v) == "function") then
        seen[name] = true
        out[#out + 1] = head .. sep .. name
      end
    end
  end
  table.sort(out)
  return out
end

-- ---------------------------------------------------------------- line input
pcall(ffi.cdef, [[
typedef void (*kd_rl_line_fn)(char *line);
typedef char *(*kd_rl_entry_fn)(const char *text, int state);
typedef char **(*kd_rl_complete_fn)(const char *text, int start, int end);
void rl_callback_handler_install(const char *prompt, kd_rl_line_fn handler);
void rl_callback_read_char(void);
void rl_callback_handler_remove(void);
int rl_replace_line(const char *text, int clear_undo);
char **rl_completion_matches(const char *text, kd_rl_entry_fn entry);
kd_rl_complete_fn rl_attempted_completion_function;
int rl_attempted_completion_over;
int rl_completion_append_character;
int rl_catch_signals;
const char *rl_readline_name;
void add_history(const char *line);
int read_history(const char *filename);
int append_history(int n, const char *filename);
int history_truncate_file(const char *filename, int lines);
struct kd_pollfd { int fd; short events; short revents; };
int poll(struct kd_pollfd *fds, unsigned long n, int timeout);
int isatty(int fd);
int mkdir(const char *path, unsigned int mode);
]])
pcall(ffi.cdef, "void free(void *p);")
pcall(ffi.cdef, "char *strdup(const char *s);")

-- where the history lives: $XDG_STATE_HOME/kdtree/history, else ~/.kdtree_history
function R.history_path()
  local state = os.getenv("XDG_STATE_HOME")
  if state and state ~= "" then
    ffi.C.mkdir(state, 448)                -- 0700, as the XDG spec asks; existing ones stay
    ffi.C.mkdir(state .. "/kdtree", 448)
    return state .. "/kdtree/history"
  end
  return (os.getenv("HOME") or ".") .. "/.kdtree_history"
end

local HISTORY_LINES = 1000

-- read(prompt) -> a line, nil at end of input, or false when Ctrl-C cleared the line
local function readline_reader(rl, E)
  local hist = R.history_path()
  local f = io.open(hist, "a")      -- append_history needs the file to exist
  if f then f:close() end
  rl.read_history(hist)
  rl.rl_catch_signals = 0           -- SIGINT is blocked and polled; readline need not catch it
  rl.rl_readline_name = "kdtree"
  local matches
  -- C calls these back from rl_callback_read_char (an FFI call made by the interpreter: jit.off)
  local entry = ffi.cast("kd_rl_entry_fn", function(_, state)
    local m = matches[state + 1]
    return m and ffi.C.strdup(m) or nil
  end)
  rl.rl_attempted_completion_function = ffi.cast("kd_rl_complete_fn", function(text)
    rl.rl_attempted_completion_over = 1           -- no file names
    rl.rl_completion_append_character = 0         -- `m:new_seq` is followed by `(`, not a space
    matches = R.complete(E, ffi.string(text))
    return rl.rl_completion_matches(text, entry)
  end)
  local line, waiting
  local on_line = ffi.cast("kd_rl_line_fn", function(p)
    if p == nil then line = nil else line = ffi.string(p); ffi.C.free(p) end
    rl.rl_callback_handler_remove()
    waiting = false
  end)
  local pfd = ffi.new("struct kd_pollfd[1]")
  pfd[0].fd, pfd[0].events = 0, 1                  -- POLLIN on standard input
  local function read(prompt)
    waiting = true
    rl.rl_callback_handler_install(prompt, on_line)
    while waiting do
      if ffi.C.poll(pfd, 1, 100) > 0 then
        rl.rl_callback_read_char()
      elseif interrupt.take() then               -- Ctrl-C: drop the line, a fresh prompt
        rl.rl_replace_line("", 0)
        rl.rl_callback_handler_remove()
        io.write("^C\n")
        return false
      end
    end
    if line and line:match("%S") then
      rl.add_history(line)
      rl.append_history(1, hist)
    end
    return line
  end
  jit.off(read)
  local function close() rl.history_truncate_file(hist, HISTORY_LINES) end
  return read, close
end

local function make_reader(E)
  local ok, rl = pcall(ffi.load, "libreadline.so.8")
  if not ok then ok, rl = pcall(ffi.load, "readline") end
  if ok and ffi.C.isatty(0) == 1 and os.getenv("TERM") ~= "dumb" and os.getenv("KDTREE_NO_READLINE") == nil then
    local read, close = readline_reader(rl, E)
    return read, close, "readline"
  end
  return function(prompt)
    io.stdout:write(prompt)
    io.stdout:flush()
    local line = io.read("*l")
    if interrupt.take() then return false end
    return line
  end, function() end, "plain"
end

-- ---------------------------------------------------------------- evaluation
-- one chunk: expressions print their values; incomplete input asks for more ("more")
local function eval(E, src)
  local f, err = loadstring("return " .. src, "=repl")
  if not f then f, err = loadstring(src, "=repl") end
  if not f then
    if err:match("<eof>") then return "more" end
    print(err)
    return
  end
  setfenv(f, E)
  -- Ctrl-C while Lua runs: an error inside the protected call (polled every 100k instructions;
  -- count hooks run only in the interpreter, so what is typed runs there, not as JIT traces)
  jit.off(f, true)
  debug.sethook(function() if interrupt.take() then error("interrupted", 2) end end, "", 100000)
  local res = { xpcall(f, debug.traceback) }
  debug.sethook()
  if not res[1] then
    print((tostring(res[2]):gsub("\nstack traceback:.*", ""):gsub("^repl:%d+: ", "")))
    return
  end
  local out = {}
  for i = 2, table.maxn(res) do out[#out + 1] = show(res[i]) end
  if #out > 0 then print(table.concat(out, "\t")) end
end
R.eval = eval

local COMMANDS = { help = "help()", exit = false, quit = false }

function R.start(opts)
  opts = opts or {}
  interrupt.block()
  local E = R.env(opts)
  local read, close, kind = make_reader(E)
  print(string.format("kdtree %s REPL (%s input): help lists the helpers, exit leaves", kd.version(), kind))
  if opts.model then E.load(opts.model) end
  if opts.draft then E.drafter(opts.draft) end
  local buf = nil
  while true do
    -- a Ctrl-C that came while no reply or Lua ran (a reply that ended by itself first, or one
    -- typed ahead of buffered input) is dropped here: left pending it would end the session
    -- at exit, with SIGINT's status, once a thread that does not block it (CUDA's) exists
    interrupt.take()
    -- the read is inside the protected call too: nothing that happens at the prompt ends the session
    local ok, line = pcall(read, buf and ">> " or "kd> ")
    if not ok then
      print(tostring(line))
      line = false
    end
    if line == nil then print(); break end
    if line == false then
      buf = nil
    else
      local word = not buf and line:match("^%s*(%a+)%s*$")
      if word and COMMANDS[word] == false then break end
      if word and COMMANDS[word] then line = COMMANDS[word] end
      buf = buf and (buf .. "\n" .. line) or line
      if eval(E, buf) ~= "more" then buf = nil end
      if rawget(E, "_exit") then break end
    end
  end
  interrupt.take()                 -- the same for a Ctrl-C typed ahead of `exit` (the CLI then
  close()                          -- ignores SIGINT for its way out: scripts/kdtree's cmd_repl)
  return E
end

return R
