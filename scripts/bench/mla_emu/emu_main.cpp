/* emu_main.cpp: runs cuda/mla_tc.cuh's tensor-core attention kernels on the CPU under the SIMT
 * emulation (inc/mla_mma.cuh + ../ddtree_emu/inc/cuda_internal.cuh) and checks
 *  - every output against a float64 reference attention over the same bf16 inputs
 *    (error = max |emu - ref| / max |ref|; P is rounded to bf16 as on the GPU);
 *  - the batch-invariance logic: a tree node's output bit-identical to decoding it alone and
 *    to the last row of a causal prefill, and attention_at (device past, larger bound) equal
 *    to attention, and several query batches (t0 > 0) equal to one.
 * The launch below takes its block shape, kernel and shared chunks from mla_tc.cuh's launch
 * plan, as attention_tc() in cuda/mla.cu does, and mirrors its grids, visible lists and partial
 * slots. Usage: run.sh (builds and runs this). */
#include "mla_mma.cuh"
#include <functional>
#include <vector>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "emu_fibers.h"

#define KD_MLA_EMU 1
#include "../../../cuda/mla_tc.cuh"

using namespace mla;

static int last_rg, last_kw, last_vs, last_tail_rg;   /* the kernel shape run_tc picked last (and its tail launch's rows) */
static uint64_t rs = 88172645463325252ull;
static double urand() { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (rs >> 11) * 0x1.0p-53; }
static uint16_t rbf() { return f2bf((float)((urand() * 2 - 1) * 1.7)); }

struct Att {
    int T, S, past, Hq, Hkv, hd, dv;
    bool causal; int window; float scale;
    const uint64_t *vis;          /* T x ceil(T/64) words or NULL */
    int bound;                    /* > 0: attention_at with k/v rows = bound, past on the "device" */
    int tbatch;                   /* 0: all T at once */
    int rg = 0;                   /* row groups per block: 1 or 4; 0: attention_tc's rule (on sms SMs) */
    int vs = 0;                   /* value split (KDTREE_MLA_TC_VSPLIT): 0: the rule, -1: off, 1|2|4: forced */
    int sms = 132;                /* the SM count the rule sees (few: 64-row shared blocks at small sizes) */
};

/* q [T][Hq*hd], k [S][Hkv*hd], v [S][Hkv*dv] (v == k: value = first dv cols of k, ld = k's) */
static std::vector<float> run_tc(const Att &c, const uint16_t *q, const uint16_t *k, long long ldk, const uint16_t *v,
                                 long long ldv, bool force_plain) {
    const int T = c.T, G = c.Hq / c.Hkv;
    const int S = c.bound > 0 ? c.bound : c.S;
    TcArgs a;
    std::memset(&a, 0, sizeof a);
    a.q = q; a.ldq = (long long)c.Hq * c.hd;
    a.k = k; a.ldk = ldk; a.kstride = (int)(ldk / c.Hkv);
    a.v = v; a.ldv = ldv; a.vstride = v == k ? a.kstride : (int)(ldv / c.Hkv);
    a.T = T; a.S = S; a.past = c.bound > 0 ? 0 : c.past; a.Hq = c.Hq; a.G = G; a.hd = c.hd; a.dv = c.dv;
    a.HDP = (c.hd + 63) / 64 * 64;
    a.causal = c.causal; a.window = c.window; a.scale2 = c.scale * 1.4426950408889634f;
    int dpast = c.past;
    a.d_past = c.bound > 0 ? &dpast : nullptr;
    a.nc_max = (S + TC_CHUNK - 1) / TC_CHUNK;
    bool async = !force_plain && c.hd % 8 == 0 && c.dv % 8 == 0 && a.kstride % 8 == 0 && a.vstride % 8 == 0;
    const int DVP = tc_dv_padded(c.dv);
    /* attention_tc's shape rule on c.sms SMs, this emulator's shared memory as the limit */
    const long long ncq = tc_max_chunks(S, a.past, T, c.causal, c.vis != nullptr, c.bound > 0);
    const int vs_mode = c.vs < 0 ? 0 : c.vs == 0 ? 8 : c.vs;
    const bool wide_fits = tc_wide_offsets_fit(S, ldk, ldv);
    const TcShape sh = tc_shape(ncq, T, G, c.Hkv, DVP, a.HDP, async, wide_fits, c.sms, sizeof emu_smem_buf, c.rg, vs_mode);
    const TcShape sh_tail = c.vis ? tc_tail_shape(sh, tc_tail_chunks(T), T, G, c.Hkv, DVP, a.HDP, async, wide_fits, c.sms,
                                                  sizeof emu_smem_buf, c.rg, vs_mode)
                                  : sh;
    last_rg = sh.rg; last_kw = sh.kw; last_vs = sh.vs; last_tail_rg = sh_tail.rg;
    const int nth = tc_threads(sh);
    a.qvec = c.hd % 8 == 0;
    std::vector<int32_t> list, cnt;
    if (c.vis) {
        int words = (T + 63) / 64;
        list.assign((size_t)T * T, 0);
        cnt.assign(T, 0);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < T; j++)
                if ((c.vis[(size_t)t * words + j / 64] >> (j % 64)) & 1) list[(size_t)t * T + cnt[t]++] = j;
        a.vis_list = list.data();
        a.vis_cnt = cnt.data();
    }
    int tbatch = c.tbatch > 0 ? c.tbatch : T;
    std::vector<float> pm((size_t)tbatch * c.Hq * a.nc_max, NAN), pl(pm.size(), NAN), po(pm.size() * c.dv, NAN);
    const bool split = tc_split(sh), split_tail = tc_split(sh_tail);
    /* NaN: a score read before it is written shows */
    std::vector<float> ps(split || split_tail ? pm.size() * TC_CHUNK : 0, NAN);
    a.pm = pm.data(); a.pl = pl.data(); a.po = po.data(); a.ps = ps.empty() ? nullptr : ps.data();
    std::vector<float> out((size_t)T * c.Hq * c.dv, NAN);
    const TcKernel fn = tc_kernel(DVP, async, sh), fn_tail = tc_kernel(DVP, async, sh_tail);
    /* a forced row-group count must be the one that ran (tc_shape takes 1 where 4 does not fit):
     * the checks name the mode they test */
    if (c.rg && sh.rg != c.rg) { printf("shape: %d row groups forced, %d taken\n", c.rg, sh.rg); exit(2); }
    for (int t0 = 0; t0 < T; t0 += tbatch) {
        int tb = std::min(tbatch, T - t0);
        a.t0 = t0; a.tb = tb;
        const int nsh = tc_shared_chunks(S, a.past, t0, tb, c.causal, c.vis != nullptr, c.bound > 0);
        if (nsh > 0) {
            a.tail = 0;
            a.rows_fastest = tc_rows_fastest(sh);
            TcArgs aa = a;
            const int rbs = tc_row_blocks((long long)tb * G, sh);
            if (split) launch(nsh * TS_KB, rbs, c.Hkv, TS_NTH, [&] { tc_scores_kernel(aa); });
            launch(a.rows_fastest ? rbs : nsh, a.rows_fastest ? nsh : rbs, c.Hkv * sh.vs, nth, [&] { fn(aa); });
        }
        if (c.vis) {
            a.tail = 1;
            a.rows_fastest = false;
            a.rb_per_q = tc_row_blocks(G, sh_tail);
            TcArgs aa = a;
            const int ncx = tc_tail_chunks(T);
            if (split_tail) launch(ncx * TS_KB, tb * a.rb_per_q, c.Hkv, TS_NTH, [&] { tc_scores_kernel(aa); });
            launch(ncx, tb * a.rb_per_q, c.Hkv * sh_tail.vs, tc_threads(sh_tail), [&] { fn_tail(aa); });
        }
        TcArgs aa = a;
        launch(c.Hq, tb, 1, 32, [&] {
            /* the merge kernel with blockIdx.x = head, .y = query (32 threads) */
            tc_merge_kernel(aa, out.data(), KD_F32, (long long)c.Hq * c.dv);
        });
    }
    return out;
}

/* float64 reference over the same bf16 values */
static std::vector<double> reference(const Att &c, const uint16_t *q, const uint16_t *k, long long ldk,
                                     const uint16_t *v, long long ldv) {
    const int T = c.T, G = c.Hq / c.Hkv, words = (T + 63) / 64;
    int kstride = (int)(ldk / c.Hkv), vstride = v == k ? kstride : (int)(ldv / c.Hkv);
    std::vector<double> out((size_t)T * c.Hq * c.dv, 0.0);
    for (int t = 0; t < T; t++) {
        std::vector<int> rows;
        for (int r = 0; r < c.past; r++) rows.push_back(r);
        for (int j = 0; j < T; j++) {
            bool vis = c.vis ? ((c.vis[(size_t)t * words + j / 64] >> (j % 64)) & 1) : (!c.causal || j <= t);
            if (vis) rows.push_back(c.past + j);
        }
        for (int h = 0; h < c.Hq; h++) {
            int g = h / G;
            std::vector<double> s(rows.size());
            double m = -INFINITY;
            for (size_t i = 0; i < rows.size(); i++) {
                double d = 0;
                for (int x = 0; x < c.hd; x++)
                    d += (double)bf2f(q[(size_t)t * c.Hq * c.hd + (size_t)h * c.hd + x]) *
                         (double)bf2f(k[(size_t)rows[i] * ldk + (size_t)g * kstride + x]);
                s[i] = d * c.scale;
                if (c.window > 0 && (c.past + t) - rows[i] >= c.window) s[i] = -INFINITY;
                m = std::max(m, s[i]);
            }
            double l = 0;
            for (auto &x : s) { x = x == -INFINITY ? 0 : std::exp(x - m); l += x; }
            for (int d = 0; d < c.dv; d++) {
                double o = 0;
                for (size_t i = 0; i < rows.size(); i++) o += s[i] * bf2f(v[(size_t)rows[i] * ldv + (size_t)g * vstride + d]);
                out[((size_t)t * c.Hq + h) * c.dv + d] = l > 0 ? o / l : 0;
            }
        }
    }
    return out;
}

static int fails = 0, checks = 0;
static void check_close(const char *name, const std::vector<float> &o, const std::vector<double> &r, double tol) {
    double md = 0, mr = 0;
    bool nan = false;
    for (size_t i = 0; i < o.size(); i++) {
        if (!std::isfinite(o[i])) nan = true;
        md = std::max(md, std::fabs(o[i] - r[i]));
        mr = std::max(mr, std::fabs(r[i]));
    }
    double err = md / (mr > 0 ? mr : 1);
    checks++;
    bool ok = !nan && err <= tol;
    if (!ok) fails++;
    printf("%-4s %-62s err %.2e (tol %.0e)%s\n", ok ? "ok" : "FAIL", name, err, tol, nan ? " NaN" : "");
    fflush(stdout);
}
static void check_same(const char *name, const float *a, const float *b, size_t n) {
    checks++;
    size_t at = n;
    for (size_t i = 0; i < n && at == n; i++)
        if (std::memcmp(&a[i], &b[i], 4)) at = i;
    if (at != n) { fails++; printf("FAIL %-62s differs at %zu (%.9g vs %.9g)\n", name, at, a[at], b[at]); }
    else printf("ok   %-62s bit-identical (%zu values)\n", name, n);
    fflush(stdout);
}

static std::vector<uint16_t> rand_bf(size_t n) {
    std::vector<uint16_t> x(n);
    for (auto &e : x) e = rbf();
    return x;
}

/* visibility bits of a tree (parents[i] < i, -1 = root) */
static std::vector<uint64_t> tree_vis(const std::vector<int> &par, std::vector<std::vector<int>> &paths) {
    int n = (int)par.size(), words = (n + 63) / 64;
    std::vector<uint64_t> vis((size_t)n * words, 0);
    paths.assign(n, {});
    for (int i = 0; i < n; i++) {
        if (par[i] >= 0) paths[i] = paths[par[i]];
        paths[i].push_back(i);
        for (int j : paths[i]) vis[(size_t)i * words + j / 64] |= 1ull << (j % 64);
    }
    return vis;
}

static void accuracy(const char *name, Att c, bool vfromk, bool plain = false) {
    int S = c.bound > 0 ? c.bound : c.S;
    long long ldk = (long long)c.Hkv * c.hd, ldv = vfromk ? ldk : (long long)c.Hkv * c.dv;
    auto q = rand_bf((size_t)c.T * c.Hq * c.hd);
    auto k = rand_bf((size_t)S * ldk);
    auto v = vfromk ? std::vector<uint16_t>() : rand_bf((size_t)S * ldv);
    const uint16_t *vp = vfromk ? k.data() : v.data();
    auto o = run_tc(c, q.data(), k.data(), ldk, vp, ldv, plain);
    auto r = reference(c, q.data(), k.data(), ldk, vp, ldv);
    check_close(name, o, r, 5e-3);
}

/* tree node == decoded alone == last row of a causal prefill; attention_at == attention;
 * batches of queries == one batch */
/* kernel shapes {row groups, value split, SMs the rule sees}: 16-row 2-warp blocks (the split
 * off), 64-row blocks unsplit, in 2 value slices and in the rule's (4 at MLA dims), 16-row 8-warp
 * blocks with 1, 2, 4 value slices (capped at DVP / 128: the tiny dims fall back to the 2-warp
 * kernel, so those checks compare it with itself), and the rule on 8 SMs (64-row blocks in the
 * shared launch, 16-row ones in the tail where G <= 32) */
static const int modes[][3] = {{1, -1, 132}, {4, -1, 132}, {4, 2, 132}, {4, 0, 132},
                               {1, 1, 132}, {1, 2, 132}, {1, 4, 132}, {0, 0, 8}};

static void invariance(const char *name, int H, int hd, int dv, int P, const std::vector<int> &par, bool full) {
    std::vector<std::vector<int>> paths;
    auto vis = tree_vis(par, paths);
    int n = (int)par.size();
    long long ld = hd;
    auto past = rand_bf((size_t)P * hd), nodes = rand_bf((size_t)n * hd), q = rand_bf((size_t)n * H * hd);
    std::vector<uint16_t> kv(past);
    kv.insert(kv.end(), nodes.begin(), nodes.end());
    Att tc{n, P + n, P, H, 1, hd, dv, false, 0, 0.1447f, vis.data(), 0, 0};
    auto tree = run_tc(tc, q.data(), kv.data(), ld, kv.data(), ld, false);
    char nm[200];
    snprintf(nm, sizeof nm, "%s: tree (%d nodes after %d) vs float64", name, n, P);
    check_close(nm, tree, reference(tc, q.data(), kv.data(), ld, kv.data(), ld), 5e-3);
    {   /* attention_at: past on the device, k/v rows = a larger bound (rows past it hold garbage) */
        std::vector<uint16_t> big(kv);
        for (int i = 0; i < 700 * hd; i++) big.push_back(0x7fc0);   /* NaN rows beyond len + T: never read */
        Att at = tc;
        at.bound = P + n + 700;
        auto o = run_tc(at, q.data(), big.data(), ld, big.data(), ld, false);
        snprintf(nm, sizeof nm, "%s: tree via attention_at (bound +700 NaN rows) == attention", name);
        check_same(nm, o.data(), tree.data(), o.size());
        Att tb = tc;
        tb.tbatch = 3;
        o = run_tc(tb, q.data(), kv.data(), ld, kv.data(), ld, false);
        snprintf(nm, sizeof nm, "%s: tree in batches of 3 queries == one batch", name);
        check_same(nm, o.data(), tree.data(), o.size());
        for (const auto &md : modes) {
            Att tr = tc;
            tr.rg = md[0];
            tr.vs = md[1];
            tr.sms = md[2];
            o = run_tc(tr, q.data(), kv.data(), ld, kv.data(), ld, false);
            snprintf(nm, sizeof nm, "%s: tree, %d row groups, %d warps/group, %d value slices, tail %d row groups (%d SMs) == default",
                     name, last_rg, last_kw, last_vs, last_tail_rg, md[2]);
            check_same(nm, o.data(), tree.data(), o.size());
        }
    }
    for (int i = 0; i < n; i++) {
        if (!full && i != n - 1 && i != 3) continue;
        const auto &path = paths[i];
        int d = (int)path.size(), S2 = P + d;
        std::vector<uint16_t> kv2(past);
        for (int j : path) kv2.insert(kv2.end(), nodes.begin() + (size_t)j * hd, nodes.begin() + (size_t)(j + 1) * hd);
        Att al{1, S2, S2 - 1, H, 1, hd, dv, true, 0, 0.1447f, nullptr, 0, 0};
        for (const auto &md : modes) {
            al.rg = md[0];
            al.vs = md[1];
            al.sms = md[2];
            auto alone = run_tc(al, q.data() + (size_t)i * H * hd, kv2.data(), ld, kv2.data(), ld, false);
            snprintf(nm, sizeof nm, "%s: node %d alone (T=1; %d rg, %d warps, %d slices) == tree node", name, i, last_rg,
                     last_kw, last_vs);
            check_same(nm, alone.data(), tree.data() + (size_t)i * H * dv, (size_t)H * dv);
        }
        auto qp = rand_bf((size_t)d * H * hd);
        std::memcpy(qp.data() + (size_t)(d - 1) * H * hd, q.data() + (size_t)i * H * hd, (size_t)H * hd * 2);
        Att pf{d, S2, P, H, 1, hd, dv, true, 0, 0.1447f, nullptr, 0, 0};
        auto pre = run_tc(pf, qp.data(), kv2.data(), ld, kv2.data(), ld, false);
        snprintf(nm, sizeof nm, "%s: node %d as prefill row %d == tree node", name, i, d - 1);
        check_same(nm, pre.data() + (size_t)(d - 1) * H * dv, tree.data() + (size_t)i * H * dv, (size_t)H * dv);
        Att pa = pf;
        pa.bound = S2 + 40;
        std::vector<uint16_t> kv3(kv2);
        kv3.resize((size_t)(S2 + 40) * hd, 0x7fc0);
        auto pre_at = run_tc(pa, qp.data(), kv3.data(), ld, kv3.data(), ld, false);
        snprintf(nm, sizeof nm, "%s: node %d prefill via attention_at == prefill", name, i);
        check_same(nm, pre_at.data(), pre.data(), pre.size());
        if (full || i == n - 1) {   /* the prefill and its attention_at in the unsplit 16-row and the 64-row kernels */
            for (int m = 0; m < 2; m++) {
                Att pu = m ? pa : pf;
                pu.rg = 1;
                pu.vs = -1;
                auto o = run_tc(pu, qp.data(), m ? kv3.data() : kv2.data(), ld, m ? kv3.data() : kv2.data(), ld, false);
                snprintf(nm, sizeof nm, "%s: node %d prefill%s unsplit (1 rg, 2 warps) == default", name, i,
                         m ? " via attention_at" : "");
                check_same(nm, o.data(), pre.data(), pre.size());
            }
            Att p4 = pa;
            p4.rg = 4;
            auto o = run_tc(p4, qp.data(), kv3.data(), ld, kv3.data(), ld, false);
            snprintf(nm, sizeof nm, "%s: node %d prefill via attention_at, 4 row groups == default", name, i);
            check_same(nm, o.data(), pre.data(), pre.size());
        }
    }
}

int main(int argc, char **argv) {
    bool full = argc > 1 && !strcmp(argv[1], "full");
    /* accuracy, every kind of call */
    accuracy("MLA dims H=64 576/512 decode T=1 past=700 (2 chunks)", {1, 701, 700, 64, 1, 576, 512, true, 0, 0.1447f, nullptr, 0, 0}, true);
    accuracy("MLA dims H=16 576/512 causal T=5 past=509 (straddles)", {5, 514, 509, 16, 1, 576, 512, true, 0, 0.1447f, nullptr, 0, 0}, true);
    accuracy("tiny MLA H=4 40/32 causal T=20 past=3", {20, 23, 3, 4, 1, 40, 32, true, 0, 0.25f, nullptr, 0, 0}, true);
    /* 11 chunks: the merge's batches of 8 chunks and a remainder */
    accuracy("tiny MLA H=4 40/32 decode T=1 past=5300 (11 chunks)",
             {1, 5301, 5300, 4, 1, 40, 32, true, 0, 0.25f, nullptr, 0, 0}, true);
    accuracy("GQA full Hq=4 Hkv=2 d=32 T=8 past=20", {8, 28, 20, 4, 2, 32, 32, false, 0, 0.1767767f, nullptr, 0, 0}, false);
    accuracy("GQA window=5 causal Hq=4 Hkv=2 d=32 T=6 past=10", {6, 16, 10, 4, 2, 32, 32, true, 5, 0.1767767f, nullptr, 0, 0}, false);
    accuracy("GQA odd dims Hq=3 Hkv=1 d=36 (plain loads) T=5 past=7", {5, 12, 7, 3, 1, 36, 36, true, 0, 0.1666667f, nullptr, 0, 0}, false, true);
    accuracy("GQA 8 kv heads Hq=64 d=128 T=3 past=600 full", {3, 603, 600, 64, 8, 128, 128, false, 0, 0.0883883f, nullptr, 0, 0}, false);
    accuracy("MQA G=80 (2 row blocks per query) d=64/64 T=2 past=30", {2, 32, 30, 80, 1, 64, 64, true, 0, 0.125f, nullptr, 0, 0}, true);
    /* the value split (16-row blocks of 8 warps), forced shapes, against float64 */
    for (int vs = 1; vs <= 4; vs *= 2) {
        Att c{1, 1100, 1099, 64, 1, 576, 512, true, 0, 0.1447f, nullptr, 0, 0};
        c.rg = 1;
        c.vs = vs;
        char nm[120];
        snprintf(nm, sizeof nm, "MLA dims H=64 decode T=1 past=1099 (3 chunks), %d value slices", vs);
        accuracy(nm, c, true);
    }
    {
        Att c{3, 700, 697, 16, 1, 576, 500, true, 0, 0.1447f, nullptr, 0, 0};   /* dv 500: padded slice 3 */
        c.rg = 1;
        c.vs = 4;
        accuracy("MQA H=16 key 576 value 500 (zero-padded last slice) T=3, 4 slices", c, false);
        Att g{4, 530, 526, 8, 2, 256, 256, true, 0, 0.0625f, nullptr, 0, 0};
        g.rg = 1;
        g.vs = 2;
        accuracy("GQA Hq=8 Hkv=2 d=256 T=4 past=526, 2 slices (DVP 256)", g, false);
        Att w{6, 16, 10, 4, 2, 128, 128, true, 5, 0.0883883f, nullptr, 0, 0};
        w.rg = 1;
        w.vs = 1;
        accuracy("GQA window=5 Hq=4 Hkv=2 d=128 T=6, 8 warps (DVP 128)", w, false);
    }
    /* batch invariance: H=16 puts 4 queries in a block; P > 512 gives shared prefix chunks */
    std::vector<int> par = {-1, 0, 0, 1, 1, 2, 3, 6, 0, 7};
    invariance("MQA H=16 576/512", 16, 576, 512, 600, par, full);
    invariance("tiny H=4 40/32 (16 queries/block)", 4, 40, 32, 1030, par, true);
    if (full) invariance("MLA H=64 576/512", 64, 576, 512, 520, par, false);
    printf("%d checks, %d failed\n", checks, fails);
    return fails ? 1 : 0;
}
