-- progress: the one-line weight-load bar the CLI and the REPL draw on a terminal's stderr.
-- kd_model_options.progress calls back on the opening thread (about every 1% of rank 0's part,
-- once per rank at the end); the bar redraws itself with \r at most every `interval` seconds and
-- ends with its final state and a newline (or clears itself when the load failed).
local ffi = require("ffi")
local M = {}

pcall(ffi.cdef, [[
int isatty(int fd);
struct kd_progress_timespec { long tv_sec; long tv_nsec; };
int clock_gettime(int clk, struct kd_progress_timespec *ts);
]])

local ts = ffi.new("struct kd_progress_timespec")
function M.monotonic()   -- seconds, CLOCK_MONOTONIC (1 on Linux)
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- 1536 -> "1.5 KiB"
function M.human(b)
  local units, i = { "B", "KiB", "MiB", "GiB", "TiB" }, 1
  while b >= 1024 and i < #units do b = b / 1024; i = i + 1 end
  return i == 1 and string.format("%d B", b) or string.format("%.1f %s", b, units[i])
end

-- bytes per second -> "850 MB/s" / "1.23 GB/s" (decimal units, as disks and links are quoted)
function M.rate(bps)
  if bps >= 1e9 then return string.format("%.2f GB/s", bps / 1e9) end
  return string.format("%.0f MB/s", bps / 1e6)
end

-- a bar for `tp` ranks: opts.write(s) takes the text, opts.clock() gives seconds,
-- opts.interval (default 0.1 s) is the least time between two redraws
function M.new(opts)
  local B = { tp = opts.tp or 1, done = {}, total = {}, write = opts.write, clock = opts.clock,
              interval = opts.interval or 0.1, drawn = false }
  B.start = B.clock()
  B.last = -math.huge

  -- the bar's text now: rank 0's bytes (the only rank reporting along the way), its share and
  -- the rate; with tp > 1 the finished ranks and, once all are, the sum of their parts
  function B.line()
    local elapsed = math.max(B.clock() - B.start, 1e-9)
    local finished, sum = 0, 0
    for r = 0, B.tp - 1 do
      if B.total[r] and B.done[r] == B.total[r] then finished = finished + 1; sum = sum + B.total[r] end
    end
    local done, total
    if finished == B.tp then done, total = sum, sum else done, total = B.done[0] or 0, B.total[0] or 0 end
    local pct = total > 0 and 100 * done / total or 0
    local s = string.format("loading weights: %s / %s %3d%% %s", M.human(done), M.human(total), math.floor(pct),
      M.rate(done / elapsed))
    if B.tp > 1 then s = s .. string.format(", ranks %d/%d done", finished, B.tp) end
    return s
  end

  local function draw()
    B.write("\r\27[K" .. B.line())
    B.drawn, B.last = true, B.clock()
  end

  -- the kd_model_options.progress callback
  function B.update(rank, done, total)
    B.done[rank], B.total[rank] = done, total
    if B.clock() - B.last >= B.interval then draw() end
  end

  -- the load ended: its final state and a newline, or (ok false) the line cleared
  function B.finish(ok)
    if ok then draw(); B.write("\n")
    elseif B.drawn then B.write("\r\27[K") end
  end
  return B
end

-- kd.open_model(dir, opts) with a bar on stderr when stderr is a terminal (opts.progress is the
-- bar's; nothing is drawn otherwise); the bar ends before an error goes on
function M.open_model(kd, dir, opts)
  if ffi.C.isatty(2) ~= 1 then return kd.open_model(dir, opts) end
  local o = {}
  for k, v in pairs(opts or {}) do o[k] = v end
  local bar = M.new({ tp = o.tp or (o.devices and #o.devices) or 1, clock = M.monotonic,
                      write = function(s) io.stderr:write(s); io.stderr:flush() end })
  o.progress = bar.update
  local ok, m = pcall(kd.open_model, dir, o)
  bar.finish(ok)
  if not ok then error(m, 0) end
  return m
end

return M
