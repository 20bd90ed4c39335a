/* cpu_elementwise.c: the CPU backend's row-wise ops: copy/convert, embedding
 * lookup, residual adds, SwiGLU, RMSNorm, RoPE, row gathers, log-softmax,
 * argmax (NaN / +inf reported as sample_rule.h's codes) and top-k. All math in fp32. */
#include "cpu.h"
#include "sample_rule.h"
#include <stdlib.h>

kd_status kd_cpu_copy(kd_backend *be, kd_act dst, kd_act src) {
    KD_TRY(kd_cpu_check_shape("copy", "dst", dst, src.rows, src.cols));
    if (src.dtype == dst.dtype) {
        size_t row_bytes = (size_t)src.cols * kd_dtype_size(src.dtype);
        for (int r = 0; r < src.rows; r++)
            memmove(kd_act_rows(dst, r, 1).data, kd_act_rows(src, r, 1).data, row_bytes);
        return KD_OK;
    }
    bool fd = dst.dtype == KD_F32 || dst.dtype == KD_BF16 || dst.dtype == KD_F16;
    bool fs = src.dtype == KD_F32 || src.dtype == KD_BF16 || src.dtype == KD_F16;
    if (!fd || !fs)
        return kd_fail(KD_ERR_ARG, "cpu copy: cannot convert %s to %s", kd_dtype_name(src.dtype),
                       kd_dtype_name(dst.dtype));
    for (int r = 0; r < src.rows; r++)
        for (int c = 0; c < src.cols; c++) kd_act_set(dst, r, c, kd_act_get(src, r, c));
    return KD_OK;
}

kd_status kd_cpu_embed(kd_backend *be, const kd_weight *table, const int32_t *ids, kd_act out) {
    KD_TRY(kd_cpu_check_weight("embed", table));
    KD_TRY(kd_cpu_check_f32("embed", "out", out));
    if (table->format == KD_W_INT4 || out.cols != table->cols)
        return kd_fail(KD_ERR_ARG, "cpu embed: table '%s' is %lld wide (bf16/f32 expected), out has %d cols",
                       table->name ? table->name : "?", (long long)table->cols, out.cols);
    for (int t = 0; t < out.rows; t++) {
        if (ids[t] < 0 || ids[t] >= table->rows)
            return kd_fail(KD_ERR_ARG, "cpu embed: token %d at row %d is outside the table '%s' (%lld rows)",
                           ids[t], t, table->name ? table->name : "?", (long long)table->rows);
        kd_cpu_weight_row(table, ids[t], 0, out.cols, kd_act_f32_row(out, t));
    }
    return KD_OK;
}

kd_status kd_cpu_scale_add(kd_backend *be, kd_act x, kd_act y, float s) {
    KD_TRY(kd_cpu_check_f32("add", "x", x));
    KD_TRY(kd_cpu_check_f32("add", "y", y));
    KD_TRY(kd_cpu_check_shape("add", "y", y, x.rows, x.cols));
    for (int r = 0; r < x.rows; r++) {
        float *xr = kd_act_f32_row(x, r);
        const float *yr = kd_act_f32_row(y, r);
        for (int c = 0; c < x.cols; c++) xr[c] += s * yr[c];
    }
    return KD_OK;
}

kd_status kd_cpu_add(kd_backend *be, kd_act x, kd_act y) {
    KD_TRY(kd_cpu_check_f32("add", "x", x));
    KD_TRY(kd_cpu_check_f32("add", "y", y));
    KD_TRY(kd_cpu_check_shape("add", "y", y, x.rows, x.cols));
    for (int r = 0; r < x.rows; r++) {
        float *xr = kd_act_f32_row(x, r);
        const float *yr = kd_act_f32_row(y, r);
        for (int c = 0; c < x.cols; c++) xr[c] += yr[c];
    }
    return KD_OK;
}

/* out = silu(gate) * up, silu(g) = g / (1 + exp(-g)); out may alias gate or up */
kd_status kd_cpu_swiglu(kd_backend *be, kd_act gate, kd_act up, kd_act out) {
    KD_TRY(kd_cpu_check_f32("swiglu", "gate", gate));
    KD_TRY(kd_cpu_check_f32("swiglu", "up", up));
    KD_TRY(kd_cpu_check_f32("swiglu", "out", out));
    KD_TRY(kd_cpu_check_shape("swiglu", "up", up, gate.rows, gate.cols));
    KD_TRY(kd_cpu_check_shape("swiglu", "out", out, gate.rows, gate.cols));
    for (int r = 0; r < gate.rows; r++) {
        const float *g = kd_act_f32_row(gate, r), *u = kd_act_f32_row(up, r);
        float *o = kd_act_f32_row(out, r);
        for (int c = 0; c < gate.cols; c++) o[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
    }
    return KD_OK;
}

/* HF DeepseekV3RMSNorm: w * (x * rsqrt(mean(x^2) + eps)). The norm's width d is the
 * weight's length; a row of x.cols = k*d columns is k independent segments (heads). */
kd_status kd_cpu_rmsnorm(kd_backend *be, kd_act x, const kd_weight *w, float eps, kd_act out) {
    KD_TRY(kd_cpu_check_f32("rmsnorm", "x", x));
    KD_TRY(kd_cpu_check_f32("rmsnorm", "out", out));
    KD_TRY(kd_cpu_check_shape("rmsnorm", "out", out, x.rows, x.cols));
    KD_TRY(kd_cpu_check_weight("rmsnorm", w));
    int d = (int)(w->rows * w->cols);
    if (w->format == KD_W_INT4 || d <= 0 || x.cols % d)
        return kd_fail(KD_ERR_ARG, "cpu rmsnorm: weight '%s' has %d entries, which must divide the %d cols",
                       w->name ? w->name : "?", d, x.cols);
    float *wv;
    KD_TRY(kd_cpu_work(be, (size_t)d, &wv));
    kd_cpu_weight_row(w, 0, 0, d, wv);      /* a vector [d] or [d,1] is d contiguous values */
    for (int r = 0; r < x.rows; r++) {
        const float *xr = kd_act_f32_row(x, r);
        float *o = kd_act_f32_row(out, r);
        for (int s0 = 0; s0 < x.cols; s0 += d) {
            float ss = 0.0f;
            for (int i = 0; i < d; i++) ss += xr[s0 + i] * xr[s0 + i];
            float inv = 1.0f / sqrtf(ss / (float)d + eps);
            for (int i = 0; i < d; i++) o[s0 + i] = wv[i] * (xr[s0 + i] * inv);
        }
    }
    return KD_OK;
}

/* RoPE in place. For pair i (0 <= i < dim/2) the angle is pos * inv_freq[i] (fp32, as HF
 * computes it); interleaved pairs are (2i, 2i+1) (MLA), otherwise (i, i + dim/2)
 * (rotate-half). y_a = a cos - b sin, y_b = b cos + a sin, cos/sin times attn_factor. */
kd_status kd_cpu_rope(kd_backend *be, kd_act x, int n_heads, int head_stride, int offset,
                      const int32_t *pos, const kd_rope *r) {
    KD_TRY(kd_cpu_check_f32("rope", "x", x));
    if (!r || !r->inv_freq || r->dim <= 0 || r->dim % 2 || offset < 0 || n_heads <= 0 ||
        offset + r->dim > head_stride || (n_heads - 1) * head_stride + offset + r->dim > x.cols)
        return kd_fail(KD_ERR_ARG, "cpu rope: dims [%d, %d) of %d heads of stride %d do not fit %d cols",
                       offset, offset + (r ? r->dim : 0), n_heads, head_stride, x.cols);
    int half = r->dim / 2;
    for (int t = 0; t < x.rows; t++) {
        float *xr = kd_act_f32_row(x, t);
        for (int i = 0; i < half; i++) {
            float ang = (float)pos[t] * r->inv_freq[i];
            float c = (float)cos((double)ang) * r->attn_factor, s = (float)sin((double)ang) * r->attn_factor;
            for (int h = 0; h < n_heads; h++) {
                float *p = xr + (size_t)h * head_stride + offset;
                int ia = r->interleaved ? 2 * i : i, ib = r->interleaved ? 2 * i + 1 : i + half;
                float a = p[ia], b = p[ib];
                p[ia] = a * c - b * s;
                p[ib] = b * c + a * s;
            }
        }
    }
    return KD_OK;
}

kd_status kd_cpu_gather_rows(kd_backend *be, kd_act dst, kd_act src, const int32_t *rows, int n) {
    if (n < 0 || n > dst.rows || dst.cols != src.cols)
        return kd_fail(KD_ERR_ARG, "cpu gather_rows: %d rows of %d cols into a %d x %d view", n, src.cols,
                       dst.rows, dst.cols);
    for (int i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= src.rows)
            return kd_fail(KD_ERR_ARG, "cpu gather_rows: rows[%d] = %d is outside the %d source rows", i, rows[i],
                           src.rows);
        KD_TRY(kd_cpu_copy(be, kd_act_rows(dst, i, 1), kd_act_rows(src, rows[i], 1)));
    }
    return KD_OK;
}

/* the definition, in the order of i; every check comes before a row moves */
kd_status kd_cpu_move_rows(kd_backend *be, const kd_act *caches, int n_caches, int src0, const int32_t *rows, int n,
                           int dst0) {
    if (n_caches < 0 || n < 0 || (n_caches > 0 && !caches) || (n > 0 && !rows))
        return kd_fail(KD_ERR_ARG, "cpu move_rows: %d rows of %d caches (NULL caches or rows)", n, n_caches);
    for (int l = 1; l < n_caches; l++)
        if (caches[l].rows != caches[0].rows || caches[l].cols != caches[0].cols || caches[l].dtype != caches[0].dtype)
            return kd_fail(KD_ERR_ARG, "cpu move_rows: cache %d is %d x %d %s, cache 0 %d x %d %s", l, caches[l].rows,
                           caches[l].cols, kd_dtype_name(caches[l].dtype), caches[0].rows, caches[0].cols,
                           kd_dtype_name(caches[0].dtype));
    for (int i = 0; n_caches > 0 && i < n; i++) {
        long long from = (long long)src0 + rows[i], to = (long long)dst0 + i;
        if (from >= caches[0].rows || to < 0 || to > from || (i > 0 && rows[i] <= rows[i - 1]))
            return kd_fail(KD_ERR_ARG, "cpu move_rows: row %lld -> %lld (rows[%d] = %d): expected strictly increasing rows "
                           "that move toward row 0 within the %d cache rows", from, to, i, rows[i], caches[0].rows);
    }
    for (int l = 0; l < n_caches; l++)
        for (int i = 0; i < n; i++)
            if (src0 + rows[i] != dst0 + i)
                KD_TRY(kd_cpu_copy(be, kd_act_rows(caches[l], dst0 + i, 1), kd_act_rows(caches[l], src0 + rows[i], 1)));
    return KD_OK;
}

/* add, then rmsnorm: the definition itself; every check comes before x changes */
kd_status kd_cpu_add_rmsnorm(kd_backend *be, kd_act x, kd_act y, const kd_weight *w, float eps, kd_act out) {
    KD_TRY(kd_cpu_check_f32("add_rmsnorm", "x", x));
    KD_TRY(kd_cpu_check_f32("add_rmsnorm", "y", y));
    KD_TRY(kd_cpu_check_f32("add_rmsnorm", "out", out));
    KD_TRY(kd_cpu_check_shape("add_rmsnorm", "y", y, x.rows, x.cols));
    KD_TRY(kd_cpu_check_shape("add_rmsnorm", "out", out, x.rows, x.cols));
    KD_TRY(kd_cpu_check_weight("add_rmsnorm", w));
    if (w->format == KD_W_INT4 || w->rows * w->cols != x.cols)
        return kd_fail(KD_ERR_ARG, "cpu add_rmsnorm: weight '%s' has %lld entries, expected the %d cols of a row",
                       w->name ? w->name : "?", (long long)(w->rows * w->cols), x.cols);
    KD_TRY(kd_cpu_add(be, x, y));
    return kd_cpu_rmsnorm(be, x, w, eps, out);
}

/* backend memory is host memory here: the length is read directly */
kd_status kd_cpu_store_rows_at(kd_backend *be, kd_act dst, const int32_t *d_len, kd_act src) {
    int row0 = *d_len;
    if (row0 < 0 || row0 + src.rows > dst.rows)
        return kd_fail(KD_ERR_ARG, "cpu store_rows_at: rows [%d, %d) outside the %d rows", row0, row0 + src.rows,
                       dst.rows);
    return kd_cpu_copy(be, kd_act_rows(dst, row0, src.rows), src);
}

/* the definition: the query's rope part copied beside its latent and roped there; the latent
 * normed into its cache rows, its rope part copied after it and roped there. Every check comes
 * before the first write. */
kd_status kd_cpu_mla_rope_store(kd_backend *be, kd_act q, kd_act qfull, int n_heads, kd_act kva, const kd_weight *w,
                                float eps, const int32_t *pos, const kd_rope *r, kd_act cache, int row0,
                                const int32_t *d_len) {
    KD_TRY(kd_cpu_check_f32("mla_rope_store", "q", q));
    KD_TRY(kd_cpu_check_f32("mla_rope_store", "qfull", qfull));
    KD_TRY(kd_cpu_check_f32("mla_rope_store", "kva", kva));
    KD_TRY(kd_cpu_check_f32("mla_rope_store", "cache", cache));
    KD_TRY(kd_cpu_check_weight("mla_rope_store", w));
    int d = r && r->inv_freq ? r->dim : 0;
    if (d <= 0 || d % 2 || n_heads <= 0 || q.cols % n_heads || qfull.cols % n_heads || q.cols / n_heads < d ||
        qfull.cols / n_heads < d || kva.cols <= d || cache.cols != kva.cols || w->rows * w->cols != kva.cols - d ||
        q.rows != kva.rows || qfull.rows != kva.rows || (kva.rows > 0 && !pos))
        return kd_fail(KD_ERR_ARG, "cpu mla_rope_store: rope dim %d, %d heads: q %d x %d, qfull %d x %d, kva %d x %d, "
                       "cache %d cols, norm '%s' %lld entries (expected heads wider than the rope dim, kva's cols "
                       "= the cache's = norm + rope dim, one row of each per position)", d, n_heads, q.rows, q.cols,
                       qfull.rows, qfull.cols, kva.rows, kva.cols, cache.cols, w->name ? w->name : "?",
                       (long long)(w->rows * w->cols));
    long long start = (long long)row0 + (d_len ? *d_len : 0);
    if (start < 0 || start + kva.rows > cache.rows)
        return kd_fail(KD_ERR_ARG, "cpu mla_rope_store: rows [%lld, %lld) outside the %d cache rows", start,
                       start + kva.rows, cache.rows);
    int qs = q.cols / n_heads, fs = qfull.cols / n_heads, c = kva.cols - d;
    for (int h = 0; h < n_heads; h++)
        KD_TRY(kd_cpu_copy(be, kd_act_cols(qfull, h * fs + fs - d, d), kd_act_cols(q, h * qs + qs - d, d)));
    KD_TRY(kd_cpu_rope(be, qfull, n_heads, fs, fs - d, pos, r));
    kd_act rows = kd_act_rows(cache, (int)start, kva.rows);
    KD_TRY(kd_cpu_rmsnorm(be, kd_act_cols(kva, 0, c), w, eps, kd_act_cols(rows, 0, c)));
    KD_TRY(kd_cpu_copy(be, kd_act_cols(rows, c, d), kd_act_cols(kva, c, d)));
    return kd_cpu_rope(be, rows, 1, kva.cols, c, pos, r);
}

kd_status kd_cpu_log_softmax(kd_backend *be, kd_act x) {
    KD_TRY(kd_cpu_check_f32("log_softmax", "x", x));
    for (int r = 0; r < x.rows; r++) {
        float *xr = kd_act_f32_row(x, r);
        float m = -INFINITY;
        for (int c = 0; c < x.cols; c++) if (xr[c] > m) m = xr[c];
        float sum = 0.0f;
        for (int c = 0; c < x.cols; c++) sum += expf(xr[c] - m);
        float lse = m + logf(sum);
        for (int c = 0; c < x.cols; c++) xr[c] -= lse;
    }
    return KD_OK;
}

/* a beats b: larger value, or equal value and lower id; NaN loses to everything */
static inline bool beats(float va, int ia, float vb, int ib) {
    if (va != va) return false;
    if (vb != vb) return true;
    return va > vb || (va == vb && ia < ib);
}

kd_status kd_cpu_argmax(kd_backend *be, kd_act x, int32_t *out) {
    KD_TRY(kd_cpu_check_f32("argmax", "x", x));
    for (int r = 0; r < x.rows; r++) {
        const float *xr = kd_act_f32_row(x, r);
        int best = 0;
        int32_t bad = kd_rule_logit_code(xr[0], 0);
        for (int c = 1; c < x.cols && !bad; c++) {
            bad = kd_rule_logit_code(xr[c], c);
            if (beats(xr[c], c, xr[best], best)) best = c;
        }
        out[r] = bad ? -bad : best;
    }
    return KD_OK;
}

/* top-k per row with a size-k min-heap (root = the weakest kept entry), then sorted */
static void sift_down(float *v, int32_t *id, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && beats(v[w], id[w], v[l], id[l])) w = l;
        if (r < n && beats(v[w], id[w], v[r], id[r])) w = r;
        if (w == i) return;
        float tv = v[i]; v[i] = v[w]; v[w] = tv;
        int32_t ti = id[i]; id[i] = id[w]; id[w] = ti;
        i = w;
    }
}

kd_status kd_cpu_topk(kd_backend *be, kd_act x, int k, float *vals, int32_t *ids) {
    KD_TRY(kd_cpu_check_f32("topk", "x", x));
    if (k <= 0 || k > x.cols) return kd_fail(KD_ERR_ARG, "cpu topk: k = %d must be in [1, %d]", k, x.cols);
    for (int r = 0; r < x.rows; r++) {
        const float *xr = kd_act_f32_row(x, r);
        float *v = vals + (size_t)r * k;
        int32_t *id = ids + (size_t)r * k;
        for (int c = 0; c < k; c++) { v[c] = xr[c]; id[c] = c; }
        for (int i = k / 2 - 1; i >= 0; i--) sift_down(v, id, k, i);
        for (int c = k; c < x.cols; c++)
            if (beats(xr[c], c, v[0], id[0])) { v[0] = xr[c]; id[0] = c; sift_down(v, id, k, 0); }
        /* heap sort: repeatedly move the weakest to the end -> best first */
        for (int n = k - 1; n > 0; n--) {
            float tv = v[0]; v[0] = v[n]; v[n] = tv;
            int32_t ti = id[0]; id[0] = id[n]; id[n] = ti;
            sift_down(v, id, n, 0);
        }
    }
    return KD_OK;
}
