/* w4a16_device.cuh: what the W4A16 kernels share (w4a16.cu: the pipelined GEMM, the MoE and
 * the configurations; w4a16_skinny.cu: the small-M kernel): the device form's constants, the
 * kernel arguments, the PTX helpers (cp.async, ldmatrix, mma, the INT4 dequantisation,
 * bulk copies, cluster barriers, distributed shared memory, st.async and mbarriers) and the
 * skinny kernel's planning entry. Internal to cuda/w4a16*.cu. */
#ifndef KD_W4A16_DEVICE_CUH
#define KD_W4A16_DEVICE_CUH
#include "w4a16.cuh"
#include "griddep.cuh"   /* kd_griddep_wait / kd_griddep_release */
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

namespace kd_w4a16_impl {

constexpr int CHUNK_K = 64;       /* k per chunk of the device form */
/* the most parts of K (blocks of a cluster): 8, the portable cluster size (16-block clusters
 * are placed poorly: the pipelined kernel at M >= 16 ran 1.4-1.8x slower with 16 parts on the
 * H200) */
constexpr int MAX_PARTS = 8;

/* ---------------------------------------------------------------- PTX helpers */
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16-byte async copy; valid = false writes 16 zero bytes and reads nothing */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t &r0, uint32_t &r1, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1) : "r"(smem_addr(p)) : "memory");
}
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
/* (a & b) | c in one LOP3 */
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

/* One packed word -> the four A registers of one m16n8k16 step (see repack_codes_kernel):
 * nibble pairs (0,4) (1,5) (2,6) (3,7) -> a0 a1 a2 a3, each the exact bf16x2 (u-8, u'-8). */
__device__ __forceinline__ void dequant4(uint32_t w, uint32_t a[4]) {
    const uint32_t MASK = 0x000F000Fu, EX = 0x43004300u, ONE = 0x3F803F80u, M136 = 0xC308C308u;
    a[0] = bf16x2_fma(and_or(w, MASK, EX), ONE, M136);
    a[1] = bf16x2_fma(and_or(w >> 4, MASK, EX), ONE, M136);
    a[2] = bf16x2_fma(and_or(w >> 8, MASK, EX), ONE, M136);
    a[3] = bf16x2_fma(and_or(w >> 12, MASK, EX), ONE, M136);
}

__device__ __forceinline__ void store_out(void *y, int f32, size_t i, float v) {
    if (f32) ((float *)y)[i] = v;
    else ((bf16 *)y)[i] = __float2bfloat16_rn(v);
}
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

struct W4Mat {
    const uint4 *q;
    const uint32_t *s;
};

struct W4Args {
    const bf16 *x;
    long long ldx;
    const int *row_map;               /* tile row (slot) -> x row; NULL: identity */
    W4Mat mat;                        /* plain GEMM weights (table == NULL) */
    const kd_w4a16_expert *table;     /* MoE: per-expert pointers */
    int n, k, kc, groups, gshift, parts, cpp, n_tiles, nb;   /* group = 1 << gshift */
    const int4 *tiles;                /* MoE: (expert, row0, rows) per token tile; NULL: plain */
    const int *n_tiles_dev;
    int tiles_ready;                  /* MoE: the tile list may be read before the wait for the grid before */
    int m;                            /* plain: rows of x / y */
    void *y;
    long long ldy;
    int y_f32;
};

typedef void (*KernelFn)(const W4Args);

/* thread-block clusters (sm_90+): the split-K parts of a tile are the blocks of one cluster */
__device__ __forceinline__ float ld_cluster(uint32_t addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
/* mapa: the shared::cluster address of the same variable in block `rank` of the cluster */
__device__ __forceinline__ uint32_t cluster_addr(const void *p, unsigned rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
    return remote;
}
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/* after the peers have read this block's shared memory (the end of a work item, before the
 * next item's copies overwrite it): they have used what they read before arriving, so no
 * release (a release here waits for every earlier global store) */
__device__ __forceinline__ void cluster_sync_exit() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}
/* split arrive/wait: arrive after initialising barriers peers will use (relaxed: the mbarrier
 * init fence orders them), wait before the first access to a peer's shared memory */
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
/* a 16-byte store into a peer block's shared memory that completes on the peer's mbarrier
 * (addresses from cluster_addr): no cluster barrier, no fence */
__device__ __forceinline__ void st_async_v4(uint32_t addr, const float (&v)[4], uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
                 ::"r"(addr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(bar) : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

/* mbarrier (sm_90+): the skinny kernel's warps wait on one each for their weights (completed
 * by the bulk-copy engine), and its split-K reduction on one completed by the bytes its peers
 * store into this block with st_async_v4 */
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* after initialising a barrier that the bulk-copy engine (the async proxy) will complete */
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* the one arrival of a count-1 barrier, announcing `bytes` that peers or copies will deliver */
__device__ __forceinline__ void mbar_arrive_expect(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait0(uint64_t *bar) {
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
                 "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)) : "memory");
}
/* 16-byte aligned bytes global -> this block's shared memory by the bulk-copy engine,
 * completing on the mbarrier `bar` (which expects them); read once: evict first from L2 */
__device__ __forceinline__ void bulk_load_stream(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
    asm volatile("{\n.reg .b64 policy;\n"
                 "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
                 "policy;\n}\n"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

/* shared memory of the skinny kernel, in bytes from the start: the block's reduction barrier
 * and one weight barrier per warp; every warp's weights (its part of its tile, as streamed)
 * and scale words; the block's slice of the activations (M rows, the part's k) and (split K)
 * the partial tiles the peers send for the tiles this block reduces:
 * [tile / parts][part][lane][MT8][4] floats. */
struct SkinnyLayout {
    int w, s, x, red, total;
};
__host__ __device__ inline SkinnyLayout skinny_layout(int m, int warps, int parts, int cpp, int groups_per_part) {
    SkinnyLayout L;
    L.w = 128;   /* barriers: 8 bytes each, 1 + at most 8 warps */
    L.s = L.w + warps * cpp * 512;
    L.x = L.s + warps * groups_per_part * 32;
    L.red = L.x + ((m * (cpp * CHUNK_K + 8) * 2 + 15) & ~15);
    L.total = L.red + (parts > 1 ? (warps + parts - 1) / parts * parts * 32 * (m > 8 ? 32 : 16) : 0);
    return L;
}

/* the small-M kernel (w4a16_skinny.cu) for one plain GEMM launch */
struct SkinnyPlan {
    KernelFn fn;
    int threads, smem, clusters;   /* grid = clusters x parts blocks, clusters of `parts` */
};
/* false when it does not take the launch (M above 16, a part longer than 16 chunks of 64, or
 * shared memory that does not fit even with one warp per block; then the pipelined kernel
 * does). warps: tiles per block (at most 8), <= 0: chosen from the shape (about one block per
 * SM, at most 4 warps at M <= 4) */
bool skinny_plan(int warps, int m, int n_tiles, int kc, int parts, int cpp, int gshift, SkinnyPlan *plan);
/* the shared memory the skinny kernel may take on the current device (its attribute is set to this) */
int skinny_smem_max();
/* an attribute of the current device, asked once per (device, attribute); fallback when the
 * driver does not answer */
int device_attr(cudaDeviceAttr attr, int fallback);
/* the current device's SM count */
int sm_count();

}  // namespace kd_w4a16_impl
#endif
