/* cpu_moe.c: the routed experts of a DeepSeek-V3 / Kimi MoE layer, fp32.
 *
 * Router (HF DeepseekV3TopkRouter, transformers 5.x, "noaux_tc"):
 *   scores = sigmoid(x @ router^T)                        fp32
 *   choice = scores + e_score_correction_bias             (bias only selects)
 *   group score = sum of the top-2 choice values of each of n_group groups;
 *   the topk_group best groups stay, the others' experts get choice = -inf
 *   (transformers 5.x masks with -inf; older releases used 0.0)
 *   idx = the top_k experts by choice (equal values: lower expert id first)
 *   w = scores[idx]; norm_topk_prob: w /= sum(w) + 1e-20; w *= routed_scaling_factor
 * Experts: out[t] = sum over the chosen experts, in ascending expert id (HF's order),
 *   of w * down(silu(gate x) * up x). The shared experts are not part of this op. */
#include "cpu.h"

/* the index of the best of v[0..n) not yet taken (ties: lowest index) */
static int best_free(const float *v, const unsigned char *taken, int n) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (taken[i]) continue;
        if (best < 0 || v[i] > v[best]) best = i;
    }
    return best;
}

/* route one token: choose top_k experts of `scores` (n), write ids and weights */
static void route(const kd_experts *e, const float *scores, float *choice, unsigned char *taken,
                  int32_t *ids, float *w) {
    int n = e->n, ng = e->n_group > 0 ? e->n_group : 1, per = n / ng;
    for (int i = 0; i < n; i++) choice[i] = scores[i] + (e->bias ? e->bias[i] : 0.0f);
    if (ng > 1) {
        /* group scores: top-2 sum inside each group (float gscore[ng] lives after choice) */
        float *gscore = choice + n;
        for (int g = 0; g < ng; g++) {
            float a = -INFINITY, b = -INFINITY;     /* a >= b */
            for (int i = g * per; i < (g + 1) * per; i++) {
                float c = choice[i];
                if (c > a) { b = a; a = c; } else if (c > b) b = c;
            }
            gscore[g] = per >= 2 ? a + b : a;
        }
        memset(taken, 0, (size_t)ng);
        for (int j = 0; j < e->topk_group && j < ng; j++) taken[best_free(gscore, taken, ng)] = 1;
        for (int g = 0; g < ng; g++)
            if (!taken[g]) for (int i = g * per; i < (g + 1) * per; i++) choice[i] = -INFINITY;
    }
    memset(taken, 0, (size_t)n);
    float sum = 0.0f;
    for (int j = 0; j < e->top_k; j++) {
        int b = best_free(choice, taken, n);
        taken[b] = 1;
        ids[j] = b;
        w[j] = scores[b];
        sum += w[j];
    }
    for (int j = 0; j < e->top_k; j++) {
        if (e->norm_topk_prob) w[j] /= sum + 1e-20f;
        w[j] *= e->routed_scaling_factor;
    }
}

kd_status kd_cpu_moe(kd_backend *be, kd_act x, const kd_experts *e, kd_act shared, kd_act out) {
    KD_TRY(kd_cpu_check_f32("moe", "x", x));
    KD_TRY(kd_cpu_check_f32("moe", "out", out));
    KD_TRY(kd_cpu_check_shape("moe", "out", out, x.rows, x.cols));
    if (shared.data) {
        KD_TRY(kd_cpu_check_f32("moe", "shared", shared));
        KD_TRY(kd_cpu_check_shape("moe", "shared", shared, x.rows, x.cols));
        if (shared.data == out.data) return kd_fail(KD_ERR_ARG, "cpu moe: shared must not alias out");
    }
    if (!e || !e->router || !e->gate || !e->up || !e->down || e->n <= 0 || e->top_k <= 0 || e->top_k > e->n ||
        (e->n_group > 1 && (e->n % e->n_group || e->topk_group <= 0 || e->topk_group > e->n_group)))
        return kd_fail(KD_ERR_ARG, "cpu moe: bad expert table (n %d, top_k %d, n_group %d, topk_group %d)",
                       e ? e->n : 0, e ? e->top_k : 0, e ? e->n_group : 0, e ? e->topk_group : 0);
    KD_TRY(kd_cpu_check_weight("moe", e->router));
    int T = x.rows, H = x.cols, n = e->n, K = e->top_k, I = (int)e->gate[0].rows;
    if (e->router->rows != n || e->router->cols != H)
        return kd_fail(KD_ERR_ARG, "cpu moe: router '%s' is [%lld, %lld], expected [%d, %d]",
                       e->router->name ? e->router->name : "?", (long long)e->router->rows,
                       (long long)e->router->cols, n, H);
    for (int i = 0; i < n; i++) {
        const kd_weight *g = &e->gate[i], *u = &e->up[i], *d = &e->down[i];
        KD_TRY(kd_cpu_check_weight("moe", g));
        KD_TRY(kd_cpu_check_weight("moe", u));
        KD_TRY(kd_cpu_check_weight("moe", d));
        if (g->rows != I || g->cols != H || u->rows != I || u->cols != H || d->rows != H || d->cols != I)
            return kd_fail(KD_ERR_ARG, "cpu moe: expert %d: gate '%s' [%lld, %lld], up [%lld, %lld], down [%lld, %lld]: "
                           "expected [%d, %d], [%d, %d], [%d, %d]", i, g->name ? g->name : "?",
                           (long long)g->rows, (long long)g->cols, (long long)u->rows, (long long)u->cols,
                           (long long)d->rows, (long long)d->cols, I, H, I, H, H, I);
    }
    /* work layout: scores [T,n] | choice [n + n_group] | w [T,K] | ids [T,K] | taken [n] bytes |
     *              tok [T] | slot [T] | xs [T,H] | g [T,I] | u [T,I] | d [T,H] */
    size_t o_scores = 0, o_choice = o_scores + (size_t)T * n, o_w = o_choice + n + (e->n_group > 1 ? e->n_group : 1);
    size_t o_ids = o_w + (size_t)T * K, o_taken = o_ids + (size_t)T * K, o_tok = o_taken + (n + 3) / 4;
    size_t o_slot = o_tok + T, o_xs = o_slot + T, o_g = o_xs + (size_t)T * H, o_u = o_g + (size_t)T * I;
    size_t o_d = o_u + (size_t)T * I, total = o_d + (size_t)T * H;
    float *wk;
    KD_TRY(kd_cpu_work(be, total, &wk));
    float *scores = wk + o_scores, *choice = wk + o_choice, *wsel = wk + o_w;
    int32_t *ids = (int32_t *)(wk + o_ids), *tok = (int32_t *)(wk + o_tok), *slot = (int32_t *)(wk + o_slot);
    unsigned char *taken = (unsigned char *)(wk + o_taken);
    float *xs = wk + o_xs, *gb = wk + o_g, *ub = wk + o_u, *db = wk + o_d;

    /* 1. router logits in fp32, sigmoid, selection */
    KD_TRY(kd_cpu_matmul_wt(be, x.data, T, x.ld, H, e->router, 0, 0, n, scores, n));
    for (size_t i = 0; i < (size_t)T * n; i++) scores[i] = 1.0f / (1.0f + expf(-scores[i]));
    for (int t = 0; t < T; t++) route(e, scores + (size_t)t * n, choice, taken, ids + (size_t)t * K, wsel + (size_t)t * K);

    /* 2. experts in ascending id, each over the tokens that chose it */
    for (int t = 0; t < T; t++) memset(kd_act_f32_row(out, t), 0, (size_t)H * sizeof(float));
    for (int ex = 0; ex < n; ex++) {
        int m = 0;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++)
                if (ids[(size_t)t * K + j] == ex) { tok[m] = t; slot[m] = j; m++; }
        if (!m) continue;
        for (int i = 0; i < m; i++) memcpy(xs + (size_t)i * H, kd_act_f32_row(x, tok[i]), (size_t)H * sizeof(float));
        KD_TRY(kd_cpu_matmul_wt(be, xs, m, H, H, &e->gate[ex], 0, 0, I, gb, I));
        KD_TRY(kd_cpu_matmul_wt(be, xs, m, H, H, &e->up[ex], 0, 0, I, ub, I));
        for (size_t i = 0; i < (size_t)m * I; i++) gb[i] = gb[i] / (1.0f + expf(-gb[i])) * ub[i];
        KD_TRY(kd_cpu_matmul_wt(be, gb, m, I, I, &e->down[ex], 0, 0, H, db, H));
        for (int i = 0; i < m; i++) {
            float wt = wsel[(size_t)tok[i] * K + slot[i]], *o = kd_act_f32_row(out, tok[i]);
            const float *dr = db + (size_t)i * H;
            for (int c = 0; c < H; c++) o[c] += dr[c] * wt;
        }
    }
    return shared.data ? kd_cpu_add(be, out, shared) : KD_OK;
}
