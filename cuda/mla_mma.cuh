/* mla_mma.cuh: the warp-level primitives of the tensor-core attention kernel (mla_tc.cuh):
 * ldmatrix, mma.sync m16n8k16 bf16 -> fp32, cp.async, bf16 bit conversions.
 * Kept apart so scripts/bench/mla_emu/ can compile mla_tc.cuh on the CPU against a SIMT
 * emulation of exactly these functions (inc/mla_mma.cuh there); mla.cu includes this file,
 * then mla_tc.cuh. The dense GEMM (gemm.cuh) takes its cp.async, ldmatrix and mma from here too.
 * Shared-memory addresses are generic pointers into __shared__ arrays. */
#ifndef KD_MLA_MMA_CUH
#define KD_MLA_MMA_CUH
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace mla {

__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

/* four 8x8 b16 matrices; lane l supplies the row address of matrix l/8, row l%8 */
__device__ __forceinline__ void ldsm_x4(uint32_t *r, const void *row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row_addr)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t *r, const void *row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row_addr)));
}
/* d[4] += A[16x16] (a[4]) * B[16x8] (b[2]); bf16 inputs, fp32 accumulate */
__device__ __forceinline__ void mma16816(float *d, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
/* 16 bytes global -> shared; ok = false writes 16 zero bytes (src is not read) */
__device__ __forceinline__ void cp16(void *smem, const void *gmem, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ float bf2f(uint16_t b) { return __uint_as_float((unsigned)b << 16); }
__device__ __forceinline__ uint16_t f2bf(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }

}  // namespace mla
#endif
