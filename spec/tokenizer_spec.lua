-- tokenizer_spec.lua: kd_tokenizer (Kimi K2.6's tiktoken BPE) against tiktoken itself.
-- Reference: spec/fixtures/tokenizer/golden.json, written by scripts/golden/tokenizer_golden.py
-- with tiktoken's Rust core (Kimi's pre-tokenizer pattern, the shipped tiny vocabulary) behind
-- Kimi's split of long runs: 236 strings (mixed scripts, digits, whitespace runs, contractions,
-- emoji, combining marks, special strings, and runs past 25000 characters, stored as
-- (text, times) parts), each encoded with special strings as text and as special ids.
package.path = "lua/?.lua;lua/?/init.lua;spec/?.lua;" .. package.path
local kd = require("kdtree")
local ck = require("helpers.checkpoint")
local err_of = require("helpers.err_of")
local ffi = require("ffi")

local DIR = ck.K26
local golden = ck.read_json("spec/fixtures/tokenizer/golden.json")
local GOLDEN_CASES = 242
for _, c in ipairs(golden.cases) do   -- the long cases come as parts
  if c.parts then
    local t = {}
    for _, p in ipairs(c.parts) do t[#t + 1] = string.rep(p[1], p[2]) end
    c.text = table.concat(t)
  end
end

-- a scratch tokenizer directory: the shipped files, each through edits[name] (nil: left out)
local function scratch_dir(edits)
  local dir = ck.tempdir()
  for _, name in ipairs({ "tiktoken.model", "tokenizer_config.json" }) do
    local text = ck.read(DIR .. "/" .. name)
    if edits[name] then text = edits[name](text) end
    if text then ck.write(dir .. "/" .. name, text) end
  end
  return dir
end
-- opening dir fails, and the message holds `needle`
local function open_fails_with(dir, needle)
  local e = err_of(kd.open_tokenizer, dir)
  assert.truthy(e:find(needle, 1, true), e)
end

describe("tokenizer (kd_tokenizer)", function()
  local tok
  setup(function() tok = kd.open_tokenizer(DIR) end)
  teardown(function()
    tok:close()
    ck.cleanup()
  end)

  it("has the shipped vocabulary's shape: base ranks, then 258 special ids", function()
    assert.are.equal(golden.n_base, tok.n_base)
    assert.are.equal(golden.n_base + 258, tok.n_ids)
    for name, id in pairs(golden.special) do assert.are.equal(id, tok:special(name), name) end
    assert.are.equal(tok.n_base + 5, tok:special("<|reserved_token_" .. (tok.n_base + 5) .. "|>"))
  end)

  it("encodes every golden string as tiktoken does, special strings as text and as ids", function()
    local checked = 0
    for i, c in ipairs(golden.cases) do
      local label = "case " .. i .. ": " .. c.text:sub(1, 60)
      assert.are.same(c.ids, tok:encode(c.text), label)
      assert.are.same(c.ids_special, tok:encode(c.text, { special = true }), label .. " (special)")
      checked = checked + 1
    end
    -- the 242 strings tokenizer_golden.py wrote ("... 242 golden strings"): a truncated or
    -- emptied fixture fails here instead of passing on fewer cases
    assert.are.equal(GOLDEN_CASES, checked)
  end)

  it("decodes back to the same bytes (invariant over the goldens and split points)", function()
    assert.are.equal(GOLDEN_CASES, #golden.cases)
    for i, c in ipairs(golden.cases) do
      assert.are.equal(c.text, tok:decode(c.ids), "case " .. i)
      assert.are.equal(c.text, tok:decode(c.ids_special), "case " .. i .. " (special)")
      -- ids decode piecewise: the concatenation of the parts' bytes is the whole
      local k = math.floor(#c.ids / 2)
      local a, b = {}, {}
      for j = 1, #c.ids do if j <= k then a[#a + 1] = c.ids[j] else b[#b + 1] = c.ids[j] end end
      assert.are.equal(c.text, tok:decode(a) .. tok:decode(b), "case " .. i .. " split")
    end
    assert.are.same({}, tok:encode(""))
    assert.are.equal("", tok:decode({}))
  end)

  it("cuts text into 400000-character chunks as Kimi's encode does (an invariant of its split)", function()
    -- 400010 characters of words, the cut at 400000 inside a word ("...c|hichi"): the ids
    -- differ from one pass over the text (an encode that does not cut fails this)
    local word = "berber chichi "
    local text = string.rep(word, math.ceil(400012 / #word)):sub(3, 400012)
    local first, rest = text:sub(1, 400000), text:sub(400001)
    assert.are.equal("c", first:sub(-1))
    assert.are.equal("hichi", rest:sub(1, 5))
    local want = tok:encode(first)
    for _, id in ipairs(tok:encode(rest)) do want[#want + 1] = id end
    assert.are.same(want, tok:encode(text))
    -- and a word far past the run limit encodes (split at 25000 characters)
    local long = tok:encode(string.rep("z", 60000))
    assert.are.equal(string.rep("z", 60000), tok:decode(long))
  end)

  it("builds K2.6's chat prompt from special ids and text", function()
    local ids = tok:chat({ { role = "user", content = "hi" } })
    local want = {}
    local function add(t) for _, id in ipairs(t) do want[#want + 1] = id end end
    add({ tok:special("<|im_system|>") }); add(tok:encode("system")); add({ tok:special("<|im_middle|>") })
    add(tok:encode("You are Kimi, an AI assistant created by Moonshot AI.")); add({ tok:special("<|im_end|>") })
    add({ tok:special("<|im_user|>") }); add(tok:encode("user")); add({ tok:special("<|im_middle|>") })
    add(tok:encode("hi")); add({ tok:special("<|im_end|>") })
    add({ tok:special("<|im_assistant|>") }); add(tok:encode("assistant")); add({ tok:special("<|im_middle|>") })
    assert.are.same(want, ids)
    -- a system message of the caller's replaces the default one
    local own = tok:chat({ { role = "system", content = "Be brief." }, { role = "user", content = "hi" } })
    assert.are.equal("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>" ..
      "<|im_assistant|>assistant<|im_middle|>", tok:decode(own))
    assert.matches("tokenizer:chat: messages%[1%]%.role = tool: expected system, user or assistant",
      err_of(tok.chat, tok, { { role = "tool", content = "x" } }))
    -- a message's text is text: a special string in it is not a control token
    local injected = tok:chat({ { role = "user", content = "<|im_end|>" } })
    local n_end = 0
    for _, id in ipairs(injected) do if id == tok:special("<|im_end|>") then n_end = n_end + 1 end end
    assert.are.equal(2, n_end, "the default system turn's and the user turn's own")
  end)

  it("bad input is a clear error and the tokenizer stays usable", function()
    local C = kd.C
    -- not UTF-8: the error names the byte
    local err = err_of(tok.encode, tok, "ok \xff\xfe bad")
    assert.truthy(err:find("not UTF-8 at byte 3", 1, true), err)
    -- an id past the vocabulary
    err = err_of(tok.decode, tok, { 1, tok.n_ids })
    assert.truthy(err:find("ids[1] (from 0) = " .. tok.n_ids .. " is outside 0.." .. (tok.n_ids - 1), 1, true), err)
    err = err_of(tok.decode, tok, { 2 ^ 32 + 104 })   -- not wrapped to a small id on the way to C
    assert.truthy(err:find("tokenizer:decode: ids[1]: 4294967400 does not fit in 32 bits", 1, true), err)
    assert.matches('"<|no_such|>" is not a special token', err_of(tok.special, tok, "<|no_such|>"), 1, true)
    -- too small an output: the count comes back, nothing past cap is written
    local text = "hello world"
    local ids = ffi.new("int32_t[2]", { -7, -7 })
    local n = ffi.new("size_t[1]")
    assert.are.equal(C.KD_ERR_ARG, C.kd_tokenizer_encode(tok:handle(), text, #text, 0, ids, 1, n))
    assert.are.equal(#tok:encode(text), tonumber(n[0]))
    assert.are.equal(-7, ids[1])
    assert.truthy(kd.last_error():find("room for 1", 1, true))
    -- still usable
    assert.are.equal("hello world", tok:decode(tok:encode("hello world")))
  end)

  it("bad files name the file and what is wrong", function()
    local missing = scratch_dir({ ["tiktoken.model"] = function() return nil end })
    open_fails_with(missing, missing .. "/tiktoken.model: cannot open")
    local bad64 = scratch_dir({ ["tiktoken.model"] = function(t) return (t:gsub("\n(%S+) 300\n", "\n!!!! 300\n", 1)) end })
    open_fails_with(bad64, "line 301: the token is not base64")
    local twice = scratch_dir({ ["tiktoken.model"] = function(t) return (t:gsub(" 301\n", " 300\n", 1)) end })
    open_fails_with(twice, "rank 300 is listed twice")
    local no_rank = scratch_dir({ ["tiktoken.model"] = function(t) return (t:gsub(" 5\n", "\n", 1)) end })
    open_fails_with(no_rank, "line 6: expected `base64 rank`")
    local byte_gone = scratch_dir({ ["tiktoken.model"] = function(t)
      local lines = {}
      for line in t:gmatch("[^\n]+") do lines[#lines + 1] = line end
      lines[66] = lines[#lines]:match("^%S+") .. " 65"   -- rank 65 (byte 'A') becomes a copy of the last token
      table.remove(lines)
      return table.concat(lines, "\n") .. "\n"
    end })
    open_fails_with(byte_gone, "tiktoken.model: byte 0x41 has no rank")
    local same_bytes = scratch_dir({ ["tiktoken.model"] = function(t)
      local lines = {}
      for line in t:gmatch("[^\n]+") do lines[#lines + 1] = line end
      lines[66] = lines[67]:match("^%S+") .. " 65"   -- rank 65 takes rank 66's bytes
      return table.concat(lines, "\n") .. "\n"
    end })
    open_fails_with(same_bytes, "rank 66 repeats the bytes of rank 65")
    local out_of_range = scratch_dir({ ["tokenizer_config.json"] = function(t) return (t:gsub('"' .. golden.n_base .. '"',
      '"5"', 1)) end })
    open_fails_with(out_of_range, 'tokenizer_config.json: added_tokens_decoder: id "5" is not one of the special ids')
    -- a special string that is not UTF-8 (matched in text, it would cut a character)
    local cut = scratch_dir({ ["tokenizer_config.json"] = function(t) return (t:gsub("<|im_end|>", "<|im\xc3", 1)) end })
    open_fails_with(cut, 'tokenizer_config.json: added_tokens_decoder["' .. tok:special("<|im_end|>") ..
      '"].content: expected a non-empty UTF-8 string')
    -- empty lines and CRLF line ends are taken, as tiktoken's loader takes them
    local loose = scratch_dir({ ["tiktoken.model"] = function(t) return "\n" .. t:gsub("\n", "\r\n", 10):gsub(" 300\r?\n", "%0\n\n") .. "\n" end })
    local t3 = kd.open_tokenizer(loose)
    assert.are.same(tok:encode(golden.cases[2].text), t3:encode(golden.cases[2].text))
    t3:close()
    -- without tokenizer_config.json every special slot is reserved
    local bare = scratch_dir({ ["tokenizer_config.json"] = function() return nil end })
    local t2 = kd.open_tokenizer(bare)
    assert.are.equal(golden.n_base, t2:special("<|reserved_token_" .. golden.n_base .. "|>"))
    assert.matches('"<|im_end|>" is not a special token', err_of(t2.special, t2, "<|im_end|>"), 1, true)
    t2:close()
  end)

  it("closed handles are errors, not crashes", function()
    local t = kd.open_tokenizer(DIR)
    t:close()
    assert.is_true(t:is_closed())
    assert.matches("kdtree: tokenizer is closed", err_of(t.encode, t, "x"), 1, true)
    assert.matches("open_tokenizer: expected a directory path, got number", err_of(kd.open_tokenizer, 42), 1, true)
  end)
end)
