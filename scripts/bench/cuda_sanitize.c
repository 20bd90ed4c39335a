/* cuda_sanitize.c: a plain C driver for compute-sanitizer (memcheck, racecheck) over the CUDA
 * backend: every op once at small and odd shapes through the op test surface, the tree build at
 * two budgets (256 and the largest, 4096), then the tiny
 * K2.6 model through the public API (prefill, decode, a verified tree, accept, commit, a draft
 * and a drafted tree). Prints "sanitize: ok" when every call succeeded.
 * Build: cc -O1 -std=c11 -D_GNU_SOURCE -Icore -Ispec/c scripts/bench/cuda_sanitize.c -Lbuild -lkdtree_test \
 *          -Wl,-rpath,$PWD/build -lm -o build/cuda_sanitize
 * Run:   compute-sanitizer --tool memcheck build/cuda_sanitize  (and --tool racecheck) */
#include "kdtree.h"
#include "kdtree_testing.h"
#include "kdtree_testing_ddtree.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fails;
static kd_backend_kind kind = KD_BACKEND_CUDA;   /* KDTREE_SANITIZE_BACKEND=cpu: check the driver itself */
static void ck(kd_status st, const char *what) {
    if (st != KD_OK) {
        fprintf(stderr, "FAIL %s: %s\n", what, kd_last_error());
        fails++;
    }
}
static uint32_t rs = 1;
static float rnd(void) {
    rs = rs * 1664525u + 1013904223u;
    return ((float)(rs >> 8) / 16777216.0f - 0.5f) * 2.0f;
}
static float *rfloats(size_t n) {
    float *a = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) a[i] = rnd();
    kd_test_round_bf16(a, n);
    return a;
}
static kd_test_weight bf16w(int rows, int cols) {
    float *f = rfloats((size_t)rows * cols);
    uint16_t *b = malloc((size_t)rows * cols * 2);
    kd_test_to_bf16(f, b, (size_t)rows * cols);
    free(f);
    return (kd_test_weight){0, rows, cols, 0, b, NULL};
}
static kd_test_weight int4w(int rows, int cols, int group) {
    uint32_t *w = malloc((size_t)rows * cols / 2);
    for (size_t i = 0; i < (size_t)rows * cols / 8; i++) { rs = rs * 1664525u + 1013904223u; w[i] = rs; }
    float *sf = malloc((size_t)rows * cols / group * 4);
    for (size_t i = 0; i < (size_t)rows * cols / group; i++) sf[i] = 0.01f + 0.01f * fabsf(rnd());
    uint16_t *sb = malloc((size_t)rows * cols / group * 2);
    kd_test_to_bf16(sf, sb, (size_t)rows * cols / group);
    free(sf);
    return (kd_test_weight){2, rows, cols, group, w, sb};
}

static void ops(void) {
    kd_test_backend *tb;
    ck(kd_test_backend_new(kind, 0, NULL, &tb), "backend");
    if (!tb) return;
    float *out = malloc(sizeof(float) * 1 << 22);
    float *x = rfloats(1 << 20), *y = rfloats(1 << 20);
    ck(kd_test_copy(tb, x, 3, 101, 2, out), "copy");
    kd_test_weight tab = bf16w(100, 72);
    int32_t ids[5] = {0, 99, 3, 3, 50};
    ck(kd_test_embed(tb, &tab, ids, 5, out), "embed");
    ck(kd_test_add(tb, x, y, 3, 129, 0.5f, 1, out), "scale_add");
    ck(kd_test_swiglu(tb, x, y, 3, 129, out), "swiglu");
    kd_test_weight nw = bf16w(100, 1);
    ck(kd_test_rmsnorm(tb, x, 7, 100, &nw, 1e-6f, out), "rmsnorm");
    {   /* the norms' other shapes: 256 threads x 8 and x 32 columns, and a row in pieces */
        float *xo = malloc(sizeof(float) * 2 * 9000);
        int widths[3] = {1536, 7168, 9000};
        for (int i = 0; i < 3; i++) {
            kd_test_weight ww = bf16w(widths[i], 1);
            ck(kd_test_rmsnorm(tb, x, 2, widths[i], &ww, 1e-6f, out), "rmsnorm 256 threads");
            ck(kd_test_add_rmsnorm(tb, x, y, 2, widths[i], &ww, 1e-6f, xo, out), "add_rmsnorm 256 threads");
            free((void *)ww.data);
        }
        free(xo);
    }
    int32_t pos[4] = {0, 5, 4000, 262000};
    float inv[32];
    for (int i = 0; i < 32; i++) inv[i] = powf(50000.0f, -2.0f * i / 64);
    ck(kd_test_rope(tb, x, 4, 4 * 24, 4, 24, 16, pos, 8, 1, 1.0f, inv, out), "rope interleaved");
    ck(kd_test_rope(tb, x, 4, 4 * 32, 4, 32, 0, pos, 32, 0, 1.0f, inv, out), "rope rotate-half");
    {   /* tiny MLA: 4 heads [16 | 8] into [32 | 8], latent 32 + 8, rows 3.. of 12 (host and device length) */
        kd_test_weight kn = bf16w(32, 1);
        float *qf = calloc(4 * 4 * 40, sizeof(float)), *cache = calloc(12 * 40, sizeof(float));
        ck(kd_test_mla_rope_store(tb, x, 4, 4 * 24, 4, qf, 4 * 40, y, 40, &kn, 1e-6f, pos, 8, 1, 1.0f, inv, cache, 12, 3,
                                  -1), "mla_rope_store");
        ck(kd_test_mla_rope_store(tb, x, 4, 4 * 24, 4, qf, 4 * 40, y, 40, &kn, 1e-6f, pos, 8, 1, 1.0f, inv, cache, 12, 1,
                                  7), "mla_rope_store at a device length");
        free(qf);
        free(cache);
    }
    int32_t keep[4] = {2, 5, 6, 9};
    ck(kd_test_gather_rows(tb, x, 12, 40, keep, 4, 1, 2, out), "gather in place");
    ck(kd_test_gather_rows(tb, x, 12, 40, keep, 4, 0, 0, out), "gather");
    ck(kd_test_move_rows(tb, x, 70, 12, 576, 1, keep, 4, 1, out), "move_rows (two launches)");
    ck(kd_test_move_rows(tb, x, 3, 12, 37, 0, keep, 4, 0, out), "move_rows, byte path");
    kd_test_weight lw = bf16w(33, 40), lw2 = bf16w(200, 512), l4 = int4w(64, 256, 32);
    ck(kd_test_linear(tb, x, 5, &lw, 1, out), "linear odd");
    ck(kd_test_linear(tb, x, 70, &lw2, 0, out), "linear");
    ck(kd_test_linear(tb, x, 9, &l4, 0, out), "linear int4");
    ck(kd_test_linear_pair(tb, x, 5, &lw, &lw, 1, out), "linear_pair odd");
    ck(kd_test_linear_pair(tb, x, 70, &lw2, &lw2, 0, out), "linear_pair");
    kd_test_weight kvb = bf16w(4 * 32, 32);
    ck(kd_test_head_matmul(tb, x, 3, 4 * 24, 4, 24, 16, &kvb, 32, 0, 0, 32, 32, 4 * 32, out), "head_matmul");
    ck(kd_test_head_matmul(tb, x, 3, 4 * 32, 4, 32, 32, &kvb, 32, 16, 1, 16, 16, 4 * 16, out), "head_matmul T");
    uint64_t vis[9];
    int par[9] = {-1, 0, 0, 1, 1, 2, 3, 6, 0};
    for (int i = 0; i < 9; i++) {
        vis[i] = 1ull << i;
        for (int p = par[i]; p >= 0; p = par[p]) vis[i] |= 1ull << p;
    }
    ck(kd_test_attention(tb, x, 9, 2 * 576, 2, 576, y, 309, 576, NULL, 512, 1, 1, 300, 0, vis, 0, 0.14f, 2 * 512, out),
       "attention tree");
    ck(kd_test_attention(tb, x, 5, 4 * 40, 4, 40, y, 600, 40, NULL, 32, 1, 1, 595, 1, NULL, 0, 0.2f, 4 * 32, out),
       "attention causal 3 chunks");
    ck(kd_test_attention(tb, x, 6, 4 * 32, 4, 32, y, 16, 64, x, 64, 0, 2, 10, 1, NULL, 5, 0.2f, 4 * 32, out),
       "attention gqa window");
    ck(kd_test_attention(tb, x, 5, 3 * 36, 3, 36, y, 12, 36, x, 36, 0, 1, 7, 1, NULL, 0, 0.2f, 3 * 36, out),
       "attention unaligned");
    {   /* 64-row blocks forced: the wide tensor-core kernel (mla_tc_wide.cuh), shared and tail chunks */
        const kd_model_options wide = {.mla_row_groups = 4};
        kd_test_backend *tw;
        ck(kd_test_backend_new(kind, 0, &wide, &tw), "backend (mla_row_groups 4)");
        if (tw) {
            ck(kd_test_attention(tw, x, 9, 2 * 576, 2, 576, y, 609, 576, NULL, 512, 1, 1, 600, 0, vis, 0, 0.14f, 2 * 512,
                                 out), "attention tree, 64-row blocks");
            ck(kd_test_attention(tw, x, 5, 4 * 576, 4, 576, y, 1100, 576, NULL, 512, 1, 1, 1095, 1, NULL, 0, 0.14f,
                                 4 * 512, out), "attention causal 3 chunks, 64-row blocks");
            kd_test_backend_free(tw);
        }
    }
    enum { NE = 16, H = 128, I = 64 };
    kd_test_weight router = bf16w(NE, H), g[NE], u[NE], d[NE], g4[NE], u4[NE], d4[NE];
    float bias[NE];
    for (int i = 0; i < NE; i++) {
        bias[i] = 0.01f * rnd();
        g[i] = bf16w(I, H); u[i] = bf16w(I, H); d[i] = bf16w(H, I);
        g4[i] = int4w(I, H, 32); u4[i] = int4w(I, H, 32); d4[i] = int4w(H, I, 32);
    }
    ck(kd_test_moe(tb, x, 9, H, NE, 4, 4, 2, 1, 2.5f, &router, bias, g, u, d, y, out), "moe bf16 + shared");
    ck(kd_test_moe(tb, x, 40, H, NE, 4, 1, 1, 1, 2.5f, &router, bias, g4, u4, d4, y, out), "moe int4 + shared");
    kd_test_weight gm[NE], um[NE], dm[NE];
    for (int i = 0; i < NE; i++) { gm[i] = i % 2 ? g[i] : g4[i]; um[i] = i % 2 ? u[i] : u4[i]; dm[i] = i % 2 ? d[i] : d4[i]; }
    ck(kd_test_moe(tb, x, 7, H, NE, 4, 1, 1, 1, 2.5f, &router, bias, gm, um, dm, NULL, out), "moe mixed");
    ck(kd_test_log_softmax(tb, x, 3, 163840 / 4, out), "log_softmax");
    int32_t am[3];
    ck(kd_test_argmax(tb, x, 3, 1000, am), "argmax");
    int32_t ti[3 * 300];
    ck(kd_test_topk(tb, x, 3, 40000, 300, out, ti), "topk");
    /* flat rows (seven distinct values) at K2.6's vocabulary: the top bins hold far more than k
     * keys, so the row-wide second histogram narrows the cut (its several blocks per row) */
    float *flat = malloc(sizeof(float) * 2 * 163840);
    for (int i = 0; i < 2 * 163840; i++) flat[i] = 0.001f * (float)(i % 7);
    int32_t tf[2 * 256];
    ck(kd_test_topk(tb, flat, 2, 163840, 256, out, tf), "topk flat");
    free(flat);
    kd_test_backend_free(tb);
    free(x); free(y); free(out);
}

/* the tree build (top-K + tree_select) at budget 256 on flat lists (the root's 256 children) and on
 * falling ones (a tree of every depth), and at 4096, tree_select's largest (a frontier of 180 KB
 * of shared memory); the selection path of each (status word 3) is printed */
static void tree_builds(void) {
    kd_test_dd *h = NULL;
    ck(kd_test_dd_new(kind, 0, &h), "dd backend");
    if (!h) return;
    enum { L = 7, V = 5000, BMAX = 4096 };
    float *lp = malloc(sizeof(float) * L * V);
    for (int i = 0; i < L * V; i++) lp[i] = -4.0f - 2.0f * fabsf(rnd());
    int32_t *tok = malloc(4 * (BMAX + 1)), *par = malloc(4 * (BMAX + 1)), *dep = malloc(4 * (BMAX + 1)), st[4];
    uint64_t *vis = malloc(sizeof(uint64_t) * (BMAX + 1) * ((BMAX + 1 + 63) / 64));
    int n = 0;
    ck(kd_test_dd_tree(h, lp, L, V, 256, &n, tok, par, dep, vis, st), "tree build 256");
    printf("tree build 256, flat lists: %d nodes, path %d\n", n, st[3]);
    ck(kd_test_dd_tree(h, lp, L, V, BMAX, &n, tok, par, dep, vis, st), "tree build 4096");
    printf("tree build 4096: %d nodes, path %d\n", n, st[3]);
    for (int i = 0; i < L * V; i++) lp[i] = -0.3f * (float)(i % V) - 0.01f * fabsf(rnd());
    ck(kd_test_dd_tree(h, lp, L, V, 256, &n, tok, par, dep, vis, st), "tree build 256 (falling lists)");
    int depth = 0;
    for (int i = 1; i <= n; i++) depth = dep[i] > depth ? dep[i] : depth;
    printf("tree build 256, falling lists: %d nodes to depth %d, path %d\n", n, depth, st[3]);
    free(lp); free(tok); free(par); free(dep); free(vis);
    kd_test_dd_free(h);
}

static void model(void) {
    kd_model_options opt = {kind, 0, 1};
    kd_model *m = NULL;
    ck(kd_model_open("models/tiny-k2.6", &opt, &m), "model open");
    if (!m) return;
    kd_drafter *d = NULL;
    ck(kd_drafter_open("models/tiny-k2.6-dflash", m, &d), "drafter open");
    kd_seq *s = NULL;
    ck(kd_seq_new(m, 128, &s), "seq");
    if (!s) return;
    if (d) ck(kd_seq_attach_drafter(s, d), "attach");
    int32_t prompt[12] = {168, 517, 402, 424, 597, 575, 728, 217, 441, 171, 799, 786}, am[64];
    ck(kd_forward(s, prompt, 12, NULL, NULL), "prefill");
    ck(kd_seq_argmax(s, am), "argmax");
    int32_t tok = am[11];
    for (int i = 0; i < 3; i++) {
        ck(kd_forward(s, &tok, 1, NULL, NULL), "decode");
        ck(kd_seq_argmax(s, am), "argmax");
        tok = am[0];
    }
    kd_tree *t = NULL;
    ck(kd_tree_new(&t), "tree");
    if (d) {
        ck(kd_draft(s, tok, NULL), "draft");
        ck(kd_tree_build_drafted(t, s, 16), "build drafted");
    } else {
        float *lg = rfloats(4 * 1024);
        ck(kd_tree_build(t, lg, 4, 1024, 16, 0), "build");
        free(lg);
    }
    ck(kd_tree_set_root(t, tok), "root");
    ck(kd_verify(s, t), "verify");
    int32_t nodes[64], toks[64], bonus;
    int n = 0;
    ck(kd_accept(s, t, NULL, nodes, toks, &n, &bonus), "accept");
    ck(kd_commit(s, t), "commit");
    float cache[4 * 40];
    ck(kd_seq_read_cache(s, 1, 0, 4, cache), "read cache");
    kd_tree_free(t);
    kd_seq_free(s);
    if (d) kd_drafter_close(d);
    kd_model_close(m);
}

int main(void) {
    const char *k = getenv("KDTREE_SANITIZE_BACKEND");
    if (k && !strcmp(k, "cpu")) kind = KD_BACKEND_CPU;
    ops();
    tree_builds();
    model();
    printf("sanitize: %s (%d failed calls)\n", fails ? "FAILED" : "ok", fails);
    return fails ? 1 : 0;
}
