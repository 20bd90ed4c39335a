-- repl.lua: an interactive LuaJIT prompt for poking at the engine.
-- Uses GNU readline through the FFI when libreadline is present (history, line editing),
-- else plain io.read. `kd` is preloaded, expressions print their values, and helpers
-- cover one DDTree round step by step:
--   load(dir)            open a target model as `m` (and a fresh sequence `s`; `tok`, its tokenizer, when
--                        the directory has one)
--   drafter(dir)         open a DFlash drafter as `d`, attached to `s`
--   prefill{5, 77, 300}  forward a prompt (or prefill"text" through `tok`); sets `bonus` (the greedy next token)
--   draft(bonus)         one draft pass -> `lp` (L x V log-probs)
--   tree(budget)         build a tree from `lp` (or the drafted one) -> `t`, printed
--   verify()             verify `t` on `s`
--   accept()             accept (greedy) -> acc = {nodes, tokens, tau, bonus}; commit()
--   round(budget)        draft + tree + verify + accept + commit in one go
--   top(k, row)          the k most likely tokens of an output row of the last forward
--   help()               this list
local kd = require("kdtree")
local ffi = require("ffi")

local R = {}

-- ---- line input: readline via FFI, or io.read ----
local function make_reader()
  -- each declaration on its own: another module may have declared free() already
  pcall(ffi.cdef, "char *readline(const char *prompt);")
  pcall(ffi.cdef, "void add_history(const char *line);")
  pcall(ffi.cdef, "void free(void *p);")
  local ok, rl = pcall(ffi.load, "libreadline.so.8")
  if not ok then ok, rl = pcall(ffi.load, "readline") end
  if ok and rl and os.getenv("TERM") ~= "dumb" and os.getenv("KDTREE_NO_READLINE") == nil then
    return function(prompt)
      local p = rl.readline(prompt)
      if p == nil then return nil end
      local line = ffi.string(p)
      ffi.C.free(p)
      if line:match("%S") then rl.add_history(line) end
      return line
    end, "readline"
  end
  return function(prompt)
    io.stdout:write(prompt)
    io.stdout:flush()
    return io.read("*l")
  end, "plain"
end

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

-- the helper environment (globals of the REPL)
function R.env(opts)
  opts = opts or {}
  local E = setmetatable({ kd = kd, ffi = ffi }, { __index = _G })
  E.show = show
  E.help = function() print((R.helptext:gsub("^%s+", ""))) end

  function E.load(dir, o)
    if E.m then pcall(function() E.s:close() end) end
    E.m = kd.open_model(dir, { backend = (o and o.backend) or opts.backend, tp = (o and o.tp) or opts.tp,
      devices = (o and o.devices) or opts.devices })
    E.s = E.m:new_seq((o and o.capacity) or 4096)
    local f = io.open(dir .. "/tiktoken.model")
    if E.tok then E.tok:close(); E.tok = nil end
    if f then
      f:close()
      local ok, t = pcall(kd.open_tokenizer, dir)   -- a bad tokenizer leaves the model usable
      if ok then E.tok = t else print("no tokenizer: " .. tostring(t)) end
    end
    return E.m
  end
  function E.drafter(dir)
    assert(E.m, "load a model first: load(dir)")
    E.d = kd.open_drafter(dir, E.m)
    E.s:attach_drafter(E.d)
    return E.d
  end
  function E.prefill(ids)
    assert(E.s, "load a model first: load(dir)")
    if type(ids) == "string" then
      assert(E.tok, "this model directory has no tokenizer (tiktoken.model): give token ids")
      ids = E.tok:encode(ids)
    end
    E.s:forward(ids)
    local a = E.s:argmax()
    E.bonus = a[#a]
    print(string.format("len %d, next token (bonus) %d", E.s:len(), E.bonus))
  end
  function E.top(k, row)
    assert(E.s, "load a model first: load(dir)")
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
    bonus = bonus or E.bonus
    E.lp = E.s:draft(bonus)
    print(string.format("draft: %d x %d log-probs after bonus %d (lp)", E.lp.L, E.lp.V, bonus))
  end
  function E.tree(budget, scores)
    budget = budget or 16
    if E.t then E.t:close() end
    if scores then
      E.t = kd.tree.build(scores, budget, { logprobs = true, root = E.bonus })
    else
      E.t = kd.tree.build_drafted(E.s, budget)
    end
    print(E.t:dump())
  end
  function E.verify() E.s:verify(E.t); print(string.format("verified %d nodes", E.t.n + 1)) end
  function E.accept(sampler)
    E.acc = E.s:accept(E.t, sampler)
    print(string.format("tau %d: tokens %s, bonus %d", E.acc.tau, table.concat(E.acc.tokens, " "), E.acc.bonus))
  end
  function E.commit()
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
  return E
end

R.helptext = [[
  kd                    the kdtree module (kd.open_model, kd.tree.build, ...; docs/lua-api.md)
  load(dir)             open a target model as m, with a sequence s (and its tokenizer as tok, if any)
  drafter(dir)          open a DFlash drafter as d and attach it to s
  prefill{5, 77, 300}   forward a prompt (prefill"text": through tok); sets bonus (the greedy next token)
  top(k, row)           top-k tokens of an output row of the last forward (default: last row) -> tops
  draft()               one draft pass after bonus -> lp (L x V log-probs, lp:row(i))
  tree(budget)          DDTree from the drafted log-probs -> t (printed)
  tree(budget, rows)    ... or from any L x V log-prob rows (Lua drafters)
  verify()  accept()  commit()    the rest of a round, step by step (accept -> acc)
  round(budget)         a whole round
  show(v)               print a table readably
  quit with Ctrl-D or os.exit()
]]

-- evaluate one chunk: expressions print their values; incomplete input asks for more
local function eval(E, src)
  local f, err = loadstring("return " .. src, "=repl")
  if not f then f, err = loadstring(src, "=repl") end
  if not f then
    if err:match("<eof>") then return "more" end
    print(err)
    return
  end
  setfenv(f, E)
  local res = { xpcall(f, debug.traceback) }
  if not res[1] then
    print((tostring(res[2]):gsub("\nstack traceback:.*", "")))
    return
  end
  local out = {}
  for i = 2, table.maxn(res) do out[#out + 1] = show(res[i]) end
  if #out > 0 then print(table.concat(out, "\t")) end
end
R.eval = eval

function R.start(opts)
  opts = opts or {}
  local read, kind = make_reader()
  local E = R.env(opts)
  print(string.format("kdtree %s REPL (%s input); help() lists the helpers", kd.version(), kind))
  if opts.model then E.load(opts.model) end
  if opts.draft then E.drafter(opts.draft) end
  local buf = nil
  while true do
    local line = read(buf and ">> " or "kd> ")
    if line == nil then print(); break end
    buf = buf and (buf .. "\n" .. line) or line
    if eval(E, buf) ~= "more" then buf = nil end
  end
  return E
end

return R
