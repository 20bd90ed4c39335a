# emu_build.sh: what the run.sh of the OS-thread emulators share (ddtree_emu, tree_emu, norm_emu,
# route_emu), sourced after `set -eu` and `here=...`. The kernels and the device helpers are taken
# from the sources as they are, so the emulation runs the code the GPU runs.
#   emu_init NAME        root, out (EMU_BUILD, default /tmp/kd_NAME_emu) and lib: the engine's
#                        objects (libkdtree_internal.a, engine.flags) of EMU_LIB's build, or built here
#   emu_helpers          cuda/cuda_internal.cuh's device helpers (kd_ld .. kd_float_of_key) -> helpers.inc
#   emu_kernels FILE [S] the anonymous namespaces of cuda/FILE, through the sed script S (dynamic
#                        shared memory from a host buffer, host-only pieces left out) -> kernels.inc
#   emu_build            emu_main.cpp against ddtree_emu/inc, the extracted pieces and the engine
emu_init() {
  root=$(cd "$here/../../.." && pwd)
  out=${EMU_BUILD:-/tmp/kd_$1_emu}
  mkdir -p "$out"
  lib=${EMU_LIB:-$out/lib}
  [ -n "${EMU_LIB:-}" ] || make -s -C "$root" BUILD="$lib" CUDA=0 "$lib/libkdtree_internal.a"
}
emu_helpers() {
  sed -n '/^__device__ __forceinline__ float kd_ld/,/^\/\* ---- entry points shared/p' "$root/cuda/cuda_internal.cuh" |
    sed '$d' > "$out/helpers.inc"
}
emu_kernels() {
  sed -n '/^namespace {/,/^}  \/\/ namespace/p' "$root/cuda/$1" | sed "${2:-}" > "$out/kernels.inc"
}
emu_build() {
  g++ -std=c++20 -O1 -pthread -I"$root/scripts/bench/ddtree_emu/inc" -I"$out" -I"$root/core" -o "$out/emu" \
    "$here/emu_main.cpp" "$lib/libkdtree_internal.a" $(cat "$lib/engine.flags")
}
