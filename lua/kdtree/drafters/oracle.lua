-- drafters/oracle.lua: a Lua drafter that knows the future (for tests and demos).
-- Given the true continuation, it puts probability `confidence` on the true token at every
-- depth and spreads the rest evenly, so a DDTree with budget >= depth accepts depth+1
-- tokens every round (tau = L + 1) as long as the future it was given reaches that far.
local ffi = require("ffi")

local Oracle = {}
Oracle.__index = Oracle

-- opts: future = the full token stream (prompt followed by the true continuation),
--       vocab = V, depth = L (default 7), confidence (default 0.9)
function Oracle.new(opts)
  assert(type(opts) == "table" and type(opts.future) == "table", "oracle: opts.future: expected a token list")
  assert(type(opts.vocab) == "number", "oracle: opts.vocab: expected the vocabulary size")
  return setmetatable({ future = opts.future, vocab = opts.vocab, depth = opts.depth or 7,
                        confidence = opts.confidence or 0.9 }, Oracle)
end

-- context: committed tokens (the bonus is at position #context + 1); returns L x V log-probs
function Oracle:draft(context, bonus)
  local L, V = self.depth, self.vocab
  local hit = math.log(self.confidence)
  local miss = math.log((1 - self.confidence) / (V - 1))
  local uniform = -math.log(V)
  local data = ffi.new("float[?]", L * V)
  for d = 1, L do
    local tok = self.future[#context + 1 + d]
    local base = (d - 1) * V
    for j = 0, V - 1 do data[base + j] = tok and miss or uniform end
    if tok then data[base + tok] = hit end
  end
  return { data = data, L = L, V = V }
end

return Oracle
