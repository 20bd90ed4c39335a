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
 * then logits = lm_head(rmsnorm(x; norm)). mlp(h) = down(silu(gate h) * up h).
 * After layer l, when a drafter is attached and l is one of its taps, x (the residual
 * stream, HF hidden_states[l+1]) is copied into s->taps for the drafter.
 *
 * A causal forward longer than the sequence's out_cap rows runs in chunks (each
 * commits before the next); only the last chunk computes logits, so the output rows
 * are the last min(T, out_cap) tokens. A masked forward must fit in one chunk. */
#include "forward.h"
#include "drafter.h"
#include "error.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ALIGN_UP(v) (((v) + 255u) & ~(size_t)255u)

void kd_fwd_plan_make(const kd_model *m, int rows, kd_fwd_plan *p) {
    const kd_config *c = &m->cfg;
    size_t a = kd_dtype_size(m->be->act_dtype), off = 0, R = (size_t)rows;
    int H = c->n_heads, r = c->kv_lora_rank, dr = c->qk_rope_dim, dn = c->qk_nope_dim, dv = c->v_head_dim;
    int inter = c->intermediate;
    if (c->moe_intermediate * c->n_shared_experts > inter) inter = c->moe_intermediate * c->n_shared_experts;
    memset(p, 0, sizeof *p);
    p->rows = rows;
    p->words = (rows + 63) / 64;
#define REGION(field, nbytes) do { p->field = off; off = ALIGN_UP(off + (nbytes)); } while (0)
    REGION(ids, R * 4);
    REGION(pos, R * 4);
    REGION(vis, R * (size_t)p->words * 8);
    REGION(idx, R * 4);
    REGION(x, R * c->hidden * a);
    REGION(h, R * c->hidden * a);
    REGION(t1, R * c->hidden * a);
    REGION(t2, R * c->hidden * a);
    REGION(qa, R * (size_t)(c->q_lora_rank > 0 ? c->q_lora_rank : 0) * a);
    REGION(q, R * (size_t)H * (dn + dr) * a);
    REGION(kva, R * (size_t)(r + dr) * a);
    REGION(qfull, R * (size_t)H * (r + dr) * a);
    REGION(lat, R * (size_t)H * r * a);
    REGION(o, R * (size_t)H * dv * a);
    REGION(gate, R * (size_t)inter * a);
    REGION(up, R * (size_t)inter * a);
    REGION(tmp, R * (size_t)(r + dr) * (a > 4 ? a : 4));
#undef REGION
    p->bytes = off;
}

kd_act kd_fwd_act(const kd_seq *s, size_t off, int rows, int cols, kd_dtype dt) {
    kd_act v = { (char *)s->scratch + off, rows, cols, cols, dt };
    return v;
}

/* [T, H*c] (contiguous) seen as [T*H, c]: one row per (token, head) */
static kd_act heads_as_rows(kd_act a, int H) {
    kd_act v = a;
    v.rows = a.rows * H;
    v.cols = a.cols / H;
    v.ld = a.ld / H;
    return v;
}

/* out = down(silu(gate x) * up x) */
static kd_status mlp(kd_seq *s, const kd_fwd_plan *p, kd_act x, const kd_weight *gate, const kd_weight *up,
                     const kd_weight *down, kd_act out) {
    kd_backend *be = s->model->be;
    int T = x.rows, I = (int)gate->rows;
    kd_act g = kd_fwd_act(s, p->gate, T, I, be->act_dtype), u = kd_fwd_act(s, p->up, T, I, be->act_dtype);
    KD_TRY(be->ops->linear(be, x, gate, g));
    KD_TRY(be->ops->linear(be, x, up, u));
    KD_TRY(be->ops->swiglu(be, g, u, g));
    return be->ops->linear(be, g, down, out);
}

/* MLA attention of layer l: writes the layer's cache rows [len, len+T) and x += attn(h) */
static kd_status attention_block(kd_seq *s, const kd_fwd_plan *p, int l, kd_act h, kd_act x, const int32_t *pos,
                                 const uint64_t *vis) {
    kd_model *m = s->model;
    kd_backend *be = m->be;
    const kd_config *c = &m->cfg;
    const kd_layer *L = &m->layers[l];
    kd_dtype dt = be->act_dtype;
    int T = h.rows, H = c->n_heads, r = c->kv_lora_rank, dr = c->qk_rope_dim, dn = c->qk_nope_dim,
        dv = c->v_head_dim, len = s->len;

    /* queries */
    kd_act q = kd_fwd_act(s, p->q, T, H * (dn + dr), dt);
    if (c->q_lora_rank > 0) {
        kd_act qa = kd_fwd_act(s, p->qa, T, c->q_lora_rank, dt);
        KD_TRY(be->ops->linear(be, h, &L->q_a, qa));
        KD_TRY(be->ops->rmsnorm(be, qa, &L->q_a_norm, c->q_a_norm_eps, qa));
        KD_TRY(be->ops->linear(be, qa, &L->q_b, q));
    } else {
        KD_TRY(be->ops->linear(be, h, &L->q_proj, q));
    }
    KD_TRY(be->ops->rope(be, q, H, dn + dr, dn, pos, &m->rope));

    /* the latent of the new tokens goes straight into the cache: [c_kv | roped k_pe] */
    kd_act kva = kd_fwd_act(s, p->kva, T, r + dr, dt);
    KD_TRY(be->ops->linear(be, h, &L->kv_a, kva));
    kd_act rows = kd_act_rows(s->cache[l], len, T);
    KD_TRY(be->ops->rmsnorm(be, kd_act_cols(kva, 0, r), &L->kv_a_norm, c->kv_a_norm_eps, kd_act_cols(rows, 0, r)));
    KD_TRY(be->ops->copy(be, kd_act_cols(rows, r, dr), kd_act_cols(kva, r, dr)));
    KD_TRY(be->ops->rope(be, rows, 1, r + dr, r, pos, &m->rope));

    /* absorbed query per head: [q_nope W_UK | q_pe] */
    kd_act lat = kd_fwd_act(s, p->lat, T, H * r, dt);
    kd_act qfull = kd_fwd_act(s, p->qfull, T, H * (r + dr), dt);
    KD_TRY(be->ops->head_matmul(be, q, H, dn + dr, dn, &L->kv_b, dn + dv, 0, false, lat, r));
    kd_act qf_rows = heads_as_rows(qfull, H);
    KD_TRY(be->ops->copy(be, kd_act_cols(qf_rows, 0, r), heads_as_rows(lat, H)));
    KD_TRY(be->ops->copy(be, kd_act_cols(qf_rows, r, dr), kd_act_cols(heads_as_rows(q, H), dn, dr)));

    /* one latent KV head (MQA) over the cache rows [0, len+T) */
    kd_act kv = kd_act_rows(s->cache[l], 0, len + T);
    KD_TRY(be->ops->attention(be, qfull, H, r + dr, kv, kd_act_cols(kv, 0, r), 1, len, vis == NULL, vis, 0,
                              c->softmax_scale, lat));

    /* back to per-head values, output projection, residual */
    kd_act o = kd_fwd_act(s, p->o, T, H * dv, dt);
    KD_TRY(be->ops->head_matmul(be, lat, H, r, r, &L->kv_b, dn + dv, dn, true, o, dv));
    kd_act t1 = kd_fwd_act(s, p->t1, T, c->hidden, dt);
    KD_TRY(be->ops->linear(be, o, &L->o_proj, t1));
    return be->ops->add(be, x, t1);
}

/* x += mlp(h) (dense layer) or moe(h) + shared(h) */
static kd_status ffn_block(kd_seq *s, const kd_fwd_plan *p, int l, kd_act h, kd_act x) {
    kd_model *m = s->model;
    kd_backend *be = m->be;
    const kd_layer *L = &m->layers[l];
    int T = h.rows, D = m->cfg.hidden;
    kd_act t1 = kd_fwd_act(s, p->t1, T, D, be->act_dtype);
    if (!L->is_moe) {
        KD_TRY(mlp(s, p, h, &L->mlp_gate, &L->mlp_up, &L->mlp_down, t1));
        return be->ops->add(be, x, t1);
    }
    KD_TRY(be->ops->moe(be, h, &L->experts, t1));
    if (m->cfg.n_shared_experts > 0) {
        kd_act t2 = kd_fwd_act(s, p->t2, T, D, be->act_dtype);
        KD_TRY(mlp(s, p, h, &L->mlp_gate, &L->mlp_up, &L->mlp_down, t2));
        KD_TRY(be->ops->add(be, t1, t2));        /* HF order: experts + shared, then the residual */
    }
    return be->ops->add(be, x, t1);
}

/* keep x (the output of layer l) for the drafter when l is one of its taps */
static kd_status keep_taps(kd_seq *s, int l, kd_act x) {
    if (!s->drafter || !s->taps.data) return KD_OK;
    const int *taps = NULL;
    int n = kd_drafter_taps(s->drafter, &taps), D = s->model->cfg.hidden;
    for (int j = 0; j < n; j++)
        if (taps[j] == l) {
            kd_act dst = kd_act_cols(kd_act_rows(s->taps, 0, x.rows), j * D, D);
            KD_TRY(s->model->be->ops->copy(s->model->be, dst, x));
        }
    return KD_OK;
}

/* one chunk of T <= out_cap tokens at cache rows [len, len+T); pos: host positions */
static kd_status forward_chunk(kd_seq *s, const int32_t *tokens, int T, const int32_t *pos,
                               const uint64_t *visible, bool want_logits) {
    kd_model *m = s->model;
    kd_backend *be = m->be;
    const kd_config *c = &m->cfg;
    kd_fwd_plan p;
    kd_fwd_plan_make(m, s->out_cap, &p);
    int32_t *d_ids = (int32_t *)((char *)s->scratch + p.ids), *d_pos = (int32_t *)((char *)s->scratch + p.pos);
    uint64_t *d_vis = NULL;
    KD_TRY(be->ops->upload(be, d_ids, tokens, sizeof(int32_t) * (size_t)T));
    KD_TRY(be->ops->upload(be, d_pos, pos, sizeof(int32_t) * (size_t)T));
    if (visible) {
        d_vis = (uint64_t *)((char *)s->scratch + p.vis);
        KD_TRY(be->ops->upload(be, d_vis, visible, sizeof(uint64_t) * (size_t)T * (size_t)((T + 63) / 64)));
    }
    kd_act x = kd_fwd_act(s, p.x, T, c->hidden, be->act_dtype);
    kd_act h = kd_fwd_act(s, p.h, T, c->hidden, be->act_dtype);
    KD_TRY(be->ops->embed(be, &m->embed, d_ids, x));
    for (int l = 0; l < c->n_layers; l++) {
        const kd_layer *L = &m->layers[l];
        kd_status st = be->ops->rmsnorm(be, x, &L->attn_norm, c->rms_norm_eps, h);
        if (st == KD_OK) st = attention_block(s, &p, l, h, x, d_pos, d_vis);
        if (st == KD_OK) st = be->ops->rmsnorm(be, x, &L->ffn_norm, c->rms_norm_eps, h);
        if (st == KD_OK) st = ffn_block(s, &p, l, h, x);
        if (st == KD_OK) st = keep_taps(s, l, x);
        if (st != KD_OK) return kd_fail_context(st, "forward: layer %d", l);
    }
    if (!want_logits) return KD_OK;
    KD_TRY(be->ops->rmsnorm(be, x, &m->final_norm, c->rms_norm_eps, h));
    /* logits are fp32 on every backend: linear writes out.dtype */
    return be->ops->linear(be, h, &m->lm_head, kd_act_rows(s->logits, 0, T));
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
        for (int i = 0; i < n; i++) s->out_positions[i] = positions ? positions[i] : s->len + i;
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
            int32_t rows[KD_SEQ_MAX_ROWS];
            for (int i = 0; i < T; i++) rows[i] = i;
            st = kd_draft_context_append(s, rows, T);
            if (st != KD_OK) { kd_fail_context(st, "forward: drafter context"); break; }
        }
        done += T;
    }
    if (st != KD_OK) {                       /* leave the sequence as it was */
        s->len = len0;
        s->out_rows = 0;
        if (s->drafter) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", kd_last_error());
            kd_draft_context_truncate(s, len0);
            kd_fail(st, "%s", msg);
        }
    }
    return st;
}
