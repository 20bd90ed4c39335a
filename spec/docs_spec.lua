-- docs_spec: the documentation's examples run as written. README's and the docs' Lua blocks
-- run as scripts in a separate LuaJIT from the repository root with no KDTREE_LIB set (as a
-- reader copies them; the caller's LUA_PATH/LUA_CPATH pass through: they are the system's, e.g.
-- where a machine keeps dkjson, and `make test` puts no source-tree path in them); their `scripts/kdtree` and `luajit` shell lines run and exit
-- 0; C blocks are verbatim excerpts of scripts/examples/ddtree.c (which `make test` compiles
-- and runs) or of core/kdtree.h; the tutorial's Lua blocks are excerpts of the example it
-- builds; no document points outside the repository.
local function slurp(f) local h = assert(io.open(f, "rb")); local s = h:read("*a"); h:close(); return s end

local DOCS = { "README.md", "docs/lua-api.md", "docs/c-api.md", "docs/tutorial-decode-script.md",
  "docs/architecture.md", "docs/ddtree.md", "docs/dflash.md", "docs/formats.md" }

local function blocks(text, lang)
  local out = {}
  for code in text:gmatch("\n```" .. lang .. "\n(.-)```") do out[#out + 1] = code end
  return out
end

-- run a shell command from the repository root without the spec's KDTREE_LIB (the system's
-- LUA_PATH, LUA_CPATH and LD_LIBRARY_PATH stay, as a reader has them); (code, output)
local function sh(cmd)
  local p = io.popen("env -u KDTREE_LIB sh -c " .. ("%q"):format(cmd) .. " </dev/null 2>&1; echo \"rc=$?\"")
  local out = p:read("*a")
  p:close()
  return tonumber(out:match("rc=(%d+)\n$")), out
end

local function run_lua(code)
  local f = os.tmpname() .. ".lua"
  local h = io.open(f, "w"); h:write(code); h:close()
  local rc, out = sh("luajit " .. f)
  os.remove(f)
  return rc, out
end

-- a block's lines, stripped of trailing blanks, appear in this order and together in text
local function excerpt_of(block, text)
  local norm = function(s) return (s:gsub("[ \t]+\n", "\n")) end
  return norm(text):find(norm(block), 1, true) ~= nil
end

describe("documentation examples", function()
  it("README's Lua in ten lines works when copied: ten lines, a tree of 16 nodes, a round", function()
    local code = slurp("README.md"):match("## Lua in ten lines.-```lua\n(.-)```")
    assert.is_string(code)
    assert.are.equal(10, select(2, code:gsub("\n", "")))
    local rc, out = run_lua(code)
    assert.are.equal(0, rc, out)
    assert.truthy(out:match("^tree: 16 nodes, root token %d+"), out)
    assert.truthy(out:match("\naccepted\t[%d ]+\ttau\t%d+\tnext\t%d+\n"), out)
  end)

  it("lua-api.md's blocks run in order as one script", function()
    local rc, out = run_lua(table.concat(blocks(slurp("docs/lua-api.md"), "lua"), "\n"))
    assert.are.equal(0, rc, out)
  end)

  it("the shell lines of README and the tutorial run and exit 0 (make lines are CI's own)", function()
    local n = 0
    for _, doc in ipairs({ "README.md", "docs/tutorial-decode-script.md" }) do
      for _, block in ipairs(blocks(slurp(doc), "sh")) do
        for line in block:gmatch("[^\n]+") do
          local cmd = line:gsub("%s+#[^'\"]*$", "")   -- the trailing comment
          if cmd:match("scripts/kdtree") or cmd:match("^luajit ") then
            n = n + 1
            local rc, out = sh(cmd)
            assert.are.equal(0, rc, doc .. ": " .. cmd .. "\n" .. out)
          end
        end
      end
    end
    assert.is_true(n >= 9, n)
  end)

  it("c-api.md's C blocks are excerpts of the example make test runs, or of kdtree.h", function()
    local example, header = slurp("scripts/examples/ddtree.c"), slurp("core/kdtree.h")
    local cs = blocks(slurp("docs/c-api.md"), "c")
    assert.is_true(#cs >= 3)
    for _, b in ipairs(cs) do assert.is_true(excerpt_of(b, example) or excerpt_of(b, header), b) end
    assert.truthy(slurp("Makefile"):find("$(EXAMPLE) $(RUN_MODEL) $(RUN_DRAFT)", 1, true))
  end)

  it("the tutorial's Lua blocks are excerpts of the example it builds", function()
    local example = slurp("scripts/examples/adaptive_budget.lua")
    for _, b in ipairs(blocks(slurp("docs/tutorial-decode-script.md"), "lua")) do
      assert.is_true(excerpt_of(b, example), b)
    end
  end)

  it("no document points outside the repository, and relative links resolve", function()
    for _, doc in ipairs(DOCS) do
      local text = slurp(doc)
      assert.falsy(text:find("shared/reference", 1, true), doc)
      assert.falsy(text:find("/work/", 1, true), doc)
      for target in text:gmatch("%]%(([^)#]+)[^)]*%)") do
        if not target:match("^https?:") then
          local base = doc:match("^(.*)/") or "."
          local f = io.open(base .. "/" .. target)
          assert.is_not_nil(f, doc .. " links to " .. target)
          f:close()
        end
      end
    end
  end)
end)

describe("lua-api.md", function()
  -- every call it names exists: kd.f(...), m:f, s:f, t:f, d:f, tok:f, gen.f (names in code and prose)
  it("names only functions and options that exist", function()
    package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
    local kd = require("kdtree")
    local owners = { kd = kd, m = kd.Model, s = kd.Seq, t = kd.tree.Tree, d = kd.Drafter, tok = kd.Tokenizer,
      gen = require("kdtree.generate"), ["kd.tree"] = kd.tree }
    local text = slurp("docs/lua-api.md")
    local n = 0
    for owner, name in text:gmatch("%f[%w_%.]([%a][%w_%.]*)[%.:]([%a_][%w_]*)%(") do
      local o = owners[owner]
      if o then
        n = n + 1
        assert.are.equal("function", type(o[name]), owner .. "." .. name)
      end
    end
    assert.is_true(n > 60, n)
    -- options the model does not take are not offered
    assert.falsy(text:find("n_devices", 1, true))
    assert.falsy(text:find("opts%.device[^s]"))   -- (opts.devices is tp's)
  end)
end)
