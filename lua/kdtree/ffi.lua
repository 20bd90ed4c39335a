-- ffi.lua: loads libkdtree through the LuaJIT FFI.
-- The declarations come from core/kdtree.h itself (FFI-clean by design: we drop
-- the preprocessor lines), so the binding can never drift from the C API.
local ffi = require("ffi")

local here = debug.getinfo(1, "S").source:match("^@(.*)/kdtree/ffi%.lua$") or "."

local function first_existing(paths)
  for _, p in ipairs(paths) do
    local f = io.open(p, "r")
    if f then f:close(); return p end
  end
end

local header = first_existing({
  os.getenv("KDTREE_HEADER") or "",
  here .. "/../core/kdtree.h",                 -- source tree: lua/ beside core/
  here .. "/../../../include/kdtree.h",        -- installed: PREFIX/share/lua/5.1 -> PREFIX/include
  "/usr/local/include/kdtree.h", "/usr/include/kdtree.h",
})
if not header then error("kdtree: cannot find kdtree.h (set KDTREE_HEADER)") end

-- cdef_file(path): declare an FFI-clean header: drop the preprocessor lines and the C++ guard
-- (the specs declare their test surface, spec/c/*.h, with it too)
local function cdef_file(path)
  local f = assert(io.open(path), "kdtree: cannot open " .. path)
  local text = f:read("*a")
  f:close()
  local decls = {}
  for line in text:gmatch("[^\n]*") do
    if not line:match("^%s*#") and not line:match('^%s*extern "C"') then decls[#decls + 1] = line end
  end
  ffi.cdef((table.concat(decls, "\n"):gsub('\n}%s*$', "\n")))   -- the guard's closing brace
end
cdef_file(header)

local lib_path = first_existing({
  os.getenv("KDTREE_LIB") or "",
  here .. "/../build/libkdtree.so",
  here .. "/../../../lib/libkdtree.so",
})
local ok, C = pcall(ffi.load, lib_path or "kdtree")
if not ok then
  error(string.format("kdtree: cannot load the engine library (%s): %s\n" ..
    "build it with `make` or point KDTREE_LIB at libkdtree.so", lib_path or "libkdtree.so on the loader path",
    tostring(C)), 0)
end

-- check(st, what): turn a failing kd_status into a Lua error carrying kd_last_error()
local function check(st, what)
  if st ~= 0 then
    local msg = ffi.string(C.kd_last_error())
    error(string.format("kdtree: %s failed (%s): %s", what, ffi.string(C.kd_status_name(st)), msg), 3)
  end
end

return { C = C, ffi = ffi, check = check, header = header, cdef_file = cdef_file }
