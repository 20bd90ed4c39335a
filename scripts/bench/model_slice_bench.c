/* model_slice_bench.c: the decode step of a Kimi K2.6-dims model slice against its
 * weight-bytes roofline, and the MLA attention rows, in one run (issue 4's speed bar).
 *
 *   model_slice_bench [--backend cuda|cpu] [--tiny] [--md FILE] [--quick] [--steps N]
 *                     [--row-seconds S] [--no-mla] [--no-graphs] [--no-draft] [--tolerance X]
 *                     [--shared-branch rows|on|off]
 *   model_slice_bench --k26-rank N [--layers L] [--md FILE] [--quick] [--steps N] [--shared-branch rows|on|off] [--ncu]
 *
 * The slice: the K2.6 text model's dims (hidden 7168, 64 heads, q_lora 1536, kv_lora 512,
 * rope 64, nope 128, v 128, dense intermediate 18432, 384 routed experts top-8 INT4 group 32,
 * expert width 2048, 1 shared expert, vocab 163840, YaRN as K2.6) with 4 layers: 1 dense + 3
 * MoE. No checkpoint: the config goes through the real parser (kd_config_load on a config.json
 * written to a temporary directory), then every weight is made on the host from a seeded RNG,
 * handed to the backend's own weight_load (the backend's form, e.g. the W4A16 repack) and the
 * host copy freed at once (the CPU backend keeps it: its form is the host bytes). INT4 codes
 * and scales come from small random pools at random offsets (what an expert holds does not
 * change its timing; every expert still gets its own device copy). --tiny uses the shipped
 * tiny model's dims instead (for the CPU spec and a quick GPU spec).
 *
 * The cache is filled with random latent rows written directly (no 32K prefill); a step is
 * one kd_forward: decode T = 1 at each context, and tree verification T = 1 + B (B = 16,
 * 64, 256; a random tree of depth <= 7 with its ancestor-only mask, positions ctx + depth).
 * Before each step the sequence is put back at the context length (bench-only: s->len is set
 * directly), so every timed step sees the same context.
 *
 * Per row: (1) one counting step: the backend's moe op is wrapped so that the router logits
 * of its input are computed (the backend's own linear) and routed on the host (sigmoid,
 * bias for selection, group-limited top-k) to count the distinct experts the step reads;
 * (2) one profiled step: every backend op between two CUDA events (host clock + sync on the
 * CPU), summed by kind; (3) 2 warm-up steps, then N timed steps (N from --row-seconds,
 * 5..30, or --steps), each between two CUDA events on the backend's stream, the median
 * reported with the host wall time of the same steps; (4) when the library has step graphs
 * (model.c, the graphs option), the same steps on a second sequence opened in graph mode
 * (the measured one has graphs off: the wrapped ops must run from the host), counting the
 * steps that replayed a captured graph (they call no backend op).
 * Roofline: bytes the step must read (every attention, norm, dense, shared, router and
 * lm_head weight once; the distinct routed experts counted in (1) x their INT4 codes and
 * scales; T embedding rows; the latent KV of ctx + T rows in every layer) over the device
 * copy bandwidth measured in the same run (cudaMemcpy D2D, bytes read + written, as
 * docs/performance.md's ceilings).
 *
 * Draft rows (slice_draft.c, --no-draft skips them): the DFlash draft pass of a random drafter at
 * the K2.6 drafter's dims, loaded from a checkpoint the run writes, against its roofline, and one
 * pass profiled op by op as (2) below.
 *
 * MLA rows: the backend's attention op alone (absorbed: key 576, value 512, one latent KV
 * head), 64 and 8 heads, contexts 1K..64K, 1 and 64 queries (causal), events around each
 * call, median; GB/s = latent KV bytes read once (ctx x 576 x 2) over the time, and that over
 * the copy ceiling.
 *
 * Checks in the same run (exit 1 when one fails, after the tables are written):
 * 10 decode steps (4 at K2.6 dims) feeding back the argmax: every logit finite; a tree of 16
 * nodes verified, then the root, the deepest node and another node's path prefilled causally
 * after the same context: the path's last row must equal the node's row (bit for bit unless
 * --tolerance: the batch invariance the engine promises, here at the bench's dims).
 *
 * --k26-rank N (the TP-N projection, issue 14): all 61 layers (--layers L) at the dims of rank 0 of
 * TP-N (heads, dense / shared / routed widths and the lm_head's vocab / N; q_a, kv_a, norms, router
 * and embedding whole): the per-rank compute of TP-N without its all-reduces. kd_plan_tp plans the
 * rank first (the run stops before building when it does not fit), each built layer's device use is
 * checked against what is left, and the built weights must equal the plan's. Then the checks below,
 * the memory table, decode and verify B = 16, 64 at ctx 1K and 8K on one step-graph sequence, the
 * all-reduce of [T, hidden] bf16 for T = 1, 17, 65 through NCCL on one rank (slice_cuda.cu), and the
 * table of projected rates 1 / (rank step + 2 x layers x all-reduce), labelled as a projection;
 * then (unless --no-draft) the draft rows at a rank's share of the drafter (its heads, KV heads and
 * MLP width over N, the rank model's lm_head rows: what each rank's draft pass computes at TP-N,
 * less its all-reduces and the logits' all-gather). --tiny runs the same at the tiny dims (the CPU
 * spec).
 *
 * Build: `make bench` (with scripts/bench/slice_cuda.cu: CUDA events and ceilings), or
 * plain C against the engine's objects (host clock between syncs; it reaches inside the engine,
 * and libkdtree.so exports only kdtree.h), as spec/model_slice_bench_spec.lua does:
 *   cc -O2 -std=c11 -D_GNU_SOURCE -Icore scripts/bench/model_slice_bench.c build/libkdtree_internal.a \
 *      $(cat build/engine.flags) -lm -o model_slice_bench */
#include "forward.h"
#include "plan.h"
#include "error.h"
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef KD_SLICE_EVENTS
#include "slice_cuda.h"
#endif

/* ------------------------------------------------------------------ failure */
static void die_st(const char *what, int line) {
    fprintf(stderr, "FATAL model_slice_bench.c:%d: %s: %s\n", line, what, kd_last_error());
    fflush(stdout);
    exit(2);
}
#define CK(x) do { if ((x) != KD_OK) die_st(#x, __LINE__); } while (0)
static void *xmalloc(size_t n, const char *what) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "FATAL: out of host memory: %zu bytes for %s\n", n, what);
        exit(2);
    }
    return p;
}
static void *xcalloc(size_t n, size_t sz, const char *what) {
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p) {
        fprintf(stderr, "FATAL: out of host memory: %zu x %zu bytes for %s\n", n, sz, what);
        exit(2);
    }
    return p;
}

/* ------------------------------------------------------------------ markdown out */
static char *g_md;
static size_t g_md_len, g_md_cap;
static void md(const char *fmt, ...) {
    char line[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof line) n = sizeof line - 1;
    if (g_md_len + (size_t)n + 1 > g_md_cap) {
        g_md_cap = (g_md_len + (size_t)n + 1) * 2;
        char *p = realloc(g_md, g_md_cap);
        if (!p) { fprintf(stderr, "FATAL: out of host memory (markdown)\n"); exit(2); }
        g_md = p;
    }
    memcpy(g_md + g_md_len, line, (size_t)n + 1);
    g_md_len += (size_t)n;
    fputs(line, stdout);
    fflush(stdout);
}

/* ------------------------------------------------------------------ random numbers */
static uint64_t g_rng = 0x243F6A8885A308D3ull;
static uint64_t rnd64(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double urand(void) { return (double)(rnd64() >> 11) * (1.0 / 9007199254740992.0); }
static int irand(int n) { return (int)(rnd64() % (uint64_t)n); }
static uint16_t f2bf(float f) {   /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
/* n bf16 values uniform in [lo, hi): 4 values per 64 random bits, a 256-entry table each */
static void fill_bf16(uint16_t *p, size_t n, float lo, float hi) {
    uint16_t tab[256];
    for (int i = 0; i < 256; i++) tab[i] = f2bf(lo + (hi - lo) * ((float)i + 0.5f) / 256.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t r = rnd64();
        for (int k = 0; k < 8; k++) p[i + k] = tab[(r >> (8 * k)) & 255];
    }
    for (; i < n; i++) p[i] = tab[rnd64() & 255];
}
static void fill_f32(float *p, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) p[i] = lo + (hi - lo) * (float)urand();
}

/* ------------------------------------------------------------------ options, dims */
typedef struct dims {
    const char *name;
    int vocab, hidden, layers, dense, heads, q_lora, kv_lora, nope, rope, v, inter, moe_inter, experts, topk, shared,
        group;
    int embed_vocab;                  /* embedding rows when not vocab (a rank's lm_head holds a vocab shard) */
} dims;
static const dims K26 = {"Kimi K2.6 dims", 163840, 7168, 4, 1, 64, 1536, 512, 128, 64, 128, 18432, 2048, 384, 8, 1, 32, 0};
enum { K26_LAYERS = 61 };             /* the whole model's (the slice keeps 4) */
static const dims TINY = {"tiny (models/tiny-k2.6 dims)", 1024, 128, 4, 1, 4, 64, 32, 16, 8, 16, 256, 64, 16, 4, 1, 32, 0};

typedef struct opts {
    bool cuda, tiny, quick, mla, graphs, draft;
    const char *md;
    int steps;
    double row_s, tol;
    int k26_rank;                     /* --k26-rank N: the TP-N projection (0: the slice bench) */
    int layers;                       /* --layers: of the projection's model (default all 61) */
} opts;

/* ------------------------------------------------------------------ the backend, wrapped */
static kd_backend *g_be;
static const kd_backend_ops *g_real;
static kd_backend_ops g_wrap;
static bool g_events;                 /* CUDA events (slice_cuda.cu) rather than the host clock */
static int g_shared_branch;           /* --shared-branch rows|on|off: kd_model_options.shared_expert_branch 0, 1, -1 */
static bool g_ncu;                    /* --ncu: each projection row's last timed step in the profiler's window */

enum { MAXMARK = 8192 };   /* a profiled step of 61 layers makes about 1600 op calls, 2 marks each */
static uint64_t g_host_mark[MAXMARK];
static void mark(int i) {
#ifdef KD_SLICE_EVENTS
    if (g_events) { CK(kd_slice_ev_mark(i)); return; }
#endif
    CK(g_real->sync(g_be));
    g_host_mark[i] = kd_time_ns();
}
static double mark_ms(int a, int b) {
#ifdef KD_SLICE_EVENTS
    if (g_events) {
        float ms = 0;
        CK(kd_slice_ev_ms(a, b, &ms));
        return ms;
    }
#endif
    return (double)(g_host_mark[b] - g_host_mark[a]) * 1e-6;
}

/* op kinds of the profile */
enum cat { C_ATTN_PROJ, C_ABSORB, C_ATTN, C_DENSE, C_MOE, C_SHARED, C_LMHEAD, C_NORM, C_ELEM, C_UPLOAD, C_OTHER, C_N };
static const char *cat_name[C_N] = {"attn proj", "absorb", "attention", "dense MLP", "routed MoE", "shared exp",
                                    "lm_head", "norms (+ residual), rope", "elementwise", "upload", "other"};
static bool g_prof;
static int g_nmark;                   /* profile marks start at 2 (0, 1: the step) */
static int g_mark_cat[MAXMARK];
static int prof_begin(void) {
    if (!g_prof) return -1;
    if (g_nmark + 2 > MAXMARK) { fprintf(stderr, "FATAL: more than %d profile marks in one step\n", MAXMARK); exit(2); }
    int i = g_nmark;
    g_nmark += 2;
    mark(i);
    return i;
}
static void prof_end(int i, int cat) {
    if (i < 0) return;
    mark(i + 1);
    g_mark_cat[i] = cat;
}
static int weight_cat(const kd_weight *w) {
    const char *n = w && w->name ? w->name : "";
    if (strstr(n, "self_attn")) return C_ATTN_PROJ;
    if (strstr(n, "shared_experts")) return C_SHARED;
    if (strstr(n, "lm_head")) return C_LMHEAD;
    if (strstr(n, ".mlp.")) return C_DENSE;
    return C_OTHER;
}

static long g_op_calls;               /* backend op calls (a replayed step graph makes none) */
#define WRAP(name, cat, params, args) \
    static kd_status w_##name params { \
        if (#name[0] != 'u') g_op_calls++;   /* not upload: a graph step still uploads its inputs */ \
        int i_ = prof_begin(); \
        kd_status st_ = g_real->name args; \
        prof_end(i_, cat); \
        return st_; \
    }
WRAP(upload, C_UPLOAD, (kd_backend *be, void *d, const void *s, size_t n), (be, d, s, n))
WRAP(copy, C_ELEM, (kd_backend *be, kd_act d, kd_act s), (be, d, s))
WRAP(embed, C_ELEM, (kd_backend *be, const kd_weight *t, const int32_t *ids, kd_act o), (be, t, ids, o))
WRAP(add, C_ELEM, (kd_backend *be, kd_act x, kd_act y), (be, x, y))
WRAP(scale_add, C_ELEM, (kd_backend *be, kd_act x, kd_act y, float s), (be, x, y, s))
WRAP(swiglu, C_ELEM, (kd_backend *be, kd_act g, kd_act u, kd_act o), (be, g, u, o))
WRAP(rmsnorm, C_NORM, (kd_backend *be, kd_act x, const kd_weight *w, float eps, kd_act o), (be, x, w, eps, o))
WRAP(add_rmsnorm, C_NORM, (kd_backend *be, kd_act x, kd_act y, const kd_weight *w, float eps, kd_act o),
     (be, x, y, w, eps, o))
WRAP(rope, C_NORM, (kd_backend *be, kd_act x, int nh, int hs, int off, const int32_t *pos, const kd_rope *r),
     (be, x, nh, hs, off, pos, r))
WRAP(mla_rope_store, C_NORM,
     (kd_backend *be, kd_act q, kd_act qf, int nh, kd_act kva, const kd_weight *w, float eps, const int32_t *pos,
      const kd_rope *r, kd_act cache, int row0, const int32_t *d_len),
     (be, q, qf, nh, kva, w, eps, pos, r, cache, row0, d_len))
WRAP(gather_rows, C_ELEM, (kd_backend *be, kd_act d, kd_act s, const int32_t *rows, int n), (be, d, s, rows, n))
WRAP(linear, weight_cat(w), (kd_backend *be, kd_act x, const kd_weight *w, kd_act o), (be, x, w, o))
WRAP(linear_pair, weight_cat(w0), (kd_backend *be, kd_act x, const kd_weight *w0, const kd_weight *w1, kd_act o),
     (be, x, w0, w1, o))
WRAP(linear_swiglu, weight_cat(g), (kd_backend *be, kd_act x, const kd_weight *g, const kd_weight *u, kd_act o),
     (be, x, g, u, o))
/* a profiled step runs the shared expert in line, not on a branch, so that the marks around each
 * op on the backend's stream time that op */
static kd_status w_branch_begin(kd_backend *be) { return g_prof ? KD_OK : g_real->branch_begin(be); }
static kd_status w_branch_end(kd_backend *be) { return g_prof ? KD_OK : g_real->branch_end(be); }
WRAP(head_matmul, C_ABSORB,
     (kd_backend *be, kd_act x, int nh, int xs, int k, const kd_weight *w, int ws, int wr0, bool tr, kd_act o, int oc,
      int os),
     (be, x, nh, xs, k, w, ws, wr0, tr, o, oc, os))
WRAP(attention, C_ATTN,
     (kd_backend *be, kd_act q, int nh, int hd, kd_act k, kd_act v, int nkv, int past, bool causal, const uint64_t *vis,
      int window, float scale, kd_act o),
     (be, q, nh, hd, k, v, nkv, past, causal, vis, window, scale, o))

/* ------------------------------------------------------------------ the slice model */
enum { B_ATTN, B_NORM, B_DENSE, B_SHARED, B_ROUTER, B_EXPERTS, B_EMBED, B_LMHEAD, B_N };
static const char *bkind_name[B_N] = {"attention (q_a, q_b, kv_a, kv_b, o_proj, latent norms)", "layer + final norms",
                                      "dense MLP (layer 0)", "shared experts", "routers + biases",
                                      "routed experts (INT4 codes + bf16 scales)", "embedding", "lm_head"};

typedef struct slice {
    dims d;
    kd_model *m;
    bool keep_host;                   /* CPU: the weights' host bytes are their backend form */
    void **keep;
    int n_keep, cap_keep;
    char **names;
    int n_names, cap_names;
    uint32_t *codes;                  /* INT4 code pool */
    size_t n_codes;
    uint16_t *scales[2];              /* scale pools for in = hidden and in = moe_intermediate */
    int scale_cols[2];
    size_t n_scales;
    float **bias_host;                /* per layer: the router bias (host copy, MoE layers) */
    bool *experts_loaded;
    uint64_t bytes[B_N];
    uint64_t expert_bytes;            /* one routed expert: gate + up + down */
    /* distinct experts routed in the counting step, per layer */
    bool counting;
    unsigned char *used;              /* layers x experts */
    float *d_logits, *h_logits;       /* router logits [KD max rows, experts] */
    int logit_rows;
} slice;
static slice S;

static void keep_host(void *p) {
    if (S.n_keep == S.cap_keep) {
        S.cap_keep = S.cap_keep ? 2 * S.cap_keep : 256;
        void **k = realloc(S.keep, (size_t)S.cap_keep * sizeof *k);
        if (!k) { fprintf(stderr, "FATAL: out of host memory\n"); exit(2); }
        S.keep = k;
    }
    S.keep[S.n_keep++] = p;
}
static const char *name_of(const char *fmt, ...) {
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (S.n_names == S.cap_names) {
        S.cap_names = S.cap_names ? 2 * S.cap_names : 1024;
        char **k = realloc(S.names, (size_t)S.cap_names * sizeof *k);
        if (!k) { fprintf(stderr, "FATAL: out of host memory\n"); exit(2); }
        S.names = k;
    }
    char *s = strdup(buf);
    if (!s) { fprintf(stderr, "FATAL: out of host memory\n"); exit(2); }
    S.names[S.n_names++] = s;
    return s;
}

/* a bf16 matrix [rows, cols] (a vector: cols = 1) uniform in [lo, hi), loaded by the backend */
static void load_bf16(kd_weight *w, const char *name, int64_t rows, int64_t cols, float lo, float hi, int kind) {
    size_t n = (size_t)rows * (size_t)cols;
    uint16_t *h = xmalloc(n * 2, name);
    fill_bf16(h, n, lo, hi);
    memset(w, 0, sizeof *w);
    w->name = name;
    w->format = KD_W_BF16;
    w->rows = rows;
    w->cols = cols;
    w->src = h;
    if (g_be->ops->weight_load(g_be, w) != KD_OK) {
        fprintf(stderr, "FATAL: weight_load '%s' [%lld, %lld] bf16: %s\n", name, (long long)rows, (long long)cols,
                kd_last_error());
        exit(2);
    }
    if (S.keep_host) keep_host(h);
    else { free(h); w->src = NULL; }
    S.bytes[kind] += n * 2;
}
static void load_norm(kd_weight *w, const char *name, int64_t n, int kind) { load_bf16(w, name, n, 1, 0.9f, 1.1f, kind); }
static void load_linear(kd_weight *w, const char *name, int64_t rows, int64_t cols, int kind) {
    float a = sqrtf(3.0f / (float)cols);   /* unit-variance outputs for unit-variance inputs */
    load_bf16(w, name, rows, cols, -a, a, kind);
}

/* an INT4 group-32 weight: codes and scales from the pools at random offsets */
static void load_int4(kd_weight *w, const char *name, int64_t rows, int64_t cols) {
    size_t words = (size_t)rows * (size_t)cols / 8, ns = (size_t)rows * (size_t)cols / (size_t)S.d.group;
    int pool = cols == S.scale_cols[0] ? 0 : 1;
    if (words > S.n_codes || ns > S.n_scales || cols != S.scale_cols[pool]) {
        fprintf(stderr, "FATAL: INT4 weight '%s' [%lld, %lld] does not fit the pools\n", name, (long long)rows,
                (long long)cols);
        exit(2);
    }
    size_t oc = (size_t)(rnd64() % (S.n_codes - words + 1)) & ~(size_t)15;
    size_t os = (size_t)(rnd64() % (S.n_scales - ns + 1)) & ~(size_t)15;
    memset(w, 0, sizeof *w);
    w->name = name;
    w->format = KD_W_INT4;
    w->rows = rows;
    w->cols = cols;
    w->group = S.d.group;
    w->src = S.codes + oc;
    w->src_scale = S.scales[pool] + os;
    if (g_be->ops->weight_load(g_be, w) != KD_OK) {
        fprintf(stderr, "FATAL: weight_load '%s' [%lld, %lld] INT4 group %d: %s\n", name, (long long)rows,
                (long long)cols, S.d.group, kd_last_error());
        exit(2);
    }
    if (!S.keep_host) { w->src = NULL; w->src_scale = NULL; }
}

/* bytes in GB (>= 0.1 GB) or MB, for the tables */
static const char *human(double bytes, char *buf, size_t cap) {
    if (bytes >= 1e8) snprintf(buf, cap, "%.3f GB", bytes / 1e9);
    else snprintf(buf, cap, "%.3f MB", bytes / 1e6);
    return buf;
}

static void write_config(const char *dir, const dims *d) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) { fprintf(stderr, "FATAL: cannot write %s\n", path); exit(2); }
    fprintf(f,
            "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"model_type\": \"kimi_k2\",\n"
            " \"vocab_size\": %d, \"hidden_size\": %d, \"intermediate_size\": %d, \"moe_intermediate_size\": %d,\n"
            " \"num_hidden_layers\": %d, \"first_k_dense_replace\": %d, \"moe_layer_freq\": 1,\n"
            " \"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"q_lora_rank\": %d, \"kv_lora_rank\": %d,\n"
            " \"qk_nope_head_dim\": %d, \"qk_rope_head_dim\": %d, \"v_head_dim\": %d,\n"
            " \"n_routed_experts\": %d, \"num_experts_per_tok\": %d, \"n_shared_experts\": %d,\n"
            " \"n_group\": 1, \"topk_group\": 1, \"topk_method\": \"noaux_tc\", \"scoring_func\": \"sigmoid\",\n"
            " \"norm_topk_prob\": true, \"routed_scaling_factor\": 2.827, \"hidden_act\": \"silu\",\n"
            " \"rms_norm_eps\": 1e-05, \"rope_theta\": 50000.0,\n"
            " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 64.0, \"beta_fast\": 32.0, \"beta_slow\": 1.0,\n"
            "   \"mscale\": 1.0, \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096},\n"
            " \"max_position_embeddings\": 262144, \"attention_bias\": false, \"tie_word_embeddings\": false,\n"
            " \"bos_token_id\": %d, \"eos_token_id\": [%d, %d],\n"
            " \"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": \"pack-quantized\",\n"
            "   \"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 4,\n"
            "     \"type\": \"int\", \"symmetric\": true, \"strategy\": \"group\", \"group_size\": %d}}},\n"
            "   \"ignore\": [\"lm_head\", \"re:.*self_attn.*\", \"re:.*shared_experts.*\",\n"
            "     \"re:.*mlp\\\\.(gate|up|gate_up|down)_proj.*\"]}}\n",
            d->vocab, d->hidden, d->inter, d->moe_inter, d->layers, d->dense, d->heads, d->heads, d->q_lora, d->kv_lora,
            d->nope, d->rope, d->v, d->experts, d->topk, d->shared, d->vocab - 3, d->vocab - 2, d->vocab - 1, d->group);
    if (fclose(f) != 0) { fprintf(stderr, "FATAL: cannot write %s\n", path); exit(2); }
}

static void build_layer(kd_model *m, int l) {
    const kd_config *c = &m->cfg;
    kd_layer *ly = &m->ranks[0].layers[l];
    int H = c->n_heads, r = c->kv_lora_rank, dr = c->qk_rope_dim, dn = c->qk_nope_dim, dv = c->v_head_dim;
    int64_t D = c->hidden;
#define N(s) name_of("model.layers.%d.%s", l, s)
    load_norm(&ly->attn_norm, N("input_layernorm.weight"), D, B_NORM);
    load_norm(&ly->ffn_norm, N("post_attention_layernorm.weight"), D, B_NORM);
    if (c->q_lora_rank > 0) {
        load_linear(&ly->q_a, N("self_attn.q_a_proj.weight"), c->q_lora_rank, D, B_ATTN);
        load_norm(&ly->q_a_norm, N("self_attn.q_a_layernorm.weight"), c->q_lora_rank, B_ATTN);
        load_linear(&ly->q_b, N("self_attn.q_b_proj.weight"), (int64_t)H * (dn + dr), c->q_lora_rank, B_ATTN);
    } else {
        load_linear(&ly->q_proj, N("self_attn.q_proj.weight"), (int64_t)H * (dn + dr), D, B_ATTN);
    }
    load_linear(&ly->kv_a, N("self_attn.kv_a_proj_with_mqa.weight"), r + dr, D, B_ATTN);
    load_norm(&ly->kv_a_norm, N("self_attn.kv_a_layernorm.weight"), r, B_ATTN);
    load_linear(&ly->kv_b, N("self_attn.kv_b_proj.weight"), (int64_t)H * (dn + dv), r, B_ATTN);
    load_linear(&ly->o_proj, N("self_attn.o_proj.weight"), D, (int64_t)H * dv, B_ATTN);
    ly->is_moe = l >= c->first_k_dense;
    if (!ly->is_moe) {
        load_linear(&ly->mlp_gate, N("mlp.gate_proj.weight"), c->intermediate, D, B_DENSE);
        load_linear(&ly->mlp_up, N("mlp.up_proj.weight"), c->intermediate, D, B_DENSE);
        load_linear(&ly->mlp_down, N("mlp.down_proj.weight"), D, c->intermediate, B_DENSE);
        return;
    }
    int E = c->n_experts;
    int64_t I = c->moe_intermediate;
    load_linear(&ly->router, N("mlp.gate.weight"), E, D, B_ROUTER);
    float *bias = xmalloc((size_t)E * sizeof(float), "router bias");
    fill_f32(bias, (size_t)E, -0.02f, 0.02f);
    S.bias_host[l] = bias;
    /* the bias as the loader keeps it: an f32 weight (counted with the router) and a backend copy */
    kd_weight *bw = &ly->router_bias;
    memset(bw, 0, sizeof *bw);
    bw->name = N("mlp.gate.e_score_correction_bias");
    bw->format = KD_W_F32;
    bw->rows = E;
    bw->cols = 1;
    bw->src = bias;
    if (g_be->ops->weight_load(g_be, bw) != KD_OK) die_st("weight_load (router bias)", __LINE__);
    void *dbias = NULL;
    CK(g_be->ops->alloc(g_be, (size_t)E * sizeof(float), &dbias));
    CK(g_be->ops->upload(g_be, dbias, bias, (size_t)E * sizeof(float)));
    S.bytes[B_ROUTER] += (uint64_t)E * sizeof(float);
    kd_experts *e = &ly->experts;
    e->bias = dbias;
    if (c->n_shared_experts > 0) {
        int64_t SI = (int64_t)c->n_shared_experts * I;
        load_linear(&ly->mlp_gate, N("mlp.shared_experts.gate_proj.weight"), SI, D, B_SHARED);
        load_linear(&ly->mlp_up, N("mlp.shared_experts.up_proj.weight"), SI, D, B_SHARED);
        load_linear(&ly->mlp_down, N("mlp.shared_experts.down_proj.weight"), D, SI, B_SHARED);
    }
    e->n = E;
    e->top_k = c->n_experts_per_tok;
    e->n_group = c->n_group;
    e->topk_group = c->topk_group;
    e->norm_topk_prob = c->norm_topk_prob;
    e->routed_scaling_factor = c->routed_scaling_factor;
    e->gate = xcalloc((size_t)E, sizeof *e->gate, "expert table");
    e->up = xcalloc((size_t)E, sizeof *e->up, "expert table");
    e->down = xcalloc((size_t)E, sizeof *e->down, "expert table");
    for (int j = 0; j < E; j++) {
        load_int4(&e->gate[j], name_of("model.layers.%d.mlp.experts.%d.gate_proj.weight_packed", l, j), I, D);
        load_int4(&e->up[j], name_of("model.layers.%d.mlp.experts.%d.up_proj.weight_packed", l, j), I, D);
        load_int4(&e->down[j], name_of("model.layers.%d.mlp.experts.%d.down_proj.weight_packed", l, j), D, I);
    }
    S.expert_bytes = kd_weight_bytes(&e->gate[0]) + kd_weight_bytes(&e->up[0]) + kd_weight_bytes(&e->down[0]);
    S.bytes[B_EXPERTS] += (uint64_t)E * S.expert_bytes;
    e->router = &ly->router;
    if (g_be->ops->experts_load(g_be, e) != KD_OK) {
        fprintf(stderr, "FATAL: experts_load of layer %d: %s\n", l, kd_last_error());
        exit(2);
    }
    S.experts_loaded[l] = true;
#undef N
}

/* d's config through the real parser: a config.json written to a temporary directory */
static void load_config(const dims *d, kd_config *cfg) {
    char dir[] = "/tmp/kd_slice_XXXXXX";
    if (!mkdtemp(dir)) { fprintf(stderr, "FATAL: mkdtemp failed\n"); exit(2); }
    write_config(dir, d);
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    kd_status st = kd_config_load(dir, cfg);
    remove(path);
    rmdir(dir);
    if (st != KD_OK) die_st("kd_config_load (the slice's config.json)", __LINE__);
}

/* the device memory a built layer took (driver's view); refuses up front when the layers still
 * to build would not fit at that rate (allocation rounding shows here before it runs out) */
static void check_layer_memory(int l, int n_layers, uint64_t *free_before) {
    kd_mem_usage u;
    g_be->ops->mem_usage(g_be, &u);
    if (!u.device_total) return;
    uint64_t took = *free_before > u.device_free ? *free_before - u.device_free : 0;
    *free_before = u.device_free;
    uint64_t need = took * (uint64_t)(n_layers - 1 - l) + ((uint64_t)2 << 30);
    if (l > 0 && need > u.device_free) {
        fprintf(stderr, "FATAL: layer %d took %.3f GB of device memory; the %d layers still to build need about "
                "%.3f GB (+ 2 GiB), and %.3f GB are free. Fewer layers: --layers N\n", l, (double)took / 1e9,
                n_layers - 1 - l, (double)(need - ((uint64_t)2 << 30)) / 1e9, (double)u.device_free / 1e9);
        exit(2);
    }
}

static kd_model *build_model(const dims *d) {
    memset(&S, 0, sizeof S);
    S.d = *d;
    S.keep_host = g_be->kind == KD_BACKEND_CPU;
    kd_model *m = xcalloc(1, sizeof *m, "model");
    m->opt.shared_expert_branch = g_shared_branch;
    load_config(d, &m->cfg);
    const kd_config *c = &m->cfg;
    /* one rank holding the whole model */
    m->tp = 1;
    m->ranks = xcalloc(1, sizeof *m->ranks, "ranks");
    m->ranks[0].be = m->be = g_be;
    m->split = (kd_widths){1, c->n_heads, c->intermediate, c->moe_intermediate, c->vocab};
    snprintf(m->dir, sizeof m->dir, "(model slice: %s, random weights in memory)", d->name);
    m->ranks[0].layers = xcalloc((size_t)c->n_layers, sizeof *m->ranks[0].layers, "layers");
    S.bias_host = xcalloc((size_t)c->n_layers, sizeof *S.bias_host, "biases");
    S.experts_loaded = xcalloc((size_t)c->n_layers, sizeof *S.experts_loaded, "flags");
    S.used = xcalloc((size_t)c->n_layers * (size_t)c->n_experts, 1, "expert marks");
    /* INT4 pools: 4 experts' worth of codes, 4 weights' worth of scales per input width */
    S.n_codes = (size_t)4 * c->moe_intermediate * c->hidden / 8;
    S.codes = xmalloc(S.n_codes * 4, "INT4 code pool");
    for (size_t i = 0; i < S.n_codes; i += 2) {
        uint64_t r = rnd64();
        S.codes[i] = (uint32_t)r;
        if (i + 1 < S.n_codes) S.codes[i + 1] = (uint32_t)(r >> 32);
    }
    S.n_scales = (size_t)4 * c->moe_intermediate * c->hidden / d->group;
    S.scale_cols[0] = c->hidden;
    S.scale_cols[1] = c->moe_intermediate;
    for (int p = 0; p < 2; p++) {
        /* codes q in -8..7 have E[q^2] = 21.5: scale ~ 1/sqrt(21.5 in) gives unit-variance outputs */
        float base = 1.0f / sqrtf(21.5f * (float)S.scale_cols[p]);
        S.scales[p] = xmalloc(S.n_scales * 2, "INT4 scale pool");
        fill_bf16(S.scales[p], S.n_scales, 0.75f * base, 1.25f * base);
    }
    uint64_t t0 = kd_time_ns();
    load_bf16(&m->ranks[0].embed, name_of("model.embed_tokens.weight"), d->embed_vocab ? d->embed_vocab : c->vocab, c->hidden,
              -1.0f, 1.0f, B_EMBED);
    kd_mem_usage u0;
    g_be->ops->mem_usage(g_be, &u0);
    uint64_t free_before = u0.device_free;
    for (int l = 0; l < c->n_layers; l++) {
        build_layer(m, l);
        check_layer_memory(l, c->n_layers, &free_before);
        printf("  layer %d built (%s), %.1f s\n", l, m->ranks[0].layers[l].is_moe ? "MoE" : "dense",
               (double)(kd_time_ns() - t0) * 1e-9);
        fflush(stdout);
    }
    load_norm(&m->ranks[0].final_norm, name_of("model.norm.weight"), c->hidden, B_NORM);
    load_linear(&m->ranks[0].lm_head, name_of("lm_head.weight"), c->vocab, c->hidden, B_LMHEAD);
    /* RoPE (YaRN) inverse frequencies, as kd_model_load_weights */
    int half = c->qk_rope_dim / 2;
    float *inv = xmalloc((size_t)half * sizeof(float), "rope");
    kd_rope_inv_freq(c, c->qk_rope_dim, inv);
    void *dev = NULL;
    CK(g_be->ops->alloc(g_be, (size_t)half * sizeof(float), &dev));
    CK(g_be->ops->upload(g_be, dev, inv, (size_t)half * sizeof(float)));
    free(inv);
    m->ranks[0].rope_inv_freq = dev;
    m->ranks[0].rope.dim = c->qk_rope_dim;
    m->ranks[0].rope.interleaved = true;
    m->ranks[0].rope.attn_factor = (float)c->rope.amp;
    m->ranks[0].rope.inv_freq = m->ranks[0].rope_inv_freq;
    CK(g_be->ops->sync(g_be));
    /* router logits for the expert count: up to KD_SEQ_MAX_ROWS (1024) rows */
    S.logit_rows = 1024;
    CK(g_be->ops->alloc(g_be, (size_t)S.logit_rows * c->n_experts * sizeof(float), (void **)&S.d_logits));
    S.h_logits = xmalloc((size_t)S.logit_rows * c->n_experts * sizeof(float), "router logits");
    S.m = m;
    return m;
}

static void free_w(kd_weight *w) {
    if (w->name) g_be->ops->weight_free(g_be, w);
    memset(w, 0, sizeof *w);
}
static void free_model(kd_model *m) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        kd_layer *ly = &m->ranks[0].layers[l];
        kd_experts *e = &ly->experts;
        if (S.experts_loaded[l]) g_be->ops->experts_free(g_be, e);
        for (int j = 0; e->gate && j < e->n; j++) {
            free_w(&e->gate[j]);
            free_w(&e->up[j]);
            free_w(&e->down[j]);
        }
        free(e->gate);
        free(e->up);
        free(e->down);
        if (e->bias) g_be->ops->free(g_be, (void *)e->bias);
        kd_weight *ws[] = {&ly->attn_norm, &ly->ffn_norm, &ly->q_a, &ly->q_a_norm, &ly->q_b, &ly->q_proj, &ly->kv_a,
                           &ly->kv_a_norm, &ly->kv_b, &ly->o_proj, &ly->mlp_gate, &ly->mlp_up, &ly->mlp_down,
                           &ly->router, &ly->router_bias};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) free_w(ws[i]);
        free(S.bias_host[l]);
    }
    free_w(&m->ranks[0].embed);
    free_w(&m->ranks[0].final_norm);
    free_w(&m->ranks[0].lm_head);
    if (m->ranks[0].rope_inv_freq) g_be->ops->free(g_be, m->ranks[0].rope_inv_freq);
    if (S.d_logits) g_be->ops->free(g_be, S.d_logits);
    free(S.h_logits);
    free(m->ranks[0].layers);
    free(m->ranks);
    kd_config_free(&m->cfg);
    free(m);
    for (int i = 0; i < S.n_keep; i++) free(S.keep[i]);
    free(S.keep);
    for (int i = 0; i < S.n_names; i++) free(S.names[i]);
    free(S.names);
    free(S.codes);
    free(S.scales[0]);
    free(S.scales[1]);
    free(S.bias_host);
    free(S.experts_loaded);
    free(S.used);
}

/* ------------------------------------------------------------------ counting routed experts */
static void count_experts(kd_backend *be, kd_act x, const kd_experts *e) {
    kd_model *m = S.m;
    int l = -1;
    for (int i = 0; i < m->cfg.n_layers; i++)
        if (&m->ranks[0].layers[i].experts == e) l = i;
    if (l < 0 || x.rows > S.logit_rows) { fprintf(stderr, "FATAL: moe call of an unknown layer\n"); exit(2); }
    int T = x.rows, E = e->n, K = e->top_k, ng = e->n_group > 1 ? e->n_group : 1, per = E / ng;
    kd_act lg = {S.d_logits, T, E, E, KD_F32};
    CK(g_real->linear(be, x, e->router, lg));
    CK(g_real->download(be, S.h_logits, S.d_logits, (size_t)T * E * sizeof(float)));
    float *choice = xmalloc((size_t)(E + ng) * sizeof(float), "routing");
    unsigned char *taken = xmalloc((size_t)(E > ng ? E : ng), "routing");
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < E; i++) {
            float s = 1.0f / (1.0f + expf(-S.h_logits[(size_t)t * E + i]));
            choice[i] = s + S.bias_host[l][i];
        }
        if (ng > 1) {   /* group-limited: the topk_group groups of best top-2 sums */
            float *gs = choice + E;
            for (int g = 0; g < ng; g++) {
                float a = -INFINITY, b = -INFINITY;
                for (int i = g * per; i < (g + 1) * per; i++) {
                    if (choice[i] > a) { b = a; a = choice[i]; } else if (choice[i] > b) b = choice[i];
                }
                gs[g] = per >= 2 ? a + b : a;
            }
            memset(taken, 0, (size_t)ng);
            for (int j = 0; j < e->topk_group; j++) {
                int best = -1;
                for (int g = 0; g < ng; g++)
                    if (!taken[g] && (best < 0 || gs[g] > gs[best])) best = g;
                taken[best] = 1;
            }
            for (int g = 0; g < ng; g++)
                if (!taken[g]) for (int i = g * per; i < (g + 1) * per; i++) choice[i] = -INFINITY;
        }
        memset(taken, 0, (size_t)E);
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int i = 0; i < E; i++)
                if (!taken[i] && (best < 0 || choice[i] > choice[best])) best = i;
            taken[best] = 1;
            S.used[(size_t)l * E + best] = 1;
        }
    }
    free(choice);
    free(taken);
}
static kd_status w_moe(kd_backend *be, kd_act x, const kd_experts *e, kd_act shared, kd_act o) {
    g_op_calls++;
    if (S.counting) count_experts(be, x, e);
    int i = prof_begin();
    kd_status st = g_real->moe(be, x, e, shared, o);
    prof_end(i, C_MOE);
    return st;
}

static void wrap_backend(void) {
    g_real = g_be->ops;
    g_wrap = *g_real;
    g_wrap.upload = w_upload;
    g_wrap.copy = w_copy;
    g_wrap.embed = w_embed;
    g_wrap.add = w_add;
    g_wrap.scale_add = w_scale_add;
    g_wrap.swiglu = w_swiglu;
    g_wrap.rmsnorm = w_rmsnorm;
    g_wrap.add_rmsnorm = w_add_rmsnorm;
    g_wrap.rope = w_rope;
    g_wrap.mla_rope_store = w_mla_rope_store;
    g_wrap.gather_rows = w_gather_rows;
    g_wrap.linear = w_linear;
    g_wrap.linear_pair = w_linear_pair;
    g_wrap.linear_swiglu = w_linear_swiglu;
    if (g_real->branch_begin) {
        g_wrap.branch_begin = w_branch_begin;
        g_wrap.branch_end = w_branch_end;
    }
    g_wrap.head_matmul = w_head_matmul;
    g_wrap.attention = w_attention;
    g_wrap.moe = w_moe;
    g_be->ops = &g_wrap;
}

/* ------------------------------------------------------------------ steps */
typedef struct step {
    int ctx, T, B, depth_max;
    int32_t tok[1024], pos[1024], parent[1024], depth[1024];
    uint64_t *vis;
} step;

/* decode (B = 0, T = 1) or a random tree of 1 + B nodes, depth <= L, at context ctx */
static void make_step(step *st, int ctx, int B, int L, int vocab) {
    memset(st, 0, sizeof *st);
    st->ctx = ctx;
    st->B = B;
    st->T = B + 1;
    st->parent[0] = -1;
    for (int i = 1; i <= B; i++) {
        int p;
        do p = irand(i); while (st->depth[p] >= L);
        st->parent[i] = p;
        st->depth[i] = st->depth[p] + 1;
        if (st->depth[i] > st->depth_max) st->depth_max = st->depth[i];
    }
    for (int i = 0; i < st->T; i++) {
        st->tok[i] = irand(vocab);
        st->pos[i] = ctx + st->depth[i];
    }
    if (B == 0) return;
    int words = (st->T + 63) / 64;
    st->vis = xcalloc((size_t)st->T * words, sizeof(uint64_t), "visibility");
    for (int i = 0; i < st->T; i++)
        for (int j = i; j >= 0; j = st->parent[j]) st->vis[(size_t)i * words + j / 64] |= 1ull << (j % 64);
}

/* bench-only: put the sequence back at `ctx` committed rows (nothing pending) */
static void set_ctx(kd_seq *s, int ctx) {
    s->len = ctx;
    s->pending = 0;
    s->out_rows = 0;
    s->phase = KD_PHASE_IDLE;
    s->n_accepted = 0;
}
static void run_step(kd_seq *s, const step *st) {
    set_ctx(s, st->ctx);
    if (kd_forward(s, st->tok, st->T, st->B ? st->pos : NULL, st->B ? st->vis : NULL) != KD_OK)
        die_st("kd_forward (bench step)", __LINE__);
}
/* one timed step: events (or host clock) around it; host wall time in *host_ms */
static double timed_step(kd_seq *s, const step *st, double *host_ms) {
    CK(g_real->sync(g_be));
    uint64_t h0 = kd_time_ns();
    mark(0);
    run_step(s, st);
    mark(1);
    CK(g_real->sync(g_be));
    uint64_t h1 = kd_time_ns();
    if (host_ms) *host_ms = (double)(h1 - h0) * 1e-6;
    return mark_ms(0, 1);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median_of(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
static int n_steps_for(const opts *o, double ms_one) {
    if (o->steps > 0) return o->steps;
    int lo = o->quick ? 3 : 5, hi = o->quick ? 10 : 30;
    int n = ms_one > 0 ? (int)(o->row_s * 1e3 / ms_one) : hi;
    return n < lo ? lo : n > hi ? hi : n;
}

/* ------------------------------------------------------------------ rows */
typedef struct row {
    int ctx, T, B, depth;
    int distinct[64];                 /* per layer (MoE layers) */
    int distinct_sum;
    double w_bytes, kv_bytes, roof_ms, ms, ms_min, host_ms;
    int n;
    double cat_ms[C_N], prof_total, prof_ops;
    double g_ms, g_host_ms;           /* the same step on the step-graph sequence */
    int g_n, g_replayed;
} row;

static double g_copy_gbs, g_read_gbs;
static kd_seq *g_seq_graph;           /* a second sequence in step-graph mode (graphs "on"), or NULL */
static int g_fail;                    /* failed checks (exit 1 after the tables) */

/* A profiled run: every backend op between two marks (the ops must run from the host: graphs
 * off), summed by kind into cat_ms; *total: the whole run, *ops: the ops' sum, *calls: ops made */
static void prof_start(void) {
    CK(g_real->sync(g_be));
    g_prof = true;
    g_nmark = 2;
    mark(0);
}
static void prof_finish(double cat_ms[C_N], double *total, double *ops, int *calls) {
    mark(1);
    g_prof = false;
    CK(g_real->sync(g_be));
    *total = mark_ms(0, 1);
    *ops = 0;
    for (int i = 2; i < g_nmark; i += 2) {
        double t = mark_ms(i, i + 1);
        cat_ms[g_mark_cat[i]] += t;
        *ops += t;
    }
    if (calls) *calls = (g_nmark - 2) / 2;
}
static void profile_step(kd_seq *s, const step *st, double cat_ms[C_N], double *total, double *ops, int *calls) {
    prof_start();
    run_step(s, st);
    prof_finish(cat_ms, total, ops, calls);
}
/* the profile table's header (the n_first leading columns named in first_cols, then the op kinds,
 * the gaps, the total) and the rest of a row after its leading columns */
static void prof_header(const char *first_cols, int n_first) {
    md("| %s |", first_cols);
    for (int j = 0; j < C_N; j++) md(" %s |", cat_name[j]);
    md(" between ops | profiled run |\n|");
    for (int j = 0; j < n_first + C_N + 2; j++) md("---|");
    md("\n");
}
static void prof_row(const double cat_ms[C_N], double total, double ops) {
    for (int j = 0; j < C_N; j++) md(" %.3f |", cat_ms[j]);
    md(" %.3f | %.3f |\n", total - ops, total);
}

static void bench_row(kd_seq *s, const opts *o, row *r, int ctx, int B) {
    kd_model *m = S.m;
    const kd_config *c = &m->cfg;
    step *st = xmalloc(sizeof *st, "step");
    make_step(st, ctx, B, 7, c->vocab);
    memset(r, 0, sizeof *r);
    r->ctx = ctx;
    r->T = st->T;
    r->B = B;
    r->depth = st->depth_max;
    /* (1) which experts the step reads */
    memset(S.used, 0, (size_t)c->n_layers * c->n_experts);
    S.counting = true;
    run_step(s, st);
    S.counting = false;
    CK(g_real->sync(g_be));
    for (int l = 0; l < c->n_layers && l < 64; l++) {
        if (!m->ranks[0].layers[l].is_moe) continue;
        for (int j = 0; j < c->n_experts; j++) r->distinct[l] += S.used[(size_t)l * c->n_experts + j];
        r->distinct_sum += r->distinct[l];
        /* the count is the host's routing of the backend's own router logits: it must lie in
         * [top_k, min(n, T * top_k)], and be exactly top_k for one token */
        int lo = c->n_experts_per_tok, hi = st->T * lo < c->n_experts ? st->T * lo : c->n_experts;
        if (r->distinct[l] < lo || r->distinct[l] > hi || (st->T == 1 && r->distinct[l] != lo)) {
            md("- FAIL: layer %d, T = %d: %d distinct experts counted, expected %d..%d\n", l, st->T, r->distinct[l], lo,
               hi);
            g_fail++;
        }
    }
    /* bytes the step must read */
    int distinct_tok = 0;
    for (int i = 0; i < st->T; i++) {
        int seen = 0;
        for (int j = 0; j < i && !seen; j++) seen = st->tok[j] == st->tok[i];
        distinct_tok += !seen;
    }
    r->w_bytes = (double)(S.bytes[B_ATTN] + S.bytes[B_NORM] + S.bytes[B_DENSE] + S.bytes[B_SHARED] +
                          S.bytes[B_ROUTER] + S.bytes[B_LMHEAD]) +
                 (double)r->distinct_sum * (double)S.expert_bytes + (double)distinct_tok * c->hidden * 2.0;
    r->kv_bytes = (double)c->n_layers * (double)(ctx + st->T) * (c->kv_lora_rank + c->qk_rope_dim) *
                  (double)kd_dtype_size(g_be->act_dtype);
    r->roof_ms = (r->w_bytes + r->kv_bytes) / (g_copy_gbs * 1e9) * 1e3;
    /* (2) one profiled step */
    profile_step(s, st, r->cat_ms, &r->prof_total, &r->prof_ops, NULL);
    /* (3) warm-up, then the timed steps */
    double w0 = timed_step(s, st, NULL);
    double w1 = timed_step(s, st, NULL);
    int n = n_steps_for(o, w0 < w1 ? w0 : w1);
    double *t = xmalloc((size_t)n * sizeof(double), "times"), *h = xmalloc((size_t)n * sizeof(double), "times");
    for (int i = 0; i < n; i++) t[i] = timed_step(s, st, &h[i]);
    r->n = n;
    r->ms = median_of(t, n);
    r->ms_min = t[0];
    r->host_ms = median_of(h, n);
    /* (4) the same step on the step-graph sequence: its first run is eager, the second captures,
     * later ones replay (a replay calls no backend op: counted) */
    if (g_seq_graph) {
        timed_step(g_seq_graph, st, NULL);
        timed_step(g_seq_graph, st, NULL);
        for (int i = 0; i < n; i++) {
            long calls = g_op_calls;
            t[i] = timed_step(g_seq_graph, st, &h[i]);
            if (g_op_calls == calls) r->g_replayed++;
        }
        r->g_n = n;
        r->g_ms = median_of(t, n);
        r->g_host_ms = median_of(h, n);
    }
    free(t);
    free(h);
    free(st->vis);
    free(st);
    printf("  %-12s ctx %6d T %4d: %9.3f ms (min %.3f, host %.3f, n %d), roofline %.3f ms, experts %d", B ? "verify" : "decode",
           ctx, r->T, r->ms, r->ms_min, r->host_ms, r->n, r->roof_ms, r->distinct_sum);
    if (g_seq_graph) printf("; graphs %.3f ms (replayed %d/%d)", r->g_ms, r->g_replayed, r->g_n);
    printf("\n");
    fflush(stdout);
}

/* ------------------------------------------------------------------ MLA attention rows */
static void mla_rows(const opts *o, const kd_config *c) {
    int ctx_k26[] = {1024, 4096, 16384, 65536}, ctx_tiny[] = {128, 512};
    int heads_k26[] = {64, 8}, heads_tiny[] = {8, 2}, Ts[] = {1, 64};
    const int *ctxs = o->tiny ? ctx_tiny : ctx_k26, *heads = o->tiny ? heads_tiny : heads_k26;
    int nctx = o->tiny ? 2 : 4;
    int dk = c->kv_lora_rank + c->qk_rope_dim, dvv = c->kv_lora_rank;
    kd_dtype dt = g_be->act_dtype;
    size_t es = kd_dtype_size(dt);
    int maxctx = ctxs[nctx - 1], maxh = heads[0];
    size_t nq = (size_t)64 * maxh * dk, nkv = (size_t)maxctx * dk, nh = nq > nkv ? nq : nkv;
    void *host = xmalloc(nh * es, "attention inputs");
    if (dt == KD_BF16) fill_bf16(host, nh, -1.7f, 1.7f);
    else fill_f32(host, nh, -1.7f, 1.7f);
    md("\n### MLA attention (absorbed: key %d = %d + %d, value %d, one latent KV head; causal; %s)\n\n", dk,
       c->kv_lora_rank, c->qk_rope_dim, dvv, g_events ? "CUDA events around each call" : "host clock between syncs");
    md("| heads | ctx | queries T | us | KV GB/s | of copy | TFLOP/s |\n|---|---|---|---|---|---|---|\n");
    for (int hi = 0; hi < 2; hi++)
        for (int ti = 0; ti < 2; ti++)
            for (int ci = 0; ci < nctx; ci++) {
                int H = heads[hi], T = Ts[ti], ctx = ctxs[ci];
                void *q, *kv, *out;
                CK(g_be->ops->alloc(g_be, (size_t)T * H * dk * es, &q));
                CK(g_be->ops->alloc(g_be, (size_t)ctx * dk * es, &kv));
                CK(g_be->ops->alloc(g_be, (size_t)T * H * dvv * es, &out));
                CK(g_be->ops->upload(g_be, q, host, (size_t)T * H * dk * es));
                CK(g_be->ops->upload(g_be, kv, host, (size_t)ctx * dk * es));
                kd_act aq = {q, T, H * dk, H * dk, dt}, akv = {kv, ctx, dk, dk, dt}, ao = {out, T, H * dvv, H * dvv, dt};
#define ATT() CK(g_real->attention(g_be, aq, H, dk, akv, kd_act_cols(akv, 0, dvv), 1, ctx - T, true, NULL, 0, \
                                   c->softmax_scale, ao))
                ATT();
                CK(g_real->sync(g_be));
                mark(0);
                ATT();
                mark(1);
                double one = mark_ms(0, 1);
                int n = n_steps_for(o, one) * 2;
                if (o->tiny && n > 6) n = 6;
                double *t = xmalloc((size_t)n * sizeof(double), "times");
                for (int i = 0; i < n; i++) {
                    mark(0);
                    ATT();
                    mark(1);
                    t[i] = mark_ms(0, 1);
                }
#undef ATT
                double ms = median_of(t, n);
                free(t);
                double bytes = (double)ctx * dk * 2.0, gbs = bytes / (ms * 1e-3) / 1e9;
                double flops = 2.0 * T * H * (double)ctx * (dk + dvv);
                md("| %d | %d | %d | %.1f | %.1f | %.1f%% | %.2f |\n", H, ctx, T, ms * 1e3, gbs, 100.0 * gbs / g_copy_gbs,
                   flops / (ms * 1e-3) / 1e12);
                g_be->ops->free(g_be, q);
                g_be->ops->free(g_be, kv);
                g_be->ops->free(g_be, out);
            }
    free(host);
}

/* ------------------------------------------------------------------ checks */
static bool all_finite(const float *v, size_t n, size_t *bad) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i])) { if (bad) *bad = i; return false; }
    return true;
}

static void checks(kd_seq *s, const opts *o, int ctx) {
    kd_model *m = S.m;
    int V = m->cfg.vocab;
    md("\n### Checks in the same run\n\n");
    /* decode steps feeding back the argmax */
    int n_dec = o->tiny ? 10 : 4;
    float *lg = xmalloc((size_t)17 * V * sizeof(float), "logits");
    set_ctx(s, ctx);
    int32_t tok = irand(V), ids[16];
    bool finite = true;
    for (int i = 0; i < n_dec; i++) {
        CK(kd_forward(s, &tok, 1, NULL, NULL));
        CK(kd_seq_logits(s, 0, 1, lg));
        size_t bad = 0;
        if (!all_finite(lg, (size_t)V, &bad)) {
            finite = false;
            md("- FAIL: decode step %d at position %d: logit %zu is %g\n", i, ctx + i, bad, (double)lg[bad]);
            break;
        }
        CK(kd_seq_argmax(s, &tok));
        ids[i] = tok;
    }
    if (finite) {
        md("- %d decode steps after %d random latent rows, argmax fed back: all %d logits finite in every step "
           "(ids", n_dec, ctx, V);
        for (int i = 0; i < n_dec; i++) md(" %d", ids[i]);
        md(")\n");
    } else g_fail++;
    /* a tree node's row == its path prefilled causally */
    step *st = xmalloc(sizeof *st, "step");
    make_step(st, ctx, 16, 7, V);
    run_step(s, st);
    CK(kd_seq_logits(s, 0, st->T, lg));
    size_t bad = 0;
    if (!all_finite(lg, (size_t)st->T * V, &bad)) {
        md("- FAIL: verify of 17 nodes at context %d: logit %zu (row %zu) is %g\n", ctx, bad % V, bad / V,
           (double)lg[bad]);
        g_fail++;
    }
    int deepest = 0, other = 1;
    for (int i = 0; i <= st->B; i++)
        if (st->depth[i] > st->depth[deepest]) deepest = i;
    do other = 1 + irand(st->B); while (other == deepest && st->B > 1);
    int nodes[3] = {0, deepest, other};
    float *ref = xmalloc((size_t)V * sizeof(float), "logits");
    for (int k = 0; k < 3; k++) {
        int node = nodes[k], d = st->depth[node];
        int32_t path[16];
        for (int j = node, at = d; j >= 0; j = st->parent[j], at--) path[at] = st->tok[j];
        set_ctx(s, ctx);
        CK(kd_forward(s, path, d + 1, NULL, NULL));
        CK(kd_seq_logits(s, d, 1, ref));
        double maxd = 0, maxr = 0;
        bool same = true;
        for (int j = 0; j < V; j++) {
            float a = lg[(size_t)node * V + j], b = ref[j];
            if (memcmp(&a, &b, 4) != 0) same = false;
            double df = fabs((double)a - (double)b);
            if (!(df <= maxd)) maxd = df;   /* NaN sticks */
            if (fabs((double)b) > maxr) maxr = fabs((double)b);
        }
        double rel = maxr > 0 ? maxd / maxr : maxd;
        bool ok = same || (o->tol > 0 && rel <= o->tol);
        md("- %s: tree node %d (depth %d) of a 17-node verify vs its path prefilled causally at context %d: %s "
           "(max |diff| / max |logit| = %.3g)\n", ok ? "ok" : "FAIL", node, d, ctx,
           same ? "bit-identical" : "differs", rel);
        if (!ok) g_fail++;
    }
    free(ref);
    free(st->vis);
    free(st);
    free(lg);
    set_ctx(s, ctx);
}

/* ------------------------------------------------------------------ ceilings on the host */
static void cpu_ceilings(size_t bytes, double *copy_gbs, double *read_gbs) {
    char *a = xmalloc(bytes, "ceiling"), *b = xmalloc(bytes, "ceiling");
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double tc[5], tr[5];
    volatile uint64_t sink = 0;
    for (int r = 0; r < 5; r++) {
        uint64_t t0 = kd_time_ns();
        memcpy(b, a, bytes);
        uint64_t t1 = kd_time_ns();
        const uint64_t *p = (const uint64_t *)a;
        uint64_t acc = 0;
        for (size_t i = 0; i < bytes / 8; i++) acc ^= p[i];
        sink ^= acc;
        uint64_t t2 = kd_time_ns();
        tc[r] = (double)(t1 - t0) * 1e-9;
        tr[r] = (double)(t2 - t1) * 1e-9;
    }
    (void)sink;
    *copy_gbs = 2.0 * (double)bytes / median_of(tc, 5) / 1e9;
    *read_gbs = (double)bytes / median_of(tr, 5) / 1e9;
    free(a);
    free(b);
}

/* the slice's memory by component (kd_model_memory: what the engine holds on the backend),
 * with the driver's view of the device; printed while the timed sequences are still open */
static void memory_table(const kd_model *m, int n_seqs, int capacity) {
    kd_memory_report r;
    if (kd_model_memory(m, &r) != KD_OK) {
        md("\n(kd_model_memory failed: %s)\n", kd_last_error());
        return;
    }
    char hb[64], hb2[64];
    md("\n### Memory by component (kd_model_memory after the timed steps; %d sequence(s) of capacity %d open)\n\n"
       "| component | bytes | human |\n|---|---|---|\n", n_seqs, capacity);
    struct { const char *name; uint64_t v; } rows[] = {
        {"weights: attention", r.weights_attention}, {"weights: dense MLP", r.weights_dense_mlp},
        {"weights: shared experts", r.weights_shared_experts}, {"weights: routed experts", r.weights_routed_experts},
        {"weights: router", r.weights_router}, {"weights: embedding", r.weights_embed},
        {"weights: lm_head", r.weights_lm_head}, {"weights: norms", r.weights_norms},
        {"**weights**", r.weights_total}, {"KV cache", r.kv_cache}, {"activations (logits + forward scratch)", r.activations},
        {"workspace (backend scratch)", r.workspace}, {"other", r.other}, {"**total**", r.total}};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        md("| %s | %llu | %s |\n", rows[i].name, (unsigned long long)rows[i].v, human((double)rows[i].v, hb, sizeof hb));
    if (r.device_total)
        md("| device in use (driver: every process, CUDA context, libraries, graphs) | %llu | %s of %s |\n",
           (unsigned long long)(r.device_total - r.device_free), human((double)(r.device_total - r.device_free), hb,
           sizeof hb), human((double)r.device_total, hb2, sizeof hb2));
    md("| step graphs held / captured / launched / fallbacks | %llu / %llu / %llu / %llu | |\n",
       (unsigned long long)r.graphs, (unsigned long long)r.graph_captures, (unsigned long long)r.graph_launches,
       (unsigned long long)r.graph_fallbacks);
}

/* a sequence with step graphs in `mode` (and the full 1024-row forward: a verify of 257 rows) */
static kd_seq *new_seq_mode(kd_model *m, int cap, kd_graphs_mode mode) {
    kd_seq *s = NULL;
    const kd_seq_options so = { .graphs = mode };
    if (kd_seq_new_opts(m, cap, &so, &s) != KD_OK) die_st("kd_seq_new_opts", __LINE__);
    return s;
}
/* whether the backend runs step graphs (its optional graph ops: forward.h) */
static bool graphs_available(void) { return kd_graphs_resolve(g_be, KD_GRAPHS_CAPTURE) == KD_GRAPHS_CAPTURE; }

/* random latent rows [0, rows) in every layer of s's cache */
static void fill_cache(kd_seq *s, int rows) {
    const kd_config *c = &s->model->cfg;
    int cols = c->kv_lora_rank + c->qk_rope_dim;
    size_t n = (size_t)rows * cols, es = kd_dtype_size(g_be->act_dtype);
    void *h = xmalloc(n * es, "cache rows");
    if (g_be->act_dtype == KD_BF16) fill_bf16(h, n, -1.7f, 1.7f);
    else fill_f32(h, n, -1.7f, 1.7f);
    for (int l = 0; l < c->n_layers; l++) CK(g_real->upload(g_be, s->rk[0].cache[l].data, h, n * es));
    free(h);
}

/* ------------------------------------------------------------------ the TP-N projection */
/* The per-rank compute of TP-N is a model of rank-0 dims (heads, dense, shared and routed expert
 * widths and lm_head vocab / N; q_a, kv_a, norms, router and embedding whole) plus two all-reduces
 * of [T, hidden] a layer. Estimated 8-GPU all-reduce latencies for comparison (not measured):
 * shared/reference/multi_gpu.md, the upper ends of "1-8 tokens about 6-8 us, 16-64 tokens 9-17 us". */
static double ref_allreduce_us(int T) { return T <= 8 ? 8.0 : 17.0; }

#include "slice_draft.c"   /* the draft pass at the drafter's dims: draft_rows */

/* median ms of the timed steps of st on s (2 warm-up steps first: in graph mode an eager one and
 * the capture); *replayed: timed steps that called no backend op */
static double time_steps(kd_seq *s, const step *st, const opts *o, int *n_out, int *replayed) {
    double w0 = timed_step(s, st, NULL), w1 = timed_step(s, st, NULL);
    int n = n_steps_for(o, w0 < w1 ? w0 : w1);
    double *t = xmalloc((size_t)n * sizeof(double), "times");
    *replayed = 0;
    for (int i = 0; i < n; i++) {
        long calls = g_op_calls;
#ifdef KD_SLICE_EVENTS
        if (g_ncu && i == n - 1) CK(kd_slice_profiler(g_be, 1));
#endif
        t[i] = timed_step(s, st, NULL);
#ifdef KD_SLICE_EVENTS
        if (g_ncu && i == n - 1) CK(kd_slice_profiler(g_be, 0));
#endif
        if (g_op_calls == calls) (*replayed)++;
    }
    double ms = median_of(t, n);
    free(t);
    *n_out = n;
    return ms;
}

static void projection(const opts *o) {
    /* --tiny: the same program at the tiny model's dims (the CPU spec) */
    const dims *base = o->tiny ? &TINY : &K26;
    int tp = o->k26_rank, layers = o->layers ? o->layers : o->tiny ? TINY.layers : K26_LAYERS;
    int ctxs[] = {o->tiny ? 64 : 1024, o->tiny ? 300 : 8192}, buds[] = {0, 16, 64}, cap = ctxs[1] + 65 + 16;
    /* the plan of the whole model's rank first: refuse before building what will not fit */
    dims full = *base;
    full.layers = layers;
    kd_config fc;
    load_config(&full, &fc);
    kd_mem_usage u;
    g_be->ops->mem_usage(g_be, &u);
    kd_plan_report plan;
    kd_status pst = kd_plan_tp(&fc, tp, u.device_total, cap, &plan);
    kd_config_free(&fc);
    if (pst == KD_ERR_ARG) die_st("kd_plan_tp (the split of K2.6 dims)", __LINE__);
    md("\n### The plan (kd_plan_tp, before building)\n\n%s\n", pst == KD_OK ? plan.message : kd_last_error());
    if (pst != KD_OK) {
        fprintf(stderr, "model_slice_bench: %d layers of rank dims do not fit this device (--layers N)\n", layers);
        exit(2);
    }
    dims d = *base;
    char name[128];
    snprintf(name, sizeof name, "%s, rank 0 of TP-%d", base->name, tp);
    d.name = name;
    d.layers = layers;
    d.heads /= tp;
    d.inter /= tp;
    d.moe_inter /= tp;
    d.embed_vocab = d.vocab;
    d.vocab /= tp;
    printf("building %s: %d layers ...\n", name, layers);
    fflush(stdout);
    uint64_t tb = kd_time_ns();
    kd_model *m = build_model(&d);
    double build_s = (double)(kd_time_ns() - tb) * 1e-9;
    const kd_config *c = &m->cfg;
    kd_memory_report mr;
    CK(kd_model_memory(m, &mr));
    md("\n### %s: the model\n\n%d layers (%d dense, intermediate %d; %d MoE: %d experts top-%d INT4 group %d of width "
       "%d, %d shared), %d of %d heads, lm_head %d of %d vocab rows, embedding whole; random weights built on the "
       "device through the backend's weight_load in %.1f s (host buffers: one tensor at a time).\n\n", name,
       c->n_layers, c->first_k_dense, c->intermediate, c->n_layers - c->first_k_dense, c->n_experts,
       c->n_experts_per_tok, c->quant_group, c->moe_intermediate, c->n_shared_experts, c->n_heads, base->heads,
       c->vocab, d.embed_vocab, build_s);
    uint64_t planned = plan.weights_total;
    bool same = mr.weights_total == planned;
    md("- %s: weights built %llu bytes (kd_model_memory), the plan's rank %llu bytes\n",
       same ? "ok" : "FAIL", (unsigned long long)mr.weights_total, (unsigned long long)planned);
    if (!same) g_fail++;

    bool graphs = o->graphs && graphs_available();
    kd_seq *s = new_seq_mode(m, cap, graphs ? KD_GRAPHS_CAPTURE : KD_GRAPHS_OFF);
    fill_cache(s, ctxs[1]);
    checks(s, o, ctxs[0]);

    /* the all-reduces of the step: [T, hidden] bf16, NCCL on one rank, in a graph */
    double ar_us[3] = {0, 0, 0};   /* T = 1 + buds[i] */
    bool have_ar = false;
#ifdef KD_SLICE_EVENTS
    if (g_events) {
        int Ts[] = {1, 17, 65};
        have_ar = true;
        for (int i = 0; i < 3 && have_ar; i++)
            if (kd_slice_allreduce_us(g_be, Ts[i], c->hidden, 100, &ar_us[i]) != KD_OK) {
                md("- FAIL: the NCCL all-reduce of [%d, %d]: %s\n", Ts[i], c->hidden, kd_last_error());
                g_fail++;
                have_ar = false;
            }
    }
#endif
    printf("timing steps ...\n");
    fflush(stdout);
    md("\n### PROJECTION: %d GPUs in tensor parallel, from rank 0's compute on one GPU\n\n"
       "Not a measurement of %d GPUs. rank step = one `kd_forward` of the rank-dims model above (%s; median "
       "of n after 2 warm-up steps, %s); all-reduce = `ncclAllReduce` of [T, %d] bf16, sum, out of place, "
       "NCCL on **one** rank (nranks 1), 100 in one CUDA graph (median of 10 launches / 100): it measures the "
       "call inside a graph, not NVLink traffic. A step has %d all-reduces (2 a layer). Projected rate = 1 / (rank "
       "step + %d x all-reduce): tokens/s for decode, DDTree rounds/s for verify (x the tokens a round accepts; the "
       "draft pass and the round's host work are not included). The last column uses the upper end of "
       "multi_gpu.md's *estimated* 8-GPU latency (8 us up to 8 tokens, 17 us at 16-64) instead.\n\n",
       tp, tp, graphs ? "step graphs" : "step graphs off", g_events ? "CUDA events" : "host clock", c->hidden,
       2 * c->n_layers, 2 * c->n_layers);
    md("| step | ctx | T | rank step ms | n | replays | all-reduce us (1-rank NCCL) | %d x all-reduce ms | projected "
       "/s | projected /s with the 8-GPU estimate |\n|---|---|---|---|---|---|---|---|---|---|\n", 2 * c->n_layers);
    for (int ci = 0; ci < 2; ci++)
        for (int bi = 0; bi < 3; bi++) {
            step *st = xmalloc(sizeof *st, "step");
            make_step(st, ctxs[ci], buds[bi], 7, c->vocab);
            int n, replayed;
            double ms = time_steps(s, st, o, &n, &replayed);
            double ar = have_ar ? ar_us[bi] : 0, ars = 2.0 * c->n_layers * ar * 1e-3;
            double est = 2.0 * c->n_layers * ref_allreduce_us(st->T) * 1e-3;
            char label[32];
            if (buds[bi]) snprintf(label, sizeof label, "verify B=%d", buds[bi]);
            else snprintf(label, sizeof label, "decode");
            const char *unit = buds[bi] ? "rounds" : "tokens";
            char arc[32] = "-", arsc[32] = "-", pc[48] = "-";
            if (have_ar) {
                snprintf(arc, sizeof arc, "%.2f", ar);
                snprintf(arsc, sizeof arsc, "%.3f", ars);
                snprintf(pc, sizeof pc, "**%.1f %s/s**", 1e3 / (ms + ars), unit);
            }
            md("| %s | %d | %d | %.3f | %d | %d/%d | %s | %s | %s | %.1f %s/s |\n", label, st->ctx, st->T, ms, n,
               replayed, n, arc, arsc, pc, 1e3 / (ms + est), unit);
            free(st->vis);
            free(st);
        }
    /* where a rank step's time goes: one profiled step on a sequence whose ops run from the host */
    kd_seq *sp = new_seq_mode(m, ctxs[0] + 65 + 16, KD_GRAPHS_OFF);
    fill_cache(sp, ctxs[0]);
    md("\n### Where a rank step's time goes (one profiled step, graphs off: %s around every backend op, ms)\n\n"
       "An op is one backend call (a GEMM, a norm, the MoE, the attention: one or a few kernels each); the marks "
       "add their own cost to every op, so the profiled step is longer than the graphed one above.\n\n",
       g_events ? "CUDA events" : "host clock + sync");
    prof_header("step | ctx | ops", 3);
    for (int bi = 0; bi < 2; bi++) {
        step *st = xmalloc(sizeof *st, "step");
        make_step(st, ctxs[0], buds[bi], 7, c->vocab);
        run_step(sp, st);   /* the shapes' workspaces, before the marks */
        double cat[C_N] = {0}, total, ops;
        int calls;
        profile_step(sp, st, cat, &total, &ops, &calls);
        if (buds[bi]) md("| verify B=%d | %d | %d |", buds[bi], st->ctx, calls);
        else md("| decode | %d | %d |", st->ctx, calls);
        prof_row(cat, total, ops);
        free(st->vis);
        free(st);
    }
    kd_seq_free(sp);
    memory_table(m, 1, cap);
    if (mr.device_total) {
        CK(kd_model_memory(m, &mr));
        md("\nThe plan said %.3f GB for this rank (+ a %.2f GB margin); the driver reports %.3f GB in use.\n",
           (double)plan.total / 1e9, (double)plan.margin / 1e9, (double)(mr.device_total - mr.device_free) / 1e9);
    }
    kd_seq_free(s);
    if (o->draft) {   /* a rank's share of the drafter: its heads, KV heads and MLP part; its lm_head rows */
        const draft_dims *f = o->tiny ? &TINY_DRAFT : &K26_DRAFT;
        draft_dims rd = *f;
        char name[96];
        snprintf(name, sizeof name, "%s, rank dims of TP-%d", f->name, tp);
        rd.name = name;
        rd.heads /= tp;
        rd.kv_heads /= tp;
        rd.inter /= tp;
        if (f->heads % tp == 0 && f->kv_heads % tp == 0 && f->inter % tp == 0) draft_rows(o, m, &rd);
        else md("\n(the drafter's dims do not split over %d ranks: no draft rows)\n", tp);
    }
    free_model(m);
}

/* the slice bench: the slice's tables, the decode and verify rows, the profile, memory, MLA rows */
static void slice_run(const opts *o, const dims *d) {
    /* the model (built first: its config gives the MLA dims) */
    printf("building the slice (%s) on %s ...\n", d->name, g_real->name);
    fflush(stdout);
    uint64_t tb = kd_time_ns();
    kd_model *m = build_model(d);
    double build_s = (double)(kd_time_ns() - tb) * 1e-9;
    const kd_config *c = &m->cfg;
    uint64_t total = 0;
    for (int k = 0; k < B_N; k++) total += S.bytes[k];
    md("\n### The slice\n\n%s: hidden %d, %d heads, q_lora %d, kv_lora %d, rope %d, nope %d, v %d, vocab %d, "
       "%d layers (%d dense, intermediate %d; %d MoE: %d experts top-%d INT4 group %d, width %d, %d shared), "
       "YaRN factor %.0f; random weights built in memory through the backend's weight_load in %.1f s.\n\n",
       d->name, c->hidden, c->n_heads, c->q_lora_rank, c->kv_lora_rank, c->qk_rope_dim, c->qk_nope_dim,
       c->v_head_dim, c->vocab, c->n_layers, c->first_k_dense, c->intermediate, c->n_layers - c->first_k_dense,
       c->n_experts, c->n_experts_per_tok, c->quant_group, c->moe_intermediate, c->n_shared_experts,
       c->rope.factor, build_s);
    char hb[64];
    md("| weights | bytes |\n|---|---|\n");
    for (int k = 0; k < B_N; k++) md("| %s | %s |\n", bkind_name[k], human((double)S.bytes[k], hb, sizeof hb));
    md("| total resident | %s |\n", human((double)total, hb, sizeof hb));
    md("| one routed expert (gate + up + down) | %s |\n", human((double)S.expert_bytes, hb, sizeof hb));

    int ctx_k26[] = {1024, 8192, 32768}, ctx_tiny[] = {64, 300};
    int bud_k26[] = {16, 64, 256}, bud_tiny[] = {4, 16, 64};
    const int *ctxs = o->tiny ? ctx_tiny : ctx_k26, *buds = o->tiny ? bud_tiny : bud_k26;
    int nctx = o->tiny ? 2 : 3, nbud = 3, maxT = 1 + buds[nbud - 1];
    /* the measured sequence runs every op from the host (step graphs off: the profile and the
     * expert count wrap the ops); a second one in step-graph mode when the library has it */
    kd_seq *s = new_seq_mode(m, ctxs[nctx - 1] + maxT + 16, KD_GRAPHS_OFF);
    if (o->graphs && graphs_available()) g_seq_graph = new_seq_mode(m, ctxs[nctx - 1] + maxT + 16, KD_GRAPHS_CAPTURE);
    fill_cache(s, ctxs[nctx - 1]);
    if (g_seq_graph) fill_cache(g_seq_graph, ctxs[nctx - 1]);

    checks(s, o, o->tiny ? 40 : 1024);

    printf("timing steps ...\n");
    fflush(stdout);
    int nrows = nctx * (1 + nbud);
    row *rows = xcalloc((size_t)nrows, sizeof *rows, "rows");
    int k = 0;
    for (int ci = 0; ci < nctx; ci++) {
        bench_row(s, o, &rows[k++], ctxs[ci], 0);
        for (int bi = 0; bi < nbud; bi++) bench_row(s, o, &rows[k++], ctxs[ci], buds[bi]);
    }
    md("\n### Decode and verify steps against the weight-bytes roofline\n\n");
    md("One step = one `kd_forward` (T = 1 decode, or T = 1 + B tree verify with its ancestor mask) at `ctx` "
       "cached rows; %s; median of n steps after 2 warm-up steps. Bytes = every dense weight once + the "
       "distinct routed experts the step's routing picks (counted in the run) + T embedding rows + the latent "
       "KV of ctx + T rows in every layer; roofline = bytes / copy ceiling (%.0f GB/s).\n\n",
       g_events ? "CUDA events on the backend's stream around it" : "host clock between syncs", g_copy_gbs);
    if (g_seq_graph)
        md("\"graph\" columns: the same steps on a second sequence opened with graphs on (step graphs: "
           "first run eager, second captured, then replayed); replays = timed steps that called no backend op "
           "(launched from a captured graph).\n\n");
    md("| step | ctx | T | experts read (per MoE layer) | weights read | KV read | roofline ms | step ms (median) | "
       "min ms | host ms | of roofline | n | graph ms | graph of roofline | replays |\n"
       "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nrows; i++) {
        row *r = &rows[i];
        char ex[128] = "";
        size_t at = 0;
        for (int l = 0; l < c->n_layers && l < 64; l++)
            if (m->ranks[0].layers[l].is_moe)
                at += (size_t)snprintf(ex + at, sizeof ex - at, "%s%d", at ? "/" : "", r->distinct[l]);
        char name[32];
        if (r->B) snprintf(name, sizeof name, "verify B=%d", r->B);
        else snprintf(name, sizeof name, "decode");
        char wb[64], kb[64];
        char gcols[96] = " - | - | - |";
        if (r->g_n)
            snprintf(gcols, sizeof gcols, " %.3f | %.0f%% | %d/%d |", r->g_ms, 100.0 * r->roof_ms / r->g_ms,
                     r->g_replayed, r->g_n);
        md("| %s | %d | %d | %s | %s | %s | %.3f | **%.3f** | %.3f | %.3f | %.0f%% | %d |%s\n", name, r->ctx, r->T, ex,
           human(r->w_bytes, wb, sizeof wb), human(r->kv_bytes, kb, sizeof kb), r->roof_ms, r->ms, r->ms_min,
           r->host_ms, 100.0 * r->roof_ms / r->ms, r->n, gcols);
    }
    md("\n### Where a step's time goes (one profiled step per row: %s around every backend op, ms)\n\n",
       g_events ? "CUDA events" : "host clock + sync");
    prof_header("step | ctx", 2);
    for (int i = 0; i < nrows; i++) {
        row *r = &rows[i];
        if (r->B) md("| verify B=%d | %d |", r->B, r->ctx);
        else md("| decode | %d |", r->ctx);
        prof_row(r->cat_ms, r->prof_total, r->prof_ops);
    }
    free(rows);
    memory_table(m, g_seq_graph ? 2 : 1, ctxs[nctx - 1] + maxT + 16);
    kd_seq_free(s);
    if (g_seq_graph) kd_seq_free(g_seq_graph);
    if (o->draft) draft_rows(o, m, o->tiny ? &TINY_DRAFT : &K26_DRAFT);

    if (o->mla) mla_rows(o, c);
    free_model(m);
}

/* ------------------------------------------------------------------ main */
static void usage(void) {
    printf("usage: model_slice_bench [--backend cuda|cpu] [--tiny] [--md FILE] [--quick] [--steps N]\n"
           "                         [--row-seconds S] [--no-mla] [--no-graphs] [--no-draft] [--tolerance X]\n"
           "                         [--shared-branch rows|on|off]\n"
           "       model_slice_bench --k26-rank N [--layers L] [--md FILE] [--quick] [--steps N] [--shared-branch rows|on|off] [--ncu]\n"
           "  --backend    cuda (default when the library has it) or cpu\n"
           "  --tiny       the shipped tiny model's dims instead of Kimi K2.6's (quick logic check)\n"
           "  --md FILE    also write the markdown tables to FILE\n"
           "  --quick      fewer timed steps (3..10 per row)\n"
           "  --steps N    exactly N timed steps per row\n"
           "  --row-seconds S  time budget per row that picks N (default 1)\n"
           "  --no-mla     skip the MLA attention rows\n"
           "  --no-graphs  skip the step-graph column (a sequence with graphs on)\n"
           "  --no-draft   skip the draft pass rows (a random drafter at the K2.6 drafter's dims: 6.5 GB\n"
           "               written to /tmp and loaded)\n"
           "  --tolerance X    accept a tree row within X (max |diff| / max |logit|) of its causal path\n"
           "                   (default 0: bit-identical, the engine's batch invariance)\n"
           "  --k26-rank N     the TP-N projection: all 61 layers of Kimi K2.6 at rank 0 of TP-N dims, decode and\n"
           "                   verify B = 16, 64 at ctx 1K, 8K (step graphs), NCCL all-reduce on one rank, and the\n"
           "                   projected N-GPU rate (about 78 GB of device memory at N = 8; CUDA, or --tiny)\n"
           "  --layers L       layers of the projection's model (default 61; the rate is for 61)\n"
           "  --shared-branch rows|on|off  the shared expert beside the router and routed experts in steps\n"
           "                   of up to 32 rows (the default), in every step, or in line in every step\n"
           "                   (kd_model_options.shared_expert_branch 0, 1, -1: an A/B of the branch)\n"
           "  --ncu            the last timed step of each projection row between cudaProfilerStart and\n"
           "                   Stop: `ncu --profile-from-start off` then profiles one step a row\n");
}

int main(int argc, char **argv) {
    opts o = {.cuda = true, .mla = true, .graphs = true, .draft = true, .row_s = 1.0};
    bool backend_given = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--backend") && v) { o.cuda = !strcmp(v, "cuda"); backend_given = true; i++;
            if (strcmp(v, "cuda") && strcmp(v, "cpu")) { usage(); return 2; } }
        else if (!strcmp(a, "--tiny")) o.tiny = true;
        else if (!strcmp(a, "--quick")) o.quick = true;
        else if (!strcmp(a, "--no-mla")) o.mla = false;
        else if (!strcmp(a, "--no-graphs")) o.graphs = false;
        else if (!strcmp(a, "--no-draft")) o.draft = false;
        else if (!strcmp(a, "--ncu")) g_ncu = true;
        else if (!strcmp(a, "--shared-branch") && v) {
            g_shared_branch = !strcmp(v, "on") ? 1 : !strcmp(v, "off") ? -1 : 0;
            if (strcmp(v, "on") && strcmp(v, "off") && strcmp(v, "rows")) { usage(); return 2; }
            i++;
        }
        else if (!strcmp(a, "--md") && v) { o.md = v; i++; }
        else if (!strcmp(a, "--steps") && v) { o.steps = atoi(v); i++; }
        else if (!strcmp(a, "--row-seconds") && v) { o.row_s = atof(v); i++; }
        else if (!strcmp(a, "--tolerance") && v) { o.tol = atof(v); i++; }
        else if (!strcmp(a, "--k26-rank") && v) { o.k26_rank = atoi(v); i++; }
        else if (!strcmp(a, "--layers") && v) { o.layers = atoi(v); i++; }
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else { fprintf(stderr, "model_slice_bench: unknown or incomplete argument '%s'\n", a); usage(); return 2; }
    }
    /* the CUDA backend, when the engine's objects have it (KD_WITH_CUDA: `make -s engine-flags`) */
#ifdef KD_WITH_CUDA
    (void)backend_given;   /* only a build without CUDA refuses --backend cuda */
#else
    if (o.cuda && backend_given) { fprintf(stderr, "FATAL: this libkdtree has no CUDA backend\n"); return 2; }
    o.cuda = false;
#endif
    if (o.k26_rank && !o.tiny && !o.cuda) {
        fprintf(stderr, "model_slice_bench: --k26-rank builds tens of GB of weights: it needs the CUDA backend "
                "(or --tiny)\n");
        return 2;
    }
#ifdef KD_WITH_CUDA
    if (o.cuda) CK(kd_backend_cuda_create(0, NULL, &g_be));
#endif
    if (!o.cuda) CK(kd_backend_cpu_create(&g_be));
    const dims *d = o.tiny ? &TINY : &K26;

    char date[32];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
    char dev[256] = "CPU (host)";
    int sms = 0, drv = 0, rt = 0;
    double mem = 0, l2 = 0;
#ifdef KD_SLICE_EVENTS
    if (o.cuda) {
        CK(kd_slice_ev_init(g_be, MAXMARK));
        g_events = true;
        CK(kd_slice_device(g_be, dev, sizeof dev, &sms, &mem, &l2, &drv, &rt));
        CK(kd_slice_ceilings(g_be, o.tiny ? ((size_t)256 << 20) : ((size_t)1 << 30), &g_copy_gbs, &g_read_gbs));
    }
#endif
    if (o.cuda && !g_events) snprintf(dev, sizeof dev, "CUDA device 0 (no events: host clock)");
    if (!g_events) cpu_ceilings(o.tiny ? ((size_t)64 << 20) : ((size_t)512 << 20), &g_copy_gbs, &g_read_gbs);
    wrap_backend();

    md("## %s (%s, %s)\n\n", o.k26_rank ? "TP projection, Kimi K2.6 rank dims on one GPU" : "Decode step, K2.6-dims slice",
       date, dev);
    if (sms) md("%s: %d SMs, %.0f GiB, L2 %.0f MB, driver %d.%d, runtime %d.%d; backend %s.\n\n", dev, sms, mem, l2,
                drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10, g_real->name);
    else md("Backend %s; %s.\n\n", g_real->name, g_events ? "CUDA events" : "host clock between syncs");
    md("| ceiling (measured in this run) | value |\n|---|---|\n");
    if (g_events)
        md("| cudaMemcpy device to device, 1 GiB, bytes read + written | **%.0f GB/s** |\n"
           "| read-only kernel, 1 GiB of 16-byte streaming loads | %.0f GB/s |\n", g_copy_gbs, g_read_gbs);
    else if (o.cuda)
        md("| (no CUDA events in this build: host memcpy as the ceiling) | %.1f GB/s |\n", g_copy_gbs);
    else
        md("| host memcpy, bytes read + written | **%.1f GB/s** |\n| host read loop | %.1f GB/s |\n", g_copy_gbs,
           g_read_gbs);

    if (o.k26_rank) projection(&o);
    else slice_run(&o, d);

    char run_args[64] = "";
    if (o.k26_rank) snprintf(run_args, sizeof run_args, " --k26-rank %d --layers %d", o.k26_rank, o.layers ? o.layers : K26_LAYERS);
    md("\nRun: `%s%s%s%s`. Checks failed: %d.\n", argv[0], o.tiny ? " --tiny" : "", o.cuda ? "" : " --backend cpu",
       run_args, g_fail);
    if (o.md) {
        FILE *f = fopen(o.md, "w");
        if (!f || fwrite(g_md, 1, g_md_len, f) != g_md_len || fclose(f) != 0) {
            fprintf(stderr, "FATAL: cannot write %s\n", o.md);
            return 2;
        }
        printf("(markdown written to %s)\n", o.md);
    }
#ifdef KD_SLICE_EVENTS
    if (g_events) kd_slice_ev_fini();
#endif
    g_be->ops = g_real;
    g_be->ops->destroy(g_be);
    free(g_md);
    if (g_fail) fprintf(stderr, "model_slice_bench: %d check(s) FAILED\n", g_fail);
    return g_fail ? 1 : 0;
}
