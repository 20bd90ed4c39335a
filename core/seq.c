/* seq.c: sequences: the latent KV cache, the outputs of the last forward, and the
 * calls that validate input before the forward (model.c) runs.
 *
 * Memory of a sequence (all allocated by kd_seq_new, nothing later):
 *   cache[l]      [capacity, kv_lora_rank + qk_rope_dim] act dtype, per layer
 *   logits        [out_cap, vocab] fp32
 *   scratch       the forward's plan for out_cap rows (forward.h)
 *   out_positions out_cap int32 on the host
 *   graphs        the forward inputs' host staging, and step graphs in graph mode (model.c)
 * out_cap = min(capacity, 1024) rows per forward chunk (env KDTREE_SEQ_ROWS lowers it,
 * for tests of the chunked path). A longer causal forward runs in chunks; a masked
 * (tree) forward must fit in out_cap rows. */
#include "forward.h"
#include "drafter.h"
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
    return (uint64_t)s->out_cap * (uint64_t)s->model->cfg.vocab * sizeof(float) + s->scratch_bytes;
}

static void seq_release(kd_seq *s) {
    kd_model *m = s->model;
    kd_backend *be = m->be;
    kd_seq_graphs_free(s);     /* before the buffers its graphs point at */
    if (s->cache) {
        for (int l = 0; l < m->cfg.n_layers; l++)
            if (s->cache[l].data) be->ops->free(be, s->cache[l].data);
        free(s->cache);
    }
    if (s->logits.data) be->ops->free(be, s->logits.data);
    if (s->scratch) be->ops->free(be, s->scratch);
    free(s->out_positions);
    free(s);
}

kd_status kd_seq_new(kd_model *m, int capacity, kd_seq **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_seq_new: out is NULL");
    *out = NULL;
    if (!m) return kd_fail(KD_ERR_ARG, "kd_seq_new: model is NULL");
    if (m->closing) return kd_fail(KD_ERR_STATE, "kd_seq_new: the model is closed");
    if (capacity <= 0) return kd_fail(KD_ERR_ARG, "kd_seq_new: capacity %d: expected a positive number of tokens", capacity);
    kd_backend *be = m->be;
    const kd_config *c = &m->cfg;
    int out_cap = capacity < KD_SEQ_MAX_ROWS ? capacity : KD_SEQ_MAX_ROWS;
    const char *env = getenv("KDTREE_SEQ_ROWS");
    if (env && atoi(env) > 0 && atoi(env) < out_cap) out_cap = atoi(env);

    kd_seq *s = calloc(1, sizeof *s);
    if (!s) return kd_fail(KD_ERR_NOMEM, "kd_seq_new: out of host memory");
    s->model = m;
    s->capacity = capacity;
    s->out_cap = out_cap;
    s->phase = KD_PHASE_IDLE;
    kd_status st = KD_OK;
    size_t asz = kd_dtype_size(be->act_dtype);
    s->cache = calloc((size_t)c->n_layers, sizeof *s->cache);
    s->out_positions = calloc((size_t)out_cap, sizeof(int32_t));
    if (!s->cache || !s->out_positions) st = kd_fail(KD_ERR_NOMEM, "kd_seq_new: out of host memory");
    for (int l = 0; st == KD_OK && l < c->n_layers; l++) {
        kd_act *a = &s->cache[l];
        a->rows = capacity;
        a->cols = a->ld = cache_cols(m);
        a->dtype = be->act_dtype;
        st = be->ops->alloc(be, (size_t)capacity * a->cols * asz, &a->data);
        if (st != KD_OK) kd_fail_context(st, "kd_seq_new: KV cache of layer %d (%d tokens)", l, capacity);
    }
    if (st == KD_OK) {
        s->logits = (kd_act){ NULL, out_cap, c->vocab, c->vocab, KD_F32 };
        st = be->ops->alloc(be, (size_t)out_cap * c->vocab * sizeof(float), &s->logits.data);
        if (st != KD_OK) kd_fail_context(st, "kd_seq_new: logits (%d rows x %d)", out_cap, c->vocab);
    }
    if (st == KD_OK) {
        kd_fwd_plan p;
        kd_fwd_plan_make(m, out_cap, &p);
        s->scratch_bytes = p.bytes;
        st = be->ops->alloc(be, p.bytes, &s->scratch);
        if (st != KD_OK) kd_fail_context(st, "kd_seq_new: forward scratch (%zu bytes)", p.bytes);
    }
    if (st == KD_OK) st = kd_seq_graphs_new(s, kd_graphs_mode_from_env(be));
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
    kd_backend *be = s->model->be;
    kd_act rows = kd_act_rows(s->logits, row0, n_rows);
    return be->ops->download(be, dst, rows.data, (size_t)n_rows * s->logits.ld * sizeof(float));
}

kd_status kd_seq_argmax(kd_seq *s, int32_t *dst) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_argmax: sequence is NULL");
    if (!dst) return kd_fail(KD_ERR_ARG, "kd_seq_argmax: dst is NULL");
    if (s->out_rows <= 0) return kd_fail(KD_ERR_STATE, "kd_seq_argmax: no output rows (run a forward first)");
    kd_backend *be = s->model->be;
    kd_fwd_plan p;
    kd_fwd_plan_make(s->model, s->out_cap, &p);
    int32_t *d = (int32_t *)((char *)s->scratch + p.idx);
    KD_TRY(be->ops->argmax(be, kd_act_rows(s->logits, 0, s->out_rows), d));
    KD_TRY(be->ops->download(be, dst, d, sizeof(int32_t) * (size_t)s->out_rows));
    return kd_argmax_check(dst, s->out_rows, "kd_seq_argmax", "the target forward's output");
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

/* slots start+d_keep[i] -> slot to+i (i < n <= out_cap) in every layer, d_keep in backend
 * memory: gathered into the staging area, then copied back */
static kd_status move_slots(kd_seq *s, const kd_fwd_plan *p, int start, const int32_t *d_keep, int n, int to) {
    kd_model *m = s->model;
    kd_backend *be = m->be;
    kd_act tmp = kd_act_rows(kd_fwd_act(s, p->tmp, s->out_cap, cache_cols(m), be->act_dtype), 0, n);
    int written = s->len + s->pending;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        KD_TRY(be->ops->gather_rows(be, tmp, kd_act_rows(s->cache[l], start, written - start), d_keep, n));
        KD_TRY(be->ops->copy(be, kd_act_rows(s->cache[l], to, n), tmp));
    }
    return KD_OK;
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
    kd_backend *be = s->model->be;
    kd_fwd_plan p;
    kd_fwd_plan_make(s->model, s->out_cap, &p);
    int32_t *d_idx = (int32_t *)((char *)s->scratch + p.idx);
    /* chunks in increasing order: slot start+keep[i] >= start+i, so a chunk reads only
     * slots no earlier chunk wrote */
    for (int c0 = 0; c0 < n_keep; c0 += s->out_cap) {
        int n = n_keep - c0 < s->out_cap ? n_keep - c0 : s->out_cap;
        kd_status st = be->ops->upload(be, d_idx, keep + c0, sizeof(int32_t) * (size_t)n);
        if (st == KD_OK) st = move_slots(s, &p, start, d_idx, n, start + c0);
        if (st != KD_OK) return move_failed(s, start, st, "kd_seq_compact");
    }
    return compacted(s, start, n_keep);
}

kd_status kd_seq_compact_staged(kd_seq *s, int start, const int32_t *d_keep, int n_keep) {
    if (start < 0 || start > s->len || n_keep < 0 || n_keep > s->pending || n_keep > s->out_cap)
        return kd_fail(KD_ERR_ARG, "kd_seq_compact_staged: %d kept slots at %d: expected at most %d (the pending "
                       "rows, within the staging of %d) at 0..%d", n_keep, start, s->pending, s->out_cap, s->len);
    kd_fwd_plan p;
    kd_fwd_plan_make(s->model, s->out_cap, &p);
    kd_status st = move_slots(s, &p, start, d_keep, n_keep, start);
    if (st != KD_OK) return move_failed(s, start, st, "kd_seq_compact_staged");
    return compacted(s, start, n_keep);
}

kd_status kd_seq_read_cache(kd_seq *s, int layer, int row0, int n, float *dst) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: sequence is NULL");
    kd_model *m = s->model;
    int written = s->len + s->pending;
    if (layer < 0 || layer >= m->cfg.n_layers)
        return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: layer %d: expected 0..%d", layer, m->cfg.n_layers - 1);
    if (row0 < 0 || n < 0 || row0 + n > written)
        return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: rows [%d, %d): expected within the %d written rows", row0,
                       row0 + n, written);
    if (!dst && n) return kd_fail(KD_ERR_ARG, "kd_seq_read_cache: dst is NULL");
    kd_backend *be = m->be;
    int w = cache_cols(m);
    if (s->cache[layer].dtype == KD_F32)
        return be->ops->download(be, dst, kd_act_rows(s->cache[layer], row0, n).data, sizeof(float) * (size_t)n * w);
    kd_fwd_plan p;
    kd_fwd_plan_make(m, s->out_cap, &p);
    kd_act tmp = kd_fwd_act(s, p.tmp, s->out_cap, w, KD_F32);
    for (int c0 = 0; c0 < n; c0 += s->out_cap) {
        int k = n - c0 < s->out_cap ? n - c0 : s->out_cap;
        KD_TRY(be->ops->copy(be, kd_act_rows(tmp, 0, k), kd_act_rows(s->cache[layer], row0 + c0, k)));
        KD_TRY(be->ops->download(be, dst + (size_t)c0 * w, tmp.data, sizeof(float) * (size_t)k * w));
    }
    return KD_OK;
}
