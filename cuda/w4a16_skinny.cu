/* w4a16_skinny.cu: the small-M W4A16 GEMM (plain GEMM, M <= 16), built so that back-to-back
 * launches keep the memory busy. Its arithmetic order is the pipelined kernel's (w4a16.cu),
 * so both give the same bits; config_for there gives it every M <= 16.
 *
 * Why its shape: at M <= 16 a launch is one stream of weight bytes (8 MB at K2.6's expert
 * shapes, 2 us at the H200's copy rate) plus a serial tail once the previous grid has
 * finished: read the activations, dequantise and multiply, reduce, store. Under programmatic
 * dependent launch the next launch's blocks load their weights during that tail, if they fit
 * on the SMs beside the running ones. So:
 *  - at entry, before the wait on the previous grid, one lane of each warp has the bulk-copy
 *    engine bring the warp's weights and scale words (its part of its tile, contiguous in the
 *    device form) into shared memory, completing on the warp's own mbarrier: no registers
 *    are held by the weights while the block waits, and they are in place at the release;
 *  - the next launch is released after the wait, not at entry: released at entry, a third
 *    launch's blocks load beside the two running ones and every launch's weights arrive later
 *    (H200 traces, docs/performance-log.md);
 *  - a block is one part of K for a few 16-row tiles (one warp per tile), so it stages only
 *    its part's slice of the activations beside its weights (at most 100 KB, fewer warps
 *    where more would not fit): two launches fit per SM, except at M = 16 with short parts
 *    (7168 x 2048: three 61 KB blocks an SM, not four);
 *  - a warp's math over its part is straight-line code (chunk count and group size compiled
 *    in), so the groups' loads, dequantisation and mma interleave;
 *  - the parts of a tile are the blocks of one cluster; the reduction sends each warp's fp32
 *    fragments to the reducing block with st.async (no cluster barrier after the math).
 * `make bench-trace` takes the launch timeline (entry, release, activations, weights, math,
 * end per block). */
#include "w4a16_device.cuh"

namespace kd_w4a16_impl {

/* One warp's math over its part: per scale group, tmp = the chain of mma k16 steps from zero,
 * then acc = fma(tmp, scale, acc) (w4a16.cuh: the order that makes every configuration
 * bit-identical). With the chunk count (FULL: nch == NCH) and the group size (GSHIFT > 0)
 * known at compile time this is straight-line code, so the loads, dequantisation and mma of
 * different groups interleave; a run-time group size puts a branch after every k16 step (a
 * run-time bound, one per chunk), and the H200 traces of that form showed 3-4 us of math per
 * launch. GSHIFT = 0: the group size is gshift (64 or 128). */
template <int NCH, int MT8, int GSHIFT, bool FULL>
__device__ __forceinline__ void skinny_math(const uint4 *wl, const bf16 *const (&xl)[MT8], const uint32_t *ss,
                                            int nch, int gshift, float (&acc)[MT8][4]) {
    const int gs = GSHIFT ? GSHIFT : gshift, gmask = (1 << gs) - 1;
    float tmp[MT8][4];
#pragma unroll
    for (int j = 0; j < MT8; j++)
#pragma unroll
        for (int r = 0; r < 4; r++) tmp[j][r] = 0.0f;
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        if (!FULL && c >= nch) break;
        const uint4 wq = wl[c * 32];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t b[MT8][2], av[4];
#pragma unroll
            for (int j = 0; j < MT8; j++) ldmatrix_x2(b[j][0], b[j][1], xl[j] + c * CHUNK_K + kk * 16);
            dequant4(kk == 0 ? wq.x : kk == 1 ? wq.y : kk == 2 ? wq.z : wq.w, av);
#pragma unroll
            for (int j = 0; j < MT8; j++) mma_bf16(tmp[j], av, b[j][0], b[j][1]);
            const int k_end = c * CHUNK_K + kk * 16 + 16;   /* parts start on a scale group */
            if ((k_end & gmask) == 0) {
                const uint32_t s2 = ss[((k_end - 1) >> gs) * 8];
                const float slo = __uint_as_float(s2 << 16), shi = __uint_as_float(s2 & 0xFFFF0000u);
#pragma unroll
                for (int j = 0; j < MT8; j++) {
                    acc[j][0] = fmaf(tmp[j][0], slo, acc[j][0]);
                    acc[j][1] = fmaf(tmp[j][1], slo, acc[j][1]);
                    acc[j][2] = fmaf(tmp[j][2], shi, acc[j][2]);
                    acc[j][3] = fmaf(tmp[j][3], shi, acc[j][3]);
#pragma unroll
                    for (int r = 0; r < 4; r++) tmp[j][r] = 0.0f;
                }
            }
        }
    }
}

#ifdef KD_W4A16_TRACE
/* Launch timeline (bench builds only: `make bench-trace`): thread 0 of each of the first
 * KD_W4A16_TRACE_BLOCKS blocks stamps %globaltimer at entry, after the wait on the previous
 * grid, once the activations are in, once warp 0's weights are in (it waits for them after
 * the activations, so never earlier), after warp 0's math and at the end, and notes the SM it
 * ran on, for the last KD_W4A16_TRACE_LAUNCHES launches of each block index
 * (kd_w4a16_trace_read in w4a16.cuh). */
__device__ unsigned long long g_trace[KD_W4A16_TRACE_LAUNCHES][KD_W4A16_TRACE_BLOCKS][KD_W4A16_TRACE_POINTS];
__device__ unsigned g_trace_count[KD_W4A16_TRACE_BLOCKS];
__device__ unsigned g_trace_sm[KD_W4A16_TRACE_LAUNCHES][KD_W4A16_TRACE_BLOCKS];
__device__ __forceinline__ unsigned trace_slot() {
    __shared__ unsigned slot;
    if (threadIdx.x == 0 && blockIdx.x < KD_W4A16_TRACE_BLOCKS) slot = atomicAdd(&g_trace_count[blockIdx.x], 1u) % KD_W4A16_TRACE_LAUNCHES;
    __syncthreads();
    return slot;
}
__device__ __forceinline__ void trace_point(unsigned slot, int point) {
    if (threadIdx.x == 0 && blockIdx.x < KD_W4A16_TRACE_BLOCKS) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        g_trace[slot][blockIdx.x][point] = t;
    }
}
__device__ __forceinline__ void trace_sm(unsigned slot) {
    if (threadIdx.x == 0 && blockIdx.x < KD_W4A16_TRACE_BLOCKS) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        g_trace_sm[slot][blockIdx.x] = sm;
    }
}
#define SKINNY_TRACE_START const unsigned trace_slot_ = trace_slot(); trace_point(trace_slot_, 0); trace_sm(trace_slot_)
#define SKINNY_TRACE(point) trace_point(trace_slot_, point)
#else
#define SKINNY_TRACE_START do {} while (0)
#define SKINNY_TRACE(point) do {} while (0)
#endif

/* blocks of 8 warps per SM the registers must allow. Short parts (NCH <= 8, e.g. 7168 x 2048
 * in 4 parts: 224 blocks of 8 warps at M > 4, 1.7 a launch per SM) ask for 4 (64 registers;
 * the M = 16 instances spill 8-32 bytes there); long ones (2048 x 7168: 128 blocks of 8 warps
 * at M > 4) for 2, and the compiler keeps more of the math in flight with the room (64
 * registers for all, 8-warp blocks at M = 1: 2048 x 7168 5.34 us against 5.09 with this rule,
 * H200, before the 4-warp blocks at M <= 4) */
template <int NCH>
struct SkinnyMinBlocks { static constexpr int value = NCH <= 8 ? 4 : 2; };

/* Grid: clusters of `parts` blocks (rank = part of K); cluster c owns tiles [c*W, c*W + W) for
 * W = warps per block, warp w of each block the tile c*W + w over the block's part.
 * NCH: the most chunks of 64 k a part holds (the straight-line math is unrolled over them);
 * GSHIFT: log2 of the group size when it is compiled in (5: Kimi K2.6's 32), else 0.
 * Split K: tile slot w is reduced by block w % parts, which adds the parts in order
 * 0..parts-1 and stores. One relaxed cluster barrier, arrived at before the wait on the
 * previous grid, orders each block's reduction barrier set-up before its peers' stores. */
template <int NCH, int MT8, int GSHIFT>
__global__ void __launch_bounds__(256, (SkinnyMinBlocks<NCH>::value)) w4a16_skinny_kernel(const W4Args a) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int P = a.parts, part = P > 1 ? (int)cluster_rank() : 0, cluster = blockIdx.x / P;
    const int tile = cluster * warps + warp;
    const bool live = tile < a.n_tiles;
    const int gshift = a.gshift;
    const int c0 = part * a.cpp, nch = min(a.kc, c0 + a.cpp) - c0;
    const int gpp = (a.cpp * CHUNK_K) >> gshift;   /* scale groups of a whole part (the layout's stride) */
    const int ng = (nch * CHUNK_K) >> gshift;      /* ... of this part (the last may be short) */
    const SkinnyLayout L = skinny_layout(a.m, warps, P, a.cpp, gpp);
    const int XR = a.cpp * CHUNK_K + 8;            /* +16 bytes per row: conflict-free ldmatrix */
    uint64_t *rbar = (uint64_t *)smem, *wbar = rbar + 1 + warp;
    const uint4 *wl = (const uint4 *)(smem + L.w) + warp * a.cpp * 32 + lane;
    const uint32_t *ss = (const uint32_t *)(smem + L.s) + warp * gpp * 8 + (lane >> 2);
    bf16 *sx = (bf16 *)(smem + L.x);
    float *red = (float *)(smem + L.red);
    /* live tile slots this block reduces: part, part + P, ... below the cluster's live count */
    const int live_slots = min(warps, a.n_tiles - cluster * warps);
    const int owned = part < live_slots ? (live_slots - part + P - 1) / P : 0;
    SKINNY_TRACE_START;

    if (live && lane == 0) {   /* the warp's weights and scale words, by the bulk-copy engine */
        const unsigned wbytes = (unsigned)nch * 512, sbytes = (unsigned)ng * 32;
        mbar_init(wbar, 1);
        mbar_init_fence();
        fence_proxy_async_smem();
        mbar_arrive_expect(wbar, wbytes + sbytes);
        bulk_load_stream(smem + L.w + warp * a.cpp * 512, a.mat.q + ((size_t)tile * a.kc + c0) * 32, wbytes, wbar);
        bulk_load_stream(smem + L.s + warp * gpp * 32,
                         a.mat.s + ((size_t)tile * a.groups + ((c0 * CHUNK_K) >> gshift)) * 8, sbytes, wbar);
    }
    if (P > 1) {
        if (tid == 0) {
            mbar_init(rbar, 1);
            mbar_init_fence();
            mbar_arrive_expect(rbar, (unsigned)(owned * P * 32 * MT8 * 16));
        }
        cluster_arrive_relaxed();
    }

    kd_griddep_wait();
    SKINNY_TRACE(1);
    kd_griddep_release();   /* see the file comment: after the wait, not at entry */
    {   /* the activation slice; rows past M are never staged (their mma columns are not stored) */
        const int pieces = nch * (CHUNK_K / 8);
        for (int e = tid; e < a.m * pieces; e += blockDim.x) {
            const int row = e / pieces, kp = e - row * pieces, k = c0 * CHUNK_K + kp * 8;
            const bool v = k < a.k;
            cp_async16(sx + row * XR + kp * 8, v ? (const void *)(a.x + (size_t)row * a.ldx + k) : (const void *)a.x, v);
        }
        cp_async_commit();
        cp_async_wait<0>();
    }
    __syncthreads();
    SKINNY_TRACE(2);

    float acc[MT8][4];
#pragma unroll
    for (int j = 0; j < MT8; j++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[j][r] = 0.0f;
    if (live) {
        mbar_wait0(wbar);
        SKINNY_TRACE(3);
        /* ldmatrix row addresses; rows past M read row M-1 (an mma column depends on its own
         * column of B alone, and those columns are never stored) */
        const bf16 *xl[MT8];
#pragma unroll
        for (int j = 0; j < MT8; j++) xl[j] = sx + min(j * 8 + (lane & 7), a.m - 1) * XR + ((lane >> 3) & 1) * 8;
        if (nch == NCH) skinny_math<NCH, MT8, GSHIFT, true>(wl, xl, ss, nch, a.gshift, acc);
        else skinny_math<NCH, MT8, GSHIFT, false>(wl, xl, ss, nch, a.gshift, acc);
    }

    SKINNY_TRACE(4);
    /* fragment (j, r) of lane L: row L/4 (+8 for r >= 2), token 8j + 2(L%4) (+1 for odd r) */
    if (P == 1) {
        if (live)
#pragma unroll
            for (int j = 0; j < MT8; j++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const int n = tile * 16 + (lane >> 2) + (r >= 2 ? 8 : 0), t = j * 8 + (lane & 3) * 2 + (r & 1);
                    if (n < a.n && t < a.m) store_out(a.y, a.y_f32, (size_t)t * a.ldy + n, acc[j][r]);
                }
        SKINNY_TRACE(5);
        return;
    }
    cluster_wait();   /* every peer's reduction barrier is set up */
    if (live) {
        const unsigned owner = (unsigned)(warp % P);
        const int slot = (warp / P * P + part) * 32 * MT8 + lane * MT8;   /* in 16-byte units */
        const uint32_t dst = cluster_addr(red, owner) + slot * 16, rb = cluster_addr(rbar, owner);
#pragma unroll
        for (int j = 0; j < MT8; j++) st_async_v4(dst + j * 16, acc[j], rb);
    }
    if (owned > 0) {
        mbar_wait0(rbar);
        const int per_slot = 16 * a.m;
        for (int e = tid; e < owned * per_slot; e += blockDim.x) {
            const int o = e / per_slot, rt = e - o * per_slot, row = rt / a.m, t = rt - row * a.m;
            const int n = (cluster * warps + o * P + part) * 16 + row;
            if (n >= a.n) continue;
            const int l = (row & 7) * 4 + ((t & 7) >> 1), r = (row >> 3) * 2 + (t & 1), j = t >> 3;
            const float *pv = red + ((o * P) * 32 * MT8 + l * MT8 + j) * 4 + r;
            float v = pv[0];
            for (int q = 1; q < P; q++) v += pv[q * 32 * MT8 * 4];
            store_out(a.y, a.y_f32, (size_t)t * a.ldy + n, v);
        }
    }
    SKINNY_TRACE(5);
}

/* the shared memory a skinny block may take: 100 KB, so that two launches' blocks fit on an
 * SM (the point of the kernel), or the device's opt-in limit where that is lower */
int skinny_smem_max() {
    const int optin = device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
    return optin < 100 * 1024 ? optin : 100 * 1024;
}

/* the instance unrolled over a part of cpp chunks: the fewest of 2, 4, 8, 14 (K2.6's
 * 2048 x 7168 in 8 parts) or 16, NULL past 16; the group size compiled in for 32 */
template <int MT8, int GSHIFT>
KernelFn skinny_fn(int cpp) {
    if (cpp <= 2) return w4a16_skinny_kernel<2, MT8, GSHIFT>;
    if (cpp <= 4) return w4a16_skinny_kernel<4, MT8, GSHIFT>;
    if (cpp <= 8) return w4a16_skinny_kernel<8, MT8, GSHIFT>;
    if (cpp <= 14) return w4a16_skinny_kernel<14, MT8, GSHIFT>;
    if (cpp <= 16) return w4a16_skinny_kernel<16, MT8, GSHIFT>;
    return nullptr;
}

bool skinny_plan(int warps, int m, int n_tiles, int kc, int parts, int cpp, int gshift, SkinnyPlan *plan) {
    if (m < 1 || m > 16 || gshift < 5 || gshift > 7 || parts > MAX_PARTS || kc > parts * cpp) return false;
    const KernelFn fn = gshift == 5 ? (m > 8 ? skinny_fn<2, 5>(cpp) : skinny_fn<1, 5>(cpp))
                                    : (m > 8 ? skinny_fn<2, 0>(cpp) : skinny_fn<1, 0>(cpp));
    if (!fn) return false;
    if (warps <= 0) {
        /* about one block per SM: the fewest warps whose blocks cover the SMs, at most 8; at
         * M <= 4 at most 4, as the smaller blocks of two launches place better side by side
         * (H200, 2048 x 7168 M = 1: 4.39 us against 5.09 with 8; 7168 x 2048 within noise) */
        const int sms = sm_count(), most = m <= 4 ? 4 : 8;
        long long want = ((long long)n_tiles * parts + sms - 1) / sms;
        warps = 1;
        while (warps < most && warps < want) warps *= 2;
    }
    if (warps > 8) warps = 8;
    const int gpp = (cpp * CHUNK_K) >> gshift, smem_max = skinny_smem_max();
    while (warps > 1 && skinny_layout(m, warps, parts, cpp, gpp).total > smem_max) warps /= 2;
    const int smem = skinny_layout(m, warps, parts, cpp, gpp).total;
    if (smem > smem_max) return false;
    plan->fn = fn;
    plan->threads = warps * 32;
    plan->smem = smem;
    plan->clusters = (n_tiles + warps - 1) / warps;
    return true;
}

}  // namespace kd_w4a16_impl

#ifdef KD_W4A16_TRACE
extern "C" int kd_w4a16_trace_read(unsigned long long *out, unsigned *sms, unsigned *counts, int reset) {
    using namespace kd_w4a16_impl;
    if (cudaMemcpyFromSymbol(out, g_trace, sizeof g_trace) != cudaSuccess) return -1;
    if (cudaMemcpyFromSymbol(counts, g_trace_count, sizeof g_trace_count) != cudaSuccess) return -1;
    if (cudaMemcpyFromSymbol(sms, g_trace_sm, sizeof g_trace_sm) != cudaSuccess) return -1;
    if (reset) {
        static const unsigned zero[KD_W4A16_TRACE_BLOCKS] = {0};
        if (cudaMemcpyToSymbol(g_trace_count, zero, sizeof zero) != cudaSuccess) return -1;
    }
    return 0;
}
#endif
