/* cuda_internal.cuh: what the CUDA backend's files share: the backend state, error
 * sites that turn CUDA/cuBLAS failures into kd_status, scratch workspaces, and the
 * small device helpers (bf16/f32 loads and stores, fixed-order block reductions).
 *
 * Batch invariance is a rule for every kernel here: a row's result depends only on
 * that row's inputs, never on how many rows share the launch or where the row sits.
 * Reductions therefore run in an order fixed by the reduced length alone (block
 * reductions over a row use the same thread layout whatever the row count), and the
 * GEMMs never choose a split or an algorithm from M (see linear.cu). */
#ifndef KD_CUDA_INTERNAL_CUH
#define KD_CUDA_INTERNAL_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <stdint.h>
#include <stddef.h>

extern "C" {
#include "backend.h"
#include "error.h"
}

typedef __nv_bfloat16 bf16;

/* The W4A16 engineer's kernels (INT4 experts); absent while that file is being written. */
#if !defined(KD_NO_W4A16) && __has_include("w4a16.cuh")
#include "w4a16.cuh"
#define KD_HAVE_W4A16 1
#else
#define KD_HAVE_W4A16 0
#endif

/* Scratch workspaces, one per user so an op that calls another op never hands out
 * the same bytes twice, and one set per queue so a branch's ops never share bytes with the
 * ops beside them. They grow on demand (never shrink until destroy). */
enum kd_cuda_ws {
    KD_WS_GEMM = 0,      /* split-K partial sums of linear */
    KD_WS_ATTN,          /* attention partials (m, l, o per chunk) and visible lists */
    KD_WS_MOE,           /* router logits, expert ids/weights, grouped rows */
    KD_WS_MOE2,          /* expert intermediate activations */
    KD_WS_TREE,          /* top-k's histograms and candidates, argmax's partials */
    KD_WS_TMP,           /* dtype conversions, in-place gather staging */
    KD_WS_W4A16,         /* handed to the W4A16 kernels */
    KD_WS_GLU,           /* linear_swiglu's up product where its weights take two launches */
    KD_WS_COUNT
};

typedef struct kd_cuda {
    int device;
    int n_sms;
    size_t smem_optin;             /* max dynamic shared memory per block */
    /* the MLA attention kernel's choice (kd_model_options at creation; mla.cu) */
    bool mla_tc;                   /* the tensor-core kernel where the shape allows */
    int mla_vsplit;                /* tc_shape's value split: 8 = its rule, 0 = off, 1, 2 or 4 forced */
    int mla_rg;                    /* tc_shape's row groups: 0 = its rule, 1 or 4 forced */
    cudaStream_t stream;           /* where ops enqueue: queue[0], or queue[1] inside a branch */
    cudaStream_t queue[2];         /* the backend's stream and its branch's (backend.h: branch_begin) */
    cudaEvent_t fork_ev, join_ev;  /* the branch's start on queue[0] and its end on queue[1] */
    int branch;                    /* 1 between branch_begin and branch_end, else 0: the queue in use */
    bool branch_open;              /* queue[0] has not yet waited for the last branch's work */
    cublasHandle_t cublas;         /* created lazily; the dense GEMMs use our own kernels */
    void *ws[2][KD_WS_COUNT];      /* per queue */
    size_t ws_bytes[2][KD_WS_COUNT];
    /* memory accounting (bytes currently held) */
    size_t bytes_alloc, bytes_weights, bytes_workspace;
    /* step graphs and buffer accounting (backend.cu, graph.cu) */
    int capturing;                 /* a graph capture is open on `stream`: workspaces must not grow */
    unsigned long long ws_epoch;   /* bumped whenever a workspace is reallocated (graphs point into them) */
    struct kd_cuda_buf *bufs;      /* the alloc() buffers and their sizes, so free() can subtract */
    int n_bufs, cap_bufs;
    /* the dynamic shared memory each kernel has been allowed on this device (kd_cuda_smem) */
    struct { const void *fn; size_t smem; } smem_set[32];
    int n_smem_set;
} kd_cuda;
typedef struct kd_cuda_buf { void *ptr; size_t bytes; } kd_cuda_buf;

static inline kd_cuda *kd_cuda_of(kd_backend *be) { return (kd_cuda *)be->impl; }

/* ---- error sites ---- */
kd_status kd_cuda_fail(cudaError_t e, const char *call, const char *file, int line);
kd_status kd_cublas_fail(cublasStatus_t e, const char *call, const char *file, int line);

#define KD_CUDA(call) do { cudaError_t kd_e_ = (call); \
    if (kd_e_ != cudaSuccess) return kd_cuda_fail(kd_e_, #call, __FILE__, __LINE__); } while (0)
#define KD_CUBLAS(call) do { cublasStatus_t kd_e_ = (call); \
    if (kd_e_ != CUBLAS_STATUS_SUCCESS) return kd_cublas_fail(kd_e_, #call, __FILE__, __LINE__); } while (0)
/* after a kernel launch: report a launch failure where it happened */
#define KD_CUDA_LAUNCH(what) do { cudaError_t kd_e_ = cudaGetLastError(); \
    if (kd_e_ != cudaSuccess) return kd_cuda_fail(kd_e_, what, __FILE__, __LINE__); } while (0)

/* a workspace of at least `bytes`, the current queue's (grows: waits for the stream, frees,
 * reallocates) */
kd_status kd_cuda_ws(kd_backend *be, int which, size_t bytes, void **ptr);
/* queue[0] waits for the last branch's work, if it has not yet (backend.h: branch_begin) */
kd_status kd_cuda_branch_join(kd_cuda *c);
/* allow kernel `fn` `smem` bytes of dynamic shared memory on this device: the driver is asked
 * only when a kernel needs more than it was last allowed, not at every launch */
kd_status kd_cuda_smem(kd_cuda *c, const void *fn, size_t smem);

/* ---- programmatic dependent launch: the kernels' side in griddep.cuh ---- */
#include "griddep.cuh"
/* fn<<<grid, threads, smem, st>>>(args...) with programmatic stream serialization; `what` names
 * the kernel in the error (the arguments convert to fn's parameter types, as with <<< >>>) */
template <typename... Params, typename... Args>
static inline kd_status kd_launch_pdl(const char *what, void (*fn)(Params...), dim3 grid, int threads, size_t smem,
                                      cudaStream_t st, Args... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, fn, args...);
    return e == cudaSuccess ? KD_OK : kd_cuda_fail(e, what, __FILE__, __LINE__);
}

/* ---- dtype helpers (device) ---- */
__device__ __forceinline__ float kd_ld(const void *p, int dt, size_t i) {
    if (dt == KD_BF16) return __bfloat162float(((const bf16 *)p)[i]);
    if (dt == KD_F32) return ((const float *)p)[i];
    return __half2float(((const __half *)p)[i]);   /* KD_F16 */
}
__device__ __forceinline__ void kd_st(void *p, int dt, size_t i, float v) {
    if (dt == KD_BF16) ((bf16 *)p)[i] = __float2bfloat16(v);
    else if (dt == KD_F32) ((float *)p)[i] = v;
    else ((__half *)p)[i] = __float2half(v);
}
/* v as a store to dtype dt leaves it (kd_st, then kd_ld) */
__device__ __forceinline__ float kd_round(int dt, float v) {
    if (dt == KD_BF16) return __bfloat162float(__float2bfloat16(v));
    if (dt == KD_F32) return v;
    return __half2float(__float2half(v));
}
static inline bool kd_cuda_float_dtype(kd_dtype t) { return t == KD_F32 || t == KD_BF16 || t == KD_F16; }

/* Block-wide sum with a fixed order: each warp reduces with the same xor tree, then
 * warp 0 adds the warp sums in warp order. The order depends on blockDim only. */
__device__ __forceinline__ float kd_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float kd_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* red: __shared__ float[32]; all threads get the result */
__device__ __forceinline__ float kd_block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = kd_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < nw ? red[lane] : 0.0f;
        s = kd_warp_sum(s);
        if (lane == 0) red[0] = s;
    }
    __syncthreads();
    return red[0];
}
__device__ __forceinline__ float kd_block_max(float v, float *red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = kd_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < nw ? red[lane] : -INFINITY;
        s = kd_warp_max(s);
        if (lane == 0) red[0] = s;
    }
    __syncthreads();
    return red[0];
}
/* A float's order-preserving key: larger value -> larger unsigned key; -0 == +0; NaN is 0, below
 * every number (the top-K's keys, the router's, the sampling rule's, whose logits are never NaN
 * there) */
__device__ __forceinline__ uint32_t kd_float_key(float v) {
    if (v != v) return 0u;
    if (v == 0.0f) v = 0.0f;
    const uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
/* the number whose kd_float_key is k (k of a non-NaN; -0 comes back as +0) */
__device__ __forceinline__ float kd_float_of_key(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* ---- entry points shared between the backend's files (extern "C" for the table) ---- */
extern "C" {
/* the ops (backend.h's KD_BACKEND_OPS): elementwise and data movement in norm_rope.cu and graph.cu,
 * linear.cu, mla.cu (attention, attention_at), moe.cu / w4a16_backend.cu, the vocabulary
 * reductions and the DDTree round in ddtree.cu and tree.cu */
#define KD_CUDA_OP_DECL(name, params, args) kd_status kd_cuda_##name params;
KD_BACKEND_OPS(KD_CUDA_OP_DECL)
#undef KD_CUDA_OP_DECL
kd_status kd_cuda_experts_load(kd_backend *be, kd_experts *e);
void kd_cuda_experts_free(kd_backend *be, kd_experts *e);
/* step graphs (graph.cu): capture and replay */
kd_status kd_cuda_graph_begin(kd_backend *be);
kd_status kd_cuda_graph_end(kd_backend *be, void **graph);
kd_status kd_cuda_graph_launch(kd_backend *be, void *graph);
void kd_cuda_graph_free(kd_backend *be, void *graph);
uint64_t kd_cuda_graph_epoch(kd_backend *be);
/* the branch (backend.cu) */
kd_status kd_cuda_branch_begin(kd_backend *be);
kd_status kd_cuda_branch_end(kd_backend *be);
}

#include "gemm_args.cuh"   /* the GEMM core (linear.cu), shared by linear, head_matmul and the bf16 experts */
kd_status kd_cuda_gemm(kd_backend *be, const kd_gemm_args *g);

#endif
