/* emu_main.cpp: runs cuda/gemm.cuh's dense GEMM kernel on the CPU under the fiber SIMT emulation
 * of ../mla_emu/inc (ldmatrix, mma.sync, and cp.async whose copies land only when a wait retires
 * their group) and checks, bit for bit:
 *  - every output element against a CPU sum with the emulated mma's rounding: each split an mma
 *    chain over its k16 steps from zero, the splits added in split order (what the last block of
 *    a tile adds), rounded to C's dtype;
 *  - batch invariance: rows of M = 1 equal to the same rows inside M = 37 and M = 130 (tiles of
 *    16, 64 and 128 rows);
 *  - every tile counter back at zero after a launch (the next launch relies on it);
 *  - SwiGLU launches (linear_swiglu): each output silu(g) * u of its gate and up row's sums, each
 *    rounded to C's dtype first, through the tile epilogue, the GEMM's last blocks or the second
 *    kernel;
 * over k-major and [K, N] weights, batched (head_matmul) and grouped (experts) launches, the
 * cp.async and plain-load paths, and 1 to 11 splits added by the GEMM's last blocks or by the
 * second kernel (kd_cuda_gemm's rule, and each forced). The emulated mma adds its 16 products in
 * double (the tensor core's own order differs), so this checks the kernel's indexing, pipeline,
 * split-K sums and launch logic, not the GPU's bits. Usage: run.sh (builds and runs this). */
#include "mla_mma.cuh"
#include "emu_fibers.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>

/* the CUDA pieces gemm.cuh uses beyond the attention's (one fiber runs at a time: no races) */
struct bf16 { uint16_t x; };
inline float __bfloat162float(bf16 b) { return mla::bf2f(b.x); }
inline bf16 __float2bfloat16(float f) { return bf16{mla::f2bf(f)}; }
template <class T> inline T __ldcg(const T *p) { return *p; }
inline void __threadfence() {}
inline float kd_round(int dt, float v) { return dt == KD_F32 ? v : mla::bf2f(mla::f2bf(v)); }
inline int atomicAdd(int *p, int v) { const int o = *p; *p = o + v; return o; }
#define __shared__ static
#define __align__(n)
unsigned char *gemm_emu_smem() { return emu_smem_buf; }
#define KD_GEMM_EMU 1
#include "../../../cuda/gemm_args.cuh"
#include "../../../cuda/gemm.cuh"

using namespace gemm;

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static double urand() { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (rs >> 11) * 0x1.0p-53; }
static float rval() { return (float)((urand() * 2 - 1) * 1.5); }

/* one GEMM: A [batch][rows][K] (bf16 or f32; gathered through a_rows when grouped), B per z
 * ([N][K] when kmajor, else [K][N]), C [batch][M][N] */
struct Case {
    const char *name;
    int M, N, K, batch, splits_asked;
    bool kmajor, a_f32, c_f32;
    std::vector<int> group_rows;   /* grouped: rows of each expert (z), else empty */
    int n1 = 0;                    /* > 0: a weight pair, columns [n1, N) from a second buffer (linear_pair) */
    bool glu = false;              /* with n1: a SwiGLU, rows [0, n1) the gate, [n1, 2 n1) the up weight, N
                                      = glu_cols(n1) logical columns, C n1 wide */
};

struct Data {
    std::vector<float> a32;        /* A as stored (f32 path) */
    std::vector<uint16_t> a16, b16;
    std::vector<int32_t> a_rows, row_off;
    std::vector<const bf16 *> b_ptrs;
    int a_total_rows = 0;
};


/* where split-K's sums are added: kd_cuda_gemm's rule, or forced */
enum SumPath { SUM_RULE, SUM_IN_KERNEL, SUM_SECOND_KERNEL };

/* The GEMM workspace, kept from launch to launch as the backend keeps it: the tile counters in
 * its first bytes (gemm_counter_bytes of a 132-SM part), every launch's partial sums after them.
 * Zeroed once, as a new workspace is; the counters must be zero again after every launch. */
constexpr size_t WS_COUNTERS = gemm_counter_bytes(132);
static std::vector<unsigned char> g_ws(WS_COUNTERS + ((size_t)64 << 20), 0);

/* kd_cuda_gemm's launch (one M chunk): tile height, splits, grid, partials and counters, and the
 * second kernel when the sums are not added in the GEMM */
static std::vector<float> run(const Case &c, Data &d, int *splits_out, bool *counters_zero, SumPath path = SUM_RULE) {
    const int M = c.M, N = c.N, K = c.K, Z = c.batch;
    kd_gemm_args g;
    std::memset(&g, 0, sizeof g);
    g.a_dtype = c.a_f32 ? KD_F32 : KD_BF16;
    g.A = c.a_f32 ? (const void *)d.a32.data() : (const void *)d.a16.data();
    g.lda = K;
    g.b_kmajor = c.kmajor;
    g.ldb = c.kmajor ? K : N;
    g.M = M; g.N = N; g.K = K; g.batch = Z;
    const int NC = c.glu ? c.n1 : N;   /* C's columns */
    std::vector<float> out((size_t)Z * M * NC, NAN);
    g.C = out.data();
    g.c_dtype = c.c_f32 ? KD_F32 : KD_BF16;
    std::vector<uint16_t> out16(c.c_f32 ? 0 : out.size(), 0x7fc0);
    if (!c.c_f32) g.C = out16.data();
    g.ldc = NC;
    if (!c.group_rows.empty()) {
        g.a_rows = d.a_rows.data();
        g.row_off = d.row_off.data();
        g.b_ptrs = d.b_ptrs.data();
        g.c_zstride = 0;
    } else {
        g.B = (const bf16 *)d.b16.data();
        g.b_zstride = (long long)N * K;
        g.a_zstride = (long long)M * K;
        g.c_zstride = (long long)M * NC;
    }
    std::vector<uint16_t> b1;   /* the pair's second weight: rows [n1, N) of the stacked one, elsewhere */
    if (c.n1 > 0) {
        b1.assign(d.b16.begin() + (size_t)c.n1 * K, d.b16.begin() + (size_t)(c.glu ? 2 * c.n1 : N) * K);
        g.B1 = (const bf16 *)b1.data();
        g.n1 = c.n1;
        g.glu = c.glu;
    }
    const int kt_total = (K + BK - 1) / BK;
    int per = (kt_total + c.splits_asked - 1) / c.splits_asked;
    const int splits = (kt_total + per - 1) / per;
    *splits_out = splits;
    const int tbm = gemm_tbm(M), n_tiles = (N + gemm_tbn(tbm) - 1) / gemm_tbn(tbm), m_tiles = (M + tbm - 1) / tbm;
    const size_t n_partial = (size_t)splits * Z * M * N;
    if (WS_COUNTERS + n_partial * sizeof(float) > g_ws.size()) {
        std::printf("FATAL: workspace too small\n");
        std::exit(2);
    }
    int *counters = (int *)g_ws.data();
    float *partial = (float *)(g_ws.data() + WS_COUNTERS);
    for (size_t i = 0; i < n_partial; i++) partial[i] = NAN;   /* the bytes every split must overwrite */
    const bool async = !c.a_f32 && K % 8 == 0 && (c.kmajor || N % 8 == 0);
    const int tile_rows = M < tbm ? M : tbm;
    const bool fits = (size_t)m_tiles * n_tiles * Z * sizeof(int) <= WS_COUNTERS;
    const bool in_kernel = path == SUM_RULE ? gemm_sum_in_kernel(tile_rows, splits) && fits : path == SUM_IN_KERNEL;
    int *counts = splits > 1 && in_kernel ? counters : nullptr;
    auto go = [&](auto kernel) {
        launch(m_tiles, n_tiles * splits, Z, THREADS, [&] { kernel(g, n_tiles, splits, per, partial, counts); });
        if (splits > 1 && !in_kernel)
            launch(3, 64, 1, 64, [&] { gemm_reduce_kernel(g, splits, partial); });   /* a strided grid */
    };
    if (tbm == BM_SMALL) {
        if (async) { if (c.kmajor) go(gemm_kernel<BM_SMALL, true, true>); else go(gemm_kernel<BM_SMALL, true, false>); }
        else { if (c.kmajor) go(gemm_kernel<BM_SMALL, false, true>); else go(gemm_kernel<BM_SMALL, false, false>); }
    } else if (tbm == BM) {
        if (async) { if (c.kmajor) go(gemm_kernel<BM, true, true>); else go(gemm_kernel<BM, true, false>); }
        else { if (c.kmajor) go(gemm_kernel<BM, false, true>); else go(gemm_kernel<BM, false, false>); }
    } else {
        if (async) { if (c.kmajor) go(gemm_kernel<BM_LARGE, true, true>); else go(gemm_kernel<BM_LARGE, true, false>); }
        else { if (c.kmajor) go(gemm_kernel<BM_LARGE, false, true>); else go(gemm_kernel<BM_LARGE, false, false>); }
    }
    *counters_zero = true;
    for (size_t i = 0; i < WS_COUNTERS / sizeof(int); i++) *counters_zero = *counters_zero && counters[i] == 0;
    if (!c.c_f32)
        for (size_t i = 0; i < out.size(); i++) out[i] = mla::bf2f(out16[i]);
    return out;
}

/* row r of z, column n: the splits' mma chains added in split order, unrounded */
static float ref_sum(const Case &c, const Data &d, int z, int r, int n, int splits) {
    const int K = c.K, N = c.N, kt_total = (K + BK - 1) / BK, per = (kt_total + splits - 1) / splits;
    const bool grouped = !c.group_rows.empty();
    const long long arow = grouped ? d.a_rows[r] : (long long)z * c.M + r;
    const uint16_t *B = grouped ? (const uint16_t *)d.b_ptrs[z] : d.b16.data() + (size_t)z * N * K;
    auto a = [&](int k) {
        return c.a_f32 ? mla::bf2f(mla::f2bf(d.a32[(size_t)arow * K + k])) : mla::bf2f(d.a16[(size_t)arow * K + k]);
    };
    auto b = [&](int k) { return mla::bf2f(c.kmajor ? B[(size_t)n * K + k] : B[(size_t)k * N + n]); };
    float sum = 0.0f;
    for (int sp = 0; sp < splits; sp++) {
        const int k0 = sp * per * BK, k1 = std::min(kt_total, (sp + 1) * per) * BK;
        float acc = 0.0f;
        for (int k16 = k0; k16 < k1; k16 += 16) {
            double p = 0.0;
            for (int i = 0; i < 16; i++) {
                const int k = k16 + i;
                if (k < K) p += (double)a(k) * (double)b(k);
            }
            acc = (float)(p + (double)acc);
        }
        sum = splits > 1 ? sum + acc : acc;
    }
    return sum;
}

/* the reference: row r of z, column n, as C's dtype holds it (glu: output column n of the gate's
 * row n and the up's row n1 + n) */
static float ref_elem(const Case &c, const Data &d, int z, int r, int n, int splits) {
    const int dt = c.c_f32 ? KD_F32 : KD_BF16;
    if (!c.glu) return kd_round(dt, ref_sum(c, d, z, r, n, splits));
    const float gv = kd_round(dt, ref_sum(c, d, z, r, n, splits)), uv = kd_round(dt, ref_sum(c, d, z, r, c.n1 + n, splits));
    return kd_round(dt, gv / (1.0f + expf(-gv)) * uv);
}

static Data make_data(const Case &c) {
    Data d;
    const bool grouped = !c.group_rows.empty();
    d.a_total_rows = grouped ? c.M + 3 : c.batch * c.M;
    const size_t na = (size_t)d.a_total_rows * c.K;
    d.a32.resize(na);
    d.a16.resize(na);
    for (size_t i = 0; i < na; i++) { d.a32[i] = rval(); d.a16[i] = mla::f2bf(rval()); }
    d.b16.resize((size_t)c.batch * c.N * c.K);
    for (auto &v : d.b16) v = mla::f2bf(rval());
    if (grouped) {
        d.row_off.push_back(0);
        for (int n : c.group_rows) d.row_off.push_back(d.row_off.back() + n);
        for (int i = 0; i < c.M; i++) d.a_rows.push_back((i * 7 + 2) % d.a_total_rows);   /* a gather */
        for (int z = 0; z < c.batch; z++) d.b_ptrs.push_back((const bf16 *)d.b16.data() + (size_t)z * c.N * c.K);
    }
    return d;
}

static int fails = 0, checks = 0;
static void report(bool ok, const char *what, const char *name) {
    checks++;
    if (!ok) fails++;
    std::printf("%s %s: %s\n", ok ? "ok  " : "FAIL", name, what);
}

static void check_case(const Case &c, SumPath path = SUM_RULE) {
    Data d = make_data(c);
    int splits;
    bool zero;
    std::vector<float> out = run(c, d, &splits, &zero, path);
    const bool grouped = !c.group_rows.empty();
    const int NC = c.glu ? c.n1 : c.N;
    long long bad = 0, first = -1;
    for (int z = 0; z < c.batch; z++)
        for (int m = 0; m < c.M; m++) {
            if (grouped && (m < d.row_off[z] || m >= d.row_off[z + 1])) continue;
            for (int n = 0; n < NC; n++) {
                const size_t i = grouped ? (size_t)m * NC + n : ((size_t)z * c.M + m) * NC + n;
                const float r = ref_elem(c, d, z, m, n, splits);
                if (std::memcmp(&r, &out[i], 4) != 0) { if (first < 0) first = (long long)i; bad++; }
            }
        }
    char what[200];
    const char *how = splits == 1 ? "" : path == SUM_IN_KERNEL ? " summed in the GEMM (forced)"
                                       : path == SUM_SECOND_KERNEL ? " summed by the second kernel (forced)" : "";
    std::snprintf(what, sizeof what, "M %d N %d K %d batch %d, %d split(s)%s: %lld elements differ from the "
                  "reference%s", c.M, c.N, c.K, c.batch, splits, how, bad, first >= 0 ? " (first at " : "");
    if (first >= 0) std::snprintf(what + std::strlen(what), sizeof what - std::strlen(what), "%lld)", first);
    report(bad == 0, what, c.name);
    report(zero, "every tile counter back at 0", c.name);
}

/* rows of M = 1, 37 and 100 within M = 130 (tiles of 16, 64 in one and two m tiles, and 128 rows):
 * the same bits (k-major bf16, the engine's linear) */
static void check_invariance(int splits) {
    const Case big{"invariance", 130, 136, 328, 1, splits, true, false, false, {}};
    const Data d = make_data(big);
    int s_big, s_part;
    bool zero;
    const std::vector<float> out_big = run(big, *const_cast<Data *>(&d), &s_big, &zero);
    struct { int M, r0, row; } parts[] = {{37, 0, 0}, {37, 0, 36}, {100, 0, 99}, {1, 0, 0}, {1, 77, 0}, {1, 129, 0}};
    for (const auto &p : parts) {   /* A rows [r0, r0 + M) of the big one; compare row `row` */
        Case c = big;
        c.M = p.M;
        Data dp = d;
        dp.a16.assign(d.a16.begin() + (size_t)p.r0 * big.K, d.a16.begin() + (size_t)(p.r0 + p.M) * big.K);
        const std::vector<float> out = run(c, dp, &s_part, &zero);
        const int r = p.r0 + p.row;
        const bool same = std::memcmp(&out[(size_t)p.row * big.N], &out_big[(size_t)r * big.N], big.N * 4) == 0;
        char what[120];
        std::snprintf(what, sizeof what, "row %d of M = %d == row %d of M = 130 (%d split(s))", p.row, p.M, r, s_big);
        report(same && s_part == s_big, what, "invariance");
    }
}

int main() {
    const Case cases[] = {
        {"linear", 1, 136, 328, 1, 5, true, false, false, {}},
        {"linear", 5, 200, 264, 1, 3, true, false, true, {}},
        {"linear", 37, 136, 328, 1, 7, true, false, false, {}},
        {"linear", 130, 72, 200, 1, 2, true, false, true, {}},
        {"linear", 64, 64, 64, 1, 1, true, false, false, {}},
        {"linear", 3, 72, 704, 1, 11, true, false, true, {}},
        {"linear f32 A (plain loads)", 20, 72, 100, 1, 3, true, true, true, {}},
        {"linear f32 A (plain loads)", 140, 200, 72, 1, 2, true, true, false, {}},
        {"head_matmul [K, N]", 3, 72, 96, 3, 2, false, false, false, {}},
        {"head_matmul [K, N]", 140, 136, 64, 2, 1, false, false, true, {}},
        {"head_matmul k-major", 17, 64, 160, 4, 4, true, false, true, {}},
        {"grouped experts", 25, 72, 96, 3, 1, true, false, true, {5, 0, 20}},
        {"grouped experts", 150, 136, 64, 2, 1, true, false, true, {100, 50}},
        /* weight pairs (linear_pair): the stacked weight's bits, the second weight apart in memory;
         * a tile across the seam (n1 = 100), one at it (n1 = 64), with split-K and plain loads */
        {"linear pair", 1, 136, 328, 1, 5, true, false, false, {}, 100},
        {"linear pair", 37, 200, 264, 1, 3, true, false, true, {}, 64},
        {"linear pair", 130, 200, 72, 1, 2, true, false, false, {}, 136},
        {"linear pair f32 A (plain loads)", 20, 72, 100, 1, 3, true, true, true, {}, 40},
        /* SwiGLU (linear_swiglu): widths ending inside a 32-column group; split-K summed in the
         * GEMM (M = 1) and by the second kernel (M = 37), and none (the tile epilogue through
         * shared memory at 16-, 64- and 128-row tiles) */
        {"swiglu", 1, glu_cols(100), 328, 1, 5, true, false, false, {}, 100, true},
        {"swiglu", 37, glu_cols(64), 264, 1, 3, true, false, false, {}, 64, true},
        {"swiglu", 5, glu_cols(33), 128, 1, 1, true, false, false, {}, 33, true},
        {"swiglu", 20, glu_cols(40), 96, 1, 1, true, false, true, {}, 40, true},
        {"swiglu", 130, glu_cols(72), 200, 1, 1, true, false, false, {}, 72, true},
        {"swiglu f32 A (plain loads)", 20, glu_cols(40), 100, 1, 3, true, true, true, {}, 40, true},
    };
    for (const Case &c : cases) check_case(c);
    /* both places that add the splits, whichever the rule picks for the shape */
    const Case both[] = {
        {"linear", 1, 136, 328, 1, 5, true, false, false, {}},
        {"linear", 37, 136, 328, 1, 7, true, false, false, {}},
        {"head_matmul [K, N]", 3, 72, 96, 3, 2, false, false, false, {}},
        {"swiglu", 3, glu_cols(100), 328, 1, 4, true, false, false, {}, 100, true},
    };
    for (const Case &c : both) {
        check_case(c, SUM_IN_KERNEL);
        check_case(c, SUM_SECOND_KERNEL);
    }
    check_invariance(1);
    check_invariance(4);
    std::printf("%d checks, %d failed\n", checks, fails);
    return fails ? 1 : 0;
}
