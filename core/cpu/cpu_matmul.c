/* cpu_matmul.c: linear (out = x W^T), a pair of them, and the per-head products of MLA absorption. */
#include "cpu.h"

kd_status kd_cpu_linear(kd_backend *be, kd_act x, const kd_weight *w, kd_act out) {
    KD_TRY(kd_cpu_check_weight("linear", w));
    KD_TRY(kd_cpu_check_f32("linear", "x", x));
    KD_TRY(kd_cpu_check_f32("linear", "out", out));
    if (x.cols != w->cols || out.rows != x.rows || out.cols != w->rows)
        return kd_fail(KD_ERR_ARG, "cpu linear: weight '%s' is [%lld, %lld]: expected x [T, %lld] and out [T, %lld], "
                       "got x %d x %d and out %d x %d", w->name ? w->name : "?", (long long)w->rows,
                       (long long)w->cols, (long long)w->cols, (long long)w->rows, x.rows, x.cols, out.rows, out.cols);
    return kd_cpu_matmul_wt(be, x.data, x.rows, x.ld, x.cols, w, 0, 0, out.cols, out.data, out.ld);
}

/* the definition: each weight's linear into its columns of out (every check first) */
kd_status kd_cpu_linear_pair(kd_backend *be, kd_act x, const kd_weight *w0, const kd_weight *w1, kd_act out) {
    KD_TRY(kd_cpu_check_weight("linear_pair", w0));
    KD_TRY(kd_cpu_check_weight("linear_pair", w1));
    if (w0->cols != w1->cols || out.cols != w0->rows + w1->rows || x.cols != w0->cols || out.rows != x.rows)
        return kd_fail(KD_ERR_ARG, "cpu linear_pair: weights '%s' [%lld, %lld] and '%s' [%lld, %lld], x [%d, %d], "
                       "out [%d, %d]: expected the same input width as x's cols and out's cols = the rows of both",
                       w0->name ? w0->name : "?", (long long)w0->rows, (long long)w0->cols, w1->name ? w1->name : "?",
                       (long long)w1->rows, (long long)w1->cols, x.rows, x.cols, out.rows, out.cols);
    KD_TRY(kd_cpu_linear(be, x, w0, kd_act_cols(out, 0, (int)w0->rows)));
    return kd_cpu_linear(be, x, w1, kd_act_cols(out, (int)w0->rows, (int)w1->rows));
}

/* the definition: linear_pair's products, then swiglu (every check first; the up product in the work
 * buffer, which the matmul does not use) */
kd_status kd_cpu_linear_swiglu(kd_backend *be, kd_act x, const kd_weight *gate, const kd_weight *up, kd_act out) {
    KD_TRY(kd_cpu_check_weight("linear_swiglu", gate));
    KD_TRY(kd_cpu_check_weight("linear_swiglu", up));
    KD_TRY(kd_cpu_check_f32("linear_swiglu", "x", x));
    KD_TRY(kd_cpu_check_f32("linear_swiglu", "out", out));
    if (gate->cols != up->cols || gate->rows != up->rows || x.cols != gate->cols || out.rows != x.rows ||
        out.cols != gate->rows)
        return kd_fail(KD_ERR_ARG, "cpu linear_swiglu: gate '%s' [%lld, %lld] and up '%s' [%lld, %lld], x [%d, %d], "
                       "out [%d, %d]: expected weights of one shape [I, K], x [T, K] and out [T, I]",
                       gate->name ? gate->name : "?", (long long)gate->rows, (long long)gate->cols,
                       up->name ? up->name : "?", (long long)up->rows, (long long)up->cols, x.rows, x.cols, out.rows,
                       out.cols);
    if (x.rows == 0) return KD_OK;
    float *u;
    KD_TRY(kd_cpu_work(be, (size_t)x.rows * out.cols, &u));
    kd_act ua = {u, x.rows, out.cols, out.cols, KD_F32};
    KD_TRY(kd_cpu_linear(be, x, gate, out));
    KD_TRY(kd_cpu_linear(be, x, up, ua));
    return kd_cpu_swiglu(be, out, ua, out);
}

/* Per head h: x_h = x[:, h*xstride : h*xstride + k].
 * transposed: W_h = w rows [h*wstride + wrow0, +ocols) (each k = w->cols wide), out_h = x_h W_h^T.
 * else:       W_h = w rows [h*wstride + wrow0, +k) (each ocols = w->cols wide), out_h = x_h W_h.
 * out_h = out[:, h*ostride : h*ostride + ocols]. */
kd_status kd_cpu_head_matmul(kd_backend *be, kd_act x, int n_heads, int xstride, int k,
                             const kd_weight *w, int wstride, int wrow0, bool transposed,
                             kd_act out, int ocols, int ostride) {
    KD_TRY(kd_cpu_check_weight("head_matmul", w));
    KD_TRY(kd_cpu_check_f32("head_matmul", "x", x));
    KD_TRY(kd_cpu_check_f32("head_matmul", "out", out));
    int64_t wrows_h = transposed ? ocols : k;
    if (n_heads <= 0 || k <= 0 || ocols <= 0 || ostride < ocols || (n_heads - 1) * xstride + k > x.cols ||
        out.rows != x.rows || (int64_t)(n_heads - 1) * ostride + ocols > out.cols ||
        (transposed ? k : ocols) != w->cols || (int64_t)(n_heads - 1) * wstride + wrow0 + wrows_h > w->rows ||
        wrow0 < 0)
        return kd_fail(KD_ERR_ARG, "cpu head_matmul: %d heads, k %d, ocols %d (stride %d), x %d x %d (stride %d), "
                       "out %d x %d, weight '%s' [%lld, %lld] rows h*%d+%d (%s)", n_heads, k, ocols, ostride, x.rows,
                       x.cols, xstride, out.rows, out.cols, w->name ? w->name : "?", (long long)w->rows,
                       (long long)w->cols, wstride, wrow0, transposed ? "transposed" : "plain");
    const float *xd = x.data;
    float *od = out.data;
    for (int h = 0; h < n_heads; h++) {
        int64_t r0 = (int64_t)h * wstride + wrow0;
        if (transposed) {
            KD_TRY(kd_cpu_matmul_wt(be, xd + (size_t)h * xstride, x.rows, x.ld, k, w, r0, 0, ocols,
                                    od + (size_t)h * ostride, out.ld));
            continue;
        }
        /* out_h[t, :] = sum_i x_h[t, i] * W_h[i, :], i ascending (same order for every T) */
        float *row;
        KD_TRY(kd_cpu_work(be, (size_t)ocols, &row));
        for (int t = 0; t < x.rows; t++)
            memset(od + (size_t)t * out.ld + (size_t)h * ostride, 0, ocols * sizeof(float));
        for (int i = 0; i < k; i++) {
            kd_cpu_weight_row(w, r0 + i, 0, ocols, row);
            for (int t = 0; t < x.rows; t++) {
                float xi = xd[(size_t)t * x.ld + (size_t)h * xstride + i];
                float *o = od + (size_t)t * out.ld + (size_t)h * ostride;
                for (int c = 0; c < ocols; c++) o[c] += xi * row[c];
            }
        }
    }
    return KD_OK;
}
