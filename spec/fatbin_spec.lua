-- The library's CUDA code is a fat binary for both GPUs users run: sm_90 (H100/H200) and
-- sm_120 (RTX PRO 6000 Blackwell) machine code, plus compute_120 PTX for later GPUs, for every
-- CUDA translation unit. Read from the ELF section .nv_fatbin of the library under test (no GPU
-- needed, so CI checks it); a library built with CUDA=0 has no such section and is skipped.
package.path = "spec/?.lua;" .. package.path
local ffi = require("ffi")
local ck = require("helpers.checkpoint")

local lib_path = os.getenv("KDTREE_LIB") or "build/libkdtree.so"

local function u16(s, off) return ffi.cast("const uint16_t *", ffi.cast("const char *", s) + off)[0] end
local function u32(s, off) return ffi.cast("const uint32_t *", ffi.cast("const char *", s) + off)[0] end
local function u64(s, off) return tonumber(ffi.cast("const uint64_t *", ffi.cast("const char *", s) + off)[0]) end

-- the bytes of one ELF64 section by name, or nil
local function elf_section(elf, want)
  assert(elf:sub(1, 4) == "\127ELF" and elf:byte(5) == 2, lib_path .. ": not an ELF64 file")
  local shoff, shentsize, shnum, shstrndx = u64(elf, 0x28), u16(elf, 0x3A), u16(elf, 0x3C), u16(elf, 0x3E)
  local function header(i) return shoff + i * shentsize end
  local strtab = u64(elf, header(shstrndx) + 24)
  for i = 0, shnum - 1 do
    local h = header(i)
    local name_at = strtab + u32(elf, h)
    local name = elf:sub(name_at + 1, elf:find("\0", name_at + 1, true) - 1)
    if name == want then
      local off, size = u64(elf, h + 24), u64(elf, h + 32)
      return elf:sub(off + 1, off + size)
    end
  end
  return nil
end

-- the entries of every fat binary in the section: {kind = "elf"|"ptx", arch = 90|120|...}
-- Layout (cuda fatbin.h): a 16-byte header (magic 0xBA55ED50, version, header size, fat size),
-- then entries, each with kind (u16: 1 PTX, 2 ELF), header size (u32 at +4), payload size
-- (u64 at +8) and the SM version (u32 at +28).
local function fatbin_entries(sec)
  local out, pos = {}, 0
  while pos + 16 <= #sec do
    if u32(sec, pos) ~= 0xBA55ED50 then
      pos = pos + 8                         -- alignment padding between fat binaries
    else
      local header_size, fat_size = u16(sec, pos + 6), u64(sec, pos + 8)
      local p, stop = pos + header_size, pos + header_size + fat_size
      while p < stop do
        local kind, entry_header, payload = u16(sec, p), u32(sec, p + 4), u64(sec, p + 8)
        out[#out + 1] = { kind = kind == 2 and "elf" or kind == 1 and "ptx" or tostring(kind), arch = u32(sec, p + 28) }
        p = p + entry_header + payload
      end
      pos = stop
    end
  end
  return out
end

describe("fat binary", function()
  it("holds sm_90 and sm_120 machine code and compute_120 PTX for every CUDA source", function()
    local sec = elf_section(ck.read(lib_path), ".nv_fatbin")
    if not sec then
      pending(lib_path .. " was built without CUDA (no .nv_fatbin section)")
      return
    end
    local units = 0
    for _ in io.popen("ls cuda/*.cu"):lines() do units = units + 1 end
    assert.is_true(units > 0, "no cuda/*.cu sources found from " .. (os.getenv("PWD") or "."))
    local count = {}
    for _, e in ipairs(fatbin_entries(sec)) do
      local key = e.kind .. "_" .. e.arch
      count[key] = (count[key] or 0) + 1
    end
    assert.are.equal(units, count.elf_90, "sm_90 cubins")
    assert.are.equal(units, count.elf_120, "sm_120 cubins")
    assert.are.equal(units, count.ptx_120, "compute_120 PTX")
  end)
end)
