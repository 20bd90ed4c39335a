-- exports_spec.lua: the shipped library's surface. build/libkdtree.so is compiled with hidden
-- visibility and linked with a version script made from core/kdtree.h (Makefile); here its
-- dynamic symbol table (nm -D --defined-only) must equal the set of functions core/kdtree.h
-- declares -- no more, no less -- as this spec parses the header itself. The test surface
-- (kd_test_*, kd_testing_*) lives in build/libkdtree_test.so only, and nothing `make install`
-- puts on disk names it.
package.path = "spec/?.lua;" .. package.path
local sh = require("helpers.shell")

local BUILD = (os.getenv("KDTREE_LIB") or "build/libkdtree.so"):match("^(.*)/[^/]+$") or "build"
local SHIPPED, TESTLIB = BUILD .. "/libkdtree.so", BUILD .. "/libkdtree_test.so"

-- the functions a C header declares: comments, preprocessor lines and every {...} body (struct,
-- enum, the extern "C" block's braces) removed, then each ';'-ended declaration with a '(' that is
-- not a typedef names its function by the identifier before the '('
local function header_functions(path)
  local text = assert(io.open(path)):read("*a")
  text = text:gsub("/%*.-%*/", " "):gsub("\n%s*#[^\n]*", "\n"):gsub('extern "C" {', ""):gsub("\n}%s*\n", "\n")
  repeat local n; text, n = text:gsub("%b{}", " ") until n == 0
  local set = {}
  for decl in text:gmatch("([^;]*);") do
    decl = decl:gsub("^%s+", "")
    if decl:find("(", 1, true) and not decl:match("^typedef") then
      local name = decl:match("([%a_][%w_]*)%s*%(")
      set[assert(name, "no name in: " .. decl)] = true
    end
  end
  return set
end

-- the defined dynamic symbols of a shared library: name -> nm type letter
local function exports(lib)
  local rc, out = sh("nm -D --defined-only '" .. lib .. "'")
  assert(rc == 0, "nm -D " .. lib .. " failed: " .. out)
  local set = {}
  for typ, name in out:gmatch("%x+ (%a) ([^\n]+)") do set[name] = typ end
  return set
end

local function sorted_keys(t)
  local r = {}
  for k in pairs(t) do r[#r + 1] = k end
  table.sort(r)
  return r
end

describe("the shipped library's dynamic symbols", function()
  local declared = header_functions("core/kdtree.h")

  it("parses a sane number of functions from core/kdtree.h", function()
    local n = #sorted_keys(declared)
    assert.is_true(n >= 40, "only " .. n .. " functions parsed")
    for _, f in ipairs({ "kd_model_open", "kd_seq_new_opts", "kd_forward", "kd_accept", "kd_tokenizer_decode",
                         "kd_model_memory", "kd_last_error" }) do
      assert.is_true(declared[f], f .. " not found in the header")
    end
  end)

  it("build/libkdtree.so exports exactly the functions of core/kdtree.h, as code", function()
    local got = exports(SHIPPED)
    local extra, missing = {}, {}
    for _, name in ipairs(sorted_keys(got)) do if not declared[name] then extra[#extra + 1] = name end end
    for _, name in ipairs(sorted_keys(declared)) do if not got[name] then missing[#missing + 1] = name end end
    assert.are.same({}, extra, "exported but not declared in kdtree.h: " .. table.concat(extra, " "))
    assert.are.same({}, missing, "declared in kdtree.h but not exported: " .. table.concat(missing, " "))
    for name, typ in pairs(got) do assert.are.equal("T", typ, name .. " is not a function in the text section") end
  end)

  it("build/libkdtree_test.so adds only the test surface (kd_test_*, kd_testing_*)", function()
    local shipped, test = exports(SHIPPED), exports(TESTLIB)
    local n_test = 0
    for name in pairs(shipped) do assert.is_truthy(test[name], name .. " missing from the test library") end
    for name in pairs(test) do
      if not shipped[name] then
        assert.is_truthy(name:match("^kd_test_") or name:match("^kd_testing_"), "unexpected export " .. name)
        n_test = n_test + 1
      end
    end
    assert.is_true(n_test > 20, "the test library exports only " .. n_test .. " test functions")
  end)

  it("nothing `make install` puts on disk names the test surface", function()
    local dest = os.tmpname()
    os.remove(dest)
    -- in the configuration of the build under test, so that make finds it up to date
    local rc, out = sh(string.format("make -s --no-print-directory install DESTDIR='%s' PREFIX=/usr BUILD='%s' %s",
      dest, BUILD, require("helpers.build_config")(BUILD)))
    assert.are.equal(0, rc, "make install failed: " .. out)
    local rc2, files = sh(string.format("find '%s' -type f | wc -l", dest))
    assert.are.equal(0, rc2)
    assert.is_true(tonumber(files) > 10, "make install put only " .. files .. " files")
    -- (the library's own internals, kd_cpu_* and the rest, are in its debug symbols, hidden)
    local rc3, hits = sh(string.format("grep -rlaE 'kd_test_|kd_testing_' '%s'", dest))
    sh("rm -rf '" .. dest .. "'")
    assert.are.equal(1, rc3, "files naming the test surface: " .. hits)
  end)
end)
