#!/usr/bin/env bash
# ab.sh: the same bench rows on two source trees, built side by side and run one after the other
# on one GPU in one call: a run's numbers compare only within it (the copy ceiling alone moves
# a few percent from machine to machine).
#
# BASE is a directory holding another commit's files, made where git is:
#     mkdir BASE && git archive COMMIT | tar -x -C BASE
# and carried to the GPU machine with the working tree. This tree's bench sources are compiled
# against each tree's own headers and engine objects (the backend's op table changes between
# commits), so a row this tree's bench gained runs on both.
#
# Usage (repo root; on the GPU machine after `source .device/env.sh`):
#     scripts/bench/ab.sh BASE [-a ARCH] ROW...
# ARCH: the CUDA architecture both trees are built for (default 90; `make`'s CUDA_ARCHS).
# ROW, one argument each:
#     "linear N K M"       one dense GEMM (cuda_ops_bench --linear-at), cuBLAS beside it
#     "attention CTX T"    MLA at 64 heads, T queries (a tree when T > 1) after CTX - T rows
#     "round"              the DDTree round's table (cuda_ops_bench --round)
#     "sample ROWS"        sample_rows alone per sampled sampler over ROWS flat rows (--sample-at)
#     "tree B"             the tree build alone at budget B: top-K and the build, flat and peaked (--tree-at)
#     "slice"              the K2.6-dims slice's decode and verify steps (model_slice_bench --quick)
#     "tp8 [LAYERS]"       the TP-8 rank step, LAYERS of 61 (default 30: 61 need more than 80 GB), no drafter
# Per row, the base tree's lines come first, then this tree's, each line prefixed with its tree.
# Build logs: ${OUT:-ab-logs}/build-{base,this}.log.
set -u -o pipefail
usage() { sed -n '12,23p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
BASE=$(cd "$1" 2>/dev/null && pwd) || { echo "ab.sh: base tree '$1' is not a directory" >&2; exit 2; }
shift
ARCH=90
if [ "${1:-}" = -a ]; then
  [ $# -ge 2 ] || usage
  ARCH=$2; shift 2
fi
[ $# -ge 1 ] || usage
num='[1-9][0-9]*'
for row in "$@"; do
  [[ $row =~ ^(linear\ $num\ $num\ $num|attention\ $num\ $num|round|sample\ $num|tree\ $num|slice|tp8(\ $num)?)$ ]] ||
    { echo "ab.sh: unknown row '$row'" >&2; usage; }
done
THIS=$PWD
LOGS=${OUT:-ab-logs}
mkdir -p "$LOGS"
[ -f "$BASE/Makefile" ] || { echo "ab.sh: $BASE has no Makefile (expected a source tree)" >&2; exit 2; }

# both trees' engine objects and slice benches, at once (half the cores each)
JOBS=$(( ($(nproc) + 1) / 2 ))
build() {   # build TREE NAME
  (cd "$1" && make -j"$JOBS" CUDA_ARCHS="$ARCH" build/libkdtree_internal.a build/bench/model_slice_bench) \
    > "$LOGS/build-$2.log" 2>&1 || { echo "ab.sh: the $2 tree did not build: $LOGS/build-$2.log" >&2; return 1; }
  local cuda_inc; cuda_inc=$(dirname "$(dirname "$(command -v nvcc)")")/include
  (cd "$1" && cc -O2 -std=c11 -D_GNU_SOURCE -Icore -I"$cuda_inc" "$THIS/scripts/bench/cuda_ops_bench.c" \
     build/libkdtree_internal.a $(cat build/engine.flags) -o build/bench/cuda_ops_bench) >> "$LOGS/build-$2.log" 2>&1 ||
    { echo "ab.sh: this tree's cuda_ops_bench.c does not build against the $2 tree: $LOGS/build-$2.log" >&2; return 1; }
}
build "$BASE" base & pb=$!
build "$THIS" this & pt=$!
wait $pb || exit 1
wait $pt || exit 1

run_row() {   # run_row TREE ROW: the row's lines on stdout
  local tree=$1 row=$2 md
  md=$(mktemp)
  set -- $row
  case $1 in
    linear) "$tree/build/bench/cuda_ops_bench" --linear-at "$2" "$3" "$4" | tail -1 ;;
    attention) "$tree/build/bench/cuda_ops_bench" --attention-at "$2" "$3" | tail -1 ;;
    round) "$tree/build/bench/cuda_ops_bench" --round ;;
    sample) "$tree/build/bench/cuda_ops_bench" --sample-at "$2" ;;
    tree) "$tree/build/bench/cuda_ops_bench" --tree-at "$2" ;;
    slice) "$tree/build/bench/model_slice_bench" --quick --no-draft --no-mla --md "$md" > /dev/null &&
           grep -E '^\| (decode|verify)' "$md" ;;
    tp8) "$tree/build/bench/model_slice_bench" --k26-rank 8 --layers "${2:-30}" --quick --no-draft --md "$md" > /dev/null &&
         grep -E '^\| (decode|verify)' "$md" ;;
  esac
  local rc=$?
  rm -f "$md"
  return $rc
}
for row in "$@"; do
  echo "## $row"
  for t in base this; do
    tree=$BASE; [ $t = this ] && tree=$THIS
    run_row "$tree" "$row" 2>&1 | sed "s/^/$t  /"
    [ "${PIPESTATUS[0]}" = 0 ] || echo "$t  (the row failed)"
  done
done
