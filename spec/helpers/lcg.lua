-- spec/helpers/lcg.lua: a deterministic generator (LCG) uniform in [0, 1): the same numbers on
-- every machine and LuaJIT version, for specs whose inputs must not move
return function(seed)
  local x = seed % 2147483648
  return function()
    x = (x * 1103515245 + 12345) % 2147483648
    return x / 2147483648
  end
end
