/* emu_main.cpp: see run.sh. Runs cuda/moe.cu's route_kernel (kernels.inc, extracted by run.sh) as
 * kd_cuda_moe launches it (one block of ROUTE_THREADS per token), under the SIMT emulation of
 * ../ddtree_emu/inc/cuda_internal.cuh, against the host rule below. */
#include "cuda_internal.cuh"
#include "emu_half.h"
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "helpers.inc"
#include "emu_runtime.h"
static double emu_dyn_buf[4096];
static double *emu_dyn_smem = emu_dyn_buf;
#include "kernels.inc"

static uint64_t rs = 0x2545F4914F6CDD1Dull;
static double urand() { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (rs >> 11) * 0x1.0p-53; }
static int fails = 0, checks = 0;

/* the rule (moe.cu's top comment): s = sigmoid, choice = s + bias; groups scored by their top two
 * choices, all but the topk_group best masked; top_k by choice (value desc, lower id); weights s
 * of the chosen, normalised (+1e-20), scaled, listed in ascending expert id */
static void host_route(const float *logit, int n, const float *bias, int n_group, int topk_group, int top_k, bool norm,
                       float scaling, int *ids, float *w) {
    std::vector<float> s(n), ch(n);
    for (int i = 0; i < n; i++) {
        s[i] = 1.0f / (1.0f + expf(-logit[i]));
        ch[i] = s[i] + (bias ? bias[i] : 0.0f);
    }
    auto better = [](float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); };
    if (n_group > 1) {
        const int per = n / n_group;
        std::vector<float> gs(n_group);
        std::vector<char> keep(n_group, 0);
        for (int g = 0; g < n_group; g++) {
            float a = -INFINITY, b = -INFINITY;
            for (int i = g * per; i < (g + 1) * per; i++) {
                if (ch[i] > a) { b = a; a = ch[i]; } else if (ch[i] > b) b = ch[i];
            }
            gs[g] = per >= 2 ? a + b : a;
        }
        for (int j = 0; j < topk_group && j < n_group; j++) {
            int bi = -1;
            for (int g = 0; g < n_group; g++)
                if (!keep[g] && (bi < 0 || better(gs[g], g, gs[bi], bi))) bi = g;
            keep[bi] = 1;
        }
        for (int i = 0; i < n; i++)
            if (!keep[i / per]) ch[i] = -INFINITY;
    }
    std::vector<char> taken(n, 0);
    std::vector<int> sel(top_k);
    for (int j = 0; j < top_k; j++) {
        int bi = -1;
        for (int i = 0; i < n; i++)
            if (!taken[i] && (bi < 0 || better(ch[i], i, ch[bi], bi))) bi = i;
        taken[bi] = 1;
        sel[j] = bi;
    }
    float sum = 0.0f;
    for (int j = 0; j < top_k; j++) { w[j] = s[sel[j]]; sum += w[j]; }
    for (int j = 0; j < top_k; j++) {
        if (norm) w[j] /= sum + 1e-20f;
        w[j] *= scaling;
        ids[j] = sel[j];
    }
    for (int a = 1; a < top_k; a++)
        for (int b = a; b > 0 && ids[b - 1] > ids[b]; b--) {
            std::swap(ids[b], ids[b - 1]);
            std::swap(w[b], w[b - 1]);
        }
}

/* T tokens of n experts; kind 0: random logits, 1: four distinct logits and no bias (ties), 2: a
 * bias that pushes some experts to -inf choices */
static void test(const char *name, int T, int n, int n_group, int topk_group, int top_k, bool norm, float scaling,
                 int kind) {
    std::vector<float> logit((size_t)T * n), bias(n);
    for (auto &v : logit) v = kind == 1 ? (float)(int)(urand() * 4) - 1.5f : (float)(urand() * 8 - 4);
    for (int i = 0; i < n; i++)   /* ties: no bias, so equal logits make equal choices */
        bias[i] = kind == 1 ? 0.0f : kind == 2 && i % 5 == 0 ? -INFINITY : (float)(urand() * 0.2 - 0.1);
    std::vector<int32_t> ids((size_t)T * top_k, -7);
    std::vector<float> w((size_t)T * top_k, NAN);
    const int ng = n_group > 1 ? n_group : 1;
    const size_t smem = (size_t)(2 * n + ng) * sizeof(float) + (size_t)(n > ng ? n : ng) + 16;
    if (smem > sizeof emu_dyn_buf) { printf("FAIL %s: %zu bytes of shared memory > the emulator's\n", name, smem); fails++; return; }
    launch(T, ROUTE_THREADS, [&] {
        route_kernel(logit.data(), n, bias.data(), n_group, topk_group, top_k, norm, scaling, ids.data(), w.data());
    });
    long bad = 0;
    std::vector<int> hid(top_k);
    std::vector<float> hw(top_k);
    for (int t = 0; t < T; t++) {
        host_route(&logit[(size_t)t * n], n, bias.data(), n_group, topk_group, top_k, norm, scaling, hid.data(), hw.data());
        for (int j = 0; j < top_k; j++)
            if (ids[(size_t)t * top_k + j] != hid[j] || memcmp(&w[(size_t)t * top_k + j], &hw[j], 4) != 0) bad++;
    }
    checks++;
    if (bad) fails++;
    printf("%s %s: %d tokens, %d experts (%s), groups %d/%d, top %d: %ld entries differ from the host rule\n",
           bad ? "FAIL" : "ok  ", name, T, n, n <= 32 * ROUTE_LANE_MAX ? "one warp" : "block", topk_group, n_group,
           top_k, bad);
}

int main() {
    test("K2.6 (384 experts, top 8)", 5, 384, 1, 1, 8, true, 2.827f, 0);
    test("K2.6, ties", 4, 384, 1, 1, 8, true, 2.827f, 1);
    test("K2.6, -inf choices", 3, 384, 1, 1, 8, true, 2.827f, 2);
    test("DeepSeek-V3 (256 experts, 8 groups, 4 kept)", 4, 256, 8, 4, 8, true, 2.5f, 0);
    test("DeepSeek-V3, ties", 3, 256, 8, 4, 8, true, 2.5f, 1);
    test("tiny (16 experts, top 4), no norm", 4, 16, 1, 1, 4, false, 1.0f, 0);
    test("33 experts (a partial lane row)", 3, 33, 1, 1, 6, true, 1.0f, 1);
    test("K2.6 at top 32 (the most the kernel takes)", 3, 384, 1, 1, 32, true, 2.827f, 0);
    test("K2.6 at top 32, ties", 2, 384, 1, 1, 32, true, 2.827f, 1);
    test("512 experts (the one-warp bound)", 2, 512, 1, 1, 8, true, 1.0f, 0);
    test("640 experts (block-wide)", 2, 640, 1, 1, 8, true, 1.0f, 0);
    test("640 experts, ties (block-wide)", 2, 640, 4, 2, 8, true, 1.0f, 1);
    printf("%d checks, %d failed\n", checks, fails);
    return fails ? 1 : 0;
}
