-- kdtree: the Lua API of the kdtree engine (require "kdtree").
--
--   local kd = require("kdtree")
--   local m = kd.open_model("models/tiny-k2.6")          -- {backend = "cpu" | "cuda"}
--   local s = m:new_seq(256)
--   s:forward({5, 77, 300})
--   print(s:argmax()[3])
--
-- Every failing C call becomes a Lua error carrying kd_last_error(); handles are freed by
-- :close() and, as a safety net, by the garbage collector; a closed handle raises
-- "kdtree: <kind> is closed". docs/lua-api.md documents every function.
local K = require("kdtree.ffi")
local U = require("kdtree.util")
local ffi, C, check = K.ffi, K.C, K.check

local kd = {}
kd.ffi = ffi          -- the LuaJIT ffi module
kd.C = C              -- the raw library (kd_* functions of core/kdtree.h)
kd.check = check      -- check(status, what): Lua error on a failing kd_status

kd.Model = require("kdtree.model")
kd.Seq = require("kdtree.seq")
kd.Drafter = require("kdtree.drafter")
kd.tree = require("kdtree.tree")
kd.Tokenizer = require("kdtree.tokenizer")

function kd.version() return ffi.string(C.kd_version()) end
function kd.time_ns() return C.kd_time_ns() end          -- uint64 cdata; tonumber() for arithmetic
function kd.now_ns() return tonumber(C.kd_time_ns()) end -- Lua number (exact for ~104 days)
function kd.last_error() return ffi.string(C.kd_last_error()) end
function kd.backend_available(name)
  local b = U.BACKENDS[name]
  if b == nil then error(string.format("kdtree: backend_available: expected \"cpu\" or \"cuda\", got %q", tostring(name)), 2) end
  return C.kd_backend_available(b) ~= 0
end

-- config.json + safetensors headers only: nothing is loaded. Returns a plain table
-- (report fields, with info as a nested table).
function kd.inspect(dir)
  if type(dir) ~= "string" then error("kdtree: inspect: expected a directory path, got " .. type(dir), 2) end
  local r = ffi.new("kd_inspect_report")
  check(C.kd_inspect(dir, r), "kd_inspect(" .. dir .. ")")
  return U.inspect_report(r)
end

-- one rank's device memory for tp ranks (kd_plan): opts = {tp = 1, device_bytes = 0 (not checked),
-- capacity = 32768}. A plain table of the report's fields; fits is true, false or nil (not checked).
function kd.plan(dir, opts)
  if type(dir) ~= "string" then error("kdtree: plan: expected a directory path, got " .. type(dir), 2) end
  opts = opts or {}
  local r = ffi.new("kd_plan_report")
  check(C.kd_plan(dir, opts.tp or 1, opts.device_bytes or 0, opts.capacity or 32768, r), "kd_plan(" .. dir .. ")")
  return U.plan_report(r)
end

function kd.open_model(dir, opts) return kd.Model.open(dir, opts) end
kd.shipped = U.shipped
function kd.open_drafter(dir, model) return kd.Drafter.open(dir, model) end
function kd.open_tokenizer(dir) return kd.Tokenizer.open(dir) end

-- a sampler table -> kd_sampler cdata (for raw C calls)
kd.sampler = U.sampler

-- Lua-side helpers policies use
kd.policy = setmetatable({}, { __index = function(t, name)
  local p = require("kdtree.policy." .. name); rawset(t, name, p); return p
end })

return kd
