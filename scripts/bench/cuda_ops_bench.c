/* cuda_ops_bench.c: timings of the CUDA backend's ops (not the W4A16 GEMM, which has its
 * own bench): dense bf16 linear at K2.6 shapes, MLA attention (64 and 8 heads, contexts
 * 1K..64K, 1 and 64 query tokens; 256 queries causal and as a tree at 4K and 32K, with the
 * roofline of each row), the per-depth top-k of a DDTree build
 * (log_softmax + top-K over 163840, L = 7 rows, K = 256), and the DDTree round on the
 * device (cuda/ddtree.cu): the tree build (top-K + best-first selection) at B = 16, 64, 256,
 * L = 7, V = 163840, and accept over its 1 + B rows (greedy: argmax + walk; sampled with four
 * samplers, min-p among them: the keyed rule + walk), each with the one small result download
 * a round makes, and a commit's KV compaction over K2.6's 61 layers (move_rows beside the
 * per-layer gather and copy it replaced), as a markdown table (also into FILE with --md FILE).
 *
 *   cuda_ops_bench [--round] [--md FILE]     --round: the round's table alone (under a minute)
 *   cuda_ops_bench --linear                  the dense linear rows alone
 *   cuda_ops_bench --attention | --attention-at CTX T   the verify's attention rows (or one)
 *                  [--mla-row-groups N] [--mla-value-slices N]   force an MLA block shape
 *
 * Build: `make bench` (against build/libkdtree_internal.a: the backend's ops are not exported by
 * libkdtree.so), which runs it with --md build/bench/ddtree_round.md.
 * Method: each case runs 3 warm-up calls, then N timed calls between two stream syncs
 * (host monotonic clock: includes launch overheads, as a decode step pays them); the median
 * of 5 such batches is reported. Weights rotate over enough copies to exceed the 50 MB L2
 * where the weight is smaller than that. */
#include "backend.h"
#include "error.h"
#include "tree.h"
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kd_backend *be;

static void die(kd_status st, const char *what) {
    if (st != KD_OK) {
        fprintf(stderr, "%s: %s\n", what, kd_last_error());
        exit(1);
    }
}
#define CK(x) die((x), #x)

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* median seconds per call of fn(arg, i), each batch of n calls ended by wait() */
typedef kd_status (*bench_fn)(void *arg, int i);
static double time_with(bench_fn fn, void *arg, int n, kd_status (*wait)(void)) {
    for (int i = 0; i < 3; i++) CK(fn(arg, i));
    CK(wait());
    double t[5];
    for (int r = 0; r < 5; r++) {
        uint64_t t0 = kd_time_ns();
        for (int i = 0; i < n; i++) CK(fn(arg, i));
        CK(wait());
        t[r] = (double)(kd_time_ns() - t0) * 1e-9 / n;
    }
    qsort(t, 5, sizeof t[0], cmp_d);
    return t[2];
}
static kd_status backend_wait(void) { return be->ops->sync(be); }
/* the backend's ops, waited for on its stream */
static double time_it(bench_fn fn, void *arg, int n) { return time_with(fn, arg, n, backend_wait); }

/* the round's flat logits: h[0..n) uniform in [0, 16), from the LCG state *sd */
static void fill_flat(float *h, size_t n, uint32_t *sd) {
    for (size_t i = 0; i < n; i++) { *sd = *sd * 1664525u + 1013904223u; h[i] = (float)(*sd >> 8) / 1048576.0f; }
}

static void *dev_random_bf16(size_t n) {
    uint16_t *h = malloc(n * 2);
    uint32_t s = 12345;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        float f = ((float)(s >> 8) / 16777216.0f - 0.5f) * 0.1f;
        uint32_t u;
        memcpy(&u, &f, 4);
        h[i] = (uint16_t)(u >> 16);
    }
    void *d;
    CK(be->ops->alloc(be, n * 2, &d));
    CK(be->ops->upload(be, d, h, n * 2));
    free(h);
    return d;
}

/* ---- linear ---- */
typedef struct { kd_act x, out; kd_weight *w; int nw; cublasHandle_t blas; } lin_arg;
static kd_status lin_run(void *p, int i) {
    lin_arg *a = p;
    return be->ops->linear(be, a->x, &a->w[i % a->nw], a->out);
}

/* The same product by cuBLAS (GemmEx, bf16 in, fp32 compute, default algorithm), the rate the
 * issue holds the GEMM to. cuBLAS runs on the default stream, not the backend's, so its batches
 * wait for the whole device. Not batch-invariant: a reference rate, not a kernel. */
static kd_status cublas_run(void *p, int i) {
    const lin_arg *a = p;
    const float one = 1.0f, zero = 0.0f;
    const int M = a->x.rows, N = a->out.cols, K = a->x.cols;
    const cudaDataType ct = a->out.dtype == KD_F32 ? CUDA_R_32F : CUDA_R_16BF;
    if (cublasGemmEx(a->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, a->w[i % a->nw].dev, CUDA_R_16BF, K, a->x.data,
                     CUDA_R_16BF, K, &zero, a->out.data, ct, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
        return kd_fail(KD_ERR_BACKEND, "cublasGemmEx failed (M %d N %d K %d)", M, N, K);
    return KD_OK;
}
static kd_status device_wait(void) {
    cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? KD_OK : kd_fail(KD_ERR_BACKEND, "cuBLAS: %s", cudaGetErrorString(e));
}

/* only_M > 0: that row alone (for a profiler), else the rows of `all` */
static void bench_linear(const char *name, int N, int K, int only_M) {
    size_t wbytes = (size_t)N * K * 2;
    int nw = (int)((200u << 20) / wbytes) + 1;       /* > 200 MB of weights in rotation */
    if (nw > 16) nw = 16;
    uint16_t *src = malloc(wbytes);
    memset(src, 0, wbytes);
    for (size_t i = 0; i < (size_t)N * K; i += 97) src[i] = 0x3c00;
    kd_weight *w = calloc((size_t)nw, sizeof *w);
    for (int j = 0; j < nw; j++) {
        w[j] = (kd_weight){.name = name, .format = KD_W_BF16, .rows = N, .cols = K, .src = src};
        CK(be->ops->weight_load(be, &w[j]));
    }
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasCreate failed\n");
        exit(1);
    }
    const int all[] = {1, 8, 17, 64, 65, 256};   /* 17 and 65: verify at B = 16 and 64 */
    const int *Ms = only_M > 0 ? &only_M : all;
    const int nM = only_M > 0 ? 1 : (int)(sizeof all / sizeof all[0]);
    for (int mi = 0; mi < nM; mi++) {
        int M = Ms[mi];
        lin_arg a = {.w = w, .nw = nw, .blas = blas};
        a.x = (kd_act){dev_random_bf16((size_t)M * K), M, K, K, KD_BF16};
        int f32 = N > 100000;
        void *o;
        CK(be->ops->alloc(be, (size_t)M * N * (f32 ? 4 : 2), &o));
        a.out = (kd_act){o, M, N, N, f32 ? KD_F32 : KD_BF16};
        double s = time_it(lin_run, &a, 20);
        double gbs = (double)wbytes / s / 1e9, tf = 2.0 * M * N * (double)K / s / 1e12;
        double sc = time_with(cublas_run, &a, 20, device_wait);
        printf("linear %-14s N=%6d K=%5d M=%3d  %8.1f us  %7.1f GB/s (weights)  %6.1f TFLOP/s  cuBLAS %8.1f us: %3.0f%% of its rate\n",
               name, N, K, M, s * 1e6, gbs, tf, sc * 1e6, 100.0 * sc / s);
        be->ops->free(be, a.x.data);
        be->ops->free(be, o);
    }
    cublasDestroy(blas);
    for (int j = 0; j < nw; j++) be->ops->weight_free(be, &w[j]);
    free(w);
    free(src);
}

/* ---- attention ----
 * MLA at K2.6 dims (key 576, value = the first 512 cache columns, one latent KV head), ctx
 * cached rows of which the last T are the queries' own (causal), or a random T-node tree
 * after ctx - T committed rows (tree: the DDTree verify). Roofline per row: the cache read
 * once at the copy ceiling vs the score + value FLOPs at the bf16 tensor-core ceiling
 * (ATT_BW, ATT_TF: the H200 numbers measured in docs/performance.md). */
#define ATT_BW 4210e9
#define ATT_TF 783e12
typedef struct { kd_act q, kv, out; int H, past; const uint64_t *vis; } att_arg;
static kd_status att_run(void *p, int i) {
    att_arg *a = p;
    (void)i;
    return be->ops->attention(be, a->q, a->H, 576, a->kv, kd_act_cols(a->kv, 0, 512), 1, a->past, a->vis == NULL,
                              a->vis, 0, 0.1447f, a->out);
}

static void bench_attention(int H, int ctx, int T, int tree) {
    att_arg a = {.H = H, .past = ctx - T};
    a.q = (kd_act){dev_random_bf16((size_t)T * H * 576), T, H * 576, H * 576, KD_BF16};
    a.kv = (kd_act){dev_random_bf16((size_t)ctx * 576), ctx, 576, 576, KD_BF16};
    void *o, *vis = NULL;
    CK(be->ops->alloc(be, (size_t)T * H * 512 * 2, &o));
    a.out = (kd_act){o, T, H * 512, H * 512, KD_BF16};
    double keys = 0;   /* sum over queries of visible keys */
    if (tree) {
        int words = (T + 63) / 64;
        uint64_t *bits = calloc((size_t)T * words, 8);
        int *par = malloc((size_t)T * sizeof(int));
        uint32_t sd = 4242;
        for (int i = 0; i < T; i++) {
            sd = sd * 1664525u + 1013904223u;
            par[i] = i == 0 ? -1 : ((sd >> 8) % 10 < 6 ? i - 1 : (int)((sd >> 12) % (uint32_t)i));
            for (int j = i; j >= 0; j = par[j]) bits[(size_t)i * words + j / 64] |= 1ull << (j % 64);
            for (int j = 0; j < T; j++) keys += (bits[(size_t)i * words + j / 64] >> (j % 64)) & 1;
        }
        keys += (double)T * a.past;
        CK(be->ops->alloc(be, (size_t)T * words * 8, &vis));
        CK(be->ops->upload(be, vis, bits, (size_t)T * words * 8));
        free(bits);
        free(par);
        a.vis = vis;
    } else {
        for (int t = 0; t < T; t++) keys += a.past + t + 1;
    }
    double s = time_it(att_run, &a, T >= 256 ? 5 : 10);
    double bytes = (double)ctx * 576 * 2;
    double flops = 2.0 * H * keys * (576 + 512);
    double roof = bytes / ATT_BW > flops / ATT_TF ? bytes / ATT_BW : flops / ATT_TF;
    printf("attention MLA H=%2d ctx=%6d T=%3d %-6s %9.1f us  %7.1f GB/s (cache)  %6.2f TFLOP/s  roofline %7.1f us (%s) %5.1f%%\n",
           H, ctx, T, tree ? "tree" : "causal", s * 1e6, bytes / s / 1e9, flops / s / 1e12, roof * 1e6,
           bytes / ATT_BW > flops / ATT_TF ? "bytes" : "flops", 100.0 * roof / s);
    be->ops->free(be, a.q.data);
    be->ops->free(be, a.kv.data);
    be->ops->free(be, o);
    if (vis) be->ops->free(be, vis);
}

/* ---- tree build's top-K over the vocabulary ---- */
typedef struct { kd_act x; float *vals; int32_t *ids; int k; } topk_arg;
static kd_status topk_run(void *p, int i) {
    topk_arg *a = p;
    (void)i;
    KD_TRY(be->ops->log_softmax(be, a->x));
    return be->ops->topk(be, a->x, a->k, a->vals, a->ids);
}

/* ---- the DDTree round on the device ---- */
typedef struct { kd_act lp; kd_dtree d; int L, K, B; } tree_arg;
static kd_status tree_topk_run(void *p, int i) {
    tree_arg *a = p;
    (void)i;
    return be->ops->topk(be, a->lp, a->K, a->d.vals, a->d.ids);
}
static kd_status tree_build_run(void *p, int i) {
    tree_arg *a = p;
    KD_TRY(tree_topk_run(p, i));
    return be->ops->tree_select(be, &a->d, a->L, a->K, a->B);
}

typedef struct { kd_act logits; kd_dtree *d; int n; kd_sampler sp; int32_t *host; size_t words; } accept_arg;
static kd_status accept_run(void *p, int i) {
    accept_arg *a = p;
    (void)i;
    if (a->sp.temperature > 0) KD_TRY(be->ops->sample_rows(be, a->logits, &a->sp, a->d->pos, 1, a->d->target, a->d->row_status));
    else KD_TRY(be->ops->argmax(be, a->logits, a->d->target));
    KD_TRY(be->ops->tree_walk(be, a->d, a->n, a->sp.temperature > 0));
    return be->ops->download(be, a->host, a->d->result, a->words * sizeof(int32_t));
}

/* a commit's KV compaction: tau rows of the last 257 moved down to row START in each of n caches */
enum { COMPACT_START = 3000, COMPACT_CAP = 4096, COMPACT_COLS = 576 };
typedef struct compact_arg {
    kd_act *caches;
    int n, tau;
    int32_t *d_keep;
    void *tmp;
} compact_arg;
static kd_status compact_move_run(void *p, int i) {   /* the engine's: one move_rows */
    compact_arg *a = p;
    return be->ops->move_rows(be, a->caches, a->n, COMPACT_START, a->d_keep, a->tau, COMPACT_START);
}
static kd_status compact_layers_run(void *p, int i) {   /* before it: a gather and a copy back a layer */
    compact_arg *a = p;
    kd_act tmp = {a->tmp, a->tau, COMPACT_COLS, COMPACT_COLS, be->act_dtype};
    for (int l = 0; l < a->n; l++) {
        KD_TRY(be->ops->gather_rows(be, tmp, kd_act_rows(a->caches[l], COMPACT_START, 257), a->d_keep, a->tau));
        KD_TRY(be->ops->copy(be, kd_act_rows(a->caches[l], COMPACT_START, a->tau), tmp));
    }
    return KD_OK;
}

/* the round around verify at V = 163840, L = 7 (the K2.6 drafter's block 8): the tree build
 * (top-K, K = B, + best-first selection) at B = 16, 64, 256 on two kinds of draft log-probs, and
 * accept over the 1 + B rows of random flat logits (uniform in [0, 16): every mass is nonzero,
 * the worst case for the sampling rule's exact sums) per sampler; a markdown table on stdout and
 * in md_path. The draft log-probs: flat (the same uniform logits: the top B of each depth differ
 * by about 1e-4, so every node's child costs ~12 more than its next sibling and the tree is the
 * root's B children) and peaked (8 ids a depth at logits 30, 28, .., 16 above the uniform rest:
 * a draft's shape, a tree of several depths) */
static const struct { const char *name; kd_sampler sp; } samplers[] = {
    {"greedy (argmax)", {.temperature = 0.0f}},
    {"T 1", {.temperature = 1.0f, .seed = 7}},
    {"T 0.8, top-k 50, top-p 0.95", {.temperature = 0.8f, .top_k = 50, .top_p = 0.95f, .seed = 7}},
    {"T 1, top-p 0.9", {.temperature = 1.0f, .top_p = 0.9f, .seed = 7}},
    {"T 1, min-p 0.05", {.temperature = 1.0f, .seed = 7, .min_p = 0.05f}},
};
enum { NS = sizeof samplers / sizeof samplers[0] };

typedef struct { kd_act logits; const kd_sampler *sp; int32_t *pos, *out, *code; } sample_arg;
static kd_status sample_run(void *p, int i) {
    sample_arg *a = p;
    (void)i;
    return be->ops->sample_rows(be, a->logits, a->sp, a->pos, 1, a->out, a->code);
}

/* sample_rows alone over `rows` rows of the round's flat logits (uniform in [0, 16), V = 163840),
 * one line per sampled sampler (for a profiler: the accept's kernels without the tree's) */
static void bench_sample(int rows) {
    enum { V = 163840 };
    float *hx = malloc((size_t)rows * V * 4);
    int32_t *hp = malloc((size_t)rows * sizeof(int32_t));
    uint32_t sd = 4242;
    fill_flat(hx, (size_t)rows * V, &sd);
    for (int r = 0; r < rows; r++) hp[r] = 1000 + r;
    sample_arg a = {.logits = {NULL, rows, V, V, KD_F32}};
    CK(be->ops->alloc(be, (size_t)rows * V * 4, &a.logits.data));
    CK(be->ops->alloc(be, (size_t)rows * sizeof(int32_t), (void **)&a.pos));
    CK(be->ops->alloc(be, (size_t)rows * sizeof(int32_t), (void **)&a.out));
    CK(be->ops->alloc(be, (size_t)rows * sizeof(int32_t), (void **)&a.code));
    CK(be->ops->upload(be, a.logits.data, hx, (size_t)rows * V * 4));
    CK(be->ops->upload(be, a.pos, hp, (size_t)rows * sizeof(int32_t)));
    for (int k = 1; k < NS; k++) {
        a.sp = &samplers[k].sp;
        printf("sample_rows %s, %d rows of V = %d: %.1f us\n", samplers[k].name, rows, V, time_it(sample_run, &a, 10) * 1e6);
    }
    be->ops->free(be, a.logits.data);
    be->ops->free(be, a.pos);
    be->ops->free(be, a.out);
    be->ops->free(be, a.code);
    free(hx);
    free(hp);
}

/* the round's draft log-probs, L rows of V on the device (log_softmax of the logits below):
 * *flat from the uniform logits, *peaked the same with 8 ids a depth at logits 30, 28, .., 16 */
static void draft_logprobs(int L, int V, uint32_t *sd, kd_act *flat, kd_act *peaked) {
    float *hx = malloc((size_t)L * V * 4);
    *flat = (kd_act){NULL, L, V, V, KD_F32};
    *peaked = *flat;
    CK(be->ops->alloc(be, (size_t)L * V * 4, &flat->data));
    CK(be->ops->alloc(be, (size_t)L * V * 4, &peaked->data));
    fill_flat(hx, (size_t)L * V, sd);
    CK(be->ops->upload(be, flat->data, hx, (size_t)L * V * 4));
    for (int d = 0; d < L; d++)
        for (int k = 0; k < 8; k++) { *sd = *sd * 1664525u + 1013904223u; hx[(size_t)d * V + (*sd >> 8) % V] = 30.0f - 2 * k; }
    CK(be->ops->upload(be, peaked->data, hx, (size_t)L * V * 4));
    free(hx);
    CK(be->ops->log_softmax(be, *flat));
    CK(be->ops->log_softmax(be, *peaked));
}

/* the tree build alone at budget B (K = B, L = 7, V = 163840): top-K, then the whole build, on the
 * round's flat and peaked draft log-probs, one line each (for A/Bs and a profiler: ncu's
 * `-k regex:topk` then sees only the build's top-K passes) */
static void bench_tree(int B) {
    enum { L = 7, V = 163840 };
    uint32_t sd = 4242;
    tree_arg a = {.L = L, .K = B, .B = B};
    kd_act peaked;
    draft_logprobs(L, V, &sd, &a.lp, &peaked);
    void *buf;
    size_t bytes = kd_dtree_layout(&a.d, NULL, B, L * B);
    CK(be->ops->alloc(be, bytes, &buf));
    kd_dtree_layout(&a.d, buf, B, L * B);
    tree_arg ap = a;
    ap.lp = peaked;
    printf("tree B = %d, flat: top-K %.1f us, build %.1f us\n", B, time_it(tree_topk_run, &a, 20) * 1e6,
           time_it(tree_build_run, &a, 20) * 1e6);
    printf("tree B = %d, peaked: top-K %.1f us, build %.1f us\n", B, time_it(tree_topk_run, &ap, 20) * 1e6,
           time_it(tree_build_run, &ap, 20) * 1e6);
    be->ops->free(be, buf);
    be->ops->free(be, a.lp.data);
    be->ops->free(be, peaked.data);
}

static void bench_round(const char *md_path) {
    enum { L = 7, V = 163840, NB = 3 };
    static const int budgets[NB] = {16, 64, 256};
    double build_us[NB], peaked_us[NB], topk_us[NB], accept_us[NB][NS];
    int rows[NB], path[NB][2], peaked_depth[NB];
    uint32_t sd = 4242;
    kd_act lp, lpp;   /* draft log-probs */
    draft_logprobs(L, V, &sd, &lp, &lpp);
    float *hx = malloc((size_t)(256 + 1) * V * 4);
    void *lg;
    CK(be->ops->alloc(be, (size_t)(256 + 1) * V * 4, &lg));
    fill_flat(hx, (size_t)(256 + 1) * V, &sd);
    CK(be->ops->upload(be, lg, hx, (size_t)(256 + 1) * V * 4));
    free(hx);
    for (int b = 0; b < NB; b++) {
        int B = budgets[b];
        tree_arg a = {.lp = lp, .L = L, .K = B, .B = B};
        void *buf;
        size_t bytes = kd_dtree_layout(&a.d, NULL, B, L * B);
        CK(be->ops->alloc(be, bytes, &buf));
        kd_dtree_layout(&a.d, buf, B, L * B);
        topk_us[b] = time_it(tree_topk_run, &a, 20) * 1e6;
        tree_arg ap = a;
        ap.lp = lpp;
        peaked_us[b] = time_it(tree_build_run, &ap, 20) * 1e6;
        int32_t st[4], dep[257];
        CK(be->ops->download(be, st, a.d.status, sizeof st));
        CK(be->ops->download(be, dep, a.d.depth, (size_t)(st[2] + 1) * sizeof(int32_t)));
        path[b][1] = st[3];
        peaked_depth[b] = 0;
        for (int i = 1; i <= st[2]; i++) if (dep[i] > peaked_depth[b]) peaked_depth[b] = dep[i];
        build_us[b] = time_it(tree_build_run, &a, 20) * 1e6;   /* last: its tree stays for the accepts */
        CK(be->ops->download(be, st, a.d.status, sizeof st));
        path[b][0] = st[3];
        int n = st[2];
        rows[b] = n + 1;
        CK(be->ops->tree_stage(be, &a.d, n, 1, 1000, NULL, NULL, NULL));
        accept_arg ac = {.logits = (kd_act){lg, n + 1, V, V, KD_F32}, .d = &a.d, .n = n};
        ac.words = KD_DTREE_HDR + (size_t)(B + 1) + (size_t)L + 1;
        ac.host = malloc(ac.words * sizeof(int32_t));
        for (int k = 0; k < NS; k++) {
            ac.sp = samplers[k].sp;
            accept_us[b][k] = time_it(accept_run, &ac, 10) * 1e6;
        }
        free(ac.host);
        be->ops->free(be, buf);
    }
    be->ops->free(be, lg);
    be->ops->free(be, lp.data);
    be->ops->free(be, lpp.data);

    /* commit's KV compaction in K2.6's 61 layers (latent 512 + rope 64 a row), tau = 4, 8, 16 */
    enum { NLAYER = 61, NT = 3 };
    static const int taus[NT] = {4, 8, 16};
    double move_us[NT], layers_us[NT];
    kd_act caches[NLAYER];
    const size_t es = kd_dtype_size(be->act_dtype);
    for (int l = 0; l < NLAYER; l++) {
        caches[l] = (kd_act){NULL, COMPACT_CAP, COMPACT_COLS, COMPACT_COLS, be->act_dtype};
        CK(be->ops->alloc(be, (size_t)COMPACT_CAP * COMPACT_COLS * es, &caches[l].data));
    }
    int32_t keep[16];
    for (int i = 0; i < 16; i++) keep[i] = 2 * i;   /* every other row of the tree's: a path */
    compact_arg ca = {.caches = caches, .n = NLAYER};
    CK(be->ops->alloc(be, sizeof keep, (void **)&ca.d_keep));
    CK(be->ops->upload(be, ca.d_keep, keep, sizeof keep));
    CK(be->ops->alloc(be, (size_t)16 * COMPACT_COLS * es, &ca.tmp));
    for (int t = 0; t < NT; t++) {
        ca.tau = taus[t];
        move_us[t] = time_it(compact_move_run, &ca, 20) * 1e6;
        layers_us[t] = time_it(compact_layers_run, &ca, 5) * 1e6;
    }
    for (int l = 0; l < NLAYER; l++) be->ops->free(be, caches[l].data);
    be->ops->free(be, ca.d_keep);
    be->ops->free(be, ca.tmp);

    char line[4096];
    FILE *md = md_path ? fopen(md_path, "w") : NULL;
    if (md_path && !md) fprintf(stderr, "cannot write %s\n", md_path);
#define OUT(...) do { snprintf(line, sizeof line, __VA_ARGS__); fputs(line, stdout); if (md) fputs(line, md); } while (0)
    OUT("\n## The DDTree round around verify (V = %d, L = %d; us per call, median of 5 batches)\n\n", V, L);
    OUT("| step | B = %d (%d rows) | B = %d (%d rows) | B = %d (%d rows) |\n|---|---|---|---|\n", budgets[0], rows[0],
        budgets[1], rows[1], budgets[2], rows[2]);
    OUT("| tree build (top-K + select), flat lists (the root's B children) | %.1f | %.1f | %.1f |\n", build_us[0],
        build_us[1], build_us[2]);
    OUT("| tree build, peaked lists (depth %d / %d / %d) | %.1f | %.1f | %.1f |\n", peaked_depth[0], peaked_depth[1],
        peaked_depth[2], peaked_us[0], peaked_us[1], peaked_us[2]);
    OUT("| selection path, flat / peaked (1: parallel, 0: one node at a time) | %d / %d | %d / %d | %d / %d |\n",
        path[0][0], path[0][1], path[1][0], path[1][1], path[2][0], path[2][1]);
    OUT("| of which top-K alone (K = B) | %.1f | %.1f | %.1f |\n", topk_us[0], topk_us[1], topk_us[2]);
    for (int k = 0; k < NS; k++)
        OUT("| accept: %s (+ walk + result) | %.1f | %.1f | %.1f |\n", samplers[k].name, accept_us[0][k],
            accept_us[1][k], accept_us[2][k]);
    OUT("\nCommit's KV compaction, %d layers of %d x %d %s (us per call, median of 5 batches):\n\n", NLAYER,
        COMPACT_CAP, COMPACT_COLS, kd_dtype_name(be->act_dtype));
    OUT("| rows moved (tau) | %d | %d | %d |\n|---|---|---|---|\n", taus[0], taus[1], taus[2]);
    OUT("| move_rows, every layer in one op | %.1f | %.1f | %.1f |\n", move_us[0], move_us[1], move_us[2]);
    OUT("| gather_rows + copy a layer (%d ops) | %.1f | %.1f | %.1f |\n", 2 * NLAYER, layers_us[0], layers_us[1],
        layers_us[2]);
#undef OUT
    if (md) fclose(md);
}

int main(int argc, char **argv) {
    const char *md_path = NULL;
    int round_only = 0, attention_only = 0, linear_only = 0, rg = 0, vs = 0, one_ctx = 0, one_T = 0;
    int one_N = 0, one_K = 0, one_M = 0, sample_rows_n = 0, tree_B = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--md") && i + 1 < argc) md_path = argv[++i];
        else if (!strcmp(argv[i], "--round")) round_only = 1;
        else if (!strcmp(argv[i], "--attention")) attention_only = 1;
        else if (!strcmp(argv[i], "--linear")) linear_only = 1;
        else if (!strcmp(argv[i], "--attention-at") && i + 2 < argc) {   /* one row (for a profiler) */
            attention_only = 1;
            one_ctx = atoi(argv[++i]);
            one_T = atoi(argv[++i]);
        }
        else if (!strcmp(argv[i], "--linear-at") && i + 3 < argc) {   /* one row (for a profiler) */
            one_N = atoi(argv[++i]);
            one_K = atoi(argv[++i]);
            one_M = atoi(argv[++i]);
        }
        else if (!strcmp(argv[i], "--sample-at") && i + 1 < argc) sample_rows_n = atoi(argv[++i]);   /* for a profiler */
        else if (!strcmp(argv[i], "--tree-at") && i + 1 < argc) tree_B = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mla-row-groups") && i + 1 < argc) rg = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mla-value-slices") && i + 1 < argc) vs = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: cuda_ops_bench [--round | --linear | --linear-at N K M | --attention | --attention-at CTX T | --sample-at ROWS | --tree-at B] [--md FILE] [--mla-row-groups N] "
                            "[--mla-value-slices N]\n");
            return 2;
        }
    }
    /* KDTREE_MLA_TC=0: the attention rows on the CUDA-core kernel (a bench maps the old variable to
     * the option; the library reads no environment) */
    const char *tc = getenv("KDTREE_MLA_TC");
    const kd_model_options opt = { .mla_kernel = tc && !strcmp(tc, "0") ? KD_MLA_CUDA_CORES : KD_MLA_DEFAULT,
                                   .mla_row_groups = rg, .mla_value_slices = vs };
    CK(kd_backend_cuda_create(0, &opt, &be));
    if (sample_rows_n > 0) {
        bench_sample(sample_rows_n);
        be->ops->destroy(be);
        return 0;
    }
    if (tree_B > 0) {
        bench_tree(tree_B);
        be->ops->destroy(be);
        return 0;
    }
    if (round_only) {
        bench_round(md_path);
        be->ops->destroy(be);
        return 0;
    }
    if (attention_only) {   /* the step's attention: MLA, 64 heads (one GPU) and 8 (a TP-8 rank); decode, verify trees */
        printf("# attention rows (--mla-row-groups %d --mla-value-slices %d)\n", rg, vs);
        if (one_ctx > 0 && one_T > 0) {
            bench_attention(64, one_ctx, one_T, one_T > 1);
            be->ops->destroy(be);
            return 0;
        }
        static const int actx[] = {1024, 8192, 32768}, aT[] = {1, 17, 65, 257};
        for (int c = 0; c < 3; c++)
            for (int t = 0; t < 4; t++) bench_attention(64, actx[c], aT[t], aT[t] > 1);
        for (int c = 0; c < 3; c++)
            for (int t = 0; t < 3; t++) bench_attention(8, actx[c], aT[t], aT[t] > 1);
        be->ops->destroy(be);
        return 0;
    }
    if (one_N > 0 && one_K > 0 && one_M > 0) {
        bench_linear("linear", one_N, one_K, one_M);
        be->ops->destroy(be);
        return 0;
    }
    printf("# kdtree CUDA ops bench (median of 5 batches; host clock between syncs)\n");
    bench_linear("q_a", 1536, 7168, 0);
    bench_linear("kv_a", 576, 7168, 0);
    bench_linear("q_b", 12288, 1536, 0);
    bench_linear("o_proj", 7168, 8192, 0);
    bench_linear("shared_up", 2048, 7168, 0);
    bench_linear("shared_down", 7168, 2048, 0);
    bench_linear("dense_up", 18432, 7168, 0);
    bench_linear("lm_head", 163840, 7168, 0);
    if (linear_only) {
        be->ops->destroy(be);
        return 0;
    }
    int ctxs[] = {1024, 4096, 16384, 65536};
    int Hs[] = {64, 8}, Ts[] = {1, 64};
    printf("# attention path: %s\n", opt.mla_kernel == KD_MLA_CUDA_CORES ? "CUDA cores (KDTREE_MLA_TC=0)"
                                                                         : "tensor cores (mla_tc.cuh)");
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 2; t++)
            for (int c = 0; c < 4; c++) bench_attention(Hs[h], ctxs[c], Ts[t], 0);
    /* the DDTree verify: 256 queries, causal and as a tree, at 4K and 32K */
    bench_attention(64, 4096, 256, 0);
    bench_attention(64, 4096, 256, 1);
    bench_attention(64, 32768, 256, 0);
    bench_attention(64, 32768, 256, 1);
    bench_attention(64, 32768, 64, 1);
    {
        int L = 7, V = 163840, k = 256;
        topk_arg a = {.k = k};
        float *x;
        CK(be->ops->alloc(be, (size_t)L * V * 4, (void **)&x));
        float *hx = malloc((size_t)L * V * 4);
        uint32_t sd = 777;
        fill_flat(hx, (size_t)L * V, &sd);
        CK(be->ops->upload(be, x, hx, (size_t)L * V * 4));
        free(hx);
        a.x = (kd_act){x, L, V, V, KD_F32};
        CK(be->ops->alloc(be, (size_t)L * k * 4, (void **)&a.vals));
        CK(be->ops->alloc(be, (size_t)L * k * 4, (void **)&a.ids));
        double s = time_it(topk_run, &a, 20);
        printf("tree build top-K: log_softmax + topk L=%d V=%d K=%d  %8.1f us\n", L, V, k, s * 1e6);
    }
    bench_round(md_path);
    be->ops->destroy(be);
    return 0;
}
