#!/usr/bin/env bash
# cuda_gpu_check.sh: one pass on the GPU machine for the CUDA backend (ops, batch invariance,
# the whole suite on CUDA, compute-sanitizer, op timings). Logs go to $OUT (or ./gpu-logs).
# Usage (repo root, GPU machine, after `source .device/env.sh`):  scripts/bench/cuda_gpu_check.sh [steps]
# steps: any of build ops bi bench diag memcheck racecheck suite (default: all, in that order)
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
steps=${*:-"build ops bi bench diag memcheck racecheck suite"}
has() { case " $steps " in *" $1 "*) return 0 ;; esac; return 1; }
B="luajit ${KDROOT:+$KDROOT}/usr/bin/busted"
LIB=build/libkdtree.so
export KDTREE_LIB=$PWD/$LIB
SM90='-O3 -std=c++17 -Xcompiler -fPIC -Icore -lineinfo -gencode arch=compute_90,code=sm_90'

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  nvcc --version | tail -2
} > "$OUT/summary.log" 2>&1

if has build; then
  # the project build (sm_90 only here, to save device time; CI builds the fat binary)
  if ! make -k -j16 NVFLAGS="$SM90" > /tmp/kd_build.log 2>&1; then
    echo "make failed; retrying with the CUDA backend built without the W4A16 kernels" | tee -a "$OUT/summary.log"
    tail -20 /tmp/kd_build.log >> "$OUT/summary.log"
    objs=""
    for f in cuda/backend.cu cuda/linear.cu cuda/mla.cu cuda/moe.cu cuda/norm_rope.cu cuda/tree.cu; do
      o=build/now4/${f%.cu}.o; mkdir -p "$(dirname "$o")"
      nvcc $SM90 -DKD_NO_W4A16 -c "$f" -o "$o" >> /tmp/kd_build.log 2>&1 &
      objs="$objs $o"
    done
    wait
    cc -shared -o $LIB build/core/*.o build/core/cpu/*.o $objs -lcjson -lm -lpthread -L/usr/local/cuda/lib64 \
      -Wl,-rpath,/usr/local/cuda/lib64 -lcudart -lcublas -lcublasLt -lstdc++ >> /tmp/kd_build.log 2>&1 \
      || echo "fallback link failed" >> "$OUT/summary.log"
  fi
  cc -O2 -std=c11 -D_GNU_SOURCE -Icore scripts/bench/cuda_ops_bench.c -Lbuild -lkdtree -Wl,-rpath,$PWD/build \
    -o build/cuda_ops_bench >> /tmp/kd_build.log 2>&1 || echo "bench build failed" >> "$OUT/summary.log"
  cc -O1 -g -std=c11 -D_GNU_SOURCE -Icore scripts/bench/cuda_sanitize.c -Lbuild -lkdtree -Wl,-rpath,$PWD/build -lm \
    -o build/cuda_sanitize >> /tmp/kd_build.log 2>&1 || echo "sanitize driver build failed" >> "$OUT/summary.log"
fi

run() {   # run NAME SECONDS CMD...: output to $OUT/NAME.log, a line in the summary
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($(( $(date +%s) - t0 )) s): $(grep -E '[0-9]+ success' "$OUT/$name.log" | tail -1)" >> "$OUT/summary.log"
}
has ops && run ops 100 $B spec/cuda_ops_spec.lua
has bi && run bi 60 $B spec/batch_invariance_spec.lua
has bench && run bench 60 build/cuda_ops_bench
has diag && run diag 60 sh -c 'for g in spec/fixtures/golden-tiny-k2.6.json spec/fixtures/golden-tiny-dsv3.json; do
  luajit scripts/bench/cuda_vs_cpu_model.lua $g; done'
has memcheck && run memcheck 90 compute-sanitizer --tool memcheck --leak-check full --print-limit 20 build/cuda_sanitize
has racecheck && run racecheck 90 compute-sanitizer --tool racecheck --print-limit 20 build/cuda_sanitize
has suite && run suite 70 env KDTREE_BACKEND=cuda $B spec
cat "$OUT/summary.log"
