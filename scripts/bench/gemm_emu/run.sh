#!/usr/bin/env bash
# run.sh: run cuda/gemm.cuh's dense GEMM kernel on the CPU under the fiber SIMT emulation of
# ../mla_emu/inc (ldmatrix, mma.sync and cp.async emulated from their PTX definitions) and check
# it against a CPU sum of the same rounding, for batch invariance and for its split-K tile
# counters (emu_main.cpp). No GPU needed; checks indexing, the cp.async pipeline, split-K and the
# launch logic, not nvcc's code generation or the tensor cores' own rounding.
# Usage (repo root): scripts/bench/gemm_emu/run.sh   (about a minute on 2 cores)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${EMU_BUILD:-/tmp/kd_gemm_emu}
mkdir -p "$out"
g++ -std=c++20 -O2 -Wno-unknown-pragmas -I"$root/scripts/bench/mla_emu/inc" -I"$root/core" -o "$out/emu" \
  "$here/emu_main.cpp"
"$out/emu"
