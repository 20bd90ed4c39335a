/* SIMT emulation of the CUDA pieces ddtree.cu's kernels use: one OS thread per CUDA thread,
 * std::barrier for __syncthreads and for warp-synchronous shuffles/ballots. */
#pragma once
#include <barrier>
#include <mutex>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <cfloat>
#include <climits>
#include <algorithm>
extern "C" {
#include "backend.h"
#include "error.h"
}
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct emu_dim { unsigned x = 0, y = 0, z = 0; };
struct alignas(16) uint4 { unsigned x, y, z, w; };   /* CUDA's vector type: 16-byte loads */
extern thread_local emu_dim threadIdx, blockIdx;
extern emu_dim blockDim, gridDim;
extern std::barrier<> *emu_block_bar;
extern std::barrier<> *emu_warp_bar[64];
extern uint64_t emu_xbuf[64][32];
extern std::mutex emu_atomic_mu;
inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
template <class T> inline T emu_exchange(T v, int src_lane) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint64_t b = 0; std::memcpy(&b, &v, sizeof(T));
    emu_xbuf[w][lane] = b;
    emu_warp_bar[w]->arrive_and_wait();
    uint64_t r = emu_xbuf[w][src_lane];
    emu_warp_bar[w]->arrive_and_wait();
    T out; std::memcpy(&out, &r, sizeof(T));
    return out;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return emu_exchange(v, (threadIdx.x & 31) ^ o); }
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src); }
template <class T> inline T __shfl_up_sync(unsigned, T v, int o) {
    int lane = threadIdx.x & 31; T r = emu_exchange(v, lane >= o ? lane - o : lane); return r;
}
inline unsigned __ballot_sync(unsigned, bool p) {
    int w = threadIdx.x >> 5;
    emu_xbuf[w][threadIdx.x & 31] = p;
    emu_warp_bar[w]->arrive_and_wait();
    unsigned b = 0;
    for (int i = 0; i < 32; i++) if (emu_xbuf[w][i]) b |= 1u << i;
    emu_warp_bar[w]->arrive_and_wait();
    return b;
}
inline bool __any_sync(unsigned m, bool p) { return __ballot_sync(m, p) != 0; }
inline unsigned __match_any_sync(unsigned, unsigned v) {   /* the lanes holding this lane's value */
    int w = threadIdx.x >> 5;
    emu_xbuf[w][threadIdx.x & 31] = v;
    emu_warp_bar[w]->arrive_and_wait();
    unsigned b = 0;
    for (int i = 0; i < 32; i++) if (emu_xbuf[w][i] == v) b |= 1u << i;
    emu_warp_bar[w]->arrive_and_wait();
    return b;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
    int w = threadIdx.x >> 5;
    emu_xbuf[w][threadIdx.x & 31] = v;
    emu_warp_bar[w]->arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; i++) m = std::max(m, (unsigned)emu_xbuf[w][i]);
    emu_warp_bar[w]->arrive_and_wait();
    return m;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
inline double __longlong_as_double(long long u) { double d; std::memcpy(&d, &u, 8); return d; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline float __double2float_ru(double d) { float f = (float)d; return (double)f < d ? std::nextafter(f, INFINITY) : f; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline unsigned atomicAdd(unsigned *p, unsigned v) { std::lock_guard<std::mutex> g(emu_atomic_mu); unsigned o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) { std::lock_guard<std::mutex> g(emu_atomic_mu); auto o = *p; *p = o + v; return o; }
inline float atomicAdd(float *p, float v) { std::lock_guard<std::mutex> g(emu_atomic_mu); float o = *p; *p = o + v; return o; }
inline int atomicMin(int *p, int v) { std::lock_guard<std::mutex> g(emu_atomic_mu); int o = *p; if (v < o) *p = v; return o; }
using std::min;
typedef struct kd_cuda { size_t smem_optin; } kd_cuda;
inline int atomicAdd(int *p, int v) { std::lock_guard<std::mutex> g(emu_atomic_mu); int o = *p; *p = o + v; return o; }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
/* programmatic dependent launch: one launch at a time here, so the grid before has ended */
inline void kd_griddep_wait() {}
inline void kd_griddep_release() {}
inline void kd_griddep_enter() {}
