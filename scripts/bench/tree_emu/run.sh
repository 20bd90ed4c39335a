#!/usr/bin/env bash
# run.sh: run the kernels of cuda/tree.cu (argmax, top-k) on the CPU under the SIMT emulation of
# ../ddtree_emu/inc (one OS thread per CUDA thread) and compare them with a plain C++ reference:
# the order value descending, the lower id first among equal values, NaN last; argmax's first
# NaN / +inf column reported as -code (sample_rule.h). A check of the kernels' logic and
# barrier / shuffle structure without a GPU, not of nvcc's code generation.
# The kernels and the device helpers (kd_ld, the block reductions) are taken from the sources as
# they are. spec/tree_emu_spec.lua runs the quick form in CI.
# Usage (repo root): scripts/bench/tree_emu/run.sh [quick|full]   (quick: about a minute on 2 cores;
# full: adds rows of 163840 ids, several minutes). EMU_LIB=DIR links the engine's objects of a build
# there (libkdtree_internal.a, engine.flags) instead of building its own.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${EMU_BUILD:-/tmp/kd_tree_emu}
mkdir -p "$out"
lib=${EMU_LIB:-$out/lib}
[ -n "${EMU_LIB:-}" ] || make -s -C "$root" BUILD="$lib" CUDA=0 "$lib/libkdtree_internal.a"
# the device helpers of cuda/cuda_internal.cuh (kd_ld .. kd_block_max) and tree.cu's kernels (its
# anonymous namespace), dynamic shared memory from a host buffer
sed -n '/^__device__ __forceinline__ float kd_ld/,/^\/\* ---- entry points shared/p' "$root/cuda/cuda_internal.cuh" |
  sed '$d' > "$out/helpers.inc"
sed -n '/^namespace {/,/^}  \/\/ namespace/p' "$root/cuda/tree.cu" |
  sed 's/extern __shared__ unsigned long long cand\[\];/unsigned long long *cand = (unsigned long long *)emu_dyn_smem;/' \
  > "$out/kernels.inc"
g++ -std=c++20 -O1 -pthread -I"$here/../ddtree_emu/inc" -I"$out" -I"$root/core" -o "$out/emu" "$here/emu_main.cpp" \
  "$lib/libkdtree_internal.a" $(cat "$lib/engine.flags")
"$out/emu" "${1:-quick}"
