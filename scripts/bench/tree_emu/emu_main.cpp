/* emu_main.cpp: see run.sh. Runs the argmax and top-k kernels of cuda/tree.cu (kernels.inc,
 * extracted by run.sh) as kd_cuda_argmax / kd_cuda_topk launch them, under the SIMT emulation
 * of ../ddtree_emu/inc/cuda_internal.cuh, against a plain sort. */
#include "cuda_internal.cuh"
#include "sample_rule.h"
#include "emu_half.h"
#include <numeric>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "helpers.inc"
#include "emu_runtime.h"
static double emu_dyn_buf[8192];   /* 64 KB: topk_kernel's TK_CAND composite keys */
static double *emu_dyn_smem = emu_dyn_buf;
#include "kernels.inc"

static uint64_t rs = 88172645463325252ull;
static double urand() { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (rs >> 11) * 0x1.0p-53; }
static int fails = 0, checks = 0, gathered_rows = 0, radix_rows = 0;

/* rows x V values of a kind, rounded to bf16 when dt is KD_BF16 (f: the values the kernels read) */
struct rows_t { std::vector<float> f; std::vector<bf16> h; int dt; const void *data() const { return dt == KD_BF16 ? (const void *)h.data() : f.data(); } };
static rows_t make_rows(int rows, int V, int kind, int dt) {
    rows_t r{std::vector<float>((size_t)rows * V), {}, dt};
    for (size_t i = 0; i < r.f.size(); i++) {
        double u = urand();
        float v;
        switch (kind) {
        case 0: v = (float)(u * 20 - 10); break;                          /* smooth */
        case 1: v = 1.0f + (float)(u * 1e-3); break;                       /* flat: one top bin, a few sub-bins */
        case 2: v = 1.0f + (float)(u * 0.25); break;                       /* flat: one top bin, many sub-bins */
        case 3: v = (float)(i % 7) * 0.001f; break;                        /* seven values: ties past any slots */
        default: v = (float)(u * 2); if (i % 997 == 3) v = 5 + (float)urand(); break;   /* peaked */
        }
        r.f[i] = v;
    }
    if (dt == KD_BF16) {
        r.h.resize(r.f.size());
        for (size_t i = 0; i < r.f.size(); i++) { r.h[i] = __float2bfloat16(r.f[i]); r.f[i] = __bfloat162float(r.h[i]); }
    }
    return r;
}
static void set(rows_t &r, size_t i, float v) {
    r.f[i] = v;
    if (r.dt == KD_BF16) r.h[i] = __float2bfloat16(v);
}

static bool before(float a, int ia, float b, int ib) {   /* the kernels' order: value desc, lower id, NaN last */
    if (a != a) return b != b && ia < ib;
    if (b != b) return true;
    return a > b || (a == b && ia < ib);
}

/* path: 0 as kd_cuda_topk chooses, 1 the slice pass, 2 the histograms and the gather */
static void test_topk(int rows, int V, int k, int kind, int dt, int path = 0) {
    rows_t x = make_rows(rows, V, kind, dt);
    if (kind == 0) { set(x, 3, NAN); set(x, (size_t)V - 1, -INFINITY); }
    /* as kd_cuda_topk launches them */
    int kp = 1;
    while (kp < k) kp <<= 1;
    const bool by_slices = path == 1 || (path == 0 && topk_by_slices(V, kp));
    const int nslices = (V + TS_SLICE - 1) / TS_SLICE;
    const int cap = by_slices ? topk_slice_cap(V, kp) : kp < TK_CAND ? topk_gather_cap(kp) : kp;
    std::vector<unsigned> bins, bins2, ncand;
    std::vector<unsigned long long> gcand;
    const unsigned *nc = NULL;
    const unsigned long long *gc = NULL;
    if (cap > kp) {
        ncand.assign(rows, 0);
        gcand.assign((size_t)rows * cap, 0x5a5aull);
        if (by_slices) {
            launch(nslices, TS_THREADS, [&] { topk_slice_kernel(x.data(), dt, V, V, k, cap, ncand.data(), gcand.data()); }, rows);
        } else {
            bins.assign((size_t)rows * TK_BINS, 0); bins2.assign((size_t)rows * TK_BINS, 0);
            const int g = (V + TK_SLICE - 1) / TK_SLICE;
            launch(g, 256, [&] { topk_hist_kernel(x.data(), dt, V, V, bins.data()); }, rows);
            launch(g, 256, [&] { topk_hist2_kernel(x.data(), dt, V, V, k, 2 * kp, bins.data(), bins2.data()); }, rows);
            launch(g, 256, [&] { topk_gather_kernel(x.data(), dt, V, V, k, 2 * kp, cap, bins.data(), bins2.data(), ncand.data(), gcand.data()); }, rows);
        }
        nc = ncand.data(); gc = gcand.data();
        for (int r = 0; r < rows; r++) {
            if (ncand[r] > 0 && ncand[r] <= (unsigned)cap) gathered_rows++;
            else radix_rows++;
        }
    }
    std::vector<float> vals((size_t)rows * k);
    std::vector<int32_t> ids((size_t)rows * k, -7);
    launch(rows, ROW_THREADS, [&] { topk_kernel(x.data(), dt, V, V, k, kp, cap, nc, gc, vals.data(), ids.data()); });
    for (int r = 0; r < rows; r++) {
        const float *xr = x.f.data() + (size_t)r * V;
        std::vector<int> o(V);
        std::iota(o.begin(), o.end(), 0);
        std::partial_sort(o.begin(), o.begin() + k, o.end(), [&](int a, int b) { return before(xr[a], a, xr[b], b); });
        checks++;
        for (int i = 0; i < k; i++) {
            const int32_t id = ids[(size_t)r * k + i];
            const float v = vals[(size_t)r * k + i];
            if (id != o[i] || !(v == xr[o[i]] || (v != v && xr[o[i]] != xr[o[i]]))) {
                fails++;
                printf("TOPK MISMATCH rows=%d V=%d k=%d kind=%d dt=%d path=%d row %d entry %d: ref %d (%g), emu %d (%g)\n", rows, V,
                       k, kind, dt, path, r, i, o[i], xr[o[i]], id, v);
                break;
            }
        }
    }
}

static void test_argmax(int rows, int V, int dt) {
    rows_t x = make_rows(rows, V, 0, dt);
    const int far = (int)(V * 0.43), near = (int)(V * 0.06);
    if (rows >= 6) {
        set(x, (size_t)0 * V + far, 50); set(x, (size_t)0 * V + near, 50);   /* a tie in two slices */
        for (int i = 0; i < V; i++) set(x, (size_t)2 * V + i, 1.5f);       /* all equal */
        set(x, (size_t)3 * V + far, INFINITY); set(x, (size_t)3 * V + near, NAN);
        set(x, (size_t)4 * V + far, NAN); set(x, (size_t)4 * V + V - 1, INFINITY);
        for (int i = 0; i < V; i++) set(x, (size_t)5 * V + i, -INFINITY);  /* no finite value: id 0 */
    }
    const int nparts = (V + AM_SLICE - 1) / AM_SLICE;
    std::vector<am_part> part((size_t)rows * nparts);
    std::vector<int32_t> out(rows, -12345);
    launch(nparts, 256, [&] { argmax_part_kernel(x.data(), dt, V, V, part.data()); }, rows);
    launch((rows + 7) / 8, 256, [&] { argmax_merge_kernel(part.data(), nparts, rows, out.data()); });
    for (int r = 0; r < rows; r++) {
        const float *xr = x.f.data() + (size_t)r * V;
        int best = 0, bad = INT_MAX;
        for (int i = 0; i < V; i++) {
            const int32_t c = kd_rule_logit_code(xr[i], i);
            if (c && c < bad) bad = c;
            if (before(xr[i], i, xr[best], best)) best = i;
        }
        const int32_t want = bad != INT_MAX ? -bad : best;
        checks++;
        if (out[r] != want) { fails++; printf("ARGMAX MISMATCH rows=%d V=%d dt=%d row %d: ref %d, emu %d\n", rows, V, dt, r, want, out[r]); }
    }
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    const bool full = argc > 1 && !strcmp(argv[1], "full");
    for (int dt : {(int)KD_F32, (int)KD_BF16})
        for (int V : {33, 8193, 20000}) test_argmax(6, V, dt);
    printf("argmax: %d checks, %d fails\n", checks, fails);
    for (int dt : {(int)KD_F32, (int)KD_BF16})
        for (int kind = 0; kind < 5; kind++)
            for (int k : {1, 8, 64, 256, 1024})
                for (int path : {1, 2}) test_topk(2, 12000, k, kind, dt, path);
    test_topk(3, 40, 32, 0, KD_F32);
    printf("topk V=12000: %d checks, %d fails\n", checks, fails);
    /* rows of several slices, a tail slice of k ids or fewer */
    for (int kind = 0; kind < 5; kind++)
        for (int k : {8, 256}) test_topk(2, 40000, k, kind, KD_F32);
    test_topk(2, TS_SLICE + 100, 256, 0, KD_BF16);
    test_topk(2, TS_SLICE + 100, 256, 1, KD_F32);
    printf("topk V=40000, %d: %d checks, %d fails\n", TS_SLICE + 100, checks, fails);
    printf("top-k rows: %d sorted from their candidates, %d by the radix select\n", gathered_rows, radix_rows);
    if (full) {
        for (int kind : {0, 1, 2, 4}) test_topk(1, 163840, 256, kind, KD_F32);
        test_topk(1, 163840, 16, 2, KD_BF16);
        test_argmax(6, 163840, KD_F32);
        printf("V=163840: %d checks, %d fails\n", checks, fails);
    }
    printf("%s: %d checks, %d fails\n", fails ? "FAILED" : "ok", checks, fails);
    return fails != 0;
}
