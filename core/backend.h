/* backend.h: the backend interface (a table of function pointers, ggml-backend style).
 *
 * The model code (model.c, drafter.c) is written once against these ops; the CPU
 * backend (cpu/) is the readable specification in fp32, the CUDA backend (cuda/)
 * the fast path with bf16 activations and fp32 accumulation. Every op here has a
 * CPU twin and a spec comparing the two.
 *
 * Memory: pointers handed to ops live in the backend's memory (host memory for the
 * CPU backend, device memory for CUDA). Ops are asynchronous on the backend's
 * stream; download() and sync() wait.
 */
#ifndef KD_BACKEND_H
#define KD_BACKEND_H
#include "kdtree.h"
#include <stdbool.h>

typedef enum kd_dtype { KD_F32, KD_F16, KD_BF16, KD_I32, KD_I64 } kd_dtype;
size_t kd_dtype_size(kd_dtype t);
const char *kd_dtype_name(kd_dtype t);

/* A weight matrix [rows = out, cols = in] (vectors: rows = n, cols = 1). */
typedef enum kd_wformat { KD_W_BF16, KD_W_F32, KD_W_INT4 } kd_wformat;
typedef struct kd_weight {
    const char *name;        /* checkpoint name, kept for error messages (points into the loader's table) */
    kd_wformat format;
    int64_t rows, cols;
    int group;               /* INT4: scale group along cols */
    const void *src;         /* mapped checkpoint bytes: bf16/f32 [rows, cols], or int32 [rows, cols/8] */
    const void *src_scale;   /* INT4: bf16 [rows, cols/group] */
    int64_t ld;              /* elements from one row of src to the next: the full tensor's width when the
                              * weight is a column slice of it (a rank's part of o_proj or down; INT4 codes
                              * then step ld/8 words and scales ld/group); 0 = cols (rows are packed) */
    void *dev;               /* the backend's form; CPU uses src directly */
    void *dev_scale;
} kd_weight;
/* the row stride of w->src in elements (kd_weight.ld) */
static inline int64_t kd_weight_ld(const kd_weight *w) { return w->ld ? w->ld : w->cols; }
/* a weight's bytes as the checkpoint stores them: its values, and (INT4) its bf16 scales */
static inline uint64_t kd_weight_value_bytes(const kd_weight *w) {
    uint64_t n = (uint64_t)w->rows * (uint64_t)w->cols;
    return w->format == KD_W_INT4 ? n / 2 : w->format == KD_W_F32 ? 4 * n : 2 * n;
}
static inline uint64_t kd_weight_scale_bytes(const kd_weight *w) {
    return w->format == KD_W_INT4 && w->group > 0 ? (uint64_t)w->rows * (uint64_t)w->cols / (uint64_t)w->group * 2 : 0;
}
static inline uint64_t kd_weight_bytes(const kd_weight *w) { return kd_weight_value_bytes(w) + kd_weight_scale_bytes(w); }
/* what a weight counts for in the memory tallies (both backends' and kd_model_memory's walk):
 * kd_weight_bytes once it is loaded (w->dev set), else 0 */
static inline uint64_t kd_weight_held(const kd_weight *w) { return w->dev ? kd_weight_bytes(w) : 0; }

/* A row-major activation view: element (r, c) at data + (r*ld + c)*size(dtype). */
typedef struct kd_act {
    void *data;
    int rows, cols, ld;
    kd_dtype dtype;
} kd_act;

/* RoPE parameters: inverse frequencies (dim/2 floats, in backend memory) and the
 * cos/sin amplitude. interleaved: pairs (2i, 2i+1) (MLA); else rotate-half pairs (i, i+dim/2). */
typedef struct kd_rope {
    int dim;
    bool interleaved;
    float attn_factor;
    const float *inv_freq;
} kd_rope;

/* The routed experts of one MoE layer. */
typedef struct kd_experts {
    int n, top_k, n_group, topk_group;
    bool norm_topk_prob;
    float routed_scaling_factor;
    const kd_weight *router;       /* [n, hidden] */
    const float *bias;             /* e_score_correction_bias, n floats in backend memory (NULL: none) */
    kd_weight *gate, *up, *down;   /* n each */
    void *table;                   /* the backend's own per-layer form (CUDA: pointer tables), or NULL */
} kd_experts;

/* what a backend holds now (mem_usage) */
typedef struct kd_mem_usage {
    uint64_t weights;        /* weight_load'ed weights */
    uint64_t buffers;        /* alloc() buffers not yet freed */
    uint64_t workspace;      /* the backend's own scratch */
    uint64_t device_free, device_total;
} kd_mem_usage;

/* A DDTree in backend memory (core/tree.c lays it out in one buffer; docs/ddtree.md).
 * Node 0 is the root, drafted nodes 1..n in pop order; arrays of 1+cap entries unless noted. */
typedef struct kd_dtree {
    int cap;                       /* drafted nodes it can hold (root excluded) */
    int topk_cap;                  /* entries of vals / ids */
    int32_t *token, *parent, *depth;
    int32_t *pos;                  /* positions of the verify forward: pos0 + depth */
    uint64_t *vis;                 /* (1+n) rows of ceil((1+n)/64) words: the ancestor-only mask */
    int32_t *target;               /* accept: the target token of each node */
    int32_t *row_status;           /* accept: 0, or the sampling error code of the node's row */
    int32_t *status;               /* KD_DTREE_STATUS words: build error (0/1), its index, n built, path */
    int32_t *result;               /* accept: KD_DTREE_HDR header words, nodes[1+cap], tokens[1+cap] */
    float *vals;                   /* a build's per-depth top-K lists, topk_cap entries */
    int32_t *ids;
} kd_dtree;
/* the depth limit L of a tree build (tree_select's rank tuples, entry_before, hold this many) */
enum { KD_TREE_MAX_DEPTH = 64 };
/* the accept result's header words */
enum { KD_DTREE_HDR = 8, KD_DTREE_STATUS = 4 };
enum { KD_DTREE_R_STATUS = 0,   /* 0, or the sampling error code of the failing node's row */
       KD_DTREE_R_NODE = 1,     /* the failing node */
       KD_DTREE_R_POS = 2,      /* its sampling position */
       KD_DTREE_R_TAU = 3, KD_DTREE_R_BONUS = 4,
       KD_DTREE_R_N = 5,        /* nodes the walk saw (a check) */
       KD_DTREE_R_BUILD = 6 };  /* the build status word 0 (a NaN / +inf draft value) */

typedef struct kd_backend kd_backend;

/* The compute ops, listed once: X(name, parameters, arguments). Everything that enumerates them
 * is generated from this list: the op table's entries below, each backend's declarations of its
 * kd_<backend>_<name> (cpu/cpu.h, cuda/cuda_internal.cuh) and its table (cpu/cpu_backend.c;
 * cuda/backend.cu, where each entry first makes the device current), and the specs' FFI view
 * (spec/helpers/backend.lua).
 * Adding an op is a line here and its implementations; every backend implements every op, and
 * spec/op_coverage_spec.lua fails until the new op is compared with its CPU twin on CUDA. */
#define KD_BACKEND_OPS(X)                                                                                     \
    /* elementwise and data movement */                                                                      \
    X(copy, (kd_backend *be, kd_act dst, kd_act src), (be, dst, src))          /* same shape, converts dtype */ \
    X(embed, (kd_backend *be, const kd_weight *table, const int32_t *ids, kd_act out), (be, table, ids, out))  \
    /* x += y and x += s*y, with y first rounded to x's dtype (a rank's fp32 partial sums are added as    \
     * the bf16 one device's GEMM would have stored: tp > 1 adds what tp = 1 adds) */                       \
    X(add, (kd_backend *be, kd_act x, kd_act y), (be, x, y))                    /* x += y */                     \
    X(scale_add, (kd_backend *be, kd_act x, kd_act y, float s), (be, x, y, s))  /* x += s*y */                   \
    X(swiglu, (kd_backend *be, kd_act gate, kd_act up, kd_act out), (be, gate, up, out))   /* silu(gate)*up */   \
    /* out = x * rsqrt(mean(x^2)+eps) * w, in fp32; rows may be heads (x viewed [rows*k, cols/k]) */          \
    X(rmsnorm, (kd_backend *be, kd_act x, const kd_weight *w, float eps, kd_act out), (be, x, w, eps, out))    \
    /* x += y (y rounded to x's dtype, as add), then out = rmsnorm(x) * w over whole rows (w has x.cols  \
     * entries; out must not alias x):                                                                      \
     * the residual add and the next norm in one pass, the bits of add followed by rmsnorm */               \
    X(add_rmsnorm, (kd_backend *be, kd_act x, kd_act y, const kd_weight *w, float eps, kd_act out),             \
      (be, x, y, w, eps, out))                                                                               \
    /* in place on dims [offset, offset+r->dim) of each of n_heads blocks of head_stride cols */             \
    X(rope, (kd_backend *be, kd_act x, int n_heads, int head_stride, int offset, const int32_t *pos,          \
             const kd_rope *r), (be, x, n_heads, head_stride, offset, pos, r))                               \
    /* MLA's rope parts and its new latent rows, in one pass after q_b and kv_a (model.c): with d = r->dim,  \
     * qs = q.cols / n_heads and fs = qfull.cols / n_heads, qfull[t, h*fs + fs-d ..] = rope(q[t, h*qs + qs-d  \
     * ..]) (the query's rope part beside its absorbed latent; qfull's other columns are left as they are),   \
     * and cache row row0 + (d_len ? *d_len : 0) + t = [rmsnorm(kva[t, :c]) * w | rope(kva[t, c:])] with      \
     * c = kva.cols - d. The bits of rope and rmsnorm each alone (what it replaces: two ropes, a norm, the    \
     * copies and the store) */                                                                              \
    X(mla_rope_store, (kd_backend *be, kd_act q, kd_act qfull, int n_heads, kd_act kva, const kd_weight *w,     \
                       float eps, const int32_t *pos, const kd_rope *r, kd_act cache, int row0,             \
                       const int32_t *d_len),                                                                \
      (be, q, qfull, n_heads, kva, w, eps, pos, r, cache, row0, d_len))                                       \
    /* rows[i] of src -> rows dst_row0+i of dst (KV compaction gathers) */                                   \
    X(gather_rows, (kd_backend *be, kd_act dst, kd_act src, const int32_t *rows, int n), (be, dst, src, rows, n)) \
    /* the KV compaction of a commit in every layer at once: in each of the n_caches views (one shape and  \
     * dtype), rows dst0 + i <- rows src0 + rows[i] for i < n (rows in backend memory, strictly increasing,  \
     * dst0 + i <= src0 + rows[i], checked by the caller): each row moves toward row 0 or stays, so copying \
     * in the order of i overwrites no row still to be read */                                             \
    X(move_rows, (kd_backend *be, const kd_act *caches, int n_caches, int src0, const int32_t *rows, int n,     \
                  int dst0), (be, caches, n_caches, src0, rows, n, dst0))                                      \
    /* src rows i -> dst rows *d_len + i (same dtype; dst spans the whole cache; d_len in backend memory) */ \
    X(store_rows_at, (kd_backend *be, kd_act dst, const int32_t *d_len, kd_act src), (be, dst, d_len, src))  \
                                                                                                             \
    /* matrix products */                                                                                    \
    X(linear, (kd_backend *be, kd_act x, const kd_weight *w, kd_act out), (be, x, w, out))   /* out = x w^T */ \
    /* out = x [w0; w1]^T: two weights of the same input width stacked by rows, out's first w0->rows      \
     * columns from w0 (one launch on CUDA: q_a with kv_a, an MLP's gate with its up) */                   \
    X(linear_pair, (kd_backend *be, kd_act x, const kd_weight *w0, const kd_weight *w1, kd_act out),        \
      (be, x, w0, w1, out))                                                                                  \
    /* out = silu(x gate^T) * (x up^T), each product rounded to out's dtype first: the bits of linear_pair \
     * into out's dtype followed by swiglu (one launch on CUDA, the product never stored) */               \
    X(linear_swiglu, (kd_backend *be, kd_act x, const kd_weight *gate, const kd_weight *up, kd_act out),     \
      (be, x, gate, up, out))                                                                                \
    /* per head h: out[:, h*ostride : h*ostride+ocols] = x[:, h*xstride : h*xstride+k] @ W_h, where W_h is  \
     * rows [h*wstride + wrow0, +k) of w (transposed = false: W_h is k x ocols, out = x W_h) or (transposed   \
     * = true: W_h is ocols x k rows, out = x W_h^T). MLA absorption uses both; ostride > ocols writes the   \
     * absorbed query beside its rope part (out's other columns are left as they are). */                  \
    X(head_matmul, (kd_backend *be, kd_act x, int n_heads, int xstride, int k, const kd_weight *w, int wstride, \
                    int wrow0, bool transposed, kd_act out, int ocols, int ostride),                         \
      (be, x, n_heads, xstride, k, w, wstride, wrow0, transposed, out, ocols, ostride))                      \
                                                                                                             \
    /* attention. q: [T, Hq*dq]; keys/values: kv rows [0, S), key = first dk cols, value = first dv cols of  \
     * the value view; Hkv groups (Hq % Hkv == 0). Query t sits at cache row past+t. visible: NULL with      \
     * causal = true: query t sees rows <= past+t; causal = false: all rows; else bits (T rows, ceil(T/64)   \
     * words) over the last T rows, rows < past always visible. window > 0: key row r visible only when      \
     * pos_q - pos_k < window (positions = rows). */                                                         \
    X(attention, (kd_backend *be, kd_act q, int n_heads, int head_dim, kd_act k, kd_act v, int n_kv_heads,     \
                  int past, bool causal, const uint64_t *visible, int window, float scale, kd_act out),      \
      (be, q, n_heads, head_dim, k, v, n_kv_heads, past, causal, visible, window, scale, out))               \
    /* attention with past = *d_len (backend memory) and S = past + q.rows; k and v span the whole cache     \
     * (their rows are the bound); bit-identical to attention at that past. A step that reads its length    \
     * this way is the same at every length, so it can be captured once (docs/architecture.md) */           \
    X(attention_at, (kd_backend *be, kd_act q, int n_heads, int head_dim, kd_act k, kd_act v, int n_kv_heads,  \
                     const int32_t *d_len, bool causal, const uint64_t *visible, int window, float scale,     \
                     kd_act out),                                                                            \
      (be, q, n_heads, head_dim, k, v, n_kv_heads, d_len, causal, visible, window, scale, out))              \
                                                                                                             \
    /* mixture of experts: out = sum_j w_j expert_{idx_j}(x); then, unless shared.data is NULL, out +=     \
     * shared as add does (shared: out's shape and dtype, not aliasing it; the shared expert's output,       \
     * computed before the routed ones so that their sum adds it: a launch fewer than a separate add, the    \
     * same bits) */                                                                                         \
    X(moe, (kd_backend *be, kd_act x, const kd_experts *e, kd_act shared, kd_act out), (be, x, e, shared, out)) \
                                                                                                             \
    /* rows of logits -> log_softmax in place (fp32) */                                                      \
    X(log_softmax, (kd_backend *be, kd_act x), (be, x))                                                      \
    /* one id per row (ties: the lower id); a row holding NaN or +inf gets -code instead, the code          \
     * (sample_rule.h: kind | column << 2) of its first such column, for the caller to report */           \
    X(argmax, (kd_backend *be, kd_act x, int32_t *out), (be, x, out))                                        \
    /* per row the k largest values, descending; equal values: lower id first */                             \
    X(topk, (kd_backend *be, kd_act x, int k, float *vals, int32_t *ids), (be, x, k, vals, ids))             \
                                                                                                             \
    /* the DDTree round (docs/ddtree.md; CPU: cpu/cpu_ddtree.c, CUDA: cuda/ddtree.cu).                      \
     * tree_select: Algorithm 1 on the per-depth top-K lists t->vals/ids [L, K] (rows descending): nodes    \
     * 1..n (token, parent, depth), node 0's parent -1 and depth 0, the ancestor mask of the 1+n rows,      \
     * t->status = {0 or 1 (a NaN / +inf list value), its index, n, how it selected: 0 one node at a time,  \
     * 1 in parallel (docs/ddtree.md)}, where n = min(budget, K + K^2 + ... + K^L). KD_ERR_UNSUPPORTED: a     \
     * budget the backend cannot hold (the caller builds on the host instead). */                           \
    X(tree_select, (kd_backend *be, const kd_dtree *t, int L, int K, int budget), (be, t, L, K, budget))     \
    /* token[0] = root and pos[i] = pos0 + depth[i] for nodes 0..n; when ids is not NULL also the verify    \
     * forward's inputs ids[i] = token[i], pos_out[i] = pos[i] and the (1+n) x ceil((1+n)/64) mask words    \
     * into vis_out (the sequence's scratch regions) */                                                     \
    X(tree_stage, (kd_backend *be, const kd_dtree *t, int n, int32_t root, int32_t pos0, int32_t *ids,        \
                   int32_t *pos_out, uint64_t *vis_out), (be, t, n, root, pos0, ids, pos_out, vis_out))      \
    /* one keyed draw per row of fp32 logits (sample.c's rule; sp not greedy) at position pos[i] +          \
     * pos_offset: out[i] the token, code[i] 0 or the row's error (sample_rule.h) */                        \
    X(sample_rows, (kd_backend *be, kd_act logits, const kd_sampler *sp, const int32_t *pos, int pos_offset,  \
                    int32_t *out, int32_t *code), (be, logits, sp, pos, pos_offset, out, code))              \
    /* the accept walk over nodes 0..n from the root along t->target (stopping at a node whose              \
     * t->row_status is set when sampled): writes t->result */                                              \
    X(tree_walk, (kd_backend *be, const kd_dtree *t, int n, int sampled), (be, t, n, sampled))

typedef struct kd_backend_ops {
    const char *name;
    void (*destroy)(kd_backend *be);

    /* memory */
    kd_status (*alloc)(kd_backend *be, size_t bytes, void **ptr);    /* zero-filled */
    void (*free)(kd_backend *be, void *ptr);
    kd_status (*upload)(kd_backend *be, void *dst, const void *src, size_t bytes);
    kd_status (*download)(kd_backend *be, void *dst, const void *src, size_t bytes);
    kd_status (*sync)(kd_backend *be);
    kd_status (*weight_load)(kd_backend *be, kd_weight *w);     /* w->src -> w->dev */
    void (*weight_free)(kd_backend *be, kd_weight *w);
    kd_status (*experts_load)(kd_backend *be, kd_experts *e);   /* after weight_load of each expert */
    void (*experts_free)(kd_backend *be, kd_experts *e);
    /* memory accounting: the backend's totals (a loaded weight counts as kd_weight_bytes) */
    void (*mem_usage)(kd_backend *be, kd_mem_usage *out);

    /* the compute ops (KD_BACKEND_OPS) */
#define KD_OP_ENTRY(name, params, args) kd_status (*name) params;
    KD_BACKEND_OPS(KD_OP_ENTRY)
#undef KD_OP_ENTRY

    /* ---- step graphs: optional, NULL on the CPU backend (docs/architecture.md "Step graphs") ----
     * begin captures the work the following ops enqueue (nothing runs); end stops and returns an
     * executable graph in *graph, or NULL with a failing status when the capture failed (then none
     * of the captured work ran); launch replays it. epoch changes whenever memory a captured graph
     * may point at (the shared workspaces) is reallocated. */
    kd_status (*graph_begin)(kd_backend *be);
    kd_status (*graph_end)(kd_backend *be, void **graph);
    kd_status (*graph_launch)(kd_backend *be, void *graph);
    void (*graph_free)(kd_backend *be, void *graph);
    uint64_t (*graph_epoch)(kd_backend *be);

    /* ---- a branch: optional, NULL where the ops run one after another (the CPU backend) ----
     * The ops issued between branch_begin and branch_end run in order on a second queue, after
     * everything issued before branch_begin, beside the ops issued after branch_end (with their
     * own workspaces). The one reader of a branch's output is `moe`, which waits for the branch
     * before it reads `shared` (model.c, with the model option shared_expert_branch: the shared
     * expert beside the router and the routed experts); download, upload, sync, graph_begin,
     * graph_end, graph_launch and the next branch_begin wait for it too. A
     * branch changes which queue an op runs on, never what it computes. */
    kd_status (*branch_begin)(kd_backend *be);
    kd_status (*branch_end)(kd_backend *be);
} kd_backend_ops;

struct kd_backend {
    const kd_backend_ops *ops;
    kd_backend_kind kind;
    kd_dtype act_dtype;      /* activations: F32 on CPU, BF16 on CUDA */
    int device;
    void *impl;
};

kd_status kd_backend_cpu_create(kd_backend **out);
/* opt: the MLA kernel fields (mla_kernel, mla_value_slices, mla_row_groups), checked by
 * kd_model_options_check; NULL = the defaults */
kd_status kd_backend_cuda_create(int device, const kd_model_options *opt, kd_backend **out);   /* UNSUPPORTED without CUDA */

/* helpers shared by both backends and the model code */
static inline kd_act kd_act_cols(kd_act a, int col0, int ncols) {
    kd_act v = a;
    v.data = (char *)a.data + (size_t)col0 * kd_dtype_size(a.dtype);
    v.cols = ncols;
    return v;
}
static inline kd_act kd_act_rows(kd_act a, int row0, int nrows) {
    kd_act v = a;
    v.data = (char *)a.data + (size_t)row0 * a.ld * kd_dtype_size(a.dtype);
    v.rows = nrows;
    return v;
}
#endif
