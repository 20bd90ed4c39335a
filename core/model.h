/* model.h: the target model (DeepSeek-V3 / Kimi K2.x) as the core sees it:
 * its config, its weights, a sequence with its latent KV cache. */
#ifndef KD_MODEL_H
#define KD_MODEL_H
#include "backend.h"
#include "safetensors.h"
#include "config_read.h"

/* Everything read from config.json (+ generation_config.json); never hard-coded. */
typedef struct kd_config {
    int vocab, hidden, n_layers, first_k_dense, moe_layer_freq;
    int n_heads, q_lora_rank, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim;
    int intermediate, moe_intermediate, n_experts, n_experts_per_tok, n_shared_experts;
    int n_group, topk_group;
    bool norm_topk_prob, tie_embeddings;
    float routed_scaling_factor, rms_norm_eps;
    float q_a_norm_eps, kv_a_norm_eps;       /* HF builds these norms with eps 1e-6 (see docs/formats.md) */
    int max_positions;
    kd_rope_params rope;                      /* RoPE / YaRN (config_read.h) */
    float softmax_scale;                      /* qk_head_dim^-0.5 * mscale^2 under YaRN */
    /* quantization (compressed-tensors pack-quantized) */
    bool experts_int4;
    int quant_bits, quant_group;
    char **quant_ignore;                      /* the ignore list, as written */
    int n_quant_ignore;
    /* checkpoint naming */
    char prefix[32];                          /* "" or "language_model." */
    int n_eos, eos[8], bos;
} kd_config;

/* Parse DIR/config.json (+ generation_config.json when present) and validate it. */
kd_status kd_config_load(const char *dir, kd_config *cfg);
void kd_config_free(kd_config *cfg);
/* the model's RoPE inverse frequencies for `dim` rotary dims (host array of dim/2) */
void kd_rope_inv_freq(const kd_config *cfg, int dim, float *inv_freq);

typedef struct kd_layer {
    kd_weight attn_norm, ffn_norm;
    kd_weight q_a, q_a_norm, q_b, q_proj;     /* q_proj when q_lora_rank == 0, else q_a/q_a_norm/q_b */
    kd_weight kv_a, kv_a_norm, kv_b, o_proj;
    bool is_moe;
    kd_weight mlp_gate, mlp_up, mlp_down;     /* dense layer MLP, or the shared experts of a MoE layer */
    kd_weight router, router_bias;            /* router bias: f32 [n_experts] */
    kd_experts experts;
} kd_layer;

/* One rank of a tensor-parallel model (tp = 1: the only one): its backend instance and its slice
 * of every weight (the split, docs/architecture.md "Several devices"): q_b and kv_b by heads,
 * o_proj by its input columns, the dense MLP and every expert (shared and routed) on the
 * intermediate dim (gate/up rows, down input columns), lm_head by vocab rows; q_a, kv_a, the
 * norms, the router and the embedding replicated. Row slices point into the mapping; column
 * slices point into it too, with the full row stride in kd_weight.ld. */
typedef struct kd_rank {
    kd_backend *be;
    kd_weight embed, final_norm, lm_head;     /* lm_head: vocab rows [rank * vocab/tp, +vocab/tp) */
    kd_layer *layers;
    float *rope_inv_freq;                     /* backend memory, qk_rope_dim/2 */
    kd_rope rope;
} kd_rank;

/* the widths one rank holds (kd_widths_of: config widths / tp, once kd_plan_check_tp passed) */
typedef struct kd_widths {
    int tp;                                   /* the ranks the widths are split over */
    int heads, intermediate, moe_intermediate, vocab;
} kd_widths;

struct kd_workers;                            /* the rank threads (ranks.c) */
struct kd_comm;

struct kd_model {
    kd_config cfg;
    kd_model_options opt;                     /* as opened (kd_model_open checked them) */
    int tp;                                   /* ranks (1..8) */
    kd_widths split;
    kd_rank *ranks;                           /* [tp] */
    kd_backend *be;                           /* ranks[0].be: the drafter, trees and host staging live here */
    struct kd_comm *comm;                     /* tp > 1: the ranks' all-reduce */
    struct kd_workers *workers;               /* tp > 1: one persistent thread per rank past rank 0 */
    kd_st_set files;                          /* the mapped checkpoint */
    char dir[1024];
    int n_seqs;                               /* open sequences (a model outlives them) */
    bool closing;                             /* kd_model_close was called while n_seqs > 0 */
    /* tallies of the open sequences for kd_model_memory (seq.c, model.c); rank 0's */
    uint64_t mem_kv, mem_act;                 /* backend bytes: KV caches; logits + forward scratch */
    uint64_t mem_trees;                       /* backend bytes of the trees' backend copies (tree.c) */
    uint64_t graphs_held, graph_captures, graph_launches, graph_fallbacks;
};


/* Run fn(ctx, r) for every rank r, each on its rank's thread (tp = 1: inline on the caller's).
 * A rank that fails aborts the communicator, so the others leave their collectives; the
 * communicator is reset once every rank returned. The result is the first failing rank's
 * status, with its message in the caller's kd_last_error (a rank's own failure preferred
 * to "another rank failed"). */
typedef kd_status (*kd_rank_fn)(void *ctx, int rank);
kd_status kd_ranks_run(kd_model *m, kd_rank_fn fn, void *ctx);
kd_status kd_workers_start(kd_model *m);
void kd_workers_stop(kd_model *m);

/* Every field in its range, or KD_ERR_ARG naming the field (options.c). */
kd_status kd_model_options_check(const kd_model_options *o);
kd_status kd_seq_options_check(const kd_seq_options *o);

/* Reference counting (model_load.c): kd_seq_new / kd_drafter_open take a reference with
 * m->n_seqs++; kd_seq_free / kd_drafter_close give it back with kd_model_unref(m), which
 * decrements n_seqs and frees the model when kd_model_close was called meanwhile and this
 * was the last reference. kd_model_close frees at once when n_seqs == 0. */
void kd_model_unref(kd_model *m);


/* The sequence. The cache is one buffer per layer, rows = capacity,
 * cols = kv_lora_rank + qk_rope_dim (c_kv then roped k_pe). */
typedef enum kd_seq_phase { KD_PHASE_IDLE, KD_PHASE_VERIFIED, KD_PHASE_ACCEPTED } kd_seq_phase;

struct kd_drafter;
typedef struct kd_draft_state kd_draft_state;   /* the drafter's per-sequence state (drafter.c) */

/* a sequence's state on one rank: its KV cache (the latent cache is replicated: every rank
 * writes the same rows), its logits shard and its forward scratch */
typedef struct kd_seq_rank {
    kd_act *cache;                 /* n_layers */
    kd_act logits;                 /* [out_cap, vocab/tp] f32: vocab ids [rank * vocab/tp, ...) */
    void *gather;                  /* tp > 1: every rank's shard of up to KD_GATHER_ROWS rows, then (rank 0)
                                      the same rows whole: kd_seq_rows_whole (forward.h) */
    kd_act taps;                   /* [out_cap, n_taps*hidden] act dtype (when a drafter is attached): the
                                      drafter's tap features, kept by every rank for its part of it */
    void *scratch;                 /* the forward's plan for out_cap rows (forward.h) */
} kd_seq_rank;

struct kd_seq {
    kd_model *model;
    int capacity, len, pending;    /* pending: rows written by a masked forward, not committed */
    kd_seq_rank *rk;               /* [model->tp] */
    /* outputs of the last forward */
    int out_rows, out_cap;
    int32_t *out_positions;        /* host copy of the positions of the last forward */
    size_t scratch_bytes;          /* each rank's */
    /* DDTree round state */
    kd_seq_phase phase;
    int32_t accepted[1024];
    int n_accepted;
    /* the attached drafter */
    struct kd_drafter *drafter;
    kd_draft_state *draft;
    /* step graphs (CUDA graphs of decode / verify steps; model.c), NULL when off */
    struct kd_seq_graphs *graphs;
    kd_graphs_mode draft_graphs;   /* asked for the draft pass (kd_seq_options), resolved at attach */
};

/* Model forward over n tokens (internal form of kd_forward; taps_rows: which layer outputs to keep).
 * tokens NULL (masked forwards only): the inputs are already in the sequence's scratch regions
 * ids, pos and vis (forward.h), staged on the backend by kd_verify; out_positions become -1. */
kd_status kd_model_forward(kd_seq *s, const int32_t *tokens, int n, const int32_t *positions,
                           const uint64_t *visible);
#endif
