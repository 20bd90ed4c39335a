/* sample_rule.h: the exact arithmetic of the keyed sampling rule (sample.c, docs/ddtree.md),
 * shared word for word by the host (core/sample.c) and the device (cuda/ddtree.cu), so that
 * both give bit-identical tokens.
 *
 * Every step is either an IEEE-754 operation with one rounding (+, -, *, /, fma) or integer
 * arithmetic:
 *  - exp(a) for a <= 0 (kd_rule_exp_parts) by Cody-Waite reduction (k = rint(a / ln2), r = a -
 *    k ln2 with two fma) and a degree-13 Taylor polynomial p in Horner form with fma; w = p 2^k.
 *    Below a = -708 the weight is 0 (the result would leave the normal range). Accuracy is a
 *    few ulp; what matters is that it is the same function on both sides (no library exp:
 *    glibc's and CUDA's differ in the last bit). On the device the non-fma steps use the
 *    __d*_rn intrinsics so nvcc cannot contract them into fma; on the host C11 (-std=c11)
 *    does not contract either, and fma() is the C library's correctly rounded fma.
 *  - kd_rule_mass: a token's mass q = trunc(w * 2^62) with w = exp(x/T - m/T) in double (x/T
 *    and m/T rounded to nearest, found without a division: kd_rule_scaled), an integer in
 *    [0, 2^62] (read off p's bits: w * 2^62 is exact); the top token has w = 1 exactly, so
 *    q = 2^62.
 *  - masses are summed exactly in 128-bit integers (kd_u128), so every sum is independent of
 *    the order of summation: a parallel reduction gives the host's value.
 *  - the draw: U = the top 53 bits of the keyed SplitMix64 word; target = floor(U * W / 2^53)
 *    with W the kept mass; the token is the first kept id (ascending) whose inclusive prefix
 *    mass exceeds target.
 *  - min-p: Q = ceil(min_p * 2^62) (min_p in (0, 1]); a token whose mass q is below Q gets
 *    mass 0 (it can never be drawn and adds nothing to a sum). As q = trunc(w * 2^62) and Q is
 *    an integer, q >= Q exactly when w >= Q * 2^-62: the token's probability is at least
 *    min_p times the top token's, rounded up to the 2^-62 grid.
 *  - top-p: G = max(1, ceil(S * P / 2^32)) with P = trunc(top_p * 2^32) and S the mass kept
 *    by top-k and min-p; the nucleus is the shortest prefix (logit descending, id ascending)
 *    whose mass reaches G.
 * Not part of any public contract; include it only where the rule is computed or checked:
 * core/sample.c, core/drafter.c, the backends' sampling and argmax ops (cpu/, cuda/ddtree.cu,
 * cuda/tree.cu) and the test surface. */
#ifndef KD_SAMPLE_RULE_H
#define KD_SAMPLE_RULE_H
#include <stdint.h>
#include <math.h>
#include <string.h>

#ifdef __CUDACC__
#define KD_RULE_FN static __host__ __device__ __forceinline__
#else
#define KD_RULE_FN static inline
#endif

#if defined(__CUDA_ARCH__)
#define KD_RULE_MUL(a, b) __dmul_rn((a), (b))
#define KD_RULE_DIV(a, b) __ddiv_rn((a), (b))
#define KD_RULE_SUB(a, b) __dsub_rn((a), (b))
#define KD_RULE_ADD(a, b) __dadd_rn((a), (b))
#else
#define KD_RULE_MUL(a, b) ((a) * (b))
#define KD_RULE_DIV(a, b) ((a) / (b))
#define KD_RULE_SUB(a, b) ((a) - (b))
#define KD_RULE_ADD(a, b) ((a) + (b))
#endif

/* error codes of one row: kind | column << 2 (0 = fine) */
enum { KD_SAMPLE_ERR_NAN = 1, KD_SAMPLE_ERR_PINF = 2, KD_SAMPLE_ERR_ALLNEG = 3 };
/* the largest vocabulary the codes can name a column of */
enum { KD_SAMPLE_MAX_VOCAB = 1 << 29 };
/* one logit's error code at column col: NaN or +inf (-inf is a masked token, fine) */
KD_RULE_FN int32_t kd_rule_logit_code(float v, int col) {
    if (v != v) return KD_SAMPLE_ERR_NAN | (int32_t)((uint32_t)col << 2);
    if (isinf(v) && v > 0) return KD_SAMPLE_ERR_PINF | (int32_t)((uint32_t)col << 2);
    return 0;
}

/* ---- the keyed uniform ---- */
KD_RULE_FN uint64_t kd_rule_mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
/* the top 53 bits of the keyed word: u = U * 2^-53 */
KD_RULE_FN uint64_t kd_rule_u53(uint64_t seed, int64_t position) {
    return kd_rule_mix64(kd_rule_mix64(seed) + (uint64_t)position * 0xD1B54A32D192ED03ull) >> 11;
}

/* ---- exp on (-inf, 0] ---- */
/* a double's bits (the device reads them from the register; the host through memcpy) */
KD_RULE_FN uint64_t kd_rule_bits(double d) {
#if defined(__CUDA_ARCH__)
    return (uint64_t)__double_as_longlong(d);
#else
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
#endif
}
/* exp(a) = p * 2^k for a in [-708, 0] (p about [0.7, 1.42]). k = rint(a / ln2) is found by adding
 * and subtracting 1.5 * 2^52: for |y| < 2^51 the sum rounds y to an integer, ties to even as rint
 * does, and the subtraction is exact; the sum's low 32 bits are k itself. Neither step is a
 * conversion instruction, which the device issues at a quarter of its fp64 rate. */
KD_RULE_FN double kd_rule_exp_parts(double a, int *k) {
    const double shift = 0x1.8p52;
    const double s = KD_RULE_ADD(KD_RULE_MUL(a, 0x1.71547652b82fep+0), shift); /* a / ln2 + shift */
    const double kf = KD_RULE_SUB(s, shift);
    *k = (int32_t)(uint32_t)kd_rule_bits(s);
    double r = fma(-kf, 0x1.62e42fee00000p-1, a);         /* ln2 high part (k * hi is exact) */
    r = fma(-kf, 0x1.a39ef35793c76p-33, r);               /* ln2 low part */
    double p = 0x1.6124613a86d09p-33;                     /* 1/13! */
    p = fma(p, r, 0x1.1eed8eff8d898p-29);                 /* 1/12! */
    p = fma(p, r, 0x1.ae64567f544e4p-26);                 /* 1/11! */
    p = fma(p, r, 0x1.27e4fb7789f5cp-22);                 /* 1/10! */
    p = fma(p, r, 0x1.71de3a556c734p-19);                 /* 1/9! */
    p = fma(p, r, 0x1.a01a01a01a01ap-16);                 /* 1/8! */
    p = fma(p, r, 0x1.a01a01a01a01ap-13);                 /* 1/7! */
    p = fma(p, r, 0x1.6c16c16c16c17p-10);                 /* 1/6! */
    p = fma(p, r, 0x1.1111111111111p-7);                  /* 1/5! */
    p = fma(p, r, 0x1.5555555555555p-5);                  /* 1/4! */
    p = fma(p, r, 0x1.5555555555555p-3);                  /* 1/3! */
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    return fma(p, r, 1.0);
}

/* x / T rounded to nearest, without a division per value (the device's is a long sequence): q =
 * RN(x invT) with invT = RN(1/T) is within an ulp of x/T, r = x - q T is exact (fma), and RN(q + r
 * invT) is then RN(x/T) (Markstein's theorem; x and T are floats, so nothing under- or overflows in
 * double). r = 0 keeps q, whose zero has x's sign as x/T's does. T = 1 is x. */
KD_RULE_FN double kd_rule_scaled(float x, double T, double invT) {
    if (T == 1.0) return (double)x;
    const double q = KD_RULE_MUL((double)x, invT);
    const double r = fma(-q, T, (double)x);
    return r == 0.0 ? q : fma(r, invT, q);
}
/* A row's constants under temperature T: invT = RN(1/T) and z = m/T for its max m. */
typedef struct kd_rule_row { double T, invT, z; } kd_rule_row;
KD_RULE_FN kd_rule_row kd_rule_row_of(float m, double T) {
    const double invT = KD_RULE_DIV(1.0, T);
    const kd_rule_row row = {T, invT, kd_rule_scaled(m, T, invT)};
    return row;
}
/* a token's mass: trunc(exp(x/T - z) * 2^62) under its row's constants; 0 below a = -708 (and
 * for -inf). With p = M * 2^(E - 52) (M its 53-bit significand), w = p * 2^k is normal (k >=
 * -1021), so w * 2^62 = M * 2^(E + k + 10) exactly and its trunc is M shifted: integer steps,
 * not ldexp and a conversion. */
KD_RULE_FN uint64_t kd_rule_mass(float x, kd_rule_row row) {
    const double a = KD_RULE_SUB(kd_rule_scaled(x, row.T, row.invT), row.z);
    if (!(a >= -708.0)) return 0;
    int k;
    const uint64_t u = kd_rule_bits(kd_rule_exp_parts(a, &k));
    const uint64_t M = (u & 0xfffffffffffffull) | 0x10000000000000ull;
    const int s = (int)(u >> 52) - 1023 + k + 10;
    return s >= 0 ? M << s : s > -64 ? M >> -s : 0;
}
/* the min-p floor Q = ceil(min_p * 2^62) for 0 < min_p <= 1 (exact: a power-of-two scaling of a
 * float), 0 = off for min_p <= 0; kd_sampler_check rejects NaN and min_p > 1 */
KD_RULE_FN uint64_t kd_rule_min_p_floor(float min_p) {
    if (!(min_p > 0.0f)) return 0;
    return (uint64_t)ceil(KD_RULE_MUL((double)min_p, 0x1p62));
}

/* ---- 128-bit unsigned integers ---- */
typedef struct kd_u128 { uint64_t lo, hi; } kd_u128;

KD_RULE_FN kd_u128 kd_u128_of(uint64_t v) { kd_u128 r; r.lo = v; r.hi = 0; return r; }
KD_RULE_FN kd_u128 kd_u128_add(kd_u128 a, kd_u128 b) {
    kd_u128 r;
    r.lo = a.lo + b.lo;
    r.hi = a.hi + b.hi + (r.lo < a.lo ? 1u : 0u);
    return r;
}
KD_RULE_FN kd_u128 kd_u128_add64(kd_u128 a, uint64_t b) { return kd_u128_add(a, kd_u128_of(b)); }
KD_RULE_FN kd_u128 kd_u128_sub(kd_u128 a, kd_u128 b) {   /* a >= b */
    kd_u128 r;
    r.lo = a.lo - b.lo;
    r.hi = a.hi - b.hi - (a.lo < b.lo ? 1u : 0u);
    return r;
}
KD_RULE_FN int kd_u128_lt(kd_u128 a, kd_u128 b) { return a.hi < b.hi || (a.hi == b.hi && a.lo < b.lo); }
/* the full product of two 64-bit numbers */
KD_RULE_FN kd_u128 kd_u128_mul64x64(uint64_t a, uint64_t b) {
    uint64_t a0 = a & 0xffffffffu, a1 = a >> 32, b0 = b & 0xffffffffu, b1 = b >> 32;
    uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    uint64_t mid = (p00 >> 32) + (p01 & 0xffffffffu) + (p10 & 0xffffffffu);
    kd_u128 r;
    r.lo = (p00 & 0xffffffffu) | (mid << 32);
    r.hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
    return r;
}
/* a * b when the product is below 2^128 */
KD_RULE_FN kd_u128 kd_u128_mul64(kd_u128 a, uint64_t b) {
    kd_u128 r = kd_u128_mul64x64(a.lo, b);
    r.hi += a.hi * b;
    return r;
}
KD_RULE_FN kd_u128 kd_u128_shr(kd_u128 a, int s) {   /* 0 < s < 64 */
    kd_u128 r;
    r.lo = (a.lo >> s) | (a.hi << (64 - s));
    r.hi = a.hi >> s;
    return r;
}
KD_RULE_FN kd_u128 kd_u128_shl(kd_u128 a, int s) {   /* 0 < s < 64, no overflow */
    kd_u128 r;
    r.hi = (a.hi << s) | (a.lo >> (64 - s));
    r.lo = a.lo << s;
    return r;
}
/* ceil(a / d) for 0 < d < 2^63 when the quotient is below 2^64 */
KD_RULE_FN uint64_t kd_u128_div64_ceil(kd_u128 a, uint64_t d) {
    uint64_t q = 0, r = 0;
    for (int i = 127; i >= 0; i--) {
        uint64_t bit = i >= 64 ? (a.hi >> (i - 64)) & 1u : (a.lo >> i) & 1u;
        r = (r << 1) | bit;                 /* r < d < 2^63 before the shift: no overflow */
        if (r >= d) {
            r -= d;
            if (i < 64) q |= (uint64_t)1 << i;
        }
    }
    return q + (r != 0 ? 1u : 0u);
}

/* the nucleus goal G = max(1, ceil(S * trunc(p * 2^32) / 2^32)); S < 2^94 */
KD_RULE_FN kd_u128 kd_rule_top_p_goal(kd_u128 S, float top_p) {
    uint64_t P = (uint64_t)KD_RULE_MUL((double)top_p, 0x1p32);
    kd_u128 g = kd_u128_mul64(S, P);
    g = kd_u128_add64(g, 0xffffffffull);
    g = kd_u128_shr(g, 32);
    if (g.hi == 0 && g.lo == 0) g.lo = 1;
    return g;
}

/* the draw's target floor(U * W / 2^53) for U < 2^53, W < 2^117 (exact, < W) */
KD_RULE_FN kd_u128 kd_rule_target(uint64_t U, kd_u128 W) {
    kd_u128 hi = kd_u128_mul64x64(U, W.hi);   /* < 2^117: shifted by 11 stays below 2^128 */
    kd_u128 lo = kd_u128_mul64x64(U, W.lo);
    return kd_u128_add(kd_u128_shl(hi, 11), kd_u128_shr(lo, 53));
}
#endif
