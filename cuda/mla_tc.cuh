/* mla_tc.cuh: the tensor-core attention kernel (included by mla.cu after mla_mma.cuh; also
 * compiled on the CPU by scripts/bench/mla_emu/ against an emulation of mla_mma.cuh).
 *
 * What it computes, per (query t, query head h) "row" and per chunk c of TC_CHUNK ordinals
 * (the same ordinals as the CUDA-core kernel in mla.cu: the query's visible key rows in row
 * order, cut at fixed multiples of TC_CHUNK):
 *   s_j  = (q_h . k_j) * scale * log2(e)       fp32, bf16 inputs, mma over the key dims in
 *                                               16-dim steps in ascending order
 *   m    = max_j s_j;  p_j = bf16(exp2(s_j - m)) (masked keys: p_j = 0)
 *   l    = L(0) + L(1), L(h) the sum of p_j over the keys kg*128 + h*64 + [0,64) of the
 *          chunk's four 128-key groups, in a fixed lane/register order and a fixed quad
 *          shuffle tree (written out above tc_chunk_kernel)
 *   o    = sum_j p_j v_j                        fp32 mma over 32 fixed 16-key steps
 * and writes (m, l, o) as the chunk's partial; tc_merge_kernel combines the chunks of a row
 * in chunk order: M = max m_c, L = sum l_c 2^(m_c-M), out = sum o_c 2^(m_c-M) / L.
 *
 * Block shape: 64 rows (4 groups of 16, the mma M dimension) x one chunk x one kv head: 8
 * warps that each span the 64 rows (tc_wide_kernel, mla_tc_wide.cuh) where its cp.async path and
 * shared memory allow, else 2 warps per 16 rows (tc_chunk_kernel). When few blocks would run (decode, small T at short context): 16 rows
 * of 8 warps, and the value dims split over up to 4 blocks ("value slices": each block
 * computes the chunk's S and softmax, and its DVP / VS value dims of O), so a decode step at 1K
 * runs 32 blocks of 8 warps instead of 8 blocks of 2. Those 16-row blocks take S = Q K^T from
 * tc_scores_kernel (mla_tc_scores.cuh: 64 keys a block, so a chunk's keys are read by 8 blocks,
 * not by every value slice of it whole) and run only the softmax and O = P V (SPLIT).
 * Rows are (query, head) pairs: 64 heads of one query for MLA, 8 queries x 8 heads for
 * 8 heads, etc. All rows of a block share one staged key/value tile when their ordinals
 * map to the same cache rows: causal or full attention (ordinal = row), and in tree mode
 * (bitmask) the chunks lying wholly in the committed prefix (ordinal = row < past: the
 * "shared" launch). Tree-mode chunks that reach into the new rows are per query (the
 * "tail" launch: a block holds one query's heads and stages that query's rows).
 *
 * Why a row's bits do not depend on T, the batch, or the other rows of its block
 * (decode alone == prefill row == tree node; attention == attention_at):
 *  - the chunking is a function of the row's own ordinals (fixed TC_CHUNK);
 *  - mma rows are independent: D[i][n] = sum_k A[i][k] B[k][n] + C[i][n] reads only row i
 *    of A, so other rows (other queries, padding rows) never enter a row's sums;
 *  - a row's scores s_j are columns of Q K^T, each computed over the key dims in the same
 *    fixed k-step order whatever else is in the tile;
 *  - the tile position of ordinal o is o - c*TC_CHUNK in every launch. Tile positions past
 *    this row's visible count hold zeros (nothing loaded: the T = 1 case) or other rows'
 *    keys (a batch): either way this row's p there is exactly 0, so the P.V products at
 *    those positions are zero in both cases, and all 32 key steps of P.V always run (no
 *    step is skipped on a batch-dependent bound);
 *  - softmax max/sum, the l sum and the merge run in orders fixed by the chunk size alone;
 *  - the block shape (row groups, warps per row group, value slices) moves work between warps
 *    and blocks but not one operation of a row's sums (see above tc_chunk_kernel).
 * The tile source (cp.async or plain loads: alignment of the buffers) does not change the
 * staged values, so it does not change the arithmetic either.
 *
 * Precision: scores fp32 from bf16 q and cache; P is rounded to bf16 for the P.V mma (as
 * FlashAttention does), and l sums the rounded p, so the weights are normalised exactly as
 * used; o, m, l and the merge are fp32. */
#ifndef KD_MLA_TC_CUH
#define KD_MLA_TC_CUH

namespace mla {

constexpr int TC_CHUNK = 512;              /* ordinals per chunk: fixed, never from T or S */
constexpr int TC_ROWS = 64;                /* (query, head) rows per block at most (RG = 4 row groups) */
constexpr int TC_STAGES = 4;               /* cp.async pipeline depth (slabs) */
constexpr int TC_KSLAB = 128;              /* phase 1 slab: 128 keys x 64 key dims */
constexpr int TC_P1LD = 64 + 8;            /* its row stride (bf16): 9 x 16 bytes, conflict-free */
constexpr int TC_PLD = TC_CHUNK + 8;       /* P row stride (bf16): 65 x 16 bytes */
constexpr int TC_KSTEPS = TC_CHUNK / 16;   /* phase 2: 16-key steps a chunk (a slab: VS steps x DVP / VS dims) */
constexpr int TC_HD_MAX = 576, TC_DV_MAX = 512;
constexpr int TC_STAGE_BYTES = TC_KSLAB * TC_P1LD * 2;   /* phase 1's slab; phase 2's fit (tc_chunk_kernel) */
constexpr int TC_SKEYS = 64;               /* keys of a tc_scores_kernel block (8 a chunk) */

/* the kernels' dynamic shared memory (the emulator hands out its own buffer) */
#ifdef KD_MLA_EMU
#define TC_DYNAMIC_SMEM(name) unsigned char *name = mla_emu_smem()
#else
#define TC_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

struct TcArgs {
    const uint16_t *q; long long ldq;
    const uint16_t *k; long long ldk; int kstride;
    const uint16_t *v; long long ldv; int vstride;
    int T, S, past, Hq, G, hd, dv, HDP;
    bool causal; int window; float scale2;        /* scale * log2(e) */
    const int32_t *vis_list; const int32_t *vis_cnt;   /* bitmask mode: per query, visible new rows */
    int t0, tb;                                   /* this launch's queries [t0, t0 + tb) */
    const int32_t *d_past;                        /* attention_at: past on the device */
    int nc_max;                                   /* chunk slots per (query, head) in the partials */
    float *pm, *pl, *po;                          /* partials [tb][Hq][nc_max] (+ [dv] for po) */
    float *ps;                                    /* split path: S [tb][Hq][nc_max][TC_CHUNK] (tc_scores_kernel) */
    int tail, rb_per_q;                           /* tail launch; row blocks per query there */
    bool rows_fastest;                            /* grid x is the row block, y the chunk (tc_rows_fastest) */
    bool qvec;                                    /* q rows may be read 16 bytes at a time */
};

__device__ __forceinline__ void tc_past_rows(const TcArgs &a, int *past, int *S) {
    if (!a.d_past) { *past = a.past; *S = a.S; return; }
    int p = a.d_past[0];
    p = p < 0 ? 0 : p;
    p = p > a.S - a.T ? a.S - a.T : p;
    *past = p; *S = p + a.T;
}
/* where this block works: x is its chunk in the launch (tail: counted from past's chunk), y its
 * row block (tail: query * rb_per_q + row block of `rows`). false: a shared launch's chunk that
 * reaches into the new rows (the tail launch takes it) */
__device__ __forceinline__ bool tc_block_place(const TcArgs &a, int past, int x, int y, int rows, int *c, int *tq,
                                               int *rbase) {
    if (a.tail) {
        *c = past / TC_CHUNK + x;
        *tq = y / a.rb_per_q;
        *rbase = (y % a.rb_per_q) * rows;
        return true;
    }
    *c = x;
    *tq = 0;
    *rbase = y * rows;
    return !(a.vis_list && (x + 1) * TC_CHUNK > past);
}
/* the partials' slot of query t, head h, chunk c (pm, pl; po and ps hold dv and TC_CHUNK floats a slot) */
__device__ __forceinline__ size_t tc_slot(const TcArgs &a, int t, int h, int c) {
    return ((size_t)(t - a.t0) * a.Hq + h) * a.nc_max + c;
}
__device__ __forceinline__ int tc_nvis(const TcArgs &a, int past, int S, int t) {
    if (a.vis_list) return past + a.vis_cnt[t];
    if (a.causal) return S < past + t + 1 ? S : past + t + 1;
    return S;
}
__device__ __forceinline__ int tc_ordinal_row(const TcArgs &a, int past, int t, int o) {
    if (a.vis_list && o >= past) return past + a.vis_list[(size_t)t * a.T + (o - past)];
    return o;
}

/* 8 bf16 of row `row` (cols d0..d0+7 of n) -> dst; missing row or cols: zeros */
template <bool ASYNC>
__device__ __forceinline__ void tc_copy8(uint16_t *dst, const uint16_t *base, int row, long long ld, int d0, int n) {
    if (ASYNC) {   /* n % 8 == 0 and 16-byte aligned rows: d0 < n means all 8 are in range */
        bool ok = row >= 0 && d0 < n;
        cp16(dst, ok ? (const void *)(base + (size_t)row * ld + d0) : (const void *)base, ok);
    } else {
        for (int e = 0; e < 8; e++)
            dst[e] = (row >= 0 && d0 + e < n) ? base[(size_t)row * ld + d0 + e] : (uint16_t)0;
    }
}

/* Q rows into q_s [rows][qld] by plain loads: row r is query t_s[r] (-1: zeros) at head h_s[r], dims
 * from hd to HDP zeros (tc_chunk_kernel, tc_scores_kernel) */
template <int NTH>
__device__ __forceinline__ void tc_load_q(const TcArgs &a, uint16_t *q_s, int qld, int rows, const int *t_s,
                                          const int *h_s) {
    const int du = a.HDP / 8;
    for (int i = threadIdx.x; i < rows * du; i += NTH) {
        const int r = i / du, d0 = (i % du) * 8, t = t_s[r];
        uint16_t *dst = q_s + r * qld + d0;
        const uint16_t *src = a.q + (size_t)(t >= 0 ? t : 0) * a.ldq + (size_t)h_s[r] * a.hd + d0;
        if (a.qvec) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (t >= 0 && d0 < a.hd) v = *(const uint4 *)src;
            *(uint4 *)dst = v;
        } else {
            for (int e = 0; e < 8; e++) dst[e] = (t >= 0 && d0 + e < a.hd) ? src[e] : (uint16_t)0;
        }
    }
}

/* The block's rows (tc_chunk_kernel, tc_wide_kernel, tc_scores_kernel): row r of ROWS is query t_s[r] (-1: inert)
 * and head h_s[r], sees nv_s[r] keys of the chunk starting at ordinal o0, and its query is cache
 * row qr_s[r]. Returns the most keys any row sees, the tile's loaded length (nl_s: its slot).
 * Two barriers. */
template <int ROWS>
__device__ __forceinline__ int tc_block_rows(const TcArgs &a, int past, int S, int o0, int tq, int rbase, int g,
                                             int *t_s, int *h_s, int *nv_s, int *qr_s, int *nl_s) {
    const int tid = threadIdx.x;
    if (tid < ROWS) {
        int R = rbase + tid, t = -1, hh = 0;
        if (a.tail) { if (R < a.G) { t = a.t0 + tq; hh = R; } }
        else if (R < a.tb * a.G) { t = a.t0 + R / a.G; hh = R % a.G; }
        int nv = 0;
        if (t >= 0) {
            nv = tc_nvis(a, past, S, t) - o0;
            nv = nv < 0 ? 0 : nv > TC_CHUNK ? TC_CHUNK : nv;
        }
        t_s[tid] = nv > 0 ? t : -1;
        h_s[tid] = g * a.G + hh;
        nv_s[tid] = nv;
        qr_s[tid] = past + (t >= 0 ? t : 0);
    }
    __syncthreads();
    if (tid == 0) {
        int m = 0;
        for (int r = 0; r < ROWS; r++) m = nv_s[r] > m ? nv_s[r] : m;
        nl_s[0] = m;
    }
    __syncthreads();
    return nl_s[0];
}

/* slab s of the block's sequence: s < ns1: keys [kg*128, +128) x key dims [ds*64, +64)
 * (kg = s / nds, ds = s % nds), stored [key][TC_P1LD]; else (phase 2, ks = s - ns1) 16 * VS
 * keys [ks*16*VS, +16*VS) x the DVP / VS value dims of slice sl, stored [key][DVP / VS + 8].
 * Keys at or past n_load, value dims at or past dv: zeros. */
template <int DVP, bool ASYNC, int NTH, int VS>
__device__ __forceinline__ void tc_load_slab(const TcArgs &a, uint16_t *dst, int s, int ns1, int nds,
                                             const int *row_s, int n_load, int g, int sl) {
    const int tid = threadIdx.x;
    if (s < ns1) {
        const int kg = s / nds, ds = s % nds;
        const uint16_t *base = a.k + (size_t)g * a.kstride;
        for (int i = tid; i < TC_KSLAB * 8; i += NTH) {
            int r = i >> 3, u = i & 7, j = kg * TC_KSLAB + r;
            tc_copy8<ASYNC>(dst + r * TC_P1LD + u * 8, base, j < n_load ? row_s[j] : -1, a.ldk, ds * 64 + u * 8, a.hd);
        }
    } else {
        const int ks = s - ns1;
        constexpr int DVS = DVP / VS, U = DVS / 8;
        const uint16_t *base = a.v + (size_t)g * a.vstride;
        for (int i = tid; i < 16 * VS * U; i += NTH) {
            int r = i / U, u = i % U, j = ks * 16 * VS + r;
            tc_copy8<ASYNC>(dst + r * (DVS + 8) + u * 8, base, j < n_load ? row_s[j] : -1, a.ldv, sl * DVS + u * 8,
                            a.dv);
        }
    }
}

/* bytes of dynamic shared memory for key dims padded to HDP, rg row groups of 16 and kw
 * warps per row group (rg 4, kw 8: tc_wide_kernel, whose 8 warps each span the 64 rows) */
static inline size_t tc_wide_smem_bytes(int HDP);
static inline size_t tc_smem_bytes(int HDP, int rg, int kw = 2) {
    if (rg == 4 && kw == 8) return tc_wide_smem_bytes(HDP);
    const size_t rows = (size_t)rg * 16;
    return rows * (HDP + 8) * 2 + rows * TC_PLD * 2 + (size_t)TC_STAGES * TC_STAGE_BYTES + (size_t)TC_CHUNK * 4 +
           4 * rows * 4 + (size_t)(kw + 2) * rows * 4 + 16;
}

/* grid: x = chunk (tail: chunk - past / TC_CHUNK), y = row block (tail: query * rb_per_q +
 * row block), z = kv head * VS + value slice. DVP: value dims padded (32..512, a power of
 * two). RG: row groups of 16 per block (1 or 4). KW: warps per row group (2 or 8). VS: value
 * slices (1, 2, 4): the block computes the chunk's whole S = Q K^T and softmax, and O = P V
 * for value dims [sl * DVP/VS, +DVP/VS) only.
 * None of RG, KW, VS changes any row's arithmetic, so each may be chosen per launch:
 *  - a row group's rows, their two-tile mma rows and their slots are the same code for any RG;
 *  - an S element is one mma accumulator over the key dims in ascending 16-dim steps, whichever
 *    warp (KW) holds its key; the max is exact in any order; p = bf16(exp2(s - m)) per element;
 *  - l is always the sum in the KW = 2 order: for each half h of every 128-key group (keys
 *    kg*128 + h*64 + [0,64)) and quad position q: v(h,q) = sum over kg = 0..3, nt = 0..7,
 *    e = 0..1 of p[kg*128 + h*64 + nt*8 + 2q + e] (ascending), L(h) = (v0 + v1) + (v2 + v3),
 *    l = L(0) + L(1). KW = 2 sums in registers as it goes; KW = 8 reads P back from shared
 *    memory in that exact order;
 *  - an O element is one mma accumulator over the 32 16-key steps in ascending order, with the
 *    same A fragment (P rows) and B column whichever warp (KW) or block (VS) holds its value dim,
 *    and whether its phase-2 slab holds 16 or 16 * VS keys.
 * SPLIT (RG 1, KW 8): phase 1 is tc_scores_kernel's, launched before on the same grid rows; this
 * block reads each S element it owns from a.ps instead (the same accumulator, computed there in
 * the same 16-dim steps) and runs from the softmax on. */
template <int DVP, bool ASYNC, int RG, int KW = 2, int VS = 1, bool SPLIT = false>
__global__ void __launch_bounds__(RG * 32 * KW, 1) tc_chunk_kernel(TcArgs a) {
    kd_griddep_enter();
    TC_DYNAMIC_SMEM(smem);
    static_assert(KW == 2 || KW == 8, "KW: 2 or 8 warps per row group");
    static_assert(VS == 1 || VS == 2 || VS == 4, "VS: 1, 2 or 4 value slices");
    static_assert(!SPLIT || (RG == 1 && KW == 8 && ASYNC), "SPLIT: the 16-row blocks of 8 warps");
    constexpr int DVS = DVP / VS;                  /* value dims of this block's slice */
    constexpr int DW = DVS / KW;                   /* phase 2: value dims per warp */
    static_assert(DW >= 16, "a warp's phase-2 tile is at least two n-tiles");
    static_assert(16 * VS * (DVS + 8) * 2 <= TC_STAGE_BYTES, "a phase-2 slab fits one pipeline stage");
    constexpr int NT2 = DW / 8;                    /* phase 2 n-tiles per warp */
    constexpr int KPW = TC_KSLAB / KW;             /* phase 1: keys per warp per 128-key group */
    constexpr int NT1 = KPW / 8;                   /* phase 1 n-tiles per warp per key group */
    constexpr int KS2 = TC_KSTEPS / VS;            /* phase 2 slabs (of 16 * VS keys) */
    constexpr int ROWS = RG * 16, NTH = RG * 32 * KW;
    const int HDP = a.HDP, QLD = HDP + 8, nds = HDP / 64;
    uint16_t *q_s = (uint16_t *)smem;                                   /* [ROWS][QLD] */
    uint16_t *p_s = q_s + ROWS * QLD;                                /* [ROWS][TC_PLD] */
    unsigned char *st_s = (unsigned char *)(p_s + ROWS * TC_PLD);    /* [STAGES][STAGE_BYTES] */
    int *row_s = (int *)(st_s + TC_STAGES * TC_STAGE_BYTES);            /* [CHUNK] cache row of tile pos */
    int *nv_s = row_s + TC_CHUNK;                                       /* [ROWS] visible keys in the chunk */
    int *qr_s = nv_s + ROWS;                                         /* [ROWS] the query's cache row */
    int *t_s = qr_s + ROWS;                                          /* [ROWS] query index, -1: inert */
    int *h_s = t_s + ROWS;                                           /* [ROWS] query head */
    float *red_s = (float *)(h_s + ROWS);                            /* [KW][ROWS] max, [2][ROWS] l */
    float *lred_s = red_s + KW * ROWS;
    int *nl_s = (int *)(lred_s + 2 * ROWS);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, rg = warp / KW, kw = warp % KW;
    const int g = (int)blockIdx.z / VS, sl = (int)blockIdx.z % VS;
    int past, S;
    tc_past_rows(a, &past, &S);
    int c, tq, rbase;
    if (!tc_block_place(a, past, (int)blockIdx.x, (int)blockIdx.y, ROWS, &c, &tq, &rbase)) return;
    const int o0 = c * TC_CHUNK;

    const int n_load = tc_block_rows<ROWS>(a, past, S, o0, tq, rbase, g, t_s, h_s, nv_s, qr_s, nl_s);
    if (n_load == 0) return;

    for (int j = tid; j < TC_CHUNK; j += NTH)
        row_s[j] = j < n_load ? (a.tail ? tc_ordinal_row(a, past, a.t0 + tq, o0 + j) : o0 + j) : -1;
    if (!SPLIT) tc_load_q<NTH>(a, q_s, QLD, ROWS, t_s, h_s);
    __syncthreads();

    const int kg_n = (n_load + TC_KSLAB - 1) / TC_KSLAB;
    const int ns1 = SPLIT ? 0 : kg_n * nds, ns = ns1 + KS2;
#define TC_STAGE(i) ((uint16_t *)(st_s + (size_t)((i) % TC_STAGES) * TC_STAGE_BYTES))
#define TC_LOAD(i) tc_load_slab<DVP, ASYNC, NTH, VS>(a, TC_STAGE(i), (i), ns1, nds, row_s, n_load, g, sl)
    for (int s0 = 0; s0 < TC_STAGES - 1; s0++) {
        if (s0 < ns) TC_LOAD(s0);
        cp_commit();
    }

    /* ---- phase 1: S = Q K^T; warp (rg, kw) owns rows rg*16.. and keys kg*128 + kw*KPW + [0,KPW) ---- */
    float sc[4][NT1][4];
#pragma unroll
    for (int kg = 0; kg < 4; kg++)
#pragma unroll
        for (int nt = 0; nt < NT1; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[kg][nt][e] = 0.0f;
    /* the first of the two keys of n-tile nt of key group kg that this thread holds */
    auto key0 = [&](int kg, int nt) { return kg * TC_KSLAB + kw * KPW + nt * 8 + 2 * (lane & 3); };
    int s = 0;
    const uint16_t *qa = q_s + (rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QLD + (lane >> 4) * 8;
    const int kb_off = (kw * KPW + ((lane >> 4) << 3) + (lane & 7)) * TC_P1LD + ((lane >> 3) & 1) * 8;
    if (SPLIT) {   /* S from tc_scores_kernel: where its TC_SKEYS-key block was loaded (else 0, as unloaded keys) */
#pragma unroll
        for (int kg = 0; kg < 4; kg++)
#pragma unroll
            for (int nt = 0; nt < NT1; nt++)
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    const int row = rg * 16 + (lane >> 2) + hr * 8, t = t_s[row], j = key0(kg, nt);
                    float2 v = make_float2(0.0f, 0.0f);
                    if (t >= 0 && j / TC_SKEYS * TC_SKEYS < n_load)
                        v = *(const float2 *)(a.ps + tc_slot(a, t, h_s[row], c) * TC_CHUNK + j);
                    sc[kg][nt][2 * hr] = v.x;
                    sc[kg][nt][2 * hr + 1] = v.y;
                }
    }
#pragma unroll
    for (int kg = 0; kg < 4; kg++) {
        if (!SPLIT && kg < kg_n) {
            for (int ds = 0; ds < nds; ds++, s++) {
                cp_wait<TC_STAGES - 2>();
                __syncthreads();
                if (s + TC_STAGES - 1 < ns) TC_LOAD(s + TC_STAGES - 1);
                cp_commit();
                const uint16_t *ks = TC_STAGE(s);
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    uint32_t af[4];
                    ldsm_x4(af, qa + ds * 64 + kk * 16);
#pragma unroll
                    for (int np = 0; np < NT1 / 2; np++) {
                        uint32_t bfr[4];
                        ldsm_x4(bfr, ks + kb_off + np * 16 * TC_P1LD + kk * 16);
                        mma16816(sc[kg][2 * np], af, bfr);
                        mma16816(sc[kg][2 * np + 1], af, bfr + 2);
                    }
                }
            }
        }
    }

    /* ---- softmax over the chunk: rows r0 (c0, c1) and r0 + 8 (c2, c3) of this thread ---- */
    const int r0 = rg * 16 + (lane >> 2);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int kg = 0; kg < 4; kg++)
#pragma unroll
        for (int nt = 0; nt < NT1; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hr = e >> 1, row = r0 + hr * 8;
                const int j = key0(kg, nt) + (e & 1);
                bool ok = j < nv_s[row] && (a.window <= 0 || qr_s[row] - row_s[j] < a.window);
                float v = ok ? sc[kg][nt][e] * a.scale2 : -INFINITY;
                sc[kg][nt][e] = v;
                mx[hr] = fmaxf(mx[hr], v);
            }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        mx[hr] = fmaxf(mx[hr], shfl_xor(mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], shfl_xor(mx[hr], 2));
        if ((lane & 3) == 0) red_s[kw * ROWS + r0 + hr * 8] = mx[hr];
    }
    __syncthreads();
    float m[2], ls[2] = {0.0f, 0.0f};
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        m[hr] = fmaxf(red_s[r0 + hr * 8], red_s[ROWS + r0 + hr * 8]);
#pragma unroll
        for (int w = 2; w < KW; w++) m[hr] = fmaxf(m[hr], red_s[w * ROWS + r0 + hr * 8]);
    }
#pragma unroll
    for (int kg = 0; kg < 4; kg++)
#pragma unroll
        for (int nt = 0; nt < NT1; nt++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int row = r0 + hr * 8;
                const int j = key0(kg, nt);
                float v0 = sc[kg][nt][2 * hr], v1 = sc[kg][nt][2 * hr + 1];
                uint16_t b0 = v0 == -INFINITY ? (uint16_t)0 : f2bf(exp2f(v0 - m[hr]));
                uint16_t b1 = v1 == -INFINITY ? (uint16_t)0 : f2bf(exp2f(v1 - m[hr]));
                *(uint32_t *)(p_s + row * TC_PLD + j) = (uint32_t)b0 | ((uint32_t)b1 << 16);
                if (KW == 2) {   /* the l order, summed as it goes (KW = 8: from p_s below) */
                    ls[hr] += bf2f(b0);
                    ls[hr] += bf2f(b1);
                }
            }
    if (KW == 2) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            ls[hr] += shfl_xor(ls[hr], 1);
            ls[hr] += shfl_xor(ls[hr], 2);
            if ((lane & 3) == 0) lred_s[kw * ROWS + r0 + hr * 8] = ls[hr];
        }
    } else {
        /* the same sums in the same order, from P in shared memory: thread i < 8 * ROWS (whole
         * warps) takes quad position q = i & 3 of half h = (i >> 2) & 1 of row i >> 3 */
        __syncthreads();
        if (tid < 8 * ROWS) {
            const int q = tid & 3, h = (tid >> 2) & 1, row = tid >> 3;
            const uint16_t *pr = p_s + row * TC_PLD + h * 64 + 2 * q;
            float v = 0.0f;
#pragma unroll 4
            for (int kg = 0; kg < 4; kg++)
#pragma unroll
                for (int nt = 0; nt < 8; nt++) {
                    const uint32_t w = *(const uint32_t *)(pr + kg * TC_KSLAB + nt * 8);
                    v += bf2f((uint16_t)(w & 0xffffu));
                    v += bf2f((uint16_t)(w >> 16));
                }
            v += shfl_xor(v, 1);
            v += shfl_xor(v, 2);
            if (q == 0) lred_s[h * ROWS + row] = v;
        }
    }

    /* ---- phase 2: O = P V; warp (rg, kw) owns rows rg*16.. and value dims sl*DVS + kw*DW + [0, DW) ---- */
    float oacc[NT2][4];
#pragma unroll
    for (int nt = 0; nt < NT2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) oacc[nt][e] = 0.0f;
    const uint16_t *pa = p_s + (rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * TC_PLD + (lane >> 4) * 8;
    const int vb_off = (((lane >> 3) & 1) * 8 + (lane & 7)) * (DVS + 8) + kw * DW + (lane >> 4) * 8;
    for (int k2 = 0; k2 < KS2; k2++, s++) {
        cp_wait<TC_STAGES - 2>();
        __syncthreads();   /* also publishes P and l (written above) before the first step */
        if (s + TC_STAGES - 1 < ns) TC_LOAD(s + TC_STAGES - 1);
        cp_commit();
        const uint16_t *vs = TC_STAGE(s);
#pragma unroll
        for (int kk = 0; kk < VS; kk++) {   /* the 16-key steps k2 * VS + kk, ascending */
            uint32_t af[4];
            ldsm_x4(af, pa + (k2 * VS + kk) * 16);
#pragma unroll
            for (int np = 0; np < NT2 / 2; np++) {
                uint32_t bfr[4];
                ldsm_x4_trans(bfr, vs + vb_off + kk * 16 * (DVS + 8) + np * 16);
                mma16816(oacc[2 * np], af, bfr);
                mma16816(oacc[2 * np + 1], af, bfr + 2);
            }
        }
    }
    cp_wait<0>();
#undef TC_LOAD
#undef TC_STAGE

    /* ---- partials (m, l, o) of this chunk for the block's live rows (m, l: slice 0) ---- */
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int row = r0 + hr * 8, t = t_s[row];
        if (t < 0) continue;
        const size_t slot = tc_slot(a, t, h_s[row], c);
        if (sl == 0 && kw == 0 && (lane & 3) == 0) {
            a.pm[slot] = m[hr];
            a.pl[slot] = lred_s[row] + lred_s[ROWS + row];
        }
        float *po = a.po + slot * a.dv;
#pragma unroll
        for (int nt = 0; nt < NT2; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int d = sl * DVS + kw * DW + nt * 8 + 2 * (lane & 3) + e;
                if (d < a.dv) po[d] = oacc[nt][2 * hr + e];
            }
    }
}

/* grid: x = query head, y = query within the launch; the chunks of a row in chunk order. The
 * chunks' maxima, masses and weights 2^(m_c - M) are staged in shared memory by all threads at
 * once (tc_merge_smem), and each value dim reads its partials MERGE_BATCH chunks at a time: one
 * at a time, every addition waited for its own load (64 for a row at 32K). Every sum keeps its
 * chunk order and its operands, so the bits are the same. */
constexpr int MERGE_BATCH = 8;
static inline size_t tc_merge_smem(int nc_max) { return (size_t)3 * nc_max * sizeof(float); }
__global__ void tc_merge_kernel(TcArgs a, void *out, int odt, long long ldo) {
    kd_griddep_enter();
    TC_DYNAMIC_SMEM(smem);
    float *pm_s = (float *)smem;
    float *pl_s = pm_s + a.nc_max, *w_s = pl_s + a.nc_max;   /* w_s: 2^(m_c - M), -1 for an empty chunk */
    const int h = blockIdx.x, tb = blockIdx.y, t = a.t0 + tb;
    int past, S;
    tc_past_rows(a, &past, &S);
    const int nvis = tc_nvis(a, past, S, t);
    const int nc = (nvis + TC_CHUNK - 1) / TC_CHUNK;
    const size_t base = tc_slot(a, t, h, 0);
    for (int c = threadIdx.x; c < nc; c += blockDim.x) {
        pm_s[c] = a.pm[base + c];
        pl_s[c] = a.pl[base + c];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int c = 0; c < nc; c++) M = fmaxf(M, pm_s[c]);
    for (int c = threadIdx.x; c < nc; c += blockDim.x) w_s[c] = pm_s[c] != -INFINITY ? exp2f(pm_s[c] - M) : -1.0f;
    __syncthreads();
    float L = 0.0f;
    for (int c = 0; c < nc; c++)
        if (w_s[c] >= 0.0f) L += pl_s[c] * w_s[c];
    for (int d = threadIdx.x; d < a.dv; d += blockDim.x) {
        const float *po = a.po + base * a.dv + d;
        float o = 0.0f;
        for (int c0 = 0; c0 < nc; c0 += MERGE_BATCH) {
            float v[MERGE_BATCH];
#pragma unroll
            for (int j = 0; j < MERGE_BATCH; j++) v[j] = c0 + j < nc ? po[(size_t)(c0 + j) * a.dv] : 0.0f;
#pragma unroll
            for (int j = 0; j < MERGE_BATCH; j++)
                if (c0 + j < nc && w_s[c0 + j] >= 0.0f) o += v[j] * w_s[c0 + j];
        }
        kd_st(out, odt, (size_t)t * ldo + (size_t)h * a.dv + d, M == -INFINITY || L == 0.0f ? 0.0f : o / L);
    }
}

}  // namespace mla
#include "mla_tc_wide.cuh"
#include "mla_tc_scores.cuh"
namespace mla {

/* ---- the launch plan (host): attention_tc in mla.cu and scripts/bench/mla_emu both take it from here ---- */

/* value dims padded to a kernel instance (32..512, a power of two) */
static inline int tc_dv_padded(int dv) { return dv <= 32 ? 32 : dv <= 64 ? 64 : dv <= 128 ? 128 : dv <= 256 ? 256 : 512; }

/* chunks of the query that sees the most keys: all S rows unless causal with a host past */
static inline long long tc_max_chunks(int S, int past, int T, bool causal, bool visible, bool d_past) {
    return visible || !causal || d_past ? (S + TC_CHUNK - 1) / TC_CHUNK : (past + T + TC_CHUNK - 1) / TC_CHUNK;
}

/* The block shape of a call: rg row groups of 16 per block (4: 64 rows share a tile) unless
 * that leaves two thirds of the SMs idle (K2.6 decode below ~22K context, small T at short
 * context) or does not fit; 64-row blocks take tc_wide_kernel (kw = 8: each warp spans the 64
 * rows) where it applies (async, DVP >= 128, its shared memory fits, wide_fits:
 * tc_wide_offsets_fit), split into vs value slices while the grid stays within one block an SM
 * (up to DVP / 128), else kw = 2. 16-row blocks, when async and vs_mode allow, take kw = 8
 * warps split into vs value slices (up to DVP / 128; more while the grid has fewer than two
 * blocks per SM), which take S from tc_scores_kernel (where its shared memory fits as well).
 * rg_forced: 1 or 4, else 0 (the rule); vs_mode: 0 off, 1, 2 or 4 forced, 8 the rule. The bits
 * depend on none of these (above). */
struct TcShape { int rg, kw, vs; };
/* whether rows (query, head) pairs in 64-row blocks fill them more than half */
static inline bool tc_fills_half(long long rows) { return rows * 2 > TC_ROWS * ((rows + TC_ROWS - 1) / TC_ROWS); }
/* the blocks of shape s that rows (query, head) pairs take (a shared launch's grid y; a tail query's blocks) */
static inline int tc_row_blocks(long long rows, TcShape s) { return (int)((rows + s.rg * 16 - 1) / (s.rg * 16)); }
/* value slices of a DVP-dim block: vs_mode's forced count (0: none), or the rule's (8), doubling
 * while more(vs) holds; at most DVP / 128 */
template <class F> static inline int tc_value_slices(int DVP, int vs_mode, F more) {
    const int vs_max = DVP / 128;
    int vs = vs_mode == 0 ? 1 : vs_mode;
    if (vs_mode == 8)
        for (vs = 1; vs < vs_max && more(vs);) vs *= 2;
    return vs < vs_max ? vs : vs_max;
}
static inline TcShape tc_shape(long long ncq, int T, int G, int n_kv_heads, int DVP, int HDP, bool async,
                               bool wide_fits, int n_sms, size_t smem_optin, int rg_forced, int vs_mode) {
    TcShape s = {4, 2, 1};
    const long long rows = (long long)T * G, blocks4 = ncq * ((rows + TC_ROWS - 1) / TC_ROWS) * n_kv_heads;
    /* 64-row blocks once they fill a third of the SMs: below that the 16-row blocks (4x as many,
     * each a quarter of the work) finish sooner. Measured (cuda_ops_bench --attention, H100,
     * 2026-12-05): 34 blocks (1K, T = 17) faster as 16-row blocks; 64 (32K, T = 1) and 130 (1K,
     * T = 65) faster as 64-row blocks. And only where the 64-row blocks are more than half full: a
     * block costs the same full or not, so 8 heads at T = 1 (8 rows of 64) ran the 32K decode in
     * 62.8 us as 64 blocks of 64 rows, 53.9 as 16-row blocks (H100, 2026-12-07), where 8 heads at
     * T = 17 (136 rows in 192) stayed faster as 64-row blocks (8K: 85.3 against 116.9 us). */
    s.rg = rg_forced ? rg_forced : blocks4 * 3 < n_sms || !tc_fills_half(rows) ? 1 : 4;
    if (s.rg == 4 && async && wide_fits && DVP >= 128 && tc_smem_bytes(HDP, 4, 8) <= smem_optin) {
        /* value slices while the grid stays within one block an SM (a wide block takes most of an
         * SM's shared memory) */
        s.kw = 8;
        s.vs = tc_value_slices(DVP, vs_mode, [&](int vs) { return blocks4 * vs * 2 <= n_sms; });
        return s;
    }
    if (s.rg == 4 && tc_smem_bytes(HDP, 4) > smem_optin) s.rg = 1;   /* e.g. sm_120's 99 KB */
    if (s.rg == 1 && vs_mode != 0 && async && DVP >= 128 && tc_smem_bytes(HDP, 1, 8) <= smem_optin &&
        tc_scores_smem_bytes(HDP) <= smem_optin) {
        s.kw = 8;
        const long long blocks1 = ncq * ((rows + 15) / 16) * n_kv_heads;
        s.vs = tc_value_slices(DVP, vs_mode, [&](int vs) { return blocks1 * vs < 2LL * n_sms; });
    }
    return s;
}
/* the tail launch's chunk positions (grid x): the new rows, from past's chunk on, span at most these */
static inline int tc_tail_chunks(int T) { return (T + TC_CHUNK - 1) / TC_CHUNK + 1; }

/* The tail launch's shape (tree masks): its blocks hold one query's G rows each, so where those
 * fill a 64-row block at most half (G <= 32) it costs what a full one does (ncu, H100, a TP-8 rank's
 * 17-row verify at 8K, 8 heads: the tail's 34 wide blocks took 46 us a layer beside the shared
 * launch's 60; with 16-row tail blocks the rank's verify step at 8K went from 7.506 to 6.793 ms,
 * 2026-12-07). There the tail takes the rule's 16-row shape for its own grid (ncx chunk positions x
 * T queries x the 16-row blocks of G), whatever the shared launch took; a forced row-group count
 * applies to both. Shapes change no bits (above). */
static inline TcShape tc_tail_shape(TcShape shared, long long ncx, int T, int G, int n_kv_heads, int DVP, int HDP,
                                    bool async, bool wide_fits, int n_sms, size_t smem_optin, int rg_forced,
                                    int vs_mode) {
    if (rg_forced || shared.rg == 1 || tc_fills_half(G)) return shared;
    /* G padded to 16: tc_shape counts the tail's blocks */
    return tc_shape(ncx, T, (G + 15) / 16 * 16, n_kv_heads, DVP, HDP, async, wide_fits, n_sms, smem_optin, 1, vs_mode);
}
/* whether the shape's blocks are tc_wide_kernel's (64 rows, 8 warps spanning them) */
static inline bool tc_wide(TcShape s) { return s.rg == 4 && s.kw == 8; }
/* threads of a block of that shape */
static inline int tc_threads(TcShape s) { return tc_wide(s) ? TW_NTH : s.rg * 32 * s.kw; }
/* whether the shape's values kernel takes S from tc_scores_kernel, launched before it */
static inline bool tc_split(TcShape s) { return s.rg == 1 && s.kw == 8; }

/* Whether a shared launch of this shape puts the row blocks on grid x and the chunks on y: the
 * 64-row blocks of tc_wide_kernel do, so the blocks reading one chunk's keys run together and find
 * them in L2. With the chunks on x a wave spans all of them (the whole cache: 37 MB at 32K), and
 * ncu counted 29% of the verify's L2 reads missing (H100, 32K, T = 257); rows first took that call
 * from 8049 to 7845 us. The 16-row shapes keep the chunks on x (rows first not measured there). */
static inline bool tc_rows_fastest(TcShape s) { return tc_wide(s); }

/* the kernel instance of a shape, or NULL (no instance for that DVP) */
typedef void (*TcKernel)(TcArgs);
static inline TcKernel tc_kernel(int DVP, bool async, TcShape s) {
    if (tc_wide(s)) {   /* async, DVP >= 128 * vs (tc_shape) */
        if (DVP == 128) return tc_wide_kernel<128, 1>;
        if (DVP == 256) return s.vs == 1 ? tc_wide_kernel<256, 1> : tc_wide_kernel<256, 2>;
        if (DVP == 512)
            return s.vs == 1 ? tc_wide_kernel<512, 1> : s.vs == 2 ? tc_wide_kernel<512, 2> : tc_wide_kernel<512, 4>;
        return NULL;
    }
    if (s.kw == 8) {   /* async, rg 1, DVP >= 128 * vs (tc_shape); S from tc_scores_kernel */
        if (DVP == 128) return tc_chunk_kernel<128, true, 1, 8, 1, true>;
        if (DVP == 256)
            return s.vs == 1 ? tc_chunk_kernel<256, true, 1, 8, 1, true> : tc_chunk_kernel<256, true, 1, 8, 2, true>;
        if (DVP == 512)
            return s.vs == 1 ? tc_chunk_kernel<512, true, 1, 8, 1, true>
                 : s.vs == 2 ? tc_chunk_kernel<512, true, 1, 8, 2, true> : tc_chunk_kernel<512, true, 1, 8, 4, true>;
        return NULL;
    }
#define TC_PICK(D)                                                                                  \
    if (DVP == D)                                                                                   \
        return s.rg == 1 ? (async ? tc_chunk_kernel<D, true, 1> : tc_chunk_kernel<D, false, 1>)     \
                         : (async ? tc_chunk_kernel<D, true, 4> : tc_chunk_kernel<D, false, 4>);
    TC_PICK(32) TC_PICK(64) TC_PICK(128) TC_PICK(256) TC_PICK(512)
#undef TC_PICK
    return NULL;
}

/* the shared launch's chunks for queries [t0, t0 + tb): those whose ordinals are the same rows
 * for every query (tree mask: the committed prefix; device past: all, the blocks past it exit) */
static inline int tc_shared_chunks(int S, int past, int t0, int tb, bool causal, bool visible, bool d_past) {
    if (visible) return d_past ? (S + TC_CHUNK - 1) / TC_CHUNK : past / TC_CHUNK;
    int max_vis = d_past ? S : causal ? past + t0 + tb : S;
    if (max_vis > S) max_vis = S;
    return (max_vis + TC_CHUNK - 1) / TC_CHUNK;
}

}  // namespace mla
#endif
