/* seq.c: sequences: the latent KV cache, the outputs of the last forward, and the
 * calls that validate input before the forward (model.c) runs.
 *
 * Memory of a sequence (all allocated by kd_seq_new, nothing later), on each rank r (rk[r]):
 *   cache[l]      [capacity, kv_lora_rank + qk_rope_dim] act dtype, per layer (replicated:
 *                 every rank writes the same rows)
 *   logits        [out_cap, vocab/tp] fp32: the rank's vocabulary shard
 *   scratch       the forward's plan for out_cap rows (forward.h)
 * and once:
 *   out_positions out_cap int32 on the host
 *   graphs        the forward inputs' host staging, and step graphs in graph mode (model.c)
 * out_cap = min(capacity, 1024) rows per forward chunk (kd_seq_options.max_rows lowers it,
 * for tests of the chunked path and to bound the logits' memory). A longer causal forward runs in chunks; a masked
 * (tree) forward must fit in out_cap rows. */
#include "forward.h"
#include "drafter.h"
#include "comm.h"
#include "error.h"
#include "sample.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cache_cols(const kd_model *m) { return m->cfg.kv_lora_rank + m->cfg.qk_rope_dim; }

/* the backend bytes a sequence holds, by kind (kd_model_memory) */
static uint64_t seq_kv_bytes(const kd_seq *s) {
    const kd_model *m = s->model;
    return (uint64_t)m->cfg.n_layers * (uint64_t)s->capacity * (uint64_t)cache_cols(m) *
           kd_dtype_size(m->be->act_dtype);
}
static uint64_t seq_act_bytes(const kd_seq *s) {
    const kd_model *m = s->model;
    return (uint64_t)s->out_cap * (uint64_t)m->split.vocab * sizeof(float) + s->scratch_bytes +
           kd_gather_bytes(m->tp, s->out_cap, m->cfg.vocab);
}

static void seq_release(kd_seq *s) {
    kd_model *m = s->model;
    kd_seq_graphs_free(s);     /* before the buffers its graphs point at */
    for (int r = 0; s->rk && r < m->tp; r++) {
        kd_backend *be = m->ranks[r].be;
        kd_seq_rank *S = &s->rk[r];
        if (S->cache) {
            for (int l = 0; l < m->cfg.n_layers; l++)
                if (S->cache[l].data) be->ops->free(be, S->cache[l].data);
            free(S->cache);
        }
        if (S->logits.data) be->ops->free(be, S->logits.data);
        if (S->scratch) be->ops->free(be, S->scratch);
        if (S->gather) be->ops->free(be, S->gather);
    }
    free(s->rk);
    free(s->out_positions);
    free(s);
}

/* rank r's cache, logits shard, scratch and (tp > 1) the buffer of rows gathered whole */
static kd_status seq_rank_new(kd_seq *s, int r) {
    kd_model *m = s->model;
    kd_backend *be = m->ranks[r].be;
    const kd_config *c = &m->cfg;
    kd_seq_rank *S = &s->rk[r];
    size_t asz = kd_dtype_size(be->act_dtype);
    int V = m->split.vocab;
    S->cache = calloc((size_t)c->n_layers, sizeof *S->cache);
    if (!S->cache) return kd_fail(KD_ERR_NOMEM, "kd_seq_new: out of host memory");
    for (int l = 0; l < c->n_layers; l++) {
        kd_act *a = &S->cache[l];
        a->rows = s->capacity;
        a->cols = a->ld = cache_cols(m);
        a->dtype = be->act_dtype;
        kd_status st = be->ops->alloc(be, (size_t)s->capacity * a->cols * asz, &a->data);
        if (st != KD_OK) return kd_fail_context(st, "kd_seq_new: KV cache of layer %d (%d tokens)", l, s->capacity);
    }
    S->logits = (kd_act){ NULL, s->out_cap, V, V, KD_F32 };
    kd_status st = be->ops->alloc(be, (size_t)s->out_cap * V * sizeof(float), &S->logits.data);
    if (st != KD_OK) return kd_fail_context(st, "kd_seq_new: logits (%d rows x %d)", s->out_cap, V);
    st = be->ops->alloc(be, s->scratch_bytes, &S->scratch);
    if (st != KD_OK) return kd_fail_context(st, "kd_seq_new: forward scratch (%zu bytes)", s->scratch_bytes);
    uint64_t gather = kd_gather_bytes(m->tp, s->out_cap, c->vocab);
    if (gather) {
        st = be->ops->alloc(be, (size_t)gather, &S->gather);
        if (st != KD_OK) return kd_fail_context(st, "kd_seq_new: logits rows gathered whole (%llu bytes)",
                                                (unsigned long long)gather);
    }
    return KD_OK;
}

kd_status kd_seq_new(kd_model *m, int capacity, kd_seq **out) { return kd_seq_new_opts(m, capacity, NULL, out); }

kd_status kd_seq_new_opts(kd_model *m, int capacity, const kd_seq_options *opt, kd_seq **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_seq_new: out is NULL");
    *out = NULL;
    if (!m) return kd_fail(KD_ERR_ARG, "kd_seq_new: model is NULL");
    if (m->closing) return kd_fail(KD_ERR_STATE, "kd_seq_new: the model is closed");
    if (capacity <= 0) return kd_fail(KD_ERR_ARG, "kd_seq_new: capacity %d: expected a positive number of tokens", capacity);
    const kd_seq_options o = opt ? *opt : (kd_seq_options){ 0 };
    KD_TRY(kd_seq_options_check(&o));
    int out_cap = capacity < KD_SEQ_MAX_ROWS ? capacity : KD_SEQ_MAX_ROWS;
    if (o.max_rows > 0 && o.max_rows < out_cap) out_cap = o.max_rows;
    const kd_graphs_mode graphs = o.graphs ? o.graphs : m->opt.graphs;

    kd_seq *s = calloc(1, sizeof *s);
    if (!s) return kd_fail(KD_ERR_NOMEM, "kd_seq_new: out of host memory");
    s->model = m;
    s->capacity = capacity;
    s->out_cap = out_cap;
    s->phase = KD_PHASE_IDLE;
    kd_fwd_plan p;
    kd_fwd_plan_make(m, out_cap, &p);
    s->scratch_bytes = p.bytes;
    /* the draft pass's mode: this sequence's, else the model's, else as the steps' */
    s->draft_graphs = o.draft_graphs ? o.draft_graphs : m->opt.draft_graphs ? m->opt.draft_graphs : graphs;
    kd_status st = KD_OK;
    s->rk = calloc((size_t)m->tp, sizeof *s->rk);
    s->out_positions = calloc((size_t)out_cap, sizeof(int32_t));
    if (!s->rk || !s->out_positions) st = kd_fail(KD_ERR_NOMEM, "kd_seq_new: out of host memory");
    for (int r = 0; st == KD_OK && r < m->tp; r++) {
        st = seq_rank_new(s, r);
        if (st != KD_OK && m->tp > 1) kd_fail_context(st, "rank %d of %d", r, m->tp);
    }
    /* step graphs capture one backend's work: one rank only */
    if (st == KD_OK) st = kd_seq_graphs_new(s, m->tp > 1 ? KD_GRAPHS_OFF : kd_graphs_resolve(m->be, graphs));
    if (st != KD_OK) {
        seq_release(s);
        return st;
    }
    m->n_seqs++;
    m->mem_kv += seq_kv_bytes(s);
    m->mem_act += seq_act_bytes(s);
    *out = s;
    return KD_OK;
}

void kd_seq_free(kd_seq *s) {
    if (!s) return;
    kd_model *m = s->model;
    if (s->drafter || s->draft) kd_draft_state_free(s);
    uint64_t kv = seq_kv_bytes(s), act = seq_act_bytes(s);
    m->mem_kv = m->mem_kv > kv ? m->mem_kv - kv : 0;
    m->mem_act = m->mem_act > act ? m->mem_act - act : 0;
    seq_release(s);
    kd_model_unref(m);
}

int kd_seq_len(const kd_seq *s) { return s ? s->len : 0; }
int kd_seq_capacity(const kd_seq *s) { return s ? s->capacity : 0; }
int kd_seq_out_rows(const kd_seq *s) { return s ? s->out_rows : 0; }

kd_status kd_forward(kd_seq *s, const int32_t *tokens, int n, const int32_t *positions,
                     const uint64_t *visible) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_forward: sequence is NULL");
    if (n <= 0) return kd_fail(KD_ERR_ARG, "kd_forward: %d tokens: expected at least 1", n);
    if (!tokens) return kd_fail(KD_ERR_ARG, "kd_forward: tokens is NULL");
    if (s->pending > 0)
        return kd_fail(KD_ERR_STATE, "kd_forward: %d rows of the last masked (tree) forward are still pending: "
                       "commit them (kd_commit / kd_seq_compact) or drop them (kd_seq_truncate) first", s->pending);
    int vocab = s->model->cfg.vocab;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= vocab)
            return kd_fail(KD_ERR_ARG, "kd_forward: tokens[%d] = %d is outside the vocabulary [0, %d)", i, tokens[i],
                           vocab);
    if (positions)
        for (int i = 0; i < n; i++)
            if (positions[i] < 0)
                return kd_fail(KD_ERR_ARG, "kd_forward: positions[%d] = %d: expected a position >= 0", i, positions[i]);
    if ((int64_t)s->len + n > s->capacity)
        return kd_fail(KD_ERR_CAPACITY, "kd_forward: %d new tokens after %d cached would exceed the sequence "
                       "capacity of %d tokens", n, s->len, s->capacity);
    return kd_model_forward(s, tokens, n, positions, visible);
}

kd_status kd_seq_logits(kd_seq *s, int row0, int n_rows, float *dst) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_logits: sequence is NULL");
    if (row0 < 0 || n_rows < 0 || row0 + n_rows > s->out_rows)
        return kd_fail(KD_ERR_ARG, "kd_seq_logits: rows [%d, %d): expected within the %d output rows of the last forward",
                       row0, row0 + n_rows, s->out_rows);
    if (!dst && n_rows) return kd_fail(KD_ERR_ARG, "kd_seq_logits: dst is NULL");
    if (!n_rows) return KD_OK;
    kd_model *m = s->model;
    if (m->tp == 1) {
        kd_act rows = kd_act_rows(s->rk[0].logits, row0, n_rows);
        return m->be->ops->download(m->be, dst, rows.data, (size_t)n_rows * rows.ld * sizeof(float));
    }
    /* full rows assembled from the shards (only here: the sampling and argmax paths merge per shard) */
    int V = m->cfg.vocab, Vr = m->split.vocab;
    for (int r = 0; r < m->tp; r++) {
        kd_backend *be = m->ranks[r].be;
        for (int i = 0; i < n_rows; i++) {
            kd_act row = kd_act_rows(s->rk[r].logits, row0 + i, 1);
            KD_TRY(be->ops->download(be, dst + (size_t)i * V + (size_t)r * Vr, row.data, (size_t)Vr * sizeof(float)));
        }
    }
    return KD_OK;
}

/* rank 0's whole rows of a gather of n rows: the second half of its buffer */
static kd_act gather_view(const kd_seq *s, int n) {
    const kd_model *m = s->model;
    int rows = s->out_cap < KD_GATHER_ROWS ? s->out_cap : KD_GATHER_ROWS, V = m->cfg.vocab;
    kd_act a = {(char *)s->rk[0].gather + (size_t)rows * V * sizeof(float), n, V, V, KD_F32};
    return a;
}

typedef struct gather_job {
    kd_seq *s;
    int row0, n;
} gather_job;

/* rank r's part of a gather: its shard rows (contiguous: ld = vocab / tp) into the first half of
 * every rank's buffer, and on rank 0 whole into the second half */
static kd_status gather_rank(void *ctx, int r) {
    const gather_job *j = ctx;
    kd_act whole = gather_view(j->s, j->n);
    return kd_gather_columns(j->s->model, r, j->s->model->ranks[r].be, kd_act_rows(j->s->rk[r].logits, j->row0, j->n),
                             j->s->rk[r].gather, r == 0 ? &whole : NULL);
}

kd_status kd_seq_rows_whole(kd_seq *s, int row0, int n, kd_act *out) {
    kd_model *m = s->model;
    if (n < 1 || n > kd_whole_rows_chunk(m, n) || row0 < 0 || row0 + n > s->out_rows)
        return kd_fail(KD_ERR_ARG, "kd_seq_rows_whole: rows [%d, %d) of %d output rows (at tp %d at most %d at a time)",
                       row0, row0 + n, s->out_rows, m->tp, KD_GATHER_ROWS);
    if (m->tp == 1) {
        *out = kd_act_rows(s->rk[0].logits, row0, n);
        return KD_OK;
    }
    gather_job job = {s, row0, n};
    KD_TRY(kd_ranks_run(m, gather_rank, &job));
    *out = gather_view(s, n);
    return KD_OK;
}

typedef struct argmax_job {
    kd_seq *s;
    size_t tmp;          /* the plan's tmp region: >= 3 int32 a row on every rank (r + dr >= 3: config.c) */
    int n;
    int32_t *host;       /* [tp][3 n]: each rank's argmax codes, top-1 value bits and top-1 ids */
} argmax_job;

/* rank r's shard, on its thread: its argmax (for its NaN / +inf report: top-1 lets NaN lose), its
 * top-1 value and id, side by side in its tmp region and brought back in one download */
static kd_status argmax_rank(void *ctx, int r) {
    const argmax_job *j = ctx;
    kd_backend *be = j->s->model->ranks[r].be;
    int32_t *d = (int32_t *)((char *)j->s->rk[r].scratch + j->tmp);
    kd_act rows = kd_act_rows(j->s->rk[r].logits, 0, j->n);
    KD_TRY(be->ops->argmax(be, rows, d));
    KD_TRY(be->ops->topk(be, rows, 1, (float *)(d + j->n), d + 2 * j->n));
    return be->ops->download(be, j->host + (size_t)r * 3 * j->n, d, 3 * sizeof(int32_t) * (size_t)j->n);
}

/* One rank: the backend's argmax. Several: every rank's shard at once (argmax_rank), then per
 * row, in rank order, each rank's best (value, id) of its shard (the backend's top-1, equal
 * values: the lower id); the merge keeps the larger value and, on equal values, the lower rank,
 * whose ids are the lower ones: the whole row's argmax by the same rule. A NaN / +inf is
 * reported from the lowest rank that has one, as one device's argmax reports its first. */
kd_status kd_seq_argmax(kd_seq *s, int32_t *dst) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_argmax: sequence is NULL");
    if (!dst) return kd_fail(KD_ERR_ARG, "kd_seq_argmax: dst is NULL");
    if (s->out_rows <= 0) return kd_fail(KD_ERR_STATE, "kd_seq_argmax: no output rows (run a forward first)");
    kd_model *m = s->model;
    kd_fwd_plan p;
    kd_fwd_plan_make(m, s->out_cap, &p);
    int n = s->out_rows, Vr = m->split.vocab;
    if (m->tp == 1) {
        int32_t *d = (int32_t *)((char *)s->rk[0].scratch + p.idx);
        KD_TRY(m->be->ops->argmax(m->be, kd_act_rows(s->rk[0].logits, 0, n), d));
        KD_TRY(m->be->ops->download(m->be, dst, d, sizeof(int32_t) * (size_t)n));
        return kd_argmax_check(dst, n, "kd_seq_argmax", "the target forward's output");
    }
    argmax_job job = {s, p.tmp, n, malloc(sizeof(int32_t) * 3 * (size_t)n * (size_t)m->tp)};
    if (!job.host) return kd_fail(KD_ERR_NOMEM, "kd_seq_argmax: cannot allocate the %d ranks' results", m->tp);
    kd_status st = kd_ranks_run(m, argmax_rank, &job);
    float best[KD_SEQ_MAX_ROWS];
    for (int r = 0; st == KD_OK && r < m->tp; r++) {
        int32_t *ids = job.host + (size_t)r * 3 * n, *top = ids + 2 * n;
        /* a code's column is the shard's; the vocabulary's is r * Vr further */
        for (int i = 0; i < n; i++)
            if (ids[i] < 0) ids[i] = -((-ids[i] & 3) | (int32_t)((uint32_t)((-ids[i] >> 2) + r * Vr) << 2));
        st = kd_argmax_check(ids, n, "kd_seq_argmax", "the target forward's output");
        for (int i = 0; st == KD_OK && i < n; i++) {
            float v;
            memcpy(&v, ids + n + i, sizeof v);
            if (top[i] < 0 || top[i] >= Vr) {
                st = kd_fail(KD_ERR_BACKEND, "kd_seq_argmax: rank %d: row %d: top id %d outside its %d ids", r, i,
                             (int)top[i], Vr);
                break;
            }
            bool nan = v != v, best_nan = r > 0 && best[i] != best[i];   /* NaN loses, as in argmax */
            if (r == 0 || (!nan && (best_nan || v > best[i]))) {
                best[i] = v;
                dst[i] = r * Vr + top[i];
            }
        }
    }
    free(job.host);
    return st;
}

/* the round (if any) and the pending rows are void after the cache changes shape */
static void end_round(kd_seq *s) {
    s->pending = 0;
    s->phase = KD_PHASE_IDLE;
    s->n_accepted = 0;
}

kd_status kd_seq_truncate(kd_seq *s, int len) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_truncate: sequence is NULL");
    if (len < 0 || len > s->len)
        return kd_fail(KD_ERR_ARG, "kd_seq_truncate: length %d: expected 0..%d (the committed length)", len, s->len);
    s->len = len;
    end_round(s);
    if (s->drafter) KD_TRY(kd_draft_context_truncate(s, len));
    return KD_OK;
}

/* slots start+d_keep[i] -> slot to+i (i < n, d_keep strictly increasing, to <= start + d_keep[0])
 * in every layer of rank r, d_keep in backend memory: one backend op for all the layers */
static kd_status move_slots_rank(kd_seq *s, int r, int start, const int32_t *d_keep, int n, int to) {
    kd_backend *be = s->model->ranks[r].be;
    return be->ops->move_rows(be, s->rk[r].cache, s->model->cfg.n_layers, start, d_keep, n, to);
}

/* a move that failed partway has moved the slots from `start` on in some layers (or chunks)
 * and not in others: those rows are dropped so that nothing reads them again (a retried
 * compaction would gather slots already overwritten). The sequence ends at `start`, the round
 * is over and the drafter's context is cut there too, so the sequence stays usable. */
static kd_status move_failed(kd_seq *s, int start, kd_status st, const char *what) {
    s->len = start;
    end_round(s);
    if (s->drafter) kd_draft_context_truncate(s, start);   /* a valid length: sets no error */
    return kd_fail_context(st, "%s: moving the kept slots failed, so the rows from %d on are dropped (the "
                           "sequence now ends at %d)", what, start, start);
}

/* the kept slots are in place: the sequence ends at start + n_keep and the round is over */
static kd_status compacted(kd_seq *s, int start, int n_keep) {
    int old_len = s->len;
    s->len = start + n_keep;
    end_round(s);
    /* committed rows from `start` on changed: the drafter's context of them is stale */
    if (s->drafter && start < old_len) KD_TRY(kd_draft_context_truncate(s, start));
    return KD_OK;
}

kd_status kd_seq_compact(kd_seq *s, int start, const int32_t *keep, int n_keep) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_compact: sequence is NULL");
    int written = s->len + s->pending;
    if (start < 0 || start > s->len)
        return kd_fail(KD_ERR_ARG, "kd_seq_compact: start %d: expected 0..%d (the committed length)", start, s->len);
    if (n_keep < 0 || (n_keep > 0 && !keep))
        return kd_fail(KD_ERR_ARG, "kd_seq_compact: keep: expected a list of %d slots", n_keep);
    for (int i = 0; i < n_keep; i++) {
        if (keep[i] < 0 || start + keep[i] >= written)
            return kd_fail(KD_ERR_ARG, "kd_seq_compact: keep[%d] = %d: slot %d is outside the %d written slots", i,
                           keep[i], start + keep[i], written);
        if (i > 0 && keep[i] <= keep[i - 1])
            return kd_fail(KD_ERR_ARG, "kd_seq_compact: keep[%d] = %d after keep[%d] = %d: expected strictly increasing",
                           i, keep[i], i - 1, keep[i - 1]);
    }
    kd_model *m = s->model;
    kd_fwd_plan p;
    kd_fwd_plan_make(m, s->out_cap, &p);
    /* chunks in increasing order: slot start+keep[i] >= start+i, so a chunk reads only
     * slots no earlier chunk wrote; every rank's replica of the cache moves the same rows */
    for (int c0 = 0; c0 < n_keep; c0 += s->out_cap) {
        int n = n_keep - c0 < s->out_cap ? n_keep - c0 : s->out_cap;
        for (int r = 0; r < m->tp; r++) {
            kd_backend *be = m->ranks[r].be;
            int32_t *d_idx = (int32_t *)((char *)s->rk[r].scratch + p.idx);
            kd_status st = be->ops->upload(be, d_idx, keep + c0, sizeof(int32_t) * (size_t)n);
            if (st == KD_OK) st = move_slots_rank(s, r, start, d_idx, n, start + c0);
            if (st != KD_OK) return move_failed(s, start, st, "kd_seq_compact");
        }
    }
    return compacted(s, start, n_keep);
}

kd_status kd_seq_compact_staged(kd_seq *s, int start, const int32_t *d_keep, int n_keep) {
    if (start < 0 || start > s->len || n_keep < 0 || n_keep > s->pending || n_keep > s->out_cap)
        return kd_fail(KD_ERR_ARG, "kd_seq_compact_staged: %d kept slots at %d: expected at most %d (the pending "
                       "rows, within the staging of %d) at 0..%d", n_keep, start, s->pending, s->out_cap, s->len);
    if (s->model->tp > 1)      /* d_keep lives on rank 0's backend */
        return kd_fail(KD_ERR_STATE, "kd_seq_compact_staged: slots staged on one backend cannot move %d ranks' caches",
                       s->model->tp);
    kd_status st = move_slots_rank(s, 0, start, d_keep, n_keep, start);
    if (st != KD_OK) return move_failed(s, start, st, "kd_seq_compact_staged");
    return compacted(s, start, n_keep);
}

kd_status kd_seq_read_cache_rank(kd_seq *s, int rank, int layer, int row0, int n, float *dst) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: sequence is NULL");
    kd_model *m = s->model;
    int written = s->len + s->pending;
    if (rank < 0 || rank >= m->tp)
        return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: rank %d: expected 0..%d", rank, m->tp - 1);
    if (layer < 0 || layer >= m->cfg.n_layers)
        return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: layer %d: expected 0..%d", layer, m->cfg.n_layers - 1);
    if (row0 < 0 || n < 0 || row0 + n > written)
        return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: rows [%d, %d): expected within the %d written rows", row0,
                       row0 + n, written);
    if (!dst && n) return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: dst is NULL");
    kd_backend *be = m->ranks[rank].be;
    kd_seq_rank *S = &s->rk[rank];
    int w = cache_cols(m);
    if (S->cache[layer].dtype == KD_F32)
        return be->ops->download(be, dst, kd_act_rows(S->cache[layer], row0, n).data, sizeof(float) * (size_t)n * w);
    kd_fwd_plan p;
    kd_fwd_plan_make(m, s->out_cap, &p);
    kd_act tmp = kd_fwd_act(S->scratch, p.tmp, s->out_cap, w, KD_F32);
    for (int c0 = 0; c0 < n; c0 += s->out_cap) {
        int k = n - c0 < s->out_cap ? n - c0 : s->out_cap;
        KD_TRY(be->ops->copy(be, kd_act_rows(tmp, 0, k), kd_act_rows(S->cache[layer], row0 + c0, k)));
        KD_TRY(be->ops->download(be, dst + (size_t)c0 * w, tmp.data, sizeof(float) * (size_t)k * w));
    }
    return KD_OK;
}

kd_status kd_seq_read_cache(kd_seq *s, int layer, int row0, int n, float *dst) {
    return kd_seq_read_cache_rank(s, 0, layer, row0, n, dst);
}
