/* tree.c: the DDTree draft tree and its builder (Algorithm 1 of Ringel & Romano,
 * "DDTree", as the reference code build_ddtree_tree implements it).
 *
 * Exact rules (docs/ddtree.md; scripts/golden/tree_ref.py is the independent
 * Python reference the specs compare against):
 *  - log-probs per depth: is_logprobs = 1 takes the values as given; otherwise
 *    lp = x - lse in fp32, lse = (float)(m + log(sum_i exp((double)x_i - m))) with
 *    m the row max and the sum taken in double in id order. A log-prob of -inf
 *    (probability 0) is clamped to -FLT_MAX so the double sums below stay finite;
 *    NaN anywhere, +inf, or a logits row with no finite value is an error.
 *  - K = min(budget, V); per depth the K best log-probs, value descending, equal
 *    values ranked lower token id first.
 *  - best-first: a max-heap of (score, rank tuple); the score is updated
 *    incrementally in double exactly as the reference does:
 *        next sibling: (logw - lp[d-1][r]) + lp[d-1][r+1]     first child: logw + lp[d][0]
 *    equal scores are ordered by the rank tuple, lexicographically ascending
 *    (Python's heapq comparing the tuples). Nodes are numbered in pop order, the
 *    root (the bonus token) is node 0, the build stops after `budget` pops or
 *    when the heap is empty; depth limit L.
 *
 * Heap entries store (score, parent node, depth, rank): the rank tuple of an
 * entry is the rank tuple of its (already popped) parent plus its own rank, so two
 * entries are compared on exact score ties only, by walking their parent chains
 * (at most KD_TREE_MAX_DEPTH steps). The heap holds at most 2*budget+1 entries.
 *
 * The backend copy (tree.h): kd_tree_build_drafted runs the backend's topk and
 * tree_select ops (the CUDA one runs this same algorithm on the device, cuda/ddtree.cu)
 * and leaves the host arrays stale; kd_tree_host downloads them when asked.
 */
#include "tree.h"
#include "error.h"
#include "model.h"
#include "drafter.h"
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { KD_TREE_MAX_BUDGET = 65536 };

/* ---------------------------------------------------------------- storage */

static void tree_arrays_free(kd_tree *t) {
    free(t->token); free(t->parent); free(t->depth); free(t->rank);
    free(t->score); free(t->first_child); free(t->next_sibling);
    t->token = t->parent = t->depth = t->rank = t->first_child = t->next_sibling = NULL;
    t->score = NULL;
}

/* make room for 1+n entries; on failure the tree is unchanged */
static kd_status tree_reserve(kd_tree *t, int n) {
    int need = n + 1;
    if (need <= t->cap) return KD_OK;
    int cap = t->cap ? t->cap : 16;
    while (cap < need) cap *= 2;
    size_t i4 = sizeof(int32_t) * (size_t)cap;
    int32_t *tok = malloc(i4), *par = malloc(i4), *dep = malloc(i4), *rk = malloc(i4);
    int32_t *fc = malloc(i4), *ns = malloc(i4);
    double *sc = malloc(sizeof(double) * (size_t)cap);
    if (!tok || !par || !dep || !rk || !fc || !ns || !sc) {
        free(tok); free(par); free(dep); free(rk); free(fc); free(ns); free(sc);
        return kd_fail(KD_ERR_NOMEM, "kd_tree: cannot allocate %d nodes", need);
    }
    if (t->cap) {   /* keep the current tree (its host copy) */
        size_t k = (size_t)(t->host_valid ? t->n + 1 : 1);
        memcpy(tok, t->token, k * 4); memcpy(par, t->parent, k * 4);
        memcpy(dep, t->depth, k * 4); memcpy(rk, t->rank, k * 4);
        memcpy(fc, t->first_child, k * 4); memcpy(ns, t->next_sibling, k * 4);
        memcpy(sc, t->score, k * sizeof(double));
    }
    tree_arrays_free(t);
    t->token = tok; t->parent = par; t->depth = dep; t->rank = rk;
    t->first_child = fc; t->next_sibling = ns; t->score = sc;
    t->cap = cap;
    return KD_OK;
}

/* the child lists of nodes 0..n (children in pop order) and max_depth, from the host arrays */
static void tree_relink(kd_tree *t) {
    for (int i = 0; i <= t->n; i++) t->first_child[i] = t->next_sibling[i] = -1;
    int maxd = 0;
    for (int i = t->n; i >= 1; i--) {
        int p = t->parent[i];
        t->next_sibling[i] = t->first_child[p];
        t->first_child[p] = i;
        if (t->depth[i] > maxd) maxd = t->depth[i];
    }
    t->max_depth = maxd;
    t->depth_bound = maxd;
}

/* the host arrays now hold a new tree: link it, the backend copy is stale, the version moves */
static void tree_link(kd_tree *t) {
    tree_relink(t);
    t->host_valid = true;
    t->dev_valid = false;
    t->version++;
}

/* free the backend copy and drop the model reference (the host copy must be valid first
 * when the tree lives on) */
static void tree_dev_release(kd_tree *t) {
    if (t->dev_buf && t->model) {
        t->model->be->ops->free(t->model->be, t->dev_buf);
        t->model->mem_trees -= t->dev_bytes;
    }
    if (t->model) kd_model_unref(t->model);
    t->model = NULL;
    t->dev_buf = NULL;
    t->dev_bytes = 0;
    memset(&t->dev, 0, sizeof t->dev);
    t->dev_valid = false;
}

static size_t align256(size_t v) { return (v + 255u) & ~(size_t)255u; }

/* the layout of the backend copy (backend.h kd_dtree): status (KD_DTREE_STATUS words, padded
 * to STATUS_WORDS), token, parent and depth contiguous (kd_tree_host downloads them in one
 * piece, kd_tree_to_backend uploads them in one), then the rest 256-byte aligned */
enum { STATUS_WORDS = 8 };
static size_t head_words(int cap) { return STATUS_WORDS + 3 * ((size_t)cap + 1); }

size_t kd_dtree_layout(kd_dtree *d, void *base_ptr, int cap, int topk_cap) {
    char *base = (char *)base_ptr;
    size_t N = (size_t)cap + 1, words = (N + 63) / 64, off = 0;
    d->cap = cap;
    d->topk_cap = topk_cap;
    d->status = (int32_t *)(base + off); off += STATUS_WORDS * sizeof(int32_t);
    d->token = (int32_t *)(base + off); off += N * sizeof(int32_t);
    d->parent = (int32_t *)(base + off); off += N * sizeof(int32_t);
    d->depth = (int32_t *)(base + off); off = align256(off + N * sizeof(int32_t));
    d->pos = (int32_t *)(base + off); off = align256(off + N * sizeof(int32_t));
    d->target = (int32_t *)(base + off); off = align256(off + N * sizeof(int32_t));
    d->row_status = (int32_t *)(base + off); off = align256(off + N * sizeof(int32_t));
    d->result = (int32_t *)(base + off); off = align256(off + (KD_DTREE_HDR + 2 * N) * sizeof(int32_t));
    d->vis = (uint64_t *)(base + off); off = align256(off + N * words * sizeof(uint64_t));
    d->vals = (float *)(base + off); off = align256(off + (size_t)topk_cap * sizeof(float));
    d->ids = (int32_t *)(base + off); off = align256(off + (size_t)topk_cap * sizeof(int32_t));
    return off;
}

/* a backend copy on m with room for cap nodes and topk_cap list entries; its content is
 * not kept (callers make the host copy valid first when they need it) */
static kd_status tree_dev_reserve(kd_tree *t, kd_model *m, int cap, int topk_cap, const char *fn) {
    if (t->model == m && t->dev_buf && t->dev.cap >= cap && t->dev.topk_cap >= topk_cap) return KD_OK;
    if (t->model == m && t->dev_buf) {   /* grow: keep the larger of the old and new shapes */
        if (t->dev.cap > cap) cap = t->dev.cap;
        if (t->dev.topk_cap > topk_cap) topk_cap = t->dev.topk_cap;
    }
    tree_dev_release(t);
    kd_dtree d;
    size_t bytes = kd_dtree_layout(&d, NULL, cap, topk_cap);
    void *buf = NULL;
    kd_status st = m->be->ops->alloc(m->be, bytes, &buf);
    if (st != KD_OK) return kd_fail_context(st, "%s: the tree's backend copy (%d nodes, %zu bytes)", fn, cap, bytes);
    kd_dtree_layout(&t->dev, buf, cap, topk_cap);
    t->dev_buf = buf;
    t->dev_bytes = bytes;
    t->model = m;
    m->mem_trees += bytes;
    m->n_seqs++;        /* the model (its backend) outlives this buffer */
    return KD_OK;
}

kd_status kd_tree_new(kd_tree **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_tree_new: out is NULL");
    *out = NULL;
    kd_tree *t = calloc(1, sizeof *t);
    if (!t) return kd_fail(KD_ERR_NOMEM, "kd_tree_new: cannot allocate a tree");
    if (tree_reserve(t, 0) != KD_OK) { free(t); return KD_ERR_NOMEM; }
    t->n = 0;
    t->token[0] = -1;          /* root token unset until kd_tree_set_root */
    t->parent[0] = -1; t->depth[0] = 0; t->rank[0] = -1; t->score[0] = 0.0;
    tree_link(t);
    *out = t;
    return KD_OK;
}

void kd_tree_free(kd_tree *t) {
    if (!t) return;
    tree_dev_release(t);
    tree_arrays_free(t);
    free(t);
}

int kd_tree_size(const kd_tree *t) { return t ? t->n : 0; }

kd_status kd_tree_set_root(kd_tree *t, int32_t token) {
    if (!t) return kd_fail(KD_ERR_ARG, "kd_tree_set_root: tree is NULL");
    if (token < 0) return kd_fail(KD_ERR_ARG, "kd_tree_set_root: token: expected a token id >= 0, got %d", (int)token);
    t->token[0] = token;       /* the backend copy gets it at kd_verify */
    t->version++;
    return KD_OK;
}

kd_status kd_tree_set_chain(kd_tree *t, const int32_t *tokens, int n) {
    if (!t) return kd_fail(KD_ERR_ARG, "kd_tree_set_chain: tree is NULL");
    if (n < 0 || n > KD_TREE_MAX_BUDGET)
        return kd_fail(KD_ERR_ARG, "kd_tree_set_chain: n: expected 0..%d tokens, got %d", KD_TREE_MAX_BUDGET, n);
    if (n > 0 && !tokens) return kd_fail(KD_ERR_ARG, "kd_tree_set_chain: tokens is NULL (n = %d)", n);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0)
            return kd_fail(KD_ERR_ARG, "kd_tree_set_chain: tokens[%d]: expected a token id >= 0, got %d", i, (int)tokens[i]);
    KD_TRY(tree_reserve(t, n));
    for (int i = 1; i <= n; i++) {
        t->token[i] = tokens[i - 1];
        t->parent[i] = i - 1;
        t->depth[i] = i;
        t->rank[i] = -1;
        t->score[i] = 0.0;
    }
    t->n = n;
    tree_link(t);
    return KD_OK;
}

kd_status kd_tree_build_error(const kd_tree *t, const int32_t *status, const char *fn) {
    if (status[0]) {
        int K = t->dev_K > 0 ? t->dev_K : 1, i = status[1];
        return kd_fail(KD_ERR_BACKEND, "%s: the tree was built on the backend from a draft log-prob that is %s "
                       "(depth %d rank %d): expected finite values (or -inf)", fn, status[0] == 2 ? "+inf" : "NaN",
                       i / K + 1, i % K);
    }
    if (status[2] != t->n)
        return kd_fail(KD_ERR_BACKEND, "%s: the backend built %d tree nodes, expected %d", fn, (int)status[2], t->n);
    return KD_OK;
}

kd_status kd_tree_host(kd_tree *t, const char *fn) {
    if (t->host_valid) return KD_OK;
    if (!t->dev_valid || !t->model)
        return kd_fail(KD_ERR_STATE, "%s: the tree has neither a host nor a backend copy", fn);
    KD_TRY(tree_reserve(t, t->n));
    size_t N = (size_t)t->dev.cap + 1, words = head_words(t->dev.cap);
    int32_t *buf = malloc(words * sizeof(int32_t));
    if (!buf) return kd_fail(KD_ERR_NOMEM, "%s: cannot allocate %zu bytes to read the tree", fn, words * 4);
    kd_backend *be = t->model->be;
    kd_status st = be->ops->download(be, buf, t->dev.status, words * sizeof(int32_t));
    if (st != KD_OK) kd_fail_context(st, "%s: reading the tree from the backend", fn);
    if (st == KD_OK) st = kd_tree_build_error(t, buf, fn);
    if (st == KD_OK) {
        const int32_t *tok = buf + STATUS_WORDS, *par = tok + N, *dep = par + N;
        for (int i = 1; i <= t->n; i++) {   /* token[0] (the root) lives on the host */
            t->token[i] = tok[i];
            t->parent[i] = par[i];
            t->depth[i] = dep[i];
            t->rank[i] = -1;
            t->score[i] = 0.0;
            if (par[i] < 0 || par[i] >= i || dep[i] < 1) {
                st = kd_fail(KD_ERR_BACKEND, "%s: the backend's tree has node %d with parent %d, depth %d", fn, i,
                             (int)par[i], (int)dep[i]);
                break;
            }
        }
    }
    free(buf);
    if (st != KD_OK) return st;
    t->parent[0] = -1; t->depth[0] = 0; t->rank[0] = -1; t->score[0] = 0.0;
    tree_relink(t);        /* no version change: the same tree */
    t->host_valid = true;
    return KD_OK;
}

kd_status kd_tree_to_backend(kd_tree *t, kd_model *m, const char *fn) {
    if (t->dev_valid && t->model == m) return KD_OK;
    KD_TRY(kd_tree_host(t, fn));
    KD_TRY(tree_dev_reserve(t, m, t->n, 1, fn));
    int n = t->n, N = t->dev.cap + 1;
    size_t cnt = head_words(t->dev.cap);
    int32_t *buf = calloc(cnt, sizeof(int32_t));
    if (!buf) return kd_fail(KD_ERR_NOMEM, "%s: cannot allocate the upload of %d tree nodes", fn, n + 1);
    buf[2] = n;                       /* status: no bad value, n nodes */
    int32_t *tok = buf + STATUS_WORDS, *par = tok + N, *dep = par + N;
    memcpy(tok, t->token, sizeof(int32_t) * (size_t)(n + 1));
    memcpy(par, t->parent, sizeof(int32_t) * (size_t)(n + 1));
    memcpy(dep, t->depth, sizeof(int32_t) * (size_t)(n + 1));
    kd_backend *be = m->be;
    kd_status st = be->ops->upload(be, t->dev.status, buf, cnt * sizeof(int32_t));
    free(buf);
    if (st != KD_OK) return kd_fail_context(st, "%s: uploading the tree", fn);
    t->dev_valid = true;
    return KD_OK;
}

kd_status kd_tree_nodes(const kd_tree *t, int32_t *tokens, int32_t *parents, int32_t *depths) {
    if (!t) return kd_fail(KD_ERR_ARG, "kd_tree_nodes: tree is NULL");
    if (!tokens && !parents && !depths) return KD_OK;
    KD_TRY(kd_tree_host((kd_tree *)t, "kd_tree_nodes"));   /* the host view is filled lazily */
    size_t k = (size_t)(t->n + 1) * sizeof(int32_t);
    if (tokens) memcpy(tokens, t->token, k);
    if (parents) memcpy(parents, t->parent, k);
    if (depths) memcpy(depths, t->depth, k);
    return KD_OK;
}

void kd_tree_mask(const int32_t *parent, int n, uint64_t *dst) {
    int rows = n + 1, words = (rows + 63) / 64;
    memset(dst, 0, sizeof(uint64_t) * (size_t)rows * (size_t)words);
    dst[0] = 1;
    for (int i = 1; i < rows; i++) {
        uint64_t *row = dst + (size_t)i * words;
        const uint64_t *prow = dst + (size_t)parent[i] * words;
        int used = parent[i] / 64 + 1;      /* the parent's row has no bits past its own */
        memcpy(row, prow, sizeof(uint64_t) * (size_t)used);
        row[i / 64] |= (uint64_t)1 << (i % 64);
    }
}

kd_status kd_tree_visibility(const kd_tree *t, uint64_t *dst) {
    if (!t) return kd_fail(KD_ERR_ARG, "kd_tree_visibility: tree is NULL");
    if (!dst) return kd_fail(KD_ERR_ARG, "kd_tree_visibility: dst is NULL");
    KD_TRY(kd_tree_host((kd_tree *)t, "kd_tree_visibility"));
    kd_tree_mask(t->parent, t->n, dst);
    return KD_OK;
}

int kd_tree_child(const kd_tree *t, int node, int32_t token) {
    for (int c = t->first_child[node]; c >= 0; c = t->next_sibling[c])
        if (t->token[c] == token) return c;
    return -1;
}

/* ---------------------------------------------------------------- top-K per depth */

/* a is worse than b: lower value, or the same value and a higher id */
static inline bool worse(float av, int32_t ai, float bv, int32_t bi) {
    return av < bv || (av == bv && ai > bi);
}

static void minheap_down(float *hv, int32_t *hi, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && worse(hv[l], hi[l], hv[w], hi[w])) w = l;
        if (r < n && worse(hv[r], hi[r], hv[w], hi[w])) w = r;
        if (w == i) return;
        float tv = hv[i]; hv[i] = hv[w]; hv[w] = tv;
        int32_t ti = hi[i]; hi[i] = hi[w]; hi[w] = ti;
        i = w;
    }
}

static void minheap_up(float *hv, int32_t *hi, int i) {
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!worse(hv[i], hi[i], hv[p], hi[p])) return;
        float tv = hv[i]; hv[i] = hv[p]; hv[p] = tv;
        int32_t ti = hi[i]; hi[i] = hi[p]; hi[p] = ti;
        i = p;
    }
}

/* the row's K best (value, id) into vals/ids, descending; the row's values are
 * computed by value(x) on the fly. A bounded min-heap of the K best so far: one
 * compare rejects almost every element. */
kd_status kd_tree_topk_rows(const float *scores, int L, int V, int K, int is_logprobs,
                            float *vals, int32_t *ids) {
    if (!scores || !vals || !ids) return kd_fail(KD_ERR_ARG, "kd_tree_topk_rows: NULL array");
    if (L <= 0 || V <= 0 || K <= 0 || K > V)
        return kd_fail(KD_ERR_ARG, "kd_tree_topk_rows: expected L > 0, V > 0, 0 < K <= V, got L=%d V=%d K=%d", L, V, K);
    for (int d = 0; d < L; d++) {
        const float *x = scores + (size_t)d * V;
        float lse = 0.0f;
        /* validate the row; for logits, its logsumexp */
        float m = -INFINITY;
        for (int i = 0; i < V; i++) {
            float v = x[i];
            if (isnan(v) || (isinf(v) && v > 0))
                return kd_fail(KD_ERR_ARG, "kd_tree_build: %s[%d][%d] is %s: expected a finite value or -inf",
                               is_logprobs ? "logprobs" : "logits", d, i, isnan(v) ? "NaN" : "+inf");
            if (v > m) m = v;
        }
        if (!is_logprobs) {
            if (isinf(m))
                return kd_fail(KD_ERR_ARG, "kd_tree_build: logits row %d has no finite value (all -inf)", d);
            double s = 0.0, md = (double)m;
            for (int i = 0; i < V; i++) s += exp((double)x[i] - md);
            lse = (float)(md + log(s));
        }
        float *hv = vals + (size_t)d * K;
        int32_t *hi = ids + (size_t)d * K;
        int n = 0;
        for (int i = 0; i < V; i++) {
            float v = is_logprobs ? x[i] : x[i] - lse;
            if (v < -FLT_MAX) v = -FLT_MAX;           /* -inf: probability 0 */
            if (n < K) {
                hv[n] = v; hi[n] = i;
                minheap_up(hv, hi, n);
                n++;
            } else if (v > hv[0]) {   /* ids ascend, so an equal value never displaces */
                hv[0] = v; hi[0] = i;
                minheap_down(hv, hi, K, 0);
            }
        }
        /* heap sort: the worst goes last */
        for (int e = K - 1; e > 0; e--) {
            float tv = hv[0]; hv[0] = hv[e]; hv[e] = tv;
            int32_t ti = hi[0]; hi[0] = hi[e]; hi[e] = ti;
            minheap_down(hv, hi, e, 0);
        }
    }
    return KD_OK;
}

/* ---------------------------------------------------------------- best-first selection */

typedef struct heap_entry {
    double score;
    int32_t parent, depth, rank;
} heap_entry;

/* the nodes popped so far (parent, depth, rank of each) */
typedef struct sel_nodes {
    const int32_t *parent, *depth, *rank;
} sel_nodes;

/* rank tuple of an entry: the ranks of its parent's path, then its own rank */
static int entry_ranks(const sel_nodes *t, const heap_entry *e, int32_t *out) {
    out[e->depth - 1] = e->rank;
    for (int p = e->parent; p > 0; p = t->parent[p]) out[t->depth[p] - 1] = t->rank[p];
    return e->depth;
}

/* a pops before b: higher score, or the same score and a smaller rank tuple */
static bool entry_before(const sel_nodes *t, const heap_entry *a, const heap_entry *b) {
    if (a->score != b->score) return a->score > b->score;
    int32_t ra[KD_TREE_MAX_DEPTH], rb[KD_TREE_MAX_DEPTH];
    int na = entry_ranks(t, a, ra), nb = entry_ranks(t, b, rb);
    int n = na < nb ? na : nb;
    for (int i = 0; i < n; i++)
        if (ra[i] != rb[i]) return ra[i] < rb[i];
    return na < nb;   /* a proper prefix comes first (never happens between heap entries) */
}

static void heap_push(const sel_nodes *t, heap_entry *h, int *n, heap_entry e) {
    int i = (*n)++;
    h[i] = e;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!entry_before(t, &h[i], &h[p])) break;
        heap_entry tmp = h[i]; h[i] = h[p]; h[p] = tmp;
        i = p;
    }
}

static heap_entry heap_pop(const sel_nodes *t, heap_entry *h, int *n) {
    heap_entry top = h[0];
    h[0] = h[--(*n)];
    int i = 0;
    for (;;) {
        int l = 2 * i + 1, r = l + 1, b = i;
        if (l < *n && entry_before(t, &h[l], &h[b])) b = l;
        if (r < *n && entry_before(t, &h[r], &h[b])) b = r;
        if (b == i) break;
        heap_entry tmp = h[i]; h[i] = h[b]; h[b] = tmp;
        i = b;
    }
    return top;
}

static kd_status check_shape(const char *fn, int L, int V, int budget) {
    if (L <= 0 || L > KD_TREE_MAX_DEPTH)
        return kd_fail(KD_ERR_ARG, "%s: L (depths, rows of the scores): expected 1..%d, got %d", fn, KD_TREE_MAX_DEPTH, L);
    if (V <= 0) return kd_fail(KD_ERR_ARG, "%s: V (vocabulary, columns of the scores): expected > 0, got %d", fn, V);
    if (budget < 0) return kd_fail(KD_ERR_ARG, "%s: budget: expected >= 0 (0 = root only), got %d", fn, budget);
    if (budget > KD_TREE_MAX_BUDGET)
        return kd_fail(KD_ERR_ARG, "%s: budget: expected at most %d nodes, got %d", fn, KD_TREE_MAX_BUDGET, budget);
    return KD_OK;
}

int kd_tree_count(int L, int K, int budget) {
    if (K <= 0 || budget <= 0) return 0;
    long long total = 0, pw = 1;
    for (int d = 1; d <= L; d++) {
        pw *= K;
        if (pw > budget) pw = (long long)budget + 1;   /* no overflow; anything above budget is enough */
        total += pw;
        if (total >= budget) return budget;
    }
    return (int)total;
}

/* a list value as Algorithm 1 reads it: NaN and -inf -> -FLT_MAX, +inf -> FLT_MAX */
static inline double list_value(const float *vals, size_t i) {
    float v = vals[i];
    if (!(v >= -FLT_MAX)) v = -FLT_MAX;
    else if (v > FLT_MAX) v = FLT_MAX;
    return (double)v;
}

kd_status kd_tree_select_host(const float *vals, const int32_t *ids, int L, int K, int budget, int32_t *token,
                              int32_t *parent, int32_t *depth, int32_t *rank, double *score, int *n_out) {
    *n_out = 0;
    if (budget <= 0 || K <= 0) return KD_OK;
    heap_entry *heap = malloc(sizeof(heap_entry) * (2 * (size_t)budget + 1));
    if (!heap) return kd_fail(KD_ERR_NOMEM, "kd_tree_build: cannot allocate a heap of %d entries", 2 * budget + 1);
    sel_nodes nodes = { parent, depth, rank };
    parent[0] = -1; depth[0] = 0; rank[0] = -1;
    int hn = 0, n = 0;
    heap_push(&nodes, heap, &hn, (heap_entry){ list_value(vals, 0), 0, 1, 0 });
    while (hn > 0 && n < budget) {
        heap_entry e = heap_pop(&nodes, heap, &hn);
        int i = ++n, d = e.depth, r = e.rank;
        size_t row = (size_t)(d - 1) * K;
        token[i] = ids[row + r];
        parent[i] = e.parent;
        depth[i] = d;
        rank[i] = r;
        score[i] = e.score;
        if (r + 1 < K)
            heap_push(&nodes, heap, &hn,
                      (heap_entry){ e.score - list_value(vals, row + r) + list_value(vals, row + r + 1), e.parent, d, r + 1 });
        if (d < L)
            heap_push(&nodes, heap, &hn, (heap_entry){ e.score + list_value(vals, (size_t)d * K), i, d + 1, 0 });
    }
    free(heap);
    *n_out = n;
    return KD_OK;
}

kd_status kd_tree_build_topk(kd_tree *t, const float *vals, const int32_t *ids, int L, int K, int budget) {
    if (!t) return kd_fail(KD_ERR_ARG, "kd_tree_build: tree is NULL");
    KD_TRY(check_shape("kd_tree_build", L, K > 0 ? K : 1, budget));
    if (budget > 0 && (K <= 0 || !vals || !ids))
        return kd_fail(KD_ERR_ARG, "kd_tree_build: top-K lists: expected K > 0 and non-NULL arrays, got K=%d", K);
    if (K <= 0 || budget == 0) {       /* root only */
        t->n = 0;
        tree_link(t);
        return KD_OK;
    }
    KD_TRY(tree_reserve(t, budget));
    int n = 0;
    kd_status st = kd_tree_select_host(vals, ids, L, K, budget, t->token, t->parent, t->depth, t->rank, t->score, &n);
    t->n = st == KD_OK ? n : 0;
    t->parent[0] = -1; t->depth[0] = 0; t->rank[0] = -1; t->score[0] = 0.0;
    tree_link(t);
    return st;
}

kd_status kd_tree_build(kd_tree *t, const float *scores, int L, int V, int budget, int is_logprobs) {
    if (!t) return kd_fail(KD_ERR_ARG, "kd_tree_build: tree is NULL");
    if (!scores) return kd_fail(KD_ERR_ARG, "kd_tree_build: scores is NULL");
    KD_TRY(check_shape("kd_tree_build", L, V, budget));
    int K = budget < V ? budget : V;
    if (K == 0) return kd_tree_build_topk(t, NULL, NULL, L, 0, 0);
    float *vals = malloc(sizeof(float) * (size_t)L * K);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)L * K);
    kd_status st;
    if (!vals || !ids) st = kd_fail(KD_ERR_NOMEM, "kd_tree_build: cannot allocate %d x %d top-K lists", L, K);
    else {
        st = kd_tree_topk_rows(scores, L, V, K, is_logprobs, vals, ids);
        if (st == KD_OK) st = kd_tree_build_topk(t, vals, ids, L, K, budget);
    }
    free(vals);
    free(ids);
    return st;
}

/* ---------------------------------------------------------------- where the round runs */

/* the default is the backend: the H200 run of 2026-11-30 passed the whole suite with the round there */
bool kd_ddtree_on_device(const kd_model *m) { return m->opt.ddtree_round != KD_ROUND_HOST; }

/* ---------------------------------------------------------------- from the drafter */

/* the backend cannot select this budget: download the top-K lists and select on the host */
static kd_status build_on_host(kd_tree *t, kd_backend *be, int L, int K, int budget) {
    size_t n = (size_t)L * K;
    float *vals = malloc(n * sizeof(float));
    int32_t *ids = malloc(n * sizeof(int32_t));
    kd_status st = KD_OK;
    if (!vals || !ids) st = kd_fail(KD_ERR_NOMEM, "kd_tree_build_drafted: cannot allocate %d x %d top-K lists", L, K);
    if (st == KD_OK) st = be->ops->download(be, vals, t->dev.vals, n * sizeof(float));
    if (st == KD_OK) st = be->ops->download(be, ids, t->dev.ids, n * sizeof(int32_t));
    for (size_t i = 0; i < n && st == KD_OK; i++)     /* -inf is fine: Algorithm 1 reads it as -FLT_MAX */
        if (isnan(vals[i]) || (isinf(vals[i]) && vals[i] > 0))
            st = kd_fail(KD_ERR_BACKEND, "kd_tree_build_drafted: draft log-prob at depth %d rank %d is %s",
                         (int)(i / K) + 1, (int)(i % K), isnan(vals[i]) ? "NaN" : "+inf");
    if (st == KD_OK) st = kd_tree_build_topk(t, vals, ids, L, K, budget);
    free(vals);
    free(ids);
    return st;
}

kd_status kd_tree_build_drafted(kd_tree *t, kd_seq *s, int budget) {
    if (!t) return kd_fail(KD_ERR_ARG, "kd_tree_build_drafted: tree is NULL");
    if (!s) return kd_fail(KD_ERR_ARG, "kd_tree_build_drafted: sequence is NULL");
    if (!s->drafter)
        return kd_fail(KD_ERR_STATE, "kd_tree_build_drafted: no drafter attached to the sequence (kd_seq_attach_drafter)");
    kd_act lp;
    int32_t bonus;
    KD_TRY(kd_draft_logprobs(s, &lp, &bonus));
    int L = lp.rows, V = lp.cols;
    KD_TRY(check_shape("kd_tree_build_drafted", L, V, budget));
    if (lp.dtype != KD_F32)
        return kd_fail(KD_ERR_STATE, "kd_tree_build_drafted: draft log-probs: expected f32, got %s", kd_dtype_name(lp.dtype));
    if (V > s->model->cfg.vocab)
        return kd_fail(KD_ERR_STATE, "kd_tree_build_drafted: the draft's vocabulary (%d) is larger than the target's (%d)",
                       V, s->model->cfg.vocab);
    int K = budget < V ? budget : V;
    /* the tree is rooted at the draft's bonus token */
    if (K == 0) {
        KD_TRY(kd_tree_build_topk(t, NULL, NULL, L, 0, 0));
        return kd_tree_set_root(t, bonus);
    }
    kd_model *m = s->model;
    kd_backend *be = m->be;
    int n = kd_tree_count(L, K, budget);
    KD_TRY(tree_reserve(t, budget));     /* host room for a later kd_tree_host */
    kd_status st = tree_dev_reserve(t, m, budget, L * K, "kd_tree_build_drafted");
    if (st == KD_OK) st = be->ops->topk(be, lp, K, t->dev.vals, t->dev.ids);
    if (st == KD_OK) {
        st = kd_ddtree_on_device(m) ? be->ops->tree_select(be, &t->dev, L, K, budget) : KD_ERR_UNSUPPORTED;
        if (st == KD_ERR_UNSUPPORTED) st = build_on_host(t, be, L, K, budget);
        else if (st == KD_OK) {
            t->n = n;
            t->dev_K = K;
            t->depth_bound = L < n ? L : n;
            t->host_valid = false;
            t->dev_valid = true;
            t->version++;
        }
    }
    if (st != KD_OK) {                   /* leave a well-formed tree: the root alone */
        t->n = 0;
        t->parent[0] = -1; t->depth[0] = 0;
        tree_link(t);
        return st;
    }
    return kd_tree_set_root(t, bonus);
}
