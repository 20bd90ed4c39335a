/* mla_tc_scores.cuh: S = Q K^T for the split 16-row path (included by mla_tc.cuh after
 * tc_chunk_kernel; compiled on the CPU by scripts/bench/mla_emu/ too).
 *
 * Why: a 16-row block of tc_chunk_kernel (decode, small T at short context) reads its chunk's
 * whole key tile (512 keys x 576 dims, 590 KB at MLA's dims) for 16 rows, and each of its value
 * slices reads it again, one SM streaming a whole tile (cuda_ops_bench, H100, 2026-12-05: K2.6
 * decode at 1K, 48 such blocks, 38 us for 1.2 MB of cache). Here a block takes 64 keys (74 KB) of
 * the chunk for the same 16 rows, so 8 blocks share a chunk's keys, and writes S to a.ps;
 * tc_chunk_kernel<..., SPLIT> then runs the softmax and O = P V from it. 32-key blocks of 2
 * warps (twice the blocks, each half the bytes) were slower: H100, 2026-12-07, K2.6 decode at
 * 64 heads 21.9 -> 24.0 us at 1K and 42.8 -> 47.1 at 8K, a TP-8 rank's decode step +2%.
 *
 * The bits are tc_chunk_kernel's: an S element is one mma accumulator, from 0, over the key
 * dims in ascending 16-dim steps up to HDP (dims past hd are zeros in both), with the same
 * operands; which warp or block computes it changes nothing. Keys past the block's loaded
 * count (n_load) are zeros, as there; a key block wholly past it writes nothing and the
 * values kernel reads 0 for it (masked either way). */
#ifndef KD_MLA_TC_SCORES_CUH
#define KD_MLA_TC_SCORES_CUH

namespace mla {

constexpr int TS_WARPS = TC_SKEYS / 16, TS_NTH = TS_WARPS * 32, TS_ROWS = 16;
constexpr int TS_KB = TC_CHUNK / TC_SKEYS;   /* key blocks a chunk */
static_assert(TC_SKEYS % 16 == 0 && TC_CHUNK % TC_SKEYS == 0, "a warp owns 16 keys (two n-tiles); blocks tile a chunk");

/* Q rows, the key tile, the tile's cache rows, the row tables */
static inline size_t tc_scores_smem_bytes(int HDP) {
    return (size_t)(TS_ROWS + TC_SKEYS) * (HDP + 8) * 2 + (size_t)TC_SKEYS * 4 + 4 * TS_ROWS * 4 + 16;
}

/* grid: x = chunk * TS_KB + key block (tail: chunk - past / TC_CHUNK), y and z as the values
 * kernel's (tc_chunk_kernel with RG 1, VS slices: z = kv head here) */
__global__ void __launch_bounds__(TS_NTH) tc_scores_kernel(TcArgs a) {
    kd_griddep_enter();
    TC_DYNAMIC_SMEM(smem);
    const int HDP = a.HDP, LD = HDP + 8;
    uint16_t *q_s = (uint16_t *)smem;                        /* [TS_ROWS][LD] */
    uint16_t *k_s = q_s + TS_ROWS * LD;                      /* [TC_SKEYS][LD] */
    int *row_s = (int *)(k_s + TC_SKEYS * LD);               /* [TC_SKEYS] cache row of a key, -1: none */
    int *nv_s = row_s + TC_SKEYS, *qr_s = nv_s + TS_ROWS, *t_s = qr_s + TS_ROWS, *h_s = t_s + TS_ROWS;
    int *nl_s = h_s + TS_ROWS;

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = blockIdx.z;
    int past, S;
    tc_past_rows(a, &past, &S);
    const int kb = (int)blockIdx.x % TS_KB;
    int c, tq, rbase;
    if (!tc_block_place(a, past, (int)blockIdx.x / TS_KB, (int)blockIdx.y, TS_ROWS, &c, &tq, &rbase)) return;
    const int o0 = c * TC_CHUNK, j0 = kb * TC_SKEYS;
    const int n_load = tc_block_rows<TS_ROWS>(a, past, S, o0, tq, rbase, g, t_s, h_s, nv_s, qr_s, nl_s);
    if (n_load <= j0) return;

    for (int j = tid; j < TC_SKEYS; j += TS_NTH)
        row_s[j] = j0 + j < n_load ? (a.tail ? tc_ordinal_row(a, past, a.t0 + tq, o0 + j0 + j) : o0 + j0 + j) : -1;
    tc_load_q<TS_NTH>(a, q_s, LD, TS_ROWS, t_s, h_s);
    __syncthreads();   /* row_s */
    const uint16_t *kbase = a.k + (size_t)g * a.kstride;
    for (int i = tid; i < TC_SKEYS * (HDP / 8); i += TS_NTH) {   /* the whole key tile in one group */
        const int r = i / (HDP / 8), d0 = (i % (HDP / 8)) * 8;
        tc_copy8<true>(k_s + r * LD + d0, kbase, row_s[r], a.ldk, d0, a.hd);
    }
    cp_commit();
    cp_wait<0>();
    __syncthreads();

    /* warp w: keys j0 + 16 w + [0, 16) (two n-tiles) of the 16 rows, the 16-dim steps ascending */
    float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    const uint16_t *qa = q_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
    const uint16_t *kbp = k_s + (w * 16 + ((lane >> 4) << 3) + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
    for (int d = 0; d < HDP / 16; d++) {
        uint32_t af[4], bfr[4];
        ldsm_x4(af, qa + d * 16);
        ldsm_x4(bfr, kbp + d * 16);
        mma16816(sc[0], af, bfr);
        mma16816(sc[1], af, bfr + 2);
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int row = (lane >> 2) + hr * 8, t = t_s[row];
        if (t < 0) continue;
        float *ps = a.ps + tc_slot(a, t, h_s[row], c) * TC_CHUNK;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
            *(float2 *)(ps + j0 + w * 16 + nt * 8 + 2 * (lane & 3)) = make_float2(sc[nt][2 * hr], sc[nt][2 * hr + 1]);
    }
}

}  // namespace mla
#endif
