-- tokenizer.lua: Kimi K2.6's tokenizer (kd_tokenizer: tiktoken BPE, Kimi's pre-tokenizer).
--
--   local tok = kd.open_tokenizer("models/tiny-k2.6")      -- tiktoken.model + tokenizer_config.json
--   local ids = tok:encode("Hello, world!")                  -- a Lua array of ids
--   print(tok:decode(ids))                                  -- the text again
--   tok:encode("<|im_end|>", { special = true })            -- special strings become their ids
--   tok:special("<|im_end|>")                               -- an id by its string
--   tok:chat({ { role = "user", content = "hi" } })         -- K2.6's chat prompt, as ids
local K = require("kdtree.ffi")
local H = require("kdtree.handle")
local U = require("kdtree.util")
local ffi, C, check = K.ffi, K.C, K.check

local Tokenizer = {}
Tokenizer.__index = Tokenizer
Tokenizer.__tostring = function(t)
  if rawget(t, "_h") == nil then return "kdtree.tokenizer (closed)" end
  return string.format("kdtree.tokenizer(%s, %d base ids + %d special)", t.dir, t.n_base, t.n_ids - t.n_base)
end

local function free_tokenizer(p) C.kd_tokenizer_close(p) end

function Tokenizer.open(dir)
  if type(dir) ~= "string" then error("kdtree: open_tokenizer: expected a directory path, got " .. type(dir), 2) end
  local out = ffi.new("kd_tokenizer*[1]")
  check(C.kd_tokenizer_open(dir, out), "kd_tokenizer_open(" .. dir .. ")")
  local st, h = H.own(out[0], "kd_tokenizer*", free_tokenizer, "tokenizer")
  return setmetatable({ _h = h, _st = st, dir = dir, n_base = C.kd_tokenizer_n_base(h),
                        n_ids = C.kd_tokenizer_n_ids(h) }, Tokenizer)
end

function Tokenizer:handle() return H.get(self, "tokenizer") end
function Tokenizer:is_closed() return rawget(self, "_h") == nil end
function Tokenizer:close() H.close(self) end

-- text -> a Lua array of ids; opts.special: special-token strings become their ids
function Tokenizer:encode(text, opts)
  if type(text) ~= "string" then error("kdtree: tokenizer:encode: expected a string, got " .. type(text), 2) end
  local h = self:handle()
  local cap = #text   -- each id takes at least one byte of the text
  local ids = ffi.new("int32_t[?]", cap + 1)
  local n = ffi.new("size_t[1]")
  check(C.kd_tokenizer_encode(h, text, #text, (opts and opts.special) and 1 or 0, ids, cap, n), "kd_tokenizer_encode")
  return U.list_from(ids, tonumber(n[0]))
end

-- a Lua array of ids -> their bytes as a string (a token may end inside a UTF-8 character)
function Tokenizer:decode(ids)
  local h = self:handle()
  local a, count = U.int32s(ids, nil, "tokenizer:decode: ids")
  local n = ffi.new("size_t[1]")
  check(C.kd_tokenizer_decode(h, a, count, nil, 0, n), "kd_tokenizer_decode")   -- the size only
  local need = tonumber(n[0])
  local buf = ffi.new("char[?]", need + 1)
  check(C.kd_tokenizer_decode(h, a, count, buf, need, n), "kd_tokenizer_decode")
  return ffi.string(buf, need)
end

function Tokenizer:special(name)
  if type(name) ~= "string" then error("kdtree: tokenizer:special: expected a string, got " .. type(name), 2) end
  local id = ffi.new("int32_t[1]")
  check(C.kd_tokenizer_special(self:handle(), name, id), "kd_tokenizer_special")
  return id[0]
end

-- K2.6's chat prompt (kimi_k2.md section 4, the instruct form: no <think> handling): a system
-- turn first (the default one when messages[1] is not a system message), each turn
-- <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>, then the assistant's opening; no BOS.
-- The markers are special ids; a message's content is text (a special string in it stays text).
-- messages: { {role = "system"|"user"|"assistant", content = "..."}, ... }
local DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
function Tokenizer:chat(messages)
  if type(messages) ~= "table" then error("kdtree: tokenizer:chat: expected an array of messages", 2) end
  local ids = {}
  local marker = rawget(self, "_markers")   -- the special ids of the template, looked up once
  if not marker then
    marker = {}
    for _, name in ipairs({ "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>" }) do
      marker[name] = self:special(name)
    end
    self._markers = marker
  end
  local function special(name) ids[#ids + 1] = marker[name] end
  local function text(s) for _, id in ipairs(self:encode(s)) do ids[#ids + 1] = id end end
  local function turn(role, content)
    special("<|im_" .. role .. "|>"); text(role); special("<|im_middle|>"); text(content); special("<|im_end|>")
  end
  if not (messages[1] and messages[1].role == "system") then turn("system", DEFAULT_SYSTEM) end
  for i, msg in ipairs(messages) do
    local role, content = msg.role, msg.content
    if role ~= "system" and role ~= "user" and role ~= "assistant" then
      error(string.format("kdtree: tokenizer:chat: messages[%d].role = %s: expected system, user or assistant", i,
        tostring(role)), 2)
    end
    if type(content) ~= "string" then
      error(string.format("kdtree: tokenizer:chat: messages[%d].content: expected a string", i), 2)
    end
    turn(role, content)
  end
  special("<|im_assistant|>"); text("assistant"); special("<|im_middle|>")
  return ids
end

-- the special ids that end an assistant turn of chat(): <|im_end|> and [EOT] where the
-- vocabulary has them (kimi_k2.md section 4; the model's own eos ids are its config's)
function Tokenizer:chat_stops()
  local stops, id = {}, ffi.new("int32_t[1]")
  for _, name in ipairs({ "<|im_end|>", "[EOT]" }) do
    if C.kd_tokenizer_special(self:handle(), name, id) == C.KD_OK then stops[#stops + 1] = id[0] end
  end
  return stops
end

return Tokenizer
