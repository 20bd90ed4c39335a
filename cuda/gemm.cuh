/* gemm.cuh: the dense GEMM's kernel (device side; the launch, split-K choice and ops are in
 * linear.cu, whose top comment says why the bits do not depend on M). Included by linear.cu after
 * cuda_internal.cuh and mla_mma.cuh; also compiled on the CPU by scripts/bench/gemm_emu/ against
 * the SIMT emulation of those two headers. */
#ifndef KD_GEMM_CUH
#define KD_GEMM_CUH

namespace gemm {
using mla::cp16;
using mla::cp_commit;
using mla::cp_wait;
using mla::ldsm_x4;
using mla::ldsm_x4_trans;
using mla::mma16816;

/* Block shapes, by the rows of A a block takes (TBM, from M: linear.cu): 16 where M <= 16 (a
 * quarter of the mma and of the A tile, more blocks per SM), 64 up to 64, 128 above. TBM = 128
 * takes 128 columns of B too, and its 4 warps 64 x 64 each: a k16 step loads 4 A and 4 B
 * fragments by ldmatrix for 32 mma (2 KB + 2 KB of shared memory, 128 bytes an mma), and a block
 * reads its rows of A once for 128 columns, not 64 (H100, the lm_head at M = 256: 2815 -> 2421 us,
 * 35% -> 41% of cuBLAS's rate). BK: the k-tile, the unit of split-K. A pipeline stage holds KS of
 * k: 2 k-tiles at TBM <= 64, so it reads 128 contiguous bytes of each weight row, not 64 (H200, the
 * lm_head at M = 1 944 -> 606 us, at M = 64 1167 -> 923); 1 at TBM = 128, so 4 stages fit sm_120's
 * 99 KB. None of this changes an output element's k16 steps or their order, so the bits are the
 * same for every shape (see linear.cu's top). At M = 256 the kernel is bound by the traffic between
 * L2 and the SMs (ncu, H100, lm_head: L2 88% busy, tensor pipe 38%, 2 warps a scheduler); a
 * 128 x 256 tile of 8 warps in 3 stages (sm_120's 99 KB), which cuts that traffic by a quarter, was
 * measured and lost: lm_head at M = 256 -4%, but at M = 257 +10% and K2.6's other weights at 200-257
 * rows +7-15% (H100, 2026-12-06). */
constexpr int BM = 64, BM_SMALL = 16, BM_LARGE = 128, BK = 32, THREADS = 128, STAGES = 4;
constexpr int SPLIT_BN = 64;   /* the column tile split-K is chosen by (linear.cu): fixed, not TBN */
template <int TBM> struct Shape {
    static_assert(TBM == BM_LARGE || TBM == BM || TBM == BM_SMALL, "the warp layouts cover these three");
    static constexpr int TBN = TBM == BM_LARGE ? 128 : 64;           /* columns of B a block takes */
    static constexpr int KS = TBM == BM_LARGE ? BK : 2 * BK, KT_PS = KS / BK;
    static constexpr int LD = KS + 8;       /* A and B [n][k] row stride: conflict-free ldmatrix */
    static constexpr int BN_LD = TBN + 8;   /* B stored [k][n] (ldmatrix.trans) */
    static constexpr int B_STAGE = TBN * LD > KS * BN_LD ? TBN * LD : KS * BN_LD;
    /* warps: 1 x 4 of 16 x 16 (TBM = 16), 2 x 2 of 32 x 32 (64) or of 64 x 64 (128) */
    static constexpr int MI = TBM == BM_SMALL ? 1 : TBM / 32, NI = TBM == BM_SMALL ? 2 : TBN / 16;
};
/* dynamic shared memory of a block: the stages of A and B (46 KB at TBM = 16, 74 KB at 64, 80 KB
 * at 128) */
template <int TBM> __host__ __device__ constexpr size_t gemm_smem() {
    return (size_t)STAGES * (TBM * Shape<TBM>::LD + Shape<TBM>::B_STAGE) * sizeof(bf16);
}
__host__ __device__ constexpr int gemm_tbn(int tbm) { return tbm == BM_LARGE ? Shape<BM_LARGE>::TBN : Shape<BM>::TBN; }
/* the rows of A a block takes for a launch of M rows: 16 up to 16, 64 up to 64, else 128. From 65
 * rows on, 64-row tiles would read the weight twice: H100, 2026-12-06, both tiles in one call, the
 * 128-row tile ran the lm_head at 65 / 100 / 128 rows in 1307 / 1367 / 1431 us against 1468 /
 * 1687 / 1866, o_proj (7168 x 8192) 81 / 90 / 100 against 94 / 109 / 122, and lost only on the
 * 18-20K-row weights at 65 rows (194 against 211 us for 18432 x 7168) */
__host__ __device__ constexpr int gemm_tbm(int M) { return M <= BM_SMALL ? BM_SMALL : M <= BM ? BM : BM_LARGE; }

/* Where split-K's sums are added: by each tile's last block when a thread of it has at most 32 to
 * load (rows x 64 columns x splits <= 4096: one row at 32 splits, four at 16; a decode step's
 * GEMMs), else by gemm_reduce_kernel over the whole GPU (at 17 rows and 32 splits one block would
 * wait out some 34 rounds of 8 loads; at a 128 x 128 tile, hundreds). The same order either way. */
__host__ __device__ constexpr bool gemm_sum_in_kernel(int tile_rows, int splits) {
    return (long long)tile_rows * SPLIT_BN * splits <= 4096;
}
/* The tile counters' bytes at the start of the GEMM workspace, the same in every call, so no call's
 * partial sums (after them) overlap them: they must be zero at each launch (a new workspace starts
 * zeroed, and each tile's last block resets its own). A launch that sums in the GEMM has one m tile
 * (at most 32 rows) and fewer column tiles than split-K's target of 3 blocks an SM: 3 an SM. */
__host__ __device__ constexpr size_t gemm_counter_bytes(int n_sms) {
    return ((size_t)3 * n_sms * sizeof(int) + 255) & ~(size_t)255;
}

struct Tile {
    int z, m0, n0, row_base, rows;   /* rows: valid rows of this z (grouped) or M */
};

/* SwiGLU launches (g.glu): a group of GLU_GROUP logical columns is GLU_GROUP / 2 rows of the gate
 * and the same rows of the up weight, so a tile (64 or 128 columns: whole groups) holds both
 * products of each output column it writes, and its epilogue multiplies them. Logical column n is
 * row glu_row(n) of the gate (glu_up(n) false) or of the up weight; the output column of a group's
 * column q < GLU_GROUP / 2 is glu_row of it. Nothing of an element's k sum depends on this map. */
constexpr int GLU_GROUP = 64, GLU_HALF = GLU_GROUP / 2;
__host__ __device__ constexpr int glu_row(int n) { return n / GLU_GROUP * GLU_HALF + n % GLU_HALF; }
__host__ __device__ constexpr bool glu_up(int n) { return n % GLU_GROUP >= GLU_HALF; }
/* the logical column of the gate product of column q of a tile's outputs (q < its width / 2); the
 * up product's is GLU_HALF further */
__host__ __device__ constexpr int glu_gate_col(int q) { return q / GLU_HALF * GLU_GROUP + q % GLU_HALF; }
/* the logical columns of a SwiGLU launch whose gate and up have n1 rows each */
__host__ __device__ constexpr int glu_cols(int n1) { return (n1 + GLU_HALF - 1) / GLU_HALF * GLU_GROUP; }
/* silu(g) * u of the two products, each rounded to C's dtype first: the bits of a linear_pair into
 * that dtype followed by swiglu (norm_rope.cu's swiglu_kernel, the same expression) */
__device__ __forceinline__ float glu_of(int dt, float g, float u) {
    const float gv = kd_round(dt, g), uv = kd_round(dt, u);
    return gv / (1.0f + expf(-gv)) * uv;
}

/* whether logical column n of a k-major B has a weight row (else its products are zeros) */
__device__ __forceinline__ bool gemm_b_has(const kd_gemm_args &g, int n) {
    return g.glu ? glu_row(n) < g.n1 : n < g.N;
}
/* row n of a k-major B: Bz's, or the pair's second weight's from column n1 on, or a SwiGLU's */
__device__ __forceinline__ const bf16 *gemm_b_row(const kd_gemm_args &g, const bf16 *Bz, int n) {
    if (g.glu) return (glu_up(n) ? g.B1 : Bz) + (long long)glu_row(n) * g.ldb;
    return g.B1 && n >= g.n1 ? g.B1 + (long long)(n - g.n1) * g.ldb : Bz + (long long)n * g.ldb;
}

/* The cp.async path (bf16 A, 16-byte aligned operands, K % 8 == 0). Each thread's 16-byte
 * pieces of a stage are the same rows and columns in every stage, so their source pointers,
 * predicates and shared-memory offsets are worked out once per block and a stage only adds
 * k0 (recomputed per piece, they cost about 550 instructions a warp per k-tile of 4 mma at
 * M <= 16; about 115 once hoisted, sm_90 SASS with one k-tile a stage). */
template <int TBM, bool BKM>
struct AsyncLoads {
    static constexpr int KS = Shape<TBM>::KS, LD = Shape<TBM>::LD, BN = Shape<TBM>::TBN, BN_LD = Shape<TBM>::BN_LD;
    static constexpr int A_PIECES = TBM * (KS / 8), B_PIECES = BN * KS / 8;
    static constexpr int A_PT = (A_PIECES + THREADS - 1) / THREADS, B_PT = B_PIECES / THREADS;
    static_assert(B_PIECES % THREADS == 0, "every thread loads the same number of B pieces");
    const bf16 *a_src[A_PT], *b_src[B_PT];
    int a_dst[A_PT], a_kc[A_PT], b_dst[B_PT], b_kc[B_PT];
    bool a_ok[A_PT], b_ok[B_PT];
    const bf16 *a_none, *b_none;   /* the (unread) source of a zero-filled piece */
    long long b_step;              /* B elements per unit of k0 (k-major: 1) */

    /* the A pieces (after the wait: a_rows and the activations are the grid before's output) */
    __device__ __forceinline__ void init_a(const kd_gemm_args &g, const Tile &t, const char *Az) {
        const int tid = threadIdx.x;
        a_none = (const bf16 *)g.A;
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
    }
    /* the B pieces (weights: may run before the wait) */
    __device__ __forceinline__ void init_b(const kd_gemm_args &g, const Tile &t, const bf16 *Bz) {
        const int tid = threadIdx.x;
        b_none = Bz;
#pragma unroll
        for (int j = 0; j < B_PT; j++) {
            const int c = tid + j * THREADS;
            if (BKM) {   /* B [n][k]: BN rows x KS cols */
                const int r = c / (KS / 8), kc = (c % (KS / 8)) * 8, n = t.n0 + r;
                b_ok[j] = gemm_b_has(g, n);
                b_src[j] = gemm_b_row(g, Bz, b_ok[j] ? n : 0) + kc;
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
    __device__ __forceinline__ void load_a(bf16 *As, int k0, int kend) const {
#pragma unroll
        for (int j = 0; j < A_PT; j++) {
            const bool v = a_ok[j] && k0 + a_kc[j] < kend;
            if (A_PIECES % THREADS == 0 || threadIdx.x + j * THREADS < A_PIECES)
                cp16(As + a_dst[j], v ? (const void *)(a_src[j] + k0) : (const void *)a_none, v);
        }
    }
    __device__ __forceinline__ void load_b(bf16 *Bs, int k0, int kend) const {
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
    constexpr int KS = Shape<TBM>::KS, LD = Shape<TBM>::LD, BN = Shape<TBM>::TBN, BN_LD = Shape<TBM>::BN_LD;
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
            bool ok = gemm_b_has(g, n);
            const bf16 *row = gemm_b_row(g, Bz, ok ? n : 0);
            for (int i = 0; i < 8; i++) dst[i] = (ok && k + i < g.K) ? row[k + i] : __float2bfloat16(0.0f);
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

/* Split-K's sums, in the GEMM (a few rows: gemm_sum_in_kernel): every block of the tile
 * has stored its split's partial sums; the one that arrives last (the tile's counter, which it
 * resets for the next launch) adds them in split order and stores C. The fence orders each
 * block's stores before its arrival, the loads bypass L1 (other SMs wrote them) and go out
 * SUM_BATCH at a time (one at a time, the 32 splits of a decode step's kv_a were 32 load
 * latencies). */
constexpr int SUM_BATCH = 8;
__device__ __forceinline__ float sum_splits(const float *p, size_t split_stride, int splits) {
    float s = 0.0f;
    for (int sp0 = 0; sp0 < splits; sp0 += SUM_BATCH) {   /* the loads of a batch in flight together */
        float v[SUM_BATCH];
#pragma unroll
        for (int j = 0; j < SUM_BATCH; j++)
            v[j] = sp0 + j < splits ? __ldcg(p + (size_t)(sp0 + j) * split_stride) : 0.0f;
#pragma unroll
        for (int j = 0; j < SUM_BATCH; j++)
            if (sp0 + j < splits) s += v[j];
    }
    return s;
}
template <int TBM>
__device__ void gemm_split_sum(const kd_gemm_args &g, const Tile &t, int tile, int splits, const float *partial,
                               int *tile_count) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&tile_count[tile], 1) == splits - 1;
        if (last) tile_count[tile] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    constexpr int BN = Shape<TBM>::TBN;
    const size_t split_stride = (size_t)g.batch * g.M * g.N;
    if (g.glu) {   /* each output column from its gate and up sums, GLU_HALF columns apart */
        for (int i = threadIdx.x; i < TBM * (BN / 2); i += THREADS) {
            const int m = t.m0 + i / (BN / 2), q = i % (BN / 2);
            const int n = t.n0 + glu_gate_col(q), j = glu_row(n);
            if (m >= t.rows || j >= g.n1) continue;
            const int out_row = t.row_base + m;
            const float *p = partial + ((size_t)t.z * g.M + out_row) * g.N + n;
            kd_st(g.C, g.c_dtype, (size_t)((long long)t.z * g.c_zstride + (long long)out_row * g.ldc + j),
                  glu_of(g.c_dtype, sum_splits(p, split_stride, splits),
                         sum_splits(p + GLU_HALF, split_stride, splits)));
        }
        return;
    }
    for (int i = threadIdx.x; i < TBM * BN; i += THREADS) {
        const int m = t.m0 + i / BN, n = t.n0 + i % BN;
        if (m >= t.rows || n >= g.N) continue;
        const int out_row = t.row_base + m;
        const float s = sum_splits(partial + ((size_t)t.z * g.M + out_row) * g.N + n, split_stride, splits);
        kd_st(g.C, g.c_dtype, (size_t)((long long)t.z * g.c_zstride + (long long)out_row * g.ldc + n), s);
    }
}

/* A SwiGLU tile without split-K: its gate and up products sit in different warps (TBM = 16, 64), so
 * the accumulators go through shared memory (the pipeline's stages, free once every warp is past
 * its last MMA) and each thread then writes whole output columns. */
template <int TBM>
__device__ void glu_epilogue(const kd_gemm_args &g, const Tile &t, const float (&acc)[Shape<TBM>::MI][Shape<TBM>::NI][4],
                             unsigned char *smem, int wm, int wn, int gq, int tq) {
    constexpr int BN = Shape<TBM>::TBN, CLD = BN + 4;
    static_assert(TBM * CLD * sizeof(float) <= gemm_smem<TBM>(), "the tile's sums fit the stages");
    float *cs = (float *)smem;
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < Shape<TBM>::MI; mi++)
#pragma unroll
        for (int ni = 0; ni < Shape<TBM>::NI; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                cs[(wm + mi * 16 + gq + (c >> 1) * 8) * CLD + wn + ni * 8 + 2 * tq + (c & 1)] = acc[mi][ni][c];
    __syncthreads();
    for (int i = threadIdx.x; i < TBM * (BN / 2); i += THREADS) {
        const int r = i / (BN / 2), col = glu_gate_col(i % (BN / 2));
        const int m = t.m0 + r, j = glu_row(t.n0 + col);
        if (m >= t.rows || j >= g.n1) continue;
        const int out_row = t.row_base + m;
        kd_st(g.C, g.c_dtype, (size_t)((long long)t.z * g.c_zstride + (long long)out_row * g.ldc + j),
              glu_of(g.c_dtype, cs[r * CLD + col], cs[r * CLD + col + GLU_HALF]));
    }
}

/* grid: x = m tiles of TBM rows, y = n_tiles (of TBN columns) * splits, z = batch (or expert).
 * The m tiles vary fastest so that the blocks sharing a strip of B run together and read it from
 * HBM once (with the n tiles fastest, M = 256 read a 2.35 GB lm_head four times). */
template <int TBM, bool ASYNC, bool BKM>
__global__ void __launch_bounds__(THREADS) gemm_kernel(kd_gemm_args g, int n_tiles, int splits,
                                                       int kts_per_split, float *partial, int *tile_count) {
    using S = Shape<TBM>;
    constexpr int MI = S::MI, NI = S::NI, KS = S::KS, KT_PS = S::KT_PS, LD = S::LD, BN = S::TBN, BN_LD = S::BN_LD;
    constexpr int B_STAGE = S::B_STAGE;
#ifdef KD_GEMM_EMU
    unsigned char *gemm_smem_buf = gemm_emu_smem();
#else
    extern __shared__ __align__(16) unsigned char gemm_smem_buf[];
#endif
    bf16 *const As0 = (bf16 *)gemm_smem_buf, *const Bs0 = As0 + STAGES * TBM * LD;

    Tile t;
    t.z = blockIdx.z;
    int nt = blockIdx.y % n_tiles, split = blockIdx.y / n_tiles;
    t.n0 = nt * BN;
    t.m0 = blockIdx.x * TBM;
    const int kt_total = (g.K + BK - 1) / BK;
    const int kt0 = split * kts_per_split;
    const int kt1 = min(kt_total, kt0 + kts_per_split);
    /* stages of KT_PS k-tiles over [kt0, kt1); the split's last stage may hold fewer */
    const int kend = min(g.K, kt1 * BK), n_stages = (kt1 - kt0 + KT_PS - 1) / KT_PS;
    auto stage_k0 = [&](int st) { return (kt0 + st * KT_PS) * BK; };
    auto stage_a = [&](int st) { return As0 + (st % STAGES) * TBM * LD; };
    auto stage_b = [&](int st) { return Bs0 + (st % STAGES) * B_STAGE; };

    /* Launched behind the grid before (kd_launch_pdl): a plain linear's first weight stages are
     * requested before the wait, so they stream in while that grid finishes. They join the
     * first stage's cp.async group, which every later wait covers. Grouped launches read their
     * row ranges and weight pointers from the device, so they wait first. */
    AsyncLoads<TBM, BKM> loads;
    const bool early_b = ASYNC && !g.row_off && !g.b_ptrs;
    const bf16 *Bz = g.B + (long long)t.z * g.b_zstride;
    if (early_b) {
        loads.init_b(g, t, Bz);
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++)
            if (s < n_stages) loads.load_b(stage_b(s), stage_k0(s), kend);
    }
    kd_griddep_wait();
    kd_griddep_release();

    if (g.row_off) {
        t.row_base = g.row_off[t.z];
        t.rows = g.row_off[t.z + 1] - t.row_base;
    } else {
        t.row_base = 0;
        t.rows = g.M;
    }
    if (t.m0 >= t.rows) return;
    if (g.b_ptrs) Bz = g.b_ptrs[t.z];
    const char *Az = (const char *)g.A +
                     (size_t)((long long)t.z * g.a_zstride) * (g.a_dtype == KD_F32 ? 4 : 2);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = TBM == BM_SMALL ? 0 : (warp >> 1) * (TBM / 2);
    const int wn = TBM == BM_SMALL ? warp * 16 : (warp & 1) * (BN / 2);
    const int gq = lane >> 2, tq = lane & 3;
    /* ldmatrix row addresses: A, 16 rows x 16 k a fragment; B, 16 columns x 16 k (two n8 fragments) */
    const int a_row = wm + (lane & 15), a_col = (lane >> 4) * 8;
    const int b_row = BKM ? wn + (lane & 7) + ((lane >> 4) << 3) : (lane & 15);
    const int b_col = BKM ? ((lane >> 3) & 1) * 8 : wn + (lane >> 4) * 8;

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.0f;

    if (ASYNC) {
        loads.init_a(g, t, Az);
        if (!early_b) loads.init_b(g, t, Bz);
    }
    auto load_stage = [&](int st, bool with_b) {
        if (!ASYNC) {
            load_tile_plain<TBM, BKM>(g, t, stage_a(st), stage_b(st), stage_k0(st), Bz, Az);
            return;
        }
        loads.load_a(stage_a(st), stage_k0(st), kend);
        if (with_b) loads.load_b(stage_b(st), stage_k0(st), kend);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < n_stages) load_stage(s, !early_b);
        if (ASYNC) cp_commit();
    }
    for (int st = 0; st < n_stages; st++) {
        if (ASYNC) cp_wait<STAGES - 2>();
        __syncthreads();
        if (st + STAGES - 1 < n_stages) load_stage(st + STAGES - 1, true);
        if (ASYNC) cp_commit();
        const bf16 *as = stage_a(st), *bs = stage_b(st);
        const int ks_valid = min(KS, (kt1 - kt0 - st * KT_PS) * BK);   /* whole k-tiles of the split */
#pragma unroll
        for (int kk = 0; kk < KS; kk += 16) {
            if (kk >= ks_valid) break;
            uint32_t af[MI][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) ldsm_x4(af[mi], as + (a_row + mi * 16) * LD + kk + a_col);
#pragma unroll
            for (int np = 0; np < NI / 2; np++) {
                uint32_t r[4];
                if (BKM) ldsm_x4(r, bs + (b_row + np * 16) * LD + kk + b_col);
                else ldsm_x4_trans(r, bs + (kk + b_row) * BN_LD + b_col + np * 16);
                bfr[2 * np][0] = r[0];
                bfr[2 * np][1] = r[1];
                bfr[2 * np + 1][0] = r[2];
                bfr[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) mma16816(acc[mi][ni], af[mi], bfr[ni]);
        }
    }
    if (ASYNC) cp_wait<0>();

    if (g.glu && splits == 1) {
        glu_epilogue<TBM>(g, t, acc, gemm_smem_buf, wm, wn, gq, tq);
        return;
    }
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
    if (splits > 1 && tile_count)
        gemm_split_sum<TBM>(g, t, (t.z * n_tiles + nt) * (int)gridDim.x + (int)blockIdx.x, splits, partial,
                            tile_count);
}

/* C = the splits' partial sums added in split order, over the whole grid: when a tile has too
 * many sums for its last block to add alone (gemm_sum_in_kernel) */
__global__ void gemm_reduce_kernel(kd_gemm_args g, int splits, const float *partial) {
    kd_griddep_enter();
    const size_t total = (size_t)g.batch * g.M * g.N;
    if (g.glu) {   /* output column j (of N / 2, the last group's past n1 skipped): gemm_split_sum's */
        const int half = g.N / 2;
        const size_t outs = (size_t)g.batch * g.M * half;
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < outs; i += (size_t)gridDim.x * blockDim.x) {
            const int q = (int)(i % half), n = glu_gate_col(q), j = glu_row(n);
            const size_t r = i / half;
            if (j >= g.n1) continue;
            const int m = (int)(r % g.M), z = (int)(r / g.M);
            const float *p = partial + r * g.N + n;
            kd_st(g.C, g.c_dtype, (size_t)((long long)z * g.c_zstride + (long long)m * g.ldc + j),
                  glu_of(g.c_dtype, sum_splits(p, total, splits), sum_splits(p + GLU_HALF, total, splits)));
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int n = (int)(i % g.N);
        const size_t r = i / g.N;
        const int m = (int)(r % g.M), z = (int)(r / g.M);
        kd_st(g.C, g.c_dtype, (size_t)((long long)z * g.c_zstride + (long long)m * g.ldc + n),
              sum_splits(partial + i, total, splits));
    }
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

}  // namespace gemm
#endif
