/* emu_main.cpp: see run.sh. Runs cuda/norm_rope.cu's scale_add, rmsnorm, add_rmsnorm, rope,
 * mla_rope_store and move_rows kernels (kernels.inc, extracted by run.sh) under the SIMT emulation
 * of ddtree_emu/inc/cuda_internal.cuh (its uint4 is move_rows_kernel's wide word):
 * add_rmsnorm_kernel must give the bits of the add followed by the norm, and the CPU twin's
 * values; mla_rope_store_kernel the bits of rmsnorm_kernel and rope_kernel on the same rows,
 * written where the op says. */
#include "cuda_internal.cuh"
#include "emu_half.h"
#include <cstdio>
#include <vector>
#include "helpers.inc"
#include "emu_runtime.h"
#include "kernels.inc"

/* the norms' block size, as kd_cuda_rmsnorm and kd_cuda_add_rmsnorm launch them */
static int threads_for(int d) { return norm_shape(d).threads; }

static uint64_t rs = 88172645463325252ull;
static float urand(float lo, float hi) {
    rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
    return lo + (hi - lo) * (float)((rs >> 11) * 0x1.0p-53);
}

static int fails = 0, checks = 0;

/* rows x d activations in bf16, y in ydt (bf16, or f32 as a rank's partial sums), a bf16 weight */
static void check(int rows, int d, int ydt, float eps) {
    size_t n = (size_t)rows * d, ysz = ydt == KD_F32 ? 4 : 2;
    std::vector<uint16_t> x0(n), w(d), xa(n), xb(n), oa(n), ob(n);
    std::vector<unsigned char> y(n * ysz);
    for (size_t i = 0; i < n; i++) x0[i] = kd_f32_to_bf16(urand(-3, 3));
    for (size_t i = 0; i < n; i++) {
        float v = urand(-2, 2);
        if (ydt == KD_F32) memcpy(&y[i * 4], &v, 4);
        else { uint16_t b = kd_f32_to_bf16(v); memcpy(&y[i * 2], &b, 2); }
    }
    for (int i = 0; i < d; i++) w[i] = kd_f32_to_bf16(urand(0.5f, 1.5f));
    int th = threads_for(d);
    /* the pair: scale_add (s = 1, a grid of strided blocks) then rmsnorm (one block per row) */
    xa = x0;
    launch(4, 256, [&] { scale_add_kernel(xa.data(), KD_BF16, d, y.data(), ydt, d, 1.0f, rows, d); });
    launch(rows, th, [&] { NORM_KERNEL(rmsnorm_kernel, norm_shape(d))(xa.data(), KD_BF16, d, w.data(), KD_BF16, d, 1, eps, oa.data(), KD_BF16, d); });
    /* the fused kernel */
    xb = x0;
    launch(rows, th, [&] {
        NORM_KERNEL(add_rmsnorm_kernel, norm_shape(d))(xb.data(), KD_BF16, d, y.data(), ydt, d, w.data(), KD_BF16, d, eps, ob.data(), KD_BF16, d);
    });
    checks++;
    if (xa != xb || oa != ob) {
        fails++;
        printf("FAIL %d x %d (y %s): add_rmsnorm differs from scale_add + rmsnorm\n", rows, d, kd_dtype_name((kd_dtype)ydt));
        return;
    }
    if (ydt == KD_F32) {   /* an fp32 addend is added as its bf16 (a rank's partial sums: tp > 1 adds what tp = 1 adds) */
        std::vector<uint16_t> y16(n), xc = x0, oc(n);
        for (size_t i = 0; i < n; i++) { float v; memcpy(&v, &y[i * 4], 4); y16[i] = kd_f32_to_bf16(v); }
        launch(rows, th, [&] {
            NORM_KERNEL(add_rmsnorm_kernel, norm_shape(d))(xc.data(), KD_BF16, d, y16.data(), KD_BF16, d, w.data(), KD_BF16, d, eps, oc.data(),
                               KD_BF16, d);
        });
        checks++;
        if (xc != xb || oc != ob) {
            fails++;
            printf("FAIL %d x %d: an fp32 addend is not added as its bf16\n", rows, d);
            return;
        }
        printf("ok   %3d x %5d: an fp32 addend is added as its bf16 (the bits of a bf16 addend)\n", rows, d);
    }
    /* the CPU twin in fp32 on the same values: within bf16 rounding (the device rounds x + y to
     * bf16 before the norm reads it, and stores the norm in bf16) */
    std::vector<float> xf(n), yf(n), of(n);
    for (size_t i = 0; i < n; i++) {
        xf[i] = kd_bf16_to_f32(x0[i]);
        if (ydt == KD_F32) memcpy(&yf[i], &y[i * 4], 4);
        else { uint16_t b; memcpy(&b, &y[i * 2], 2); yf[i] = kd_bf16_to_f32(b); }
    }
    kd_backend *be = nullptr;
    if (kd_backend_cpu_create(&be) != KD_OK) { printf("FAIL: CPU backend: %s\n", kd_last_error()); fails++; return; }
    kd_weight wt = {};
    wt.name = "emu.norm";
    wt.format = KD_W_BF16;
    wt.rows = d;
    wt.cols = 1;
    wt.src = w.data();
    kd_act ax = {xf.data(), rows, d, d, KD_F32}, ay = {yf.data(), rows, d, d, KD_F32}, ao = {of.data(), rows, d, d, KD_F32};
    if (be->ops->weight_load(be, &wt) != KD_OK || be->ops->add_rmsnorm(be, ax, ay, &wt, eps, ao) != KD_OK) {
        printf("FAIL: the CPU twin: %s\n", kd_last_error());
        fails++;
    } else {
        float top = 0, err = 0;
        for (size_t i = 0; i < n; i++) {
            top = fmaxf(top, fabsf(of[i]));
            err = fmaxf(err, fabsf(of[i] - kd_bf16_to_f32(ob[i])));
        }
        checks++;
        if (!(err <= 1e-2f * top)) {
            fails++;
            printf("FAIL %d x %d (y %s): the CPU twin differs by %g (largest %g)\n", rows, d,
                   kd_dtype_name((kd_dtype)ydt), err, top);
        } else {
            printf("ok   %3d x %5d, y %s, %3d threads: bits of scale_add + rmsnorm; CPU twin within %.2g of %.3g\n",
                   rows, d, kd_dtype_name((kd_dtype)ydt), th, err, top);
        }
    }
    be->ops->weight_free(be, &wt);
    be->ops->destroy(be);
}

/* mla_rope_store_kernel against rmsnorm_kernel + rope_kernel: T rows of H heads [dn | d] into
 * qfull heads [r | d], and kva [r | d] into the cache at row0 (+ a device length dlen >= 0) */
static void check_mla(int T, int H, int dn, int r, int d, int row0, int dlen) {
    const int qs = dn + d, fs = r + d, kc = r + d, start = row0 + (dlen >= 0 ? dlen : 0), rows = start + T + 2;
    const float eps = 1e-6f;
    auto rnd = [](std::vector<uint16_t> &v, float lo, float hi) { for (auto &e : v) e = kd_f32_to_bf16(urand(lo, hi)); };
    std::vector<uint16_t> q((size_t)T * H * qs), kva((size_t)T * kc), w(r), qf((size_t)T * H * fs), cache((size_t)rows * kc);
    rnd(q, -2, 2); rnd(kva, -3, 3); rnd(w, 0.5f, 1.5f); rnd(qf, -1, 1); rnd(cache, -1, 1);
    std::vector<int32_t> pos(T);
    for (int t = 0; t < T; t++) pos[t] = 5 + 977 * t;
    std::vector<float> inv(d / 2);
    for (int i = 0; i < d / 2; i++) inv[i] = powf(50000.0f, -2.0f * i / d);
    int32_t len = dlen;
    const int th = threads_for(r), qb = (H * (d / 2) + th - 1) / th;
    std::vector<uint16_t> qfa = qf, ca = cache;
    MlaRopeStore a;
    a.q = q.data(); a.qdt = KD_BF16; a.ldq = (long long)H * qs; a.qs = qs;
    a.qf = qfa.data(); a.fdt = KD_BF16; a.ldf = (long long)H * fs; a.fs = fs;
    a.n_heads = H;
    a.kva = kva.data(); a.kdt = KD_BF16; a.ldk = kc; a.c = r;
    a.w = w.data(); a.wdt = KD_BF16; a.eps = eps;
    a.pos = pos.data(); a.inv_freq = inv.data(); a.half = d / 2; a.interleaved = true; a.amp = 1.0f;
    a.cache = ca.data(); a.cdt = KD_BF16; a.ldc = kc; a.cache_rows = rows; a.row0 = row0;
    a.d_len = dlen >= 0 ? &len : nullptr;
    launch(T, th, [&] { NORM_KERNEL(mla_rope_store_kernel, norm_shape(r))(a); }, 1 + qb);
    /* the ops it replaces: rope of q in place, the latent's norm and k_pe's rope in place in kva */
    std::vector<uint16_t> qr = q, kr = kva, qfb = qf, cb = cache;
    launch(4, 256, [&] { rope_kernel(qr.data(), KD_BF16, (long long)H * qs, T, H, qs, dn, pos.data(), inv.data(), d / 2,
                                     true, 1.0f); });
    launch(T, th, [&] { NORM_KERNEL(rmsnorm_kernel, norm_shape(r))(kr.data(), KD_BF16, kc, w.data(), KD_BF16, r, 1, eps, kr.data(), KD_BF16, kc); });
    launch(4, 256, [&] { rope_kernel(kr.data(), KD_BF16, kc, T, 1, kc, r, pos.data(), inv.data(), d / 2, true, 1.0f); });
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++)
            for (int j = 0; j < d; j++) qfb[((size_t)t * H + h) * fs + r + j] = qr[((size_t)t * H + h) * qs + dn + j];
        for (int j = 0; j < kc; j++) cb[(size_t)(start + t) * kc + j] = kr[(size_t)t * kc + j];
    }
    checks++;
    if (qfa != qfb || ca != cb) {
        fails++;
        printf("FAIL mla_rope_store T %d H %d [%d | %d] -> [%d | %d] at row %d: %s differs from rmsnorm + rope\n", T, H, dn,
               d, r, d, start, qfa != qfb ? "qfull" : "the cache");
        return;
    }
    printf("ok   mla_rope_store T %d, %2d heads [%d | %d] -> [%d | %d], rows %d.. (%s length): bits of rmsnorm + rope\n",
           T, H, dn, d, r, d, start, dlen >= 0 ? "device" : "host");
}

/* move_rows_kernel (16-byte words, or bytes) in one launch over n caches of rows x row_b bytes
 * against the definition: in each cache, rows dst0 + i <- rows src0 + keep[i] in the order of i */
template <typename W>
static void check_move(int n, int rows, int row_b, int src0, std::vector<int32_t> keep, int dst0) {
    const size_t bytes = (size_t)rows * row_b;
    std::vector<std::vector<unsigned char>> got(n, std::vector<unsigned char>(bytes)), want;
    for (auto &c : got)
        for (auto &b : c) b = (unsigned char)urand(0, 256);
    want = got;
    for (auto &c : want)
        for (size_t i = 0; i < keep.size(); i++)
            memmove(&c[(size_t)(dst0 + i) * row_b], &c[(size_t)(src0 + keep[i]) * row_b], row_b);
    MoveRows p = {};
    for (int l = 0; l < n; l++) p.base[l] = (char *)got[l].data();
    const long long w = row_b / (long long)sizeof(W);
    launch(2, 32, [&] { move_rows_kernel<W>(p, w, w, src0, keep.data(), (int)keep.size(), dst0); }, n);
    checks++;
    if (got != want) {
        fails++;
        printf("FAIL move_rows %d caches of %d x %d bytes, %zu rows %d.. -> %d..: not the moves in order\n", n, rows, row_b,
               keep.size(), src0, dst0);
        return;
    }
    printf("ok   move_rows %2d caches of %d x %4d bytes, %2zu rows from %d to %d, %2zu-byte words: the moves in order\n", n,
           rows, row_b, keep.size(), src0, dst0, sizeof(W));
}

int main() {
    check(3, 7168, KD_BF16, 1e-6f);    /* K2.6's hidden: 256 threads */
    check(2, 7168, KD_F32, 1e-6f);     /* a rank's fp32 partial sums */
    check(5, 128, KD_BF16, 1e-5f);     /* tiny-k2.6: 64 threads */
    check(4, 100, KD_BF16, 1e-5f);     /* a width that is no multiple of the block */
    check(3, 40, KD_F32, 1e-5f);       /* 32 threads */
    check(2, 9000, KD_F32, 1e-6f);     /* wider than NORM_COLS x 256 threads: in pieces */
    check(1, 8192, KD_BF16, 1e-6f);    /* one whole piece */
    check_mla(2, 64, 128, 512, 64, 7, -1);   /* K2.6 decode + 1, host length */
    check_mla(3, 8, 128, 512, 64, 2, 9);     /* a TP-8 rank's heads, device length */
    check_mla(5, 4, 16, 32, 8, 0, 3);        /* tiny-k2.6's dims */
    /* a commit's compaction: K2.6's latent rows (576 bf16), 9 rows (two load batches), rows that
     * stay put and rows read after an earlier row's store beside them; a later chunk (dst0 above
     * src0); 64 caches (a launch's most); odd-width rows in bytes */
    check_move<uint4>(5, 40, 1152, 5, {0, 1, 3, 4, 5, 9, 10, 21, 30}, 5);
    check_move<uint4>(3, 40, 1152, 5, {3, 4, 9}, 7);
    check_move<uint4>(64, 12, 64, 0, {1, 2, 5}, 0);
    check_move<unsigned char>(3, 40, 74, 5, {0, 2, 3, 7, 8, 9, 15, 21, 30}, 5);
    printf("%d checks, %d failed\n", checks, fails);
    return fails ? 1 : 0;
}
