/* w4a16_bench.cu: validation and benchmark of the W4A16 kernels (cuda/w4a16*.cu), standalone
 * (links cuda/w4a16.cu, cuda/w4a16_skinny.cu and core/error.c only, plus cuBLAS for the GEMM
 * ceiling).
 *
 *   w4a16_bench [--quick] [--small] [--no-bench] [--no-check] [--moe-only T] [--md FILE]
 *   --small: small shapes only, no ceilings or timings (for compute-sanitizer)
 *   --moe-only T: the copy ceiling and the K2.6 MoE layer timing at T tokens, nothing else (A/B
 *   runs, profilers)
 *
 * 1. ceilings measured in this run: cudaMemcpy device-to-device (2 GiB, bytes read + written),
 *    a read-only kernel (2 GiB of 16-byte loads), cuBLAS bf16 GEMM 8192^3 (fp32 accumulate),
 *    the kernels' tensor-core instruction (mma.sync m16n8k16 bf16: rate and latency), and the
 *    least a launch costs in a chain of dependent launches;
 * 2. checks: the W4A16 GEMM against an fp64 host reference of the dequantised weights on
 *    random data (every row, a sample of columns), all kernel configurations, f32 and bf16
 *    outputs, outputs poisoned with NaN first; configurations, M = 1 vs inside M = 37 and the
 *    PDL launch must agree bit for bit (batch invariance); the MoE grouped form against an
 *    fp64 reference, and a token alone vs inside a batch, bit for bit;
 * 3. timings: CUDA events around 32 launches rotating over 32 distinct weights (264 MB, far
 *    past the 50 MB L2), warm-up first, median of 15; the MoE layer at K2.6 dims (384 experts,
 *    top-8), as GB/s of the expert bytes it must read.
 * A markdown table goes to --md FILE (default build/bench/w4a16.md); a summary ends stdout. */
#include "../../cuda/w4a16.cuh"
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <map>
#ifdef _OPENMP
#include <omp.h>
#endif

#define CK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "FATAL %s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); exit(2); } } while (0)
#define KT(call) do { kd_status s_ = (call); if (s_ != KD_OK) { \
    fprintf(stderr, "FATAL %s:%d %s: %s\n", __FILE__, __LINE__, #call, kd_last_error()); exit(2); } } while (0)

static int g_fail = 0;
static bool g_check_parts = true;
static std::string g_md;
static char g_line[1024];
#define MD(...) do { snprintf(g_line, sizeof g_line, __VA_ARGS__); g_md += g_line; fputs(g_line, stdout); } while (0)
#define CHECK(cond, ...) do { if (!(cond)) { g_fail++; printf("FAIL: "); printf(__VA_ARGS__); printf("\n"); } } while (0)

/* ---------------------------------------------------------------- host helpers */
static float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd() { g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17; return g_rng; }
static double urand() { return (rnd() >> 11) * (1.0 / 9007199254740992.0); }
static double nrand() { double u = urand() + 1e-300, v = urand(); return sqrt(-2 * log(u)) * cos(6.283185307179586 * v); }

struct HostW {   /* a checkpoint-form INT4 weight on the host */
    int n, k, g;
    std::vector<uint32_t> codes;
    std::vector<uint16_t> scales;
    double w(int r, int c) const {
        int u = (codes[(size_t)r * (k / 8) + c / 8] >> (4 * (c & 7))) & 15;
        return (double)(u - 8) * bf2f(scales[(size_t)r * (k / g) + c / g]);
    }
};
static HostW make_host_w(int n, int k, int g, double scale) {
    HostW h{n, k, g, {}, {}};
    h.codes.resize((size_t)n * k / 8);
    for (auto &c : h.codes) c = (uint32_t)rnd();                      /* all 16 codes, -8 included */
    h.scales.resize((size_t)n * k / g);
    for (auto &s : h.scales) s = f2bf((float)(scale / 7 * (0.5 + urand()) * (urand() < 0.05 ? -1 : 1)));
    return h;
}

struct DevW { void *codes = nullptr, *scales = nullptr; int n = 0, k = 0, g = 0; };
static DevW upload_w(const HostW &h) {
    DevW d; d.n = h.n; d.k = h.k; d.g = h.g;
    void *raw_c, *raw_s;
    CK(cudaMalloc(&raw_c, h.codes.size() * 4));
    CK(cudaMalloc(&raw_s, h.scales.size() * 2));
    CK(cudaMemcpy(raw_c, h.codes.data(), h.codes.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(raw_s, h.scales.data(), h.scales.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d.codes, kd_w4a16_codes_bytes(h.n, h.k)));
    CK(cudaMalloc(&d.scales, kd_w4a16_scales_bytes(h.n, h.k, h.g)));
    KT(kd_w4a16_repack((const int32_t *)raw_c, (const uint16_t *)raw_s, h.n, h.k, h.g, d.codes, d.scales, 0));
    CK(cudaDeviceSynchronize());
    cudaFree(raw_c); cudaFree(raw_s);
    return d;
}
static void free_w(DevW &d) { cudaFree(d.codes); cudaFree(d.scales); d.codes = d.scales = nullptr; }

static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

/* ---------------------------------------------------------------- device fill kernels */
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__global__ void fill_u32(uint32_t *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (uint32_t)mix64(seed * 0x100000001ull + i);
}
/* bf16 values uniform in [lo, hi) */
__global__ void fill_bf16(__nv_bfloat16 *p, size_t n, uint64_t seed, float lo, float hi) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float u = (mix64(seed * 0x100000001ull + i) >> 40) * (1.0f / 16777216.0f);
        p[i] = __float2bfloat16(lo + (hi - lo) * u);
    }
}
__global__ void read_kernel(const uint4 *p, size_t n, unsigned *out) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;   /* keeps the loads; practically never stores */
}
/* SM clock probe: clock64 cycles over globaltimer nanoseconds on one block per SM */
/* The same bytes as one GEMM (a weight's codes and scales), read and discarded: the most a
 * kernel streaming one 8 MB weight per launch can reach in this harness (launch, ramp and
 * tail included). Programmatic dependent launch like the GEMM: the next launch starts its
 * reads while this one finishes. */
__global__ void stream_kernel(const uint4 *a, size_t na, const uint4 *b, size_t nb, unsigned *out) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
    unsigned acc = 0;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t j = i; j < na; j += stride) { uint4 v = __ldcs(a + j); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    for (size_t j = i; j < nb; j += stride) { uint4 v = __ldcs(b + j); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    if (acc == 0x9e3779b9u) out[0] = acc;   /* keeps the loads; practically never stores */
}

__global__ void clock_probe(unsigned long long spin, double *mhz) {
    unsigned long long t0, t1;
    long long c0 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while ((unsigned long long)(clock64() - c0) < spin) {}
    long long c1 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (threadIdx.x == 0) mhz[blockIdx.x] = (double)(c1 - c0) / (double)(t1 - t0) * 1e3;
}
static double sm_mhz() {
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    double *d; CK(cudaMalloc(&d, sms * sizeof(double)));
    clock_probe<<<sms, 32>>>(2000000ull, d);
    CK(cudaGetLastError());
    std::vector<double> h(sms);
    CK(cudaMemcpy(h.data(), d, sms * sizeof(double), cudaMemcpyDeviceToHost));
    cudaFree(d);
    return median(h);
}
static void dev_fill_u32(void *p, size_t n, uint64_t seed) { fill_u32<<<2048, 256>>>((uint32_t *)p, n, seed); CK(cudaGetLastError()); }
static void dev_fill_bf16(void *p, size_t n, uint64_t seed, float lo, float hi) {
    fill_bf16<<<2048, 256>>>((__nv_bfloat16 *)p, n, seed, lo, hi); CK(cudaGetLastError());
}

/* ---------------------------------------------------------------- timing */
struct Timer {
    cudaEvent_t a, b;
    Timer() { CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b)); }
    ~Timer() { cudaEventDestroy(a); cudaEventDestroy(b); }
};
template <class F> static double time_ms(F f, int warm, int reps, cudaStream_t st = 0) {
    Timer t;
    for (int i = 0; i < warm; i++) f();
    CK(cudaStreamSynchronize(st));
    std::vector<double> v;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(t.a, st));
        f();
        CK(cudaEventRecord(t.b, st));
        CK(cudaEventSynchronize(t.b));
        float ms; CK(cudaEventElapsedTime(&ms, t.a, t.b));
        v.push_back(ms);
    }
    return median(v);
}

/* the median time of replaying, as one CUDA graph, what record() enqueues on st */
template <class F> static double graph_ms(cudaStream_t st, F record, int warm, int reps) {
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    record();
    CK(cudaStreamEndCapture(st, &gr));
    CK(cudaGraphInstantiate(&ge, gr, 0));
    double ms = time_ms([&] { CK(cudaGraphLaunch(ge, st)); }, warm, reps, st);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(gr);
    return ms;
}

static double g_copy_gbs = 0, g_read_gbs = 0, g_gemm_tflops = 0, g_mma_tflops = 0, g_mma_clk = 0, g_mma_lat = 0;
static double g_chain_us[2] = {0, 0};

/* The tensor-core instruction the W4A16 kernels use (mma.sync m16n8k16, bf16 in, fp32
 * accumulate): CH independent accumulator chains per warp, `iters` rounds; each block's
 * clock64 cycles go to clk[block]. */
template <int CH>
__global__ void mma_probe(int iters, float *sink, long long *clk) {
    uint32_t a[4] = {0x3F803F80u ^ threadIdx.x, 0x3F803F80u, 0x3F80u, 0x3F800000u};
    const uint32_t b0 = 0x3F803F80u + threadIdx.x, b1 = 0x3F803F80u;
    float c[CH][4] = {};
    __syncthreads();
    const long long t0 = clock64();
    for (int it = 0; it < iters; it++)
#pragma unroll
        for (int i = 0; i < CH; i++)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                         "{%0,%1,%2,%3};\n"
                         : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    __syncthreads();
    const long long t1 = clock64();
    float sum = 0;
    for (int i = 0; i < CH; i++) sum += c[i][0] + c[i][1] + c[i][2] + c[i][3];
    if (sum == 1234.5f) sink[threadIdx.x] = sum;   /* keeps the chains; practically never stores */
    if (threadIdx.x == 0) clk[blockIdx.x] = t1 - t0;
}
/* The least a launch costs in a chain of dependent launches (graph + PDL), whatever it computes:
 * each launch waits for the previous grid, reads what it wrote and writes for the next one. The
 * grid is the small-M kernel's at 2048 x 7168 for M > 4 (128 blocks of 256 threads; at M <= 4 it
 * takes 256 blocks of 128), plain or in clusters of 8. A W4A16 launch that streams one weight
 * pays this besides its math. */
__global__ void chain_kernel(const float *x, float *y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    y[i] = x[i] + 1.0f;
}
static void chain_ceiling() {
    const int blocks = 128, threads = 256, launches = 32;
    float *buf;
    CK(cudaMalloc(&buf, 2 * blocks * threads * sizeof(float)));
    CK(cudaMemset(buf, 0, 2 * blocks * threads * sizeof(float)));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int clustered = 0; clustered < 2; clustered++) {
        cudaLaunchAttribute at[2];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        at[1].id = cudaLaunchAttributeClusterDimension;
        at[1].val.clusterDim.x = 8; at[1].val.clusterDim.y = 1; at[1].val.clusterDim.z = 1;
        cudaLaunchConfig_t lc = {};
        lc.gridDim = dim3(blocks); lc.blockDim = dim3(threads); lc.stream = st; lc.attrs = at;
        lc.numAttrs = clustered ? 2 : 1;
        g_chain_us[clustered] = graph_ms(st, [&] {
            for (int i = 0; i < launches; i++) {
                const float *x = buf + (i & 1) * blocks * threads;
                float *y = buf + (~i & 1) * blocks * threads;
                CK(cudaLaunchKernelEx(&lc, chain_kernel, x, y));
            }
        }, 3, 15) * 1e3 / launches;
    }
    cudaStreamDestroy(st);
    cudaFree(buf);
}

/* the mma.sync ceiling: 8 warps per SM (two per sub-partition), 8 chains each, as TFLOP/s and
 * cycles per mma per sub-partition; and one warp per sub-partition with one chain: the
 * latency of a dependent mma */
static void mma_ceiling() {
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int iters = 4096;
    float *sink; long long *clk;
    CK(cudaMalloc(&sink, 1024 * sizeof(float))); CK(cudaMalloc(&clk, sms * sizeof(long long)));
    std::vector<long long> h(sms);
    auto mean_clk = [&] {
        CK(cudaMemcpy(h.data(), clk, sms * sizeof(long long), cudaMemcpyDeviceToHost));
        double m = 0;
        for (long long v : h) m += (double)v;
        return m / sms;
    };
    double ms = time_ms([&] { mma_probe<8><<<sms, 256>>>(iters, sink, clk); }, 1, 5);
    CK(cudaGetLastError());
    g_mma_clk = mean_clk() / ((double)iters * 8 * 8 / 4);
    g_mma_tflops = 2.0 * 16 * 8 * 16 * iters * 8 * 8 * (double)sms / (ms * 1e-3) / 1e12;
    time_ms([&] { mma_probe<1><<<sms, 128>>>(iters, sink, clk); }, 1, 1);
    CK(cudaGetLastError());
    g_mma_lat = mean_clk() / iters;
    cudaFree(sink); cudaFree(clk);
}

/* the bandwidth ceilings: device-to-device copy and the read-only kernel */
static void copy_ceilings(bool quick) {
    size_t bytes = (size_t)(quick ? 1 : 2) << 30;
    void *a, *b; unsigned *o;
    CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes)); CK(cudaMalloc(&o, 4));
    dev_fill_u32(a, bytes / 4, 1); dev_fill_u32(b, bytes / 4, 2);
    double ms = time_ms([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0)); }, 2, 10);
    g_copy_gbs = 2.0 * bytes / (ms * 1e-3) / 1e9;
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    ms = time_ms([&] { read_kernel<<<sms * 8, 512>>>((const uint4 *)a, bytes / 16, o); }, 2, 10);
    CK(cudaGetLastError());
    g_read_gbs = bytes / (ms * 1e-3) / 1e9;
    cudaFree(a); cudaFree(b); cudaFree(o);
}

/* every ceiling: bandwidth, the cuBLAS bf16 GEMM, the mma.sync rate, the dependent-launch chain */
static void ceilings(bool quick) {
    copy_ceilings(quick);
    mma_ceiling();
    chain_ceiling();
    int n = 8192;
    void *A, *B, *C;
    CK(cudaMalloc(&A, (size_t)n * n * 2)); CK(cudaMalloc(&B, (size_t)n * n * 2)); CK(cudaMalloc(&C, (size_t)n * n * 2));
    dev_fill_bf16(A, (size_t)n * n, 3, -1, 1); dev_fill_bf16(B, (size_t)n * n, 4, -1, 1);
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        printf("cublasCreate failed\n");
        cudaFree(A); cudaFree(B); cudaFree(C);
        return;
    }
    float one = 1, zero = 0;
    auto gemm = [&] {
        cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A, CUDA_R_16BF, n, B, CUDA_R_16BF, n,
                                        &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) { printf("cublasGemmEx failed %d\n", (int)s); exit(2); }
    };
    const double ms = time_ms(gemm, 3, 10);
    g_gemm_tflops = 2.0 * n * (double)n * n / (ms * 1e-3) / 1e12;
    cublasDestroy(h);
    cudaFree(A); cudaFree(B); cudaFree(C);
}

/* ---------------------------------------------------------------- GEMM checks */
static void poison(void *p, size_t bytes) { CK(cudaMemset(p, 0xFF, bytes)); }   /* NaN in f32 and bf16 */

static std::vector<float> download_y(const void *y, int m, int n, int f32) {
    std::vector<float> out((size_t)m * n);
    if (f32) CK(cudaMemcpy(out.data(), y, out.size() * 4, cudaMemcpyDeviceToHost));
    else {
        std::vector<uint16_t> b(out.size());
        CK(cudaMemcpy(b.data(), y, b.size() * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < b.size(); i++) out[i] = bf2f(b[i]);
    }
    return out;
}

static void run_gemm(const DevW &w, const void *x, int m, void *y, int f32, int flags) {
    KT(kd_w4a16_gemm(w.codes, w.scales, w.n, w.k, w.g, x, w.k, m, y, w.n, f32, flags, 0));
}

static void check_gemm_shape(int n, int k, int g, const std::vector<int> &ms) {
    HostW h = make_host_w(n, k, g, 1.0 / sqrt((double)k));
    DevW w = upload_w(h);
    int mmax = *std::max_element(ms.begin(), ms.end());
    std::vector<uint16_t> xh((size_t)mmax * k);
    for (auto &v : xh) v = f2bf((float)nrand());
    void *x, *y, *y2;
    CK(cudaMalloc(&x, xh.size() * 2));
    CK(cudaMemcpy(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&y, (size_t)mmax * n * 4)); CK(cudaMalloc(&y2, (size_t)mmax * n * 4));
    /* reference: all rows, sampled columns */
    std::vector<int> cols;
    if (n <= 96) for (int c = 0; c < n; c++) cols.push_back(c);
    else {
        cols = {0, 1, 7, 8, 15, 16, n - 1, n - 2, n - 9, n / 2};
        while ((int)cols.size() < 40) cols.push_back((int)(rnd() % n));
    }
    std::vector<double> ref((size_t)mmax * cols.size());
#pragma omp parallel for schedule(dynamic)
    for (int ci = 0; ci < (int)cols.size(); ci++) {
        std::vector<double> wr(k);
        for (int c = 0; c < k; c++) wr[c] = h.w(cols[ci], c);
        for (int r = 0; r < mmax; r++) {
            double s = 0;
            const uint16_t *xr = &xh[(size_t)r * k];
            for (int c = 0; c < k; c++) s += wr[c] * bf2f(xr[c]);
            ref[(size_t)r * cols.size() + ci] = s;
        }
    }
    int parts = kd_w4a16_parts(n, k, g);
    double worst_f32 = 0, worst_bf16 = 0;
    int ncfg = kd_w4a16_n_configs();
    for (int m : ms) {
        std::vector<float> base;
        for (int cfg = -1; cfg < ncfg; cfg++) {
            kd_w4a16_force_config(cfg);
            for (int f32 = 1; f32 >= 0; f32--) {
                if (cfg >= 0 && !f32) continue;
                poison(y, (size_t)mmax * n * 4);
                run_gemm(w, x, m, y, f32, 0);
                CK(cudaDeviceSynchronize());
                std::vector<float> out = download_y(y, m, n, f32);
                size_t nan = 0;
                for (float v : out) nan += !(v == v) || std::isinf(v);
                CHECK(nan == 0, "gemm N%d K%d g%d M%d cfg %s f32 %d: %zu outputs NaN/inf (unwritten?)", n, k, g, m,
                      kd_w4a16_config_name(cfg), f32, nan);
                double md = 0, mr = 0;
                for (int r = 0; r < m; r++)
                    for (size_t ci = 0; ci < cols.size(); ci++) {
                        double rv = ref[(size_t)r * cols.size() + ci], d = fabs(out[(size_t)r * n + cols[ci]] - rv);
                        if (!(d == d)) d = INFINITY;
                        md = std::max(md, d); mr = std::max(mr, fabs(rv));
                    }
                double rel = md / std::max(mr, 1e-30);
                if (f32) worst_f32 = std::max(worst_f32, rel); else worst_bf16 = std::max(worst_bf16, rel);
                CHECK(rel < (f32 ? 2e-5 : 5e-3), "gemm N%d K%d g%d M%d cfg %s f32 %d: max rel err %.3g", n, k, g, m,
                      kd_w4a16_config_name(cfg), f32, rel);
                if (f32) {
                    if (cfg == -1) base = out;
                    else if (memcmp(base.data(), out.data(), out.size() * 4)) {
                        size_t i = 0; while (i < out.size() && !memcmp(&base[i], &out[i], 4)) i++;
                        CHECK(false, "gemm N%d K%d g%d M%d: config %s differs from auto at row %zu col %zu", n, k, g,
                              m, kd_w4a16_config_name(cfg), i / n, i % n);
                    }
                }
            }
        }
        kd_w4a16_force_config(-1);
        /* PDL launch: same bits */
        poison(y2, (size_t)mmax * n * 4);
        run_gemm(w, x, m, y2, 1, KD_W4A16_PDL);
        CK(cudaDeviceSynchronize());
        std::vector<float> pd = download_y(y2, m, n, 1);
        CHECK(!memcmp(pd.data(), base.data(), pd.size() * 4), "gemm N%d K%d g%d M%d: PDL launch differs", n, k, g, m);
        /* other splits of K (bench variants): still right against fp64 */
        if (g_check_parts && (m == 1 || m == 16)) {
            for (int p : {2, 4, 8}) {
                kd_w4a16_force_parts(p);
                poison(y2, (size_t)mmax * n * 4);
                run_gemm(w, x, m, y2, 1, 0);
                CK(cudaDeviceSynchronize());
                kd_w4a16_force_parts(0);
                std::vector<float> o = download_y(y2, m, n, 1);
                double md = 0, mr = 0;
                for (int r = 0; r < m; r++)
                    for (size_t ci = 0; ci < cols.size(); ci++) {
                        double rv = ref[(size_t)r * cols.size() + ci], d = fabs(o[(size_t)r * n + cols[ci]] - rv);
                        if (!(d == d)) d = INFINITY;
                        md = std::max(md, d); mr = std::max(mr, fabs(rv));
                    }
                CHECK(md / std::max(mr, 1e-30) < 2e-5, "gemm N%d K%d g%d M%d forced parts %d: max rel err %.3g", n, k,
                      g, m, p, md / std::max(mr, 1e-30));
            }
        }
        /* batch invariance: each of a few rows alone (M = 1) vs inside M */
        int rows_to_try[3] = {0, m / 2, m - 1};
        for (int ri = 0; ri < 3; ri++) {
            int r = rows_to_try[ri];
            poison(y2, (size_t)n * 4);
            run_gemm(w, (const char *)x + (size_t)r * k * 2, 1, y2, 1, 0);
            CK(cudaDeviceSynchronize());
            std::vector<float> one = download_y(y2, 1, n, 1);
            CHECK(!memcmp(one.data(), &base[(size_t)r * n], (size_t)n * 4),
                  "gemm N%d K%d g%d: row %d alone differs from the same row inside M=%d", n, k, g, r, m);
        }
    }
    printf("check gemm N %5d K %5d g %3d parts %2d: M {", n, k, g, parts);
    for (int m : ms) printf(" %d", m);
    printf(" } x %d configs: max rel err f32 %.2e, bf16 %.2e\n", ncfg + 1, worst_f32, worst_bf16);
    MD("| %d | %d | %d | %d | %.2e | %.2e |\n", n, k, g, parts, worst_f32, worst_bf16);
    cudaFree(x); cudaFree(y); cudaFree(y2);
    free_w(w);
}

/* ---------------------------------------------------------------- MoE checks */
struct HostMoe {
    kd_w4a16_moe_shape s;
    std::vector<HostW> gate, up, down;
    std::vector<DevW> dg, du, dd;
    kd_w4a16_expert *table = nullptr;
};
static void make_moe(HostMoe &M, int E, int topk, int H, int I, int g, bool host_copy) {
    M.s = {E, topk, H, I, g};
    std::vector<kd_w4a16_expert> t(E);
    for (int e = 0; e < E; e++) {
        HostW hg = make_host_w(I, H, g, 1.0 / sqrt((double)H)), hu = make_host_w(I, H, g, 1.0 / sqrt((double)H));
        HostW hd = make_host_w(H, I, g, 1.0 / sqrt((double)I));
        M.dg.push_back(upload_w(hg)); M.du.push_back(upload_w(hu)); M.dd.push_back(upload_w(hd));
        t[e] = {M.dg[e].codes, M.dg[e].scales, M.du[e].codes, M.du[e].scales, M.dd[e].codes, M.dd[e].scales};
        if (host_copy) { M.gate.push_back(std::move(hg)); M.up.push_back(std::move(hu)); M.down.push_back(std::move(hd)); }
    }
    CK(cudaMalloc(&M.table, E * sizeof(kd_w4a16_expert)));
    CK(cudaMemcpy(M.table, t.data(), E * sizeof(kd_w4a16_expert), cudaMemcpyHostToDevice));
}
static void free_moe(HostMoe &M) {
    for (auto &d : M.dg) free_w(d);
    for (auto &d : M.du) free_w(d);
    for (auto &d : M.dd) free_w(d);
    cudaFree(M.table);
}
/* top_k distinct experts per token, ascending; weights in (0.1, 1.1) */
static void make_routes(int T, int E, int topk, std::vector<int> &ids, std::vector<float> &wt) {
    ids.resize((size_t)T * topk); wt.resize(ids.size());
    for (int t = 0; t < T; t++) {
        std::vector<int> pick;
        while ((int)pick.size() < topk) {
            int e = (int)(rnd() % E);
            if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
        }
        std::sort(pick.begin(), pick.end());
        for (int j = 0; j < topk; j++) { ids[(size_t)t * topk + j] = pick[j]; wt[(size_t)t * topk + j] = (float)(0.1 + urand()); }
    }
}

static void moe_run(const HostMoe &M, const void *x, int T, const int *ids_d, const float *w_d, void *out, int f32,
                    void *ws, size_t wsb) {
    KT(kd_w4a16_moe(&M.s, M.table, x, M.s.hidden, T, ids_d, w_d, NULL, 0, NULL, out, M.s.hidden, f32, ws, wsb, 0));
}

static void check_moe(int E, int topk, int H, int I, int g, const std::vector<int> &Ts, int n_ref_tokens) {
    HostMoe M;
    make_moe(M, E, topk, H, I, g, true);
    int Tmax = *std::max_element(Ts.begin(), Ts.end());
    std::vector<uint16_t> xh((size_t)Tmax * H);
    for (auto &v : xh) v = f2bf((float)nrand());
    std::vector<int> ids; std::vector<float> wt;
    make_routes(Tmax, E, topk, ids, wt);
    if (Tmax > 2) ids[(size_t)1 * topk + topk - 1] = -1;   /* an invalid id contributes nothing */
    void *x, *out, *out1, *ws, *ids_d, *w_d;
    CK(cudaMalloc(&x, xh.size() * 2));
    CK(cudaMemcpy(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&ids_d, ids.size() * 4)); CK(cudaMalloc(&w_d, wt.size() * 4));
    CK(cudaMemcpy(ids_d, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w_d, wt.data(), wt.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&out, (size_t)Tmax * H * 4)); CK(cudaMalloc(&out1, (size_t)H * 4));
    size_t wsb = 0;
    for (int T : Ts) wsb = std::max(wsb, kd_w4a16_moe_ws_bytes(&M.s, T));
    wsb = std::max(wsb, kd_w4a16_moe_ws_bytes(&M.s, 1));
    CK(cudaMalloc(&ws, wsb));
    /* reference for the first n_ref_tokens tokens */
    int nref = std::min(n_ref_tokens, Tmax);
    std::vector<double> ref((size_t)nref * H, 0.0);
#pragma omp parallel for schedule(dynamic)
    for (int tj = 0; tj < nref * topk; tj++) {
        int t = tj / topk, j = tj % topk, e = ids[(size_t)t * topk + j];
        if (e < 0) continue;
        std::vector<double> act(I);
        for (int i = 0; i < I; i++) {
            double gs = 0, us = 0;
            for (int c = 0; c < H; c++) {
                double xv = bf2f(xh[(size_t)t * H + c]);
                gs += M.gate[e].w(i, c) * xv; us += M.up[e].w(i, c) * xv;
            }
            act[i] = bf2f(f2bf((float)(gs / (1 + exp(-gs)) * us)));
        }
        std::vector<double> yv(H);
        for (int hh = 0; hh < H; hh++) {
            double s = 0;
            for (int i = 0; i < I; i++) s += M.down[e].w(hh, i) * act[i];
            yv[hh] = s * wt[(size_t)t * topk + j];
        }
#pragma omp critical
        for (int hh = 0; hh < H; hh++) ref[(size_t)t * H + hh] += yv[hh];
    }
    double worst = 0;
    for (int T : Ts) {
        for (int f32 = 1; f32 >= 0; f32--) {
            poison(out, (size_t)Tmax * H * 4);
            moe_run(M, x, T, (const int *)ids_d, (const float *)w_d, out, f32, ws, wsb);
            CK(cudaDeviceSynchronize());
            std::vector<float> o = download_y(out, T, H, f32);
            size_t nan = 0;
            for (float v : o) nan += !(v == v) || std::isinf(v);
            CHECK(nan == 0, "moe E%d k%d H%d I%d g%d T%d f32 %d: %zu NaN/inf outputs", E, topk, H, I, g, T, f32, nan);
            double md = 0, mr = 0;
            for (int t = 0; t < std::min(T, nref); t++)
                for (int hh = 0; hh < H; hh++) {
                    double d = fabs(o[(size_t)t * H + hh] - ref[(size_t)t * H + hh]);
                    if (!(d == d)) d = INFINITY;
                    md = std::max(md, d); mr = std::max(mr, fabs(ref[(size_t)t * H + hh]));
                }
            double rel = md / std::max(mr, 1e-30);
            worst = std::max(worst, rel);
            CHECK(rel < (f32 ? 2e-3 : 6e-3), "moe E%d k%d H%d I%d g%d T%d f32 %d: max rel err %.3g", E, topk, H, I, g, T,
                  f32, rel);
            if (f32) {
                /* batch invariance: tokens alone vs inside this batch */
                int toks[3] = {0, T / 2, T - 1};
                for (int q = 0; q < 3; q++) {
                    int t = toks[q];
                    poison(out1, (size_t)H * 4);
                    KT(kd_w4a16_moe(&M.s, M.table, (const char *)x + (size_t)t * H * 2, H, 1,
                                    (const int *)ids_d + (size_t)t * topk, (const float *)w_d + (size_t)t * topk, NULL,
                                    0, NULL, out1, H, 1, ws, wsb, 0));
                    CK(cudaDeviceSynchronize());
                    std::vector<float> a = download_y(out1, 1, H, 1);
                    CHECK(!memcmp(a.data(), &o[(size_t)t * H], (size_t)H * 4),
                          "moe E%d H%d I%d: token %d alone differs from inside T=%d", E, H, I, t, T);
                }
            }
        }
    }
    printf("check moe E %3d top %d H %5d I %5d g %3d: T {", E, topk, H, I, g);
    for (int T : Ts) printf(" %d", T);
    printf(" }: max rel err %.2e (vs fp64, %d tokens)\n", worst, nref);
    MD("| %d | %d | %d | %d | %d | %.2e |\n", E, topk, H, I, g, worst);
    cudaFree(x); cudaFree(out); cudaFree(out1); cudaFree(ws); cudaFree(ids_d); cudaFree(w_d);
    free_moe(M);
}

/* ---------------------------------------------------------------- benchmarks */
struct BenchRow { int n, k, m; std::string variant; double us, gbs, ratio, tflops; };
static std::vector<BenchRow> g_rows;

/* `copies` distinct random weights in device form: launches rotate over them so none stays in L2 */
static std::vector<DevW> random_dev_weights(int n, int k, int g, int copies) {
    std::vector<DevW> w(copies);
    for (int i = 0; i < copies; i++) {
        void *rc, *rs;
        size_t nc = (size_t)n * k / 8, ns = (size_t)n * k / g;
        CK(cudaMalloc(&rc, nc * 4)); CK(cudaMalloc(&rs, ns * 2));
        dev_fill_u32(rc, nc, 100 + i);
        dev_fill_bf16(rs, ns, 200 + i, 0.002f, 0.02f);
        w[i].n = n; w[i].k = k; w[i].g = g;
        CK(cudaMalloc(&w[i].codes, kd_w4a16_codes_bytes(n, k)));
        CK(cudaMalloc(&w[i].scales, kd_w4a16_scales_bytes(n, k, g)));
        KT(kd_w4a16_repack((const int32_t *)rc, (const uint16_t *)rs, n, k, g, w[i].codes, w[i].scales, 0));
        CK(cudaDeviceSynchronize());
        cudaFree(rc); cudaFree(rs);
    }
    return w;
}

static void bench_gemm(int n, int k, int g, const std::vector<int> &ms, bool quick) {
    const int COPIES = 32;
    std::vector<DevW> w = random_dev_weights(n, k, g, COPIES);
    int mmax = *std::max_element(ms.begin(), ms.end());
    void *x, *y;
    unsigned *sink;   /* the stream kernel's (practically never written) output */
    CK(cudaMalloc(&x, (size_t)mmax * k * 2)); CK(cudaMalloc(&y, (size_t)mmax * n * 4));
    CK(cudaMalloc(&sink, 16));
    dev_fill_bf16(x, (size_t)mmax * k, 7, -2, 2);
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    {   /* the stream row: the weights' bytes alone, read-only, same rotation, graph + PDL */
        int sms;
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        size_t nc = kd_w4a16_codes_bytes(n, k) / 16, ns = kd_w4a16_scales_bytes(n, k, g) / 16;
        cudaLaunchAttribute at;
        at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t lc = {};
        lc.gridDim = dim3(sms * 2); lc.blockDim = dim3(512); lc.stream = st; lc.attrs = &at; lc.numAttrs = 1;
        double t = graph_ms(st, [&] {
            for (int i = 0; i < COPIES; i++)
                CK(cudaLaunchKernelEx(&lc, stream_kernel, (const uint4 *)w[i].codes, nc, (const uint4 *)w[i].scales,
                                      ns, sink));
        }, 3, quick ? 5 : 15) * 1e-3 / COPIES;
        double bytes = (double)(nc + ns) * 16;
        BenchRow r{n, k, 0, "stream (read only)", t * 1e6, bytes / t / 1e9, bytes / t / 1e9 / g_copy_gbs, 0};
        g_rows.push_back(r);
        printf("bench N %5d K %5d stream (read only, graph+pdl) %8.2f us %8.1f GB/s %5.1f%% of copy\n", n, k, r.us,
               r.gbs, 100 * r.ratio);
    }
    for (int m : ms) {
        double bytes = (double)n * k / 2 + (double)n * (k / g) * 2 + (double)m * k * 2 + (double)m * n * 2;
        double flops = 2.0 * m * n * (double)k;
        struct V { std::string name; int cfg; int flags; bool graph; int parts; };
        std::vector<V> vs = {{"auto", -1, 0, false, 0}, {"auto+pdl", -1, KD_W4A16_PDL, false, 0},
                             {"graph+pdl", -1, KD_W4A16_PDL, true, 0}};
        if (!quick) {
            std::vector<int> cfgs = m <= 8 ? std::vector<int>{0, 1, 7, 8, 9} : m <= 16 ? std::vector<int>{2, 3, 7, 8, 9}
                                                                                : std::vector<int>{4, 5};
            std::vector<int> ps = m <= 16 ? std::vector<int>{2, 4, 8} : std::vector<int>{1, 2, 4, 8};
            for (int c : cfgs)
                for (int p : ps)
                    vs.push_back({std::string(kd_w4a16_config_name(c)) + "/P" + std::to_string(p), c,
                                  KD_W4A16_PDL, m == 1 || m == 16, p});
        }
        for (auto &v : vs) {
            kd_w4a16_force_config(v.cfg);
            kd_w4a16_force_parts(v.parts);
            auto round = [&] {
                for (int i = 0; i < COPIES; i++)
                    KT(kd_w4a16_gemm(w[i].codes, w[i].scales, n, k, g, x, k, m, y, n, 0, v.flags, st));
            };
            double ms_ = v.graph ? graph_ms(st, round, 3, quick ? 5 : 15) : time_ms(round, 3, quick ? 5 : 15, st);
            double t = ms_ * 1e-3 / COPIES;
            BenchRow r{n, k, m, v.name, t * 1e6, bytes / t / 1e9, bytes / t / 1e9 / g_copy_gbs, flops / t / 1e12};
            kd_w4a16_force_parts(0);
            g_rows.push_back(r);
            printf("bench N %5d K %5d M %3d %-12s %8.2f us %8.1f GB/s %5.1f%% of copy %7.2f TFLOP/s\n", n, k, m,
                   v.name.c_str(), r.us, r.gbs, 100 * r.ratio, r.tflops);
            fflush(stdout);
        }
        kd_w4a16_force_config(-1);
    }
    cudaStreamDestroy(st);
    cudaFree(x); cudaFree(y); cudaFree(sink);
    for (auto &d : w) free_w(d);
}

static void bench_moe(const std::vector<int> &Ts, bool quick) {
    const int E = 384, TOPK = 8, H = 7168, I = 2048, G = 32;
    HostMoe M;
    M.s = {E, TOPK, H, I, G};
    std::vector<kd_w4a16_expert> t(E);
    void *rc, *rs;
    size_t nc = (size_t)I * H / 8, ns = (size_t)I * H / G;
    CK(cudaMalloc(&rc, nc * 4)); CK(cudaMalloc(&rs, ns * 2));
    for (int e = 0; e < E; e++) {
        DevW d[3];
        for (int j = 0; j < 3; j++) {
            int n = j < 2 ? I : H, k = j < 2 ? H : I;
            dev_fill_u32(rc, nc, 1000 + 3 * e + j);
            dev_fill_bf16(rs, ns, 5000 + 3 * e + j, 0.002f, 0.02f);
            d[j].n = n; d[j].k = k; d[j].g = G;
            CK(cudaMalloc(&d[j].codes, kd_w4a16_codes_bytes(n, k)));
            CK(cudaMalloc(&d[j].scales, kd_w4a16_scales_bytes(n, k, G)));
            KT(kd_w4a16_repack((const int32_t *)rc, (const uint16_t *)rs, n, k, G, d[j].codes, d[j].scales, 0));
        }
        M.dg.push_back(d[0]); M.du.push_back(d[1]); M.dd.push_back(d[2]);
        t[e] = {d[0].codes, d[0].scales, d[1].codes, d[1].scales, d[2].codes, d[2].scales};
    }
    CK(cudaDeviceSynchronize());
    cudaFree(rc); cudaFree(rs);
    CK(cudaMalloc(&M.table, E * sizeof(kd_w4a16_expert)));
    CK(cudaMemcpy(M.table, t.data(), E * sizeof(kd_w4a16_expert), cudaMemcpyHostToDevice));
    int Tmax = *std::max_element(Ts.begin(), Ts.end());
    void *x, *out, *ws, *ids_d, *w_d;
    CK(cudaMalloc(&x, (size_t)Tmax * H * 2)); CK(cudaMalloc(&out, (size_t)Tmax * H * 2));
    dev_fill_bf16(x, (size_t)Tmax * H, 9, -2, 2);
    size_t wsb = kd_w4a16_moe_ws_bytes(&M.s, Tmax);
    for (int T : Ts) wsb = std::max(wsb, kd_w4a16_moe_ws_bytes(&M.s, T));
    CK(cudaMalloc(&ws, wsb));
    CK(cudaMalloc(&ids_d, (size_t)Tmax * TOPK * 4)); CK(cudaMalloc(&w_d, (size_t)Tmax * TOPK * 4));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    double per_expert = 3.0 * ((double)I * H / 2 + (double)I * (H / G) * 2);
    for (int T : Ts) {
        /* a few routing draws: several rounds rotate over them so the 50 MB L2 holds no expert */
        const int DRAWS = 8;
        std::vector<std::vector<int>> idsv(DRAWS);
        std::vector<float> wt;
        double touched = 0;
        std::vector<void *> idd(DRAWS);
        for (int dr = 0; dr < DRAWS; dr++) {
            make_routes(T, E, TOPK, idsv[dr], wt);
            std::vector<int> u = idsv[dr];
            std::sort(u.begin(), u.end());
            touched += std::unique(u.begin(), u.end()) - u.begin();
            CK(cudaMalloc(&idd[dr], idsv[dr].size() * 4));
            CK(cudaMemcpy(idd[dr], idsv[dr].data(), idsv[dr].size() * 4, cudaMemcpyHostToDevice));
        }
        CK(cudaMemcpy(w_d, wt.data(), wt.size() * 4, cudaMemcpyHostToDevice));
        touched /= DRAWS;
        auto round = [&] {
            for (int dr = 0; dr < DRAWS; dr++)
                KT(kd_w4a16_moe(&M.s, M.table, x, H, T, (const int *)idd[dr], (const float *)w_d, NULL, 0, NULL, out, H, 0, ws, wsb, st));
        };
        for (int var = 0; var < (quick || T > 16 ? 2 : 5); var++) {
            int graph = var == 1 || var >= 2, fp = var >= 2 ? 1 << (var - 2) : 0;   /* graph with P = 1, 2, 4 */
            kd_w4a16_force_parts(fp);
            double ms_ = graph ? graph_ms(st, round, 3, quick ? 5 : 15) : time_ms(round, 2, quick ? 5 : 15, st);
            double tt = ms_ * 1e-3 / DRAWS;
            double bytes = touched * per_expert + (double)T * H * 2 * 2;
            kd_w4a16_force_parts(0);
            std::string vn = graph ? "moe_graph" : "moe";
            if (fp) vn += "/P" + std::to_string(fp);
            BenchRow r{H, I, T, vn, tt * 1e6, bytes / tt / 1e9, bytes / tt / 1e9 / g_copy_gbs,
                       6.0 * T * TOPK * (double)H * I / tt / 1e12};
            g_rows.push_back(r);
            printf("bench moe E %d top %d T %3d (%.0f experts) %-10s %9.2f us %8.1f GB/s %5.1f%% of copy\n", E, TOPK, T,
                   touched, r.variant.c_str(), r.us, r.gbs, 100 * r.ratio);
            fflush(stdout);
        }
        for (auto p : idd) cudaFree(p);
    }
    cudaStreamDestroy(st);
    cudaFree(x); cudaFree(out); cudaFree(ws); cudaFree(ids_d); cudaFree(w_d);
    free_moe(M);
}

/* ~200 ms of streaming reads so the SM clock has ramped before the timings */
static void warm_clocks() {
    size_t bytes = (size_t)1 << 30;
    void *a; unsigned *o;
    CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&o, 4));
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int i = 0; i < 800; i++) read_kernel<<<sms * 8, 512>>>((const uint4 *)a, bytes / 16, o);
    CK(cudaDeviceSynchronize());
    cudaFree(a); cudaFree(o);
}

/* --profile: a few launches for ncu (-k regex:w4a16_gemm): GEMM M = 1, 16, 64 at both K2.6
 * shapes, then one MoE call (16 experts, T = 4) */
static int run_profile() {
    warm_clocks();
    for (int shape = 0; shape < 2; shape++) {
        int n = shape ? 7168 : 2048, k = shape ? 2048 : 7168, g = 32;
        HostW h = make_host_w(n, k, g, 0.01);
        DevW w = upload_w(h);
        void *x, *y;
        CK(cudaMalloc(&x, (size_t)64 * k * 2)); CK(cudaMalloc(&y, (size_t)64 * n * 4));
        dev_fill_bf16(x, (size_t)64 * k, 5, -1, 1);
        for (int m : {1, 16, 64})
            for (int rep = 0; rep < 2; rep++) run_gemm(w, x, m, y, 0, 0);
        CK(cudaDeviceSynchronize());
        cudaFree(x); cudaFree(y); free_w(w);
    }
    HostMoe M;
    make_moe(M, 16, 8, 7168, 2048, 32, false);
    std::vector<int> ids; std::vector<float> wt;
    make_routes(4, 16, 8, ids, wt);
    void *x, *out, *ws, *ids_d, *w_d;
    CK(cudaMalloc(&x, (size_t)4 * 7168 * 2)); CK(cudaMalloc(&out, (size_t)4 * 7168 * 4));
    dev_fill_bf16(x, (size_t)4 * 7168, 6, -1, 1);
    CK(cudaMalloc(&ids_d, ids.size() * 4)); CK(cudaMalloc(&w_d, wt.size() * 4));
    CK(cudaMemcpy(ids_d, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w_d, wt.data(), wt.size() * 4, cudaMemcpyHostToDevice));
    size_t wsb = kd_w4a16_moe_ws_bytes(&M.s, 4);
    CK(cudaMalloc(&ws, wsb));
    moe_run(M, x, 4, (const int *)ids_d, (const float *)w_d, out, 1, ws, wsb);
    CK(cudaDeviceSynchronize());
    printf("profile done\n");
    return 0;
}

#ifdef KD_W4A16_TRACE
/* --trace (make bench-trace): the small-M kernel's launch timeline. 32 launches over distinct
 * weights in a graph with PDL, as the graph+pdl rows; for four launches in the middle, the
 * earliest..latest block at each point, in us from the first block's entry, and the SMs
 * grouped by how many of the launch's blocks they ran, with the mean over those SMs of their
 * longest math (math done - weights in, both warp 0's): the balance of the math. */
static int run_trace() {
    warm_clocks();
    const char *point[KD_W4A16_TRACE_POINTS] = {"entry", "wait released", "activations in", "weights in", "math done", "end"};
    std::vector<unsigned long long> tr((size_t)KD_W4A16_TRACE_LAUNCHES * KD_W4A16_TRACE_BLOCKS * KD_W4A16_TRACE_POINTS);
    std::vector<unsigned> sms((size_t)KD_W4A16_TRACE_LAUNCHES * KD_W4A16_TRACE_BLOCKS), counts(KD_W4A16_TRACE_BLOCKS);
    for (int shape = 0; shape < 2; shape++) {
        const int n = shape ? 7168 : 2048, k = shape ? 2048 : 7168, g = 32, COPIES = 32;
        std::vector<DevW> w = random_dev_weights(n, k, g, COPIES);
        void *x, *y;
        CK(cudaMalloc(&x, (size_t)16 * k * 2)); CK(cudaMalloc(&y, (size_t)16 * n * 4));
        dev_fill_bf16(x, (size_t)16 * k, 7, -2, 2);
        cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        for (int m : {1, 8, 16}) {
            cudaGraph_t gr; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < COPIES; i++)
                KT(kd_w4a16_gemm(w[i].codes, w[i].scales, n, k, g, x, k, m, y, n, 0, KD_W4A16_PDL, st));
            CK(cudaStreamEndCapture(st, &gr));
            CK(cudaGraphInstantiate(&ge, gr, 0));
            for (int r = 0; r < 3; r++) CK(cudaGraphLaunch(ge, st));
            CK(cudaStreamSynchronize(st));
            CK(kd_w4a16_trace_read(tr.data(), sms.data(), counts.data(), 1) == 0 ? cudaSuccess : cudaErrorUnknown);
            double ms = time_ms([&] { CK(cudaGraphLaunch(ge, st)); }, 0, 1, st);
            CK(kd_w4a16_trace_read(tr.data(), sms.data(), counts.data(), 1) == 0 ? cudaSuccess : cudaErrorUnknown);
            int blocks = 0;
            while (blocks < KD_W4A16_TRACE_BLOCKS && counts[blocks] == (unsigned)COPIES) blocks++;
            auto at = [&](int l, int b, int p) { return tr[((size_t)l * KD_W4A16_TRACE_BLOCKS + b) * KD_W4A16_TRACE_POINTS + p]; };
            unsigned long long t0 = ~0ull;
            for (int b = 0; b < blocks; b++) t0 = std::min(t0, at(0, b, 0));
            printf("trace N %d K %d M %d: %.2f us per launch, %d blocks traced\n", n, k, m, ms * 1e3 / COPIES, blocks);
            for (int l = 12; l < 16 && blocks > 0; l++) {
                printf("  launch %2d:", l);
                for (int p = 0; p < KD_W4A16_TRACE_POINTS; p++) {
                    unsigned long long lo = ~0ull, hi = 0;
                    for (int b = 0; b < blocks; b++) { lo = std::min(lo, at(l, b, p)); hi = std::max(hi, at(l, b, p)); }
                    printf("  %s %.2f..%.2f", point[p], (lo - t0) * 1e-3, (hi - t0) * 1e-3);
                }
                printf("\n");
            }
            /* blocks per SM only when the whole launch was traced (a grid past the traced block
             * indices would leave SMs' blocks out) */
            const bool whole = blocks < KD_W4A16_TRACE_BLOCKS;
            if (!whole) printf("  (the launch may have more than the %d traced blocks: no per-SM table)\n", blocks);
            for (int l = 12; l < 16 && blocks > 0 && whole; l++) {
                std::map<unsigned, std::pair<int, double>> per_sm;   /* SM -> (blocks, longest math us) */
                for (int b = 0; b < blocks; b++) {
                    auto &e = per_sm[sms[(size_t)l * KD_W4A16_TRACE_BLOCKS + b]];
                    e.first++;
                    e.second = std::max(e.second, (at(l, b, 4) - at(l, b, 3)) * 1e-3);
                }
                std::map<int, std::pair<int, double>> by_count;   /* blocks on an SM -> (SMs, sum of math) */
                for (auto &e : per_sm) {
                    by_count[e.second.first].first++;
                    by_count[e.second.first].second += e.second.second;
                }
                printf("  launch %2d per SM:", l);
                for (auto &c : by_count)
                    printf("  %d block%s: %d SMs, math %.2f us", c.first, c.first > 1 ? "s" : "", c.second.first,
                           c.second.second / c.second.first);
                printf("\n");
            }
            cudaGraphExecDestroy(ge); cudaGraphDestroy(gr);
        }
        cudaStreamDestroy(st);
        cudaFree(x); cudaFree(y);
        for (auto &d : w) free_w(d);
    }
    return 0;
}
#endif

int main(int argc, char **argv) {
    bool quick = false, bench = true, check = true, small = false, profile = false;
    int moe_only = 0;
    std::string md_path = "build/bench/w4a16.md";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--no-bench")) bench = false;
        else if (!strcmp(argv[i], "--small")) small = true, bench = false, g_check_parts = false;
        else if (!strcmp(argv[i], "--profile")) profile = true;
#ifdef KD_W4A16_TRACE
        else if (!strcmp(argv[i], "--trace")) return run_trace();
#endif
        else if (!strcmp(argv[i], "--no-check")) check = false;
        else if (!strcmp(argv[i], "--md") && i + 1 < argc) md_path = argv[++i];
        else if (!strcmp(argv[i], "--moe-only") && i + 1 < argc) moe_only = atoi(argv[++i]);
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    MD("GPU: %s, %d SMs, L2 %d MB, %.0f GB; CUDA driver %d.%d, runtime %d.%d\n\n", p.name, p.multiProcessorCount,
       p.l2CacheSize >> 20, p.totalGlobalMem / 1e9, drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
    if (profile) return run_profile();
    if (moe_only > 0) {
        copy_ceilings(true);   /* the MoE rows are a ratio to the copy rate, nothing else */
        bench_moe({moe_only}, true);
        return 0;
    }
    double mhz_idle = sm_mhz();
    if (!small) ceilings(quick);
    double mhz_ceil = sm_mhz();
    if (!small) MD("Ceilings (this run): cudaMemcpy D2D %.0f GB/s (read + write), read-only kernel %.0f GB/s, "
       "cuBLAS bf16 GEMM 8192^3 %.0f TFLOP/s; mma.sync m16n8k16 bf16 %.0f TFLOP/s (%.1f cycles per mma per SM "
       "sub-partition with 16 chains in flight), a dependent mma %.1f cycles; a launch in a dependent chain "
       "(graph + PDL, 128 blocks, nothing computed) %.2f us, in clusters of 8 %.2f us\n\n", g_copy_gbs,
       g_read_gbs, g_gemm_tflops, g_mma_tflops, g_mma_clk, g_mma_lat, g_chain_us[0], g_chain_us[1]);
    if (check) {
        MD("Checks against fp64 (max |y - ref| / max |ref|; every configuration, M = 1..256):\n\n"
           "| N | K | group | parts | f32 out | bf16 out |\n|---|---|---|---|---|---|\n");
        std::vector<int> ms = {1, 2, 7, 8, 9, 16, 17, 37, 64, 100, 256};
        std::vector<int> msq = {1, 8, 16, 37, 256};
        if (!small) {
            check_gemm_shape(2048, 7168, 32, quick ? msq : ms);
            check_gemm_shape(7168, 2048, 32, quick ? msq : ms);
            check_gemm_shape(2048, 7168, 128, msq);
            check_gemm_shape(7168, 2048, 64, msq);
        }
        check_gemm_shape(300, 1024, 32, small ? msq : ms);
        check_gemm_shape(64, 128, 32, small ? msq : ms);
        check_gemm_shape(128, 64, 32, small ? msq : ms);
        check_gemm_shape(24, 96, 32, small ? msq : ms);
        if (!small) {
            check_gemm_shape(256, 7168, 32, msq);
            check_gemm_shape(7168, 256, 32, msq);
            check_gemm_shape(1000, 4096, 64, msq);
        }
        check_gemm_shape(40, 384, 128, small ? msq : ms);
        MD("\nMoE grouped form against fp64:\n\n| experts | top-k | hidden | inter | group | max rel err |\n"
           "|---|---|---|---|---|---|\n");
        check_moe(16, 4, 128, 64, 32, small ? std::vector<int>{1, 37} : std::vector<int>{1, 3, 37, 257}, 64);
        if (!small) {
            check_moe(32, 4, 512, 1024, 128, {1, 5, 37}, 12);
            check_moe(64, 8, 7168, 256, 32, {1, 4, 37}, 6);
        } else {
            check_moe(8, 2, 256, 128, 64, {1, 9}, 9);   /* split-K in both GEMMs */
        }
        if (!small && !quick) check_moe(16, 8, 7168, 2048, 32, {1, 3, 16}, 3);
        MD("\n");
    }
    if (bench) {
        warm_clocks();
        double mhz0 = sm_mhz();
        bench_gemm(2048, 7168, 32, {1, 4, 8, 16, 64, 256}, quick);
        double mhz1 = sm_mhz();
        MD("SM clock (clock64 / globaltimer): %.0f MHz idle at start, %.0f after the ceilings, %.0f before and %.0f after "
           "the GEMM timings\n\n", mhz_idle, mhz_ceil, mhz0, mhz1);
        bench_gemm(7168, 2048, 32, {1, 4, 8, 16, 64, 256}, quick);
        bench_moe({1, 4, 16, 64, 257}, quick);
        MD("\n| N | K | M | variant | us | GB/s | of copy | TFLOP/s |\n|---|---|---|---|---|---|---|---|\n");
        for (auto &r : g_rows)
            MD("| %d | %d | %d | %s | %.2f | %.0f | %.0f%% | %.2f |\n", r.n, r.k, r.m, r.variant.c_str(), r.us, r.gbs,
               100 * r.ratio, r.tflops);
    }
    FILE *f = fopen(md_path.c_str(), "w");
    if (f) { fputs(g_md.c_str(), f); fclose(f); }
    printf("\n%s: %d check failures\n", g_fail ? "FAILED" : "OK", g_fail);
    return g_fail ? 1 : 0;
}
