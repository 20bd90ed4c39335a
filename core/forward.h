/* forward.h: the scratch plan of a sequence, shared by seq.c (which allocates it)
 * and model.c (which runs the forward in it). Private to the core.
 *
 * FlashInfer-style: the layout is planned once on the host for `rows` tokens per
 * forward (the sequence's out_cap) and allocated once in backend memory by
 * kd_seq_new; a forward never allocates. Every region is 256-byte aligned. */
#ifndef KD_FORWARD_H
#define KD_FORWARD_H
#include "model.h"

/* the most tokens one forward chunk holds (out_cap <= this) */
enum { KD_SEQ_MAX_ROWS = 1024 };
/* tp > 1: the most logits rows gathered whole at a time on rank 0 (kd_seq_rows_whole), so that
 * accept and sampling run there; each rank holds two buffers of this many whole rows: the
 * shards' all-gather, and (used on rank 0) the rows laid out */
enum { KD_GATHER_ROWS = 32 };

/* the bytes of those buffers on each rank (0 at tp 1): what the plan and kd_model_memory count */
static inline uint64_t kd_gather_bytes(int tp, int out_cap, int vocab) {
    int rows = out_cap < KD_GATHER_ROWS ? out_cap : KD_GATHER_ROWS;
    return tp > 1 ? 2u * (uint64_t)rows * (uint64_t)vocab * sizeof(float) : 0;
}

typedef struct kd_fwd_plan {
    int rows;                 /* tokens per forward chunk (the sequence's out_cap) */
    int words;                /* uint64 words per visibility row: ceil(rows / 64) */
    /* byte offsets into s->scratch; dlen, ids, pos, vis come first and in this order: every
     * forward chunk uploads them as one span (forward_chunk, model.c) */
    size_t dlen;                          /* int32: the sequence length a step starts at (graph steps) */
    size_t ids, pos, vis, idx;            /* int32 [rows], int32 [rows], uint64 [rows*words], int32 [rows] */
    size_t x, h, t1, t2;                  /* [rows, hidden]: residual, normed input, two block outputs
                                           * (fp32 partial sums at tp > 1) */
    size_t qkva;                          /* [rows, q_lora_rank + r+dr]: q_a's output (q_lora only), kv_a's */
    size_t q;                             /* [rows, H*(dn+dr)] */
    size_t qfull;                         /* [rows, H*(r+dr)]: per head [q_lat | q_pe], the MQA query */
    size_t lat;                           /* [rows, H*r]: q_lat, then reused for o_lat */
    size_t o;                             /* [rows, H*dv] */
    size_t mlp_act;                       /* [rows, max(intermediate, shared width)]: silu(gate) * up */
    size_t tmp;                           /* [rows, r+dr] fp32-sized: compaction and read_cache staging */
    size_t bytes;
} kd_fwd_plan;

void kd_fwd_plan_make(const kd_model *m, int rows, kd_fwd_plan *p);
/* the same plan from a config, one rank's widths (model.h: kd_widths; the whole model's at tp = 1)
 * and an activation size in bytes: kd_fwd_plan_make for a loaded model, kd_plan for a rank's scratch */
void kd_fwd_plan_of(const kd_config *c, const kd_widths *w, size_t act_size, int rows, kd_fwd_plan *p);
/* the type a rank's block outputs (o_proj's, the MLPs') are written in: fp32 partial sums at
 * tp > 1 when activations are narrower, so that the all-reduce adds what each rank's GEMM
 * accumulated and the sum is rounded to the activation type once, by the residual add, as one
 * device's GEMM rounds it; the activation type itself at tp 1 */
static inline kd_dtype kd_partial_dtype(int tp, kd_dtype act) {
    return tp > 1 && kd_dtype_size(act) < 4 ? KD_F32 : act;
}
/* x += the sum of every rank's part (part itself at tp 1: m->comm NULL), rounded once to x's
 * type; then, when norm is not NULL, h = rmsnorm(x; norm) in the same pass (add_rmsnorm).
 * Rank r's thread, its backend be. The target's forward and the drafter's draft pass. */
kd_status kd_add_reduced(const kd_model *m, int r, kd_backend *be, kd_act part, kd_act x, const kd_weight *norm,
                         float eps, kd_act h);
/* the output of a weight split over the ranks, whole again (tp > 1): every rank's part (a
 * contiguous [rows, w] view) all-gathered into `all` (tp slots), then, where dst is not NULL, laid
 * side by side into dst's columns, rank j's at [j w, (j+1) w). Rank r's thread, its backend be. The
 * drafter's logit shards and fc columns; the target's logit rows for accept and sampling. */
kd_status kd_gather_columns(const kd_model *m, int r, kd_backend *be, kd_act part, void *all, const kd_act *dst);
/* the region at byte offset off of a rank's scratch as an activation view [rows, cols] (ld = cols) */
kd_act kd_fwd_act(void *scratch, size_t off, int rows, int cols, kd_dtype dt);
/* kd_seq_compact with the kept slots' offsets from start already in backend memory
 * (d_keep[0..n_keep), n_keep <= out_cap, valid: kd_accept's walk on the backend made them) */
kd_status kd_seq_compact_staged(kd_seq *s, int start, const int32_t *d_keep, int n_keep);
/* rows [row0, row0 + n) of the last forward's logits, whole, on rank 0's backend: *out is rank 0's
 * [n, vocab] fp32 view. At tp 1 the logits themselves; at tp > 1 (n <= KD_GATHER_ROWS) every rank's
 * vocabulary shard of them gathered (kd_gather_columns, on every rank's thread), valid until the
 * next gather or forward. kd_whole_rows_chunk: how many rows a call takes, of n wanted. */
kd_status kd_seq_rows_whole(kd_seq *s, int row0, int n, kd_act *out);
static inline int kd_whole_rows_chunk(const kd_model *m, int n) { return m->tp > 1 ? KD_GATHER_ROWS : n; }

/* Step graphs (model.c). The mode a sequence runs (kd_graphs_mode, kdtree.h), resolved when it is
 * created: OFF: every step as before; CAPTURE: decode (causal T = 1) and verify (masked) steps
 * read the length on the device and are captured as graphs (first use of a shape runs
 * eagerly, the second captures, later ones replay); EAGER: the device-length path without
 * capture (a diagnostic: it isolates the kernels from the capture). Needs the backend's
 * optional graph ops (CUDA); elsewhere the mode is OFF. DEFAULT is CAPTURE, since the H200 run of
 * spec/graphs_spec.lua (2026-11-30) showed graph replay bit-identical to eager steps
 * (docs/architecture.md "Step graphs"). Returns OFF, CAPTURE or EAGER. */
kd_graphs_mode kd_graphs_resolve(const kd_backend *be, kd_graphs_mode asked);
/* s->graphs: the host staging of every forward's inputs, and the step graphs in graph mode */
kd_status kd_seq_graphs_new(kd_seq *s, kd_graphs_mode mode);
void kd_seq_graphs_free(kd_seq *s);
#endif
