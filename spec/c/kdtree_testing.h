/* kdtree_testing.h: the op test surface (not part of the engine's API: built only into
 * build/libkdtree_test.so, which the specs load).
 *
 * Runs one backend op on host fp32 inputs and returns host fp32 outputs, on the CPU or
 * the CUDA backend alike, so a spec can run the same op on both and compare. Inputs are
 * converted to the backend's activation dtype on upload (f32 on CPU, bf16 on CUDA; round
 * them to bf16 first with kd_test_round_bf16 so both backends see the same numbers);
 * outputs are converted back to fp32. Weights are given as raw checkpoint bytes.
 *
 * FFI-clean like kdtree.h: LuaJIT's ffi.cdef reads it after kdtree.h (spec/helpers/ops.lua).
 */
#ifndef KDTREE_TESTING_H
#define KDTREE_TESTING_H
#include "kdtree.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct kd_test_backend kd_test_backend;
struct kd_backend;   /* core/backend.h */

/* A weight in host memory, as a checkpoint stores it.
 * format 0: bf16 [rows, cols] (data: uint16 bits); 1: f32 [rows, cols] (data: float);
 * 2: INT4 compressed-tensors (data: int32 [rows, cols/8], low nibble first, nibble = q + 8;
 *    scale: bf16 bits [rows, cols/group]). */
typedef struct kd_test_weight {
    int format;
    int64_t rows, cols;
    int group;
    const void *data;
    const void *scale;
} kd_test_weight;

/* kind: KD_BACKEND_CPU or KD_BACKEND_CUDA (device index for CUDA); opt: the model options the
 * backend takes at creation (the CUDA MLA kernel's choice), NULL = the defaults */
kd_status kd_test_backend_new(kd_backend_kind kind, int device, const kd_model_options *opt, kd_test_backend **out);
/* a bare backend (core/backend.h) for specs that call its ops directly; free it with its
 * ops->destroy (spec/helpers/backend.lua) */
kd_status kd_test_raw_backend_new(kd_backend_kind kind, int device, const kd_model_options *opt,
                                  struct kd_backend **out);
void kd_test_backend_free(kd_test_backend *tb);
/* the activation dtype's element size: 4 (f32, CPU) or 2 (bf16, CUDA) */
int kd_test_backend_act_bytes(const kd_test_backend *tb);
/* the compute ops of backend.h's KD_BACKEND_OPS as the compiler expanded the list: the op at
 * index i (in table order), NULL past the last */
const char *kd_test_op_name(int i);

/* host helpers: round fp32 values to the nearest bf16 (ties to even) in place; fp32 -> bf16 bits */
void kd_test_round_bf16(float *x, size_t n);
void kd_test_to_bf16(const float *x, uint16_t *bits, size_t n);

/* ---- one op each; every array is host memory, row-major and dense ---- */
/* src [rows, cols] f32 -> a dst_dtype buffer (0 f32, 1 f16, 2 bf16) -> back to f32 */
kd_status kd_test_copy(kd_test_backend *tb, const float *src, int rows, int cols, int dst_dtype, float *out);
kd_status kd_test_embed(kd_test_backend *tb, const kd_test_weight *table, const int32_t *ids, int n, float *out);
/* out = x + s*y (use_scale = 0: the add op, s ignored) */
kd_status kd_test_add(kd_test_backend *tb, const float *x, const float *y, int rows, int cols, float s,
                      int use_scale, float *out);
kd_status kd_test_swiglu(kd_test_backend *tb, const float *gate, const float *up, int rows, int cols, float *out);
kd_status kd_test_rmsnorm(kd_test_backend *tb, const float *x, int rows, int cols, const kd_test_weight *w, float eps,
                          float *out);
/* the fused op: x_out = x + y, out = rmsnorm(x + y) * w (w: cols entries) */
kd_status kd_test_add_rmsnorm(kd_test_backend *tb, const float *x, const float *y, int rows, int cols,
                              const kd_test_weight *w, float eps, float *x_out, float *out);
/* x [rows, cols] roped in place on the device; pos [rows]; inv_freq [dim/2] */
kd_status kd_test_rope(kd_test_backend *tb, const float *x, int rows, int cols, int n_heads, int head_stride,
                       int offset, const int32_t *pos, int dim, int interleaved, float attn_factor,
                       const float *inv_freq, float *out);
/* mla_rope_store: q [rows, q_cols]; qfull [rows, f_cols] and cache [cache_rows, kv_cols] go in with
 * their starting values and come back after the op; kva [rows, kv_cols]; w the latent's norm
 * (kv_cols - dim entries); the rows start at row0 (dev_len < 0) or at the device length dev_len */
kd_status kd_test_mla_rope_store(kd_test_backend *tb, const float *q, int rows, int q_cols, int n_heads, float *qfull,
                                 int f_cols, const float *kva, int kv_cols, const kd_test_weight *w, float eps,
                                 const int32_t *pos, int dim, int interleaved, float attn_factor,
                                 const float *inv_freq, float *cache, int cache_rows, int row0, int dev_len);
/* inplace = 0: out [n, cols] = src rows idx[i]; inplace = 1: dst is rows [dst_row0, dst_row0+n) of the
 * source buffer itself (KV compaction) and out receives the whole buffer [src_rows, cols] afterwards */
kd_status kd_test_gather_rows(kd_test_backend *tb, const float *src, int src_rows, int cols, const int32_t *idx,
                              int n, int inplace, int dst_row0, float *out);
/* move_rows over n_caches caches of [rows, cols] (src: n_caches * rows * cols values, the caches
 * one after another, each in the backend's act dtype): rows dst0 + i <- rows src0 + idx[i] in
 * each; out receives every cache afterwards */
kd_status kd_test_move_rows(kd_test_backend *tb, const float *src, int n_caches, int rows, int cols, int src0,
                            const int32_t *idx, int n, int dst0, float *out);
/* out [M, w.rows] = x [M, w.cols] w^T; out_f32: output buffer in f32 (else act dtype) */
kd_status kd_test_linear(kd_test_backend *tb, const float *x, int M, const kd_test_weight *w, int out_f32, float *out);
/* out [M, w0.rows + w1.rows] = x [w0; w1]^T (linear_pair; same cols) */
kd_status kd_test_linear_pair(kd_test_backend *tb, const float *x, int M, const kd_test_weight *w0,
                              const kd_test_weight *w1, int out_f32, float *out);
/* out [M, gate.rows] = silu(x gate^T) * (x up^T) (linear_swiglu; gate and up of one shape) */
kd_status kd_test_linear_swiglu(kd_test_backend *tb, const float *x, int M, const kd_test_weight *gate,
                                const kd_test_weight *up, int out_f32, float *out);
/* the CPU backend's two forms of one product, x [T, cols] times w^T, and of the decoding of all
 * of w's rows: the portable C (out_c) and the AVX2 form (out_simd), each [T, rows] / [rows, cols];
 * KD_ERR_UNSUPPORTED where this CPU or build has no AVX2 */
kd_status kd_test_cpu_matmul_forms(const float *x, int T, const kd_test_weight *w, float *out_c, float *out_simd);
kd_status kd_test_cpu_decode_forms(const kd_test_weight *w, float *out_c, float *out_simd);
/* x [rows, xcols]; out [rows, out_cols] (starts zeroed); see backend.h head_matmul */
kd_status kd_test_head_matmul(kd_test_backend *tb, const float *x, int rows, int xcols, int n_heads, int xstride,
                              int k, const kd_test_weight *w, int wstride, int wrow0, int transposed, int ocols,
                              int ostride, int out_cols, float *out);
/* q [T, q_cols]; k [S, k_cols]; v [S, v_cols] (v_from_k = 1: the value view is the first v_cols
 * columns of the k buffer, as MLA uses the cache); visible: NULL or T x ceil(T/64) words;
 * out [T, out_cols] */
kd_status kd_test_attention(kd_test_backend *tb, const float *q, int T, int q_cols, int n_heads, int head_dim,
                            const float *k, int S, int k_cols, const float *v, int v_cols, int v_from_k,
                            int n_kv_heads, int past, int causal, const uint64_t *visible, int window, float scale,
                            int out_cols, float *out);
/* routed experts: router [n, H] weight, bias (n floats or NULL), gate/up [I, H] and down [H, I] per expert;
 * shared [T, H] (NULL: none) is added to their sum by the op (the shared expert's output) */
kd_status kd_test_moe(kd_test_backend *tb, const float *x, int T, int H, int n, int top_k, int n_group,
                      int topk_group, int norm_topk_prob, float routed_scaling_factor, const kd_test_weight *router,
                      const float *bias, const kd_test_weight *gate, const kd_test_weight *up,
                      const kd_test_weight *down, const float *shared, float *out);
/* rows of fp32 values (kept fp32 on every backend) */
kd_status kd_test_log_softmax(kd_test_backend *tb, const float *x, int rows, int cols, float *out);
kd_status kd_test_argmax(kd_test_backend *tb, const float *x, int rows, int cols, int32_t *out);
kd_status kd_test_topk(kd_test_backend *tb, const float *x, int rows, int cols, int k, float *vals, int32_t *ids);
/* one keyed draw from a host row split into n_shards equal shards (tensor parallel's vocabulary
 * shards; vocab % n_shards == 0, n_shards <= 8), merged as core/sample.c merges them; the
 * sampler not greedy. The same token as kd_sample_logits over the whole row, or its error. */
kd_status kd_test_sample_shards(const float *row, int vocab, int n_shards, const kd_sampler *sp, int32_t position,
                                int32_t *dst);
/* the sampling rule's mass (core/sample_rule.h: kd_rule_mass) against a second writing of it: x/T
 * and m/T by division, k by libm's rint, w = ldexp(p, k) and trunc(w * 2^62) by conversion, over n
 * logits x below a max m at float temperatures T (SplitMix64 from seed: spread over the span, near
 * the max, at every float bit pattern) and a grid of a = x/T - m/T over [-708.5, 0]. Returns how
 * many values differ (a mass, or m/T from m / T); *checked the values compared. */
long kd_test_rule_mass_mismatches(long n, uint64_t seed, long *checked);

/* The CPU communicator (core/comm_cpu.c) driven by n_ranks threads: rank r all-reduces its view
 * [rows, cols] (row stride ld) of bufs + r * rows * ld in place, then all-gathers its first row
 * into gathered + r * n_ranks * cols. fail_rank >= 0: that rank aborts instead of joining (as a
 * failing rank does), and the others' statuses say what they saw; after a reset, every rank then
 * all-reduces once more (status[n_ranks] is that round's first failure, or 0). status: n_ranks + 1. */
kd_status kd_test_comm_cpu(int n_ranks, int rows, int cols, int ld, float *bufs, float *gathered, int fail_rank,
                           int32_t *status);

/* the RoPE inverse frequencies (dim/2 floats) that DIR/config.json gives `dim` rotary dims
 * (model.h kd_rope_inv_freq after kd_config_load) */
kd_status kd_test_rope_inv_freq(const char *dir, int dim, float *inv_freq);

/* Fault injection (spec/c/testing_faults.c): from now on the backend op `op` of the model's
 * backend ("upload", "copy", "mla_rope_store" or "move_rows") fails with KD_ERR_BACKEND once
 * `after` more calls of it have succeeded ("tree_walk": returns a path that does not start at the
 * root instead);
 * after < 0 ends the injection (one at a time; a new call moves it; closing the model ends it too). */
kd_status kd_test_fail_op(kd_model *m, const char *op, int after);
/* 1 while an injection is on for the model's backend. Both this and the graph emulation
 * (testing_graphs.c) lay their op table over the backend's current one and put it back when
 * they end, so the emulation must come first: it refuses to start over an injection. */
int kd_test_fault_active(const kd_model *m);

#ifdef __cplusplus
}
#endif
#endif
