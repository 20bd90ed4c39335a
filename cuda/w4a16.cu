/* w4a16.cu: the W4A16 GEMM (INT4 compressed-tensors weights x bf16 activations) and the
 * MoE grouped form built on it. The contract and the batch-invariance argument are in
 * w4a16.cuh; this file has no backend state (w4a16_backend.cu adapts it to kd_backend).
 *
 * The kernel (Marlin-class, "weights as the A operand"):
 *   mma.sync m16n8k16 with A = 16 weight rows x 16 k (dequantised in registers),
 *   B = 16 k x 8 tokens (bf16 activations from shared memory through ldmatrix),
 *   C = 16 weight rows x 8 tokens in fp32. A block is WN warps; each warp owns NT tile
 *   slots of 16 weight rows (DUAL: slot 0 = gate rows, slot 1 = the same up rows) and all
 *   BM = 8*MT8 tokens of the block. A cp.async pipeline of STAGES chunks of 64 k keeps the
 *   weight stream (512 bytes per slot per chunk, each lane's 16 bytes its own fragments),
 *   the scales and the activation tile in flight.
 * Dequantisation: u | 0x4300 is the bf16 128+u; one bf16x2 fma subtracts 136, giving the
 *   exact integer q = u-8. The q*x products are exact; each scale group's sum is kept in
 *   fp32 (tmp) and folded in as acc = fma(tmp, scale, acc) when the group ends.
 * Split-K: K is cut into `parts` fixed by the weight's shape (enough warps in flight at
 *   small M); the parts of a tile are the blocks of one thread-block cluster, which leave
 *   their fp32 partials in shared memory and add them through distributed shared memory in
 *   part order 0..parts-1 (no workspace, no atomics).
 * Work items (token tile, n-block) are walked by a grid-stride loop over clusters, so the MoE
 *   can launch a fixed grid while the number of tiles is known only on the device.
 * The skinny kernel (w4a16_skinny.cu; plain GEMM, M <= 16): the same arithmetic with one warp
 *   per (16-row tile, part), the weights brought into shared memory by bulk copies before the
 *   wait on the previous grid. config_for gives it every M <= 16 (skinny_plan may still
 *   decline a launch). The helpers both files use are in w4a16_device.cuh.
 */
#include "w4a16_device.cuh"
#include <pthread.h>

namespace kd_w4a16_impl {
int device_attr(cudaDeviceAttr attr, int fallback) {
    struct Known { int dev; cudaDeviceAttr attr; int value; };
    static Known known[32];
    static int n_known = 0;
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    int dev = 0, value = fallback;
    if (cudaGetDevice(&dev) != cudaSuccess) { cudaGetLastError(); return fallback; }
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_known; i++)
        if (known[i].dev == dev && known[i].attr == attr) {
            value = known[i].value;
            pthread_mutex_unlock(&lock);
            return value;
        }
    if (cudaDeviceGetAttribute(&value, attr, dev) != cudaSuccess) { cudaGetLastError(); value = fallback; }
    else if (n_known < 32) known[n_known++] = {dev, attr, value};
    pthread_mutex_unlock(&lock);
    return value;
}
int sm_count() { return device_attr(cudaDevAttrMultiProcessorCount, 132); }
}  // namespace kd_w4a16_impl

namespace {
using namespace kd_w4a16_impl;

kd_status w4_fail(cudaError_t e, const char *call, int line) {
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        return kd_fail(KD_ERR_NOMEM, "cuda: %s at w4a16.cu:%d: %s", call, line, cudaGetErrorString(e));
    }
    cudaGetLastError();
    return kd_fail(KD_ERR_BACKEND, "cuda: %s at w4a16.cu:%d: %s", call, line, cudaGetErrorString(e));
}
#define W4_CUDA(call) do { cudaError_t w4_e_ = (call); if (w4_e_ != cudaSuccess) return w4_fail(w4_e_, #call, __LINE__); } while (0)
#define W4_LAUNCH(what) do { cudaError_t w4_e_ = cudaGetLastError(); if (w4_e_ != cudaSuccess) return w4_fail(w4_e_, what, __LINE__); } while (0)

/* ---------------------------------------------------------------- repack */
/* codes: one thread per (16-row tile t, 64-k chunk c, lane L). Lane L = 4*gr + cc holds,
 * for k16 step kk, word kk with nibbles
 *   0:(r0,k0) 1:(r1,k0) 2:(r0,k0+8) 3:(r1,k0+8) 4:(r0,k0+1) 5:(r1,k0+1) 6:(r0,k0+9) 7:(r1,k0+9)
 * where r0 = 16t+gr, r1 = r0+8, k0 = 64c + 16kk + 2cc: exactly the A fragment of
 * mma.m16n8k16 (a0 = row gr cols 2cc..+1, a1 = row gr+8, a2 = row gr cols +8, a3 = row gr+8 cols +8). */
__host__ __device__ inline uint32_t repack_word(const uint32_t *raw, int n, int k, int t, int c, int lane, int kk) {
    int gr = lane >> 2, cc = lane & 3, kw = k / 8;
    int r0 = t * 16 + gr, r1 = r0 + 8, k0 = c * CHUNK_K + kk * 16 + 2 * cc;
    auto nib = [&](int r, int col) -> uint32_t {
        if (r >= n || col >= k) return 8u;   /* q = 0 */
        return (raw[(size_t)r * kw + col / 8] >> (4 * (col & 7))) & 15u;
    };
    return nib(r0, k0) | nib(r1, k0) << 4 | nib(r0, k0 + 8) << 8 | nib(r1, k0 + 8) << 12 | nib(r0, k0 + 1) << 16 |
           nib(r1, k0 + 1) << 20 | nib(r0, k0 + 9) << 24 | nib(r1, k0 + 9) << 28;
}

__global__ void repack_codes_kernel(const uint32_t *__restrict__ raw, int n, int k, int kc, int n_tiles,
                                    uint4 *__restrict__ out) {
    size_t total = (size_t)n_tiles * kc * 32;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        int lane = (int)(idx & 31);
        size_t tc = idx >> 5;
        int c = (int)(tc % kc), t = (int)(tc / kc);
        out[idx] = make_uint4(repack_word(raw, n, k, t, c, lane, 0), repack_word(raw, n, k, t, c, lane, 1),
                              repack_word(raw, n, k, t, c, lane, 2), repack_word(raw, n, k, t, c, lane, 3));
    }
}

/* scales: word (t, g, j) = s[16t+j, g] | s[16t+j+8, g] << 16 (zero past N or K) */
__host__ __device__ inline uint32_t repack_scale_word(const uint16_t *raw, int n, int n_groups, int t, int g, int j) {
    int r0 = t * 16 + j, r1 = r0 + 8;
    uint32_t s0 = (r0 < n && g < n_groups) ? raw[(size_t)r0 * n_groups + g] : 0u;
    uint32_t s1 = (r1 < n && g < n_groups) ? raw[(size_t)r1 * n_groups + g] : 0u;
    return s0 | s1 << 16;
}

__global__ void repack_scales_kernel(const uint16_t *__restrict__ raw, int n, int n_groups, int groups_pad, int n_tiles,
                                     uint32_t *__restrict__ out) {
    size_t total = (size_t)n_tiles * groups_pad * 8;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        size_t tg = idx >> 3;
        out[idx] = repack_scale_word(raw, n, n_groups, (int)(tg / groups_pad), (int)(tg % groups_pad), (int)(idx & 7));
    }
}

/* ---------------------------------------------------------------- the GEMM kernel */
/* floats per row of a block's split-K partial tile (store_tile): one more than the BM tokens */
__host__ __device__ constexpr int partial_row(int bm) { return bm + 1; }

template <int MT8, int NT, int WN, int SC, int STAGES>
struct W4Shape {
    static constexpr int BM = MT8 * 8;
    static constexpr int THREADS = WN * 32;
    static constexpr int SLOTS = WN * NT;
    static constexpr int KS = SC * CHUNK_K;                   /* k per pipeline stage */
    static constexpr int XR = KS + 8;                         /* bf16 per activation row: +16 bytes, conflict-free ldmatrix */
    static constexpr int X_BYTES = BM * XR * 2;
    static constexpr int W_BYTES = SLOTS * SC * 512;
    static constexpr int S_BYTES = SLOTS * SC * 64;           /* up to two scale groups (group 32) per chunk per slot */
    static constexpr int STAGE_BYTES = X_BYTES + W_BYTES + S_BYTES;
    static constexpr int XP = BM * SC * 8;                    /* 16-byte activation pieces per stage */
    static constexpr int XPT = (XP + THREADS - 1) / THREADS;  /* ... per thread */
    static constexpr int PR = partial_row(BM);                /* floats per row of the partial tile */
    static constexpr int PART_BYTES = SLOTS * 16 * PR * 4;    /* the block's fp32 partial tile (split-K) */
    static constexpr int SMEM = STAGES * STAGE_BYTES > PART_BYTES ? STAGES * STAGE_BYTES : PART_BYTES;
};

/* small-M configurations ask for 16 resident warps per SM at least (at most 128 registers):
 * latency hiding is what limits them; shared memory allows ~5 blocks */
template <int MT8, int NT, int WN>
struct W4MinBlocks { static constexpr int value = MT8 <= 2 ? 512 / (WN * 32) : 1; };

/* The epilogue of a block's work item: fragment (i, j, r) is weight row 16*tile + lane/4 (+8
 * for r >= 2), token 8j + 2*(lane%4) (+1 for odd r). One part: stored directly. Several: split-K
 * inside the cluster: every block leaves its partial tile in its own shared memory
 * [slot*16 + row][token], rows BM + 1 floats apart; after a cluster barrier, block `rank` adds
 * the parts for its share of the tile in part order 0..parts-1 and stores it. The adding
 * threads walk rows, so with rows BM floats apart (a multiple of 32 banks from BM = 32 on) every
 * lane of a remote load hit one bank: ncu on the H200 showed 32 times the ideal shared
 * wavefronts on those loads and half of a 7168 x 2048, M = 64 launch's stall samples on them.
 * `smem` must hold W4Shape::PART_BYTES and be free (every warp has finished reading its
 * stages). Ends with the block synchronised. */
template <int MT8, int NT, int WN, bool DUAL>
__device__ __forceinline__ void store_tile(const W4Args &a, const float (&acc)[NT][MT8][4], const int (&slot_tile)[NT],
                                           int row0, int rows, int nbi, int part, unsigned char *smem) {
    constexpr int BM = MT8 * 8, PR = partial_row(BM), THREADS = WN * 32, SLOTS = WN * NT;
    constexpr int OUT_SLOTS = DUAL ? WN : SLOTS;    /* 16-row output tiles per block */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gr = lane >> 2, tq = (lane & 3) * 2;
    if (a.parts == 1) {
#pragma unroll
        for (int i = 0; i < (DUAL ? 1 : NT); i++)
#pragma unroll
            for (int j = 0; j < MT8; j++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    int n = slot_tile[i] * 16 + gr + (r >= 2 ? 8 : 0), t = j * 8 + tq + (r & 1);
                    if (n >= a.n || t >= rows) continue;
                    float v = DUAL ? silu_mul(acc[0][j][r], acc[1][j][r]) : acc[i][j][r];
                    store_out(a.y, a.y_f32, (size_t)(row0 + t) * a.ldy + n, v);
                }
        __syncthreads();   /* shared memory is reused by the next item */
        return;
    }
    float *pbuf = (float *)smem;
    __syncthreads();   /* the last stage has been read by every warp */
#pragma unroll
    for (int i = 0; i < NT; i++)
#pragma unroll
        for (int j = 0; j < MT8; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                int row = (warp * NT + i) * 16 + gr + (r >= 2 ? 8 : 0), t = j * 8 + tq + (r & 1);
                pbuf[row * PR + t] = acc[i][j][r];
            }
    cluster_sync_all();
    const int width = OUT_SLOTS * 16, n0 = (DUAL ? nbi * WN : nbi * SLOTS) * 16;
    const int e_total = rows * width;
    const int e_beg = (int)((long long)e_total * part / a.parts);
    const int e_end = (int)((long long)e_total * (part + 1) / a.parts);
    for (int e = e_beg + tid; e < e_end; e += THREADS) {
        int t = e / width, nl = e - t * width, n = n0 + nl;
        if (n >= a.n) continue;
        int rg = DUAL ? (nl >> 4) * 32 + (nl & 15) : nl;   /* gate (or plain) row in pbuf */
        const float *pg = pbuf + rg * PR + t;
        float v = 0.0f, u = 0.0f;
        for (int p = 0; p < a.parts; p++) {
            float gv = ld_cluster(cluster_addr(pg, (unsigned)p));
            v = p == 0 ? gv : v + gv;
            if (DUAL) {
                float uv = ld_cluster(cluster_addr(pg + 16 * PR, (unsigned)p));
                u = p == 0 ? uv : u + uv;
            }
        }
        store_out(a.y, a.y_f32, (size_t)(row0 + t) * a.ldy + n, DUAL ? silu_mul(v, u) : v);
    }
    cluster_sync_exit();   /* peers are done reading this block's partials */
}

/* Grid: clusters of `parts` blocks (one block per part of K, rank = part); a cluster walks
 * work items (token tile, n-block) with a grid-stride loop over clusters.
 * Per element the arithmetic is the same in every configuration: for each scale group in k
 * order, tmp = the chain of mma k16 steps from zero, acc = fma(tmp, scale, acc); then the
 * parts' acc added in part order. SC (chunks per stage) only changes how loads are batched.
 * GSHIFT: log2 of the group size compiled in (5: Kimi K2.6's 32; the fold points of a stage
 * are then constants and its math straight-line code: the MoE on the H200 went from 56% to
 * 64% of copy at T = 1 and from 72-74% to 78-79% at T = 4..64), or 0: a.gshift at run time. */
template <int MT8, int NT, int WN, int SC, int STAGES, bool DUAL, int GSHIFT>
__global__ void __launch_bounds__(WN * 32, (W4MinBlocks<MT8, NT, WN>::value)) w4a16_gemm_kernel(const W4Args a) {
    typedef W4Shape<MT8, NT, WN, SC, STAGES> S;
    constexpr int BM = S::BM, THREADS = S::THREADS, SLOTS = S::SLOTS, XR = S::XR, XPT = S::XPT;
    static_assert(!DUAL || NT == 2, "DUAL pairs a gate slot with an up slot");
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ long long row_off[BM];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool moe = a.tiles != nullptr;
    const int part = a.parts > 1 ? (int)cluster_rank() : 0;
    const int cluster = blockIdx.x / a.parts, n_clusters = gridDim.x / a.parts;
    /* The MoE's tile list is the plan kernel's output: read after the wait for the grid
     * before, unless that grid is gate + up and tiles_ready says so (below). A MoE grid that
     * waits releases its dependents after the wait, so the down GEMM launched behind gate +
     * up finds the plan complete and streams its first weights while gate + up finishes. */
    bool waited = false;
    if (moe && !a.tiles_ready) {
        kd_griddep_wait();
        waited = true;
    }
    kd_griddep_release();
    const int tiles_m = moe ? *a.n_tiles_dev : (a.m + BM - 1) / BM;
    const long long total = (long long)tiles_m * a.nb;
    const int gshift = GSHIFT ? GSHIFT : a.gshift, gmask = (1 << gshift) - 1;

    for (long long item = cluster; item < total; item += n_clusters) {
        const int nbi = (int)(item % a.nb);
        const int tile = (int)(item / a.nb);
        int row0, rows;
        W4Mat m0 = a.mat, m1 = a.mat;
        if (moe) {
            int4 t = a.tiles[tile];
            row0 = t.y;
            rows = t.z;
            const kd_w4a16_expert &ex = a.table[t.x];
            if (DUAL) {
                m0.q = (const uint4 *)ex.gate_codes; m0.s = (const uint32_t *)ex.gate_scales;
                m1.q = (const uint4 *)ex.up_codes;   m1.s = (const uint32_t *)ex.up_scales;
            } else {
                m0.q = (const uint4 *)ex.down_codes; m0.s = (const uint32_t *)ex.down_scales;
            }
        } else {
            row0 = tile * BM;
            rows = min(BM, a.m - row0);
        }
        const int c0 = part * a.cpp, c1 = min(a.kc, c0 + a.cpp), nchunks = c1 - c0;
        const int nstages = (nchunks + SC - 1) / SC;

        /* this warp's slots: weight and scale stream pointers (a slot past N streams tile 0;
         * its rows are never stored) */
        int slot_tile[NT];
        const uint4 *qn[NT];
        const uint4 *sq[NT];
#pragma unroll
        for (int i = 0; i < NT; i++) {
            int t = DUAL ? nbi * WN + warp : nbi * SLOTS + warp * NT + i;
            const W4Mat &mm = (DUAL && i == 1) ? m1 : m0;
            slot_tile[i] = t;
            int tc = t < a.n_tiles ? t : 0;
            qn[i] = mm.q + ((size_t)tc * a.kc + c0) * 32 + lane;
            sq[i] = (const uint4 *)(mm.s + (size_t)tc * a.groups * 8) + lane;
        }
        for (int r = tid; r < BM; r += THREADS) {
            long long off = -1;
            if (r < rows) off = (long long)(a.row_map ? a.row_map[row0 + r] : row0 + r) * a.ldx;
            row_off[r] = off;
        }
        __syncthreads();
        /* this thread's activation pieces: source pointer, k, place in the stage. Rows past
         * `rows` are not loaded: their columns of C are never stored, and a column of an mma
         * result depends on its own column of B alone. */
        const bf16 *xsrc[XPT];
        int xk[XPT], xdst[XPT], xchunk[XPT];
        bool xok[XPT];
#pragma unroll
        for (int j = 0; j < XPT; j++) {
            int p = tid + j * THREADS;
            int rr = p / (SC * 8), kp = p % (SC * 8);
            long long off = p < S::XP ? row_off[rr] : -1;
            xok[j] = off >= 0;
            xk[j] = c0 * CHUNK_K + kp * 8;
            xsrc[j] = a.x + (xok[j] ? off : 0) + xk[j];
            xdst[j] = rr * XR + kp * 8;
            xchunk[j] = kp >> 3;
        }

        /* stage loads; called for consecutive stages (the pointers advance) */
        auto load_w = [&](int s, int stage) {
            const int c = c0 + s * SC, nc = min(SC, c1 - c);
            unsigned char *sb = smem + stage * S::STAGE_BYTES;
            uint4 *sw = (uint4 *)(sb + S::X_BYTES) + warp * NT * SC * 32 + lane;
            uint4 *ss = (uint4 *)(sb + S::X_BYTES + S::W_BYTES) + warp * NT * SC * 4 + lane;
            const int g0 = (c * CHUNK_K) >> gshift;
            const int ng = (nc * CHUNK_K) >> gshift, pieces = ng > 1 ? 2 * ng : 2;
#pragma unroll
            for (int i = 0; i < NT; i++) {
#pragma unroll
                for (int cc = 0; cc < SC; cc++)
                    if (cc < nc) cp_async16(sw + (i * SC + cc) * 32, qn[i] + cc * 32, true);
                qn[i] += SC * 32;
                if (lane < pieces) cp_async16(ss + i * SC * 4, sq[i] + g0 * 2, true);
            }
        };
        auto load_x = [&](int s, int stage) {
            const int nc = min(SC, c1 - (c0 + s * SC));
            bf16 *sx = (bf16 *)(smem + stage * S::STAGE_BYTES);
#pragma unroll
            for (int j = 0; j < XPT; j++) {
                if (xok[j] && xchunk[j] < nc) {
                    bool v = xk[j] < a.k;
                    cp_async16(sx + xdst[j], v ? (const void *)xsrc[j] : (const void *)a.x, v);
                }
                xsrc[j] += S::KS;
                xk[j] += S::KS;
            }
        };

        /* prologue: the weights first (they never depend on an earlier kernel), then wait
         * for the previous grid (programmatic dependent launch), then the activations */
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++)
            if (s < nstages) load_w(s, s);
        if (!waited) {
            kd_griddep_wait();
            waited = true;
        }
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < nstages) load_x(s, s);
            cp_async_commit();
        }

        float acc[NT][MT8][4], tmp[NT][MT8][4];
#pragma unroll
        for (int i = 0; i < NT; i++)
#pragma unroll
            for (int j = 0; j < MT8; j++)
#pragma unroll
                for (int r = 0; r < 4; r++) acc[i][j][r] = tmp[i][j][r] = 0.0f;

        const int x_lane = (lane & 7) * XR + ((lane >> 3) & 1) * 8;   /* ldmatrix row address of this lane */
        const int s_lane = lane >> 2;                                  /* scale word of this lane's rows */
        for (int s = 0; s < nstages; s++) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            {
                int sn = s + STAGES - 1;
                if (sn < nstages) {
                    int st = sn % STAGES;
                    load_w(sn, st);
                    load_x(sn, st);
                }
                cp_async_commit();
            }
            const int c = c0 + s * SC, nc = min(SC, c1 - c);
            const unsigned char *sb = smem + (s % STAGES) * S::STAGE_BYTES;
            const bf16 *sx = (const bf16 *)sb + x_lane;
            const uint4 *sw = (const uint4 *)(sb + S::X_BYTES) + warp * NT * SC * 32 + lane;
            const uint32_t *ss = (const uint32_t *)(sb + S::X_BYTES + S::W_BYTES) + warp * NT * SC * 16 + s_lane;
#pragma unroll
            for (int cc = 0; cc < SC; cc++) {
                if (cc >= nc) break;
                /* scale groups end after k16 step 1 (group 32) and after step 3 (group 32, 64;
                 * 128 on odd chunks) */
                const bool end1 = gshift == 5, end3 = (((c + cc + 1) * CHUNK_K) & gmask) == 0;
                uint4 wq[NT];
#pragma unroll
                for (int i = 0; i < NT; i++) wq[i] = sw[(i * SC + cc) * 32];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    uint32_t b[MT8][2];
#pragma unroll
                    for (int j = 0; j < MT8; j++) ldmatrix_x2(b[j][0], b[j][1], sx + j * 8 * XR + cc * CHUNK_K + kk * 16);
#pragma unroll
                    for (int i = 0; i < NT; i++) {
                        uint32_t w = kk == 0 ? wq[i].x : kk == 1 ? wq[i].y : kk == 2 ? wq[i].z : wq[i].w;
                        uint32_t av[4];
                        dequant4(w, av);
#pragma unroll
                        for (int j = 0; j < MT8; j++) mma_bf16(tmp[i][j], av, b[j][0], b[j][1]);
                    }
                    if ((kk == 1 && end1) || (kk == 3 && end3)) {
                        const int gl = (cc * CHUNK_K + kk * 16) >> gshift;   /* group within the stage */
#pragma unroll
                        for (int i = 0; i < NT; i++) {
                            uint32_t sw2 = ss[i * SC * 16 + gl * 8];
                            float slo = __uint_as_float(sw2 << 16), shi = __uint_as_float(sw2 & 0xFFFF0000u);
#pragma unroll
                            for (int j = 0; j < MT8; j++) {
                                acc[i][j][0] = fmaf(tmp[i][j][0], slo, acc[i][j][0]);
                                acc[i][j][1] = fmaf(tmp[i][j][1], slo, acc[i][j][1]);
                                acc[i][j][2] = fmaf(tmp[i][j][2], shi, acc[i][j][2]);
                                acc[i][j][3] = fmaf(tmp[i][j][3], shi, acc[i][j][3]);
#pragma unroll
                                for (int r = 0; r < 4; r++) tmp[i][j][r] = 0.0f;
                            }
                        }
                    }
                }
            }
        }
        cp_async_wait<0>();

        store_tile<MT8, NT, WN, DUAL>(a, acc, slot_tile, row0, rows, nbi, part, smem);
    }
}

/* ---------------------------------------------------------------- MoE helpers */
constexpr int PLAN_THREADS = 512;
constexpr int PLAN_WARPS = PLAN_THREADS / 32;

/* an exclusive scan of two ints per thread over the block (PLAN_THREADS), in thread order,
 * both at once; *total gets the sums. Ends with the block synchronised. */
__device__ __forceinline__ int2 plan_block_scan(int2 v, int2 *warp_sums, int2 *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int2 x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int yx = __shfl_up_sync(0xFFFFFFFFu, x.x, o), yy = __shfl_up_sync(0xFFFFFFFFu, x.y, o);
        if (lane >= o) x.x += yx, x.y += yy;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int2 w = lane < PLAN_WARPS ? warp_sums[lane] : make_int2(0, 0);
        for (int o = 1; o < 32; o <<= 1) {
            const int yx = __shfl_up_sync(0xFFFFFFFFu, w.x, o), yy = __shfl_up_sync(0xFFFFFFFFu, w.y, o);
            if (lane >= o) w.x += yx, w.y += yy;
        }
        if (lane < PLAN_WARPS) warp_sums[lane] = w;   /* inclusive */
    }
    __syncthreads();
    const int2 before = warp > 0 ? warp_sums[warp - 1] : make_int2(0, 0);
    *total = warp_sums[PLAN_WARPS - 1];
    __syncthreads();   /* the block leaves synchronised (see above) */
    return make_int2(x.x - v.x + before.x, x.y - v.y + before.y);
}

/* One block. Entries i = t*top_k + j. Per expert: count, exclusive offsets, and a
 * deterministic slot for each entry (entry order within an expert), the token row of each
 * slot, and the list of token tiles (expert, first slot, rows) of at most bm rows.
 * Ids outside [0, E) get slot -1. Launched early behind the router (programmatic dependent
 * launch: its set-up overlaps the router's tail) and waits for it before reading ids; the
 * gate + up GEMM after it may start early in turn and waits for it.
 * Every thread takes a run of experts for the totals and scans (one warp doing it all took
 * 5.6 us at 384 experts on the H200). */
__global__ void __launch_bounds__(PLAN_THREADS) moe_plan_kernel(const int32_t *__restrict__ ids, int n_entries, int top_k,
                                                                int E, int bm, int *__restrict__ slot_of,
                                                                int *__restrict__ row_token, int4 *__restrict__ tiles,
                                                                int *__restrict__ n_tiles) {
    extern __shared__ int cnt[];          /* [PLAN_WARPS][E] then tot[E], ntile[E] */
    __shared__ int2 warp_sums[PLAN_WARPS];
    int *tot = cnt + PLAN_WARPS * E, *ntile = tot + E;   /* per expert: entries, token tiles */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < PLAN_WARPS * E; i += PLAN_THREADS) cnt[i] = 0;   /* shared memory: before the wait */
    kd_griddep_enter();
    __syncthreads();
    const int per = (n_entries + PLAN_WARPS - 1) / PLAN_WARPS;
    const int beg = warp * per, end = min(n_entries, beg + per);
    for (int i0 = beg; i0 < end; i0 += 32) {
        int i = i0 + lane;
        int e = i < end ? ids[i] : -1;
        if (e < 0 || e >= E) e = -1;
        unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
        if (e >= 0 && lane == __ffs(peers) - 1) cnt[warp * E + e] += __popc(peers);
    }
    __syncthreads();
    /* per expert (a contiguous run of experts per thread, every thread at once): the total,
     * each warp's offset within the expert, and the token tiles; then the exclusive scans of
     * totals and tile counts over experts, in expert order */
    const int seg = (E + PLAN_THREADS - 1) / PLAN_THREADS, e0 = min(E, tid * seg), e1 = min(E, e0 + seg);
    int s = 0, st = 0;
    for (int e = e0; e < e1; e++) {
        int run = 0;
        for (int w = 0; w < PLAN_WARPS; w++) {
            const int c = cnt[w * E + e];
            cnt[w * E + e] = run;
            run += c;
        }
        tot[e] = run;
        ntile[e] = (run + bm - 1) / bm;
        s += run;
        st += ntile[e];
    }
    int2 total;   /* entries, token tiles */
    const int2 start = plan_block_scan(make_int2(s, st), warp_sums, &total);
    int rs = start.x, rt = start.y;
    if (tid == 0) *n_tiles = total.y;
    for (int e = e0; e < e1; e++) {
        const int n = tot[e], nt = ntile[e];
        for (int r = 0; r < nt; r++) tiles[rt + r] = make_int4(e, rs + r * bm, min(bm, n - r * bm), 0);
        for (int w = 0; w < PLAN_WARPS; w++) cnt[w * E + e] += rs;
        rs += n;
        rt += nt;
    }
    __syncthreads();
    for (int i0 = beg; i0 < end; i0 += 32) {
        int i = i0 + lane;
        int e = i < end ? ids[i] : -1;
        if (e < 0 || e >= E) e = -1;
        unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
        int slot = -1;
        if (e >= 0) {
            slot = cnt[warp * E + e] + __popc(peers & ((1u << lane) - 1u));
            row_token[slot] = i / top_k;
        }
        if (i < end) slot_of[i] = slot;
        __syncwarp();
        if (e >= 0 && lane == __ffs(peers) - 1) cnt[warp * E + e] += __popc(peers);
        __syncwarp();
    }
}

/* out[t, h] = sum_j w[t, j] * y[slot(t, j), h], j in order, fp32; then + shared[t, h] (out's
 * type; NULL: none) as the backend's add op adds it: to the sum rounded to out's type */
__global__ void moe_combine_kernel(const float *__restrict__ y, const int *__restrict__ slot_of,
                                   const float *__restrict__ w, int top_k, int H, int T, const void *shared,
                                   long long ld_shared, void *out, long long ldo, int out_f32) {
    kd_griddep_wait();   /* launched early (programmatic dependent launch) behind the down GEMM */
    kd_griddep_release();   /* the kernel behind it may launch (at one rank, the residual add_rmsnorm) */
    size_t n = (size_t)T * H;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(i / H), h = (int)(i % H);
        float s = 0.0f;
        for (int j0 = 0; j0 < top_k; j0 += 8) {   /* eight entries' loads in flight, then their sums in order */
            float v[8], wj[8];
            bool ok[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int e = t * top_k + j0 + j, sl = j0 + j < top_k ? slot_of[e] : -1;
                ok[j] = sl >= 0;
                v[j] = ok[j] ? y[(size_t)sl * H + h] : 0.0f;
                wj[j] = ok[j] ? w[e] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (ok[j]) s = fmaf(wj[j], v[j], s);
        }
        if (shared) {
            const size_t si = (size_t)t * ld_shared + h;
            s = out_f32 ? s + ((const float *)shared)[si]
                        : __bfloat162float(__float2bfloat16_rn(s)) + __bfloat162float(((const bf16 *)shared)[si]);
        }
        store_out(out, out_f32, (size_t)t * ldo + h, s);
    }
}

/* ---------------------------------------------------------------- configurations */
struct W4Config {
    const char *name;
    int mt8, nt, wn, sc, stages;
    int skinny;   /* 0: the pipelined kernel (the fields above); else w4a16_skinny_kernel (plain
                   * GEMM, M <= 16, where skinny_plan takes it; the fields above are then unused)
                   * with this many warps per block, -1: chosen by shape */
};
/* index = config id; dual (MoE gate+up) kernels use the same MT8 with NT = 2, WN = 4, and the
 * MoE never takes a skinny configuration (it uses config 0) */
const W4Config CONFIGS[] = {
    {"m8_nt2_w4", 1, 2, 4, 2, 3, 0},      {"m8_nt1_w8", 1, 1, 8, 2, 3, 0},      {"m16_nt2_w4", 2, 2, 4, 2, 3, 0},
    {"m16_nt1_w8", 2, 1, 8, 2, 3, 0},     {"m32_nt2_w4", 4, 2, 4, 1, 6, 0},     {"m64_nt2_w4", 8, 2, 4, 1, 4, 0},
    {"skinny", 1, 1, 0, 0, 0, -1},        {"skinny_w2", 1, 1, 0, 0, 0, 2},      {"skinny_w4", 1, 1, 0, 0, 0, 4},
    {"skinny_w8", 1, 1, 0, 0, 0, 8},
};
constexpr int N_CONFIGS = sizeof(CONFIGS) / sizeof(CONFIGS[0]);
int g_force_config = -1;

/* the pipelined configuration for M (also the fallback of a skinny one that does not apply) */
int pipelined_config_for_m(int m) {
    if (m <= 8) return 0;
    if (m <= 16) return 3;
    if (m <= 32) return 4;
    return 5;
}
/* every configuration gives the same bits, so this choice is free to change: the skinny
 * kernel to M = 16 (where skinny_plan takes the launch), the pipelined kernel above */
int config_for(int m) {
    if (g_force_config >= 0 && g_force_config < N_CONFIGS) return g_force_config;
    return m <= 16 ? 6 : pipelined_config_for_m(m);
}


struct Launch {
    KernelFn fn;
    int threads, smem, bm, slots_per_block;
    bool skinny;   /* fn, threads and smem are then set per launch (skinny_plan) */
    int skinny_warps;
};

template <int MT8, int NT, int WN, int SC, int STAGES, bool DUAL>
Launch make_launch(int gshift) {
    Launch l;
    l.fn = gshift == 5 ? w4a16_gemm_kernel<MT8, NT, WN, SC, STAGES, DUAL, 5>
                       : w4a16_gemm_kernel<MT8, NT, WN, SC, STAGES, DUAL, 0>;
    l.threads = WN * 32;
    l.smem = W4Shape<MT8, NT, WN, SC, STAGES>::SMEM;
    l.bm = MT8 * 8;
    l.slots_per_block = DUAL ? WN : WN * NT;   /* output tiles of 16 rows per block */
    l.skinny = false;
    return l;
}

Launch make_skinny(int warps) {
    Launch l = {};
    l.skinny = true;
    l.skinny_warps = warps;   /* <= 0: skinny_plan chooses */
    return l;
}

Launch get_launch(int cfg, bool dual, int gshift) {
    if (!dual && CONFIGS[cfg].skinny) return make_skinny(CONFIGS[cfg].skinny);
    if (dual) {
        switch (CONFIGS[cfg].mt8) {
        case 1: return make_launch<1, 2, 4, 2, 3, true>(gshift);
        case 2: return make_launch<2, 2, 4, 2, 3, true>(gshift);
        case 4: return make_launch<4, 2, 4, 1, 6, true>(gshift);
        default: return make_launch<8, 2, 4, 1, 4, true>(gshift);
        }
    }
    switch (cfg) {
    case 0: return make_launch<1, 2, 4, 2, 3, false>(gshift);
    case 1: return make_launch<1, 1, 8, 2, 3, false>(gshift);
    case 2: return make_launch<2, 2, 4, 2, 3, false>(gshift);
    case 3: return make_launch<2, 1, 8, 2, 3, false>(gshift);
    case 4: return make_launch<4, 2, 4, 1, 6, false>(gshift);
    default: return make_launch<8, 2, 4, 1, 4, false>(gshift);
    }
}
/* the MoE's kernels for a configuration (a skinny one maps to config 0) */
Launch moe_launch(int cfg, bool dual, int gshift) {
    if (CONFIGS[cfg].skinny) cfg = 0;
    return get_launch(cfg, dual, gshift);
}

/* per (kernel, device): the dynamic shared memory limit and the carveout (all shared memory,
 * so several blocks fit per SM) */
pthread_mutex_t g_prep_lock = PTHREAD_MUTEX_INITIALIZER;
kd_status prepare_kernel(KernelFn fn, int smem) {
    static const int MAXK = 256;
    static KernelFn done_fn[MAXK];
    static int done_dev[MAXK];
    static int n_done = 0;
    int dev = 0;
    W4_CUDA(cudaGetDevice(&dev));
    pthread_mutex_lock(&g_prep_lock);
    for (int i = 0; i < n_done; i++)
        if (done_fn[i] == fn && done_dev[i] == dev) {
            pthread_mutex_unlock(&g_prep_lock);
            return KD_OK;
        }
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e == cudaSuccess && n_done < MAXK) {
        done_fn[n_done] = fn;
        done_dev[n_done] = dev;
        n_done++;
    }
    pthread_mutex_unlock(&g_prep_lock);
    if (e != cudaSuccess) return w4_fail(e, "cudaFuncSetAttribute (W4A16 kernel shared memory)", __LINE__);
    return KD_OK;
}

void fill_config(cudaLaunchConfig_t *cfg, cudaLaunchAttribute *attr, int blocks, int threads, int smem, int parts,
                 bool pdl, cudaStream_t st) {
    *cfg = cudaLaunchConfig_t{};
    cfg->gridDim = dim3((unsigned)blocks);
    cfg->blockDim = dim3((unsigned)threads);
    cfg->dynamicSmemBytes = (size_t)smem;
    cfg->stream = st;
    int na = 0;
    if (parts > 1) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = (unsigned)parts;
        attr[na].val.clusterDim.y = 1;
        attr[na].val.clusterDim.z = 1;
        na++;
    }
    if (pdl) {
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na].val.programmaticStreamSerializationAllowed = 1;
        na++;
    }
    cfg->attrs = attr;
    cfg->numAttrs = na;
}

kd_status launch(const Launch &l, int clusters, const W4Args &args, bool pdl, cudaStream_t st) {
    KD_TRY(prepare_kernel(l.fn, l.skinny ? skinny_smem_max() : l.smem));
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[2];
    fill_config(&cfg, attr, clusters * args.parts, l.threads, l.smem, args.parts, pdl, st);
    W4_CUDA(cudaLaunchKernelEx(&cfg, l.fn, args));
    return KD_OK;
}

int log2_of(int g) { int s = 0; while ((1 << s) < g) s++; return s; }
int kc_of(int k) { return (k + CHUNK_K - 1) / CHUNK_K; }
int tiles_of(int n) { return (n + 15) / 16; }
int groups_pad_of(int k, int group) { return (kc_of(k) * CHUNK_K + group - 1) / group; }

/* The fixed split of K: parts (P) and chunks per part (cpp), a function of the shape only.
 * warp_tiles = the 16-row weight tiles one launch streams besides the split (n/16, times
 * top_k for the MoE); P (a power of two, at most MAX_PARTS) brings the launch to `target`
 * warp-tiles (latency hiding at small M), keeping at least two chunks per part. The plain
 * GEMM aims at 1536 (K2.6: 2048 x 7168 -> 8 parts, 7168 x 2048 -> 4), the MoE at 1024 (its
 * expert tiles are many: K2.6 experts take no split; tensor-parallel slices do). */
int g_force_parts = 0;
void split_of(int k, int group, long long warp_tiles, long long target, int *parts, int *cpp) {
    int kc = kc_of(k), unit = group > CHUNK_K ? group / CHUNK_K : 1, units = kc / unit;
    int p = 1, pmax = MAX_PARTS;
    while (p < pmax && warp_tiles * p < target) p *= 2;
    if (g_force_parts > 0) p = g_force_parts < pmax ? g_force_parts : pmax;
    while (p > 1 && units < 2 * p) p /= 2;
    int upp = (units + p - 1) / p;
    *cpp = upp * unit;
    *parts = (kc + *cpp - 1) / *cpp;
}
const long long TARGET_GEMM = 1536, TARGET_MOE = 1024;

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* how many clusters of `parts` blocks fit on the device at once (for the grid-stride MoE grid);
 * an occupancy query is a driver call, so the answer is kept per (kernel, parts, device): the
 * MoE asks twice per layer and step */
int resident_clusters(const Launch &l, int parts) {
    struct Known { KernelFn fn; int parts, dev, n; };
    static Known known[64];
    static int n_known = 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) { cudaGetLastError(); return sm_count() / parts + 1; }
    pthread_mutex_lock(&g_prep_lock);
    for (int i = 0; i < n_known; i++)
        if (known[i].fn == l.fn && known[i].parts == parts && known[i].dev == dev) {
            int n = known[i].n;
            pthread_mutex_unlock(&g_prep_lock);
            return n;
        }
    pthread_mutex_unlock(&g_prep_lock);
    if (prepare_kernel(l.fn, l.smem) != KD_OK) return sm_count() / parts + 1;
    int n = 0;
    if (parts > 1) {
        cudaLaunchConfig_t cfg;
        cudaLaunchAttribute attr[2];
        fill_config(&cfg, attr, parts * 64, l.threads, l.smem, parts, false, 0);
        if (cudaOccupancyMaxActiveClusters(&n, l.fn, &cfg) != cudaSuccess) { cudaGetLastError(); n = 0; }
    } else {
        int per_sm = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, l.fn, l.threads, (size_t)l.smem) != cudaSuccess) {
            cudaGetLastError();
            per_sm = 0;
        }
        n = per_sm * sm_count();
    }
    if (n <= 0) return sm_count() / parts + 1;   /* not kept: the query may succeed next time */
    pthread_mutex_lock(&g_prep_lock);
    if (n_known < 64) known[n_known++] = {l.fn, parts, dev, n};
    pthread_mutex_unlock(&g_prep_lock);
    return n;
}

}  // namespace

/* ================================================================ raw layer */
extern "C" int kd_w4a16_group_supported(int group) { return group == 32 || group == 64 || group == 128; }

extern "C" kd_status kd_w4a16_check(int n, int k, int group, const char *name) {
    if (!name) name = "(unnamed)";
    if (n <= 0 || k <= 0)
        return kd_fail(KD_ERR_ARG, "w4a16: weight '%s': shape [%d, %d] must be positive", name, n, k);
    if (!kd_w4a16_group_supported(group))
        return kd_fail(KD_ERR_UNSUPPORTED, "w4a16: weight '%s': group size %d; the W4A16 kernels take 32, 64 or 128",
                       name, group);
    if (k % group || k % 8)
        return kd_fail(KD_ERR_ARG, "w4a16: weight '%s': group %d and 8 must divide the input dim %d", name, group, k);
    return KD_OK;
}

extern "C" size_t kd_w4a16_codes_bytes(int n, int k) { return (size_t)tiles_of(n) * kc_of(k) * 512; }
extern "C" size_t kd_w4a16_scales_bytes(int n, int k, int group) {
    return (size_t)tiles_of(n) * groups_pad_of(k, group) * 32;
}
extern "C" int kd_w4a16_parts(int n, int k, int group) {
    int p, cpp;
    split_of(k, group, tiles_of(n), TARGET_GEMM, &p, &cpp);
    return p;
}

extern "C" kd_status kd_w4a16_repack(const int32_t *raw_codes, const uint16_t *raw_scales, int n, int k, int group,
                                     void *codes, void *scales, cudaStream_t st) {
    KD_TRY(kd_w4a16_check(n, k, group, "repack"));
    int kc = kc_of(k), nt = tiles_of(n), gp = groups_pad_of(k, group);
    size_t total = (size_t)nt * kc * 32;
    int blocks = (int)((total + 255) / 256);
    if (blocks > 65535 * 16) blocks = 65535 * 16;
    repack_codes_kernel<<<blocks, 256, 0, st>>>((const uint32_t *)raw_codes, n, k, kc, nt, (uint4 *)codes);
    W4_LAUNCH("repack_codes_kernel");
    size_t stotal = (size_t)nt * gp * 8;
    int sblocks = (int)((stotal + 255) / 256);
    if (sblocks > 65535 * 16) sblocks = 65535 * 16;
    repack_scales_kernel<<<sblocks, 256, 0, st>>>(raw_scales, n, k / group, gp, nt, (uint32_t *)scales);
    W4_LAUNCH("repack_scales_kernel");
    return KD_OK;
}

extern "C" void kd_w4a16_force_config(int cfg) { g_force_config = cfg; }
extern "C" void kd_w4a16_force_parts(int parts) { g_force_parts = parts; }
extern "C" int kd_w4a16_n_configs(void) { return N_CONFIGS; }
extern "C" const char *kd_w4a16_config_name(int cfg) {
    return cfg >= 0 && cfg < N_CONFIGS ? CONFIGS[cfg].name : "auto";
}

extern "C" kd_status kd_w4a16_gemm(const void *codes, const void *scales, int n, int k, int group, const void *x,
                                   long long ldx, int m, void *y, long long ldy, int y_f32, int flags,
                                   cudaStream_t st) {
    KD_TRY(kd_w4a16_check(n, k, group, "gemm"));
    if (m < 0 || ldx < k || ldy < n)
        return kd_fail(KD_ERR_ARG, "w4a16 gemm: m %d, ldx %lld (k %d), ldy %lld (n %d)", m, ldx, k, ldy, n);
    if (m == 0) return KD_OK;
    if (!codes || !scales || !x || !y)
        return kd_fail(KD_ERR_ARG, "w4a16 gemm: a NULL pointer (codes %p, scales %p, x %p, y %p)", codes, scales, x, y);
    if (((uintptr_t)x & 15) || (ldx & 7))
        return kd_fail(KD_ERR_ARG, "w4a16 gemm: x rows must be 16-byte aligned (x %p, ldx %lld elements)", x, ldx);
    if (((uintptr_t)codes & 15) || ((uintptr_t)scales & 15))
        return kd_fail(KD_ERR_ARG, "w4a16 gemm: codes/scales must be 16-byte aligned");
    const int gshift = log2_of(group), n_tiles = tiles_of(n), kc = kc_of(k);
    int parts, cpp;
    split_of(k, group, n_tiles, TARGET_GEMM, &parts, &cpp);
    Launch l = get_launch(config_for(m), false, gshift);
    SkinnyPlan sp = {};
    if (l.skinny) {
        if (skinny_plan(l.skinny_warps, m, n_tiles, kc, parts, cpp, gshift, &sp)) {
            l.fn = sp.fn;
            l.threads = sp.threads;
            l.smem = sp.smem;
        } else {
            l = get_launch(pipelined_config_for_m(m), false, gshift);
        }
    }
    W4Args a = {};
    a.x = (const bf16 *)x;
    a.ldx = ldx;
    a.mat.q = (const uint4 *)codes;
    a.mat.s = (const uint32_t *)scales;
    a.n = n; a.k = k; a.kc = kc; a.groups = groups_pad_of(k, group); a.gshift = gshift;
    a.parts = parts; a.cpp = cpp; a.n_tiles = n_tiles;
    a.m = m;
    a.y = y; a.ldy = ldy; a.y_f32 = y_f32;
    if (l.skinny) return launch(l, sp.clusters, a, (flags & KD_W4A16_PDL) != 0, st);
    a.nb = (a.n_tiles + l.slots_per_block - 1) / l.slots_per_block;
    long long items = (long long)((m + l.bm - 1) / l.bm) * a.nb;
    if (items * parts > 0x7fffffffLL) return kd_fail(KD_ERR_ARG, "w4a16 gemm: m %d is too large for one launch", m);
    return launch(l, (int)items, a, (flags & KD_W4A16_PDL) != 0, st);
}

/* ---------------------------------------------------------------- MoE */
namespace {
struct MoeLayout {
    int gshift, tk, tiles_max, parts_gu, cpp_gu, parts_d, cpp_d, nb_gu, nb_d;
    Launch gu, dn;                    /* the gate+up and down kernels of cfg */
    size_t o_slot, o_rowtok, o_tiles, o_ntiles, o_act, o_y, total;
};

int moe_config(const kd_w4a16_moe_shape *s, int T) {
    if (g_force_config >= 0 && g_force_config < N_CONFIGS) return g_force_config;
    long long tk = (long long)T * s->top_k, active = tk < s->n_experts ? tk : s->n_experts;
    long long avg = (tk + active - 1) / (active > 0 ? active : 1);
    if (avg <= 8) return 0;
    if (avg <= 16) return 2;
    if (avg <= 32) return 4;
    return 5;
}

MoeLayout moe_layout(const kd_w4a16_moe_shape *s, int T) {
    MoeLayout L = {};
    const int cfg = moe_config(s, T);
    L.gshift = log2_of(s->group);
    L.gu = moe_launch(cfg, true, L.gshift);
    L.dn = moe_launch(cfg, false, L.gshift);
    L.tk = T * s->top_k;
    L.tiles_max = (L.tk + L.gu.bm - 1) / L.gu.bm + (L.tk < s->n_experts ? L.tk : s->n_experts);
    split_of(s->hidden, s->group, (long long)tiles_of(s->inter) * s->top_k, TARGET_MOE, &L.parts_gu, &L.cpp_gu);
    split_of(s->inter, s->group, (long long)tiles_of(s->hidden) * s->top_k, TARGET_MOE, &L.parts_d, &L.cpp_d);
    L.nb_gu = (tiles_of(s->inter) + L.gu.slots_per_block - 1) / L.gu.slots_per_block;
    L.nb_d = (tiles_of(s->hidden) + L.dn.slots_per_block - 1) / L.dn.slots_per_block;
    size_t o = 0;
    L.o_slot = o; o = align256(o + (size_t)L.tk * 4);
    L.o_rowtok = o; o = align256(o + (size_t)L.tk * 4);
    L.o_tiles = o; o = align256(o + (size_t)L.tiles_max * 16);
    L.o_ntiles = o; o = align256(o + 16);
    L.o_act = o; o = align256(o + (size_t)L.tk * s->inter * 2);
    L.o_y = o; o = align256(o + (size_t)L.tk * s->hidden * 4);
    L.total = o;
    return L;
}
}  // namespace

extern "C" size_t kd_w4a16_moe_ws_bytes(const kd_w4a16_moe_shape *s, int T) {
    if (!s || T <= 0) return 0;
    return moe_layout(s, T).total;
}

extern "C" kd_status kd_w4a16_moe(const kd_w4a16_moe_shape *s, const kd_w4a16_expert *table, const void *x,
                                  long long ldx, int T, const int32_t *ids, const float *weights, const void *shared,
                                  long long ld_shared, cudaEvent_t shared_ready, void *out, long long ldo, int out_f32,
                                  void *ws, size_t ws_bytes, cudaStream_t st) {
    if (!s) return kd_fail(KD_ERR_ARG, "w4a16 moe: no shape");
    if (s->n_experts <= 0 || s->top_k <= 0 || s->top_k > s->n_experts)
        return kd_fail(KD_ERR_ARG, "w4a16 moe: %d experts, top_k %d", s->n_experts, s->top_k);
    KD_TRY(kd_w4a16_check(s->inter, s->hidden, s->group, "moe gate/up"));
    KD_TRY(kd_w4a16_check(s->hidden, s->inter, s->group, "moe down"));
    if (T < 0 || ldx < s->hidden || ldo < s->hidden || (shared && ld_shared < s->hidden))
        return kd_fail(KD_ERR_ARG, "w4a16 moe: T %d, ldx %lld, ldo %lld, ld_shared %lld (hidden %d)", T, ldx, ldo,
                       shared ? ld_shared : 0LL, s->hidden);
    if (T == 0) return KD_OK;
    if (!table || !x || !ids || !weights || !out || !ws)
        return kd_fail(KD_ERR_ARG, "w4a16 moe: a NULL pointer (table, x, ids, weights, out or workspace)");
    if (((uintptr_t)x & 15) || (ldx & 7))
        return kd_fail(KD_ERR_ARG, "w4a16 moe: x rows must be 16-byte aligned (x %p, ldx %lld elements)", x, ldx);
    size_t plan_smem = (size_t)(PLAN_WARPS + 2) * s->n_experts * sizeof(int);
    if (plan_smem > 200 * 1024)
        return kd_fail(KD_ERR_UNSUPPORTED, "w4a16 moe: %d experts is more than the grouping kernel holds", s->n_experts);
    MoeLayout L = moe_layout(s, T);
    if (ws_bytes < L.total)
        return kd_fail(KD_ERR_ARG, "w4a16 moe: workspace of %zu bytes, need %zu (T %d)", ws_bytes, L.total, T);
    char *b = (char *)ws;
    int *slot_of = (int *)(b + L.o_slot), *row_tok = (int *)(b + L.o_rowtok), *n_tiles = (int *)(b + L.o_ntiles);
    int4 *tiles = (int4 *)(b + L.o_tiles);
    bf16 *act = (bf16 *)(b + L.o_act);
    float *yv = (float *)(b + L.o_y);

    const Launch &gu = L.gu, &dn = L.dn;
    if (plan_smem > 48 * 1024)
        W4_CUDA(cudaFuncSetAttribute(moe_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan_smem));
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[2];
    fill_config(&cfg, attr, 1, PLAN_THREADS, (int)plan_smem, 1, true, st);
    W4_CUDA(cudaLaunchKernelEx(&cfg, moe_plan_kernel, ids, L.tk, s->top_k, s->n_experts, gu.bm, slot_of, row_tok, tiles,
                               n_tiles));

    /* gate + up and the combine are launched with programmatic dependent launch: each waits
     * for the kernel before it (griddepcontrol.wait) before its first read, so its launch and
     * block set-up overlap that kernel's tail (H200, K2.6 MoE: T = 1 72.2 -> 68.8 us with the
     * plan and combine changes of the same commit, T = 4 226 -> 222 us). The down GEMM is,
     * when gate + up does its items in one pass (every block one item: T = 1 at K2.6 dims);
     * it then reads the tile list and streams its first weights before its wait (gate + up
     * releases it only after waiting for the plan). When gate + up's blocks loop over items,
     * down's blocks launched early took the SM slots gate + up's blocks left and T = 4 ran 4%
     * slower. */

    /* gate + up, fused SwiGLU: act[slot] = silu(x W_gate^T) * (x W_up^T), bf16 */
    W4Args a = {};
    a.x = (const bf16 *)x;
    a.ldx = ldx;
    a.row_map = row_tok;
    a.table = table;
    a.n = s->inter; a.k = s->hidden; a.kc = kc_of(s->hidden); a.groups = groups_pad_of(s->hidden, s->group);
    a.gshift = L.gshift;
    a.parts = L.parts_gu; a.cpp = L.cpp_gu; a.n_tiles = tiles_of(s->inter); a.nb = L.nb_gu;
    a.tiles = tiles; a.n_tiles_dev = n_tiles;
    a.y = act; a.ldy = s->inter; a.y_f32 = 0;
    long long items = (long long)L.tiles_max * a.nb;
    int grid = resident_clusters(gu, a.parts);
    if (items < grid) grid = (int)items;
    const bool gu_one_pass = items <= grid;
    KD_TRY(launch(gu, grid, a, true, st));

    /* down: y[slot] = act[slot] W_down^T, f32 */
    W4Args d = {};
    d.x = act;
    d.ldx = s->inter;
    d.row_map = nullptr;
    d.table = table;
    d.n = s->hidden; d.k = s->inter; d.kc = kc_of(s->inter); d.groups = groups_pad_of(s->inter, s->group);
    d.gshift = L.gshift;
    d.parts = L.parts_d; d.cpp = L.cpp_d; d.n_tiles = tiles_of(s->hidden); d.nb = L.nb_d;
    d.tiles = tiles; d.n_tiles_dev = n_tiles; d.tiles_ready = gu_one_pass;
    d.y = yv; d.ldy = s->hidden; d.y_f32 = 1;
    items = (long long)L.tiles_max * d.nb;
    grid = resident_clusters(dn, d.parts);
    if (items < grid) grid = (int)items;
    KD_TRY(launch(dn, grid, d, gu_one_pass, st));

    if (shared_ready) W4_CUDA(cudaStreamWaitEvent(st, shared_ready, 0));
    size_t n = (size_t)T * s->hidden;
    int cblocks = (int)((n + 255) / 256);
    const int sms = sm_count();
    if (cblocks > sms * 16) cblocks = sms * 16;
    fill_config(&cfg, attr, cblocks, 256, 0, 1, true, st);
    W4_CUDA(cudaLaunchKernelEx(&cfg, moe_combine_kernel, (const float *)yv, (const int *)slot_of, weights, s->top_k,
                               s->hidden, T, shared, ld_shared, out, ldo, out_f32));
    return KD_OK;
}
