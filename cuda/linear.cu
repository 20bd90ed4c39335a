/* linear.cu: the dense bf16 GEMM of the CUDA backend (linear, head_matmul, bf16 experts).
 *
 * Why our own kernel and not cuBLAS: cuBLAS picks its algorithm (tile shape, split-K)
 * from M, so the same token row can get different bits in a batch of 1 and a batch of
 * 37. Here every output element is computed by the same sequence of tensor-core MMAs
 * (mma.sync m16n8k16, bf16 in, fp32 accumulate) over k in a fixed order, and neither the
 * row's position in its tile nor the tile's height (16, 64 or 128 rows, by M) changes
 * anything (an MMA row depends only on that row of A). Split-K, used to give small-M
 * launches enough blocks, is chosen from (N, K, batch, SM count) only, never from M, and
 * its partial sums are added in split order by a second kernel. So a row's result is
 * bit-identical for any M.
 *
 * Loads: cp.async 16-byte copies through a 3- or 4-stage shared-memory pipeline when the
 * operands are 16-byte aligned; otherwise (odd leading dims, f32 activations) plain
 * loads into the same shared tiles, so both paths feed identical MMAs.
 */
#include "cuda_internal.cuh"
#include "mla_mma.cuh"   /* cp16 / cp_commit / cp_wait, mma16816 */

namespace {
using mla::cp16;
using mla::cp_commit;
using mla::cp_wait;
using mla::mma16816;

/* BM: rows of A per block, 64; 16 where M <= 16 (a quarter of the mma and of the A tile,
 * and more blocks per SM); 128 where M > 64 (each warp 64 x 32: 16 mma per 8 fragment loads
 * where 32 x 32 makes 8 per 6, and each B tile feeds twice the rows). The bits are the same,
 * see the top. BK: the k-tile, the unit of
 * split-K. A pipeline stage holds KS = 2 k-tiles, so it reads 128 contiguous bytes of each
 * weight row, not 64 (H200, the lm_head at M = 1 944 -> 606 us, at M = 64 1167 -> 923); the
 * k16 steps are the same, in the same order, so the bits are too. */
constexpr int BM = 64, BM_SMALL = 16, BM_LARGE = 128, BN = 64, BK = 32, KS = 2 * BK, KT_PS = KS / BK, THREADS = 128;
constexpr int LD = KS + 8;          /* smem row stride (bf16) of A and of B [n][k]: conflict-free fragment loads */
constexpr int BN_LD = BN + 8;       /* B stored [k][n] (ldmatrix.trans) */
constexpr int B_STAGE = BN * LD > KS * BN_LD ? BN * LD : KS * BN_LD;
/* pipeline stages: 4, or 3 at TBM = 128 (four would take 111 KB, over sm_120's 99 KB a block);
 * dynamic shared memory of a block: the stages of A (TBM rows) and B (46 KB at TBM = 16, 74 KB
 * at 64, 83 KB at 128) */
__host__ __device__ constexpr int gemm_stages(int tbm) { return tbm == BM_LARGE ? 3 : 4; }
__host__ __device__ constexpr size_t gemm_smem(int tbm) {
    return (size_t)gemm_stages(tbm) * (tbm * LD + B_STAGE) * sizeof(bf16);
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t *r, const void *smem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(s));
}

struct Tile {
    int z, m0, n0, row_base, rows;   /* rows: valid rows of this z (grouped) or M */
};

/* The cp.async path (bf16 A, 16-byte aligned operands, K % 8 == 0). Each thread's 16-byte
 * pieces of a stage are the same rows and columns in every stage, so their source pointers,
 * predicates and shared-memory offsets are worked out once per block and a stage only adds
 * k0 (recomputed per piece, they cost about 550 instructions a warp per k-tile of 4 mma at
 * M <= 16; about 115 once hoisted, sm_90 SASS with one k-tile a stage). */
template <int TBM, bool BKM>
struct AsyncLoads {
    static constexpr int A_PIECES = TBM * (KS / 8), B_PIECES = BN * KS / 8;
    static constexpr int A_PT = (A_PIECES + THREADS - 1) / THREADS, B_PT = B_PIECES / THREADS;
    static_assert(B_PIECES % THREADS == 0, "every thread loads the same number of B pieces");
    const bf16 *a_src[A_PT], *b_src[B_PT];
    int a_dst[A_PT], a_kc[A_PT], b_dst[B_PT], b_kc[B_PT];
    bool a_ok[A_PT], b_ok[B_PT];
    const bf16 *a_none, *b_none;   /* the (unread) source of a zero-filled piece */
    long long b_step;              /* B elements per unit of k0 (k-major: 1) */

    __device__ __forceinline__ void init(const kd_gemm_args &g, const Tile &t, const bf16 *Bz, const char *Az) {
        const int tid = threadIdx.x;
        a_none = (const bf16 *)g.A;
        b_none = Bz;
#pragma unroll
        for (int j = 0; j < A_PT; j++) {
            const int c = tid + j * THREADS, r = c / (KS / 8), kc = (c % (KS / 8)) * 8;
            const int m = t.m0 + r;
            a_ok[j] = c < A_PIECES && m < t.rows;
            long long src_row = 0;
            if (a_ok[j]) {
                const int gi = t.row_base + m;
                src_row = g.a_rows ? (long long)g.a_rows[gi] : (long long)gi;
            }
            a_src[j] = (const bf16 *)Az + src_row * g.lda + kc;
            a_dst[j] = r * LD + kc;
            a_kc[j] = kc;
        }
#pragma unroll
        for (int j = 0; j < B_PT; j++) {
            const int c = tid + j * THREADS;
            if (BKM) {   /* B [n][k]: BN rows x KS cols */
                const int r = c / (KS / 8), kc = (c % (KS / 8)) * 8, n = t.n0 + r;
                b_ok[j] = n < g.N;
                b_src[j] = Bz + (long long)(b_ok[j] ? n : 0) * g.ldb + kc;
                b_dst[j] = r * LD + kc;
                b_kc[j] = kc;
            } else {     /* B [k][n]: KS rows x BN cols */
                const int r = c / (BN / 8), nc = (c % (BN / 8)) * 8, n = t.n0 + nc;
                b_ok[j] = n < g.N;
                b_src[j] = Bz + (long long)r * g.ldb + (b_ok[j] ? n : 0);
                b_dst[j] = r * BN_LD + nc;
                b_kc[j] = r;
            }
        }
        b_step = BKM ? 1 : g.ldb;
    }
    /* the stage starting at k0 into the buffers As, Bs; k from kend on is zero-filled (past K,
     * or past the split's last k-tile: never multiplied) */
    __device__ __forceinline__ void load(bf16 *As, bf16 *Bs, int k0, int kend) const {
#pragma unroll
        for (int j = 0; j < A_PT; j++) {
            const bool v = a_ok[j] && k0 + a_kc[j] < kend;
            if (A_PIECES % THREADS == 0 || threadIdx.x + j * THREADS < A_PIECES)
                cp16(As + a_dst[j], v ? (const void *)(a_src[j] + k0) : (const void *)a_none, v);
        }
        const long long boff = (long long)k0 * b_step;
#pragma unroll
        for (int j = 0; j < B_PT; j++) {
            const bool v = b_ok[j] && k0 + b_kc[j] < kend;
            cp16(Bs + b_dst[j], v ? (const void *)(b_src[j] + boff) : (const void *)b_none, v);
        }
    }
};

/* The plain-load path (f32 activations, odd leading dims): the stage of KS k at k0 of A (TBM
 * rows) and B into the same shared tiles, so both paths feed identical MMAs. */
template <int TBM, bool BKM>
__device__ __forceinline__ void load_tile_plain(const kd_gemm_args &g, const Tile &t, bf16 *As, bf16 *Bs, int k0,
                                                const bf16 *Bz, const char *Az) {
    const int tid = threadIdx.x;
    /* A: TBM rows x KS cols, in chunks of 8 */
    for (int c = tid; c < TBM * (KS / 8); c += THREADS) {
        int r = c / (KS / 8), kc = (c % (KS / 8)) * 8;
        int m = t.m0 + r, k = k0 + kc;
        bool ok = m < t.rows;
        long long src_row = 0;
        if (ok) {
            int gi = t.row_base + m;
            src_row = g.a_rows ? (long long)g.a_rows[gi] : (long long)gi;
        }
        bf16 *dst = As + r * LD + kc;
        for (int i = 0; i < 8; i++) {
            float v = 0.0f;
            if (ok && k + i < g.K) {
                size_t idx = (size_t)(src_row * g.lda + k + i);
                v = g.a_dtype == KD_F32 ? ((const float *)Az)[idx] : __bfloat162float(((const bf16 *)Az)[idx]);
            }
            dst[i] = __float2bfloat16(v);
        }
    }
    if (BKM) {   /* B [n][k]: BN rows x KS cols */
        for (int c = tid; c < BN * (KS / 8); c += THREADS) {
            int r = c / (KS / 8), kc = (c % (KS / 8)) * 8;
            int n = t.n0 + r, k = k0 + kc;
            bf16 *dst = Bs + r * LD + kc;
            bool ok = n < g.N;
            for (int i = 0; i < 8; i++)
                dst[i] = (ok && k + i < g.K) ? Bz[(long long)n * g.ldb + k + i] : __float2bfloat16(0.0f);
        }
    } else {     /* B [k][n]: KS rows x BN cols */
        for (int c = tid; c < KS * (BN / 8); c += THREADS) {
            int r = c / (BN / 8), nc = (c % (BN / 8)) * 8;
            int k = k0 + r, n = t.n0 + nc;
            bf16 *dst = Bs + r * BN_LD + nc;
            bool ok = k < g.K;
            for (int i = 0; i < 8; i++)
                dst[i] = (ok && n + i < g.N) ? Bz[(long long)k * g.ldb + n + i] : __float2bfloat16(0.0f);
        }
    }
}

/* grid: x = m tiles of TBM rows, y = n_tiles * splits, z = batch (or expert). The m tiles vary
 * fastest so that the blocks sharing a strip of B run together and read it from HBM once (with
 * the n tiles fastest, M = 256 read a 2.35 GB lm_head four times). Warps: 2 x 2 of 64 x 32
 * (TBM = 128) or of 32 x 32 (TBM = 64), or 1 x 4 of 16 x 16 (TBM = 16). */
template <int TBM, bool ASYNC, bool BKM>
__global__ void __launch_bounds__(THREADS) gemm_kernel(kd_gemm_args g, int n_tiles, int splits,
                                                       int kts_per_split, float *partial) {
    static_assert(TBM == BM_LARGE || TBM == BM || TBM == BM_SMALL, "the warp layout below covers these three");
    constexpr int MI = TBM == BM_SMALL ? 1 : TBM / 32, NI = TBM == BM_SMALL ? 2 : 4;   /* m16 / n8 fragments a warp */
    extern __shared__ __align__(16) unsigned char gemm_smem_buf[];
    constexpr int STAGES = gemm_stages(TBM);
    bf16 *const As0 = (bf16 *)gemm_smem_buf, *const Bs0 = As0 + STAGES * TBM * LD;

    Tile t;
    t.z = blockIdx.z;
    int nt = blockIdx.y % n_tiles, split = blockIdx.y / n_tiles;
    t.n0 = nt * BN;
    t.m0 = blockIdx.x * TBM;
    if (g.row_off) {
        t.row_base = g.row_off[t.z];
        t.rows = g.row_off[t.z + 1] - t.row_base;
    } else {
        t.row_base = 0;
        t.rows = g.M;
    }
    if (t.m0 >= t.rows) return;
    const bf16 *Bz = g.b_ptrs ? g.b_ptrs[t.z] : g.B + (long long)t.z * g.b_zstride;
    const char *Az = (const char *)g.A +
                     (size_t)((long long)t.z * g.a_zstride) * (g.a_dtype == KD_F32 ? 4 : 2);

    const int kt_total = (g.K + BK - 1) / BK;
    const int kt0 = split * kts_per_split;
    const int kt1 = min(kt_total, kt0 + kts_per_split);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = TBM == BM_SMALL ? 0 : (warp >> 1) * (TBM / 2), wn = TBM == BM_SMALL ? warp * 16 : (warp & 1) * 32;
    const int gq = lane >> 2, tq = lane & 3;

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.0f;

    /* stages of KT_PS k-tiles over [kt0, kt1); the split's last stage may hold fewer */
    const int kend = min(g.K, kt1 * BK), n_stages = (kt1 - kt0 + KT_PS - 1) / KT_PS;
    AsyncLoads<TBM, BKM> loads;
    if (ASYNC) loads.init(g, t, Bz, Az);
    auto load_stage = [&](int st) {
        const int buf = st % STAGES, k0 = (kt0 + st * KT_PS) * BK;
        bf16 *as = As0 + buf * TBM * LD, *bs = Bs0 + buf * B_STAGE;
        if (ASYNC) loads.load(as, bs, k0, kend);
        else load_tile_plain<TBM, BKM>(g, t, as, bs, k0, Bz, Az);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < n_stages) load_stage(s);
        if (ASYNC) cp_commit();
    }
    for (int st = 0; st < n_stages; st++) {
        if (ASYNC) cp_wait<STAGES - 2>();
        __syncthreads();
        if (st + STAGES - 1 < n_stages) load_stage(st + STAGES - 1);
        if (ASYNC) cp_commit();
        const bf16 *as = As0 + (st % STAGES) * TBM * LD;
        const bf16 *bs = Bs0 + (st % STAGES) * B_STAGE;
        const int ks_valid = min(KS, (kt1 - kt0 - st * KT_PS) * BK);   /* whole k-tiles of the split */
#pragma unroll
        for (int kk = 0; kk < KS; kk += 16) {
            if (kk >= ks_valid) break;
            uint32_t af[MI][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                const bf16 *p = as + (wm + mi * 16 + gq) * LD + kk + 2 * tq;
                af[mi][0] = *(const uint32_t *)(p);
                af[mi][1] = *(const uint32_t *)(p + 8 * LD);
                af[mi][2] = *(const uint32_t *)(p + 8);
                af[mi][3] = *(const uint32_t *)(p + 8 * LD + 8);
            }
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
                if (BKM) {
                    const bf16 *p = bs + (wn + ni * 8 + gq) * LD + kk + 2 * tq;
                    bfr[ni][0] = *(const uint32_t *)(p);
                    bfr[ni][1] = *(const uint32_t *)(p + 8);
                } else {
                    ldmatrix_x2_trans(bfr[ni], bs + (kk + (lane & 15)) * BN_LD + wn + ni * 8);
                }
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) mma16816(acc[mi][ni], af[mi], bfr[ni]);
        }
    }
    if (ASYNC) cp_wait<0>();

    /* epilogue: fragment c0,c1 -> row gq, cols 2tq,2tq+1; c2,c3 -> row gq+8 */
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int m = t.m0 + wm + mi * 16 + gq + h * 8;
                if (m >= t.rows) continue;
                int out_row = t.row_base + m;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int n = t.n0 + wn + ni * 8 + 2 * tq + e;
                    if (n >= g.N) continue;
                    float v = acc[mi][ni][h * 2 + e];
                    if (splits > 1) {
                        partial[(((size_t)split * g.batch + t.z) * g.M + out_row) * g.N + n] = v;
                    } else {
                        size_t idx = (size_t)((long long)t.z * g.c_zstride + (long long)out_row * g.ldc + n);
                        kd_st(g.C, g.c_dtype, idx, v);
                    }
                }
            }
}

/* C = sum over splits in split order */
__global__ void gemm_reduce_kernel(kd_gemm_args g, int splits, const float *partial) {
    size_t total = (size_t)g.batch * g.M * g.N;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        int n = (int)(i % g.N);
        size_t r = i / g.N;
        int m = (int)(r % g.M), z = (int)(r / g.M);
        float s = 0.0f;
        for (int sp = 0; sp < splits; sp++) s += partial[(size_t)sp * total + i];
        kd_st(g.C, g.c_dtype, (size_t)((long long)z * g.c_zstride + (long long)m * g.ldc + n), s);
    }
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

template <int TBM>
kd_status launch_gemm(kd_cuda *c, bool async, bool kmajor, dim3 grid, const kd_gemm_args &s, int n_tiles, int splits,
                      int kts, float *partial) {
    void (*fn)(kd_gemm_args, int, int, int, float *) =
        async ? (kmajor ? gemm_kernel<TBM, true, true> : gemm_kernel<TBM, true, false>)
              : (kmajor ? gemm_kernel<TBM, false, true> : gemm_kernel<TBM, false, false>);
    const size_t smem = gemm_smem(TBM);
    KD_TRY(kd_cuda_smem(c, (const void *)fn, smem));
    fn<<<grid, THREADS, smem, c->stream>>>(s, n_tiles, splits, kts, partial);
    return KD_OK;
}

}  // namespace

/* Split-K choice: from N, K, batch and the SM count only (never M, see top). */
static int gemm_splits(const kd_cuda *c, const kd_gemm_args *g, int *kts_per_split) {
    int kt_total = (g->K + BK - 1) / BK;
    int blocks = ((g->N + BN - 1) / BN) * g->batch;
    int target = 3 * c->n_sms;
    int splits = 1;
    if (!g->row_off && blocks < target) {
        splits = (target + blocks - 1) / blocks;
        int max_splits = kt_total / 4 > 0 ? kt_total / 4 : 1;   /* >= 4 k-tiles per split */
        if (splits > max_splits) splits = max_splits;
        if (splits > 32) splits = 32;
        if (splits < 1) splits = 1;
    }
    int per = (kt_total + splits - 1) / splits;
    if (per < 1) per = 1;
    *kts_per_split = per;
    return (kt_total + per - 1) / per;
}

kd_status kd_cuda_gemm(kd_backend *be, const kd_gemm_args *g0) {
    kd_cuda *c = kd_cuda_of(be);
    kd_gemm_args g = *g0;
    if (g.M <= 0 || g.N <= 0 || g.batch <= 0) return KD_OK;
    if (g.K <= 0) return kd_fail(KD_ERR_ARG, "cuda gemm: K must be positive, got %d", g.K);
    int kts;
    int splits = gemm_splits(c, &g, &kts);
    int n_tiles = (g.N + BN - 1) / BN;

    bool async = g.a_dtype == KD_BF16 && g.K % 8 == 0 && g.lda % 8 == 0 && g.ldb % 8 == 0 &&
                 g.a_zstride % 8 == 0 && g.b_zstride % 8 == 0 && aligned16(g.A) &&
                 (g.b_ptrs || aligned16(g.B)) && (g.b_kmajor || g.N % 8 == 0);
    /* grouped weights: their pointers are checked at experts_load (16-byte aligned allocations) */

    /* split-K partials: bound the workspace by running M in chunks (rows are independent) */
    int m_chunk = g.M;
    float *partial = NULL;
    if (splits > 1) {
        size_t per_row = (size_t)splits * g.batch * g.N * sizeof(float);
        size_t cap = (size_t)256 << 20;
        m_chunk = (int)(cap / per_row);
        if (m_chunk < BM) m_chunk = BM;
        if (m_chunk > g.M) m_chunk = g.M;
        void *ws;
        KD_TRY(kd_cuda_ws(be, KD_WS_GEMM, per_row * m_chunk, &ws));
        partial = (float *)ws;
    }
    size_t asz = g.a_dtype == KD_F32 ? 4 : 2, csz = kd_dtype_size((kd_dtype)g.c_dtype);
    for (int m0 = 0; m0 < g.M; m0 += m_chunk) {
        kd_gemm_args s = g;
        s.M = g.M - m0 < m_chunk ? g.M - m0 : m_chunk;
        if (!g.row_off) {
            s.A = (const char *)g.A + (size_t)m0 * g.lda * asz;
            s.C = (char *)g.C + (size_t)m0 * g.ldc * csz;
        }
        bool async_s = async && aligned16(s.A);
        /* rows per block: 16 when M is at most 16, 64 up to 64, else 128 (grouped launches: no
         * group has more rows than M) */
        const int tbm = s.M <= BM_SMALL ? BM_SMALL : s.M <= BM ? BM : BM_LARGE;
        dim3 grid((s.M + tbm - 1) / tbm, n_tiles * splits, s.batch);
        if (grid.y > 65535 || grid.z > 65535)
            return kd_fail(KD_ERR_ARG, "cuda gemm: grid too large (N=%d: %d column tiles x %d splits, batch=%d; at most 65535 each)",
                           s.N, n_tiles, splits, s.batch);
        if (tbm == BM_SMALL) KD_TRY(launch_gemm<BM_SMALL>(c, async_s, g.b_kmajor, grid, s, n_tiles, splits, kts, partial));
        else if (tbm == BM) KD_TRY(launch_gemm<BM>(c, async_s, g.b_kmajor, grid, s, n_tiles, splits, kts, partial));
        else KD_TRY(launch_gemm<BM_LARGE>(c, async_s, g.b_kmajor, grid, s, n_tiles, splits, kts, partial));
        KD_CUDA_LAUNCH("gemm_kernel");
        if (splits > 1) {
            size_t total = (size_t)s.batch * s.M * s.N;
            int blocks = (int)((total + 255) / 256);
            if (blocks > 8 * c->n_sms) blocks = 8 * c->n_sms;
            gemm_reduce_kernel<<<blocks, 256, 0, c->stream>>>(s, splits, partial);
            KD_CUDA_LAUNCH("gemm_reduce_kernel");
        }
    }
    return KD_OK;
}

/* ---- fp32 weights: a plain CUDA-core product, one warp per output, fixed order ---- */
__global__ void linear_f32w_kernel(const void *x, int xdt, long long ldx, const float *w, long long ldw,
                                   void *out, int odt, long long ldo, int M, int N, int K) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (warp >= M * N) return;
    int m = warp / N, n = warp % N;
    float s = 0.0f;
    for (int k = lane; k < K; k += 32) s += kd_ld(x, xdt, (size_t)m * ldx + k) * w[(size_t)n * ldw + k];
    s = kd_warp_sum(s);
    if (lane == 0) kd_st(out, odt, (size_t)m * ldo + n, s);
}

extern "C" kd_status kd_cuda_linear(kd_backend *be, kd_act x, const kd_weight *w, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    const char *name = w && w->name ? w->name : "?";
    if (!w || !w->dev) return kd_fail(KD_ERR_STATE, "cuda linear: weight '%s' is not loaded on the device", name);
    if (x.cols != w->cols || out.cols != w->rows || x.rows != out.rows)
        return kd_fail(KD_ERR_ARG, "cuda linear: weight '%s' [%lld, %lld]: x is [%d, %d], out is [%d, %d]; expected "
                       "x [M, %lld] and out [M, %lld]", name, (long long)w->rows, (long long)w->cols, x.rows, x.cols,
                       out.rows, out.cols, (long long)w->cols, (long long)w->rows);
    if (!kd_cuda_float_dtype(x.dtype) || !kd_cuda_float_dtype(out.dtype))
        return kd_fail(KD_ERR_ARG, "cuda linear '%s': activations must be f32/bf16/f16, got %s -> %s", name,
                       kd_dtype_name(x.dtype), kd_dtype_name(out.dtype));
    if (x.rows == 0) return KD_OK;
    if (w->format == KD_W_INT4) {
#if KD_HAVE_W4A16
        return kd_cuda_w4a16_linear(be, x, w, out);
#else
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda linear: INT4 weight '%s': this build has no W4A16 kernels", name);
#endif
    }
    if (w->format == KD_W_F32) {
        long long warps = (long long)x.rows * w->rows;
        int blocks = (int)((warps * 32 + 255) / 256);
        linear_f32w_kernel<<<blocks, 256, 0, c->stream>>>(x.data, x.dtype, x.ld, (const float *)w->dev, w->cols,
                                                          out.data, out.dtype, out.ld, x.rows, (int)w->rows, (int)w->cols);
        KD_CUDA_LAUNCH("linear_f32w_kernel");
        return KD_OK;
    }
    if (x.dtype == KD_F16) return kd_fail(KD_ERR_ARG, "cuda linear '%s': f16 activations are not supported", name);
    kd_gemm_args g = {};
    g.A = x.data; g.a_dtype = x.dtype; g.lda = x.ld;
    g.B = (const bf16 *)w->dev; g.ldb = w->cols; g.b_kmajor = true;
    g.C = out.data; g.c_dtype = out.dtype; g.ldc = out.ld;
    g.M = x.rows; g.N = (int)w->rows; g.K = (int)w->cols; g.batch = 1;
    return kd_cuda_gemm(be, &g);
}

extern "C" kd_status kd_cuda_head_matmul(kd_backend *be, kd_act x, int n_heads, int xstride, int k,
                                         const kd_weight *w, int wstride, int wrow0, bool transposed,
                                         kd_act out, int ocols) {
    const char *name = w && w->name ? w->name : "?";
    if (!w || !w->dev) return kd_fail(KD_ERR_STATE, "cuda head_matmul: weight '%s' is not loaded", name);
    if (w->format != KD_W_BF16)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda head_matmul: weight '%s' must be bf16 (got format %d)", name, (int)w->format);
    if (n_heads <= 0 || k <= 0 || ocols <= 0)
        return kd_fail(KD_ERR_ARG, "cuda head_matmul '%s': heads %d, k %d, ocols %d must be positive", name, n_heads, k, ocols);
    if ((long long)(n_heads - 1) * xstride + k > x.cols || (long long)n_heads * ocols > out.cols || x.rows != out.rows)
        return kd_fail(KD_ERR_ARG, "cuda head_matmul '%s': x [%d, %d] / out [%d, %d] too small for %d heads (xstride %d, "
                       "k %d, ocols %d)", name, x.rows, x.cols, out.rows, out.cols, n_heads, xstride, k, ocols);
    long long last_row = (long long)(n_heads - 1) * wstride + wrow0 + (transposed ? ocols : k);
    if (last_row > w->rows || (transposed ? k > w->cols : ocols > w->cols))
        return kd_fail(KD_ERR_ARG, "cuda head_matmul '%s' [%lld, %lld]: heads need rows up to %lld and %d cols", name,
                       (long long)w->rows, (long long)w->cols, last_row, transposed ? k : ocols);
    if (x.dtype == KD_F16) return kd_fail(KD_ERR_ARG, "cuda head_matmul '%s': f16 activations are not supported", name);
    if (x.rows == 0) return KD_OK;
    kd_gemm_args g = {};
    g.A = x.data; g.a_dtype = x.dtype; g.lda = x.ld; g.a_zstride = xstride;
    g.B = (const bf16 *)w->dev + (size_t)wrow0 * w->cols; g.ldb = w->cols;
    g.b_zstride = (long long)wstride * w->cols; g.b_kmajor = transposed;
    g.C = out.data; g.c_dtype = out.dtype; g.ldc = out.ld; g.c_zstride = ocols;
    g.M = x.rows; g.N = ocols; g.K = k; g.batch = n_heads;
    return kd_cuda_gemm(be, &g);
}
