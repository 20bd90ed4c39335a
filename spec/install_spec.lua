-- install_spec: `make install` into a scratch PREFIX (the library already built: make -o keeps
-- it), then use kdtree as an installed program is used, from another directory with none of
-- the source tree's paths: the CLI finds its modules, library and models; the library has its
-- SONAME and versioned file; pkg-config builds the C example, which runs; install names the
-- LUA_PATH this LuaJIT needs for the PREFIX, and with it `require "kdtree"` and kd.shipped work.
-- Commands run without KDTREE_LIB; the caller's LUA_PATH, LUA_CPATH and LD_LIBRARY_PATH pass
-- through (the system's: where a machine keeps libcjson or dkjson; `make test` puts no
-- source-tree path in them), and the PREFIX's lib is prepended to LD_LIBRARY_PATH.
local function sh(cmd)
  local p = io.popen("env -u KDTREE_LIB sh -c " .. ("%q"):format(cmd) .. " </dev/null 2>&1; echo \"rc=$?\"")
  local out = p:read("*a")
  p:close()
  return tonumber(out:match("rc=(%d+)\n$")), out:gsub("rc=%d+\n$", "")
end

describe("make install", function()
  local prefix, root, install_out
  setup(function()
    prefix = os.tmpname()
    os.remove(prefix)
    root = io.popen("pwd"):read("*l")
    local stamp = io.open("build/config.stamp"):read("*l")
    local rc
    rc, install_out = sh(string.format("make --no-print-directory -o build/libkdtree.so install PREFIX=%s %s",
      prefix, stamp:match("^(CUDA=%d)")))
    assert.are.equal(0, rc, install_out)
  end)
  teardown(function() os.execute("rm -rf " .. prefix) end)

  it("installs a versioned library with its SONAME, the header and kdtree.pc", function()
    local _, v = sh("luajit -e 'package.path=\"lua/?.lua;lua/?/init.lua;\"..package.path; io.write(require(\"kdtree\").version())'")
    assert.truthy(v:match("^%d+%.%d+%.%d+$"), v)
    local rc, out = sh("readlink " .. prefix .. "/lib/libkdtree.so " .. prefix .. "/lib/libkdtree.so.0")
    assert.are.equal(0, rc)
    assert.are.equal("libkdtree.so.0\nlibkdtree.so." .. v .. "\n", out)
    rc, out = sh("readelf -d " .. prefix .. "/lib/libkdtree.so." .. v .. " | grep SONAME")
    assert.truthy(out:find("[libkdtree.so.0]", 1, true), out)
    local pc = "PKG_CONFIG_PATH=" .. prefix .. "/lib/pkgconfig pkg-config "
    rc, out = sh(pc .. "--modversion kdtree && " .. pc .. "--cflags --libs kdtree")
    assert.are.equal(0, rc, out)
    assert.are.equal(v .. "\n-I" .. prefix .. "/include -L" .. prefix .. "/lib -lkdtree", (out:gsub("%s+$", "")))
    assert.are.equal(io.open("core/kdtree.h"):read("*a"), io.open(prefix .. "/include/kdtree.h"):read("*a"))
  end)

  it("builds the C example with pkg-config, and it runs against the installed library", function()
    local exe = prefix .. "/ddtree"
    local rc, out = sh(string.format("cd / && cc -std=c11 %s/scripts/examples/ddtree.c $(PKG_CONFIG_PATH=%s/lib/pkgconfig "
      .. "pkg-config --cflags --libs kdtree) -o %s && LD_LIBRARY_PATH=%s/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} %s %s/share/kdtree/models/tiny-k2.6 "
      .. "%s/share/kdtree/models/tiny-k2.6-dflash", root, prefix, exe, prefix, exe, prefix, prefix))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("equals greedy autoregressive decoding: yes", 1, true), out)
    rc, out = sh("readelf -d " .. exe .. " | grep NEEDED")
    assert.truthy(out:find("[libkdtree.so.0]", 1, true), out)
  end)

  it("the installed CLI runs from anywhere with its installed models", function()
    local rc, out = sh("cd / && " .. prefix .. "/bin/kdtree generate --prompt-ids 5,77,300 -n 8 --ids")
    assert.are.equal(0, rc, out)
    local _, want = sh("luajit scripts/kdtree generate --prompt-ids 5,77,300 -n 8 --ids")
    assert.are.equal(want, out)
    rc, out = sh("cd / && " .. prefix .. "/bin/kdtree --version")
    assert.are.equal(0, rc, out)
    assert.truthy(out:match("^kdtree [%d.]+ %(backends: cpu"), out)
  end)

  it("tells the LUA_PATH for a PREFIX LuaJIT does not search, and require works with it", function()
    local lua_path = install_out:match("export LUA_PATH=\"([^\"]+)\"")
    assert.is_string(lua_path, install_out)
    assert.truthy(lua_path:find(prefix .. "/share/lua/5.1/?.lua", 1, true))
    local rc, out = sh(string.format("cd / && LUA_PATH='%s' luajit -e 'local kd = require(\"kdtree\"); "
      .. "local m = kd.open_model(kd.shipped(\"tiny-k2.6\")); io.write(m.dir, \" \", m.info.vocab)'", lua_path))
    assert.are.equal(0, rc, out)
    assert.are.equal(prefix .. "/share/kdtree/models/tiny-k2.6 1024", out)
  end)
end)

-- the build's configuration stamp, on one object in a scratch build directory: the same
-- configuration leaves it alone, a changed one (CFLAGS, CUDA, CUDA_ARCHS) rebuilds it
describe("make's configuration stamp", function()
  it("rebuilds an object when the configuration changes, and only then", function()
    local dir = os.tmpname()
    os.remove(dir)
    local obj = dir .. "/core/error.o"
    local function build(flags)
      local rc, out = sh(string.format("make --no-print-directory BUILD=%s CUDA=0 %s %s", dir, flags, obj))
      assert.are.equal(0, rc, out)
      return out
    end
    local function compiled(out) return out:find("-c -o " .. obj, 1, true) ~= nil end
    local out = build("")
    assert.truthy(out:find("kdtree: backends cpu only", 1, true), out)
    assert.is_true(compiled(out), out)
    assert.is_false(compiled(build("")))
    out = build("CFLAGS='-O1 -g'")
    assert.truthy(out:find("the configuration changed: rebuilding every object", 1, true), out)
    assert.is_true(compiled(out), out)
    assert.is_false(compiled(build("CFLAGS='-O1 -g'")))
    assert.is_false(compiled(build("CFLAGS='-O1 -g' CUDA_ARCHS=90")))   -- architectures matter with CUDA=1 only
    os.execute("rm -rf " .. dir)
  end)
end)
