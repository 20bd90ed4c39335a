/* model.c: the target forward of DeepSeek-V3 / Kimi K2.x, written once against the
 * backend ops (backend.h). One call runs T new tokens on top of a sequence's latent
 * KV cache: prefill (T large, causal), decode (T = 1) and tree verification (T tree
 * tokens with an explicit ancestor-only visibility mask).
 *
 * Per layer (pre-norm residual; MLA in the absorbed form of DeepSeek's reference):
 *   h    = rmsnorm(x; input_layernorm)
 *   q    = q_lora ? q_b(rmsnorm(q_a(h); q_a_layernorm)) : q_proj(h)      [T, H*(dn+dr)]
 *   kva  = kv_a(h)                                                         [T, r+dr]
 *   cache[len+t] = [ rmsnorm(kva[:, :r]; kv_a_layernorm) | rope(kva[:, r:]) ]
 *   q_pe = rope(q[h][dn:])                      (interleaved pairs, YaRN inv_freq)
 *   q_lat[h] = q_nope[h] @ W_UK[h]               W_UK[h] = kv_b rows h*(dn+dv) + [0, dn)
 *   o_lat = MQA attention of [q_lat | q_pe] per head over cache rows [0, len+T):
 *           key = the whole row (r+dr), value = its c_kv part (r), scale = softmax_scale
 *   o[h] = o_lat[h] @ W_UV[h]^T                  W_UV[h] = kv_b rows h*(dn+dv) + dn + [0, dv)
 *   x   += o_proj(o)
 *   h    = rmsnorm(x; post_attention_layernorm)
 *   x   += dense ? mlp(h) : moe(h) + shared_mlp(h)
 * then logits = lm_head(rmsnorm(x; norm)). mlp(h) = down(silu(gate h) * up h). Each residual
 * add and the norm after it are one backend op (add_rmsnorm).
 * After layer l, when a drafter is attached and l is one of its taps, x (the residual
 * stream, HF hidden_states[l+1]) is copied into the rank's taps (s->rk[r].taps) for the drafter.
 *
 * A causal forward longer than the sequence's out_cap rows runs in chunks (each
 * commits before the next); only the last chunk computes logits, so the output rows
 * are the last min(T, out_cap) tokens. A masked forward must fit in one chunk.
 *
 * Tensor parallel (model.h: kd_rank): this forward runs on every rank, each on its own thread
 * (kd_ranks_run), over its slice of the weights: its heads of q_b / kv_b (the absorbed attention
 * of those heads), its input columns of o_proj, its part of every intermediate dim. o_proj and
 * the down projections then hold partial sums, and the two all-reduces per layer (after o_proj;
 * after the MLP or MoE, routed + shared summed locally first) complete them before the residual
 * add. Every rank then holds the same residual bits (comm.h), so the replicated parts (norms,
 * q_a / kv_a, the router, the latent cache rows) compute the same values everywhere. The
 * lm_head gives each rank its vocabulary shard of the logits. Megatron's Column/RowParallel
 * pairing, as in DeepSeek's model.py. */
#include "forward.h"
#include "comm.h"
#include "drafter.h"
#include "graph_step.h"
#include "error.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ALIGN_UP(v) (((v) + 255u) & ~(size_t)255u)

void kd_fwd_plan_make(const kd_model *m, int rows, kd_fwd_plan *p) {
    kd_fwd_plan_of(&m->cfg, &m->split, kd_dtype_size(m->be->act_dtype), rows, p);
}

void kd_fwd_plan_of(const kd_config *c, const kd_widths *w, size_t a, int rows, kd_fwd_plan *p) {
    size_t off = 0, R = (size_t)rows;
    /* one rank's widths (the whole model's at tp = 1) */
    int H = w->heads, r = c->kv_lora_rank, dr = c->qk_rope_dim, dn = c->qk_nope_dim, dv = c->v_head_dim;
    int inter = w->intermediate;
    if (w->moe_intermediate * c->n_shared_experts > inter) inter = w->moe_intermediate * c->n_shared_experts;
    memset(p, 0, sizeof *p);
    p->rows = rows;
    p->words = (rows + 63) / 64;
#define REGION(field, nbytes) do { p->field = off; off = ALIGN_UP(off + (nbytes)); } while (0)
    REGION(dlen, 4);
    REGION(ids, R * 4);
    REGION(pos, R * 4);
    REGION(vis, R * (size_t)p->words * 8);
    REGION(idx, R * 4);
    REGION(x, R * c->hidden * a);
    REGION(h, R * c->hidden * a);
    /* the block outputs hold partial sums at tp > 1: kd_partial_dtype's rule, in bytes (rounding
     * every rank's part first moved a MoE router's near-tied choice on the H200: tiny-k2.6 at tp 2,
     * logits off by 0.37) */
    size_t part = w->tp > 1 && a < 4 ? 4 : a;
    REGION(t1, R * c->hidden * part);
    REGION(t2, R * c->hidden * part);
    REGION(qkva, R * (size_t)((c->q_lora_rank > 0 ? c->q_lora_rank : 0) + r + dr) * a);
    REGION(q, R * (size_t)H * (dn + dr) * a);
    REGION(qfull, R * (size_t)H * (r + dr) * a);
    REGION(lat, R * (size_t)H * r * a);
    REGION(o, R * (size_t)H * dv * a);
    REGION(mlp_act, R * (size_t)inter * a);
    REGION(tmp, R * (size_t)(r + dr) * (a > 4 ? a : 4));
#undef REGION
    p->bytes = off;
}

kd_act kd_fwd_act(void *scratch, size_t off, int rows, int cols, kd_dtype dt) {
    kd_act v = { (char *)scratch + off, rows, cols, cols, dt };
    return v;
}

/* what one rank's forward works on */
typedef struct rank_fwd {
    kd_seq *s;
    int r;                        /* the rank */
    const kd_rank *R;             /* its weights */
    kd_seq_rank *S;               /* its cache, logits shard and scratch */
    kd_backend *be;
    const kd_fwd_plan *p;
    int bound;                    /* device-length steps: the cache rows attention sees (step_bound) */
} rank_fwd;

static kd_act act(const rank_fwd *f, size_t off, int rows, int cols) {
    return kd_fwd_act(f->S->scratch, off, rows, cols, f->be->act_dtype);
}

/* the view of a block output at offset off (kd_partial_dtype: fp32 partial sums at tp > 1) */
static kd_act partial(const rank_fwd *f, size_t off, int rows) {
    const kd_model *m = f->s->model;
    return kd_fwd_act(f->S->scratch, off, rows, m->cfg.hidden, kd_partial_dtype(m->tp, f->be->act_dtype));
}

kd_status kd_add_reduced(const kd_model *m, int r, kd_backend *be, kd_act part, kd_act x, const kd_weight *norm,
                         float eps, kd_act h) {
    kd_comm *c = m->comm;
    if (c) KD_TRY(c->ops->all_reduce_sum(c, r, be, part));
    if (!norm) return be->ops->add(be, x, part);   /* add rounds its addend to x's dtype (backend.h) */
    return be->ops->add_rmsnorm(be, x, part, norm, eps, h);
}

kd_status kd_gather_columns(const kd_model *m, int r, kd_backend *be, kd_act part, void *all, const kd_act *dst) {
    size_t bytes = (size_t)part.rows * part.cols * kd_dtype_size(part.dtype);
    KD_TRY(m->comm->ops->all_gather(m->comm, r, be, part.data, all, bytes));
    for (int j = 0; dst && j < m->tp; j++) {
        kd_act src = {.data = (char *)all + (size_t)j * bytes, .rows = part.rows, .cols = part.cols, .ld = part.cols,
                      .dtype = part.dtype};
        KD_TRY(be->ops->copy(be, kd_act_cols(*dst, j * part.cols, part.cols), src));
    }
    return KD_OK;
}

/* add_reduced for this rank's forward: the next block's input h = rmsnorm(x; norm) */
static kd_status add_reduced(const rank_fwd *f, kd_act part, kd_act x, const kd_weight *norm, kd_act h) {
    const kd_model *m = f->s->model;
    return kd_add_reduced(m, f->r, f->be, part, x, norm, m->cfg.rms_norm_eps, h);
}

/* out = down(silu(gate x) * up x): this rank's part of the intermediate dim (a partial sum);
 * gate, up and the SwiGLU in one op (one launch on CUDA) */
static kd_status mlp(const rank_fwd *f, kd_act x, const kd_weight *gate, const kd_weight *up,
                     const kd_weight *down, kd_act out) {
    kd_backend *be = f->be;
    kd_act g = act(f, f->p->mlp_act, x.rows, (int)gate->rows);
    KD_TRY(be->ops->linear_swiglu(be, x, gate, up, g));
    return be->ops->linear(be, g, down, out);
}

/* MLA attention of layer l over this rank's heads: writes the layer's cache rows [len, len+T),
 * x += attn(h) (after the all-reduce of o_proj's partial sums) and h = rmsnorm(x; ffn_norm).
 * d_len NULL: len is the host's s->len; else the device int32 holding it (graph steps:
 * mla_rope_store puts the new latent rows at rows *d_len.., and attention reads the length on
 * the device; the same kernels on the same values, so the same bits). */
static kd_status attention_block(const rank_fwd *f, int l, kd_act h, kd_act x, const int32_t *pos,
                                 const uint64_t *vis, const int32_t *d_len) {
    const kd_fwd_plan *p = f->p;
    kd_backend *be = f->be;
    const kd_config *c = &f->s->model->cfg;
    const kd_layer *L = &f->R->layers[l];
    const kd_rope *rope = &f->R->rope;
    kd_act *cache = f->S->cache;
    int T = h.rows, H = f->s->model->split.heads, r = c->kv_lora_rank, dr = c->qk_rope_dim, dn = c->qk_nope_dim,
        dv = c->v_head_dim, len = f->s->len;

    /* queries, and the latent of the new tokens (c_kv = kv_a's first r columns, k_pe its last dr):
     * q_a and kv_a read h in one launch, side by side in qkva */
    int ql = c->q_lora_rank > 0 ? c->q_lora_rank : 0;
    kd_act q = act(f, p->q, T, H * (dn + dr));
    kd_act qkva = act(f, p->qkva, T, ql + r + dr), kva = kd_act_cols(qkva, ql, r + dr);
    if (ql > 0) {
        kd_act qa = kd_act_cols(qkva, 0, ql);
        KD_TRY(be->ops->linear_pair(be, h, &L->q_a, &L->kv_a, qkva));
        KD_TRY(be->ops->rmsnorm(be, qa, &L->q_a_norm, c->q_a_norm_eps, qa));
        KD_TRY(be->ops->linear(be, qa, &L->q_b, q));
    } else {
        KD_TRY(be->ops->linear(be, h, &L->q_proj, q));
        KD_TRY(be->ops->linear(be, h, &L->kv_a, kva));
    }

    /* the absorbed query per head, [q_nope W_UK | roped q_pe]; the new rows into the cache,
     * [rmsnorm(c_kv) | roped k_pe], at rows len.. (host length) or *d_len.. (graph steps) */
    kd_act qfull = act(f, p->qfull, T, H * (r + dr));
    KD_TRY(be->ops->head_matmul(be, q, H, dn + dr, dn, &L->kv_b, dn + dv, 0, false, qfull, r, r + dr));
    KD_TRY(be->ops->mla_rope_store(be, q, qfull, H, kva, &L->kv_a_norm, c->kv_a_norm_eps, pos, rope, cache[l],
                                   d_len ? 0 : len, d_len));

    /* one latent KV head (MQA) over the cache rows [0, len+T) */
    kd_act lat = act(f, p->lat, T, H * r);
    if (d_len) {
        kd_act kv = kd_act_rows(cache[l], 0, f->bound);   /* the kernels read len below it */
        KD_TRY(be->ops->attention_at(be, qfull, H, r + dr, kv, kd_act_cols(kv, 0, r), 1, d_len, vis == NULL, vis, 0,
                                     c->softmax_scale, lat));
    } else {
        kd_act kv = kd_act_rows(cache[l], 0, len + T);
        KD_TRY(be->ops->attention(be, qfull, H, r + dr, kv, kd_act_cols(kv, 0, r), 1, len, vis == NULL, vis, 0,
                                  c->softmax_scale, lat));
    }

    /* back to per-head values, output projection (this rank's heads: a partial sum), residual */
    kd_act o = act(f, p->o, T, H * dv);
    KD_TRY(be->ops->head_matmul(be, lat, H, r, r, &L->kv_b, dn + dv, dn, true, o, dv, dv));
    kd_act t1 = partial(f, p->t1, T);
    KD_TRY(be->ops->linear(be, o, &L->o_proj, t1));
    return add_reduced(f, t1, x, &L->ffn_norm, h);
}

/* The shared expert's branch by default up to this many rows: at the K2.6 rank dims of TP-8 (H100,
 * model_slice_bench --k26-rank 8) it took 7% off a decode step and 4% off a 17-row verify, and
 * added 3% to a 65-row one, whose routed GEMMs fill the GPU themselves */
#define SHARED_BRANCH_ROWS 32

/* x += mlp(h) (dense layer) or moe(h) + shared(h), each rank's partial sums all-reduced; then
 * h = rmsnorm(x; next) unless next is NULL. The shared expert is issued first, on a branch where
 * the backend has one and the option shared_expert_branch asks for it (backend.h: branch_begin: on
 * CUDA it then runs beside the router and the routed experts, whose combine waits for it): the
 * routed experts' sum adds its output (HF adds the two; one fp32 or bf16 addition, the same either
 * way round) */
static kd_status ffn_block(const rank_fwd *f, int l, kd_act h, kd_act x, const kd_weight *next) {
    kd_model *m = f->s->model;
    kd_backend *be = f->be;
    const kd_layer *L = &f->R->layers[l];
    int T = h.rows;
    kd_act t1 = partial(f, f->p->t1, T);
    if (!L->is_moe) {
        KD_TRY(mlp(f, h, &L->mlp_gate, &L->mlp_up, &L->mlp_down, t1));
    } else {
        kd_act shared = {0};
        if (m->cfg.n_shared_experts > 0) {
            shared = partial(f, f->p->t2, T);
            const int mode = m->opt.shared_expert_branch;
            const bool branch = be->ops->branch_begin && (mode == 1 || (mode == 0 && T <= SHARED_BRANCH_ROWS));
            if (branch) KD_TRY(be->ops->branch_begin(be));
            kd_status st = mlp(f, h, &L->mlp_gate, &L->mlp_up, &L->mlp_down, shared);
            if (branch) {
                const kd_status end = be->ops->branch_end(be);
                if (st == KD_OK) st = end;
            }
            KD_TRY(st);
        }
        KD_TRY(be->ops->moe(be, h, &L->experts, shared, t1));
    }
    return add_reduced(f, t1, x, next, h);
}

/* keep x (the output of layer l) for the drafter when l is one of its taps (each rank for its
 * part of the drafter: x is the same on every rank) */
static kd_status keep_taps(const rank_fwd *f, int l, kd_act x) {
    kd_seq *s = f->s;
    if (!s->drafter || !f->S->taps.data) return KD_OK;
    const int *taps = NULL;
    int n = kd_drafter_taps(s->drafter, &taps), D = s->model->cfg.hidden;
    for (int j = 0; j < n; j++)
        if (taps[j] == l) {
            kd_act dst = kd_act_cols(kd_act_rows(f->S->taps, 0, x.rows), j * D, D);
            KD_TRY(f->be->ops->copy(f->be, dst, x));
        }
    return KD_OK;
}

/* the layers and the head over T tokens whose ids, positions and visibility are already in
 * the rank's scratch (d_ids, d_pos, d_vis); d_len: see attention_block */
static kd_status forward_body(const rank_fwd *f, int T, const int32_t *d_ids, const int32_t *d_pos,
                              const uint64_t *d_vis, const int32_t *d_len, bool want_logits) {
    kd_backend *be = f->be;
    const kd_config *c = &f->s->model->cfg;
    kd_act x = act(f, f->p->x, T, c->hidden);
    kd_act h = act(f, f->p->h, T, c->hidden);
    KD_TRY(be->ops->embed(be, &f->R->embed, d_ids, x));
    /* each block's residual add computes the next block's normed input with it (add_rmsnorm):
     * attention leaves h = ffn_norm(x), the FFN the next layer's attn_norm(x) or the final norm's */
    const kd_weight *final = want_logits ? &f->R->final_norm : NULL;
    KD_TRY(be->ops->rmsnorm(be, x, &f->R->layers[0].attn_norm, c->rms_norm_eps, h));   /* n_layers >= 1 (config.c) */
    for (int l = 0; l < c->n_layers; l++) {
        const kd_weight *next = l + 1 < c->n_layers ? &f->R->layers[l + 1].attn_norm : final;
        kd_status st = attention_block(f, l, h, x, d_pos, d_vis, d_len);
        if (st == KD_OK) st = ffn_block(f, l, h, x, next);
        if (st == KD_OK) st = keep_taps(f, l, x);
        if (st != KD_OK) return kd_fail_context(st, "forward: layer %d", l);
    }
    if (!want_logits) return KD_OK;
    /* h = final_norm(x): logits are fp32 on every backend (linear writes out.dtype); this rank's
     * vocabulary shard */
    return be->ops->linear(be, h, &f->R->lm_head, kd_act_rows(f->S->logits, 0, T));
}

/* ---- step graphs ----
 * A decode step (causal, T = 1) or a verify step (masked, T rows) of a sequence in graph
 * mode runs on the device-length path: its inputs (len, ids, positions, visibility) sit at
 * fixed scratch addresses and go up in one copy; every kernel argument is then the same at
 * every length, so the step can be captured once per shape and replayed. The first use of
 * a shape runs eagerly (it sizes the backend's workspaces, which must not grow inside a
 * capture), the second captures and launches, later ones launch. A graph is dropped and
 * recaptured when the backend reallocated a workspace (epoch) or the drafter's tap buffer
 * changed; a shape whose capture fails twice stays eager (still on the device-length path). */
enum { KD_GRAPH_SLOTS = 8 };

/* A device-length step's attention sees the cache through a view of step_bound rows: the least
 * power-of-two multiple of BOUND_ROWS at or above len + T, the capacity at most. The backend sizes
 * the attention's grid from that bound and picks its kernel shape from it, so a step at 1K of an
 * 8K cache runs the shape a 1K context gets: bounded by the whole cache, a TP-8 rank's 17-row
 * verify at 1K ran the 64-row blocks chosen for 17 chunks (ncu, H100: 109 us a layer, 6 of its 51
 * blocks with keys to read). Graphs are keyed by the bound, so a sequence recaptures its step
 * shapes as it crosses one: log2(capacity / BOUND_ROWS) + 1 times at most. BOUND_ROWS is the CUDA
 * attention's chunk (mla_tc.cuh: TC_CHUNK). */
enum { BOUND_ROWS = 512 };
static int step_bound(const kd_seq *s, int T) {
    long long need = (long long)s->len + T, b = BOUND_ROWS;
    while (b < need) b *= 2;
    return b < s->capacity ? (int)b : s->capacity;
}

typedef struct kd_graph_entry {
    int T, bound;
    bool masked, used;
    const void *taps, *drafter;   /* what the captured step writes taps to */
    kd_graph_slot g;              /* the captured step (graph_step.h) */
    uint64_t stamp;               /* last use (LRU) */
} kd_graph_entry;

typedef struct kd_seq_graphs {
    kd_graphs_mode mode;
    kd_graph_entry e[KD_GRAPH_SLOTS];
    uint64_t clock;
    char *host;                   /* host image of the input span [dlen, vis + rows*words*8) */
    size_t host_bytes;
    bool verbose;
} kd_seq_graphs;

/* every backend has the device-length ops (store_rows_at, attention_at), so eager runs anywhere;
 * capture needs the graph ops */
kd_graphs_mode kd_graphs_resolve(const kd_backend *be, kd_graphs_mode asked) {
    const kd_backend_ops *o = be->ops;
    if (asked == KD_GRAPHS_EAGER) return asked;
    if (!o->graph_begin || !o->graph_end || !o->graph_launch || !o->graph_free || !o->graph_epoch)
        return KD_GRAPHS_OFF;
    return asked == KD_GRAPHS_DEFAULT ? KD_GRAPHS_CAPTURE : asked;
}

kd_status kd_seq_graphs_new(kd_seq *s, kd_graphs_mode mode) {
    s->graphs = NULL;
    kd_fwd_plan p;
    kd_fwd_plan_make(s->model, s->out_cap, &p);
    kd_seq_graphs *g = calloc(1, sizeof *g);
    size_t bytes = p.vis - p.dlen + (size_t)p.rows * p.words * sizeof(uint64_t);
    char *host = calloc(1, bytes);
    if (!g || !host) {
        free(g);
        free(host);
        return kd_fail(KD_ERR_NOMEM, "kd_seq_new: out of host memory for the step input staging (%zu bytes)", bytes);
    }
    g->mode = mode;
    g->host = host;
    g->host_bytes = bytes;
    g->verbose = s->model->opt.graphs_verbose != 0;
    s->graphs = g;
    return KD_OK;
}

static void graph_drop(kd_seq *s, kd_graph_entry *e) { kd_graph_slot_drop(s->model, &e->g); }

void kd_seq_graphs_free(kd_seq *s) {
    kd_seq_graphs *g = s->graphs;
    if (!g) return;
    for (int i = 0; i < KD_GRAPH_SLOTS; i++) graph_drop(s, &g->e[i]);
    free(g->host);
    free(g);
    s->graphs = NULL;
}

/* the entry of a step shape: found, or a fresh (or least recently used) slot */
static kd_graph_entry *graph_entry(kd_seq *s, int T, bool masked, int bound) {
    kd_seq_graphs *g = s->graphs;
    const void *taps = s->rk[0].taps.data, *drafter = s->drafter;
    kd_graph_entry *victim = NULL;
    for (int i = 0; i < KD_GRAPH_SLOTS; i++) {
        kd_graph_entry *e = &g->e[i];
        if (e->used && e->T == T && e->bound == bound && e->masked == masked && e->taps == taps && e->drafter == drafter)
            return e;
        if (!victim || (!e->used && victim->used) || (e->used == victim->used && e->stamp < victim->stamp)) victim = e;
    }
    graph_drop(s, victim);
    memset(victim, 0, sizeof *victim);
    victim->used = true;
    victim->T = T;
    victim->bound = bound;
    victim->masked = masked;
    victim->taps = taps;
    victim->drafter = drafter;
    return victim;
}

/* rank r's view of a sequence and its forward plan */
static rank_fwd rank_of(kd_seq *s, const kd_fwd_plan *p, int r) {
    rank_fwd f = {s, r, &s->model->ranks[r], &s->rk[r], s->model->ranks[r].be, p, s->capacity};
    return f;
}

/* forward_body with its arguments, as a kd_graph_body */
typedef struct step_body_ctx {
    const rank_fwd *f;
    int T;
    const int32_t *d_ids, *d_pos;
    const uint64_t *d_vis;
    const int32_t *d_len;
} step_body_ctx;

static kd_status step_body(void *ctx) {
    const step_body_ctx *c = ctx;
    return forward_body(c->f, c->T, c->d_ids, c->d_pos, c->d_vis, c->d_len, true);
}

/* one chunk as every rank runs it */
typedef struct chunk_job {
    kd_seq *s;
    const kd_fwd_plan *p;
    int T;
    size_t span;                  /* bytes of the host staging each rank uploads (0: none) */
    bool masked, step, want_logits;
} chunk_job;

/* rank r's part of a chunk: its inputs go up from the host staging, then the layers */
static kd_status chunk_rank(void *ctx, int r) {
    const chunk_job *j = ctx;
    kd_seq *s = j->s;
    kd_seq_graphs *g = s->graphs;
    const kd_fwd_plan *p = j->p;
    rank_fwd f = rank_of(s, p, r);
    if (j->step) f.bound = step_bound(s, j->T);
    char *base = (char *)f.S->scratch;
    const int32_t *d_len = j->step ? (const int32_t *)(base + p->dlen) : NULL, *d_ids = (const int32_t *)(base + p->ids);
    const int32_t *d_pos = (const int32_t *)(base + p->pos);
    const uint64_t *d_vis = j->masked ? (const uint64_t *)(base + p->vis) : NULL;
    if (j->span) KD_TRY(f.be->ops->upload(f.be, base + p->dlen, g->host, j->span));
    if (!j->step || g->mode != KD_GRAPHS_CAPTURE) return forward_body(&f, j->T, d_ids, d_pos, d_vis, d_len, j->want_logits);

    /* graph mode (one rank: kd_seq_new keeps graphs off at tp > 1) */
    kd_graph_entry *e = graph_entry(s, j->T, j->masked, f.bound);
    e->stamp = ++g->clock;
    step_body_ctx body = {&f, j->T, d_ids, d_pos, d_vis, d_len};
    char what[64];
    if (g->verbose)
        snprintf(what, sizeof what, "step (%d rows, %s, cache bound %d)", j->T, j->masked ? "masked" : "causal", f.bound);
    return kd_graph_run(s->model, &e->g, step_body, &body, g->verbose ? what : NULL);
}

/* one chunk of T <= out_cap tokens at cache rows [len, len+T); pos: host positions.
 * tokens NULL: ids, pos and vis are staged in rank 0's scratch already (kd_verify of a tree on
 * the backend, one rank only). The inputs go up in one copy per rank, laid out as in the
 * scratch: [dlen | ids | pos | vis]. */
static kd_status forward_chunk(kd_seq *s, const int32_t *tokens, int T, const int32_t *pos,
                               const uint64_t *visible, bool want_logits) {
    kd_model *m = s->model;
    kd_seq_graphs *g = s->graphs;
    kd_fwd_plan p;
    kd_fwd_plan_make(m, s->out_cap, &p);
    if (!tokens && m->tp > 1)
        return kd_fail(KD_ERR_STATE, "forward: inputs staged on one backend cannot feed %d ranks", m->tp);
    /* decode (causal, T = 1) and verify (masked) steps in graph mode read the length on the device */
    bool step = g->mode != KD_GRAPHS_OFF && want_logits && (visible || T == 1);
    size_t words = (size_t)(T + 63) / 64;
    size_t span = !tokens ? sizeof(int32_t) : p.vis - p.dlen + (visible ? (size_t)T * words * sizeof(uint64_t) : 0);
    if (span > g->host_bytes)
        return kd_fail(KD_ERR_STATE, "forward: a step of %d rows needs %zu staging bytes, the sequence has %zu", T, span,
                       g->host_bytes);
    if (tokens || step) {            /* (staged inputs on the host-length path: nothing to send) */
        int32_t len = s->len;
        memcpy(g->host, &len, sizeof len);
        if (tokens) {
            memcpy(g->host + (p.ids - p.dlen), tokens, sizeof(int32_t) * (size_t)T);
            memcpy(g->host + (p.pos - p.dlen), pos, sizeof(int32_t) * (size_t)T);
            if (visible) memcpy(g->host + (p.vis - p.dlen), visible, (size_t)T * words * sizeof(uint64_t));
        }
    } else span = 0;
    chunk_job job = {s, &p, T, span, visible != NULL, step, want_logits};
    return kd_ranks_run(m, chunk_rank, &job);
}

kd_status kd_model_forward(kd_seq *s, const int32_t *tokens, int n, const int32_t *positions,
                           const uint64_t *visible) {
    int len0 = s->len, cap = s->out_cap;
    kd_status st = KD_OK;
    s->out_rows = 0;
    s->pending = 0;
    if (visible) {
        /* tree verification: one chunk, rows left pending for compaction */
        if (n > cap)
            return kd_fail(KD_ERR_CAPACITY, "forward: a masked forward of %d tokens exceeds the %d rows per forward "
                           "of this sequence", n, cap);
        /* tokens NULL: staged on the backend (forward_chunk); the host then knows no positions (-1) */
        for (int i = 0; i < n; i++) s->out_positions[i] = positions ? positions[i] : tokens ? s->len + i : -1;
        st = forward_chunk(s, tokens, n, s->out_positions, visible, true);
        if (st != KD_OK) return st;
        s->out_rows = n;
        s->pending = n;
        return KD_OK;
    }
    /* causal: chunks of at most cap rows, the first one short, so the last holds the
     * final min(n, cap) tokens, whose logits are kept */
    int done = 0;
    while (done < n) {
        int T = n - done > cap ? ((n - done) % cap ? (n - done) % cap : cap) : n - done;
        for (int i = 0; i < T; i++) s->out_positions[i] = positions ? positions[done + i] : s->len + i;
        bool last = done + T == n;
        st = forward_chunk(s, tokens + done, T, s->out_positions, NULL, last);
        if (st != KD_OK) break;
        s->len += T;
        s->out_rows = T;                     /* the taps of these rows are valid (logits only when last) */
        if (s->drafter) {
            st = kd_draft_context_append(s, NULL, T);   /* rows 0..T-1 */
            if (st != KD_OK) { kd_fail_context(st, "forward: drafter context"); break; }
        }
        done += T;
    }
    if (st != KD_OK) {                       /* leave the sequence as it was */
        s->len = len0;
        s->out_rows = 0;
        if (s->drafter) kd_draft_context_truncate(s, len0);   /* sets no error: the failure's stays */
    }
    return st;
}

/* ---- memory by component ---- */

static bool in_files(const kd_st_set *set, const void *p) {
    for (int i = 0; i < set->n_files; i++) {
        const char *b = set->files[i].map;
        if (b && (const char *)p >= b && (const char *)p < b + set->files[i].size) return true;
    }
    return false;
}

/* of those, the bytes outside the mapped checkpoint (device copies, or CPU host copies) */
static uint64_t weight_allocated(const kd_model *m, const kd_weight *w) {
    uint64_t b = kd_weight_held(w);
    if (!b || m->be->kind != KD_BACKEND_CPU) return b;   /* (every rank's backend is of one kind) */
    uint64_t a = 0;
    if (w->src && !in_files(&m->files, w->src)) a += kd_weight_value_bytes(w);
    if (w->src_scale && !in_files(&m->files, w->src_scale)) a += kd_weight_scale_bytes(w);
    return a;
}

static void count_weight(const kd_model *m, const kd_weight *w, uint64_t *cat, uint64_t *allocated) {
    *cat += kd_weight_held(w);
    *allocated += weight_allocated(m, w);
}

kd_status kd_model_memory(const kd_model *m, kd_memory_report *out) { return kd_model_memory_rank(m, 0, out); }

/* One rank's device: its weights' walk, the per-sequence buffers every rank holds alike (the
 * replicated KV, its logits shard and scratch), and its backend's totals. The drafters, their
 * per-sequence state and the trees live on rank 0 (their share of another rank is 0). */
kd_status kd_model_memory_rank(const kd_model *m, int rank, kd_memory_report *out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_model_memory: out is NULL");
    memset(out, 0, sizeof *out);
    if (!m) return kd_fail(KD_ERR_ARG, "kd_model_memory: model is NULL");
    if (m->closing) return kd_fail(KD_ERR_STATE, "kd_model_memory: the model is closed");
    if (rank < 0 || rank >= m->tp)
        return kd_fail(KD_ERR_ARG, "kd_model_memory: rank %d: the model has ranks 0..%d", rank, m->tp - 1);
    const kd_config *c = &m->cfg;
    kd_memory_report *r = out;
    uint64_t alloc = 0, other = 0;
    kd_backend *be = m->ranks[rank].be;
    r->backend = (uint64_t)be->kind;
    const kd_rank *R = &m->ranks[rank];
    for (int l = 0; l < c->n_layers; l++) {
        const kd_layer *L = &R->layers[l];
        const kd_weight *attn[] = {&L->q_a, &L->q_a_norm, &L->q_b, &L->q_proj, &L->kv_a, &L->kv_a_norm, &L->kv_b,
                                   &L->o_proj};
        for (size_t i = 0; i < sizeof attn / sizeof attn[0]; i++) count_weight(m, attn[i], &r->weights_attention, &alloc);
        count_weight(m, &L->attn_norm, &r->weights_norms, &alloc);
        count_weight(m, &L->ffn_norm, &r->weights_norms, &alloc);
        uint64_t *mlp = L->is_moe ? &r->weights_shared_experts : &r->weights_dense_mlp;
        count_weight(m, &L->mlp_gate, mlp, &alloc);
        count_weight(m, &L->mlp_up, mlp, &alloc);
        count_weight(m, &L->mlp_down, mlp, &alloc);
        if (!L->is_moe) continue;
        count_weight(m, &L->router, &r->weights_router, &alloc);
        count_weight(m, &L->router_bias, &r->weights_router, &alloc);
        const kd_experts *e = &L->experts;
        for (int j = 0; j < e->n; j++) {
            if (e->gate) count_weight(m, &e->gate[j], &r->weights_routed_experts, &alloc);
            if (e->up) count_weight(m, &e->up[j], &r->weights_routed_experts, &alloc);
            if (e->down) count_weight(m, &e->down[j], &r->weights_routed_experts, &alloc);
        }
        if (e->bias) other += (uint64_t)e->n * sizeof(float);      /* the router's f32 bias buffer */
    }
    count_weight(m, &R->embed, &r->weights_embed, &alloc);
    count_weight(m, &R->final_norm, &r->weights_norms, &alloc);
    if (!c->tie_embeddings) {                    /* tied: a view of the embedding, counted once */
        count_weight(m, &R->lm_head, &r->weights_lm_head, &alloc);
    }
    if (R->rope_inv_freq) other += (uint64_t)(c->qk_rope_dim / 2) * sizeof(float);
    r->weights_total = r->weights_attention + r->weights_dense_mlp + r->weights_shared_experts +
                       r->weights_routed_experts + r->weights_router + r->weights_embed + r->weights_lm_head +
                       r->weights_norms;
    r->weights_allocated = alloc;
    r->kv_cache = m->mem_kv;
    r->activations = m->mem_act;
    r->trees = rank == 0 ? m->mem_trees : 0;
    r->other = other;
    if (be->ops->mem_usage) {
        /* the backend's totals: what this model's walk and its sequences do not account for
         * belongs to the drafters bound to it (their weights; their per-sequence buffers).
         * Both backends tally a loaded weight as the walk counts it (kd_weight_held). */
        kd_mem_usage u;
        memset(&u, 0, sizeof u);
        be->ops->mem_usage(be, &u);
        r->drafter_weights = u.weights > r->weights_total ? u.weights - r->weights_total : 0;
        uint64_t mine = r->kv_cache + r->activations + r->trees + other;
        r->drafter_cache = u.buffers > mine ? u.buffers - mine : 0;
        r->workspace = u.workspace;
        r->device_free = u.device_free;
        r->device_total = u.device_total;
    }
    r->total = r->weights_total + r->drafter_weights + r->kv_cache + r->activations + r->drafter_cache +
               r->trees + r->workspace + r->other;
    for (int i = 0; i < m->files.n_files; i++)
        if (m->files.files[i].map) r->mapped += m->files.files[i].size;
    r->n_seqs = (uint64_t)m->n_seqs;
    r->graphs = m->graphs_held;
    r->graph_captures = m->graph_captures;
    r->graph_launches = m->graph_launches;
    r->graph_fallbacks = m->graph_fallbacks;
    return KD_OK;
}
