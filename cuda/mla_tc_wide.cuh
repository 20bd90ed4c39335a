/* mla_tc_wide.cuh: the 64-row block of the tensor-core attention in a layout where each warp
 * spans all 64 rows (included by mla_tc.cuh after tc_chunk_kernel; compiled on the CPU by
 * scripts/bench/mla_emu/ too).
 *
 * Why: in tc_chunk_kernel's 64-row block a warp owns 16 rows, so every key or value fragment it
 * loads from shared memory feeds one mma; ncu of the verify at 32K (T = 257) counted ~10
 * instructions per mma and 0.24 issued per cycle per scheduler (8 warps on an SM). Here warp w
 * owns keys [64w, 64w + 64) of the chunk in phase 1 and value dims [w DW, (w + 1) DW) in phase 2,
 * for all four 16-row m-tiles, so each fragment feeds four mma, and a stage holds a whole k-step
 * of the chunk (512 keys x 32 key dims, or 32 keys x all value dims), halving the barriers.
 *
 * The bits are tc_chunk_kernel's: every S element is one mma accumulator over the key dims in
 * ascending 16-dim steps; the max is exact; p = bf16(exp2(s - m)); l is summed from P in shared
 * memory in the KW = 2 order (as the KW = 8 path does); every O element is one mma accumulator
 * over the chunk's 32 16-key steps in ascending order, all of them always run; the partials go
 * to the same slots. Only which warp computes an element changes. scripts/bench/mla_emu checks
 * this kernel against the others bit for bit (its 4-row-group mode), and against float64.
 *
 * Requires cp.async loads (tc_shape: async), DVP >= 128 (a warp's value dims: DVP / 8 >= 16) and
 * a cache whose rows tc_wide_load can address (tc_wide_offsets_fit). */
#ifndef KD_MLA_TC_WIDE_CUH
#define KD_MLA_TC_WIDE_CUH

namespace mla {

constexpr int TW_WARPS = 8, TW_NTH = TW_WARPS * 32, TW_ROWS = 64;
constexpr int TW_STAGES = 3;
constexpr int TW_D1 = 32;                     /* phase 1 stage: all TC_CHUNK keys x 32 key dims */
constexpr int TW_P1LD = TW_D1 + 8;            /* its row stride (bf16): 80 bytes, ldmatrix conflict-free */
constexpr int TW_K2 = 32;                     /* phase 2 stage: 32 keys x DVP value dims */
constexpr int TW_STAGE_BYTES = TC_CHUNK * TW_P1LD * 2;
static_assert(TW_K2 * (TC_DV_MAX + 8) * 2 <= TW_STAGE_BYTES, "a phase-2 stage fits");

/* Q (phase 1), then P (phase 2) in the same rows; stages; the per-row and per-key tables */
static inline size_t tc_wide_smem_bytes(int HDP) {
    const size_t qp = (size_t)TW_ROWS * (HDP + 8 > TC_PLD ? HDP + 8 : TC_PLD) * 2;
    return qp + (size_t)TW_STAGES * TW_STAGE_BYTES + 3 * (size_t)TC_CHUNK * 4   /* koff, voff, row */
           + 4 * TW_ROWS * 4 + (size_t)(TW_WARPS + 3) * TW_ROWS * 4 + 16;         /* rows; max, l, m; n_load */
}

/* stage s of the block: s < nd1: keys [0, TC_CHUNK) x key dims [32 s, +32), stored [key][TW_P1LD];
 * else keys [32 (s - nd1), +32) x the value dims [sl DVS, +DVS) of slice sl (DVS = DVP / VS),
 * stored [key][DVS + 8]. koff / voff: where a tile position's key / value row starts, in 16-byte
 * units from the kv head's first row, or
 * TW_NONE (zeros are stored, nothing is read); dims past hd / dv: zeros. A thread's 16-byte
 * column is the same in every stage, so a copy is a table read, one multiply-add and the cp.async. */
constexpr unsigned TW_NONE = 0xffffffffu;
template <int DVP, int VS>
__device__ __forceinline__ void tc_wide_load(const TcArgs &a, uint16_t *dst, int s, int nd1, const unsigned *koff,
                                             const unsigned *voff, int g, int sl) {
    const int tid = threadIdx.x;
    if (s < nd1) {
        const int u = tid & 3, d0 = s * TW_D1 + u * 8;
        const bool dok = d0 < a.hd;
        const uint4 *src = (const uint4 *)(a.k + (size_t)g * a.kstride + d0);
#pragma unroll
        for (int n = 0; n < TC_CHUNK / (TW_NTH / 4); n++) {
            const int r = (tid >> 2) + n * (TW_NTH / 4);
            const unsigned off = koff[r];
            const bool ok = dok && off != TW_NONE;
            cp16(dst + r * TW_P1LD + u * 8, src + (ok ? off : 0u), ok);
        }
    } else {
        constexpr int DVS = DVP / VS, U = DVS / 8;
        static_assert(TW_NTH % U == 0 && TW_K2 % (TW_NTH / U) == 0, "a thread's value column is fixed");
        const int u = tid % U, k0 = (s - nd1) * TW_K2, d0 = sl * DVS + u * 8;
        const bool dok = d0 < a.dv;
        const uint4 *src = (const uint4 *)(a.v + (size_t)g * a.vstride + d0);
#pragma unroll
        for (int n = 0; n < TW_K2 / (TW_NTH / U); n++) {
            const int r = tid / U + n * (TW_NTH / U);
            const unsigned off = voff[k0 + r];
            const bool ok = dok && off != TW_NONE;
            cp16(dst + r * (DVS + 8) + u * 8, src + (ok ? off : 0u), ok);
        }
    }
}

/* whether every key and value row of the cache can be named in tc_wide_load's 32-bit 16-byte units */
static inline bool tc_wide_offsets_fit(long long rows, long long ldk, long long ldv) {
    return rows * (ldk > ldv ? ldk : ldv) / 8 < (long long)TW_NONE;
}

/* grid as tc_chunk_kernel with RG = 4: x = chunk, y = 64-row block, z = kv head * VS + value
 * slice; x and y swapped where a.rows_fastest (a shared launch: tc_rows_fastest). VS value slices
 * (as tc_chunk_kernel's): each slice block computes the chunk's whole S and softmax and O for its
 * DVP / VS value dims, so an under-filled grid (8 heads at 8K, T = 17: 51 blocks) spreads over
 * more SMs; an O element is the same accumulator over the same 32 16-key steps with the same P
 * fragment whichever slice holds its dim, so no bit moves. */
template <int DVP, int VS>
__global__ void __launch_bounds__(TW_NTH, 1) tc_wide_kernel(TcArgs a) {
    kd_griddep_enter();
    TC_DYNAMIC_SMEM(smem);
    static_assert(DVP >= 128 && DVP <= TC_DV_MAX, "DVP: 128..512");
    static_assert(VS == 1 || VS == 2 || VS == 4, "VS: 1, 2 or 4 value slices");
    constexpr int DVS = DVP / VS;                           /* value dims of this block's slice */
    constexpr int DW = DVS / TW_WARPS, NT2 = DW / 8;       /* phase 2: value dims and n-tiles per warp */
    static_assert(DW >= 16, "a warp's phase-2 tile is at least two n-tiles");
    constexpr int KPW = TC_CHUNK / TW_WARPS, NT1 = KPW / 8; /* phase 1: keys and n-tiles per warp */
    constexpr int ROWS = TW_ROWS;
    const int HDP = a.HDP, QLD = HDP + 8, nd1 = HDP / TW_D1;
    uint16_t *q_s = (uint16_t *)smem;                                 /* [ROWS][QLD], then P [ROWS][TC_PLD] */
    uint16_t *p_s = q_s;
    unsigned char *st_s = smem + (size_t)ROWS * (QLD > TC_PLD ? QLD : TC_PLD) * 2;
    unsigned *koff_s = (unsigned *)(st_s + TW_STAGES * TW_STAGE_BYTES);   /* [CHUNK] key row (tc_wide_load) */
    unsigned *voff_s = koff_s + TC_CHUNK;                             /* [CHUNK] value row */
    int *row_s = (int *)(voff_s + TC_CHUNK);                          /* [CHUNK] cache row of tile pos */
    int *nv_s = row_s + TC_CHUNK;                                     /* [ROWS] visible keys in the chunk */
    int *qr_s = nv_s + ROWS;                                          /* [ROWS] the query's cache row */
    int *t_s = qr_s + ROWS;                                           /* [ROWS] query index, -1: inert */
    int *h_s = t_s + ROWS;                                            /* [ROWS] query head */
    float *red_s = (float *)(h_s + ROWS);                             /* [WARPS][ROWS] max */
    float *lred_s = red_s + TW_WARPS * ROWS;                          /* [2][ROWS] l halves */
    float *m_s = lred_s + 2 * ROWS;                                   /* [ROWS] the chunk's max */
    int *nl_s = (int *)(m_s + ROWS);

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = (int)blockIdx.z / VS, sl = (int)blockIdx.z % VS;
    int past, S;
    tc_past_rows(a, &past, &S);
    int c, tq, rbase;
    const int bx = a.rows_fastest ? (int)blockIdx.y : (int)blockIdx.x;   /* the chunk */
    const int by = a.rows_fastest ? (int)blockIdx.x : (int)blockIdx.y;   /* the row block */
    if (!tc_block_place(a, past, bx, by, ROWS, &c, &tq, &rbase)) return;
    const int o0 = c * TC_CHUNK;

    const int n_load = tc_block_rows<ROWS>(a, past, S, o0, tq, rbase, g, t_s, h_s, nv_s, qr_s, nl_s);
    if (n_load == 0) return;

    for (int j = tid; j < TC_CHUNK; j += TW_NTH) {
        const int row = j < n_load ? (a.tail ? tc_ordinal_row(a, past, a.t0 + tq, o0 + j) : o0 + j) : -1;
        row_s[j] = row;
        koff_s[j] = row >= 0 ? (unsigned)((long long)row * a.ldk / 8) : TW_NONE;
        voff_s[j] = row >= 0 ? (unsigned)((long long)row * a.ldv / 8) : TW_NONE;
    }
    /* Q rows: cp.async (they land with stage 0's group), or plain loads */
    const unsigned qu = (unsigned)HDP / 8;
    for (unsigned i = tid; i < ROWS * qu; i += TW_NTH) {
        const int r = (int)(i / qu), d0 = (int)(i - (unsigned)r * qu) * 8, t = t_s[r];
        uint16_t *dst = q_s + r * QLD + d0;
        const uint16_t *src = a.q + (size_t)(t >= 0 ? t : 0) * a.ldq + (size_t)h_s[r] * a.hd + d0;
        if (a.qvec) {
            cp16(dst, t >= 0 && d0 < a.hd ? (const void *)src : (const void *)a.q, t >= 0 && d0 < a.hd);
        } else {
            for (int e = 0; e < 8; e++) dst[e] = (t >= 0 && d0 + e < a.hd) ? src[e] : (uint16_t)0;
        }
    }
    __syncthreads();   /* the offset tables (and plain-loaded Q) */

    const int ns = nd1 + TC_CHUNK / TW_K2;
#define TW_STAGE(i) ((uint16_t *)(st_s + (size_t)((i) % TW_STAGES) * TW_STAGE_BYTES))
#define TW_LOAD(i) tc_wide_load<DVP, VS>(a, TW_STAGE(i), (i), nd1, koff_s, voff_s, g, sl)
    for (int s0 = 0; s0 < TW_STAGES - 1; s0++) {
        if (s0 < ns) TW_LOAD(s0);
        cp_commit();
    }

    /* ---- phase 1: S = Q K^T; warp w owns keys w*KPW + [0, KPW) of all rows (m-tiles mt) ---- */
    float sc[4][NT1][4];
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int nt = 0; nt < NT1; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[mt][nt][e] = 0.0f;
    const bool keys_live = w * KPW < n_load;   /* else all of this warp's keys are masked */
    const uint16_t *qa = q_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * QLD + (lane >> 4) * 8;
    const int kb_off = (w * KPW + ((lane >> 4) << 3) + (lane & 7)) * TW_P1LD + ((lane >> 3) & 1) * 8;
    int s = 0;
    for (; s < nd1; s++) {
        cp_wait<TW_STAGES - 2>();
        __syncthreads();
        if (s + TW_STAGES - 1 < ns) TW_LOAD(s + TW_STAGES - 1);
        cp_commit();
        if (!keys_live) continue;
        const uint16_t *ks = TW_STAGE(s);
#pragma unroll
        for (int kk = 0; kk < TW_D1 / 16; kk++) {   /* the 16-dim steps 2s + kk, ascending */
            uint32_t af[4][4];
#pragma unroll
            for (int mt = 0; mt < 4; mt++) ldsm_x4(af[mt], qa + mt * 16 * QLD + s * TW_D1 + kk * 16);
#pragma unroll
            for (int np = 0; np < NT1 / 2; np++) {
                uint32_t bfr[4];
                ldsm_x4(bfr, ks + kb_off + np * 16 * TW_P1LD + kk * 16);
#pragma unroll
                for (int mt = 0; mt < 4; mt++) {
                    mma16816(sc[mt][2 * np], af[mt], bfr);
                    mma16816(sc[mt][2 * np + 1], af[mt], bfr + 2);
                }
            }
        }
    }

    /* ---- softmax: this thread's rows mt*16 + lane/4 (+8: hr), keys w*KPW + nt*8 + 2(lane&3) + e ---- */
    float mx[4][2];
#pragma unroll
    for (int mt = 0; mt < 4; mt++) {
        mx[mt][0] = mx[mt][1] = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT1; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hr = e >> 1, row = mt * 16 + (lane >> 2) + hr * 8;
                const int j = w * KPW + nt * 8 + 2 * (lane & 3) + (e & 1);
                bool ok = j < nv_s[row] && (a.window <= 0 || qr_s[row] - row_s[j] < a.window);
                float v = ok ? sc[mt][nt][e] * a.scale2 : -INFINITY;
                sc[mt][nt][e] = v;
                mx[mt][hr] = fmaxf(mx[mt][hr], v);
            }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            mx[mt][hr] = fmaxf(mx[mt][hr], shfl_xor(mx[mt][hr], 1));
            mx[mt][hr] = fmaxf(mx[mt][hr], shfl_xor(mx[mt][hr], 2));
            if ((lane & 3) == 0) red_s[w * ROWS + mt * 16 + (lane >> 2) + hr * 8] = mx[mt][hr];
        }
    }
    __syncthreads();   /* also: every warp is done reading Q, so P may overwrite it */
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = mt * 16 + (lane >> 2) + hr * 8;
            float m = red_s[row];
#pragma unroll
            for (int v = 1; v < TW_WARPS; v++) m = fmaxf(m, red_s[v * ROWS + row]);
#pragma unroll
            for (int nt = 0; nt < NT1; nt++) {
                const int j = w * KPW + nt * 8 + 2 * (lane & 3);
                float v0 = sc[mt][nt][2 * hr], v1 = sc[mt][nt][2 * hr + 1];
                uint16_t b0 = v0 == -INFINITY ? (uint16_t)0 : f2bf(exp2f(v0 - m));
                uint16_t b1 = v1 == -INFINITY ? (uint16_t)0 : f2bf(exp2f(v1 - m));
                *(uint32_t *)(p_s + row * TC_PLD + j) = (uint32_t)b0 | ((uint32_t)b1 << 16);
            }
            if (w == 0 && (lane & 3) == 0) m_s[row] = m;
        }
    __syncthreads();
    /* l: tc_chunk_kernel's order (above it), from P: item i takes quad position q = i & 3 of half
     * h = (i >> 2) & 1 of row i >> 3; whole warps, so the quad shuffles stay inside one */
    for (int i = tid; i < 8 * ROWS; i += TW_NTH) {
        const int q = i & 3, h = (i >> 2) & 1, row = i >> 3;
        const uint16_t *pr = p_s + row * TC_PLD + h * 64 + 2 * q;
        float v = 0.0f;
#pragma unroll 4
        for (int kg = 0; kg < 4; kg++)
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const uint32_t x = *(const uint32_t *)(pr + kg * TC_KSLAB + nt * 8);
                v += bf2f((uint16_t)(x & 0xffffu));
                v += bf2f((uint16_t)(x >> 16));
            }
        v += shfl_xor(v, 1);
        v += shfl_xor(v, 2);
        if (q == 0) lred_s[h * ROWS + row] = v;
    }

    /* ---- phase 2: O = P V; warp w owns value dims sl*DVS + w*DW + [0, DW) of all rows ---- */
    float oacc[4][NT2][4];
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int nt = 0; nt < NT2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) oacc[mt][nt][e] = 0.0f;
    const uint16_t *pa = p_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * TC_PLD + (lane >> 4) * 8;
    const int vb_off = (((lane >> 3) & 1) * 8 + (lane & 7)) * (DVS + 8) + w * DW + (lane >> 4) * 8;
    for (int k2 = 0; s < ns; k2++, s++) {
        cp_wait<TW_STAGES - 2>();
        __syncthreads();   /* also publishes l (above) before the first step */
        if (s + TW_STAGES - 1 < ns) TW_LOAD(s + TW_STAGES - 1);
        cp_commit();
        const uint16_t *vs = TW_STAGE(s);
#pragma unroll
        for (int kk = 0; kk < TW_K2 / 16; kk++) {   /* the 16-key steps 2 k2 + kk, ascending */
            uint32_t af[4][4];
#pragma unroll
            for (int mt = 0; mt < 4; mt++) ldsm_x4(af[mt], pa + mt * 16 * TC_PLD + (k2 * (TW_K2 / 16) + kk) * 16);
#pragma unroll
            for (int np = 0; np < NT2 / 2; np++) {
                uint32_t bfr[4];
                ldsm_x4_trans(bfr, vs + vb_off + kk * 16 * (DVS + 8) + np * 16);
#pragma unroll
                for (int mt = 0; mt < 4; mt++) {
                    mma16816(oacc[mt][2 * np], af[mt], bfr);
                    mma16816(oacc[mt][2 * np + 1], af[mt], bfr + 2);
                }
            }
        }
    }
    cp_wait<0>();
#undef TW_LOAD
#undef TW_STAGE

    /* ---- partials (m, l, o) of this chunk for the block's live rows ---- */
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = mt * 16 + (lane >> 2) + hr * 8, t = t_s[row];
            if (t < 0) continue;
            const size_t slot = tc_slot(a, t, h_s[row], c);
            if (sl == 0 && w == 0 && (lane & 3) == 0) {
                a.pm[slot] = m_s[row];
                a.pl[slot] = lred_s[row] + lred_s[ROWS + row];
            }
            float *po = a.po + slot * a.dv;
#pragma unroll
            for (int nt = 0; nt < NT2; nt++) {
                const int d = sl * DVS + w * DW + nt * 8 + 2 * (lane & 3);   /* even; dv % 8 == 0 (async) */
                if (d < a.dv) *(float2 *)(po + d) = make_float2(oacc[mt][nt][2 * hr], oacc[mt][nt][2 * hr + 1]);
            }
        }
}

}  // namespace mla
#endif
