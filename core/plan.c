/* plan.c: the per-GPU plan of tensor parallelism (kd_plan, kd_plan_tp) and the split every
 * rank's loader follows (kd_split_of, kd_plan_check_tp); plan.h.
 *
 * Every rank holds the same (the CUDA backend's forms: bf16 activations and latent KV):
 *   weights    its share of every tensor from the loader's own walk (kd_weights_tally): split
 *              tensors 1/tp, replicated ones whole; INT4 as codes + bf16 scales
 *   KV cache   n_layers x capacity x (kv_lora_rank + qk_rope_dim) bf16: the latent cache is
 *              replicated (MLA has one KV head; every rank attends its heads over all of it)
 *   logits     the vocab shard of out_cap rows, fp32; at tp > 1 also the rows gathered whole for
 *              accept and sampling (kd_gather_bytes: 2 x 32 rows of the whole vocabulary)
 *   scratch    the forward's plan (forward.h) for out_cap rows at the rank's widths
 *   workspace  an upper bound of the CUDA backend's growable scratch (workspace_estimate)
 * and the plan keeps KD_PLAN_MARGIN free beside them (see there). */
#include "plan.h"
#include "forward.h"
#include "error.h"
#include <stdio.h>
#include <string.h>

/* Device memory the plan leaves free: the CUDA context and module images, NCCL's buffers, step
 * graphs, and the allocator's rounding of tens of thousands of weight allocations. The K2.6-dims
 * slice run of 2026-11-30 measured 1.04 GB in use beyond everything kd_model_memory counts (one GPU,
 * no NCCL); 4 GiB leaves room for NCCL's channels and rounding at 8 ranks. */
#define KD_PLAN_MARGIN ((uint64_t)4 << 30)

kd_split kd_split_of(const char *name) {
    /* substrings of the module name; the router ("mlp.gate.weight") and q_a / kv_a match none */
    static const struct { const char *part; kd_split split; } rules[] = {
        {"self_attn.q_b_proj", KD_SPLIT_ROWS}, {"self_attn.q_proj", KD_SPLIT_ROWS},
        {"self_attn.kv_b_proj", KD_SPLIT_ROWS}, {"self_attn.o_proj", KD_SPLIT_COLS},
        {"gate_proj", KD_SPLIT_ROWS}, {"up_proj", KD_SPLIT_ROWS}, {"down_proj", KD_SPLIT_COLS},
        {"lm_head", KD_SPLIT_ROWS},
    };
    for (size_t i = 0; name && i < sizeof rules / sizeof rules[0]; i++)
        if (strstr(name, rules[i].part)) return rules[i].split;
    return KD_SPLIT_NONE;
}

kd_status kd_plan_check_tp(const kd_config *c, int tp) {
    if (tp < 1 || tp > KD_TP_MAX) return kd_fail(KD_ERR_ARG, "tp %d: expected 1..%d ranks", tp, KD_TP_MAX);
    if (c->n_heads % tp)
        return kd_fail(KD_ERR_ARG, "tp %d does not divide num_attention_heads (%d): attention splits by heads", tp,
                       c->n_heads);
    if (c->first_k_dense > 0 && c->intermediate % tp)
        return kd_fail(KD_ERR_ARG, "tp %d does not divide intermediate_size (%d): the dense MLP splits on it", tp,
                       c->intermediate);
    if (c->first_k_dense < c->n_layers) {
        if (c->moe_intermediate % tp)
            return kd_fail(KD_ERR_ARG, "tp %d does not divide moe_intermediate_size (%d): the experts split on it", tp,
                           c->moe_intermediate);
        int w = c->moe_intermediate / tp;
        if (c->experts_int4 && (w % c->quant_group || w % 8))
            return kd_fail(KD_ERR_ARG,
                           "tp %d: moe_intermediate_size %d / %d = %d columns per rank is not a whole number of INT4 "
                           "scale groups (group_size %d) of whole 8-code words: a group would straddle two ranks",
                           tp, c->moe_intermediate, tp, w, c->quant_group);
    }
    if (c->vocab % tp)
        return kd_fail(KD_ERR_ARG, "tp %d does not divide vocab_size (%d): lm_head splits by vocab rows", tp, c->vocab);
    return KD_OK;
}

kd_widths kd_widths_of(const kd_config *c, int tp) {
    return (kd_widths){tp, c->n_heads / tp, c->intermediate / tp, c->moe_intermediate / tp, c->vocab / tp};
}

/* The config of one rank: the split widths of kd_widths_of (the workspace bound reads them). */
static kd_config rank_config(const kd_config *c, const kd_widths *w) {
    kd_config r = *c;
    r.quant_ignore = NULL;   /* a view: never freed through this copy */
    r.n_quant_ignore = 0;
    r.n_heads = w->heads;
    r.intermediate = w->intermediate;
    r.moe_intermediate = w->moe_intermediate;
    r.vocab = w->vocab;
    return r;
}

/* An upper bound of the CUDA backend's workspaces after the largest forward (out_cap rows) at
 * the capacity, one rank: the attention partials of cuda/mla.cu (per query H x ceil(capacity/256)
 * chunks x (kv_lora_rank + 2) fp32 (the CUDA-core kernel's chunking: the finer of the two), the
 * batch bounded by its 512 MiB cap) and its visible-row lists; the split-K partials of
 * cuda/linear.cu at their 256 MiB bound; the MoE's per-row buffers (router scores, and per routed
 * row the gate/up pair and a hidden-sized output in fp32); the INT4 load staging of the largest
 * expert matrix. */
static uint64_t workspace_estimate(const kd_config *r, int out_cap, int capacity) {
    uint64_t T = (uint64_t)out_cap, chunks = ((uint64_t)capacity + 255) / 256;
    uint64_t per_q = (uint64_t)r->n_heads * chunks * (uint64_t)(r->kv_lora_rank + 2) * 4;
    uint64_t batch = ((uint64_t)512 << 20) / per_q;   /* queries per launch, as attn_work picks them */
    if (batch < 1) batch = 1;
    if (batch > T) batch = T;
    uint64_t attn = per_q * batch + (T * T + T) * 4;
    uint64_t gemm = (uint64_t)256 << 20;
    uint64_t moe = 0, stage = 0;
    if (r->first_k_dense < r->n_layers) {
        uint64_t routed = T * (uint64_t)r->n_experts_per_tok;
        moe = T * (uint64_t)r->n_experts * 4 + routed * (uint64_t)(2 * r->moe_intermediate + r->hidden) * 4;
        if (r->experts_int4)
            stage = (uint64_t)r->moe_intermediate * (uint64_t)r->hidden / 2 +
                    (uint64_t)r->moe_intermediate * (uint64_t)r->hidden / (uint64_t)r->quant_group * 2;
    }
    return attn + gemm + moe + stage;
}

/* the capacity-dependent parts of the plan, and the total */
static void size_for(const kd_config *c, const kd_widths *w, int capacity, kd_plan_report *o) {
    o->capacity = capacity;
    o->out_cap = capacity < KD_SEQ_MAX_ROWS ? capacity : KD_SEQ_MAX_ROWS;
    uint64_t per_token = (uint64_t)c->n_layers * (uint64_t)(c->kv_lora_rank + c->qk_rope_dim) * 2u;
    o->kv_per_1k = per_token * 1024u;
    o->kv_cache = per_token * (uint64_t)capacity;
    o->logits = (uint64_t)o->out_cap * (uint64_t)w->vocab * sizeof(float) + kd_gather_bytes(w->tp, o->out_cap, c->vocab);
    kd_fwd_plan p;
    kd_fwd_plan_of(c, w, 2, o->out_cap, &p);
    o->scratch = p.bytes;
    kd_config rc = rank_config(c, w);
    o->workspace = workspace_estimate(&rc, o->out_cap, capacity);
    o->total = o->weights_total + o->kv_cache + o->logits + o->scratch + o->workspace;
}

static double gb(uint64_t b) { return (double)b / 1e9; }

/* the plan of one rank from a tally; the verdict in o->fits and o->message */
static void plan_from(const kd_config *c, int tp, uint64_t device_bytes, int capacity, const kd_tally *t,
                      kd_plan_report *o) {
    memset(o, 0, sizeof *o);
    o->tp = tp;
    o->device_bytes = device_bytes;
    o->margin = KD_PLAN_MARGIN;
    uint64_t *w[KD_WK_N] = {&o->weights_attention, &o->weights_dense_mlp, &o->weights_shared_experts,
                            &o->weights_routed_experts, &o->weights_router, &o->weights_embed, &o->weights_lm_head,
                            &o->weights_norms};
    for (int k = 0; k < KD_WK_N; k++) {
        *w[k] = t->rank[k];
        o->weights_total += t->rank[k];
        o->weights_replicated += t->replicated[k];
    }
    kd_widths rw = kd_widths_of(c, tp);
    size_for(c, &rw, capacity, o);
    char parts[160];
    snprintf(parts, sizeof parts, "weights %.2f GB, KV %.2f GB for %d tokens, activations %.2f GB, workspace %.2f GB",
             gb(o->weights_total), gb(o->kv_cache), capacity, gb(o->logits + o->scratch), gb(o->workspace));
    if (device_bytes == 0) {
        o->fits = -1;
        snprintf(o->message, sizeof o->message, "each of %d ranks needs %llu bytes (%.2f GB: %s); no device size "
                 "given, not checked", tp, (unsigned long long)o->total, gb(o->total), parts);
        return;
    }
    o->fits = o->total + o->margin <= device_bytes;
    if (!o->fits) {
        snprintf(o->message, sizeof o->message, "each of %d ranks needs %llu bytes (%.2f GB: %s) + a %.2f GB margin, but "
                 "the device has %llu bytes (%.2f GB)", tp, (unsigned long long)o->total, gb(o->total), parts,
                 gb(o->margin), (unsigned long long)device_bytes, gb(device_bytes));
        return;
    }
    /* the longest sequence that fits: the total grows with the capacity (bisection) */
    kd_plan_report probe = *o;
    uint64_t lo = (uint64_t)capacity, hi = (uint64_t)c->max_positions > lo ? (uint64_t)c->max_positions : lo;
    size_for(c, &rw, (int)hi, &probe);
    if (probe.total + o->margin > device_bytes) {
        while (hi - lo > 1) {
            uint64_t mid = lo + (hi - lo) / 2;
            size_for(c, &rw, (int)mid, &probe);
            if (probe.total + o->margin <= device_bytes) lo = mid; else hi = mid;
        }
        o->max_capacity = lo;
    } else {
        o->max_capacity = hi;
    }
    snprintf(o->message, sizeof o->message, "fits: each of %d ranks needs %llu bytes (%.2f GB: %s), plus a "
             "%.2f GB margin, within %.2f GB; one sequence of up to %llu tokens fits%s", tp, (unsigned long long)o->total,
             gb(o->total), parts, gb(o->margin), gb(device_bytes), (unsigned long long)o->max_capacity,
             o->max_capacity == (uint64_t)c->max_positions ? " (max_position_embeddings)" : "");
}

static kd_status check_args(int capacity, const kd_plan_report *out, const char *fn) {
    if (!out) return kd_fail(KD_ERR_ARG, "%s: out must not be NULL", fn);
    if (capacity <= 0) return kd_fail(KD_ERR_ARG, "%s: capacity %d: expected a positive number of tokens", fn, capacity);
    return KD_OK;
}

kd_status kd_plan_tp(const kd_config *cfg, int tp, uint64_t device_bytes, int capacity, kd_plan_report *out) {
    if (!cfg) return kd_fail(KD_ERR_ARG, "kd_plan_tp: cfg must not be NULL");
    KD_TRY(check_args(capacity, out, "kd_plan_tp"));
    memset(out, 0, sizeof *out);
    KD_TRY(kd_plan_check_tp(cfg, tp));
    kd_tally t;
    KD_TRY(kd_weights_tally(cfg, NULL, NULL, tp, &t));
    plan_from(cfg, tp, device_bytes, capacity, &t, out);
    if (out->fits == 0) return kd_fail(KD_ERR_NOMEM, "%s", out->message);
    return KD_OK;
}

kd_status kd_plan(const char *dir, int tp, uint64_t device_bytes, int capacity, kd_plan_report *out) {
    if (!dir) return kd_fail(KD_ERR_ARG, "kd_plan: dir must not be NULL");
    KD_TRY(check_args(capacity, out, "kd_plan"));
    memset(out, 0, sizeof *out);
    kd_config cfg;
    kd_st_set set;
    bool files;
    KD_TRY(kd_open_headers(dir, &cfg, &set, &files));
    kd_status st = kd_plan_check_tp(&cfg, tp);
    if (st != KD_OK) kd_fail_context(st, "%s/config.json", dir);
    kd_tally t;
    if (st == KD_OK) st = kd_weights_tally(&cfg, files ? &set : NULL, dir, tp, &t);
    if (st == KD_OK) plan_from(&cfg, tp, device_bytes, capacity, &t, out);
    kd_st_close(&set);
    kd_config_free(&cfg);
    return st;
}
