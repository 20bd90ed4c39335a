/* w4a16.cuh: the W4A16 GEMM (INT4 experts x bf16 activations) and its MoE grouped form.
 *
 * Checkpoint form (compressed-tensors pack-quantized): W[N, K] as int32 [N, K/8], nibble
 * u = q + 8 (q in [-8, 7]), low nibble first along K; bf16 scales [N, K/group].
 * W[n, k] = (u - 8) * scale[n, k / group].
 *
 * Device form (kd_cuda_w4a16_repack*): the layout the kernel streams, see w4a16.cu:
 *   codes  uint4 [ceil(N/16)][ceil(K/64)][32 lanes]   512 bytes per 16 rows x 64 k; lane L's
 *          16 bytes are exactly its four mma.m16n8k16 A fragments for the four k16 steps
 *   scales uint32 [ceil(N/16)][groups][8]              word j = bf16 s[16t+j] | bf16 s[16t+j+8] << 16
 * Rows past N and k past K are padded with q = 0 and scale 0.
 *
 * Numerics: q*x products are exact in the tensor cores (q is exact in bf16), summed in
 * fp32 per scale group, then scaled in fp32: acc = fma(group_sum, scale, acc).
 *
 * Batch invariance: each output element (row m, column n) is reduced in an order fixed by
 * the weight alone: K is cut into `parts` contiguous ranges (kd_w4a16_parts(N, K, group):
 * a function of the shape, never of M); inside a part the scale groups are summed in k
 * order (each group: the mma k16 steps chained from zero, then acc = fma(sum, scale, acc));
 * the parts are added in order 0..parts-1, with no atomics and no workspace: in both kernels
 * the parts are the blocks of one thread-block cluster (partials through distributed shared
 * memory: read by the pipelined kernel, sent with st.async by the small-M "skinny" one).
 * The kernels and tile shapes chosen for
 * different M change only which rows share a launch, never that order, and the tensor core
 * result of one output element depends only on its own row of A and column of B. So row r
 * of y is bit-identical whether it is computed with M = 1 or inside M = 37 (checked by
 * scripts/bench/w4a16_bench.cu on every configuration, and by spec/w4a16_spec.lua).
 * The MoE form keeps the same rule per expert, and adds the top-k expert outputs of a
 * token in j order (the router lists ascending expert ids), in one thread, in fp32.
 */
#ifndef KD_W4A16_CUH
#define KD_W4A16_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stddef.h>

extern "C" {
#include "backend.h"
#include "error.h"
}

extern "C" {

/* ---------------------------------------------------------------------------------------
 * Raw layer (no backend state; the bench program uses it directly).
 * Every pointer is device memory unless it says host. All calls are asynchronous on `st`. */

/* group sizes the kernels take: 32, 64, 128 (K % group == 0, K % 8 == 0) */
int kd_w4a16_group_supported(int group);
/* checks N, K, group; on failure sets kd_last_error naming `name` and returns KD_ERR_ARG */
kd_status kd_w4a16_check(int n, int k, int group, const char *name);
size_t kd_w4a16_codes_bytes(int n, int k);
size_t kd_w4a16_scales_bytes(int n, int k, int group);
/* the fixed split-K of a weight (1..8); a function of the weight's shape only */
int kd_w4a16_parts(int n, int k, int group);

/* checkpoint layout (already on the device) -> device form */
kd_status kd_w4a16_repack(const int32_t *raw_codes, const uint16_t *raw_scales, int n, int k, int group,
                          void *codes, void *scales, cudaStream_t st);

/* y[m, n] = x[m, :] . W[n, :]   x bf16 rows (ldx elements, 16-byte aligned rows),
 * y bf16 (y_f32 = 0) or f32 (y_f32 = 1) with row stride ldy. No workspace: the split-K
 * partials stay in the clusters' shared memory.
 * flags: KD_W4A16_PDL launches with programmatic dependent launch (the weights of the first
 * stages are fetched before the previous kernel on the stream has finished). */
enum { KD_W4A16_PDL = 1 };
kd_status kd_w4a16_gemm(const void *codes, const void *scales, int n, int k, int group, const void *x, long long ldx,
                        int m, void *y, long long ldy, int y_f32, int flags, cudaStream_t st);
/* for tests and the bench: force a kernel configuration (-1 = choose from M) */
void kd_w4a16_force_config(int cfg);
/* for the bench only: override the split of K (0 = the shape's own); changes the bits */
void kd_w4a16_force_parts(int parts);
int kd_w4a16_n_configs(void);
const char *kd_w4a16_config_name(int cfg);

/* The experts of one MoE layer: device pointers of each expert's device form. */
typedef struct kd_w4a16_expert {
    const void *gate_codes, *gate_scales, *up_codes, *up_scales, *down_codes, *down_scales;
} kd_w4a16_expert;

typedef struct kd_w4a16_moe_shape {
    int n_experts, top_k, hidden, inter, group;
} kd_w4a16_moe_shape;

/* table: device array of n_experts kd_w4a16_expert. x: bf16 [T, hidden] (ldx);
 * ids: int32 [T, top_k] expert ids; weights: f32 [T, top_k] (the router's final weights,
 * routed_scaling_factor included); out = sum_j weights[t, j] * expert_ids[t,j](x[t]),
 * bf16 or f32 (out_f32), row stride ldo, plus shared[t] when shared is not NULL (out's type,
 * row stride ld_shared; added to the sum rounded to out's type, as the backend's add op does).
 * An id outside [0, n_experts) contributes nothing.
 * Grouping per expert happens on the device (no host round trip): count, offsets and
 * scatter in one small kernel, then the fused gate+up GEMM (silu(gate)*up, bf16), the down
 * GEMM (f32 per (token, expert) row), and the combine. Graph-capturable (fixed shapes per T).
 * The grouping kernel waits for all earlier work on the stream, as a plain launch does; the
 * gate+up GEMM and the combine use programmatic dependent launch behind the kernel before
 * them inside the call (each waits for it before its first read), and so does the down GEMM
 * when gate+up does its work in one pass (it reads the grouping before its wait, as gate+up
 * releases it only once the grouping is complete).
 * shared_ready (NULL: none): an event the stream waits for before the combine, the first read of
 * shared (written on another stream: the backend's branch).
 * ws: kd_w4a16_moe_ws_bytes(shape, T) bytes, no initial content needed. */
size_t kd_w4a16_moe_ws_bytes(const kd_w4a16_moe_shape *shape, int T);
kd_status kd_w4a16_moe(const kd_w4a16_moe_shape *shape, const kd_w4a16_expert *table, const void *x, long long ldx,
                       int T, const int32_t *ids, const float *weights, const void *shared, long long ld_shared,
                       cudaEvent_t shared_ready, void *out, long long ldo, int out_f32, void *ws, size_t ws_bytes,
                       cudaStream_t st);

#ifdef KD_W4A16_TRACE
/* bench-trace builds only (the small-M kernel's launch timeline, see w4a16_skinny.cu):
 * out [KD_W4A16_TRACE_LAUNCHES][KD_W4A16_TRACE_BLOCKS][KD_W4A16_TRACE_POINTS] %globaltimer ns,
 * sms [KD_W4A16_TRACE_LAUNCHES][KD_W4A16_TRACE_BLOCKS] the SM each block ran on, counts
 * [KD_W4A16_TRACE_BLOCKS] launches seen per block index; reset = 1 restarts the counts.
 * 0, or -1 on a CUDA error. */
/* 512 blocks: the largest traced grid is 7168 x 2048 at M <= 4 (448 blocks of 4 warps) */
enum { KD_W4A16_TRACE_LAUNCHES = 64, KD_W4A16_TRACE_BLOCKS = 512, KD_W4A16_TRACE_POINTS = 6 };
int kd_w4a16_trace_read(unsigned long long *out, unsigned *sms, unsigned *counts, int reset);
#endif

/* ---------------------------------------------------------------------------------------
 * Backend layer (cuda/w4a16_backend.cu): what the CUDA backend's table calls. */

/* w->src / w->src_scale (host, the mapped checkpoint) -> w->dev (codes) and w->dev_scale
 * (scales), both inside one device allocation owned by w->dev. */
kd_status kd_cuda_w4a16_repack(kd_backend *be, kd_weight *w);
/* out = x w^T for an INT4 weight; x bf16 or f32, out bf16 or f32 */
kd_status kd_cuda_w4a16_linear(kd_backend *be, kd_act x, const kd_weight *w, kd_act out);
/* a layer's INT4 experts: builds the device table of their device-form pointers (after
 * weight_load of each expert); kept by this file, keyed by e, until _experts_free */
kd_status kd_cuda_w4a16_experts_load(kd_backend *be, kd_experts *e);
void kd_cuda_w4a16_experts_free(kd_backend *be, kd_experts *e);
/* routed experts for T = x.rows tokens: ids int32 [T, e->top_k] and weights f32 [T, e->top_k]
 * in device memory (the router's output; the top-k sum runs in j order, so list the ids in
 * ascending expert id to match HF and the CPU twin); out [T, hidden] = sum_j w_j expert_j(x).
 * x and out: bf16 or f32 (x is converted to bf16 first when it is f32); shared: as kd_w4a16_moe (data NULL: none). */
kd_status kd_cuda_w4a16_moe(kd_backend *be, kd_act x, const kd_experts *e, const int32_t *ids, const float *weights,
                            kd_act shared, kd_act out);
}

#endif
