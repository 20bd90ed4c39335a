/* comm_bench.c: checks and timings of the CUDA communicator (cuda/comm.cu), one host thread per rank.
 *
 * Checks (each prints "ok: ..." or "FAIL: ..."; the exit status is 1 when any failed):
 * - the loopback with N = 2, 4, 8 ranks sharing device 0: all-reduce of bf16 and f32 rows, each shape
 *   at three arrival orders (ranks delayed by different amounts), every rank's result bit-identical
 *   to a host fp32 left fold rank 0 + 1 + ... + N-1 of the same inputs rounded once to the dtype,
 *   as the kernel does; all-gather (word and byte paths); a shape mismatch fails on every rank and
 *   leaves the communicator usable; abort wakes a rank waiting at the barrier with KD_ERR_STATE,
 *   later calls fail the same way until reset, and the next round after reset is right; inside a
 *   graph capture the loopback refuses (KD_ERR_UNSUPPORTED) on every rank and works eagerly after;
 *   bad input (a missing device or backend, 9 ranks, a strided or i32 x, a bad rank) is refused
 *   with KD_ERR_ARG and a message naming it;
 * - NCCL with 1 rank on device 0: all-reduce (x unchanged: the sum over one rank) and all-gather;
 * - NCCL captured: one graph holding copy -> all-reduce -> all-gather on the rank's stream, replayed
 *   three times after new inputs were uploaded: the gathered output equals each new input;
 * - with 2+ GPUs, NCCL over min(8, GPUs) ranks: small-integer inputs (exact sums in any order) equal
 *   the host fold, random inputs bit-identical on every rank.
 * Timings (not with --check): the all-reduce of T = 1..256 rows of 7168 bf16, per call, eager and (NCCL)
 * replayed from a graph of 16 calls; a markdown table on stdout and in --md FILE.
 * Build and run: make bench-comm (links the library's objects, so hidden symbols do not matter). */
#include "comm.h"
#include "error.h"
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { MAX_RANKS = 8, HIDDEN = 7168, GRAPH_CALLS = 16 };

static int n_failed;
static FILE *md;

static void report(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(int ok, const char *fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    n_failed += !ok;
    printf("%s: %s\n", ok ? "ok" : "FAIL", line);
    if (md) fprintf(md, "- %s: %s\n", ok ? "ok" : "FAIL", line);
    fflush(stdout);
}

/* ---- host bf16 (round to nearest even, as __float2bfloat16 does for finite values) ---- */
static float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}
/* values over a wide range of exponents, so that the fp32 fold rounds differently from other orders */
static float rand_value(void) {
    float m = 1.0f + (float)(rng() % 1024) / 1024.0f;
    int e = (int)(rng() % 13) - 6;
    return (rng() & 1 ? -m : m) * (float)(1 << 6) / (float)(1 << (6 - e));
}

/* ---- a set of ranks: one backend each and the communicator over them ---- */
typedef struct group {
    int n;
    int devices[MAX_RANKS];
    kd_backend *be[MAX_RANKS];
    kd_comm *comm;
} group;

static void group_close(group *g) {
    if (g->comm) g->comm->ops->destroy(g->comm);
    for (int r = 0; r < g->n; r++)
        if (g->be[r]) g->be[r]->ops->destroy(g->be[r]);
    memset(g, 0, sizeof *g);
}

static kd_status group_open(group *g, int n, int distinct) {
    memset(g, 0, sizeof *g);
    g->n = n;
    for (int r = 0; r < n; r++) {
        g->devices[r] = distinct ? r : 0;
        kd_status st = kd_backend_cuda_create(g->devices[r], NULL, &g->be[r]);
        if (st != KD_OK) {
            group_close(g);
            return st;
        }
    }
    kd_status st = kd_comm_cuda_create(n, g->devices, g->be, &g->comm);
    if (st != KD_OK) group_close(g);
    return st;
}

/* ---- run one function on every rank, each on its own thread ---- */
typedef kd_status (*rank_fn)(group *g, int rank, void *ctx);
typedef struct rank_arg {
    group *g;
    int rank;
    rank_fn fn;
    void *ctx;
    kd_status st;
    char msg[512];
} rank_arg;

/* a rank that fails aborts the communicator, as the model's rank threads do, so that no other
 * rank waits for it forever */
static kd_status rank_failed(group *g, kd_status st) {
    if (st != KD_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kd_last_error());
        g->comm->ops->abort(g->comm);
        kd_fail(st, "%s", msg);
    }
    return st;
}

static void *rank_main(void *p) {
    rank_arg *a = p;
    a->st = rank_failed(a->g, a->fn(a->g, a->rank, a->ctx));
    snprintf(a->msg, sizeof a->msg, "%s", a->st == KD_OK ? "" : kd_last_error());
    return NULL;
}

/* returns the first failing rank's index, or -1; after a failure the communicator is reset (every
 * rank is idle again once joined) */
static int run_ranks(group *g, rank_fn fn, void *ctx, rank_arg *args) {
    pthread_t th[MAX_RANKS];
    for (int r = 0; r < g->n; r++) {
        args[r] = (rank_arg){.g = g, .rank = r, .fn = fn, .ctx = ctx};
        pthread_create(&th[r], NULL, rank_main, &args[r]);
    }
    int bad = -1;
    for (int r = 0; r < g->n; r++) {
        pthread_join(th[r], NULL);
        if (args[r].st != KD_OK && bad < 0) bad = r;
    }
    if (bad >= 0) g->comm->ops->reset(g->comm);
    return bad;
}

/* ---- all-reduce rounds ---- */
typedef struct reduce_ctx {
    void *buf[MAX_RANKS];
    int rows, cols;
    kd_dtype dt;
    int delay_us[MAX_RANKS];
} reduce_ctx;

static kd_act act_of(void *data, int rows, int cols, kd_dtype dt) {
    kd_act x = {data, rows, cols, cols, dt};
    return x;
}

static kd_status task_reduce(group *g, int r, void *p) {
    reduce_ctx *c = p;
    if (c->delay_us[r]) usleep((useconds_t)c->delay_us[r]);
    KD_TRY(g->comm->ops->all_reduce_sum(g->comm, r, g->be[r], act_of(c->buf[r], c->rows, c->cols, c->dt)));
    return g->be[r]->ops->sync(g->be[r]);
}

/* host inputs in[r][i] (as bf16 bits or f32), their fold, uploaded into c->buf; small_ints: exact sums */
typedef struct host_data {
    size_t n, es;
    unsigned char *in[MAX_RANKS];
    unsigned char *want, *got;
} host_data;

static void host_free(host_data *h) {
    for (int r = 0; r < MAX_RANKS; r++) free(h->in[r]);
    free(h->want);
    free(h->got);
    memset(h, 0, sizeof *h);
}

static void host_make(host_data *h, int n_ranks, size_t n, kd_dtype dt, int small_ints) {
    memset(h, 0, sizeof *h);
    h->n = n;
    h->es = dt == KD_BF16 ? 2 : 4;
    for (int r = 0; r < n_ranks; r++) {
        h->in[r] = malloc(n * h->es);
        for (size_t i = 0; i < n; i++) {
            float v = small_ints ? (float)((int)(rng() % 17) - 8) : rand_value();
            if (dt == KD_BF16) ((uint16_t *)h->in[r])[i] = f32_bf16(v);
            else ((float *)h->in[r])[i] = v;
        }
    }
    h->want = malloc(n * h->es);
    h->got = malloc(n * h->es);
    for (size_t i = 0; i < n; i++) {
        float acc = dt == KD_BF16 ? bf16_f32(((uint16_t *)h->in[0])[i]) : ((float *)h->in[0])[i];
        for (int r = 1; r < n_ranks; r++) acc += dt == KD_BF16 ? bf16_f32(((uint16_t *)h->in[r])[i]) : ((float *)h->in[r])[i];
        if (dt == KD_BF16) ((uint16_t *)h->want)[i] = f32_bf16(acc);
        else ((float *)h->want)[i] = acc;
    }
}

/* one all-reduce round on g; compares every rank with the fold (exact) or with rank 0 (same_only) */
static int reduce_round(group *g, reduce_ctx *c, host_data *h, int same_only, char *why, size_t why_len) {
    size_t bytes = h->n * h->es;
    for (int r = 0; r < g->n; r++)
        if (g->be[r]->ops->upload(g->be[r], c->buf[r], h->in[r], bytes) != KD_OK) {
            snprintf(why, why_len, "upload: %s", kd_last_error());
            return 0;
        }
    rank_arg args[MAX_RANKS];
    int bad = run_ranks(g, task_reduce, c, args);
    if (bad >= 0) {
        snprintf(why, why_len, "rank %d: %s", bad, args[bad].msg);
        return 0;
    }
    unsigned char *ref = same_only ? malloc(bytes) : h->want;
    for (int r = 0; r < g->n; r++) {
        if (g->be[r]->ops->download(g->be[r], r == 0 && same_only ? ref : h->got, c->buf[r], bytes) != KD_OK) {
            snprintf(why, why_len, "download: %s", kd_last_error());
            if (same_only) free(ref);
            return 0;
        }
        if (r == 0 && same_only) continue;
        for (size_t i = 0; i < h->n; i++)
            if (memcmp(h->got + i * h->es, ref + i * h->es, h->es)) {
                snprintf(why, why_len, "rank %d element %zu differs from %s", r, i, same_only ? "rank 0" : "the host fold");
                if (same_only) free(ref);
                return 0;
            }
    }
    if (same_only) free(ref);
    return 1;
}

static int alloc_bufs(group *g, void **buf, size_t bytes) {
    for (int r = 0; r < g->n; r++)
        if (g->be[r]->ops->alloc(g->be[r], bytes, &buf[r]) != KD_OK) return 0;
    return 1;
}
static void free_bufs(group *g, void **buf) {
    for (int r = 0; r < g->n; r++)
        if (buf[r]) g->be[r]->ops->free(g->be[r], buf[r]);
}

/* inputs of c's shape for g's ranks, their fold, and a buffer on each rank */
static int round_setup(group *g, reduce_ctx *c, host_data *h, int small_ints, char *why, size_t why_len) {
    host_make(h, g->n, (size_t)c->rows * c->cols, c->dt, small_ints);
    int ok = alloc_bufs(g, c->buf, h->n * h->es);
    if (!ok) snprintf(why, why_len, "alloc: %s", kd_last_error());
    return ok;
}
static void round_teardown(group *g, reduce_ctx *c, host_data *h) {
    free_bufs(g, c->buf);
    host_free(h);
}

/* ---- (a) the loopback ---- */
static void check_loopback_reduce(group *g) {
    static const struct { int rows, cols; kd_dtype dt; } shapes[] = {
        {1, HIDDEN, KD_BF16}, {3, HIDDEN, KD_BF16}, {64, HIDDEN, KD_BF16}, {5, 999, KD_BF16}, {3, HIDDEN, KD_F32}};
    const int n_shapes = (int)(sizeof shapes / sizeof shapes[0]);
    char why[600] = "", round_why[512] = "";
    int ok = 1;
    for (int s = 0; s < n_shapes && ok; s++) {
        reduce_ctx c = {.rows = shapes[s].rows, .cols = shapes[s].cols, .dt = shapes[s].dt};
        host_data h;
        ok = round_setup(g, &c, &h, 0, round_why, sizeof round_why);
        for (int order = 0; order < 3 && ok; order++) {   /* rank r waits ((r*5 + order*3) mod N) * 300 us */
            for (int r = 0; r < g->n; r++) c.delay_us[r] = ((r * 5 + order * 3) % g->n) * 300;
            ok = reduce_round(g, &c, &h, 0, round_why, sizeof round_why);
        }
        if (!ok) snprintf(why, sizeof why, ": %d x %d %s: %s", c.rows, c.cols, kd_dtype_name(c.dt), round_why);
        round_teardown(g, &c, &h);
    }
    report(ok, "loopback all-reduce, %d ranks on device 0: %d shapes (bf16 1/3/64 x 7168, 8 elements a thread; bf16 "
           "5 x 999 and f32 3 x 7168, one a thread) x 3 arrival orders, every rank bit-identical to the host fp32 fold%s",
           g->n, n_shapes, why);
}

typedef struct gather_ctx {
    void *src[MAX_RANKS], *dst[MAX_RANKS];
    size_t bytes;
} gather_ctx;

static kd_status task_gather(group *g, int r, void *p) {
    gather_ctx *c = p;
    KD_TRY(g->comm->ops->all_gather(g->comm, r, g->be[r], c->src[r], c->dst[r], c->bytes));
    return g->be[r]->ops->sync(g->be[r]);
}

/* every rank's dst equals the ranks' sources in rank order */
static int gather_round(group *g, size_t bytes, char *why, size_t why_len) {
    gather_ctx c = {.bytes = bytes};
    const size_t total = bytes * (size_t)g->n;
    unsigned char *want = malloc(total), *got = malloc(total);
    for (size_t i = 0; i < total; i++) want[i] = (unsigned char)rng();
    int ok = alloc_bufs(g, c.src, bytes) && alloc_bufs(g, c.dst, total);
    for (int r = 0; r < g->n && ok; r++) ok = g->be[r]->ops->upload(g->be[r], c.src[r], want + r * bytes, bytes) == KD_OK;
    if (!ok) snprintf(why, why_len, "setup: %s", kd_last_error());
    rank_arg args[MAX_RANKS];
    int bad = ok ? run_ranks(g, task_gather, &c, args) : -1;
    if (bad >= 0) {
        ok = 0;
        snprintf(why, why_len, "rank %d: %s", bad, args[bad].msg);
    }
    for (int r = 0; r < g->n && ok; r++) {
        ok = g->be[r]->ops->download(g->be[r], got, c.dst[r], total) == KD_OK && !memcmp(got, want, total);
        if (!ok) snprintf(why, why_len, "rank %d: the gathered bytes differ (%zu bytes a rank)", r, bytes);
    }
    free_bufs(g, c.src);
    free_bufs(g, c.dst);
    free(want);
    free(got);
    return ok;
}

static void check_gather(group *g, const char *what) {
    char why[600] = "";
    int ok = gather_round(g, (size_t)3 * HIDDEN * 2, why, sizeof why) && gather_round(g, 1001, why, sizeof why);
    report(ok, "%s all-gather, %d rank%s: 43008 bytes a rank (words) and 1001 (bytes), every rank's output the ranks' "
           "inputs in rank order%s%s", what, g->n, g->n == 1 ? "" : "s", ok ? "" : ": ", why);
}

/* ranks disagree on the shape: every rank fails with KD_ERR_ARG, and the next round is right */
static kd_status task_mismatch(group *g, int r, void *p) {
    reduce_ctx *c = p;
    return g->comm->ops->all_reduce_sum(g->comm, r, g->be[r], act_of(c->buf[r], r == g->n - 1 ? 1 : 2, c->cols, c->dt));
}

static void check_loopback_errors(group *g) {
    char why[600] = "";
    reduce_ctx c = {.rows = 2, .cols = HIDDEN, .dt = KD_BF16};
    host_data h;
    int ok = round_setup(g, &c, &h, 0, why, sizeof why);
    rank_arg args[MAX_RANKS];
    if (ok) {
        run_ranks(g, task_mismatch, &c, args);
        for (int r = 0; r < g->n; r++) ok = ok && args[r].st == KD_ERR_ARG && strstr(args[r].msg, "all-reduce: rank");
        if (!ok) snprintf(why, sizeof why, "rank 0 said %s: %s", kd_status_name(args[0].st), args[0].msg);
    }
    ok = ok && reduce_round(g, &c, &h, 0, why, sizeof why);
    report(ok, "loopback, %d ranks: ranks that disagree on the shape all fail with KD_ERR_ARG naming it, and the next "
           "all-reduce is right%s%s", g->n, ok ? "" : ": ", why);

    /* abort: rank 1 waits at the barrier for rank 0, which never comes */
    why[0] = 0;
    rank_arg a1 = {.g = g, .rank = 1, .fn = task_reduce, .ctx = &c};
    memset(c.delay_us, 0, sizeof c.delay_us);
    pthread_t th;
    pthread_create(&th, NULL, rank_main, &a1);
    usleep(100000);
    g->comm->ops->abort(g->comm);
    pthread_join(th, NULL);
    kd_status later = g->comm->ops->all_reduce_sum(g->comm, 0, g->be[0], act_of(c.buf[0], c.rows, c.cols, c.dt));
    ok = a1.st == KD_ERR_STATE && strstr(a1.msg, "another rank failed") && later == KD_ERR_STATE;
    if (!ok)
        snprintf(why, sizeof why, "the waiting rank got %s (%s), a call after abort %s", kd_status_name(a1.st), a1.msg,
                 kd_status_name(later));
    g->comm->ops->reset(g->comm);
    ok = ok && reduce_round(g, &c, &h, 0, why, sizeof why);
    report(ok, "loopback, %d ranks: abort wakes a rank waiting at the barrier with KD_ERR_STATE ('another rank failed'), "
           "a call after it fails the same way, and after reset the next all-reduce is right%s%s", g->n,
           ok ? "" : ": ", why);
    round_teardown(g, &c, &h);
}

/* inside a capture the loopback refuses on every rank (nothing enqueued), and works eagerly after */
static kd_status task_capture_refused(group *g, int r, void *p) {
    reduce_ctx *c = p;
    kd_backend *be = g->be[r];
    KD_TRY(be->ops->graph_begin(be));
    kd_status st = g->comm->ops->all_reduce_sum(g->comm, r, be, act_of(c->buf[r], c->rows, c->cols, c->dt));
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kd_last_error());
    void *graph = NULL;
    be->ops->graph_end(be, &graph);
    if (graph) be->ops->graph_free(be, graph);
    return st == KD_ERR_UNSUPPORTED && strstr(msg, "graph") ? KD_OK
                                                             : kd_fail(KD_ERR_STATE, "expected KD_ERR_UNSUPPORTED "
                                                                       "naming graphs, got %s: %s", kd_status_name(st), msg);
}

static void check_loopback_capture(group *g) {
    char why[600] = "";
    reduce_ctx c = {.rows = 1, .cols = HIDDEN, .dt = KD_BF16};
    host_data h;
    int ok = round_setup(g, &c, &h, 0, why, sizeof why);
    rank_arg args[MAX_RANKS];
    int bad = ok ? run_ranks(g, task_capture_refused, &c, args) : -1;
    if (bad >= 0) {
        ok = 0;
        snprintf(why, sizeof why, "rank %d: %s", bad, args[bad].msg);
    }
    ok = ok && reduce_round(g, &c, &h, 0, why, sizeof why);
    report(ok, "loopback, %d ranks: inside a graph capture every rank is refused with KD_ERR_UNSUPPORTED, and the next "
           "eager all-reduce is right%s%s", g->n, ok ? "" : ": ", why);
    round_teardown(g, &c, &h);
}

/* st is KD_ERR_ARG with a message holding `want`; else why says what came instead */
static int refused(kd_status st, const char *want, const char *what, char *why, size_t why_len) {
    if (st == KD_ERR_ARG && strstr(kd_last_error(), want)) return 1;
    snprintf(why, why_len, "%s: got %s: %s", what, kd_status_name(st), kd_last_error());
    return 0;
}

/* bad input: each refused with KD_ERR_ARG and a message naming what was wrong (g: the loopback) */
static void check_bad_input(group *g) {
    char why[600] = "";
    kd_comm *k = NULL;
    const int devs_bad[2] = {0, 99}, devs_one[2] = {0, 0};
    kd_backend *bes[2] = {g->be[0], g->be[0]}, *bes_missing[2] = {g->be[0], NULL};
    void *buf = NULL;
    int ok = g->be[0]->ops->alloc(g->be[0], 4 * HIDDEN * 2, &buf) == KD_OK;
    kd_act strided = {buf, 2, HIDDEN, 2 * HIDDEN, KD_BF16}, ints = {buf, 1, HIDDEN, HIDDEN, KD_I32};
    ok = ok && refused(kd_comm_cuda_create(2, devs_bad, bes, &k), "device 99 does not exist", "device 99", why,
                       sizeof why);
    ok = ok && refused(kd_comm_cuda_create(2, devs_one, bes_missing, &k), "rank 1: expected a CUDA backend on device 0",
                       "a missing backend", why, sizeof why);
    ok = ok && refused(kd_comm_cuda_create(9, devs_one, bes, &k), "9 ranks: expected 1..8", "9 ranks", why, sizeof why);
    ok = ok && refused(g->comm->ops->all_reduce_sum(g->comm, 0, g->be[0], strided), "expected contiguous rows",
                       "a strided x", why, sizeof why);
    ok = ok && refused(g->comm->ops->all_reduce_sum(g->comm, 0, g->be[0], ints), "dtype i32: expected f32, bf16 or f16",
                       "an i32 x", why, sizeof why);
    ok = ok && refused(g->comm->ops->all_reduce_sum(g->comm, g->n, g->be[0], act_of(buf, 1, HIDDEN, KD_BF16)),
                       "outside [0,", "a rank past the last", why, sizeof why);
    ok = ok && k == NULL;
    if (buf) g->be[0]->ops->free(g->be[0], buf);
    report(ok, "bad input refused with KD_ERR_ARG naming it: device 99, a missing backend, 9 ranks, a strided x, an i32 "
           "x, a rank past the last%s%s", ok ? "" : ": ", why);
}

/* ---- (b) NCCL ---- */
static void check_nccl_reduce(group *g) {
    char why[600] = "";
    int ok = 1;
    if (g->n == 1) {   /* the sum over one rank is x itself */
        static const kd_dtype dts[] = {KD_BF16, KD_F32};
        for (int k = 0; k < 2 && ok; k++) {
            reduce_ctx c = {.rows = 3, .cols = HIDDEN, .dt = dts[k]};
            host_data h;
            ok = round_setup(g, &c, &h, 0, why, sizeof why) && reduce_round(g, &c, &h, 0, why, sizeof why);
            round_teardown(g, &c, &h);
        }
        report(ok, "NCCL all-reduce, 1 rank on device 0: bf16 and f32 3 x 7168 come back unchanged%s%s", ok ? "" : ": ",
               why);
        return;
    }
    for (int k = 0; k < 2 && ok; k++) {   /* small integers: exact in any order; random: the same bits everywhere */
        reduce_ctx c = {.rows = 3, .cols = HIDDEN, .dt = KD_BF16};
        host_data h;
        ok = round_setup(g, &c, &h, k == 0, why, sizeof why) && reduce_round(g, &c, &h, k == 1, why, sizeof why);
        round_teardown(g, &c, &h);
    }
    report(ok, "NCCL all-reduce, %d ranks on devices 0..%d: small-integer bf16 sums equal the host fold, random bf16 "
           "sums bit-identical on every rank%s%s", g->n, g->n - 1, ok ? "" : ": ", why);
}

/* ---- (c) NCCL captured: copy -> all-reduce -> all-gather in one graph, replayed with new inputs ---- */
static void check_nccl_graph(group *g) {
    char why[600] = "";
    kd_backend *be = g->be[0];
    const int rows = 2;
    const size_t n = (size_t)rows * HIDDEN, bytes = n * 2;
    void *y = NULL, *x = NULL, *z = NULL, *graph = NULL;
    uint16_t *in = malloc(bytes), *out = malloc(bytes);
    int ok = be->ops->alloc(be, bytes, &y) == KD_OK && be->ops->alloc(be, bytes, &x) == KD_OK &&
             be->ops->alloc(be, bytes, &z) == KD_OK;
    kd_act ya = act_of(y, rows, HIDDEN, KD_BF16), xa = act_of(x, rows, HIDDEN, KD_BF16);
    ok = ok && be->ops->graph_begin(be) == KD_OK;
    if (ok) {
        kd_status st = be->ops->copy(be, xa, ya);
        if (st == KD_OK) st = g->comm->ops->all_reduce_sum(g->comm, 0, be, xa);
        if (st == KD_OK) st = g->comm->ops->all_gather(g->comm, 0, be, x, z, bytes);
        if (st != KD_OK) snprintf(why, sizeof why, "capture: %s", kd_last_error());
        kd_status end = be->ops->graph_end(be, &graph);
        if (end != KD_OK && st == KD_OK) snprintf(why, sizeof why, "graph_end: %s", kd_last_error());
        ok = st == KD_OK && end == KD_OK && graph;
    } else snprintf(why, sizeof why, "setup: %s", kd_last_error());
    for (int rep = 0; rep < 3 && ok; rep++) {
        for (size_t i = 0; i < n; i++) in[i] = f32_bf16(rand_value());
        ok = be->ops->upload(be, y, in, bytes) == KD_OK && be->ops->graph_launch(be, graph) == KD_OK &&
             be->ops->download(be, out, z, bytes) == KD_OK;
        if (!ok) snprintf(why, sizeof why, "replay %d: %s", rep, kd_last_error());
        else if (memcmp(in, out, bytes)) {
            ok = 0;
            snprintf(why, sizeof why, "replay %d: the gathered output is not the new input", rep);
        }
    }
    report(ok, "NCCL 1 rank in a CUDA graph: copy -> all-reduce -> all-gather captured on the rank's stream, 3 replays "
           "after new uploads, each output equal to its new input%s%s", ok ? "" : ": ", why);
    if (graph) be->ops->graph_free(be, graph);
    be->ops->free(be, y);
    be->ops->free(be, x);
    be->ops->free(be, z);
    free(in);
    free(out);
}

/* ---- (d) timings ---- */
typedef struct time_ctx {
    void *buf[MAX_RANKS];
    int rows, iters, graph;
    pthread_barrier_t bar;
    uint64_t t0[MAX_RANKS], t1[MAX_RANKS];
} time_ctx;

static kd_status task_time(group *g, int r, void *p) {
    time_ctx *c = p;
    kd_backend *be = g->be[r];
    kd_act x = act_of(c->buf[r], c->rows, HIDDEN, KD_BF16);   /* zeros: repeated sums stay finite */
    void *graph = NULL;
    kd_status st = KD_OK;
    for (int w = 0; w < 3 && st == KD_OK; w++) st = g->comm->ops->all_reduce_sum(g->comm, r, be, x);
    if (st == KD_OK && c->graph) {
        st = be->ops->graph_begin(be);
        for (int k = 0; k < GRAPH_CALLS && st == KD_OK; k++) st = g->comm->ops->all_reduce_sum(g->comm, r, be, x);
        kd_status end = st == KD_OK ? be->ops->graph_end(be, &graph) : KD_OK;
        if (st != KD_OK) {
            void *discard = NULL;
            be->ops->graph_end(be, &discard);
            if (discard) be->ops->graph_free(be, discard);
        }
        if (st == KD_OK) st = end;
        if (st == KD_OK) st = be->ops->graph_launch(be, graph);
    }
    if (st == KD_OK) st = be->ops->sync(be);
    st = rank_failed(g, st);         /* before the barrier: the others may wait in a collective for this rank */
    pthread_barrier_wait(&c->bar);   /* every rank reaches it, failed or not */
    c->t0[r] = kd_time_ns();
    if (c->graph)
        for (int i = 0; i < c->iters / GRAPH_CALLS && st == KD_OK; i++) st = be->ops->graph_launch(be, graph);
    else
        for (int i = 0; i < c->iters && st == KD_OK; i++) st = g->comm->ops->all_reduce_sum(g->comm, r, be, x);
    if (st == KD_OK) st = be->ops->sync(be);
    c->t1[r] = kd_time_ns();
    if (graph) be->ops->graph_free(be, graph);
    return st;
}

/* microseconds per all-reduce of rows x 7168 bf16, or a negative value when it failed */
static double time_reduce(group *g, int rows, int graph, int iters, char *why, size_t why_len) {
    time_ctx c = {.rows = rows, .iters = iters, .graph = graph};
    if (!alloc_bufs(g, c.buf, (size_t)rows * HIDDEN * 2)) {
        snprintf(why, why_len, "alloc: %s", kd_last_error());
        return -1;
    }
    pthread_barrier_init(&c.bar, NULL, (unsigned)g->n);
    rank_arg args[MAX_RANKS];
    int bad = run_ranks(g, task_time, &c, args);
    pthread_barrier_destroy(&c.bar);
    free_bufs(g, c.buf);
    if (bad >= 0) {
        snprintf(why, why_len, "rank %d: %s", bad, args[bad].msg);
        return -1;
    }
    uint64_t t0 = c.t0[0], t1 = c.t1[0];
    for (int r = 1; r < g->n; r++) {
        if (c.t0[r] < t0) t0 = c.t0[r];
        if (c.t1[r] > t1) t1 = c.t1[r];
    }
    const int calls = graph ? iters / GRAPH_CALLS * GRAPH_CALLS : iters;
    return (double)(t1 - t0) / 1e3 / calls;
}

static void timings(int n_gpus, int iters) {
    static const int rows[] = {1, 2, 4, 8, 16, 64, 256};
    enum { N_ROWS = 7, MAX_COLS = 6 };
    typedef struct { const char *name; int n, distinct, graph; } column;
    column cols[MAX_COLS] = {
        {"loopback 2", 2, 0, 0}, {"loopback 4", 4, 0, 0}, {"loopback 8", 8, 0, 0},
        {"NCCL 1 eager", 1, 1, 0}, {"NCCL 1 graph", 1, 1, 1}, {"", 0, 0, 0}};
    int n_cols = 5;
    char multi[32] = "";
    if (n_gpus > 1) {
        snprintf(multi, sizeof multi, "NCCL %d graph", n_gpus < MAX_RANKS ? n_gpus : MAX_RANKS);
        cols[n_cols++] = (column){multi, n_gpus < MAX_RANKS ? n_gpus : MAX_RANKS, 1, 1};
    }
    double us[N_ROWS][MAX_COLS];
    for (int k = 0; k < n_cols; k++) {
        group g;
        char why[600] = "";
        kd_status st = group_open(&g, cols[k].n, cols[k].distinct);
        for (int t = 0; t < N_ROWS; t++) us[t][k] = st == KD_OK ? time_reduce(&g, rows[t], cols[k].graph, iters, why, sizeof why) : -1;
        if (st != KD_OK || why[0]) report(0, "timing %s: %s", cols[k].name, st != KD_OK ? kd_last_error() : why);
        if (st == KD_OK) group_close(&g);
    }
    char line[512];
    int o = snprintf(line, sizeof line, "| T rows | bytes |");
    for (int k = 0; k < n_cols; k++) o += snprintf(line + o, sizeof line - (size_t)o, " %s (us) |", cols[k].name);
    printf("\n%s\n", line);
    if (md) fprintf(md, "\n%s\n", line);
    o = snprintf(line, sizeof line, "| ---: | ---: |");
    for (int k = 0; k < n_cols; k++) o += snprintf(line + o, sizeof line - (size_t)o, " ---: |");
    printf("%s\n", line);
    if (md) fprintf(md, "%s\n", line);
    for (int t = 0; t < N_ROWS; t++) {
        o = snprintf(line, sizeof line, "| %d | %d |", rows[t], rows[t] * HIDDEN * 2);
        for (int k = 0; k < n_cols; k++)
            o += us[t][k] < 0 ? snprintf(line + o, sizeof line - (size_t)o, " failed |")
                              : snprintf(line + o, sizeof line - (size_t)o, " %.1f |", us[t][k]);
        printf("%s\n", line);
        if (md) fprintf(md, "%s\n", line);
    }
}

int main(int argc, char **argv) {
    int check_only = 0, iters = 400;
    const char *md_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--check")) check_only = 1;
        else if (!strcmp(argv[i], "--md") && i + 1 < argc) md_path = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--check] [--md FILE] [--iters N]\n", argv[0]);
            return 2;
        }
    }
    if (md_path && !(md = fopen(md_path, "w"))) {
        fprintf(stderr, "cannot write %s\n", md_path);
        return 2;
    }
    int n_gpus = 0;
    for (int d = 0; d < 16; d++) {   /* devices that open (kd_backend_cuda_create checks the count) */
        kd_backend *be = NULL;
        if (kd_backend_cuda_create(d, NULL, &be) != KD_OK) break;
        be->ops->destroy(be);
        n_gpus++;
    }
    if (md) fprintf(md, "## CUDA communicator (scripts/bench/comm_bench.c), %d GPU%s\n\n", n_gpus, n_gpus == 1 ? "" : "s");
    if (!n_gpus) {
        report(0, "no CUDA device: %s", kd_last_error());
        return 1;
    }
    static const int loop_ns[] = {2, 4, 8};
    for (int k = 0; k < 3; k++) {
        group g;
        if (group_open(&g, loop_ns[k], 0) != KD_OK) {
            report(0, "loopback with %d ranks: %s", loop_ns[k], kd_last_error());
            continue;
        }
        check_loopback_reduce(&g);
        check_gather(&g, "loopback");
        check_loopback_errors(&g);
        check_loopback_capture(&g);
        if (loop_ns[k] == 2) check_bad_input(&g);
        group_close(&g);
    }
    group g;
    if (group_open(&g, 1, 1) != KD_OK) report(0, "NCCL with 1 rank: %s", kd_last_error());
    else {
        check_nccl_reduce(&g);
        check_gather(&g, "NCCL");
        check_nccl_graph(&g);
        group_close(&g);
    }
    if (n_gpus > 1) {
        const int n = n_gpus < MAX_RANKS ? n_gpus : MAX_RANKS;
        if (group_open(&g, n, 1) != KD_OK) report(0, "NCCL with %d ranks: %s", n, kd_last_error());
        else {
            check_nccl_reduce(&g);
            check_gather(&g, "NCCL");
            group_close(&g);
        }
    }
    if (!check_only) timings(n_gpus, iters);
    printf("\nChecks failed: %d.\n", n_failed);
    if (md) {
        fprintf(md, "\nChecks failed: %d.\n", n_failed);
        fclose(md);
    }
    return n_failed ? 1 : 0;
}
