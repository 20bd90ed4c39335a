/* w4a16_skinny.cu: the small-M W4A16 GEMM (plain GEMM, M <= 8): one 16-row weight tile per
 * block, one or two warps per part of K, the weights fetched whole by bulk copies at entry.
 * Its arithmetic order is the pipelined kernel's (w4a16.cu), so both give the same bits; the
 * configuration code there picks it (config_for) where the H200 timings say it is faster. */
#include "w4a16_device.cuh"

namespace kd_w4a16_impl {

/* Plain GEMM with M <= 8, one 16-row weight tile per block and H warps per part of K (H = 1
 * or 2: 2 gives a K2.6 tile 16 warps where its 8 parts alone would give 8): the arithmetic
 * order of w4a16_gemm_kernel exactly (same bits: per part the scale groups in k order, then
 * the parts added in order 0..parts-1, here through shared memory instead of a cluster).
 * With H = 2 the second warp of a part computes its groups' sums but does not fold them: it
 * keeps them in registers until the first warp's acc is in shared memory, then continues
 * the same chain of acc = fma(sum, scale, acc) from there.
 * How the bytes arrive: at entry, before waiting for the previous grid, one lane per warp
 * starts a bulk copy (TMA) of each of the NCH chunks of its range, each on its own mbarrier:
 * every weight byte of the launch is requested at once, by the copy engine, while the
 * load/store path stays free for the activations (all M rows, all of K) and the scale words.
 * The warp then walks its chunks, waiting for each chunk's barrier just before using it.
 * The group size (1 << GSHIFT) and NCH are compile-time, so the walk is straight-line code
 * the compiler can interleave across scale groups. No clusters: blocks are placed freely. */
template <int GSHIFT, int NCH, int H>
__global__ void __launch_bounds__(512) w4a16_skinny_kernel(const W4Args a) {
    constexpr int BM = 8, NG = (NCH * CHUNK_K) >> GSHIFT;   /* scale groups per warp */
    static_assert(NG >= 1 && (NCH * CHUNK_K) % (1 << GSHIFT) == 0, "a warp's range holds whole scale groups");
    static_assert(H == 1 || H == 2, "one or two warps per part");
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, threads = blockDim.x;
    const int part = warp / H, half = warp % H;
    const int tile = blockIdx.x;
    griddep_launch_dependents();
    const int c0 = part * a.cpp + half * NCH;
    const int XR = a.kc * CHUNK_K + 8;    /* +16 bytes per row: conflict-free ldmatrix */
    const SkinnyLayout L = skinny_layout(a.m, a.kc, a.parts * H, NCH, NG);
    uint64_t *bar = (uint64_t *)(smem + L.bars) + warp * NCH;
    const uint4 *sw = (const uint4 *)(smem + L.w) + warp * NCH * 32 + lane;
    uint32_t *ss = (uint32_t *)(smem + L.s) + warp * NG * 8;
    bf16 *sx = (bf16 *)(smem + L.x);

    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < NCH; j++) mbar_init(&bar[j], 1);
        mbar_init_fence();
        const uint4 *src = a.mat.q + ((size_t)tile * a.kc + c0) * 32;
#pragma unroll
        for (int j = 0; j < NCH; j++) bulk_load((uint4 *)(smem + L.w) + (warp * NCH + j) * 32, src + j * 32, 512, &bar[j]);
    }
    {   /* the scale words of this warp's range: 32 bytes per group, 16 per copy */
        const uint4 *src = (const uint4 *)(a.mat.s + ((size_t)tile * a.groups + ((c0 * CHUNK_K) >> GSHIFT)) * 8);
        for (int p = lane; p < 2 * NG; p += 32) cp_async16((uint4 *)ss + p, src + p, true);
    }

    /* the M activation rows, all of K (k past K zero-filled) */
    griddep_wait();
    const int pieces = a.kc * (CHUNK_K / 8);
    for (int row = 0; row < a.m; row++)
        for (int kp = tid; kp < pieces; kp += threads) {
            int k = kp * 8;
            bool v = k < a.k;
            cp_async16(sx + row * XR + k, v ? (const void *)(a.x + (size_t)row * a.ldx + k) : (const void *)a.x, v);
        }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();   /* also orders the barrier inits before every lane's wait */

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float kept[H == 2 ? NG : 1][4];   /* H = 2, second warp: its groups' sums, folded later */
    const uint32_t *sl = ss + (lane >> 2);
    /* acc = fma(group sum, scale, acc) for group g of this warp's range */
    auto fold = [&](const float (&sum)[4], int g) {
        uint32_t sw2 = sl[g * 8];
        float slo = __uint_as_float(sw2 << 16), shi = __uint_as_float(sw2 & 0xFFFF0000u);
        acc[0] = fmaf(sum[0], slo, acc[0]);
        acc[1] = fmaf(sum[1], slo, acc[1]);
        acc[2] = fmaf(sum[2], shi, acc[2]);
        acc[3] = fmaf(sum[3], shi, acc[3]);
    };
    /* ldmatrix row addresses; rows past M read row M-1 (their output columns are never stored,
     * and an mma column depends on its own B column alone) */
    const bf16 *xl = sx + min(lane & 7, a.m - 1) * XR + ((lane >> 3) & 1) * 8 + c0 * CHUNK_K;
#pragma unroll
    for (int j = 0; j < NCH; j++) {
        mbar_wait0(&bar[j]);
        const uint4 wq = sw[j * 32];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t b0, b1;
            ldmatrix_x2(b0, b1, xl + j * CHUNK_K + kk * 16);
            uint32_t av[4];
            dequant4(kk == 0 ? wq.x : kk == 1 ? wq.y : kk == 2 ? wq.z : wq.w, av);
            mma_bf16(tmp, av, b0, b1);
            const int k_end = j * CHUNK_K + kk * 16 + 16;        /* within the range (ranges start on a group) */
            if ((k_end & ((1 << GSHIFT) - 1)) == 0) {
                const int g = (k_end - 1) >> GSHIFT;
                if (H == 2 && half == 1) {
#pragma unroll
                    for (int r = 0; r < 4; r++) kept[H == 2 ? g : 0][r] = tmp[r];
                } else {
                    fold(tmp, g);
                }
#pragma unroll
                for (int r = 0; r < 4; r++) tmp[r] = 0.0f;
            }
        }
    }

    /* over the weights, which every warp has finished reading after the barrier: the hand-off
     * of the first warps' acc [part][lane][4], then the parts' partial tiles [part][16][BM] */
    float *hand = (float *)(smem + L.w), *pbuf = hand + a.parts * 128;
    __syncthreads();
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < NCH; j++) mbar_inval(&bar[j]);
    if (H == 2) {
        if (half == 0)
#pragma unroll
            for (int r = 0; r < 4; r++) hand[(part * 32 + lane) * 4 + r] = acc[r];
        __syncthreads();
        if (half == 1) {
#pragma unroll
            for (int r = 0; r < 4; r++) acc[r] = hand[(part * 32 + lane) * 4 + r];
#pragma unroll
            for (int g = 0; g < NG; g++) fold(kept[H == 2 ? g : 0], g);
        }
    }
    const int gr = lane >> 2, tq = (lane & 3) * 2;
    if (half == H - 1)
#pragma unroll
        for (int r = 0; r < 4; r++) pbuf[(part * 16 + gr + (r >= 2 ? 8 : 0)) * BM + tq + (r & 1)] = acc[r];
    __syncthreads();
    for (int e = tid; e < 16 * a.m; e += threads) {
        int row = e / a.m, t = e - row * a.m, n = tile * 16 + row;
        if (n >= a.n) continue;
        float v = 0.0f;
        for (int p = 0; p < a.parts; p++) {
            float pv = pbuf[(p * 16 + row) * BM + t];
            v = p == 0 ? pv : v + pv;
        }
        store_out(a.y, a.y_f32, (size_t)t * a.ldy + n, v);
    }
}

/* the shared memory a skinny kernel may take: 200 KB, or the device's opt-in limit where that
 * is lower (sm_120: about 99 KB); a launch that needs more (many rows of a long K) takes the
 * pipelined kernel */
int skinny_smem_max() {
    static int dev_cached = -1, limit = 0;
    int dev = 0, optin = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (dev != dev_cached) {
        if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) optin = 0;
        limit = optin < 200 * 1024 ? optin : 200 * 1024;
        dev_cached = dev;
    }
    return limit;
}

/* The skinny kernel for (group, chunks per warp, warps per part); NULL where none is built:
 * group 32 (Kimi K2.6's) with 2, 4, 7 or 8 chunks per warp (the K2.6 expert shapes: parts of
 * 14 chunks in two warps of 7, and of 8 chunks in one warp) */
template <int GSHIFT, int H>
KernelFn skinny_fn(int nch) {
    switch (nch) {
    case 2: return w4a16_skinny_kernel<GSHIFT, 2, H>;
    case 4: return w4a16_skinny_kernel<GSHIFT, 4, H>;
    case 7: return w4a16_skinny_kernel<GSHIFT, 7, H>;
    case 8: return w4a16_skinny_kernel<GSHIFT, 8, H>;
    default: return nullptr;
    }
}
/* false when the skinny kernel does not take the launch: M above 8, a group other than 32, a
 * part that does not split into h equal ranges with a kernel, a short last part, more than 16
 * warps, or more shared memory than skinny_smem_max() */
bool skinny_plan(int h, int m, int kc, int parts, int cpp, int gshift, KernelFn *fn, int *threads, int *smem) {
    if (m > 8 || gshift != 5 || kc != parts * cpp || cpp % h || parts * h > 16) return false;
    int nch = cpp / h;
    *fn = h == 1 ? skinny_fn<5, 1>(nch) : skinny_fn<5, 2>(nch);
    *smem = skinny_layout(m, kc, parts * h, nch, (nch * CHUNK_K) >> gshift).total;
    *threads = 32 * parts * h;
    return *fn && *smem <= skinny_smem_max();
}

}  // namespace kd_w4a16_impl
