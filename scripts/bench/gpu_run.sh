#!/usr/bin/env bash
# gpu_run.sh: one pass on the GPU machine: build, the whole suite on CUDA (make test-gpu),
# compute-sanitizer memcheck + racecheck on the CUDA driver and on the W4A16 checks at small
# shapes (w4a16_bench --small), and make bench. Logs go to $OUT
# (the device tool's folder) or ./gpu-logs; summary.log has one line per step, and in $OUT the
# rest goes into logs.tar beside it, a step at a time, so that a call cut at the device tool's time
# limit still brings back every finished step (the tool returns at most 8 files).
# Usage (repo root, after `source .device/env.sh`): scripts/bench/gpu_run.sh [steps]
# steps: any of build test sanitize bench spec-memcheck (default: all but spec-memcheck, in that
# order; spec-memcheck = the spec files under compute-sanitizer memcheck, one process each)
set -u
PACK=${GPU_RUN_PACK:-${OUT:+1}}   # pack by default only into the device tool's $OUT (GPU_RUN_PACK=0: leave the logs as they are)
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
steps=${*:-"build test sanitize bench"}
BUSTED_BIN=$(type -P busted || echo /usr/bin/busted)   # the script on PATH (as the Makefile finds it), run by luajit
has() { case " $steps " in *" $1 "*) return 0 ;; esac; return 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv; nvcc --version | tail -1; } \
  > "$OUT/summary.log" 2>&1

pack() {   # pack [FILE...]: move FILEs (default: every finished log and table) of $OUT into $OUT/logs.tar
  [ "$PACK" = 1 ] || return 0   # when packing; under a lock, as the memcheck jobs pack in parallel
  (cd "$OUT" && { [ $# -gt 0 ] || set -- $(ls | grep -vx -e summary.log -e logs.tar); } &&
    { [ $# = 0 ] || flock .pack.lock sh -c 'tar rf logs.tar -- "$@" && rm -f -- "$@"' pack "$@"; })
}
step() {   # step NAME SECONDS CMD...: output to $OUT/NAME.log, one line in the summary
  local name=$1 secs=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($(( $(date +%s) - t0 )) s) $(grep -aE '[0-9]+ success' "$OUT/$name.log" | tail -1)" >> "$OUT/summary.log"
}
START=$(date +%s)
has build && step build 300 make -j16 all   # the fat binary (sm_90 + sm_120 + PTX), as users get it
pack
if has test; then step test-gpu 420 make test-gpu; fi   # ~300 s on the H200 (2026-12-04: 235 s was too short)
pack
if has sanitize; then
  cc -O1 -g -std=c11 -D_GNU_SOURCE -Icore -Ispec/c scripts/bench/cuda_sanitize.c -Lbuild -lkdtree_test \
    -Wl,-rpath,$PWD/build -lm \
    -o build/cuda_sanitize > "$OUT/sanitize-build.log" 2>&1
  step memcheck 90 compute-sanitizer --tool memcheck --leak-check full --print-limit 20 build/cuda_sanitize
  step racecheck 90 compute-sanitizer --tool racecheck --print-limit 20 build/cuda_sanitize
  # every W4A16 configuration and the MoE grouped form (split K included) at small shapes
  make build/bench/w4a16_bench > "$OUT/w4a16-bench-build.log" 2>&1
  step memcheck-w4a16 120 compute-sanitizer --tool memcheck --print-limit 20 build/bench/w4a16_bench --small
  step racecheck-w4a16 180 compute-sanitizer --tool racecheck --print-limit 20 build/bench/w4a16_bench --small
  for t in memcheck-w4a16 racecheck-w4a16; do
    grep -aE "ERROR SUMMARY|RACECHECK SUMMARY|check failures" "$OUT/$t.log" | sed "s|^|  $t: |" >> "$OUT/summary.log"
  done
  pack
fi
if has bench; then
  step bench 240 make bench
  cp build/bench/*.md "$OUT/" 2>/dev/null
  pack
fi
# one spec file per sanitizer process (SPEC_MEMCHECK: the files, default every spec file but
# fatbin_spec, which reads the library file and runs no kernel), SPEC_MEMCHECK_JOBS of them at once
# (default 1; the GPU has room for several, and each process is mostly host-bound under the
# sanitizer), MEMCHECK_SECS each. comm_spec only builds and runs `comm_bench --check`; under the sanitizer
# through busted it waited for an attachable process until its 400 s ran out (H200, 2026-12-04), so
# its program runs under memcheck directly instead. GPU_RUN_SECONDS (seconds since this script
# started; default none) stops starting files that could overrun it, and the summary names the
# ones left, to pass as SPEC_MEMCHECK to the next call: the device tool cuts a call at 600 s.
# LuaJIT runs with its JIT off (-joff): with the JIT on, the process aborts under
# compute-sanitizer with no report (rc 6; after 12 tests of cuda_ops_spec, or at once with a
# --filter; H200, 2026-11-30), and with it off the same specs run clean. A file that makes no
# CUDA call in its process (the tree, CPU-op and report specs) ends with the sanitizer's
# "terminated before first instrumented API call" and rc 255: the summary says "no CUDA calls".
# Memcheck counts a CUDA API call that returns an error as an error: the summary line says how many
# of them are cudaErrorMemoryAllocation (device_oom_spec provokes them on purpose) and how many were
# raised inside libnccl (NCCL probing its kernels), so that any other error stands out.
memcheck_summary() {   # memcheck_summary NAME: the log's error summary, API errors sorted by cause
  local log="$OUT/memcheck-$1.log"
  if grep -aq "terminated before first instrumented API call" "$log"; then echo "  $1: no CUDA calls"; return; fi
  local line; line=$(grep -aE "ERROR SUMMARY" "$log" | tail -1)
  local oom nccl
  oom=$(grep -ac "Program hit cudaErrorMemoryAllocation" "$log")
  nccl=$(awk '/Program hit/ { e = 1; next } e && /Host Frame/ && !/libcuda/ { if (/libnccl/) n++; e = 0 } END { print n + 0 }' "$log")
  echo "  $1: ${line:-no ERROR SUMMARY (cut short?)} (API errors: $oom out of memory, $nccl inside libnccl)"
}
MEMCHECK_SECS=150
memcheck_spec() {   # memcheck_spec FILE: one spec file under memcheck, its log packed alone
  local n; n=$(basename "$1" .lua)
  if [ "$n" = comm_spec ]; then
    step "memcheck-$n" $MEMCHECK_SECS compute-sanitizer --tool memcheck --leak-check full --print-limit 20 \
      --error-exitcode 3 build/bench/comm_bench --check
  else
    KDTREE_LIB=build/libkdtree_test.so KDTREE_BACKEND=cuda step "memcheck-$n" $MEMCHECK_SECS compute-sanitizer \
      --tool memcheck --leak-check full --print-limit 20 --error-exitcode 3 luajit -joff "$BUSTED_BIN" "$1"
  fi
  memcheck_summary "$n" >> "$OUT/summary.log"
  pack "memcheck-$n.log"
}
if has spec-memcheck; then
  make build/bench/comm_bench > "$OUT/comm-bench-build.log" 2>&1
  left=""
  for f in ${SPEC_MEMCHECK:-$(ls spec/*_spec.lua | grep -v fatbin_spec)}; do
    while [ "$(jobs -rp | wc -l)" -ge "${SPEC_MEMCHECK_JOBS:-1}" ]; do wait -n; done
    if [ -n "${GPU_RUN_SECONDS:-}" ] && [ $(( $(date +%s) - START + MEMCHECK_SECS )) -gt "$GPU_RUN_SECONDS" ]; then
      left="$left $f"; continue
    fi
    memcheck_spec "$f" &
  done
  wait
  [ -z "$left" ] || echo "spec-memcheck: not run (GPU_RUN_SECONDS=$GPU_RUN_SECONDS): SPEC_MEMCHECK=\"${left# }\"" >> "$OUT/summary.log"
fi
pack
rm -f "$OUT/.pack.lock"
cat "$OUT/summary.log"
