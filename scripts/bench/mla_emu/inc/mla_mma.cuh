/* CPU stand-in for cuda/mla_mma.cuh under the fiber SIMT emulation of cuda_internal.cuh here
 * (one fiber per CUDA thread, barriers for warp-collective operations). ldmatrix and mma.sync
 * are emulated from the PTX fragment layouts: each lane publishes its operands, the warp
 * meets at a barrier, each lane assembles its own result. mma: D = C + sum_k A B with the
 * 16 exact bf16 products summed in double and rounded once (the hardware's internal order
 * differs: this checks layouts, indexing and masking, not the GPU's bits). cp.async: below. */
#pragma once
#include "cuda_internal.cuh"
#include <cstdint>
#include <cmath>
#include <vector>

struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }

unsigned char *mla_emu_smem();                 /* this block's dynamic shared memory */
extern uint32_t mla_emu_x[32][32][8];          /* per warp, per lane operand slots */

inline void kd_st(void *p, int dt, size_t i, float v);

namespace mla {

inline void warp_sync_emu() { emu_warp_sync(); }

inline void ldsm_x4_any(uint32_t *r, const void *row_addr, bool trans) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    uint64_t a = (uint64_t)(uintptr_t)row_addr;
    mla_emu_x[w][l][0] = (uint32_t)a;
    mla_emu_x[w][l][1] = (uint32_t)(a >> 32);
    warp_sync_emu();
    auto addr = [&](int lane) {
        return (const uint16_t *)(uintptr_t)((uint64_t)mla_emu_x[w][lane][0] | ((uint64_t)mla_emu_x[w][lane][1] << 32));
    };
    for (int mi = 0; mi < 4; mi++) {
        uint16_t e0, e1;
        if (!trans) {
            const uint16_t *row = addr(mi * 8 + (l >> 2));
            e0 = row[2 * (l & 3)];
            e1 = row[2 * (l & 3) + 1];
        } else {
            e0 = addr(mi * 8 + 2 * (l & 3))[l >> 2];
            e1 = addr(mi * 8 + 2 * (l & 3) + 1)[l >> 2];
        }
        r[mi] = (uint32_t)e0 | ((uint32_t)e1 << 16);
    }
    warp_sync_emu();
}
inline void ldsm_x4(uint32_t *r, const void *p) { ldsm_x4_any(r, p, false); }
inline void ldsm_x4_trans(uint32_t *r, const void *p) { ldsm_x4_any(r, p, true); }

inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

inline void mma16816(float *d, const uint32_t *a, const uint32_t *b) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    for (int i = 0; i < 4; i++) mla_emu_x[w][l][i] = a[i];
    mla_emu_x[w][l][4] = b[0];
    mla_emu_x[w][l][5] = b[1];
    warp_sync_emu();
    auto A = [&](int row, int k) {
        uint32_t v = mla_emu_x[w][(row & 7) * 4 + ((k & 7) >> 1)][(row >= 8) + 2 * (k >= 8)];
        return bf2f((uint16_t)((k & 1) ? v >> 16 : v & 0xffff));
    };
    auto B = [&](int k, int n) {
        uint32_t v = mla_emu_x[w][n * 4 + ((k & 7) >> 1)][4 + (k >= 8)];
        return bf2f((uint16_t)((k & 1) ? v >> 16 : v & 0xffff));
    };
    float out[4];
    for (int e = 0; e < 4; e++) {
        int row = (l >> 2) + (e >> 1) * 8, col = 2 * (l & 3) + (e & 1);
        double acc = 0.0;
        for (int k = 0; k < 16; k++) acc += (double)A(row, k) * (double)B(k, col);
        out[e] = (float)(acc + (double)d[e]);
    }
    warp_sync_emu();
    for (int e = 0; e < 4; e++) d[e] = out[e];
}

/* cp.async as the PTX defines it, per thread: a copy lands in shared memory only when a
 * cp.async.wait_group retires its commit group (the source is read at issue: global inputs do
 * not change during a kernel), so a kernel that reads a stage before waiting for it reads stale
 * bytes here too. emu_cp_reset() at each block's start. */
struct emu_cp { void *dst; unsigned char bytes[16]; unsigned group; };
extern std::vector<emu_cp> emu_cp_pending[1024];
extern unsigned emu_cp_committed[1024];
inline void emu_cp_reset() {
    for (int t = 0; t < 1024; t++) { emu_cp_pending[t].clear(); emu_cp_committed[t] = 0; }
}
inline void cp16(void *smem, const void *gmem, bool ok) {
    emu_cp c;
    c.dst = smem;
    if (ok) std::memcpy(c.bytes, gmem, 16);
    else std::memset(c.bytes, 0, 16);
    c.group = emu_cp_committed[threadIdx.x];
    emu_cp_pending[threadIdx.x].push_back(c);
}
inline void cp_commit() { emu_cp_committed[threadIdx.x]++; }
template <int N> inline void cp_wait() {
    const unsigned n = emu_cp_committed[threadIdx.x], done = n > (unsigned)N ? n - N : 0;
    std::vector<emu_cp> &q = emu_cp_pending[threadIdx.x];
    size_t keep = 0;
    for (size_t i = 0; i < q.size(); i++) {
        if (q[i].group < done) std::memcpy(q[i].dst, q[i].bytes, 16);
        else q[keep++] = q[i];
    }
    q.resize(keep);
}
inline float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }

}  // namespace mla
