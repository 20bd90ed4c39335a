#!/usr/bin/env bash
# kernel_cost.sh: what one kind of kernel costs the graphed TP-8 rank step at the margin: the step
# whole, then with the launches of one kernel kind skipped, in one call on one GPU. ncu times a
# kernel alone (serialized, no programmatic launch); this says how much shorter the graphed step
# gets without it, an upper bound on what fusing it into a neighbour saves.
#
# A lab tool, outside the product (as llm.c's dev/cuda): it copies this tree, patches the copy's
# kd_launch_pdl (cuda/cuda_internal.cuh) to skip the kernels named in the environment variable
# KD_LAB_SKIP, and builds model_slice_bench there; the library itself reads no environment. A
# skipped kernel leaves its output unwritten, so the step computes garbage (the bench's checks
# fail; only the timings count). Kernels launched outside kd_launch_pdl (W4A16, NCCL) cannot be
# skipped, and neither may route_kernel: the experts' ids it writes index memory.
#
# Usage (repo root, on the GPU machine after `source .device/env.sh`):
#     scripts/bench/kernel_cost.sh [-a ARCH] [-l LAYERS] [NAME=KERNEL[,KERNEL...] ...]
# ARCH: the CUDA architecture built (default 90); LAYERS: of rank 0 of TP-8 (default 16: 1 dense
# and 15 MoE). Each NAME=... is one run with those kernels skipped (kd_launch_pdl's names, e.g.
# swiglu_kernel); default: a MoE layer's small kernels one kind at a time, the attention's three,
# and every dense GEMM. The whole step runs first and last; their mean is the base.
# Output: a markdown table on stdout and in ${OUT:-kernel-cost-logs}/kernel_cost.md, the runs'
# tables beside it.
set -u -o pipefail
usage() { sed -n '14,21p' "$0" >&2; exit 2; }
ARCH=90
LAYERS=16
while [ $# -gt 0 ]; do
  case $1 in
    -a) [ $# -ge 2 ] || usage; ARCH=$2; shift 2 ;;
    -l) [ $# -ge 2 ] || usage; LAYERS=$2; shift 2 ;;
    -h|--help) usage ;;
    *) break ;;
  esac
done
[[ $LAYERS =~ ^[1-9][0-9]*$ ]] || { echo "kernel_cost.sh: -l LAYERS: expected a positive number, got '$LAYERS'" >&2; exit 2; }
if [ $# -eq 0 ]; then
  set -- merge=tc_merge_kernel swiglu=swiglu_kernel rmsnorm=rmsnorm_kernel rope_store=mla_rope_store_kernel \
    add_rmsnorm=add_rmsnorm_kernel "attention=tc_scores_kernel (shared),tc_chunk_kernel (shared),tc_merge_kernel" \
    gemm=gemm_kernel
fi
for set in "$@"; do
  [[ $set =~ ^[a-z0-9_]+=[^=]+$ ]] || { echo "kernel_cost.sh: '$set': expected NAME=KERNEL[,KERNEL...]" >&2; exit 2; }
  [[ ,${set#*=}, == *,route_kernel,* ]] && { echo "kernel_cost.sh: route_kernel cannot be skipped (its ids index memory)" >&2; exit 2; }
done
[ -f Makefile ] && [ -f cuda/cuda_internal.cuh ] || { echo "kernel_cost.sh: run it in the repository root" >&2; exit 2; }
LOGS=${OUT:-kernel-cost-logs}
mkdir -p "$LOGS"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# the copy (no build outputs, no git), its kd_launch_pdl returning at once for a skipped name
tar cf - --exclude=./build --exclude=./.git --exclude=./.device . | tar xf - -C "$WORK"
python3 - "$WORK/cuda/cuda_internal.cuh" <<'PY' || { echo "kernel_cost.sh: cannot patch kd_launch_pdl" >&2; exit 1; }
import sys
path = sys.argv[1]
s = open(path).read()
sig = "template <typename... Params, typename... Args>\nstatic inline kd_status kd_launch_pdl("
body = "cudaStream_t st, Args... args) {\n"
if sig not in s or body not in s[s.index(sig):]:
    sys.exit("kd_launch_pdl's signature changed")
skip = '''#include <stdlib.h>
#include <string.h>
static inline bool kd_lab_skip(const char *what) {   /* KD_LAB_SKIP: comma-separated exact names */
    static const char *list = getenv("KD_LAB_SKIP");
    if (!list || !*list) return false;
    const size_t n = strlen(what);
    for (const char *p = list;;) {
        const char *e = strchr(p, ',');
        const size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && !strncmp(p, what, n)) return true;
        if (!e) return false;
        p = e + 1;
    }
}
'''
s = s.replace(sig, skip + sig)
at = s.index(body, s.index(sig)) + len(body)
s = s[:at] + "    if (kd_lab_skip(what)) return KD_OK;\n" + s[at:]
open(path, "w").write(s)
PY
(cd "$WORK" && make -j"$(nproc)" CUDA_ARCHS="$ARCH" build/bench/model_slice_bench) > "$LOGS/build.log" 2>&1 ||
  { echo "kernel_cost.sh: the patched copy did not build: $LOGS/build.log" >&2; exit 1; }

ROWS=("decode|1024" "verify B=16|1024" "verify B=64|1024")
# run NAME KERNELS: the step's ms at each of ROWS, space-separated (NaN when a row is missing)
run() {
  local md="$LOGS/cost-$1.md"
  rm -f "$md"   # a table left by an earlier call must not stand for this run's
  KD_LAB_SKIP=$2 "$WORK/build/bench/model_slice_bench" --k26-rank 8 --layers "$LAYERS" --quick --md "$md" \
    > "$LOGS/cost-$1.log" 2>&1   # exits 1 when a kernel is skipped: its checks see garbage
  local out="" row ms
  for row in "${ROWS[@]}"; do
    ms=$(awk -F'|' -v step="${row%|*}" -v ctx="${row#*|}" \
      '{ gsub(/^ +| +$/, "", $2); gsub(/ /, "", $3) } $2 == step && $3 == ctx { gsub(/ /, "", $5); print $5; exit }' "$md" 2>/dev/null)
    out="$out ${ms:-NaN}"
  done
  echo "$out"
}
base1=$(run base "")
declare -a names kernels times
for set in "$@"; do
  names+=("${set%%=*}"); kernels+=("${set#*=}"); times+=("$(run "${set%%=*}" "${set#*=}")")
done
base2=$(run base2 "")

{
  echo "## Marginal cost of kernel kinds in the graphed TP-8 rank step ($LAYERS layers, ctx 1K)"
  echo
  echo "ms of the step; saved = (base - with the kernels skipped) / $LAYERS layers, in us a layer."
  echo "Base = the mean of the whole step run first ($base1 ) and last ($base2 )."
  echo
  echo "| skipped | kernels | decode ms | saved us / layer | verify B=16 ms | saved | verify B=64 ms | saved |"
  echo "|---|---|---|---|---|---|---|---|"
  for i in "${!names[@]}"; do
    awk -v n="${names[$i]}" -v k="${kernels[$i]}" -v b1="$base1" -v b2="$base2" -v t="${times[$i]}" -v L="$LAYERS" '
      BEGIN {
        split(b1, x, " "); split(b2, y, " "); split(t, z, " ")
        line = "| " n " | " k " |"
        for (j = 1; j <= 3; j++) {
          if (z[j] == "NaN" || x[j] == "NaN" || y[j] == "NaN") { line = line " " z[j] " | - |"; continue }
          base = (x[j] + y[j]) / 2
          line = line sprintf(" %s | %.1f |", z[j], (base - z[j]) * 1000 / L)
        }
        print line
      }'
  done
} | tee "$LOGS/kernel_cost.md"
