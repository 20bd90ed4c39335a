-- drafters/ngram.lua: prompt-lookup drafting as per-depth distributions.
-- Look for earlier occurrences of the last n tokens of (context .. bonus), longest n first
-- (max_n down to min_n). Every occurrence votes for the tokens that followed it: the token
-- d places after the match is a vote at depth d. Each depth's row is the smoothed vote
-- distribution  p(t) = (votes(t) + alpha / V) / (votes + alpha)  as log-probs, uniform where
-- nothing matched. The rows feed kd.tree.build like any drafter's log-probs, so a repetitive
-- text gets a bushy tree along its earlier continuations.
local ffi = require("ffi")

local Ngram = {}
Ngram.__index = Ngram

-- opts: vocab = V (required), depth = L (default 7), max_n (default 3), min_n (default 1),
--       alpha (smoothing mass, default 0.5), window (tokens searched back, default 4096)
function Ngram.new(opts)
  assert(type(opts) == "table" and type(opts.vocab) == "number", "ngram: opts.vocab: expected the vocabulary size")
  return setmetatable({ vocab = opts.vocab, depth = opts.depth or 7, max_n = opts.max_n or 3,
                        min_n = opts.min_n or 1, alpha = opts.alpha or 0.5,
                        window = opts.window or 4096 }, Ngram)
end

-- votes[d][token] from the occurrences of the longest suffix n-gram that occurs earlier
function Ngram:votes(seq)
  local N, L = #seq, self.depth
  local lo = math.max(1, N - self.window)
  for n = math.min(self.max_n, N - 1), self.min_n, -1 do
    local votes, found = {}, false
    for d = 1, L do votes[d] = { total = 0 } end
    -- match ending at position e (< N) equal to seq[N-n+1 .. N]
    for e = N - 1, lo + n - 1, -1 do
      local ok = true
      for k = 0, n - 1 do
        if seq[e - k] ~= seq[N - k] then ok = false; break end
      end
      if ok then
        found = true
        for d = 1, L do
          local t = seq[e + d]
          if t == nil or e + d > N then break end
          votes[d][t] = (votes[d][t] or 0) + 1
          votes[d].total = votes[d].total + 1
        end
      end
    end
    if found then return votes, n end
  end
  return nil, 0
end

-- context: committed tokens; bonus: the token after them. Returns L x V log-probs.
function Ngram:draft(context, bonus)
  local seq = {}
  for i = 1, #context do seq[i] = context[i] end
  seq[#seq + 1] = bonus
  local L, V, a = self.depth, self.vocab, self.alpha
  local votes = self:votes(seq)
  local data = ffi.new("float[?]", L * V)
  for d = 1, L do
    local vd = votes and votes[d]
    local total = vd and vd.total or 0
    local base = (d - 1) * V
    local floor = total > 0 and math.log((a / V) / (total + a)) or -math.log(V)
    for j = 0, V - 1 do data[base + j] = floor end
    if total > 0 then
      for t, c in pairs(vd) do
        if t ~= "total" then data[base + t] = math.log((c + a / V) / (total + a)) end
      end
    end
  end
  return { data = data, L = L, V = V }
end

return Ngram
