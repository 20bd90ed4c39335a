#!/usr/bin/env bash
# run.sh: run the DDTree kernels of cuda/ddtree.cu on the CPU under a SIMT emulation and
# compare them with the host definitions (no GPU needed; a check of the kernels' logic and
# barrier/shuffle structure, not of nvcc's code generation).
#   inc/cuda_internal.cuh  stands in for the real one: one OS thread per CUDA thread,
#                          std::barrier for __syncthreads and for warp-synchronous
#                          shuffles / ballots, a mutex for atomics, __shared__ = static
#   emu_main.cpp           launches tree_select, tree_walk and sample_rows_kernel and checks
#                          them against kd_tree_select_host + kd_tree_mask, the CPU twin of
#                          tree_walk, and kd_sample_row_code (the engine's objects, CPU build)
# Usage (repo root): scripts/bench/ddtree_emu/run.sh [full|samples|trees|crowded|slices]   (default: a few minutes; full: every
# sampling setting and V = 163840 rows, ~20 minutes on 2 cores: 512 OS threads per emulated block)
# EMU_LIB=DIR links the engine's objects of a build there (libkdtree_internal.a, engine.flags).
# spec/ddtree_emu_spec.lua runs the slices form in CI.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
. "$here/emu_build.sh"
emu_init ddtree
emu_helpers
emu_kernels ddtree.cu 's/extern __shared__ double sel_smem\[\];/double *sel_smem = emu_dyn_smem;/'
emu_build
"$out/emu" "${1:-}"
