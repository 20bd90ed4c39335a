-- spec/helpers/rank_failure.lua: rank_failure(m, prompt): on a model m opened at tp 2, rank 0 (the
-- caller's thread) fails in the first layer of a forward while rank 1 waits in the all-reduce; the
-- error reaches the caller naming rank 0, the sequence keeps its length and goes on, and a new run
-- gives the tokens of a run before the failure (the communicator was aborted, then reset).
-- Shared by spec/tp_spec.lua (CPU ranks) and spec/tp_cuda_spec.lua (CUDA ranks on one GPU).
local assert = require("luassert")
local gen = require("kdtree.generate")
local O = require("spec.helpers.ops")
local err_of = require("spec.helpers.err_of")

return function(m, prompt)
  local ref_toks = gen.run(m, prompt, { n = 8, eos = false }).tokens
  local s = m:new_seq(64)
  s:forward(prompt)
  local len = s:len()
  O.check(O.C.kd_test_fail_op(m:handle(), "mla_rope_store", 0), "kd_test_fail_op")
  local e = err_of(s.forward, s, { 5 })
  O.check(O.C.kd_test_fail_op(m:handle(), nil, -1), "kd_test_fail_op (clear)")
  assert.matches("rank 0 of 2: forward: layer 0: backend op mla_rope_store failed", e, 1, true)
  assert.are.equal(len, s:len())
  s:forward({ 5 })
  assert.are.equal(len + 1, s:len())
  s:close()
  assert.are.same(ref_toks, gen.run(m, prompt, { n = 8, eos = false }).tokens)
end
