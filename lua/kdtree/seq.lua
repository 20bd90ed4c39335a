-- seq.lua: a sequence (kd_seq): the latent KV cache, the outputs of the last forward,
-- the DDTree round state and, once attached, the drafter's context.
--
-- Indexing: output rows are 1-based in Lua (s:logits(1) is the first row of the last
-- forward); positions, cache slots (truncate, compact, read_cache) and layers are the
-- engine's own 0-based numbers, because they are absolute positions, not list indices.
local K = require("kdtree.ffi")
local H = require("kdtree.handle")
local U = require("kdtree.util")
local ffi, C, check = K.ffi, K.C, K.check

local Seq = {}
Seq.__index = Seq
Seq.__tostring = function(s)
  if rawget(s, "_h") == nil then return "kdtree.seq (closed)" end
  return string.format("kdtree.seq(len %d / capacity %d)", s:len(), s:capacity())
end

local function free_seq(p) C.kd_seq_free(p) end

function Seq.new(model, capacity, opts)
  local mh = H.get(model, "model")
  if type(capacity) ~= "number" or capacity ~= math.floor(capacity) then
    error("kdtree: new_seq: capacity: expected an integer, got " .. tostring(capacity), 2)
  end
  local o = require("kdtree.options").seq(opts or {})
  local out = ffi.new("kd_seq*[1]")
  check(C.kd_seq_new_opts(mh, capacity, o, out), "kd_seq_new")
  -- the sequence holds its model: natively (refs) and in Lua (s.model)
  local st, h = H.own(out[0], "kd_seq*", free_seq, "seq", { model._st })
  return setmetatable({ _h = h, _st = st, model = model, vocab = model.info.vocab,
                        _last_pos = nil }, Seq)
end

function Seq:handle() return H.get(self, "seq") end
function Seq:is_closed() return rawget(self, "_h") == nil end
function Seq:close() H.close(self) end

function Seq:len() return tonumber(C.kd_seq_len(H.get(self, "seq"))) end
function Seq:capacity() return tonumber(C.kd_seq_capacity(H.get(self, "seq"))) end
function Seq:out_rows() return tonumber(C.kd_seq_out_rows(H.get(self, "seq"))) end

-- s:forward(tokens, opts) or s:forward(tokens_cdata, n, opts)
-- opts.positions: Lua list or int32 cdata (default len, len+1, ...)
-- opts.visible: uint64_t cdata, T rows of ceil(T/64) words (default causal)
function Seq:forward(tokens, n, opts)
  local h = H.get(self, "seq")
  if type(n) == "table" then opts, n = n, nil end
  opts = opts or {}
  local tk, nt = U.int32s(tokens, n, "forward: tokens")
  local pos = nil
  if opts.positions ~= nil then
    local np
    pos, np = U.int32s(opts.positions, type(opts.positions) == "cdata" and nt or nil, "forward: positions")
    if np ~= nt then
      error(string.format("kdtree: forward: positions: expected %d entries (one per token), got %d", nt, np), 2)
    end
  end
  local vis = opts.visible
  if vis ~= nil and type(vis) == "table" then
    -- a Lua list of words (numbers) -> uint64 array
    local a = ffi.new("uint64_t[?]", #vis)
    for i = 1, #vis do a[i - 1] = vis[i] end
    vis = a
  end
  local len0 = tonumber(C.kd_seq_len(h))
  check(C.kd_forward(h, tk, nt, pos, vis), "kd_forward")
  -- remember positions of the rows, for sample()'s default keys
  local lp = {}
  for i = 1, nt do lp[i] = pos and tonumber(pos[i - 1]) or (len0 + i - 1) end
  self._last_pos = lp
  return self
end

-- one output row of the last forward as a Lua list of vocab floats (row is 1-based)
function Seq:logits(row)
  local h = H.get(self, "seq")
  row = row or 1
  local V = self.vocab
  local buf = ffi.new("float[?]", V)
  check(C.kd_seq_logits(h, row - 1, 1, buf), "kd_seq_logits(row " .. tostring(row) .. ")")
  return U.list_from(buf, V)
end

-- rows [row, row+n) (1-based; default all) as a float* cdata copy; returns (data, count, n_rows)
function Seq:logits_cdata(row, n)
  local h = H.get(self, "seq")
  row = row or 1
  n = n or (tonumber(C.kd_seq_out_rows(h)) - row + 1)
  local V = self.vocab
  local buf = ffi.new("float[?]", math.max(n * V, 1))
  check(C.kd_seq_logits(h, row - 1, n, buf), "kd_seq_logits")
  return buf, n * V, n
end

function Seq:argmax()
  local h = H.get(self, "seq")
  local n = tonumber(C.kd_seq_out_rows(h))
  local buf = ffi.new("int32_t[?]", math.max(n, 1))
  check(C.kd_seq_argmax(h, buf), "kd_seq_argmax")
  return U.list_from(buf, n)
end

-- one token per output row, drawn with key (seed, positions[i]); positions default to the
-- position each row produces (its own position + 1)
function Seq:sample(sampler, positions)
  local h = H.get(self, "seq")
  local n = tonumber(C.kd_seq_out_rows(h))
  if positions == nil then
    positions = {}
    local lp = self._last_pos or {}
    for i = 1, n do positions[i] = (lp[i] or 0) + 1 end
  end
  local pos, np = U.int32s(positions, type(positions) == "cdata" and n or nil, "sample: positions")
  if np ~= n then
    error(string.format("kdtree: sample: positions: expected %d entries (one per output row), got %d", n, np), 2)
  end
  local buf = ffi.new("int32_t[?]", math.max(n, 1))
  check(C.kd_seq_sample(h, U.sampler(sampler or {}), pos, buf), "kd_seq_sample")
  return U.list_from(buf, n)
end

function Seq:truncate(n)
  check(C.kd_seq_truncate(H.get(self, "seq"), n), "kd_seq_truncate")
  return self
end

-- slot start+keep[i] moves to start+i; keep: Lua list of 0-based offsets from start
function Seq:compact(start, keep)
  local h = H.get(self, "seq")
  local k, nk = U.int32s(keep, nil, "compact: keep")
  check(C.kd_seq_compact(h, start, k, nk), "kd_seq_compact")
  return self
end

-- cached latent rows [row0, row0+n) of layer `layer` (both 0-based), as one flat Lua list
-- of n * (kv_lora_rank + qk_rope_dim) floats
-- rank: which rank's replica of the latent cache (tensor parallel; default 0)
function Seq:read_cache(layer, row0, n, rank)
  local h = H.get(self, "seq")
  n = n or 1
  local w = self.model.info.kv_lora_rank + self.model.info.qk_rope_dim
  local buf = ffi.new("float[?]", math.max(n * w, 1))
  check(C.kd_seq_read_cache_rank(h, rank or 0, layer, row0, n, buf), "kd_seq_read_cache")
  return U.list_from(buf, n * w)
end

-- ---- DDTree round ----
function Seq:verify(tree)
  check(C.kd_verify(H.get(self, "seq"), H.get(tree, "tree")), "kd_verify")
  return self
end

-- returns {nodes = {...}, tokens = {...}, tau = n, bonus = id}; nodes/tokens root first
function Seq:accept(tree, sampler)
  local h, th = H.get(self, "seq"), H.get(tree, "tree")
  local cap = tonumber(C.kd_tree_size(th)) + 1
  local nodes = ffi.new("int32_t[?]", cap)
  local toks = ffi.new("int32_t[?]", cap)
  local ntau = ffi.new("int[1]")
  local bonus = ffi.new("int32_t[1]")
  check(C.kd_accept(h, th, U.sampler(sampler), nodes, toks, ntau, bonus), "kd_accept")
  local tau = tonumber(ntau[0])
  return { nodes = U.list_from(nodes, tau), tokens = U.list_from(toks, tau), tau = tau,
           bonus = tonumber(bonus[0]) }
end

function Seq:commit(tree)
  check(C.kd_commit(H.get(self, "seq"), H.get(tree, "tree")), "kd_commit")
  return self
end

-- ---- drafter ----
function Seq:attach_drafter(d)
  local h, dh = H.get(self, "seq"), H.get(d, "drafter")
  check(C.kd_seq_attach_drafter(h, dh), "kd_seq_attach_drafter")
  H.depend(self._st, d._st)   -- the drafter's native object outlives this sequence
  self.drafter = d
  return self
end

-- one draft pass over [bonus, MASK x (bs-1)]. Returns {data = float* cdata, L = bs-1, V = vocab}
-- (the form kd.tree.build accepts) with d:row(i) giving depth i as a Lua list.
-- s:draft(bonus, false) runs the pass without copying the log-probs to the host
-- (kd.tree.build_drafted reads them on the backend).
function Seq:draft(bonus, copy)
  local h = H.get(self, "seq")
  if self.drafter == nil then error("kdtree: draft: no drafter attached (use s:attach_drafter(d))", 2) end
  if copy == false then
    check(C.kd_draft(h, bonus, nil), "kd_draft")
    return nil
  end
  local L, V = self.drafter.info.block_size - 1, self.vocab
  local buf = ffi.new("float[?]", math.max(L * V, 1))
  check(C.kd_draft(h, bonus, buf), "kd_draft")
  return setmetatable({ data = buf, L = L, V = V }, {
    __index = { row = function(r, i) return U.list_from(r.data, r.V, (i - 1) * r.V) end } })
end

-- the argmax of each row of the last draft (ties: the lower id), taken on the backend: a Lua
-- list of bs-1 ids; only those come back (s:draft(bonus) copies bs-1 x vocab floats)
function Seq:draft_argmax()
  local h = H.get(self, "seq")
  if self.drafter == nil then error("kdtree: draft_argmax: no drafter attached (use s:attach_drafter(d))", 2) end
  local L = self.drafter.info.block_size - 1
  local buf = ffi.new("int32_t[?]", L)
  check(C.kd_draft_argmax(h, buf), "kd_draft_argmax")
  return U.list_from(buf, L, 0)
end

return Seq
