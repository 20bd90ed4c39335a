/* cpu_attention.c: scaled dot-product attention over cached rows, fp32, with the
 * visibility rules of backend.h (causal, full, per-token bitmask, sliding window).
 *
 * Layout: head h of q is q[:, h*head_dim, +head_dim). Key/value heads are equal
 * slices of k and v: kv head g's key is the first head_dim cols of k[:, g*kstride..]
 * with kstride = k.cols / n_kv_heads, its value the first dv cols of
 * v[:, g*vstride..] with vstride = v.cols / n_kv_heads, dv = out.cols / n_heads.
 * Query head h reads kv head h / (n_heads / n_kv_heads). MLA runs this with one kv
 * head: key = the whole cache row [c_kv | k_pe], value = its c_kv part. */
#include "cpu.h"

/* may query t (cache row past+t) see cache row s? */
static inline bool visible_row(int s, int t, int past, int T, bool causal, const uint64_t *visible,
                               int words, int window) {
    if (window > 0 && (past + t) - s >= window) return false;
    if (visible) {
        if (s < past) return true;
        int j = s - past;
        if (j >= T) return false;
        return (visible[(size_t)t * words + (j >> 6)] >> (j & 63)) & 1u;
    }
    return causal ? s <= past + t : true;
}

kd_status kd_cpu_attention(kd_backend *be, kd_act q, int n_heads, int head_dim,
                           kd_act k, kd_act v, int n_kv_heads, int past, bool causal,
                           const uint64_t *visible, int window, float scale, kd_act out) {
    KD_TRY(kd_cpu_check_f32("attention", "q", q));
    KD_TRY(kd_cpu_check_f32("attention", "k", k));
    KD_TRY(kd_cpu_check_f32("attention", "v", v));
    KD_TRY(kd_cpu_check_f32("attention", "out", out));
    int T = q.rows, S = k.rows;
    if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || q.cols < n_heads * head_dim)
        return kd_fail(KD_ERR_ARG, "cpu attention: %d query heads of %d dims over %d kv heads (q has %d cols)",
                       n_heads, head_dim, n_kv_heads, q.cols);
    int kstride = k.cols / n_kv_heads, vstride = v.cols / n_kv_heads, dv = out.cols / n_heads;
    if (kstride < head_dim || dv <= 0 || vstride < dv || v.rows != S || out.rows != T || past < 0 ||
        ((causal || visible) && past + T > S))
        return kd_fail(KD_ERR_ARG, "cpu attention: k %d x %d, v %d x %d, out %d x %d, %d queries after %d past rows: "
                       "expected k cols >= %d*%d, v cols >= %d*(out cols / %d), past + T <= rows",
                       k.rows, k.cols, v.rows, v.cols, out.rows, out.cols, T, past, n_kv_heads, head_dim,
                       n_kv_heads, n_heads);
    int group = n_heads / n_kv_heads, words = (T + 63) / 64;
    float *p;
    KD_TRY(kd_cpu_work(be, (size_t)S, &p));
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < n_heads; h++) {
            int g = h / group;
            const float *qh = kd_act_f32_row(q, t) + (size_t)h * head_dim;
            float *oh = kd_act_f32_row(out, t) + (size_t)h * dv;
            float m = -INFINITY;
            for (int s = 0; s < S; s++) {
                if (!visible_row(s, t, past, T, causal, visible, words, window)) { p[s] = -INFINITY; continue; }
                p[s] = kd_dot(qh, kd_act_f32_row(k, s) + (size_t)g * kstride, head_dim) * scale;
                if (p[s] > m) m = p[s];
            }
            memset(oh, 0, (size_t)dv * sizeof(float));
            if (m == -INFINITY) continue;            /* sees nothing: zeros */
            float sum = 0.0f;
            for (int s = 0; s < S; s++) {
                if (p[s] == -INFINITY) continue;
                float e = expf(p[s] - m);
                sum += e;
                const float *vs = kd_act_f32_row(v, s) + (size_t)g * vstride;
                for (int c = 0; c < dv; c++) oh[c] += e * vs[c];
            }
            float inv = 1.0f / sum;
            for (int c = 0; c < dv; c++) oh[c] *= inv;
        }
    }
    return KD_OK;
}

kd_status kd_cpu_attention_at(kd_backend *be, kd_act q, int n_heads, int head_dim, kd_act k, kd_act v, int n_kv_heads,
                              const int32_t *d_len, bool causal, const uint64_t *visible, int window, float scale,
                              kd_act out) {
    int past = *d_len, S = past + q.rows;
    if (past < 0 || S > k.rows || S > v.rows)
        return kd_fail(KD_ERR_ARG, "cpu attention_at: %d past rows + %d queries exceed the %d cache rows", past, q.rows,
                       k.rows < v.rows ? k.rows : v.rows);
    return kd_cpu_attention(be, q, n_heads, head_dim, kd_act_rows(k, 0, S), kd_act_rows(v, 0, S), n_kv_heads, past,
                            causal, visible, window, scale, out);
}
