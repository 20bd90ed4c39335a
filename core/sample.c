/* sample.c: sampling with a counter-based RNG keyed by (seed, absolute position).
 *
 * The rule (also in docs/ddtree.md). For one row of logits x[0..V) and a sampler
 * {temperature T, top_k, top_p, seed} producing the token at absolute position P:
 *  1. T <= 0: greedy, the argmax (equal values: the lower id). Nothing is drawn.
 *  2. weights w_i = exp(x_i/T - max_j x_j/T) in double (x_i = -inf gives 0).
 *  3. top-k (1 <= top_k < V): keep the top_k largest w, equal w: lower id first.
 *  4. top-p (0 < top_p < 1): order the kept tokens by (w descending, id ascending)
 *     and keep the shortest prefix whose summed w reaches top_p * S, where S is
 *     the kept mass summed in ascending id order (at least one token is kept).
 *  5. u = kd_rng_uniform(seed, P) in [0, 1); walk the kept tokens in ascending id
 *     order accumulating c += w_i and return the first token with u * W < c, where
 *     W is the kept mass summed in the same order (inverse CDF in id order).
 * kd_rng_uniform: k = mix(mix(seed) + P * 0xD1B54A32D192ED03), u = (k >> 11) * 2^-53,
 * mix = the SplitMix64 finalizer (with its golden-ratio increment). The draw for a
 * position depends only on (seed, P) and the logits, so DDTree sampling (one draw
 * per tree node, keyed by the position the node's next token would take) returns
 * exactly the tokens autoregressive sampling returns with the same seed.
 */
#include "sample.h"
#include "error.h"
#include "model.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

double kd_rng_uniform(uint64_t seed, int64_t position) {
    uint64_t k = mix64(mix64(seed) + (uint64_t)position * 0xD1B54A32D192ED03ull);
    return (double)(k >> 11) * 0x1.0p-53;
}

bool kd_sampler_is_greedy(const kd_sampler *sp) {
    return !sp || !(sp->temperature > 0.0f);
}

kd_status kd_sampler_check(const kd_sampler *sp, const char *fn) {
    if (!sp) return KD_OK;
    if (isnan(sp->temperature) || isinf(sp->temperature))
        return kd_fail(KD_ERR_ARG, "%s: sampler.temperature: expected a finite number, got %g", fn, (double)sp->temperature);
    if (isnan(sp->top_p))
        return kd_fail(KD_ERR_ARG, "%s: sampler.top_p: expected a number in (0, 1) or off (<= 0 or >= 1), got NaN", fn);
    return KD_OK;
}

kd_status kd_argmax_row(const float *x, int V, int32_t *dst) {
    int best = -1;
    for (int i = 0; i < V; i++) {
        if (isnan(x[i])) return kd_fail(KD_ERR_ARG, "argmax: logits[%d] is NaN", i);
        if (best < 0 || x[i] > x[best]) best = i;
    }
    *dst = best;
    return KD_OK;
}

/* ---- top-k selection on doubles: (w descending, id ascending), sorted output ---- */

static inline bool wworse(const double *w, int32_t a, int32_t b) {
    return w[a] < w[b] || (w[a] == w[b] && a > b);
}

static void wheap_down(const double *w, int32_t *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && wworse(w, h[l], h[m])) m = l;
        if (r < n && wworse(w, h[r], h[m])) m = r;
        if (m == i) return;
        int32_t t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

/* out[0..k): the k best ids, best first */
static void select_topk(const double *w, int V, int k, int32_t *out) {
    int n = 0;
    for (int i = 0; i < V; i++) {
        if (n < k) {
            int j = n++;
            out[j] = i;
            while (j > 0) {
                int p = (j - 1) / 2;
                if (!wworse(w, out[j], out[p])) break;
                int32_t t = out[j]; out[j] = out[p]; out[p] = t;
                j = p;
            }
        } else if (w[i] > w[out[0]]) {   /* ids ascend: an equal weight never displaces */
            out[0] = i;
            wheap_down(w, out, k, 0);
        }
    }
    for (int e = k - 1; e > 0; e--) {
        int32_t t = out[0]; out[0] = out[e]; out[e] = t;
        wheap_down(w, out, e, 0);
    }
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

kd_status kd_sample_row(const float *x, int V, const kd_sampler *sp, int32_t position,
                        double *w, int32_t *a, int32_t *dst) {
    if (kd_sampler_is_greedy(sp)) return kd_argmax_row(x, V, dst);
    double T = (double)sp->temperature;
    float m = -INFINITY;
    for (int i = 0; i < V; i++) {
        if (isnan(x[i]) || (isinf(x[i]) && x[i] > 0))
            return kd_fail(KD_ERR_ARG, "sample: logits[%d] is %s: expected finite values (or -inf)", i,
                           isnan(x[i]) ? "NaN" : "+inf");
        if (x[i] > m) m = x[i];
    }
    if (isinf(m)) return kd_fail(KD_ERR_ARG, "sample: every logit is -inf (no token can be drawn)");
    double zmax = (double)m / T, total = 0.0;
    for (int i = 0; i < V; i++) {
        w[i] = exp((double)x[i] / T - zmax);
        total += w[i];
    }
    /* kept set: all ids (nk = V, a unused) or a[0..nk) */
    int nk = V;
    bool all = true;
    int k = sp->top_k;
    if (k > 0 && k < V) {
        select_topk(w, V, k, a);
        nk = k;
        all = false;
    }
    double p = (double)sp->top_p;
    if (p > 0.0 && p < 1.0) {
        double S;
        if (all) S = total;
        else {
            int32_t *b = a + V;          /* the kept ids in ascending order */
            memcpy(b, a, sizeof(int32_t) * (size_t)nk);
            qsort(b, (size_t)nk, sizeof(int32_t), cmp_i32);
            S = 0.0;
            for (int j = 0; j < nk; j++) S += w[b[j]];
        }
        double goal = p * S, cum = 0.0;
        if (all) {
            /* grow a sorted prefix until it holds the nucleus (the top-k of a total
             * order has the same prefix whatever k is) */
            int kk = V < 64 ? V : 64;
            for (;;) {
                select_topk(w, V, kk, a);
                int j;
                for (j = 0, cum = 0.0; j < kk; j++) {
                    cum += w[a[j]];
                    if (cum >= goal) break;
                }
                if (j < kk) { nk = j + 1; break; }
                if (kk == V) { nk = V; break; }
                kk = kk * 4 < V ? kk * 4 : V;
            }
            all = false;
        } else {
            int j;
            for (j = 0; j < nk; j++) {
                cum += w[a[j]];
                if (cum >= goal) break;
            }
            if (j < nk) nk = j + 1;
        }
    }
    double u = kd_rng_uniform(sp->seed, position);
    if (all) {
        double target = u * total, c = 0.0;
        int last = -1;
        for (int i = 0; i < V; i++) {
            if (w[i] <= 0.0) continue;
            c += w[i];
            last = i;
            if (target < c) { *dst = i; return KD_OK; }
        }
        *dst = last;
        return KD_OK;
    }
    qsort(a, (size_t)nk, sizeof(int32_t), cmp_i32);
    double W = 0.0;
    for (int j = 0; j < nk; j++) W += w[a[j]];
    double target = u * W, c = 0.0;
    int last = a[0];
    for (int j = 0; j < nk; j++) {
        if (w[a[j]] <= 0.0) continue;
        c += w[a[j]];
        last = a[j];
        if (target < c) { *dst = a[j]; return KD_OK; }
    }
    *dst = last;
    return KD_OK;
}

/* scratch for kd_sample_row: V doubles + 2V int32s */
static kd_status scratch_alloc(int V, double **w, int32_t **a) {
    *w = malloc(sizeof(double) * (size_t)V);
    *a = malloc(sizeof(int32_t) * 2 * (size_t)V);
    if (!*w || !*a) {
        free(*w); free(*a);
        *w = NULL; *a = NULL;
        return kd_fail(KD_ERR_NOMEM, "sample: cannot allocate scratch for a vocabulary of %d", V);
    }
    return KD_OK;
}

kd_status kd_sample_logits(const float *logits, int vocab, const kd_sampler *sp, int32_t position, int32_t *dst) {
    if (!logits) return kd_fail(KD_ERR_ARG, "kd_sample_logits: logits is NULL");
    if (!dst) return kd_fail(KD_ERR_ARG, "kd_sample_logits: dst is NULL");
    if (vocab <= 0) return kd_fail(KD_ERR_ARG, "kd_sample_logits: vocab: expected > 0, got %d", vocab);
    KD_TRY(kd_sampler_check(sp, "kd_sample_logits"));
    if (kd_sampler_is_greedy(sp)) return kd_argmax_row(logits, vocab, dst);
    double *w; int32_t *a;
    KD_TRY(scratch_alloc(vocab, &w, &a));
    kd_status st = kd_sample_row(logits, vocab, sp, position, w, a, dst);
    free(w); free(a);
    return st;
}

kd_status kd_seq_sample(kd_seq *s, const kd_sampler *sp, const int32_t *positions, int32_t *dst) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_sample: sequence is NULL");
    if (!dst) return kd_fail(KD_ERR_ARG, "kd_seq_sample: dst is NULL");
    KD_TRY(kd_sampler_check(sp, "kd_seq_sample"));
    int n = s->out_rows;
    if (n <= 0) return kd_fail(KD_ERR_STATE, "kd_seq_sample: no output rows (run kd_forward first)");
    if (kd_sampler_is_greedy(sp)) return kd_seq_argmax(s, dst);
    if (!positions && !s->out_positions)
        return kd_fail(KD_ERR_STATE, "kd_seq_sample: positions is NULL and the last forward kept none");
    int V = s->model->cfg.vocab;
    double *w; int32_t *a;
    KD_TRY(scratch_alloc(V, &w, &a));
    float *row = malloc(sizeof(float) * (size_t)V);
    kd_status st = row ? KD_OK : kd_fail(KD_ERR_NOMEM, "kd_seq_sample: cannot allocate a row of %d logits", V);
    for (int i = 0; i < n && st == KD_OK; i++) {
        st = kd_seq_logits(s, i, 1, row);
        int32_t pos = positions ? positions[i] : s->out_positions[i] + 1;
        if (st == KD_OK) st = kd_sample_row(row, V, sp, pos, w, a, &dst[i]);
        if (st != KD_OK) st = kd_fail_context(st, "kd_seq_sample: row %d (position %d)", i, (int)pos);
    }
    free(row); free(w); free(a);
    return st;
}
