#!/usr/bin/env bash
# run.sh: run cuda/norm_rope.cu's residual, norm and rope kernels on the CPU under the SIMT
# emulation of scripts/bench/ddtree_emu/inc (one OS thread per CUDA thread, std::barrier for
# __syncthreads and the warp shuffles) and check add_rmsnorm_kernel (the bits of scale_add_kernel
# followed by rmsnorm_kernel at the model's widths, an fp32 addend added as its bf16, and the CPU
# twin's values within bf16 rounding), mla_rope_store_kernel (the bits of rmsnorm_kernel and
# rope_kernel) and move_rows_kernel (a compaction's moves in the order of their rows). No GPU
# needed; this checks the kernels' logic and reduction order, not nvcc's code generation.
#   emu_main.cpp   the device's 16-bit floats, the launches and the checks
# The kernels and the device helpers (kd_ld, kd_st, the block sum) are taken from the sources as
# they are, so the emulation runs the code the GPU runs. spec/norm_emu_spec.lua runs it in CI.
# Usage (repo root): scripts/bench/norm_emu/run.sh   (seconds). EMU_LIB=DIR links the engine's
# objects of a build there (libkdtree_internal.a, engine.flags) instead of building its own.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../ddtree_emu/emu_build.sh"
emu_init norm
emu_helpers
emu_kernels norm_rope.cu '/^static int ew_blocks/,/^}/d'   # ew_blocks needs the real kd_cuda
emu_build
"$out/emu"
