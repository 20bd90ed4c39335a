/* kdtree.h: the one public header of the kdtree engine.
 *
 * FFI-clean on purpose: LuaJIT's ffi.cdef reads this file after dropping the
 * lines that start with '#', so everything below the guard is plain C
 * declarations: opaque handles, enums (never #defines), fixed-size ints.
 *
 * Error model: every call that can fail returns a kd_status; on failure
 * kd_last_error() (thread-local) names what failed and where (file, tensor,
 * field, argument) and what was expected. No library function aborts or exits,
 * and a failed call leaves the engine usable.
 */
#ifndef KDTREE_H
#define KDTREE_H
#include <stddef.h>
#include <stdint.h>
/* The library is compiled with -fvisibility=hidden: the declarations of this header are the
 * ones it exports (with build/kdtree.map, the version script made from them). */
#pragma GCC visibility push(default)
#ifdef __cplusplus
extern "C" {
#endif

typedef enum kd_status {
    KD_OK = 0,
    KD_ERR_IO = 1,          /* a file is missing, unreadable or truncated */
    KD_ERR_FORMAT = 2,      /* a file's content is malformed (header, offsets, dtype, shape) */
    KD_ERR_CONFIG = 3,      /* config.json is missing a field or is inconsistent */
    KD_ERR_ARG = 4,         /* a bad argument (token id, budget, shape, NULL) */
    KD_ERR_STATE = 5,       /* a call out of order (accept before verify, commit twice, closed handle) */
    KD_ERR_NOMEM = 6,       /* host or device memory exhausted */
    KD_ERR_CAPACITY = 7,    /* a sequence would grow past its capacity */
    KD_ERR_BACKEND = 8,     /* a backend (CUDA, cuBLAS, NCCL) call failed */
    KD_ERR_UNSUPPORTED = 9  /* valid input this build cannot run (backend not compiled in) */
} kd_status;

typedef enum kd_backend_kind {
    KD_BACKEND_CPU = 0,
    KD_BACKEND_CUDA = 1
} kd_backend_kind;

typedef struct kd_model kd_model;       /* a loaded target model (weights on one backend) */
typedef struct kd_drafter kd_drafter;   /* a loaded DFlash drafter bound to one target model */
typedef struct kd_seq kd_seq;           /* one sequence: latent KV cache, outputs, drafter context */
typedef struct kd_tree kd_tree;         /* a draft tree: root + nodes in pop order */

/* ---- errors and build facts ---- */
const char *kd_last_error(void);
const char *kd_status_name(kd_status s);
const char *kd_version(void);
int kd_backend_available(kd_backend_kind kind);
uint64_t kd_time_ns(void);               /* monotonic clock, for per-stage timing */

/* ---- model ---- */
/* Step graphs: a decode / verify step (and a DFlash draft pass) captured once per shape and
 * replayed (CUDA graphs); the lengths they need are read from backend memory when they run. */
typedef enum kd_graphs_mode {
    KD_GRAPHS_DEFAULT = 0,   /* capture where the backend has graph ops (CUDA), else off; in
                                kd_seq_options: the model's choice */
    KD_GRAPHS_CAPTURE = 1,   /* as the default, said explicitly */
    KD_GRAPHS_OFF = 2,       /* every step eager, its lengths passed from the host */
    KD_GRAPHS_EAGER = 3      /* the graph path's kernels (lengths from backend memory), never captured;
                                every backend, the CPU's too */
} kd_graphs_mode;

/* Where the DDTree round (tree selection, the accept walk, the sampling of a verify's rows and
 * the compaction it drives) runs. */
typedef enum kd_ddtree_round {
    KD_ROUND_DEFAULT = 0,    /* on the backend */
    KD_ROUND_BACKEND = 1,    /* on the backend's ops: no tree data travels through the host */
    KD_ROUND_HOST = 2        /* on the host: top-K lists, logits rows or argmax ids and the accepted
                                ids travel through the host */
} kd_ddtree_round;

/* The CUDA backend's MLA attention kernel (the CPU backend has one kernel and ignores these). */
typedef enum kd_mla_kernel {
    KD_MLA_DEFAULT = 0,      /* the tensor-core kernel where the shape allows, else the CUDA-core one */
    KD_MLA_CUDA_CORES = 1    /* every shape on the CUDA-core kernel */
} kd_mla_kernel;

/* the most ranks (devices) one model spans */
enum { KD_TP_MAX = 8 };
/* Zero-initialised options are the defaults (FFI users may pass NULL). */
typedef struct kd_model_options {
    kd_backend_kind backend;
    int tp;                  /* ranks (tensor-parallel width) 1..8; 0 or 1 = one */
    int devices[8];          /* CUDA: the device of each rank */
    int n_device_list;       /* entries of devices used (0 = devices 0..tp-1; else exactly tp) */
    /* load progress: called only on the thread that called kd_model_open (NULL = none) */
    void (*progress)(void *ctx, int rank, uint64_t done, uint64_t total);
    void *progress_ctx;
    kd_graphs_mode graphs;        /* step graphs of decode / verify steps */
    kd_graphs_mode draft_graphs;  /* of the draft pass; DEFAULT = as `graphs` */
    int graphs_verbose;           /* nonzero: a capture that fails says why on stderr */
    kd_ddtree_round ddtree_round;
    kd_mla_kernel mla_kernel;
    int mla_value_slices;    /* tensor-core kernel on small grids: 0 = by the shape rule; -1 = no
                                split (2-warp 16-row blocks, unsplit 64-row ones); 1, 2 or 4 = that
                                many value slices of 8-warp blocks where they fit (tests, benches) */
    int mla_row_groups;      /* row groups per block: 0 = by the shape rule; 1 or 4 = forced where
                                the shared memory fits (tests, benches) */
    int shared_expert_branch;   /* a MoE layer's shared expert beside its router and routed experts
                                   (CUDA: on a second stream) or in line before them, the same bits
                                   either way: 0 = beside in steps of up to 32 rows, where it pays
                                   (GPU A/B), in line in larger ones; 1 = always beside; -1 = always
                                   in line */
} kd_model_options;

typedef struct kd_model_info {
    int n_layers, first_k_dense, hidden, vocab;
    int n_heads, q_lora_rank, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim;
    int intermediate, moe_intermediate, n_experts, n_experts_per_tok, n_shared_experts;
    int n_group, topk_group, norm_topk_prob;
    int expert_bits, expert_group;       /* 4 / 32 for compressed-tensors experts; 16 / 0 for bf16 */
    int max_positions;
    float rms_norm_eps, routed_scaling_factor, rope_theta, softmax_scale;
    int n_eos, eos[8];
    int bos;
    kd_backend_kind backend;
    uint64_t bytes_weights;              /* bytes the backends hold for weights (every rank's) */
    /* the tensor-parallel split: ranks, and the widths each rank holds */
    int tp, heads_per_rank, intermediate_per_rank, moe_intermediate_per_rank, vocab_per_rank;
} kd_model_info;

/* Bytes of a checkpoint by kind, from config.json and the safetensors headers
 * only: nothing is mapped or loaded. Works for checkpoints that cannot be loaded here. */
typedef struct kd_inspect_report {
    kd_model_info info;
    int n_tensors, n_files, n_skipped;   /* skipped: other towers (vision, projector) */
    uint64_t bytes_attention, bytes_dense_mlp, bytes_shared_experts, bytes_routed_experts,
             bytes_router, bytes_embed, bytes_lm_head, bytes_norms, bytes_total;
    uint64_t bytes_per_token_kv;         /* latent cache bytes per token (bf16, all layers) */
    uint64_t bytes_read_per_token;       /* weight bytes one batch-1 decode step reads */
} kd_inspect_report;

kd_status kd_inspect(const char *dir, kd_inspect_report *out);

/* One rank's device memory for tp ranks of tensor parallelism (docs/architecture.md "The per-GPU
 * plan"), from config.json and, when present, the safetensors headers (else from the config's dims
 * and quantization_config, as kd_inspect). Sized for the CUDA backend: bf16 activations and KV.
 * The split gives every rank the same bytes. A tp that does not split heads, widths (INT4 experts:
 * whole scale groups) or vocab fails with KD_ERR_ARG naming the config field; a plan that does
 * not fit is KD_OK with fits = 0 and message saying by how much. */
typedef struct kd_plan_report {
    int tp;                              /* ranks */
    int capacity, out_cap;               /* one sequence's tokens; its rows per forward (min(capacity, 1024)) */
    int fits;                            /* 1: total + margin <= device_bytes; 0: not; -1: not checked (device_bytes 0) */
    uint64_t device_bytes, margin;       /* per device, as given; what the plan leaves free (docs/architecture.md) */
    uint64_t weights_attention, weights_dense_mlp, weights_shared_experts, weights_routed_experts,
             weights_router, weights_embed, weights_lm_head, weights_norms;   /* one rank's, as the backend holds them */
    uint64_t weights_total;              /* the eight above */
    uint64_t weights_replicated;         /* of weights_total: tensors every rank holds whole */
    uint64_t kv_per_1k;                  /* latent KV cache per 1024 tokens (replicated on every rank) */
    uint64_t kv_cache;                   /* for capacity tokens */
    uint64_t logits;                     /* the logits shard [out_cap, vocab / tp] fp32 */
    uint64_t scratch;                    /* the forward's scratch for out_cap rows at one rank's widths */
    uint64_t workspace;                  /* the backend's scratch, estimated (docs/architecture.md) */
    uint64_t total;                      /* weights_total + kv_cache + logits + scratch + workspace */
    uint64_t max_capacity;               /* the longest sequence that fits (0: none, or not checked) */
    char message[384];                   /* the verdict in words: bytes needed and available */
} kd_plan_report;
kd_status kd_plan(const char *dir, int tp, uint64_t device_bytes, int capacity, kd_plan_report *out);
kd_status kd_model_open(const char *dir, const kd_model_options *opt, kd_model **out);
void kd_model_close(kd_model *m);
kd_status kd_model_get_info(const kd_model *m, kd_model_info *out);

/* ---- sequences and forward passes ---- */
/* Zero-initialised options are the defaults (NULL is the same). */
typedef struct kd_seq_options {
    int max_rows;                 /* output rows of one forward (a longer causal forward runs in chunks
                                     of this many); 0 = min(capacity, 1024) */
    kd_graphs_mode graphs;        /* DEFAULT = the model's option */
    kd_graphs_mode draft_graphs;  /* DEFAULT = the model's draft_graphs, else this sequence's graphs */
} kd_seq_options;
kd_status kd_seq_new(kd_model *m, int capacity, kd_seq **out);   /* default options */
kd_status kd_seq_new_opts(kd_model *m, int capacity, const kd_seq_options *opt, kd_seq **out);
void kd_seq_free(kd_seq *s);
int kd_seq_len(const kd_seq *s);
int kd_seq_capacity(const kd_seq *s);
/* Forward T new tokens on top of the committed cache.
 * positions: absolute positions, NULL = len, len+1, ...
 * visible: NULL = causal; else T rows of ceil(T/64) uint64 words, bit j of row i
 *          set when new token i may see new token j (the cached past is always visible).
 * A causal forward commits its tokens (len += T); a masked forward (tree verify)
 * writes KV for all T at slots len..len+T-1 and leaves them pending until
 * kd_seq_compact or kd_commit. Logits of all T rows are kept on the backend. */
kd_status kd_forward(kd_seq *s, const int32_t *tokens, int n, const int32_t *positions,
                     const uint64_t *visible);
int kd_seq_out_rows(const kd_seq *s);                       /* rows of the last forward */
kd_status kd_seq_logits(kd_seq *s, int row0, int n_rows, float *dst);   /* n_rows x vocab, fp32 */
kd_status kd_seq_argmax(kd_seq *s, int32_t *dst);          /* one id per output row */
/* Cache: keep slots [0, len) and drop everything after. */
kd_status kd_seq_truncate(kd_seq *s, int len);
/* Cache compaction: slot start+keep[i] moves to start+i (keep strictly increasing,
 * all inside the written slots), then the sequence length becomes start+n_keep. If the
 * backend fails during the moves, the rows from start on are dropped (length start, any
 * round over) and the error says so: the sequence stays consistent and usable. */
kd_status kd_seq_compact(kd_seq *s, int start, const int32_t *keep, int n_keep);
/* Read the cached latent rows [row0, row0+n) of one layer as fp32:
 * n x (kv_lora_rank + qk_rope_dim), c_kv then roped k_pe. For tests and tools. */
kd_status kd_seq_read_cache(kd_seq *s, int layer, int row0, int n, float *dst);
/* the same from one rank's replica of the cache (tensor parallel: every rank holds the latent cache) */
kd_status kd_seq_read_cache_rank(kd_seq *s, int rank, int layer, int row0, int n, float *dst);

/* ---- sampling (counter-based RNG keyed by seed and absolute position) ---- */
typedef struct kd_sampler {
    float temperature;       /* <= 0: greedy argmax */
    int top_k;               /* <= 0: off */
    float top_p;             /* >= 1 or <= 0: off */
    uint64_t seed;
    float min_p;             /* <= 0: off; (0, 1]: keep tokens with probability >= min_p * the top one's
                              * (after top-k, before top-p; docs/ddtree.md) */
} kd_sampler;
/* One token per output row of the last forward; row i's token is drawn with the
 * key (seed, positions[i]) where positions[i] is the absolute position of the token
 * being produced (row position + 1). */
kd_status kd_seq_sample(kd_seq *s, const kd_sampler *sp, const int32_t *positions, int32_t *dst);
/* The same rule on a host row of logits, for tests and Lua drafters. */
kd_status kd_sample_logits(const float *logits, int vocab, const kd_sampler *sp,
                           int32_t position, int32_t *dst);

/* ---- DDTree primitives ---- */
kd_status kd_tree_new(kd_tree **out);
void kd_tree_free(kd_tree *t);
/* Algorithm 1 (DDTree): K = min(budget, V) per depth, best-first in double
 * precision, ties by rank tuple, nodes in pop order, root = node 0.
 * scores: L x V draft logits (is_logprobs = 0) or log-probs (is_logprobs = 1). */
kd_status kd_tree_build(kd_tree *t, const float *scores, int L, int V, int budget, int is_logprobs);
/* A chain root -> tokens[0] -> tokens[1] ... (the DFlash policy). */
kd_status kd_tree_set_chain(kd_tree *t, const int32_t *tokens, int n);
kd_status kd_tree_set_root(kd_tree *t, int32_t token);
int kd_tree_size(const kd_tree *t);                           /* drafted nodes, root excluded */
/* arrays of 1+size entries, index 0 = root (parent -1, depth 0) */
kd_status kd_tree_nodes(const kd_tree *t, int32_t *tokens, int32_t *parents, int32_t *depths);
/* the ancestor-only visibility mask, (1+size) rows of ceil((1+size)/64) words */
kd_status kd_tree_visibility(const kd_tree *t, uint64_t *dst);
/* one target pass over root + nodes at positions len + depth, ancestor-only mask */
kd_status kd_verify(kd_seq *s, kd_tree *t);
/* one target token per node (greedy when sp is NULL or temperature <= 0), walk
 * from the root; accepted: node ids of the path (root first), *n_accepted = tau. */
kd_status kd_accept(kd_seq *s, kd_tree *t, const kd_sampler *sp, int32_t *accepted_nodes,
                    int32_t *accepted_tokens, int *n_accepted, int32_t *bonus);
/* compact the KV to the accepted path, hand its tap features to the drafter
 * context, advance the sequence by tau. A failed drafter append leaves everything as it was
 * (the commit can be retried); a failed compaction ends at the committed length, as
 * kd_seq_compact does. */
kd_status kd_commit(kd_seq *s, kd_tree *t);

/* ---- DFlash drafter ---- */
typedef struct kd_drafter_info {
    int n_layers, hidden, n_heads, n_kv_heads, head_dim, intermediate, block_size, mask_token_id;
    int n_taps, taps[16];
} kd_drafter_info;
kd_status kd_drafter_open(const char *dir, kd_model *target, kd_drafter **out);
void kd_drafter_close(kd_drafter *d);
kd_status kd_drafter_get_info(const kd_drafter *d, kd_drafter_info *out);
/* bind a drafter to a sequence: from now on the sequence keeps the tap features
 * of its committed tokens as the drafter's context */
kd_status kd_seq_attach_drafter(kd_seq *s, kd_drafter *d);
/* one draft pass over [bonus, MASK x (bs-1)] at positions len..len+bs-1;
 * writes (bs-1) x vocab log-probs to dst when dst is not NULL */
kd_status kd_draft(kd_seq *s, int32_t bonus, float *logprobs_dst);
/* the argmax of each of the last draft's bs-1 log-prob rows (ties: the lower id), computed
 * on the backend: bs-1 ids to ids_dst, the only bytes that come back (DFlash's chain) */
kd_status kd_draft_argmax(kd_seq *s, int32_t *ids_dst);
/* build the DDTree from the last draft's log-probs, on the backend */
kd_status kd_tree_build_drafted(kd_tree *t, kd_seq *s, int budget);

/* ---- tokenizer ----
 * Kimi K2.6's (tiktoken BPE) from a checkpoint directory: tiktoken.model (the base ranks) and
 * tokenizer_config.json (added_tokens_decoder names special ids; the others of the
 * KD_TOKENIZER_SPECIAL_SLOTS after the base ranks are <|reserved_token_{id}|>). Encodes as
 * tiktoken does, with Kimi's pre-tokenizer pattern; docs/architecture.md. */
typedef struct kd_tokenizer kd_tokenizer;
enum { KD_TOKENIZER_SPECIAL_SLOTS = 258 };
kd_status kd_tokenizer_open(const char *dir, kd_tokenizer **out);
void kd_tokenizer_close(kd_tokenizer *t);
int kd_tokenizer_n_base(const kd_tokenizer *t);   /* base ranks: the first special id */
int kd_tokenizer_n_ids(const kd_tokenizer *t);    /* base ranks + special slots */
/* UTF-8 text (n_bytes) -> ids, as Kimi's TikTokenTokenizer.encode. parse_special != 0:
 * special-token strings in the text become their ids; 0: they are ordinary text. *n_ids gets
 * the count; ids NULL (cap 0): only the count; when it exceeds cap, nothing past cap is
 * written and the call fails with KD_ERR_ARG (n_bytes ids always suffice). Reads the
 * tokenizer only: threads may share one. */
kd_status kd_tokenizer_encode(const kd_tokenizer *t, const char *text, size_t n_bytes, int parse_special,
                              int32_t *ids, size_t cap, size_t *n_ids);
/* ids -> their bytes, concatenated (a token may end inside a UTF-8 character); *n_bytes gets
 * the count; out NULL (cap 0): only the count; past cap, KD_ERR_ARG as for encode */
kd_status kd_tokenizer_decode(const kd_tokenizer *t, const int32_t *ids, size_t n_ids, char *out, size_t cap,
                              size_t *n_bytes);
/* the id of a special token by its string ("<|im_end|>") */
kd_status kd_tokenizer_special(const kd_tokenizer *t, const char *name, int32_t *id);

/* ---- memory by component ----
 * Bytes the model holds on its backend now: device memory on CUDA; on the CPU the
 * weights are the bytes its kernels read (mostly the mapped checkpoint itself), the rest
 * host allocations. total = the sum of every weights_* category, drafter_weights,
 * kv_cache, activations, drafter_cache, workspace and other. docs/architecture.md. */
typedef struct kd_memory_report {
    uint64_t backend;                     /* kd_backend_kind */
    uint64_t weights_attention, weights_dense_mlp, weights_shared_experts, weights_routed_experts,
             weights_router, weights_embed, weights_lm_head, weights_norms;
    uint64_t weights_total;               /* the eight above */
    uint64_t weights_allocated;           /* of weights_total: held outside the mapping (device, host copies) */
    uint64_t drafter_weights;             /* drafters opened on this model */
    uint64_t kv_cache;                    /* latent KV caches of the open sequences */
    uint64_t activations;                 /* per-sequence logits and forward scratch */
    uint64_t drafter_cache;               /* the rest of the backend's buffers: drafters' per-sequence
                                             state and RoPE tables */
    uint64_t trees;                       /* DDTree trees' backend copies (nodes, masks, top-K lists) */
    uint64_t workspace;                   /* the backend's shared scratch (CPU: its two work buffers) */
    uint64_t other;                       /* small model buffers: RoPE table, router bias copies */
    uint64_t total;
    uint64_t mapped;                      /* bytes of the mapped checkpoint files (not in total) */
    uint64_t device_free, device_total;   /* the device as the driver reports it (0 on the CPU) */
    uint64_t n_seqs;                      /* open sequences and drafters of the model */
    uint64_t graphs;                      /* step graphs held by the open sequences */
    uint64_t graph_captures, graph_launches, graph_fallbacks;   /* since the model was opened */
} kd_memory_report;
kd_status kd_model_memory(const kd_model *m, kd_memory_report *out);   /* rank 0's device */
/* one rank's device (0..tp-1): its weight shares, the sequences' replicated KV and per-rank
 * buffers, its part of the drafters, its backend's workspace and device figures; trees live on
 * rank 0 */
kd_status kd_model_memory_rank(const kd_model *m, int rank, kd_memory_report *out);

#ifdef __cplusplus
}
#endif
#pragma GCC visibility pop
#endif
