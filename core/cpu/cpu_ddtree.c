/* cpu_ddtree.c: the CPU twins of the DDTree round ops (backend.h: tree_select, tree_stage,
 * sample_rows, tree_walk). Backend memory is host memory here, so each twin is the host
 * code itself: Algorithm 1 of tree.c, the sampling rule of sample.c, the accept walk of
 * docs/ddtree.md. The CUDA ops (cuda/ddtree.cu) must give exactly these results. */
#include "cpu.h"
#include "../tree.h"
#include "../sample.h"
#include "../sample_rule.h"
#include <stdlib.h>

kd_status kd_cpu_tree_select(kd_backend *be, const kd_dtree *t, int L, int K, int budget) {
    (void)be;
    if (!t || L <= 0 || L > KD_TREE_MAX_DEPTH || K <= 0 || budget < 0 || budget > t->cap || (size_t)L * K > (size_t)t->topk_cap)
        return kd_fail(KD_ERR_ARG, "cpu tree_select: L = %d, K = %d, budget = %d do not fit the tree (%d nodes, %d list "
                       "entries)", L, K, budget, t ? t->cap : 0, t ? t->topk_cap : 0);
    /* the first NaN / +inf list value (reported by the host later; the build clamps it) */
    int32_t bad = 0, bad_at = 0;
    for (int i = 0; i < L * K; i++) {
        float v = t->vals[i];
        if (v != v || (isinf(v) && v > 0)) {
            bad = v != v ? 1 : 2;
            bad_at = i;
            break;
        }
    }
    int32_t *rank = malloc(sizeof(int32_t) * ((size_t)budget + 1));
    double *score = malloc(sizeof(double) * ((size_t)budget + 1));
    if (!rank || !score) {
        free(rank); free(score);
        return kd_fail(KD_ERR_NOMEM, "cpu tree_select: cannot allocate scratch for %d nodes", budget);
    }
    int n = 0;
    kd_status st = kd_tree_select_host(t->vals, t->ids, L, K, budget, t->token, t->parent, t->depth, rank, score, &n);
    free(rank);
    free(score);
    if (st != KD_OK) return st;
    t->parent[0] = -1;
    t->depth[0] = 0;
    kd_tree_mask(t->parent, n, t->vis);
    t->status[0] = bad;
    t->status[1] = bad_at;
    t->status[2] = n;
    t->status[3] = 0;
    return KD_OK;
}

kd_status kd_cpu_tree_stage(kd_backend *be, const kd_dtree *t, int n, int32_t root, int32_t pos0, int32_t *ids,
                            int32_t *pos_out, uint64_t *vis_out) {
    (void)be;
    if (!t || n < 0 || n > t->cap) return kd_fail(KD_ERR_ARG, "cpu tree_stage: %d nodes in a tree of %d", n, t ? t->cap : 0);
    t->token[0] = root;
    t->parent[0] = -1;
    t->depth[0] = 0;
    for (int i = 0; i <= n; i++) t->pos[i] = pos0 + t->depth[i];
    if (ids) {
        size_t words = (size_t)(n + 1 + 63) / 64;
        memcpy(ids, t->token, sizeof(int32_t) * (size_t)(n + 1));
        memcpy(pos_out, t->pos, sizeof(int32_t) * (size_t)(n + 1));
        memcpy(vis_out, t->vis, sizeof(uint64_t) * (size_t)(n + 1) * words);
    }
    return KD_OK;
}

kd_status kd_cpu_sample_rows(kd_backend *be, kd_act x, const kd_sampler *sp, const int32_t *pos, int pos_offset,
                             int32_t *out, int32_t *code) {
    (void)be;
    KD_TRY(kd_cpu_check_f32("sample_rows", "logits", x));
    if (!sp || !(sp->temperature > 0.0f)) return kd_fail(KD_ERR_ARG, "cpu sample_rows: a greedy sampler (use argmax)");
    if (x.cols <= 0 || x.cols > KD_SAMPLE_MAX_VOCAB)
        return kd_fail(KD_ERR_ARG, "cpu sample_rows: %d columns: expected 1..%d", x.cols, KD_SAMPLE_MAX_VOCAB);
    if (!x.rows) return KD_OK;
    uint64_t *q = malloc(sizeof(uint64_t) * (size_t)x.cols);
    int32_t *a = malloc(sizeof(int32_t) * (size_t)x.cols);
    if (!q || !a) {
        free(q); free(a);
        return kd_fail(KD_ERR_NOMEM, "cpu sample_rows: cannot allocate scratch for a vocabulary of %d", x.cols);
    }
    for (int r = 0; r < x.rows; r++) {
        out[r] = -1;
        code[r] = kd_sample_row_code(kd_act_f32_row(x, r), x.cols, sp, pos[r] + pos_offset, q, a, &out[r]);
    }
    free(q);
    free(a);
    return KD_OK;
}

kd_status kd_cpu_tree_walk(kd_backend *be, const kd_dtree *t, int n, int sampled) {
    (void)be;
    if (!t || n < 0 || n > t->cap) return kd_fail(KD_ERR_ARG, "cpu tree_walk: %d nodes in a tree of %d", n, t ? t->cap : 0);
    int N = t->cap + 1;
    int32_t *hdr = t->result, *nodes = t->result + KD_DTREE_HDR, *toks = nodes + N;
    memset(hdr, 0, sizeof(int32_t) * KD_DTREE_HDR);
    hdr[KD_DTREE_R_BUILD] = t->status[0];
    hdr[KD_DTREE_R_BUILD + 1] = t->status[1];
    hdr[KD_DTREE_R_N] = t->status[2];
    int cur = 0, tau = 0;
    int32_t bonus = -1;
    for (;;) {
        if (sampled && t->row_status[cur]) {
            hdr[KD_DTREE_R_STATUS] = t->row_status[cur];
            hdr[KD_DTREE_R_NODE] = cur;
            hdr[KD_DTREE_R_POS] = t->pos[cur] + 1;
            break;
        }
        nodes[tau] = cur;
        toks[tau] = t->token[cur];
        tau++;
        int32_t next = t->target[cur];
        int c = -1;
        for (int j = cur + 1; j <= n; j++)     /* the child of cur with token next (the first in pop order) */
            if (t->parent[j] == cur && t->token[j] == next) { c = j; break; }
        if (c < 0 || tau >= N) { bonus = next; break; }
        cur = c;
    }
    hdr[KD_DTREE_R_TAU] = tau;
    hdr[KD_DTREE_R_BONUS] = bonus;
    return KD_OK;
}
