/* gemm_args.cuh: the arguments of the dense GEMM (linear.cu launches it, gemm.cuh is its kernel).
 * Apart from cuda_internal.cuh so that scripts/bench/gemm_emu/ can compile the kernel on the CPU;
 * bf16 must be a type before this is included. */
#ifndef KD_GEMM_ARGS_CUH
#define KD_GEMM_ARGS_CUH
#include <stdint.h>

/* ---- the GEMM core (linear.cu), shared by linear, head_matmul and the bf16 experts ----
 * C[m, n] = sum_k A[m, k] * B(n, k), fp32 accumulation in a fixed k order.
 * A: activations (bf16 or f32 elements, row stride lda), optionally through a row
 *    index list a_rows (grouped experts); B: bf16 weights, either [N, K] row-major
 *    (b_kmajor: element (n,k) at B[n*ldb + k]) or [K, N] row-major (element at B[k*ldb + n]).
 * batch z (blockIdx.z): A, B, C advance by their z strides; or, grouped (groups != NULL),
 *    z is an expert: B = b_ptrs[z], rows [row_off[z], row_off[z+1]) of the gathered list.
 * B1 (k-major, one batch, not grouped): columns n >= n1 are B1's rows n - n1 (same ldb), so
 *    two weights stacked by rows run as one launch (linear_pair).
 * glu (with B1: B the gate, B1 the up weight, n1 the rows of each): C[m, j] = silu(g) * u with g
 *    and u row j's products, each rounded to C's dtype first (linear_swiglu). The launch's N
 *    columns are then logical (gemm.cuh: glu_row): each group of 64 is 32 gate rows and the same
 *    32 up rows, N = 64 ceil(n1 / 32); C has n1 columns. */
typedef struct kd_gemm_args {
    const void *A; int a_dtype; long long lda; long long a_zstride;
    const int32_t *a_rows;          /* grouped: source row of A for gathered row i (NULL: identity) */
    const bf16 *B; long long ldb; long long b_zstride; bool b_kmajor;
    const bf16 *const *b_ptrs;      /* grouped: one weight per z */
    const bf16 *B1; int n1;         /* the second weight of a pair and its first column (B1 NULL: none) */
    bool glu;                       /* B, B1 are a SwiGLU's gate and up: C = silu(x B^T) * (x B1^T) */
    void *C; int c_dtype; long long ldc; long long c_zstride;
    const int32_t *row_off;         /* grouped: z's rows are [row_off[z], row_off[z+1]) */
    int M, N, K, batch;
} kd_gemm_args;

#endif
