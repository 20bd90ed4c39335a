/* sample.c: sampling with a counter-based RNG keyed by (seed, absolute position).
 *
 * The rule (also in docs/ddtree.md). For one row of logits x[0..V) and a sampler
 * {temperature T, top_k, top_p, seed} producing the token at absolute position P:
 *  1. T <= 0: greedy, the argmax (equal values: the lower id). Nothing is drawn.
 *  2. w_i = exp(x_i/T - m/T) in double, m = max_j x_j (x_i = -inf gives 0), with the exp of
 *     sample_rule.h; the token's mass is the integer q_i = trunc(w_i * 2^62). All sums of
 *     masses below are exact (128-bit integers), so they do not depend on summation order.
 *  3. The order of the row: logit descending, equal logits: lower id first.
 *     top-k (1 <= top_k < V): keep the first top_k tokens of that order.
 *     min-p (0 < min_p <= 1): a token whose mass is below Q = ceil(min_p * 2^62) gets mass 0
 *     (the top token has 2^62, so it stays). min-p and top-k commute; min-p comes before top-p.
 *  4. top-p (0 < top_p < 1): S = the kept mass (after top-k and min-p), G = max(1, ceil(S * trunc(top_p * 2^32) / 2^32));
 *     keep the shortest prefix of the order (within the top-k set) whose mass reaches G.
 *  5. U = the top 53 bits of the keyed word (u = U * 2^-53 = kd_rng_uniform(seed, P)),
 *     W = the kept mass, target = floor(U * W / 2^53); walk the kept tokens in ascending
 *     id order and return the first whose inclusive prefix mass exceeds target.
 * kd_rng_uniform: k = mix(mix(seed) + P * 0xD1B54A32D192ED03), u = (k >> 11) * 2^-53,
 * mix = the SplitMix64 finalizer (with its golden-ratio increment). The draw for a
 * position depends only on (seed, P) and the logits, so DDTree sampling (one draw
 * per tree node, keyed by the position the node's next token would take) returns
 * exactly the tokens autoregressive sampling returns with the same seed.
 *
 * The device implementation (cuda/ddtree.cu) computes the same integers with parallel
 * reductions and radix searches; the arithmetic both share is in sample_rule.h. The
 * backend op sample_rows (backend.h) runs the rule on rows of logits in backend memory;
 * the CPU backend's twin calls kd_sample_row_code below. kd_seq_sample uses it when the
 * DDTree round runs on the backend (kd_ddtree_on_device, tree.h; at tp > 1 on rank 0, with the
 * rows gathered whole there), else it downloads rows.
 */
#include "sample.h"
#include "sample_rule.h"
#include "error.h"
#include "model.h"
#include "forward.h"
#include "tree.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

double kd_rng_uniform(uint64_t seed, int64_t position) {
    return (double)kd_rule_u53(seed, position) * 0x1.0p-53;
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
    if (isnan(sp->min_p) || sp->min_p > 1.0f)
        return kd_fail(KD_ERR_ARG, "%s: sampler.min_p: expected a number in (0, 1] or off (<= 0), got %g", fn,
                       (double)sp->min_p);
    return KD_OK;
}

kd_status kd_argmax_row(const float *x, int V, int32_t *dst) {
    int best = -1;
    for (int i = 0; i < V; i++) {
        int32_t code = kd_rule_logit_code(x[i], i);
        if (code) return kd_logit_fail("argmax", code);
        if (best < 0 || x[i] > x[best]) best = i;
    }
    *dst = best;
    return KD_OK;
}

kd_status kd_logit_fail(const char *op, int32_t code) {
    int kind = code & 3, col = (int)((uint32_t)code >> 2);
    if (kind == KD_SAMPLE_ERR_ALLNEG) return kd_fail(KD_ERR_ARG, "%s: every logit is -inf (no token can be drawn)", op);
    return kd_fail(KD_ERR_ARG, "%s: logits[%d] is %s: expected finite values (or -inf)", op, col,
                   kind == KD_SAMPLE_ERR_NAN ? "NaN" : "+inf");
}

kd_status kd_sample_fail(int32_t code) { return kd_logit_fail("sample", code); }

kd_status kd_argmax_check(const int32_t *ids, int rows, const char *fn, const char *rows_name) {
    for (int r = 0; r < rows; r++)
        if (ids[r] < 0) return kd_fail_context(kd_logit_fail("argmax", -ids[r]), "%s: %s row %d", fn, rows_name, r);
    return KD_OK;
}

/* ---- the order of a row: logit descending, equal logits: lower id first ---- */

/* a comes after b in the row's order */
static inline bool behind(const float *x, int32_t a, int32_t b) {
    return x[a] < x[b] || (x[a] == x[b] && a > b);
}

static void oheap_down(const float *x, int32_t *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && behind(x, h[l], h[m])) m = l;
        if (r < n && behind(x, h[r], h[m])) m = r;
        if (m == i) return;
        int32_t t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

/* out[0..k): the first k ids of the row's order, in order */
static void select_first(const float *x, int V, int k, int32_t *out) {
    int n = 0;
    for (int i = 0; i < V; i++) {
        if (n < k) {
            int j = n++;
            out[j] = i;
            while (j > 0) {
                int p = (j - 1) / 2;
                if (!behind(x, out[j], out[p])) break;
                int32_t t = out[j]; out[j] = out[p]; out[p] = t;
                j = p;
            }
        } else if (x[i] > x[out[0]]) {   /* ids ascend: an equal logit never displaces */
            out[0] = i;
            oheap_down(x, out, k, 0);
        }
    }
    for (int e = k - 1; e > 0; e--) {
        int32_t t = out[0]; out[0] = out[e]; out[e] = t;
        oheap_down(x, out, e, 0);
    }
}

/* ---- the rule over a row held in shards ----
 * Tensor parallel: each rank holds a shard of the row (ascending, adjacent id ranges). The rule
 * runs per shard and merges, with the same integers as over the whole row: the global max is the
 * max of the shard maxima; the masses use that max, and the shards' mass sums add up exactly
 * (128-bit integers, so the order does not matter); top-k merges the shards' own first-k lists
 * (the first k of the row are among them); top-p gathers the shards' first kk candidates each,
 * merged, growing kk as the whole-row rule does; the draw's target is found by the shards'
 * kept masses in id order, then within its shard. One shard is the whole row (tp = 1). */

/* the logit of (global) id */
static float shard_val(const kd_shard *sh, int ns, int32_t id) {
    int k = ns - 1;
    while (k > 0 && id < sh[k].id0) k--;
    return sh[k].x[id - sh[k].id0];
}

/* out[0..k): the first k ids of the whole row's order; loc: scratch for the shards' own lists
 * (at most k from each shard) */
static void select_first_shards(const kd_shard *sh, int ns, int k, int32_t *loc, int32_t *out) {
    if (ns == 1) { select_first(sh[0].x, sh[0].n, k, out); return; }   /* one shard: ids from 0 */
    int32_t *head[KD_TP_MAX];
    int left[KD_TP_MAX];
    int32_t *p = loc;
    for (int k2 = 0; k2 < ns; k2++) {
        int kk = k < sh[k2].n ? k : sh[k2].n;
        select_first(sh[k2].x, sh[k2].n, kk, p);
        for (int j = 0; j < kk; j++) p[j] += sh[k2].id0;
        head[k2] = p;
        left[k2] = kk;
        p += kk;
    }
    for (int j = 0; j < k; j++) {
        int b = -1;
        for (int k2 = 0; k2 < ns; k2++) {
            if (!left[k2]) continue;
            float xb = b < 0 ? 0.0f : shard_val(sh, ns, *head[b]), xc = shard_val(sh, ns, *head[k2]);
            if (b < 0 || xc > xb) b = k2;     /* equal values: the earlier shard's, the lower id */
        }
        out[j] = *head[b]++;
        left[b]--;
    }
}

int32_t kd_sample_shards_code(const kd_shard *sh, int ns, const kd_sampler *sp, int32_t position, uint64_t *q,
                              int32_t *a, int32_t *dst) {
    double T = (double)sp->temperature;
    float m = -INFINITY;
    int V = 0;
    for (int k = 0; k < ns; k++) {                  /* shards in id order: the first bad value by id */
        const float *x = sh[k].x;
        for (int i = 0; i < sh[k].n; i++) {
            int32_t col = sh[k].id0 + i;
            int32_t code = kd_rule_logit_code(x[i], col);
            if (code) return code;
            if (x[i] > m) m = x[i];
        }
        V += sh[k].n;
    }
    if (isinf(m)) return KD_SAMPLE_ERR_ALLNEG;
    const kd_rule_row row = kd_rule_row_of(m, T);
    const uint64_t qmin = kd_rule_min_p_floor(sp->min_p);
    kd_u128 total = kd_u128_of(0), mass[KD_TP_MAX];
    for (int k = 0; k < ns; k++) {
        mass[k] = kd_u128_of(0);
        for (int i = 0; i < sh[k].n; i++) {
            uint64_t w = kd_rule_mass(sh[k].x[i], row);
            if (w < qmin) w = 0;
            q[sh[k].id0 + i] = w;
            mass[k] = kd_u128_add64(mass[k], w);
        }
        total = kd_u128_add(total, mass[k]);
    }
    /* the kept set: every id (last < 0), or the ids up to `last` in the row's order */
    int32_t last = -1;
    kd_u128 kept = total;
    int32_t *loc = a + V;
    int k = sp->top_k;
    if (k > 0 && k < V) {
        select_first_shards(sh, ns, k, loc, a);
        last = a[k - 1];
        kept = kd_u128_of(0);
        for (int j = 0; j < k; j++) kept = kd_u128_add64(kept, q[a[j]]);
    }
    float p = sp->top_p;
    if (p > 0.0f && p < 1.0f) {
        kd_u128 goal = kd_rule_top_p_goal(kept, p);
        /* the nucleus is a prefix of the order: grow a sorted prefix until it holds it
         * (within the top-k set when there is one; its first elements are the same) */
        int lim = last >= 0 ? k : V;
        int kk = last >= 0 ? k : (V < 64 ? V : 64);
        for (;;) {
            if (last < 0) select_first_shards(sh, ns, kk, loc, a);
            kd_u128 cum = kd_u128_of(0);
            int j;
            for (j = 0; j < kk; j++) {
                cum = kd_u128_add64(cum, q[a[j]]);
                if (!kd_u128_lt(cum, goal)) break;
            }
            if (j < kk) { last = a[j]; kept = cum; break; }
            if (kk == lim) { last = a[kk - 1]; kept = cum; break; }   /* not reached: the kept mass is >= goal */
            kk = kk * 4 < lim ? kk * 4 : lim;
        }
    }
    kd_u128 target = kd_rule_target(kd_rule_u53(sp->seed, position), kept);
    float xl = last >= 0 ? shard_val(sh, ns, last) : 0.0f;
    /* the kept tokens in ascending id: a shard whose kept mass ends at or before the target is
     * passed whole; the target's shard is walked */
    kd_u128 c = kd_u128_of(0);
    int32_t found = -1;
    for (int s2 = 0; s2 < ns; s2++) {
        const float *x = sh[s2].x;
        int32_t id0 = sh[s2].id0;
        kd_u128 ms = mass[s2];
        if (last >= 0) {
            ms = kd_u128_of(0);
            for (int i = 0; i < sh[s2].n; i++)
                if (!(x[i] < xl || (x[i] == xl && id0 + i > last))) ms = kd_u128_add64(ms, q[id0 + i]);
        }
        if (s2 + 1 < ns && !kd_u128_lt(target, kd_u128_add(c, ms))) { c = kd_u128_add(c, ms); continue; }
        for (int i = 0; i < sh[s2].n; i++) {
            int32_t id = id0 + i;
            if (last >= 0 && id != last && (x[i] < xl || (x[i] == xl && id > last))) continue;
            if (!q[id]) continue;
            c = kd_u128_add64(c, q[id]);
            found = id;
            if (kd_u128_lt(target, c)) break;
        }
        break;
    }
    *dst = found;   /* target < kept mass: the walk always stops at a token */
    return 0;
}

int32_t kd_sample_row_code(const float *x, int V, const kd_sampler *sp, int32_t position, uint64_t *q, int32_t *a,
                           int32_t *dst) {
    kd_shard whole = {x, V, 0};
    return kd_sample_shards_code(&whole, 1, sp, position, q, a, dst);
}

kd_status kd_sample_row(const float *x, int V, const kd_sampler *sp, int32_t position, uint64_t *q, int32_t *a,
                        int32_t *dst) {
    if (kd_sampler_is_greedy(sp)) return kd_argmax_row(x, V, dst);
    int32_t code = kd_sample_row_code(x, V, sp, position, q, a, dst);
    return code ? kd_sample_fail(code) : KD_OK;
}

/* scratch for kd_sample_row / kd_seq_sample_row: V masses + 2V int32s */
static kd_status scratch_alloc(int V, uint64_t **q, int32_t **a) {
    *q = malloc(sizeof(uint64_t) * (size_t)V);
    *a = malloc(sizeof(int32_t) * 2 * (size_t)V);
    if (!*q || !*a) {
        free(*q); free(*a);
        *q = NULL; *a = NULL;
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
    uint64_t *q; int32_t *a;
    KD_TRY(scratch_alloc(vocab, &q, &a));
    kd_status st = kd_sample_row(logits, vocab, sp, position, q, a, dst);
    free(q); free(a);
    return st;
}

kd_status kd_seq_sample_row(kd_seq *s, int i, const kd_sampler *sp, int32_t position, float *row, uint64_t *q,
                            int32_t *a, int32_t *dst) {
    kd_model *m = s->model;
    kd_shard sh[KD_TP_MAX];
    int Vr = m->split.vocab;
    for (int r = 0; r < m->tp; r++) {
        kd_backend *be = m->ranks[r].be;
        kd_act src = kd_act_rows(s->rk[r].logits, i, 1);
        KD_TRY(be->ops->download(be, row + (size_t)r * Vr, src.data, sizeof(float) * (size_t)Vr));
        sh[r] = (kd_shard){row + (size_t)r * Vr, Vr, r * Vr};
    }
    if (kd_sampler_is_greedy(sp)) return kd_argmax_row(row, m->cfg.vocab, dst);
    int32_t code = kd_sample_shards_code(sh, m->tp, sp, position, q, a, dst);
    return code ? kd_sample_fail(code) : KD_OK;
}

/* every output row on the host: each row's shards come down (kd_ddtree_on_device false) */
static kd_status seq_sample_host(kd_seq *s, const kd_sampler *sp, const int32_t *positions, int32_t *dst) {
    int n = s->out_rows, V = s->model->cfg.vocab;
    uint64_t *q; int32_t *a;
    KD_TRY(scratch_alloc(V, &q, &a));
    float *row = malloc(sizeof(float) * (size_t)V);
    kd_status st = row ? KD_OK : kd_fail(KD_ERR_NOMEM, "kd_seq_sample: cannot allocate a row of %d logits", V);
    for (int i = 0; i < n && st == KD_OK; i++) {
        int32_t pos = positions ? positions[i] : s->out_positions[i] + 1;
        st = kd_seq_sample_row(s, i, sp, pos, row, q, a, &dst[i]);
        if (st != KD_OK) st = kd_fail_context(st, "kd_seq_sample: row %d (position %d)", i, (int)pos);
    }
    free(row); free(q); free(a);
    return st;
}

/* every output row on the backend (sample_rows): positions go up, ids and row codes come back */
kd_status kd_seq_sample(kd_seq *s, const kd_sampler *sp, const int32_t *positions, int32_t *dst) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_sample: sequence is NULL");
    if (!dst) return kd_fail(KD_ERR_ARG, "kd_seq_sample: dst is NULL");
    KD_TRY(kd_sampler_check(sp, "kd_seq_sample"));
    int n = s->out_rows;
    if (n <= 0) return kd_fail(KD_ERR_STATE, "kd_seq_sample: no output rows (run kd_forward first)");
    if (kd_sampler_is_greedy(sp)) return kd_seq_argmax(s, dst);
    if (!positions && (!s->out_positions || s->out_positions[0] < 0))
        return kd_fail(KD_ERR_STATE, "kd_seq_sample: positions is NULL and the last forward kept none on the host "
                       "(a verify of a tree built on the backend): pass the positions");
    kd_model *m = s->model;
    kd_backend *be = m->be;
    if (!kd_ddtree_on_device(m)) return seq_sample_host(s, sp, positions, dst);
    if (m->cfg.vocab > KD_SAMPLE_MAX_VOCAB)
        return kd_fail(KD_ERR_UNSUPPORTED, "kd_seq_sample: vocabulary %d above %d", m->cfg.vocab, KD_SAMPLE_MAX_VOCAB);
    int32_t pos[KD_SEQ_MAX_ROWS], res[2 * KD_SEQ_MAX_ROWS];
    for (int i = 0; i < n; i++) pos[i] = positions ? positions[i] : s->out_positions[i] + 1;
    /* scratch regions free after a forward: ids (positions in), vis (tokens, then row codes,
     * out in one download; vis holds at least 2 int32 per row) */
    kd_fwd_plan p;
    kd_fwd_plan_make(m, s->out_cap, &p);
    int32_t *d_pos = (int32_t *)((char *)s->rk[0].scratch + p.ids);
    int32_t *d_out = (int32_t *)((char *)s->rk[0].scratch + p.vis), *d_code = d_out + n;
    KD_TRY(be->ops->upload(be, d_pos, pos, sizeof(int32_t) * (size_t)n));
    int chunk = kd_whole_rows_chunk(m, n);   /* several ranks: gathered whole on rank 0, 32 rows at a time */
    for (int c0 = 0; c0 < n; c0 += chunk) {
        int k = n - c0 < chunk ? n - c0 : chunk;
        kd_act rows;
        KD_TRY(kd_seq_rows_whole(s, c0, k, &rows));
        KD_TRY(be->ops->sample_rows(be, rows, sp, d_pos + c0, 0, d_out + c0, d_code + c0));
    }
    KD_TRY(be->ops->download(be, res, d_out, sizeof(int32_t) * 2 * (size_t)n));
    const int32_t *code = res + n;
    for (int i = 0; i < n; i++)
        if (code[i]) {
            kd_sample_fail(code[i]);
            return kd_fail_context(KD_ERR_ARG, "kd_seq_sample: row %d (position %d)", i, (int)pos[i]);
        }
    memcpy(dst, res, sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++)
        if (dst[i] < 0 || dst[i] >= m->cfg.vocab)
            return kd_fail(KD_ERR_BACKEND, "kd_seq_sample: row %d: the backend drew token %d (vocabulary %d)", i,
                           (int)dst[i], m->cfg.vocab);
    return KD_OK;
}
