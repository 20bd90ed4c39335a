-- generate_text_spec: the text generate releases as tokens come (kdtree.generate's G.text):
-- a token may end inside a UTF-8 character and the text's end may be the start of a stop
-- string; neither may be released early, and together the pieces are the whole text, cut
-- before the first stop string. The tokens here are byte pieces of a known string, so the
-- reference is the string itself.
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local gen = require("kdtree.generate")

-- a tokenizer whose ids are byte pieces of a string, cut every k bytes (cuts inside characters)
local function pieces(text, k)
  local t, ids = { bytes = {} }, {}
  for i = 1, #text, k do t.bytes[#t.bytes + 1] = text:sub(i, i + k - 1); ids[#ids + 1] = #t.bytes end
  function t:decode(list) return self.bytes[list[1]] end
  return t, ids
end

local function valid_utf8(s)
  return s:gsub("[\xC0-\xDF][\x80-\xBF]", ""):gsub("[\xE0-\xEF][\x80-\xBF][\x80-\xBF]", "")
    :gsub("[\xF0-\xF7][\x80-\xBF][\x80-\xBF][\x80-\xBF]", ""):find("[\x80-\xFF]") == nil
end

describe("generate's text stream", function()
  local TEXT = "héllo, 世界! 🙂 fin\nnext line"
  it("releases only whole UTF-8 characters, and all of the text by the end", function()
    for k = 1, 5 do
      local tok, ids = pieces(TEXT, k)
      local t = gen.text(tok)
      local got = {}
      for _, id in ipairs(ids) do
        assert.is_false(t:push(id))
        local piece = t:take()
        assert.is_true(valid_utf8(piece), ("k %d: %q"):format(k, piece))
        got[#got + 1] = piece
      end
      got[#got + 1] = t:take(true)
      assert.are.equal(TEXT, table.concat(got))
      assert.are.equal(TEXT, t:all())
    end
  end)

  it("holds back a possible stop string and cuts before the first one that completes", function()
    for k = 1, 5 do
      local tok, ids = pieces(TEXT, k)
      local t = gen.text(tok, { "line", "! 🙂" })
      local got, stopped_at = {}, nil
      for i, id in ipairs(ids) do
        local stop = t:push(id)
        local piece = t:take()
        got[#got + 1] = piece
        if stop then stopped_at = i; break end
      end
      local want = TEXT:sub(1, TEXT:find("! 🙂", 1, true) - 1)
      assert.are.equal(want, table.concat(got), "k " .. k)
      -- the token that completed the stop is the first whose bytes reach its end
      local stop_end = TEXT:find("! 🙂", 1, true) + #"! 🙂" - 1
      assert.are.equal(math.ceil(stop_end / k), stopped_at, "k " .. k)
      assert.is_true(t:push(ids[#ids]))   -- stays stopped
    end
  end)

  it("never releases text that a later stop string takes back", function()
    local tok, ids = pieces("abcabd", 1)
    local t = gen.text(tok, { "abd" })
    local got = {}
    for _, id in ipairs(ids) do
      local stop = t:push(id)
      got[#got + 1] = t:take()
      if stop then break end
    end
    assert.are.same({ "", "", "abc", "", "", "" }, got)   -- "a", "ab" might have become "abd"
    assert.are.equal("abc", table.concat(got))
  end)

  it("names a bad stop list", function()
    local tok = pieces("x", 1)
    assert.has_error(function() gen.text(tok, { "" }) end, "kdtree: generate: stop[1]: expected a non-empty string")
    assert.has_error(function() gen.text(tok, 5) end, "kdtree: generate: stop: expected a list of strings")
  end)

  it("gen.run names bad stop and logprobs options", function()
    local kd = require("kdtree")
    local m = kd.open_model("models/tiny-k2.6")
    local function err_of(opts)
      local ok, e = pcall(gen.run, m, { 5, 77 }, opts)
      assert.is_false(ok)
      return tostring(e):gsub("^[^\n]-:%d+: ", "")
    end
    assert.are.equal("kdtree: generate: stop: stop strings are matched on text: give opts.tokenizer too",
      err_of({ n = 2, stop = { "x" } }))
    assert.are.equal("kdtree: generate: logprobs: expected a non-negative integer (alternatives per token), got 1.5",
      err_of({ n = 2, logprobs = 1.5 }))
    m:close()
  end)
end)
