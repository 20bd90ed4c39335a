#!/usr/bin/env bash
# run.sh: run cuda/mla_tc.cuh's tensor-core attention kernels on the CPU under a SIMT emulation
# (one fiber per CUDA thread; ldmatrix / mma.sync emulated from their PTX fragment layouts and
# cp.async from its commit groups in inc/mla_mma.cuh, barriers in inc/cuda_internal.cuh, the
# launcher in inc/emu_fibers.h, which ../gemm_emu shares) and check them
# against a float64 reference and for batch invariance (emu_main.cpp). No GPU needed; this
# checks the kernel's indexing, fragment layouts, masking, pipeline order and launch logic,
# not nvcc's code generation or the tensor cores' own rounding.
# Usage (repo root): scripts/bench/mla_emu/run.sh [full]   (default: ~minutes on 2 cores)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${EMU_BUILD:-/tmp/kd_mla_emu}
mkdir -p "$out"
g++ -std=c++20 -O2 -I"$here/inc" -I"$root/core" -o "$out/emu" "$here/emu_main.cpp"
"$out/emu" "${1:-}"
