-- drafter.lua: the DFlash drafter object (kd_drafter), bound to one target model.
local K = require("kdtree.ffi")
local H = require("kdtree.handle")
local U = require("kdtree.util")
local ffi, C, check = K.ffi, K.C, K.check

local Drafter = {}
Drafter.__index = Drafter
Drafter.__tostring = function(d)
  if rawget(d, "_h") == nil then return "kdtree.drafter (closed)" end
  local i = d.info
  return string.format("kdtree.drafter(%s, %d layers, block %d, taps %s)", d.dir, i.n_layers,
    i.block_size, table.concat(i.taps, ","))
end

local function free_drafter(p) C.kd_drafter_close(p) end

function Drafter.open(dir, model)
  if type(dir) ~= "string" then error("kdtree: open_drafter: expected a directory path, got " .. type(dir), 2) end
  if getmetatable(model) ~= require("kdtree.model") then
    error("kdtree: open_drafter: expected a target model (kd.open_model) as 2nd argument", 2)
  end
  local mh = H.get(model, "model")
  local out = ffi.new("kd_drafter*[1]")
  check(C.kd_drafter_open(dir, mh, out), "kd_drafter_open(" .. dir .. ")")
  local st, h = H.own(out[0], "kd_drafter*", free_drafter, "drafter", { model._st })
  local d = setmetatable({ _h = h, _st = st, dir = dir, model = model }, Drafter)
  local ci = ffi.new("kd_drafter_info")
  local ok, err = pcall(function() check(C.kd_drafter_get_info(h, ci), "kd_drafter_get_info") end)
  if not ok then H.close(d); error(err, 0) end
  d.info = U.drafter_info(ci)
  return d
end

function Drafter:handle() return H.get(self, "drafter") end
function Drafter:is_closed() return rawget(self, "_h") == nil end
-- freed at once, or when the last sequence it is attached to is closed
function Drafter:close() H.close(self) end

return Drafter
