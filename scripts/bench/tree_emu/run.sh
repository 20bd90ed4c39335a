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
. "$here/../ddtree_emu/emu_build.sh"
emu_init tree
emu_helpers
emu_kernels tree.cu \
  's/extern __shared__ unsigned long long cand\[\];/unsigned long long *cand = (unsigned long long *)emu_dyn_smem;/'
emu_build
"$out/emu" "${1:-quick}"
