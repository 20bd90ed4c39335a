#!/usr/bin/env bash
# run.sh: run cuda/norm_rope.cu's residual and norm kernels on the CPU under the SIMT emulation
# of scripts/bench/ddtree_emu/inc (one OS thread per CUDA thread, std::barrier for __syncthreads
# and the warp shuffles) and check add_rmsnorm_kernel: the bits of scale_add_kernel followed by
# rmsnorm_kernel at the model's widths, and the CPU twin's values within bf16 rounding. No GPU
# needed; this checks the kernel's logic and its reduction order, not nvcc's code generation.
#   emu_main.cpp   the device's 16-bit floats, the launches and the checks
# The kernels and the device helpers (kd_ld, kd_st, the block sum) are taken from the sources as
# they are, so the emulation runs the code the GPU runs. spec/norm_emu_spec.lua runs it in CI.
# Usage (repo root): scripts/bench/norm_emu/run.sh   (seconds). EMU_LIB=DIR links the engine's
# objects of a build there (libkdtree_internal.a, engine.flags) instead of building its own.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${EMU_BUILD:-/tmp/kd_norm_emu}
mkdir -p "$out"
# the engine's objects (the CPU twin and the 16-bit conversions are internal)
lib=${EMU_LIB:-$out/lib}
[ -n "${EMU_LIB:-}" ] || make -s -C "$root" BUILD="$lib" CUDA=0 "$lib/libkdtree_internal.a"
# the device helpers of cuda/cuda_internal.cuh (kd_ld .. kd_block_sum) and norm_rope.cu's kernels
# (its anonymous namespace without ew_blocks, which needs the real kd_cuda)
sed -n '/^__device__ __forceinline__ float kd_ld/,/^__device__ __forceinline__ float kd_block_max/p' \
  "$root/cuda/cuda_internal.cuh" | sed '$d' > "$out/helpers.inc"
sed -n '/^namespace {/,/^}  \/\/ namespace/p' "$root/cuda/norm_rope.cu" | sed '/^static int ew_blocks/,/^}/d' \
  > "$out/kernels.inc"
g++ -std=c++20 -O1 -pthread -I"$root/scripts/bench/ddtree_emu/inc" -I"$out" -I"$root/core" -o "$out/emu" \
  "$here/emu_main.cpp" "$lib/libkdtree_internal.a" $(cat "$lib/engine.flags")
"$out/emu"
