/* testing_graphs.c: the host emulation of step graphs (testing_graphs.h). */
#include "testing_graphs.h"
#include "kdtree_testing.h"
#include "model.h"
#include "error.h"
#include <stdlib.h>
#include <string.h>

enum { OP_COPY, OP_EMBED, OP_ADD, OP_SCALE_ADD, OP_SWIGLU, OP_RMSNORM, OP_ADD_RMSNORM, OP_ROPE, OP_LINEAR,
       OP_HEAD_MATMUL, OP_ATTENTION, OP_MOE, OP_STORE_AT, OP_ATTENTION_AT, OP_LOG_SOFTMAX, OP_MLA_ROPE_STORE,
       OP_LINEAR_PAIR, OP_LINEAR_SWIGLU };

/* one recorded op call: its arguments by value (pointers stay pointers, as in a CUDA graph) */
typedef struct rec {
    int op;
    kd_act a[4];
    const void *p[4];
    int i[7];
    float f;
    bool b;
} rec;

typedef struct emu_graph {
    rec *r;
    int n, cap;
} emu_graph;

static struct {
    kd_backend_ops ops;          /* the table the model's backend uses while emulated */
    const kd_backend_ops *orig;  /* the CPU backend's own */
    kd_backend *be;
    bool recording;
    const char *refused;         /* the first call the capture could not take */
    emu_graph *cur;
    uint64_t epoch, replayed;
    int refuse_next;             /* kd_testing_graphs_refuse */
} g;

static kd_status record(const rec *r) {
    emu_graph *gr = g.cur;
    if (gr->n == gr->cap) {
        int cap = gr->cap ? 2 * gr->cap : 256;
        rec *nr = realloc(gr->r, (size_t)cap * sizeof *nr);
        if (!nr) return kd_fail(KD_ERR_NOMEM, "emulated capture: out of host memory");
        gr->r = nr;
        gr->cap = cap;
    }
    gr->r[gr->n++] = *r;
    return KD_OK;
}

/* a call a CUDA capture refuses: the capture fails (as cudaStreamCaptureModeThreadLocal) */
static kd_status refuse(const char *what) {
    if (!g.refused) g.refused = what;
    return kd_fail(KD_ERR_BACKEND, "emulated capture: %s is not capturable", what);
}

static kd_status replay(kd_backend *be, const rec *r) {
    const kd_backend_ops *o = g.orig;
    switch (r->op) {
    case OP_COPY: return o->copy(be, r->a[0], r->a[1]);
    case OP_EMBED: return o->embed(be, r->p[0], r->p[1], r->a[0]);
    case OP_ADD: return o->add(be, r->a[0], r->a[1]);
    case OP_SCALE_ADD: return o->scale_add(be, r->a[0], r->a[1], r->f);
    case OP_SWIGLU: return o->swiglu(be, r->a[0], r->a[1], r->a[2]);
    case OP_RMSNORM: return o->rmsnorm(be, r->a[0], r->p[0], r->f, r->a[1]);
    case OP_ADD_RMSNORM: return o->add_rmsnorm(be, r->a[0], r->a[1], r->p[0], r->f, r->a[2]);
    case OP_ROPE: return o->rope(be, r->a[0], r->i[0], r->i[1], r->i[2], r->p[0], r->p[1]);
    case OP_LINEAR: return o->linear(be, r->a[0], r->p[0], r->a[1]);
    case OP_LINEAR_PAIR: return o->linear_pair(be, r->a[0], r->p[0], r->p[1], r->a[1]);
    case OP_LINEAR_SWIGLU: return o->linear_swiglu(be, r->a[0], r->p[0], r->p[1], r->a[1]);
    case OP_HEAD_MATMUL:
        return o->head_matmul(be, r->a[0], r->i[0], r->i[1], r->i[2], r->p[0], r->i[3], r->i[4], r->b, r->a[1], r->i[5],
                              r->i[6]);
    case OP_ATTENTION:
        return o->attention(be, r->a[0], r->i[0], r->i[1], r->a[1], r->a[2], r->i[2], r->i[3], r->b, r->p[0], r->i[4],
                            r->f, r->a[3]);
    case OP_MOE: return o->moe(be, r->a[0], r->p[0], r->a[1], r->a[2]);
    case OP_STORE_AT: return o->store_rows_at(be, r->a[0], r->p[0], r->a[1]);
    case OP_ATTENTION_AT:
        return o->attention_at(be, r->a[0], r->i[0], r->i[1], r->a[1], r->a[2], r->i[2], r->p[1], r->b, r->p[0],
                               r->i[4], r->f, r->a[3]);
    case OP_LOG_SOFTMAX: return o->log_softmax(be, r->a[0]);
    case OP_MLA_ROPE_STORE:
        return o->mla_rope_store(be, r->a[0], r->a[1], r->i[0], r->a[2], r->p[0], r->f, r->p[1], r->p[2], r->a[3],
                                 r->i[1], r->p[3]);
    }
    return kd_fail(KD_ERR_STATE, "emulated graph: unknown op %d", r->op);
}

/* record while capturing, else run */
static kd_status issue(kd_backend *be, const rec *r) { return g.recording ? record(r) : replay(be, r); }

static kd_status w_copy(kd_backend *be, kd_act d, kd_act s) {
    rec r = {.op = OP_COPY, .a = {d, s}};
    return issue(be, &r);
}
static kd_status w_embed(kd_backend *be, const kd_weight *t, const int32_t *ids, kd_act out) {
    rec r = {.op = OP_EMBED, .a = {out}, .p = {t, ids}};
    return issue(be, &r);
}
static kd_status w_add(kd_backend *be, kd_act x, kd_act y) {
    rec r = {.op = OP_ADD, .a = {x, y}};
    return issue(be, &r);
}
static kd_status w_scale_add(kd_backend *be, kd_act x, kd_act y, float s) {
    rec r = {.op = OP_SCALE_ADD, .a = {x, y}, .f = s};
    return issue(be, &r);
}
static kd_status w_swiglu(kd_backend *be, kd_act gt, kd_act up, kd_act out) {
    rec r = {.op = OP_SWIGLU, .a = {gt, up, out}};
    return issue(be, &r);
}
static kd_status w_rmsnorm(kd_backend *be, kd_act x, const kd_weight *w, float eps, kd_act out) {
    rec r = {.op = OP_RMSNORM, .a = {x, out}, .p = {w}, .f = eps};
    return issue(be, &r);
}
static kd_status w_add_rmsnorm(kd_backend *be, kd_act x, kd_act y, const kd_weight *w, float eps, kd_act out) {
    rec r = {.op = OP_ADD_RMSNORM, .a = {x, y, out}, .p = {w}, .f = eps};
    return issue(be, &r);
}
static kd_status w_rope(kd_backend *be, kd_act x, int nh, int hs, int off, const int32_t *pos, const kd_rope *rp) {
    rec r = {.op = OP_ROPE, .a = {x}, .i = {nh, hs, off}, .p = {pos, rp}};
    return issue(be, &r);
}
static kd_status w_linear(kd_backend *be, kd_act x, const kd_weight *w, kd_act out) {
    rec r = {.op = OP_LINEAR, .a = {x, out}, .p = {w}};
    return issue(be, &r);
}
static kd_status w_linear_pair(kd_backend *be, kd_act x, const kd_weight *w0, const kd_weight *w1, kd_act out) {
    rec r = {.op = OP_LINEAR_PAIR, .a = {x, out}, .p = {w0, w1}};
    return issue(be, &r);
}
static kd_status w_linear_swiglu(kd_backend *be, kd_act x, const kd_weight *gt, const kd_weight *up, kd_act out) {
    rec r = {.op = OP_LINEAR_SWIGLU, .a = {x, out}, .p = {gt, up}};
    return issue(be, &r);
}
static kd_status w_head_matmul(kd_backend *be, kd_act x, int nh, int xs, int k, const kd_weight *w, int ws, int wr0,
                               bool tr, kd_act out, int oc, int os) {
    rec r = {.op = OP_HEAD_MATMUL, .a = {x, out}, .i = {nh, xs, k, ws, wr0, oc, os}, .p = {w}, .b = tr};
    return issue(be, &r);
}
static kd_status w_attention(kd_backend *be, kd_act q, int nh, int hd, kd_act k, kd_act v, int nkv, int past,
                             bool causal, const uint64_t *vis, int window, float scale, kd_act out) {
    rec r = {.op = OP_ATTENTION, .a = {q, k, v, out}, .i = {nh, hd, nkv, past, window}, .p = {vis}, .b = causal,
             .f = scale};
    return issue(be, &r);
}
static kd_status w_moe(kd_backend *be, kd_act x, const kd_experts *e, kd_act shared, kd_act out) {
    rec r = {.op = OP_MOE, .a = {x, shared, out}, .p = {e}};
    return issue(be, &r);
}
static kd_status w_store_at(kd_backend *be, kd_act dst, const int32_t *d_len, kd_act src) {
    rec r = {.op = OP_STORE_AT, .a = {dst, src}, .p = {d_len}};
    return issue(be, &r);
}
static kd_status w_attention_at(kd_backend *be, kd_act q, int nh, int hd, kd_act k, kd_act v, int nkv,
                                const int32_t *d_len, bool causal, const uint64_t *vis, int window, float scale,
                                kd_act out) {
    rec r = {.op = OP_ATTENTION_AT, .a = {q, k, v, out}, .i = {nh, hd, nkv, 0, window}, .p = {vis, d_len},
             .b = causal, .f = scale};
    return issue(be, &r);
}
static kd_status w_mla_rope_store(kd_backend *be, kd_act q, kd_act qfull, int nh, kd_act kva, const kd_weight *w,
                                  float eps, const int32_t *pos, const kd_rope *rp, kd_act cache, int row0,
                                  const int32_t *d_len) {
    rec r = {.op = OP_MLA_ROPE_STORE, .a = {q, qfull, kva, cache}, .i = {nh, row0}, .p = {w, pos, rp, d_len},
             .f = eps};
    return issue(be, &r);
}

/* calls a capture refuses; pass through otherwise */
static kd_status w_alloc(kd_backend *be, size_t n, void **p) { return g.recording ? refuse("alloc") : g.orig->alloc(be, n, p); }
static void w_free(kd_backend *be, void *p) {
    if (g.recording) refuse("free");
    g.orig->free(be, p);
}
static kd_status w_upload(kd_backend *be, void *d, const void *s, size_t n) {
    return g.recording ? refuse("upload") : g.orig->upload(be, d, s, n);
}
static kd_status w_download(kd_backend *be, void *d, const void *s, size_t n) {
    return g.recording ? refuse("download") : g.orig->download(be, d, s, n);
}
static kd_status w_sync(kd_backend *be) { return g.recording ? refuse("sync") : g.orig->sync(be); }
/* every other op: refused inside a capture (so an op the capture does not record cannot run
 * eagerly unnoticed), passed through otherwise */
#define REFUSED_OP(name, params, args) \
    static kd_status refused_##name params { return g.recording ? refuse(#name) : g.orig->name args; }
KD_BACKEND_OPS(REFUSED_OP)
#undef REFUSED_OP
static kd_status w_log_softmax(kd_backend *be, kd_act x) {   /* the draft pass's last op (drafter.c) */
    rec r = {.op = OP_LOG_SOFTMAX, .a = {x}};
    return issue(be, &r);
}

/* ---- capture and replay ---- */
static kd_status w_graph_begin(kd_backend *be) {
    if (g.recording) return kd_fail(KD_ERR_STATE, "emulated graph_begin: a capture is already open");
    g.cur = calloc(1, sizeof *g.cur);
    if (!g.cur) return kd_fail(KD_ERR_NOMEM, "emulated graph_begin: out of host memory");
    g.recording = true;
    g.refused = NULL;
    if (g.refuse_next > 0) {
        g.refuse_next--;
        g.refused = "a call (kd_testing_graphs_refuse)";
    }
    return KD_OK;
}
static void graph_delete(emu_graph *gr) {
    if (!gr) return;
    free(gr->r);
    free(gr);
}
static kd_status w_graph_end(kd_backend *be, void **out) {
    *out = NULL;
    if (!g.recording) return kd_fail(KD_ERR_STATE, "emulated graph_end: no capture is open");
    g.recording = false;
    emu_graph *gr = g.cur;
    g.cur = NULL;
    if (g.refused) {
        graph_delete(gr);
        return kd_fail(KD_ERR_BACKEND, "emulated capture failed: %s was called during it", g.refused);
    }
    *out = gr;
    return KD_OK;
}
static kd_status w_graph_launch(kd_backend *be, void *graph) {
    if (g.recording) return kd_fail(KD_ERR_STATE, "emulated graph_launch: a capture is open");
    emu_graph *gr = graph;
    for (int i = 0; i < gr->n; i++) {
        kd_status st = replay(be, &gr->r[i]);
        if (st != KD_OK) return kd_fail_context(st, "emulated graph: op %d of %d", i, gr->n);
        g.replayed++;
    }
    return KD_OK;
}
static void w_graph_free(kd_backend *be, void *graph) { graph_delete(graph); }
static uint64_t w_graph_epoch(kd_backend *be) { return g.epoch; }

static void w_destroy(kd_backend *be) {
    const kd_backend_ops *orig = g.orig;
    be->ops = orig;
    graph_delete(g.cur);
    memset(&g, 0, sizeof g);
    orig->destroy(be);
}

kd_status kd_testing_emulate_graphs(kd_model *m) {
    if (!m || !m->be) return kd_fail(KD_ERR_ARG, "kd_testing_emulate_graphs: model is NULL");
    if (m->be->kind != KD_BACKEND_CPU)
        return kd_fail(KD_ERR_ARG, "kd_testing_emulate_graphs: the model must be on the CPU backend");
    if (g.be == m->be) return KD_OK;
    if (g.be) return kd_fail(KD_ERR_STATE, "kd_testing_emulate_graphs: another model is emulated (close it first)");
    if (kd_test_fault_active(m))   /* its table would be taken for the backend's own (kd_test_fault_active) */
        return kd_fail(KD_ERR_STATE, "kd_testing_emulate_graphs: a fault injection is on: emulate first, then inject");
    memset(&g, 0, sizeof g);
    g.orig = m->be->ops;
    g.be = m->be;
    g.ops = *g.orig;
    g.ops.destroy = w_destroy;
    g.ops.alloc = w_alloc;
    g.ops.free = w_free;
    g.ops.upload = w_upload;
    g.ops.download = w_download;
    g.ops.sync = w_sync;
#define REFUSED_ENTRY(name, params, args) g.ops.name = refused_##name;
    KD_BACKEND_OPS(REFUSED_ENTRY)
#undef REFUSED_ENTRY
    g.ops.copy = w_copy;
    g.ops.embed = w_embed;
    g.ops.add = w_add;
    g.ops.scale_add = w_scale_add;
    g.ops.swiglu = w_swiglu;
    g.ops.rmsnorm = w_rmsnorm;
    g.ops.add_rmsnorm = w_add_rmsnorm;
    g.ops.rope = w_rope;
    g.ops.linear = w_linear;
    g.ops.linear_pair = w_linear_pair;
    g.ops.linear_swiglu = w_linear_swiglu;
    g.ops.head_matmul = w_head_matmul;
    g.ops.attention = w_attention;
    g.ops.moe = w_moe;
    g.ops.log_softmax = w_log_softmax;
    g.ops.store_rows_at = w_store_at;
    g.ops.mla_rope_store = w_mla_rope_store;
    g.ops.attention_at = w_attention_at;
    g.ops.graph_begin = w_graph_begin;
    g.ops.graph_end = w_graph_end;
    g.ops.graph_launch = w_graph_launch;
    g.ops.graph_free = w_graph_free;
    g.ops.graph_epoch = w_graph_epoch;
    m->be->ops = &g.ops;
    return KD_OK;
}

void kd_testing_graphs_bump_epoch(kd_model *m) {
    if (m && g.be == m->be) g.epoch++;
}

uint64_t kd_testing_graphs_replayed_ops(void) { return g.replayed; }

void kd_testing_graphs_refuse(int n) { g.refuse_next = n > 0 ? n : 0; }
