/* plan.h: the tensor-parallel split of a model's weights and the per-rank memory plan
 * (core/plan.c), private to the core. The public side is kd_plan (kdtree.h).
 *
 * The split (docs/architecture.md, shared/reference/multi_gpu.md): q_b / kv_b (and q_proj
 * without a q LoRA) by heads, their output rows; o_proj by its input columns; the dense MLP,
 * shared and routed experts on the intermediate dim (gate/up rows, down input columns);
 * lm_head by vocab rows; everything else (q_a, kv_a, the latent norms, layer norms, router
 * and its bias, embedding) replicated. The loader slices by kd_split_of and refuses a tp with
 * kd_plan_check_tp, so the plan and the load agree on every tensor. */
#ifndef KD_PLAN_H
#define KD_PLAN_H
#include "model.h"

typedef enum kd_split {
    KD_SPLIT_NONE = 0,   /* replicated: every rank holds the whole tensor */
    KD_SPLIT_ROWS,       /* rank r holds output rows [r*rows/tp, (r+1)*rows/tp) */
    KD_SPLIT_COLS        /* rank r holds input columns [r*cols/tp, (r+1)*cols/tp) */
} kd_split;
/* a target tensor's split from its checkpoint name (module or "...weight" names alike); the
 * drafter's own tensors are not split (its layers run whole on rank 0; its head is the target's
 * lm_head, split as here) */
kd_split kd_split_of(const char *name);

/* KD_OK when tp ranks split every split dim of cfg whole (heads; dense, shared and routed
 * widths, INT4 experts in whole scale groups of whole 8-code words; vocab); else KD_ERR_ARG
 * naming the config field, its value and tp */
kd_status kd_plan_check_tp(const kd_config *cfg, int tp);
/* the widths one of tp ranks holds (cfg's split widths / tp); tp must pass kd_plan_check_tp */
kd_widths kd_widths_of(const kd_config *cfg, int tp);

/* weight classes, as kd_inspect and kd_model_memory count them */
typedef enum kd_wkind { KD_WK_ATTN, KD_WK_DENSE, KD_WK_SHARED, KD_WK_ROUTED, KD_WK_ROUTER, KD_WK_EMBED,
                        KD_WK_LMHEAD, KD_WK_NORM, KD_WK_N } kd_wkind;

/* the loader's walk without loading (model_load.c) */
typedef struct kd_tally {
    uint64_t stored[KD_WK_N];       /* bytes as the checkpoint stores them (INT4: codes, scales, weight_shape) */
    uint64_t rank[KD_WK_N];         /* one rank's share in the backend's form (no weight_shape; F16 held as F32) */
    uint64_t replicated[KD_WK_N];   /* of rank: tensors every rank holds whole */
    uint64_t routed_read;           /* stored routed-expert bytes one token reads (top_k of n per layer) */
    uint64_t embed_row;             /* stored bytes of one embedding row */
    int n_used;                     /* tensors the walk used */
} kd_tally;
/* set NULL: no weight files, every tensor as the config implies it (BF16 matrices and norms,
 * F32 router bias, compressed-tensors INT4 triples where quantization_config quantizes);
 * else the headers' dtypes, shapes and bytes, checked as kd_model_open checks them.
 * tp must pass kd_plan_check_tp first (the shares are exact then). */
/* dir's config.json and, when dir has weight files, their headers (set left empty and *files
 * false when it has none); on failure nothing stays open (model_load.c) */
kd_status kd_open_headers(const char *dir, kd_config *cfg, kd_st_set *set, bool *files);
kd_status kd_weights_tally(const kd_config *cfg, const kd_st_set *set, const char *dir, int tp, kd_tally *out);

/* The plan of one rank for tp ranks from the config's dims alone, before any weight is read:
 * KD_ERR_ARG for a tp that does not split (kd_plan_check_tp), KD_ERR_NOMEM naming the rank,
 * the bytes it needs and the bytes available when device_bytes > 0 and it does not fit; *out
 * is filled whenever the split is valid. */
kd_status kd_plan_tp(const kd_config *cfg, int tp, uint64_t device_bytes, int capacity, kd_plan_report *out);
#endif
