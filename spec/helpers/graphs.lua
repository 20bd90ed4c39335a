-- spec/helpers/graphs.lua: what the step-graph specs (graphs_spec, draft_graphs_spec) share:
-- runs under a graph mode (the sequences' graphs options), recordings of a run's tokens and
-- float buffers compared bit for bit, seeded prompts, the greedy DDTree round loop, and the
-- host emulation of the graph ops (spec/c/testing_graphs.h).
local kd = require("kdtree")
local K = require("kdtree.ffi")
local ffi = K.ffi
local assert = require("luassert")   -- busted's assert (a module does not see the spec's environment)

local M = {}

require("helpers.testlib").cdef("testing_graphs.h")
M.C = K.C

-- run fn with the sequence options o ({graphs = ..., draft_graphs = ...}) as m's defaults for
-- the sequences it makes (m.seq_options, the Lua layer's), then put the old ones back
function M.with_seq_options(m, o, fn)
  local saved = m.seq_options
  m.seq_options = o
  local ok, res = pcall(fn)
  m.seq_options = saved
  if not ok then error(res, 0) end
  return res
end
-- fn with graphs = mode ("off", "on", "eager") for the sequences (and so the drafter
-- attachments) it makes on m
function M.with_mode(m, mode, fn) return M.with_seq_options(m, { graphs = mode }, fn) end

-- a recording: tokens, and float buffers (copies) in order with their sizes and what they hold
function M.recorder() return { tokens = {}, bufs = {}, sizes = {}, what = {} } end
function M.keep(rec, buf, n, what)
  rec.bufs[#rec.bufs + 1] = buf
  rec.sizes[#rec.sizes + 1] = n
  rec.what[#rec.what + 1] = what
end
-- the logits of s's last forward
function M.keep_logits(rec, s)
  local buf, n = s:logits_cdata()
  M.keep(rec, buf, n, "logits")
end
-- a draft pass of s after bonus, its log-probs copied to the host
function M.keep_draft(rec, s, bonus)
  local dr = s:draft(bonus)
  M.keep(rec, dr.data, dr.L * dr.V, "draft")
end

-- two recordings hold the same tokens and the same buffer bits; a recorded draft is also a
-- real log-softmax (finite, <= 0, not flat)
function M.same_run(a, b, what)
  assert.are.same(a.tokens, b.tokens, what .. ": tokens")
  assert.are.equal(#a.bufs, #b.bufs, what .. ": recorded buffers")
  for i = 1, #a.bufs do
    assert.are.equal(a.sizes[i], b.sizes[i], what .. ": buffer " .. i .. " size")
    local ua, ub = ffi.cast("uint32_t*", a.bufs[i]), ffi.cast("uint32_t*", b.bufs[i])
    for j = 0, a.sizes[i] - 1 do
      if ua[j] ~= ub[j] then
        error(string.format("%s: buffer %d (%s), entry %d: %.9g vs %.9g (bits %08x vs %08x)", what, i, a.what[i], j,
          a.bufs[i][j], b.bufs[i][j], ua[j], ub[j]), 0)
      end
    end
    if a.what[i] == "draft" then
      local lo, hi = math.huge, -math.huge
      for j = 0, a.sizes[i] - 1 do
        local v = a.bufs[i][j]
        assert(v == v and v <= 0, what .. ": draft log-prob not finite or > 0")
        if v < lo then lo = v end
        if v > hi then hi = v end
      end
      assert(hi - lo > 1e-3, what .. ": a flat draft")
    end
  end
end

-- n token ids in [3, min(990, V - 1)], the same for a seed
function M.prompt_of(n, V, seed)
  math.randomseed(seed)
  local p = {}
  for i = 1, n do p[i] = math.random(3, math.min(990, V - 1)) end
  return p
end

-- greedy DDTree rounds on a new sequence of m (drafter d attached, or none) after prompt,
-- until n tokens: tree_of(rec, s, bonus, round) gives each round's tree under bonus (budget
-- nodes at most); the verify logits of every round are recorded
function M.rounds_run(m, d, prompt, budget, n, tree_of)
  local rec = M.recorder()
  local s = m:new_seq(#prompt + n + budget + 2 + (d and d.info.block_size or 0))
  if d then s:attach_drafter(d) end
  s:forward(prompt)
  local bonus = s:argmax()[#prompt]
  local round = 0
  while #rec.tokens < n do
    round = round + 1
    local t = tree_of(rec, s, bonus, round)
    s:verify(t)
    M.keep_logits(rec, s)
    local acc = s:accept(t)
    s:commit(t)
    for i = 2, acc.tau do rec.tokens[#rec.tokens + 1] = acc.tokens[i] end
    rec.tokens[#rec.tokens + 1] = acc.bonus
    bonus = acc.bonus
    t:close()
  end
  s:close()
  return rec
end

-- give a CPU model the graph ops of the host emulation: a capture records op calls with their
-- arguments and a launch replays them, so a host value baked into a step replays wrong
function M.emulate(m)
  kd.check(M.C.kd_testing_emulate_graphs(m:handle()), "kd_testing_emulate_graphs")
end

return M
