/* testing_ddtree.c: the op test surface of the DDTree round ops (kdtree_testing_ddtree.h).
 * Every call allocates its backend buffers, uploads, runs the op(s), downloads and frees,
 * so a failing call leaks nothing and leaves the handle usable. */
#include "kdtree_testing_ddtree.h"
#include "kdtree_testing.h"
#include "backend.h"
#include "tree.h"
#include "error.h"
#include <stdlib.h>
#include <string.h>

struct kd_test_dd {
    kd_backend *be;
};

kd_status kd_test_dd_new(kd_backend_kind kind, int device, kd_test_dd **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_test_dd_new: out is NULL");
    *out = NULL;
    kd_test_dd *h = calloc(1, sizeof *h);
    if (!h) return kd_fail(KD_ERR_NOMEM, "kd_test_dd_new: out of memory");
    kd_status st = kd_test_raw_backend_new(kind, device, NULL, &h->be);
    if (st != KD_OK) {
        free(h);
        return st;
    }
    *out = h;
    return KD_OK;
}

void kd_test_dd_free(kd_test_dd *h) {
    if (!h) return;
    if (h->be) h->be->ops->destroy(h->be);
    free(h);
}

/* a backend copy of a tree for cap nodes and topk entries */
static kd_status dtree_new(kd_backend *be, int cap, int topk, kd_dtree *d, void **buf) {
    size_t bytes = kd_dtree_layout(d, NULL, cap, topk);
    KD_TRY(be->ops->alloc(be, bytes, buf));
    kd_dtree_layout(d, *buf, cap, topk);
    return KD_OK;
}

kd_status kd_test_dd_tree(kd_test_dd *h, const float *logprobs, int L, int V, int budget, int *n, int32_t *tokens,
                          int32_t *parents, int32_t *depths, uint64_t *vis, int32_t *status) {
    if (!h || !logprobs || !n || !tokens || !parents || !depths || !vis || !status)
        return kd_fail(KD_ERR_ARG, "kd_test_dd_tree: NULL argument");
    if (L <= 0 || L > KD_TREE_MAX_DEPTH || V <= 0 || budget <= 0)
        return kd_fail(KD_ERR_ARG, "kd_test_dd_tree: L = %d, V = %d, budget = %d", L, V, budget);
    kd_backend *be = h->be;
    int K = budget < V ? budget : V;
    kd_dtree d;
    void *buf = NULL, *x = NULL;
    kd_status st = dtree_new(be, budget, L * K, &d, &buf);
    if (st == KD_OK) st = be->ops->alloc(be, sizeof(float) * (size_t)L * V, &x);
    if (st == KD_OK) st = be->ops->upload(be, x, logprobs, sizeof(float) * (size_t)L * V);
    if (st == KD_OK) st = be->ops->topk(be, (kd_act){ x, L, V, V, KD_F32 }, K, d.vals, d.ids);
    if (st == KD_OK) st = be->ops->tree_select(be, &d, L, K, budget);
    if (st == KD_OK) st = be->ops->download(be, status, d.status, 4 * sizeof(int32_t));
    if (st == KD_OK && (status[2] < 0 || status[2] > budget))
        st = kd_fail(KD_ERR_BACKEND, "kd_test_dd_tree: the backend reports %d nodes (budget %d)", status[2], budget);
    if (st == KD_OK) {
        int m = status[2], words = (m + 1 + 63) / 64;
        *n = m;
        st = be->ops->download(be, tokens, d.token, sizeof(int32_t) * (size_t)(m + 1));
        if (st == KD_OK) st = be->ops->download(be, parents, d.parent, sizeof(int32_t) * (size_t)(m + 1));
        if (st == KD_OK) st = be->ops->download(be, depths, d.depth, sizeof(int32_t) * (size_t)(m + 1));
        if (st == KD_OK) st = be->ops->download(be, vis, d.vis, sizeof(uint64_t) * (size_t)(m + 1) * (size_t)words);
        tokens[0] = -1;   /* the root token is the caller's (kd_tree_set_root); token[0] is not built */
    }
    if (x) be->ops->free(be, x);
    if (buf) be->ops->free(be, buf);
    return st;
}

kd_status kd_test_dd_sample(kd_test_dd *h, const float *logits, int rows, int V, const kd_sampler *sp,
                            const int32_t *positions, int32_t *out, int32_t *code) {
    if (!h || !logits || !sp || !positions || !out || !code) return kd_fail(KD_ERR_ARG, "kd_test_dd_sample: NULL argument");
    if (rows <= 0 || V <= 0) return kd_fail(KD_ERR_ARG, "kd_test_dd_sample: rows = %d, V = %d", rows, V);
    kd_backend *be = h->be;
    void *x = NULL, *ints = NULL;
    size_t r = (size_t)rows;
    kd_status st = be->ops->alloc(be, sizeof(float) * r * (size_t)V, &x);
    if (st == KD_OK) st = be->ops->alloc(be, sizeof(int32_t) * 3 * r, &ints);
    int32_t *d_pos = ints, *d_out = d_pos ? d_pos + r : NULL, *d_code = d_out ? d_out + r : NULL;
    if (st == KD_OK) st = be->ops->upload(be, x, logits, sizeof(float) * r * (size_t)V);
    if (st == KD_OK) st = be->ops->upload(be, d_pos, positions, sizeof(int32_t) * r);
    if (st == KD_OK) st = be->ops->sample_rows(be, (kd_act){ x, rows, V, V, KD_F32 }, sp, d_pos, 0, d_out, d_code);
    if (st == KD_OK) st = be->ops->download(be, out, d_out, sizeof(int32_t) * r);
    if (st == KD_OK) st = be->ops->download(be, code, d_code, sizeof(int32_t) * r);
    if (x) be->ops->free(be, x);
    if (ints) be->ops->free(be, ints);
    return st;
}

kd_status kd_test_dd_walk(kd_test_dd *h, const int32_t *tokens, const int32_t *parents, const int32_t *depths, int n,
                          const int32_t *targets, const int32_t *codes, int sampled, int32_t *hdr, int32_t *nodes,
                          int32_t *toks) {
    if (!h || !tokens || !parents || !depths || !targets || !hdr || !nodes || !toks || (sampled && !codes))
        return kd_fail(KD_ERR_ARG, "kd_test_dd_walk: NULL argument");
    if (n < 0) return kd_fail(KD_ERR_ARG, "kd_test_dd_walk: n = %d", n);
    for (int i = 1; i <= n; i++)
        if (parents[i] < 0 || parents[i] >= i)
            return kd_fail(KD_ERR_ARG, "kd_test_dd_walk: parents[%d] = %d: expected 0..%d", i, parents[i], i - 1);
    kd_backend *be = h->be;
    kd_dtree d;
    void *buf = NULL;
    size_t N = (size_t)n + 1;
    kd_status st = dtree_new(be, n, 1, &d, &buf);
    int32_t st4[4] = { 0, 0, n, 0 };
    if (st == KD_OK) st = be->ops->upload(be, d.status, st4, sizeof st4);
    if (st == KD_OK) st = be->ops->upload(be, d.token, tokens, sizeof(int32_t) * N);
    if (st == KD_OK) st = be->ops->upload(be, d.parent, parents, sizeof(int32_t) * N);
    if (st == KD_OK) st = be->ops->upload(be, d.depth, depths, sizeof(int32_t) * N);
    if (st == KD_OK) st = be->ops->upload(be, d.target, targets, sizeof(int32_t) * N);
    if (st == KD_OK && sampled) st = be->ops->upload(be, d.row_status, codes, sizeof(int32_t) * N);
    if (st == KD_OK) st = be->ops->tree_stage(be, &d, n, tokens[0], 100, NULL, NULL, NULL);
    if (st == KD_OK) st = be->ops->tree_walk(be, &d, n, sampled);
    if (st == KD_OK) st = be->ops->download(be, hdr, d.result, sizeof(int32_t) * KD_DTREE_HDR);
    if (st == KD_OK) st = be->ops->download(be, nodes, d.result + KD_DTREE_HDR, sizeof(int32_t) * N);
    if (st == KD_OK) st = be->ops->download(be, toks, d.result + KD_DTREE_HDR + N, sizeof(int32_t) * N);
    if (buf) be->ops->free(be, buf);
    return st;
}
