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
. "$here/../ddtree_emu/emu_build.sh"
emu_init route
emu_helpers
emu_kernels moe.cu 's/extern __shared__ float sm\[\];/float *sm = (float *)emu_dyn_smem;/'
emu_build
"$out/emu"
