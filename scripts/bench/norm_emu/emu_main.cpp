/* emu_main.cpp: see run.sh. Runs cuda/norm_rope.cu's scale_add, rmsnorm and add_rmsnorm kernels
 * (kernels.inc, extracted by run.sh) under the SIMT emulation of ddtree_emu/inc/cuda_internal.cuh:
 * add_rmsnorm_kernel must give the bits of the add followed by the norm, and the CPU twin's values. */
#include "cuda_internal.cuh"
#include "emu_half.h"
#include <cstdio>
#include <vector>
#include "helpers.inc"
#include "emu_runtime.h"
#include "kernels.inc"

/* rmsnorm's block size (kd_cuda_rmsnorm, kd_cuda_add_rmsnorm in norm_rope.cu) */
static int threads_for(int d) { return d >= 1024 ? 256 : d >= 256 ? 128 : d >= 64 ? 64 : 32; }

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
    launch(rows, th, [&] { rmsnorm_kernel(xa.data(), KD_BF16, d, w.data(), KD_BF16, d, 1, eps, oa.data(), KD_BF16, d); });
    /* the fused kernel */
    xb = x0;
    launch(rows, th, [&] {
        add_rmsnorm_kernel(xb.data(), KD_BF16, d, y.data(), ydt, d, w.data(), KD_BF16, d, eps, ob.data(), KD_BF16, d);
    });
    checks++;
    if (xa != xb || oa != ob) {
        fails++;
        printf("FAIL %d x %d (y %s): add_rmsnorm differs from scale_add + rmsnorm\n", rows, d, kd_dtype_name((kd_dtype)ydt));
        return;
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

int main() {
    check(3, 7168, KD_BF16, 1e-6f);    /* K2.6's hidden: 256 threads */
    check(2, 7168, KD_F32, 1e-6f);     /* a rank's fp32 partial sums */
    check(5, 128, KD_BF16, 1e-5f);     /* tiny-k2.6: 64 threads */
    check(4, 100, KD_BF16, 1e-5f);     /* a width that is no multiple of the block */
    check(3, 40, KD_F32, 1e-5f);       /* 32 threads */
    printf("%d checks, %d failed\n", checks, fails);
    return fails ? 1 : 0;
}
