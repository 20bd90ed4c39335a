-- tree.lua: draft trees (kd_tree). Node 0 is the root (the bonus token); drafted nodes
-- are 1..n in pop order. The Lua fields follow every change:
--   t.n, t.root (root token, -1 until set), t.tokens[i], t.parents[i] (node id, 0 = root),
--   t.depths[i] for i = 1..n.
local K = require("kdtree.ffi")
local H = require("kdtree.handle")
local U = require("kdtree.util")
local ffi, C, check = K.ffi, K.C, K.check

local Tree = {}
-- tokens / parents / depths / root are read from C on first access after a change (a tree
-- built on the backend stays there until someone looks at its nodes): a change clears them,
-- and a read of a cleared one loads all four
local LAZY = { tokens = true, parents = true, depths = true, root = true }
Tree.__index = function(t, k)
  if LAZY[k] and rawget(t, "_h") ~= nil then
    t:_load()
    return rawget(t, k)
  end
  return Tree[k]
end
Tree.__tostring = function(t)
  if rawget(t, "_h") == nil then return "kdtree.tree (closed)" end
  return string.format("kdtree.tree(%d nodes, root %d)", t.n, t.root)
end

local M = { Tree = Tree }

local function free_tree(p) C.kd_tree_free(p) end

function M.new()
  local out = ffi.new("kd_tree*[1]")
  check(C.kd_tree_new(out), "kd_tree_new")
  local st, h = H.own(out[0], "kd_tree*", free_tree, "tree")
  local t = setmetatable({ _h = h, _st = st }, Tree)
  t:_sync()
  return t
end

function Tree:handle() return H.get(self, "tree") end
function Tree:is_closed() return rawget(self, "_h") == nil end
function Tree:close() H.close(self) end

-- after a change: the size now, the nodes when first read (Tree.__index)
function Tree:_sync()
  local h = H.get(self, "tree")
  self.n = tonumber(C.kd_tree_size(h))
  for k in pairs(LAZY) do rawset(self, k, nil) end
  return self
end

-- read the nodes from C into the Lua fields (kd_tree_nodes)
function Tree:_load()
  local h = H.get(self, "tree")
  local n = tonumber(C.kd_tree_size(h))
  local tk = ffi.new("int32_t[?]", n + 1)
  local pa = ffi.new("int32_t[?]", n + 1)
  local de = ffi.new("int32_t[?]", n + 1)
  check(C.kd_tree_nodes(h, tk, pa, de), "kd_tree_nodes")
  rawset(self, "root", tonumber(tk[0]))
  rawset(self, "tokens", U.list_from(tk, n, 1))
  rawset(self, "parents", U.list_from(pa, n, 1))
  rawset(self, "depths", U.list_from(de, n, 1))
  return self
end

-- scores: an L x V Lua table (rows of numbers) or {data = float* cdata, L =, V =}
-- -> (float* cdata, L, V); every row of a table must have V entries
local function score_array(scores)
  if type(scores) ~= "table" then
    error("kdtree: tree.build: logits: expected an L x V table or {data=, L=, V=}, got " .. type(scores), 3)
  end
  if scores.data == nil and (scores.L ~= nil or scores.V ~= nil) then
    error("kdtree: tree.build: logits {data=, L=, V=}: data is missing (expected a float* cdata)", 3)
  end
  if scores.data ~= nil then
    local L, V = scores.L, scores.V
    if type(L) ~= "number" or type(V) ~= "number" then
      error("kdtree: tree.build: logits {data=...} needs numeric L and V", 3)
    end
    return scores.data, L, V
  end
  local L = #scores
  local V = L > 0 and type(scores[1]) == "table" and #scores[1] or 0
  if L > 0 and type(scores[1]) ~= "table" then
    error("kdtree: tree.build: logits: expected a list of rows (L x V), row 1 is a " .. type(scores[1]), 3)
  end
  local a = ffi.new("float[?]", math.max(L * V, 1))
  for i = 1, L do
    local r = scores[i]
    if type(r) ~= "table" or #r ~= V then
      error(string.format("kdtree: tree.build: logits row %d: expected %d values (the width of row 1), got %s",
        i, V, type(r) == "table" and tostring(#r) or type(r)), 3)
    end
    local base = (i - 1) * V
    for j = 1, V do a[base + j - 1] = r[j] end
  end
  return a, L, V
end

-- t:build(scores, budget, opts): Algorithm 1 over L x V scores; opts.logprobs (default false:
-- the rows are logits and get log-softmaxed), opts.root (sets the root token)
function Tree:build(scores, budget, opts)
  local h = H.get(self, "tree")
  opts = opts or {}
  local a, L, V = score_array(scores)
  if type(budget) ~= "number" then error("kdtree: tree.build: budget: expected an integer, got " .. type(budget), 2) end
  check(C.kd_tree_build(h, a, L, V, budget, opts.logprobs and 1 or 0), "kd_tree_build")
  if opts.root then check(C.kd_tree_set_root(h, opts.root), "kd_tree_set_root") end
  return self:_sync()
end

function Tree:set_chain(root, tokens)
  local h = H.get(self, "tree")
  local a, n = U.int32s(tokens, nil, "tree.chain: tokens")
  check(C.kd_tree_set_chain(h, a, n), "kd_tree_set_chain")
  if root ~= nil then check(C.kd_tree_set_root(h, root), "kd_tree_set_root") end
  return self:_sync()
end

function Tree:set_root(tok)
  check(C.kd_tree_set_root(H.get(self, "tree"), tok), "kd_tree_set_root")
  return self:_sync()
end

-- from the last s:draft of sequence s, on the backend; the root is that draft's bonus token
function Tree:build_drafted(s, budget)
  check(C.kd_tree_build_drafted(H.get(self, "tree"), H.get(s, "seq"), budget), "kd_tree_build_drafted")
  return self:_sync()
end

-- the ancestor-only mask: (uint64_t* cdata, rows = 1+n, words per row)
function Tree:visibility()
  local h = H.get(self, "tree")
  local rows = self.n + 1
  local words = math.floor((rows + 63) / 64)
  local a = ffi.new("uint64_t[?]", rows * words)
  check(C.kd_tree_visibility(h, a), "kd_tree_visibility")
  return a, rows, words
end

-- node ids on the path root -> node i (inclusive), root (0) first
function Tree:path(i)
  local p = {}
  while i and i > 0 do table.insert(p, 1, i); i = self.parents[i] end
  table.insert(p, 1, 0)
  return p
end

-- a readable dump: one line per node, indented by depth, children under parents
function Tree:dump(out)
  H.get(self, "tree")
  local kids = {}
  for i = 1, self.n do
    local p = self.parents[i]
    kids[p] = kids[p] or {}
    table.insert(kids[p], i)
  end
  local lines = { string.format("tree: %d nodes, root token %d", self.n, self.root) }
  local function walk(node, indent)
    for _, c in ipairs(kids[node] or {}) do
      lines[#lines + 1] = string.format("%s[%d] token %d (depth %d)", indent, c, self.tokens[c], self.depths[c])
      walk(c, indent .. "  ")
    end
  end
  walk(0, "  ")
  local s = table.concat(lines, "\n")
  if out then out:write(s, "\n") end
  return s
end

-- Graphviz DOT of the tree (`dot -Tsvg`): one node per tree node, labelled with its token
-- (and its text, given a tokenizer), the root a box; accepted (node ids of an accepted path,
-- s:accept's r.nodes) drawn bold and filled, with bold edges between them
function Tree:dot(accepted, tok)
  H.get(self, "tree")
  local on = {}
  for _, id in ipairs(accepted or {}) do on[id] = true end
  local lines = { "digraph ddtree {", "  node [shape=ellipse];" }
  local function node(i, token)
    local label = tostring(token)
    if tok and token >= 0 then
      label = label .. "\\n" .. tok:decode({ token }):gsub("[%c\\\"]", function(c) return string.format("\\\\x%02x", c:byte()) end)
    end
    lines[#lines + 1] = string.format('  n%d [label="%s"%s%s];', i, label, i == 0 and ", shape=box" or "",
      on[i] and ', style="bold,filled", fillcolor="palegreen"' or "")
  end
  node(0, self.root)
  for i = 1, self.n do node(i, self.tokens[i]) end
  for i = 1, self.n do
    local p = self.parents[i]
    lines[#lines + 1] = string.format("  n%d -> n%d%s;", p, i, (on[i] and on[p]) and " [penwidth=3]" or "")
  end
  lines[#lines + 1] = "}"
  return table.concat(lines, "\n") .. "\n"
end

-- ---- module functions (kd.tree.*) ----
-- any accepted score form (L x V table, or {data=, L=, V=}) -> {data = float* cdata, L =, V =}
function M.rows(scores)
  local a, L, V = score_array(scores)
  return { data = a, L = L, V = V }
end

function M.build(scores, budget, opts)
  local t = M.new()
  local ok, err = pcall(t.build, t, scores, budget, opts)
  if not ok then t:close(); error(err, 0) end
  return t
end

function M.chain(root, tokens)
  local t = M.new()
  local ok, err = pcall(t.set_chain, t, root, tokens)
  if not ok then t:close(); error(err, 0) end
  return t
end

function M.build_drafted(s, budget)
  local t = M.new()
  local ok, err = pcall(t.build_drafted, t, s, budget)
  if not ok then t:close(); error(err, 0) end
  return t
end

return M
