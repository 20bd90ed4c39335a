-- spec/helpers/tp_matches_tp1.lua: tp_matches_tp1(m, ref_m, prompt, opts): the split model m (opened
-- at tp = opts.tp) and the one-rank model ref_m (TP-1) each run prompt in a new sequence; m's last-row
-- logits are within opts.tol of TP-1's (opts.relative: opts.tol times TP-1's largest |logit|, else
-- absolute), m's cache holds #prompt rows on every layer and is identical on every rank, and where
-- opts.cache_tol is given it is within that of TP-1's cache (the CPU split; on CUDA each rank's bf16
-- partials move it by noise). opts.name labels the printed measurement.
-- Shared by spec/tp_spec.lua (CPU ranks) and spec/tp_cuda_spec.lua (CUDA ranks on one GPU).
local assert = require("luassert")

-- the largest |a[i] - b[i]| over i = first .. first + n - 1 (float* cdata: first 0; Lua lists: 1),
-- math.huge when a difference is NaN
local function max_diff(a, b, n, first)
  local d = 0
  for i = first, first + n - 1 do
    local x = math.abs(a[i] - b[i])
    if x ~= x then return math.huge end
    d = math.max(d, x)
  end
  return d
end

return function(m, ref_m, prompt, opts)
  local s, s1 = m:new_seq(64), ref_m:new_seq(64)
  s:forward(prompt)
  s1:forward(prompt)
  local a, n = s:logits_cdata(1)
  local b = s1:logits_cdata(1)
  local d, top = max_diff(a, b, n, 0), 0
  for i = 0, n - 1 do top = math.max(top, math.abs(b[i])) end
  print(("\n  %s tp %d: prompt logits max |diff| %.3g, relative %.3g"):format(opts.name, opts.tp, d, d / top))
  local bound = opts.relative and opts.tol * top or opts.tol
  assert.is_true(d <= bound, "logits differ by " .. d .. " (largest |logit| " .. top .. ")")
  local w = m.info.kv_lora_rank + m.info.qk_rope_dim
  for l = 0, m.info.n_layers - 1 do
    local c0 = s:read_cache(l, 0, #prompt, 0)
    assert.are.equal(#prompt * w, #c0)
    for r = 1, opts.tp - 1 do assert.are.same(c0, s:read_cache(l, 0, #prompt, r), "layer " .. l .. " rank " .. r) end
    if opts.cache_tol then
      local dc = max_diff(c0, s1:read_cache(l, 0, #prompt), #prompt * w, 1)
      assert.is_true(dc <= opts.cache_tol, "layer " .. l .. ": cache differs from TP-1 by " .. dc)
    end
  end
  s:close(); s1:close()
end
