/* cpu_avx2.c: AVX2 forms of the CPU backend's hot loops, the dot products of
 * kd_cpu_matmul_wt and the decoding of weight rows, for CPUs that have AVX2 (chosen at run
 * time: kd_cpu_has_avx2).
 *
 * Each gives the bits of its portable form (cpu.h's kd_dot, cpu_backend.c's dot_bf16,
 * dot_int4 and kd_cpu_weight_row): kd_dot's eight partial sums are the eight lanes of one
 * register, each lane adds its products in the same order (a multiply, then an add: no FMA,
 * as the ISO C build contracts nothing either), and the lanes are reduced by the same tree,
 * ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), before the same scalar tail. Decoding is
 * exact for bf16 and rounds (q - 8) * scale once, as the portable code does. So the backend's
 * results, and its batch invariance, do not depend on which form ran; spec/cpu_simd_spec.lua
 * checks both forms bit for bit.
 *
 * What it buys: the T > 2 products (verify, prefill, the draft block) compute a 4 x 2 tile of
 * dot products per pass over k, so each loaded vector of x or of a weight row serves two or
 * four products instead of one; the T <= 2 products (decode) and the decoding of bf16 and
 * INT4 rows run eight columns a step. */
#include "cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))

bool kd_cpu_has_avx2(void) { return __builtin_cpu_supports("avx2"); }

/* kd_dot's reduction of its eight partial sums */
AVX2 static inline float tree8(__m256 s) {
    float v[8];
    _mm256_storeu_ps(v, s);
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* the reduction, then kd_dot's scalar tail over [i0, n) */
AVX2 static inline float finish(__m256 s, const float *a, const float *b, int i0, int n) {
    float t = tree8(s);
    for (int i = i0; i < n; i++) t += a[i] * b[i];
    return t;
}

#define MAC(s, a, b) s = _mm256_add_ps(s, _mm256_mul_ps(a, b))

AVX2 void kd_cpu_dots_avx2(const float *x, int T, int ldx, const float *wr, int nb, int k, float *out, int ldo) {
    const int k8 = k & ~7;
    int t = 0;
    for (; t + 4 <= T; t += 4) {
        const float *x0 = x + (size_t)t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
        float *o0 = out + (size_t)t * ldo, *o1 = o0 + ldo, *o2 = o1 + ldo, *o3 = o2 + ldo;
        int j = 0;
        for (; j + 2 <= nb; j += 2) {
            const float *w0 = wr + (size_t)j * k, *w1 = w0 + k;
            __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00,
                   s31 = s00;
            for (int i = 0; i < k8; i += 8) {
                const __m256 a0 = _mm256_loadu_ps(w0 + i), a1 = _mm256_loadu_ps(w1 + i);
                __m256 v = _mm256_loadu_ps(x0 + i);
                MAC(s00, v, a0);
                MAC(s01, v, a1);
                v = _mm256_loadu_ps(x1 + i);
                MAC(s10, v, a0);
                MAC(s11, v, a1);
                v = _mm256_loadu_ps(x2 + i);
                MAC(s20, v, a0);
                MAC(s21, v, a1);
                v = _mm256_loadu_ps(x3 + i);
                MAC(s30, v, a0);
                MAC(s31, v, a1);
            }
            o0[j] = finish(s00, x0, w0, k8, k);
            o0[j + 1] = finish(s01, x0, w1, k8, k);
            o1[j] = finish(s10, x1, w0, k8, k);
            o1[j + 1] = finish(s11, x1, w1, k8, k);
            o2[j] = finish(s20, x2, w0, k8, k);
            o2[j + 1] = finish(s21, x2, w1, k8, k);
            o3[j] = finish(s30, x3, w0, k8, k);
            o3[j + 1] = finish(s31, x3, w1, k8, k);
        }
        for (; j < nb; j++) {
            const float *w0 = wr + (size_t)j * k;
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            for (int i = 0; i < k8; i += 8) {
                const __m256 a0 = _mm256_loadu_ps(w0 + i);
                MAC(s0, _mm256_loadu_ps(x0 + i), a0);
                MAC(s1, _mm256_loadu_ps(x1 + i), a0);
                MAC(s2, _mm256_loadu_ps(x2 + i), a0);
                MAC(s3, _mm256_loadu_ps(x3 + i), a0);
            }
            o0[j] = finish(s0, x0, w0, k8, k);
            o1[j] = finish(s1, x1, w0, k8, k);
            o2[j] = finish(s2, x2, w0, k8, k);
            o3[j] = finish(s3, x3, w0, k8, k);
        }
    }
    for (; t < T; t++) {
        const float *xt = x + (size_t)t * ldx;
        for (int j = 0; j < nb; j++) {
            const float *w0 = wr + (size_t)j * k;
            __m256 s = _mm256_setzero_ps();
            for (int i = 0; i < k8; i += 8) MAC(s, _mm256_loadu_ps(xt + i), _mm256_loadu_ps(w0 + i));
            out[(size_t)t * ldo + j] = finish(s, xt, w0, k8, k);
        }
    }
}

/* eight bf16 values as fp32: the 16 bits on top */
AVX2 static inline __m256 bf16x8(const uint16_t *p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

/* the eight weights of one INT4 word: ((word >> 4i) & 15) - 8, times the group's scale */
AVX2 static inline __m256 int4x8(uint32_t word, __m256 scale) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), _mm256_set1_epi32(15));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))), scale);
}

AVX2 float kd_cpu_dot_bf16_avx2(const float *x, const uint16_t *p, int n) {
    const int n8 = n & ~7;
    __m256 s = _mm256_setzero_ps();
    for (int i = 0; i < n8; i += 8) MAC(s, _mm256_loadu_ps(x + i), bf16x8(p + i));
    float t = tree8(s);
    for (int i = n8; i < n; i++) t += x[i] * kd_bf16_to_f32(p[i]);
    return t;
}

AVX2 float kd_cpu_dot_int4_avx2(const float *x, const uint32_t *words, const uint16_t *scales, int group, int n) {
    __m256 s = _mm256_setzero_ps();
    for (int c = 0; c < n; c += group) {
        const __m256 sc = _mm256_set1_ps(kd_bf16_to_f32(scales[c / group]));
        for (int i = c; i < c + group; i += 8) MAC(s, _mm256_loadu_ps(x + i), int4x8(words[i / 8], sc));
    }
    return tree8(s);
}

AVX2 void kd_cpu_decode_bf16_avx2(const uint16_t *p, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, bf16x8(p + i));
    for (; i < n; i++) dst[i] = kd_bf16_to_f32(p[i]);
}

AVX2 void kd_cpu_decode_int4_avx2(const uint32_t *words, const uint16_t *scales, int64_t g, int64_t c0, int64_t n,
                                  float *dst) {
    for (int64_t c = c0; c < c0 + n; c += g) {
        const __m256 sc = _mm256_set1_ps(kd_bf16_to_f32(scales[c / g]));
        for (int64_t j = c / 8; j < (c + g) / 8; j++) _mm256_storeu_ps(dst + (j * 8 - c0), int4x8(words[j], sc));
    }
}

#else
bool kd_cpu_has_avx2(void) { return false; }
#endif
