-- handle.lua: ownership of native handles.
--
-- Every native object (model, drafter, seq, tree) is owned by a small state table:
--   st = { ptr = <plain pointer cdata>, free = fn, kind = "seq", closed = bool, refs = n, parents = {...} }
-- The Lua object holds a second cdata of the same pointer with an ffi.gc finalizer (the
-- safety net). Both :close() and the finalizer only *mark* the state closed; the native
-- free happens once nothing depends on it any more (refs == 0). A sequence counts as a
-- reference on its model and on its attached drafter, so neither explicit closes in any
-- order nor GC finalizers running in any order can free a model under a live sequence.
local ffi = require("ffi")

local H = {}

local function try_free(st)
  if st.closed and st.refs == 0 and not st.freed then
    st.freed = true
    st.free(st.ptr)
    for _, p in ipairs(st.parents) do
      p.refs = p.refs - 1
      try_free(p)
    end
    st.parents = {}
  end
end
H.try_free = try_free

-- H.own(ptr, ctype, free, kind, parents): returns (state, gc-anchored handle)
function H.own(ptr, ctype, free, kind, parents)
  -- ffi.new, not ffi.cast: a cast to the same type returns the very same cdata object, and
  -- st.ptr must not be the anchor (st is reachable from the anchor's finalizer, and a
  -- finalizer that reaches its own cdata keeps it alive forever)
  local st = { ptr = ffi.new(ctype, ptr), free = free, kind = kind, closed = false,
               freed = false, refs = 0, parents = {} }
  for _, p in ipairs(parents or {}) do H.depend(st, p) end
  -- the finalizer closes over st only (st.ptr is a plain pointer without a finalizer),
  -- so the anchor itself stays collectable
  local anchor = ffi.gc(ffi.new(ctype, ptr), function()
    st.closed = true
    try_free(st)
  end)
  return st, anchor
end

-- st now depends on parent: parent's native object outlives st's
function H.depend(st, parent)
  parent.refs = parent.refs + 1
  st.parents[#st.parents + 1] = parent
end

-- explicit close from Lua: drop the finalizer, mark closed, free when possible
function H.close(obj)
  local h = rawget(obj, "_h")
  if h == nil then return end
  ffi.gc(h, nil)
  rawset(obj, "_h", nil)
  obj._st.closed = true
  try_free(obj._st)
end

-- the live handle or a Lua error naming the kind ("kdtree: seq is closed")
function H.get(obj, kind)
  local h = rawget(obj, "_h")
  if h == nil then error("kdtree: " .. kind .. " is closed", 3) end
  return h
end

return H
