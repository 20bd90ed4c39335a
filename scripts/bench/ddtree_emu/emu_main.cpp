/* emu_main.cpp: see run.sh. Runs the kernels of cuda/ddtree.cu (kernels.inc, extracted by run.sh)
 * under the SIMT emulation of inc/cuda_internal.cuh and compares them with the host code. */
#include "cuda_internal.cuh"
#include "emu_half.h"
#include "sample_rule.h"
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <cstring>
extern "C" {
#include "tree.h"
#include "sample.h"
kd_status kd_cpu_tree_walk(kd_backend *be, const kd_dtree *t, int n, int sampled);
}
#include "helpers.inc"
#include "emu_runtime.h"
static double emu_dyn_buf[240000 / 8];
static double *emu_dyn_smem = emu_dyn_buf;
#include "kernels.inc"

static uint64_t rs = 88172645463325252ull;
static double urand() { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (rs >> 11) * 0x1.0p-53; }

static int fails = 0, checks = 0, bin_rows = 0;

/* spec/helpers/lcg.lua, step for step in doubles (Lua's numbers), so that kind 5 below builds
 * spec/gpu_round_spec.lua's "smooth" lists value for value */
struct lua_lcg {
    double x;
    double operator()() {
        const double p = x * 1103515245.0;
        x = fmod(p + 12345.0, 2147483648.0);
        return x / 2147483648.0;
    }
};

static void test_sample(int V, int kind, const kd_sampler &sp, int rows) {
    std::vector<float> x((size_t)rows * V);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < V; i++) {
            float v;
            switch (kind) {
            case 0: v = (float)(urand() * 8 - 4); break;                     /* smooth */
            case 1: v = (float)floor(urand() * 5) * 0.5f; break;              /* ties */
            case 2: v = urand() < 0.3 ? -INFINITY : (float)(urand() * 3); break;
            case 3: v = 0.0f; break;                                          /* all equal */
            case 5: {   /* wide: near the mass's cut-offs (x/T - m/T at -44, at min-p 0.05's log), past
                           them, and magnitudes past smp_mass's float test (|x| / T >= 2^40) */
                const double u = urand(), T = sp.temperature;
                v = u < 0.25 ? (float)(10 - T * (44 + (urand() - 0.5) * 0.01))
                  : u < 0.5 ? (float)(10 - T * (2.9957 + (urand() - 0.5) * 0.01))
                  : u < 0.75 ? (float)(10 - T * urand() * 1000)
                  : u < 0.97 ? (float)(urand() * 10)
                  : (float)(-urand() * 1e30);
                if (i == 3) v = 10.0f;
                if (r == 1 && i == 5) v = 1e20f;   /* row 1's max: its other logits far below, with |m| / T past 2^40 */
                break;
            }
            default: v = (float)(urand() * 2); if (i % 1000 == 7) v = 12 + (float)urand(); break;   /* peaked */
            }
            x[(size_t)r * V + i] = v;
        }
    if (kind == 2 && rows > 1) { x[V + 5] = NAN; }
    std::vector<int32_t> pos(rows), out(rows, -7), code(rows, -7);
    for (int r = 0; r < rows; r++) pos[r] = (int32_t)(urand() * 100000);
    /* as kd_cuda_sample_rows launches them */
    const bool cut = (sp.top_k > 0 && sp.top_k < V) || (sp.top_p > 0.0f && sp.top_p < 1.0f);
    const int S = (V + SMP_SLICE - 1) / SMP_SLICE;
    const uint64_t qmin = kd_rule_min_p_floor(sp.min_p);
    std::vector<smp_max_part> pm((size_t)rows * S);
    std::vector<kd_u128> pw((size_t)rows * S, kd_u128{0xdead, 0xdead});   /* rows left out keep this */
    std::vector<unsigned int> gcnt((size_t)rows * SMP_BINS, 0);
    std::vector<unsigned long long> glo((size_t)rows * SMP_BINS, 0), ghi((size_t)rows * SMP_BINS, 0);
    const double T = (double)sp.temperature;
    std::vector<smp_cut> cuts(rows, smp_cut{0, 0, 7});
    std::vector<smp_plan> plans(rows);
    std::vector<unsigned long long> cand((size_t)rows * SMP_CAP, 0xdeadull);
    const smp_cut *cp = cut ? cuts.data() : NULL;
    launch(S, SMP_THREADS, [&] { smp_max_kernel(x.data(), V, V, pm.data()); }, rows);
    if (cut) {
        const bool bin_mass = smp_bin_mass(sp.top_k > 0 && sp.top_k < V, sp.top_p > 0.0f && sp.top_p < 1.0f, sp.top_k);
        launch(S, SMP_THREADS, [&] { smp_bins_kernel(x.data(), V, V, T, qmin, bin_mass, pm.data(), gcnt.data(), glo.data(), ghi.data()); }, rows);
        /* the bins against a host count of the same binner and masses (rows with a finite max and no
         * NaN / +inf: the others the kernel leaves out); the plan falls back to the radix select
         * when they are wrong, so the draws alone would not show it */
        for (int r = 0; r < rows; r++) {
            const float *xr = x.data() + (size_t)r * V;
            float m = -INFINITY;
            bool bad = false;
            for (int i = 0; i < V; i++) { bad |= kd_rule_logit_code(xr[i], i) != 0; if (xr[i] > m) m = xr[i]; }
            if (bad || m == -INFINITY) continue;
            const smp_mass mass(m, T, qmin);
            const smp_binner bin_of(m, T);
            std::vector<unsigned> cnt(SMP_BINS, 0);
            std::vector<unsigned __int128> ms(SMP_BINS, 0);
            for (int i = 0; i < V; i++) {
                const int b = bin_of(xr[i]);
                if (b == SMP_BINS - 1) continue;
                cnt[b]++;
                if (bin_mass) ms[b] += mass(xr[i]);
            }
            bin_rows++;
            for (int b = 0; b < SMP_BINS; b++) {
                const size_t o = (size_t)r * SMP_BINS + b;
                if (gcnt[o] != cnt[b] || ((unsigned __int128)ghi[o] << 32) + glo[o] != ms[b]) {
                    fails++;
                    printf("BINS MISMATCH V=%d kind=%d T=%g k=%d p=%g row %d bin %d: count %u / %u\n", V, kind,
                           sp.temperature, sp.top_k, sp.top_p, r, b, cnt[b], gcnt[o]);
                    break;
                }
            }
        }
        launch(rows, SMP_THREADS, [&] {
            smp_plan_kernel(V, T, sp.top_k, sp.top_p, qmin, pm.data(), S, gcnt.data(), glo.data(), ghi.data(), plans.data());
        });
        launch(S, SMP_THREADS, [&] { smp_gather_kernel(x.data(), V, V, T, qmin, plans.data(), cand.data(), pw.data()); }, rows);
        launch(rows, SMP_THREADS, [&] {
            sample_cut_kernel(x.data(), V, V, T, sp.top_k, sp.top_p, qmin, sp.seed, pm.data(), S, plans.data(),
                              cand.data(), pw.data(), pos.data(), 0, cuts.data(), out.data(), code.data());
        });
    }
    launch(S, SMP_THREADS, [&] {
        if (cut || qmin) smp_mass_kernel<true>(x.data(), V, V, T, qmin, pm.data(), cp, pw.data());
        else smp_mass_kernel<false>(x.data(), V, V, T, qmin, pm.data(), cp, pw.data());
    }, rows);
    launch(rows, SMP_THREADS, [&] {
        smp_draw_kernel(x.data(), V, V, T, qmin, sp.seed, pm.data(), cp, pw.data(), S, pos.data(), 0, out.data(),
                        code.data());
    });
    std::vector<uint64_t> q(V);
    std::vector<int32_t> a(V);
    for (int r = 0; r < rows; r++) {
        int32_t tok = -1;
        int32_t c = kd_sample_row_code(x.data() + (size_t)r * V, V, &sp, pos[r], q.data(), a.data(), &tok);
        checks++;
        if (c != code[r] || (c == 0 && tok != out[r])) {
            fails++;
            printf("MISMATCH V=%d kind=%d T=%g k=%d p=%g min_p=%g row %d: host (%d, code %d) emu (%d, code %d)\n", V,
                   kind, sp.temperature, sp.top_k, sp.top_p, sp.min_p, r, tok, c, out[r], code[r]);
        }
    }
}

static int parallel_builds = 0;

/* kind: 0 log-probs spread over (-10, 0]; 1 ties (multiples of -0.5); 2 logits (the lists are
 * log_softmax's, as a draft's); 3 spread, but a tenth of the values near -1e-13 (sums that
 * round: the parallel path gives way); 4 spread, with positive values below depth 1 (children
 * above their parent: the parallel path gives way); 5 spec/gpu_round_spec.lua's "smooth" lists of
 * the seed given (spread over (-12, 0], three peaked values a row: at V = 163840 each depth's top
 * 256 lie within 0.02, a crowded tree); 6 and 7 logits uniform in [0, 16), 7 with 8 ids a row at
 * 30, 28, .., 16 (cuda_ops_bench --round's flat and peaked draft lists). want_parallel: the
 * launch with the parallel path on must take it (as gpu_round_spec asks of CUDA). */
static void test_tree(int L, int V, int B, int kind, bool want_parallel = false, int seed = 0) {
    int K = B < V ? B : V;
    std::vector<float> lp((size_t)L * V);
    if (kind == 5) {   /* spec/gpu_round_spec.lua's scores(L, V, seed, "smooth") */
        lua_lcg r{(double)(seed % 2147483648)};
        for (size_t i = 0; i < lp.size(); i++) {
            const double u = r();
            lp[i] = (float)(-u * 12 - (r() < 0.01 ? 3 : 0));
        }
        for (int d = 0; d < L; d++)
            for (int k = 0; k < 3; k++) lp[(size_t)d * V + (size_t)floor(r() * V)] = (float)(-0.1 - k * 0.3);
    } else {
        for (size_t i = 0; i < lp.size(); i++) {
            float v;
            switch (kind) {
            case 1: v = -(float)floor(urand() * 4) * 0.5f; break;
            case 2: v = (float)(urand() * urand() * 16); break;
            case 3: v = urand() < 0.1 ? -(float)(urand() * 1e-13) : -(float)(urand() * 10); break;
            case 4: v = i >= (size_t)V && urand() < 0.05 ? (float)urand() : -(float)(urand() * 10); break;
            case 6: case 7: v = (float)(urand() * 16); break;
            default: v = -(float)(urand() * 10); break;
            }
            lp[i] = v;
        }
    }
    if (kind == 7)
        for (int d = 0; d < L; d++)
            for (int k = 0; k < 8; k++) lp[(size_t)d * V + (size_t)(urand() * V)] = 30.0f - 2 * k;
    std::vector<float> vals((size_t)L * K);
    std::vector<int32_t> ids((size_t)L * K);
    if (kd_tree_topk_rows(lp.data(), L, V, K, kind != 2 && kind < 6, vals.data(), ids.data()) != KD_OK) { printf("topk failed\n"); fails++; return; }
    /* host */
    std::vector<int32_t> tok(B + 1), par(B + 1), dep(B + 1), rk(B + 1);
    std::vector<double> sc(B + 1);
    int n = 0;
    kd_tree_select_host(vals.data(), ids.data(), L, K, B, tok.data(), par.data(), dep.data(), rk.data(), sc.data(), &n);
    par[0] = -1; dep[0] = 0;
    int words = (n + 1 + 63) / 64;
    std::vector<uint64_t> vis((size_t)(n + 1) * words);
    kd_tree_mask(par.data(), n, vis.data());
    /* emu: as kd_cuda_tree_select launches it (the parallel path's cap), and with the path off */
    kd_dtree d;
    size_t bytes = kd_dtree_layout(&d, NULL, B, L * K);
    std::vector<char> buf(bytes);
    kd_dtree_layout(&d, buf.data(), B, L * K);
    memcpy(d.vals, vals.data(), vals.size() * 4);
    memcpy(d.ids, ids.data(), ids.size() * 4);
    const int cap = sel_cap(L, K, B, true, sizeof emu_dyn_buf);   /* as kd_cuda_tree_select, in the emulated smem */
    for (int run = 0; run < 3; run++) {   /* lists in global memory; staged; staged with the parallel path */
        const bool staged = run > 0;
        const int run_cap = run == 2 ? cap : 0;
        if (run == 2 && !cap) continue;
        memset(d.vis, 0xff, vis.size() * 8);
        for (int i = 0; i <= B; i++) d.token[i] = d.parent[i] = d.depth[i] = -7;
        launch(1, SEL_THREADS, [&] { tree_select_kernel(d, L, K, B, staged, run_cap); });
        checks++;
        bool ok = d.status[2] == n && d.status[0] == 0 && (run_cap || d.status[3] == 0) &&
                  !(run == 2 && want_parallel && d.status[3] != 1);
        for (int i = 1; ok && i <= n; i++) ok = d.token[i] == tok[i] && d.parent[i] == par[i] && d.depth[i] == dep[i];
        ok = ok && d.parent[0] == -1 && d.depth[0] == 0;
        for (size_t i = 0; ok && i < vis.size(); i++) ok = d.vis[i] == vis[i];
        parallel_builds += d.status[3] == 1;
        if (!ok) {
            fails++;
            printf("TREE MISMATCH L=%d V=%d B=%d kind=%d staged=%d cap=%d parallel=%d (n host %d emu %d)\n", L, V, B,
                   kind, staged, run_cap, d.status[3], n, d.status[2]);
            for (int i = 1; i <= n; i++)
                if (d.token[i] != tok[i] || d.parent[i] != par[i] || d.depth[i] != dep[i]) {
                    printf("  node %d: host tok %d par %d dep %d rank %d score %.17g | emu tok %d par %d dep %d\n", i, tok[i], par[i], dep[i], rk[i], sc[i], d.token[i], d.parent[i], d.depth[i]);
                    if (i > 3) break;
                }
            return;
        }
    }
    /* walk: random targets */
    for (int rep = 0; rep < 3; rep++) {
        for (int i = 0; i <= n; i++) {
            int32_t t = (int32_t)(urand() * V);
            for (int j = i + 1; j <= n; j++) if (par[j] == i && urand() < 0.5) { t = d.token[j]; break; }
            d.target[i] = t;
            d.row_status[i] = urand() < 0.03 ? 5 : 0;
        }
        int sampled = rep & 1;
        d.token[0] = 42;
        for (int i = 0; i <= n; i++) d.pos[i] = 10 + d.depth[i];
        launch(1, WALK_THREADS, [&] { tree_walk_kernel(d, n, sampled); });
        std::vector<int32_t> emu(d.result, d.result + KD_DTREE_HDR + 2 * (B + 1));
        kd_cpu_tree_walk(NULL, &d, n, sampled);
        checks++;
        int tau = d.result[KD_DTREE_R_TAU];
        bool same = memcmp(emu.data(), d.result, KD_DTREE_HDR * 4) == 0;
        for (int i = 0; same && i < tau; i++) same = emu[KD_DTREE_HDR + i] == d.result[KD_DTREE_HDR + i] &&
                                                     emu[KD_DTREE_HDR + B + 1 + i] == d.result[KD_DTREE_HDR + B + 1 + i];
        if (!same) { fails++; printf("WALK MISMATCH L=%d V=%d B=%d tau %d/%d\n", L, V, B, tau, emu[KD_DTREE_R_TAU]); }
    }
}

/* default: trees, walks and a quick sampling matrix (minutes); "slices": rows of 8193 and 20000
 * ids (2-3 slices of the max, mass and bins passes), without a cut, with min-p, top-k + top-p
 * (counts by bin), top-p alone and a large top-k + top-p (masses by bin); "full": every setting at
 * V = 10, 333, 1000 and 45 settings at V = 163840 (~20 minutes on 2 cores); "samples": the
 * quick sampling matrix alone; "trees": the trees and walks alone; "crowded": rows of V = 12000
 * whose bins below the max hold more than 2048 ids (ties, all equal: the radix path) or fewer
 * (smooth, peaked: the bins' path), 12 draws */
int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    const char *mode = argc > 1 ? argv[1] : "";
    const bool full = !strcmp(mode, "full"), crowded = !strcmp(mode, "crowded"), slices = !strcmp(mode, "slices");
    if (slices)   /* rows of several 8192-id slices: the multi-block max and mass passes, and a draw in one slice */
        for (int V : {8193, 20000})
            for (int kind = 0; kind < 6; kind++)
                for (kd_sampler sp : {kd_sampler{1.0f, 0, 0.0f, 21, 0.0f}, kd_sampler{0.7f, 0, 0.0f, 22, 0.05f},
                                      kd_sampler{1.0f, 40, 0.9f, 23, 0.0f}, kd_sampler{1.0f, 0, 0.9f, 24, 0.0f},
                                      kd_sampler{0.8f, 4096, 0.95f, 25, 0.0f}})
                    test_sample(V, kind, sp, 2);
    const bool trees = !strcmp(mode, "") || full || !strcmp(mode, "trees");
    const bool samples = !strcmp(mode, "") || full || !strcmp(mode, "samples");
    if (crowded)
        for (int kind : {0, 1, 3, 4})
            for (kd_sampler sp : {kd_sampler{1.0f, 40, 0.95f, 11, 0.05f}, kd_sampler{0.6f, 4096, 0.5f, 12, 0.0f},
                                  kd_sampler{1.0f, 0, 0.9f, 13, 0.0f}})
                test_sample(12000, kind, sp, 1);
    if (trees) {
        for (int L : {1, 3, 7, 15})
            for (int B : {1, 8, 64, 256, 512})
                for (int kind : {0, 1, 2}) test_tree(L, L == 15 ? 37 : 200, B, kind);
        for (int kind : {2, 3, 4}) test_tree(7, 1000, 256, kind);
        test_tree(7, 163840, 256, 5, true, 7);   /* gpu_round_spec's K2.6-shape tree, which CUDA must select in parallel */
        for (int B : {16, 64, 256})
            for (int kind : {6, 7}) test_tree(7, 163840, B, kind, true);
        test_tree(2, 3, 64, 0);
        test_tree(4, 16, 512, 1);
        printf("trees built by the parallel path: %d\n", parallel_builds);
    }
    printf("trees and walks: %d checks, %d fails\n", checks, fails);
    std::vector<float> temps = full ? std::vector<float>{1.0f, 0.6f, 2.5f, 1e-3f, 40.0f} : std::vector<float>{1.0f, 0.6f};
    for (int V : {10, 333, 1000}) {
        if (!samples || (!full && V == 1000)) continue;   /* quick: V = 10 (one tile, V < 32) and 333 */
        for (int kind = 0; kind < 6; kind++)
            for (float T : temps) {
                std::vector<int> ks = full ? std::vector<int>{0, 1, 5, 50, V - 1} : std::vector<int>{0, 5, V - 1};
                std::vector<float> ps = full ? std::vector<float>{0.0f, 0.3f, 0.9f, 0.999f} : std::vector<float>{0.0f, 0.9f};
                for (int k : ks)
                    for (float p : ps)
                        for (float mp : {0.0f, 0.05f, 0.6f}) {
                            kd_sampler sp = {T, k, p, (uint64_t)(urand() * 1e12), mp};
                            test_sample(V, kind, sp, 2);
                        }
            }
        printf("samples V=%d: %d checks, %d fails\n", V, checks, fails);
    }
    if (full) {
        for (int kind = 0; kind < 5; kind++)
            for (int k : {0, 40, 4096})
                for (float p : {0.0f, 0.5f, 0.95f}) {
                    kd_sampler sp = {1.0f, k, p, (uint64_t)(urand() * 1e12), k == 40 ? 0.05f : 0.0f};
                    test_sample(163840, kind, sp, 1);
                }
        printf("samples V=163840: %d checks, %d fails\n", checks, fails);
    }
    printf("bins checked against the host: %d rows\n", bin_rows);
    printf("%s: %d checks, %d fails\n", fails ? "FAILED" : "ok", checks, fails);
    return fails != 0;
}
