#!/usr/bin/env bash
# run.sh: run cuda/moe.cu's router kernel (route_kernel: sigmoid, bias, group-limited top-k, the
# chosen experts' weights) on the CPU under the SIMT emulation of ../ddtree_emu/inc (one OS thread
# per CUDA thread) and compare its experts and weights, bit for bit, with a host rule written from
# the kernel's comment: its one-warp selection (n <= 512) and its block-wide one (n > 512), with
# ties, masked groups and both weight normalisations. A check of the kernel's logic and barrier /
# shuffle structure without a GPU, not of nvcc's code generation. The kernels and the device
# helpers are taken from the sources as they are. spec/route_emu_spec.lua runs it in CI.
# Usage (repo root): scripts/bench/route_emu/run.sh   (seconds). EMU_LIB=DIR links the engine's
# objects of a build there (libkdtree_internal.a, engine.flags) instead of building its own.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${EMU_BUILD:-/tmp/kd_route_emu}
mkdir -p "$out"
lib=${EMU_LIB:-$out/lib}
[ -n "${EMU_LIB:-}" ] || make -s -C "$root" BUILD="$lib" CUDA=0 "$lib/libkdtree_internal.a"
# the device helpers of cuda/cuda_internal.cuh (kd_ld .. kd_block_max) and moe.cu's kernels (its
# anonymous namespaces), dynamic shared memory from a host buffer
sed -n '/^__device__ __forceinline__ float kd_ld/,/^\/\* ---- entry points shared/p' "$root/cuda/cuda_internal.cuh" |
  sed '$d' > "$out/helpers.inc"
sed -n '/^namespace {/,/^}  \/\/ namespace/p' "$root/cuda/moe.cu" |
  sed 's/extern __shared__ float sm\[\];/float *sm = (float *)emu_dyn_smem;/' > "$out/kernels.inc"
g++ -std=c++20 -O1 -pthread -I"$here/../ddtree_emu/inc" -I"$out" -I"$root/core" -o "$out/emu" "$here/emu_main.cpp" \
  "$lib/libkdtree_internal.a" $(cat "$lib/engine.flags")
"$out/emu"
