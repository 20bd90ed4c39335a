-- check_tokenizer.lua MODEL_DIR GOLDENS_JSON: the engine's tokenizer (kd.open_tokenizer) against the tiktoken ids
-- a run of the mini-code recipe wrote (tokenize_corpus.py: tokenizer_goldens.json). Run from the repository root:
--   KDTREE_LIB=build/libkdtree.so luajit scripts/train/check_tokenizer.lua OUT/models/mini-code OUT/tokenizer_goldens.json
-- Prints one line per mismatch and the count; exits 1 on any mismatch.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local ck = require("helpers.checkpoint")
local dir, path = arg[1], arg[2]
if not dir or not path then
  io.stderr:write("usage: luajit scripts/train/check_tokenizer.lua MODEL_DIR GOLDENS_JSON\n")
  os.exit(2)
end
local golden = ck.read_json(path)
local tok = kd.open_tokenizer(dir)
local function same(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end
local bad = 0
if tok.n_base ~= golden.n_base then
  print(("n_base: engine %d, golden %d"):format(tok.n_base, golden.n_base)); bad = bad + 1
end
for name, id in pairs(golden.special) do
  if tok:special(name) ~= id then print(("special %s: engine %s, golden %d"):format(name, tostring(tok:special(name)), id)); bad = bad + 1 end
end
for i, c in ipairs(golden.cases) do
  if not same(tok:encode(c.text), c.ids) then print(("case %d %q: ids differ"):format(i, c.text:sub(1, 60))); bad = bad + 1 end
  if not same(tok:encode(c.text, { special = true }), c.ids_special) then
    print(("case %d %q: ids (special) differ"):format(i, c.text:sub(1, 60))); bad = bad + 1
  end
  if tok:decode(c.ids) ~= c.text then print(("case %d: decode differs"):format(i)); bad = bad + 1 end
end
print(("%d cases, %d mismatches"):format(#golden.cases, bad))
os.exit(bad == 0 and 0 or 1)
