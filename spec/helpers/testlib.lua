-- spec/helpers/testlib.lua: the test surface (spec/c/*.h: the op harness, fault injection, graph
-- emulation) through the LuaJIT FFI. It is built into build/libkdtree_test.so only (the engine's
-- objects plus spec/c/*.c), never into the shipped libkdtree.so: `make test` points KDTREE_LIB there.
local K = require("kdtree.ffi")

local M = { C = K.C }
local dir = debug.getinfo(1, "S").source:match("^@(.*)/helpers/testlib%.lua$") or "spec"

-- declare spec/c/NAME once per process
local declared = {}
function M.cdef(name)
  if not declared[name] then
    K.cdef_file(dir .. "/c/" .. name)
    declared[name] = true
  end
  return M
end

M.cdef("kdtree_testing.h")
if not pcall(function() return K.C.kd_test_backend_new end) then
  error("kdtree specs: the library has no test surface (kd_test_backend_new): run them against " ..
    "build/libkdtree_test.so (KDTREE_LIB), as `make test` does", 0)
end
return M
