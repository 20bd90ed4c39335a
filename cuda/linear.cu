/* linear.cu: the dense bf16 GEMM of the CUDA backend (linear, head_matmul, bf16 experts).
 *
 * Why our own kernel and not cuBLAS: cuBLAS picks its algorithm (tile shape, split-K)
 * from M, so the same token row can get different bits in a batch of 1 and a batch of
 * 37. Here every output element is computed by the same sequence of tensor-core MMAs
 * (mma.sync m16n8k16, bf16 in, fp32 accumulate) over k in a fixed order, and neither the
 * row's position in its tile nor the tile's height (16, 64 or 128 rows, by M) changes
 * anything (an MMA row depends only on that row of A). Split-K, used to give small-M
 * launches enough blocks, is chosen from (N, K, batch, SM count) only, never from M, and
 * its partial sums are added in split order, by the last block of each tile to finish when the
 * tile has few of them (a decode step's linears: one launch each, not two) or else by a second
 * kernel (gemm_sum_in_kernel). So a row's result is bit-identical for any M.
 *
 * Loads: cp.async 16-byte copies through a 3- or 4-stage shared-memory pipeline when the
 * operands are 16-byte aligned; otherwise (odd leading dims, f32 activations) plain
 * loads into the same shared tiles, so both paths feed identical MMAs.
 */
#include "cuda_internal.cuh"
#include "mla_mma.cuh"   /* cp16 / cp_commit / cp_wait, ldmatrix, mma16816 */
#include "gemm.cuh"

namespace {
using namespace gemm;

template <int TBM>
kd_status launch_gemm(kd_cuda *c, bool async, bool kmajor, dim3 grid, const kd_gemm_args &s, int n_tiles, int splits,
                      int kts, float *partial, int *tile_count) {
    void (*fn)(kd_gemm_args, int, int, int, float *, int *) =
        async ? (kmajor ? gemm_kernel<TBM, true, true> : gemm_kernel<TBM, true, false>)
              : (kmajor ? gemm_kernel<TBM, false, true> : gemm_kernel<TBM, false, false>);
    const size_t smem = gemm_smem<TBM>();
    KD_TRY(kd_cuda_smem(c, (const void *)fn, smem));
    return kd_launch_pdl("gemm_kernel", fn, grid, THREADS, smem, c->stream, s, n_tiles, splits, kts, partial,
                         tile_count);
}

}  // namespace

/* Split-K choice: from N, K, batch and the SM count only (never M, see top; the column tiles it
 * counts are SPLIT_BN wide whatever width the launch's blocks take). */
static int gemm_splits(const kd_cuda *c, const kd_gemm_args *g, int *kts_per_split) {
    int kt_total = (g->K + BK - 1) / BK;
    int blocks = ((g->N + SPLIT_BN - 1) / SPLIT_BN) * g->batch;
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

    bool async = g.a_dtype == KD_BF16 && g.K % 8 == 0 && g.lda % 8 == 0 && g.ldb % 8 == 0 &&
                 g.a_zstride % 8 == 0 && g.b_zstride % 8 == 0 && aligned16(g.A) &&
                 (g.b_ptrs || aligned16(g.B)) && (!g.B1 || aligned16(g.B1)) && (g.b_kmajor || g.N % 8 == 0);
    /* grouped weights: their pointers are checked at experts_load (16-byte aligned allocations) */

    /* split-K: the tiles' arrival counters (gemm_counter_bytes), then the partial sums; bound the
     * workspace by running M in chunks (rows are independent) */
    int m_chunk = g.M;
    float *partial = NULL;
    int *tile_count = NULL;
    const size_t counters = gemm_counter_bytes(c->n_sms);
    if (splits > 1) {
        size_t per_row = (size_t)splits * g.batch * g.N * sizeof(float);
        size_t cap = (size_t)255 << 20;
        m_chunk = (int)(cap / per_row);
        if (m_chunk < BM) m_chunk = BM;
        if (m_chunk > g.M) m_chunk = g.M;
        void *ws;
        KD_TRY(kd_cuda_ws(be, KD_WS_GEMM, counters + per_row * m_chunk, &ws));
        tile_count = (int *)ws;
        partial = (float *)((char *)ws + counters);
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
        /* rows per block (grouped launches: no group has more rows than M) */
        const int tbm = gemm_tbm(s.M);
        const int n_tiles = (g.N + gemm_tbn(tbm) - 1) / gemm_tbn(tbm);
        dim3 grid((s.M + tbm - 1) / tbm, n_tiles * splits, s.batch);
        const bool in_kernel = splits > 1 && gemm_sum_in_kernel(s.M < tbm ? s.M : tbm, splits) &&
                               (size_t)grid.x * n_tiles * s.batch * sizeof(int) <= counters;
        if (grid.y > 65535 || grid.z > 65535)
            return kd_fail(KD_ERR_ARG, "cuda gemm: grid too large (N=%d: %d column tiles x %d splits, batch=%d; at most 65535 each)",
                           s.N, n_tiles, splits, s.batch);
        int *counts = in_kernel ? tile_count : NULL;
        if (tbm == BM_SMALL)
            KD_TRY(launch_gemm<BM_SMALL>(c, async_s, g.b_kmajor, grid, s, n_tiles, splits, kts, partial, counts));
        else if (tbm == BM)
            KD_TRY(launch_gemm<BM>(c, async_s, g.b_kmajor, grid, s, n_tiles, splits, kts, partial, counts));
        else KD_TRY(launch_gemm<BM_LARGE>(c, async_s, g.b_kmajor, grid, s, n_tiles, splits, kts, partial, counts));
        if (splits > 1 && !in_kernel) {
            const size_t total = (size_t)s.batch * s.M * s.N;
            int blocks = (int)((total + 255) / 256);
            if (blocks > 8 * c->n_sms) blocks = 8 * c->n_sms;
            KD_TRY(kd_launch_pdl("gemm_reduce_kernel", gemm_reduce_kernel, blocks, 256, 0, c->stream, s, splits,
                                 partial));
        }
    }
    return KD_OK;
}

/* ---- fp32 weights: a plain CUDA-core product, one warp per output, fixed order ---- */
__global__ void linear_f32w_kernel(const void *x, int xdt, long long ldx, const float *w, long long ldw,
                                   void *out, int odt, long long ldo, int M, int N, int K) {
    kd_griddep_enter();
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
        return kd_launch_pdl("linear_f32w_kernel", linear_f32w_kernel, blocks, 256, 0, c->stream, x.data, x.dtype, x.ld,
                             (const float *)w->dev, w->cols, out.data, out.dtype, out.ld, x.rows, (int)w->rows,
                             (int)w->cols);
    }
    if (x.dtype == KD_F16) return kd_fail(KD_ERR_ARG, "cuda linear '%s': f16 activations are not supported", name);
    kd_gemm_args g = {};
    g.A = x.data; g.a_dtype = x.dtype; g.lda = x.ld;
    g.B = (const bf16 *)w->dev; g.ldb = w->cols; g.b_kmajor = true;
    g.C = out.data; g.c_dtype = out.dtype; g.ldc = out.ld;
    g.M = x.rows; g.N = (int)w->rows; g.K = (int)w->cols; g.batch = 1;
    return kd_cuda_gemm(be, &g);
}

/* both bf16: one GEMM over the stacked rows (gemm_args.cuh: B1), whose split-K is chosen for
 * their sum; else a linear each */
extern "C" kd_status kd_cuda_linear_pair(kd_backend *be, kd_act x, const kd_weight *w0, const kd_weight *w1,
                                         kd_act out) {
    const char *n0 = w0 && w0->name ? w0->name : "?", *n1 = w1 && w1->name ? w1->name : "?";
    if (!w0 || !w0->dev || !w1 || !w1->dev)
        return kd_fail(KD_ERR_STATE, "cuda linear_pair: weights '%s' and '%s' must be loaded on the device", n0, n1);
    if (w0->cols != w1->cols || out.cols != w0->rows + w1->rows || x.cols != w0->cols || out.rows != x.rows)
        return kd_fail(KD_ERR_ARG, "cuda linear_pair: weights '%s' [%lld, %lld] and '%s' [%lld, %lld], x [%d, %d], "
                       "out [%d, %d]: expected the same input width as x's cols and out's cols = the rows of both", n0,
                       (long long)w0->rows, (long long)w0->cols, n1, (long long)w1->rows, (long long)w1->cols, x.rows,
                       x.cols, out.rows, out.cols);
    if (w0->format != KD_W_BF16 || w1->format != KD_W_BF16 || x.dtype == KD_F16 || !kd_cuda_float_dtype(x.dtype) ||
        !kd_cuda_float_dtype(out.dtype)) {
        KD_TRY(kd_cuda_linear(be, x, w0, kd_act_cols(out, 0, (int)w0->rows)));
        return kd_cuda_linear(be, x, w1, kd_act_cols(out, (int)w0->rows, (int)w1->rows));
    }
    if (x.rows == 0) return KD_OK;
    kd_gemm_args g = {};
    g.A = x.data; g.a_dtype = x.dtype; g.lda = x.ld;
    g.B = (const bf16 *)w0->dev; g.ldb = w0->cols; g.b_kmajor = true;
    g.B1 = (const bf16 *)w1->dev; g.n1 = (int)w0->rows;
    g.C = out.data; g.c_dtype = out.dtype; g.ldc = out.ld;
    g.M = x.rows; g.N = (int)(w0->rows + w1->rows); g.K = (int)w0->cols; g.batch = 1;
    return kd_cuda_gemm(be, &g);
}

/* both bf16: one GEMM whose tiles hold each output column's gate and up products and write
 * silu(g) * u (gemm.cuh: glu_row), its splits those of the pair's linear_pair, so the bits of
 * linear_pair + swiglu; else the two linears (the up product in a workspace) and swiglu */
extern "C" kd_status kd_cuda_linear_swiglu(kd_backend *be, kd_act x, const kd_weight *gate, const kd_weight *up,
                                           kd_act out) {
    const char *n0 = gate && gate->name ? gate->name : "?", *n1 = up && up->name ? up->name : "?";
    if (!gate || !gate->dev || !up || !up->dev)
        return kd_fail(KD_ERR_STATE, "cuda linear_swiglu: weights '%s' and '%s' must be loaded on the device", n0, n1);
    if (gate->cols != up->cols || gate->rows != up->rows || x.cols != gate->cols || out.rows != x.rows ||
        out.cols != gate->rows)
        return kd_fail(KD_ERR_ARG, "cuda linear_swiglu: gate '%s' [%lld, %lld] and up '%s' [%lld, %lld], x [%d, %d], "
                       "out [%d, %d]: expected weights of one shape [I, K], x [T, K] and out [T, I]", n0,
                       (long long)gate->rows, (long long)gate->cols, n1, (long long)up->rows, (long long)up->cols,
                       x.rows, x.cols, out.rows, out.cols);
    if (!kd_cuda_float_dtype(x.dtype) || !kd_cuda_float_dtype(out.dtype) || x.dtype == KD_F16)
        return kd_fail(KD_ERR_ARG, "cuda linear_swiglu '%s': activations must be f32/bf16, got %s -> %s", n0,
                       kd_dtype_name(x.dtype), kd_dtype_name(out.dtype));
    if (x.rows == 0) return KD_OK;
    if (gate->format != KD_W_BF16 || up->format != KD_W_BF16) {
        void *ws;
        KD_TRY(kd_cuda_ws(be, KD_WS_GLU, (size_t)x.rows * out.cols * kd_dtype_size(out.dtype), &ws));
        kd_act u = {ws, x.rows, out.cols, out.cols, out.dtype};
        KD_TRY(kd_cuda_linear(be, x, gate, out));
        KD_TRY(kd_cuda_linear(be, x, up, u));
        return kd_cuda_swiglu(be, out, u, out);
    }
    kd_gemm_args g = {};
    g.A = x.data; g.a_dtype = x.dtype; g.lda = x.ld;
    g.B = (const bf16 *)gate->dev; g.ldb = gate->cols; g.b_kmajor = true;
    g.B1 = (const bf16 *)up->dev; g.n1 = (int)gate->rows; g.glu = true;
    g.C = out.data; g.c_dtype = out.dtype; g.ldc = out.ld;
    g.M = x.rows; g.N = glu_cols((int)gate->rows); g.K = (int)gate->cols; g.batch = 1;
    return kd_cuda_gemm(be, &g);
}

extern "C" kd_status kd_cuda_head_matmul(kd_backend *be, kd_act x, int n_heads, int xstride, int k,
                                         const kd_weight *w, int wstride, int wrow0, bool transposed,
                                         kd_act out, int ocols, int ostride) {
    const char *name = w && w->name ? w->name : "?";
    if (!w || !w->dev) return kd_fail(KD_ERR_STATE, "cuda head_matmul: weight '%s' is not loaded", name);
    if (w->format != KD_W_BF16)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda head_matmul: weight '%s' must be bf16 (got format %d)", name, (int)w->format);
    if (n_heads <= 0 || k <= 0 || ocols <= 0 || ostride < ocols)
        return kd_fail(KD_ERR_ARG, "cuda head_matmul '%s': heads %d, k %d, ocols %d must be positive, ostride %d >= ocols",
                       name, n_heads, k, ocols, ostride);
    if ((long long)(n_heads - 1) * xstride + k > x.cols || (long long)(n_heads - 1) * ostride + ocols > out.cols ||
        x.rows != out.rows)
        return kd_fail(KD_ERR_ARG, "cuda head_matmul '%s': x [%d, %d] / out [%d, %d] too small for %d heads (xstride %d, "
                       "k %d, ocols %d, ostride %d)", name, x.rows, x.cols, out.rows, out.cols, n_heads, xstride, k, ocols,
                       ostride);
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
    g.C = out.data; g.c_dtype = out.dtype; g.ldc = out.ld; g.c_zstride = ostride;
    g.M = x.rows; g.N = ocols; g.K = k; g.batch = n_heads;
    return kd_cuda_gemm(be, &g);
}
