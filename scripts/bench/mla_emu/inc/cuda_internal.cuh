/* Fiber SIMT emulation for mla_emu: one block at a time, one ucontext fiber per CUDA thread,
 * all in one OS thread (OS threads per CUDA thread, as ../ddtree_emu does, spend minutes in
 * the scheduler for the thousands of warp-collective steps of one attention block).
 * A barrier (warp or block) counts arrivals and yields until its generation changes. */
#pragma once
#include <ucontext.h>
#include <cstring>
#include <cstdint>
#include <cstddef>
#include <cmath>
#include <cfloat>
#include <algorithm>
#include <vector>
extern "C" {
#include "backend.h"
#include "error.h"
}
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct emu_dim { unsigned x = 0, y = 0, z = 0; };
extern emu_dim threadIdx, blockIdx, blockDim, gridDim;

struct emu_bar { int n = 0, count = 0; unsigned gen = 0; };
extern emu_bar emu_block_bar, emu_warp_bars[32];
void emu_yield();
inline void emu_arrive(emu_bar &b) {
    unsigned g = b.gen;
    if (++b.count == b.n) { b.count = 0; b.gen++; return; }
    while (b.gen == g) emu_yield();
}
inline void __syncthreads() { emu_arrive(emu_block_bar); }
inline void emu_warp_sync() { emu_arrive(emu_warp_bars[threadIdx.x >> 5]); }

extern uint64_t emu_xbuf[32][32];
template <class T> inline T emu_exchange(T v, int src_lane) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint64_t b = 0; std::memcpy(&b, &v, sizeof(T));
    emu_xbuf[w][lane] = b;
    emu_warp_sync();
    uint64_t r = emu_xbuf[w][src_lane];
    emu_warp_sync();
    T out; std::memcpy(&out, &r, sizeof(T));
    return out;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return emu_exchange(v, (threadIdx.x & 31) ^ o); }
inline void kd_griddep_wait() {}      /* one launch at a time here: the grid before has ended */
inline void kd_griddep_release() {}
inline void kd_griddep_enter() {}
using std::min;
