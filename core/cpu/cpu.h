/* cpu.h: internals shared by the CPU backend's files (not part of any contract).
 *
 * The CPU backend is the readable specification of every backend op: fp32 math,
 * activations fp32 (kd_act dtype KD_F32), weights decoded from bf16 / f32 / INT4
 * one row at a time into an fp32 buffer and then used as plain float rows. */
#ifndef KD_CPU_H
#define KD_CPU_H
#include "../backend.h"
#include "../error.h"
#include <math.h>
#include <string.h>

/* The backend's private state: one growable fp32 work buffer, so that ops that
 * need temporary space (attention scores, MoE routing, weight rows) do not
 * allocate per call once the largest shape has been seen. */
typedef struct kd_cpu {
    float *work;
    size_t work_floats;
} kd_cpu;

/* a work area of at least n floats (grows, never shrinks; contents not kept) */
kd_status kd_cpu_work(kd_backend *be, size_t n, float **out);

/* ---- scalar conversions ---- */
static inline float kd_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
static inline uint16_t kd_f32_to_bf16(float f) {      /* round to nearest even */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);   /* quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
float kd_f16_to_f32(uint16_t h);
uint16_t kd_f32_to_f16(float f);

/* element (r, c) of an activation view as float / stored from float, any float dtype */
static inline float kd_act_get(kd_act a, int r, int c) {
    size_t i = (size_t)r * a.ld + c;
    switch (a.dtype) {
    case KD_F32: return ((const float *)a.data)[i];
    case KD_BF16: return kd_bf16_to_f32(((const uint16_t *)a.data)[i]);
    case KD_F16: return kd_f16_to_f32(((const uint16_t *)a.data)[i]);
    default: return 0.0f;
    }
}
static inline void kd_act_set(kd_act a, int r, int c, float v) {
    size_t i = (size_t)r * a.ld + c;
    switch (a.dtype) {
    case KD_F32: ((float *)a.data)[i] = v; break;
    case KD_BF16: ((uint16_t *)a.data)[i] = kd_f32_to_bf16(v); break;
    case KD_F16: ((uint16_t *)a.data)[i] = kd_f32_to_f16(v); break;
    default: break;
    }
}
/* row r of an fp32 view */
static inline float *kd_act_f32_row(kd_act a, int r) { return (float *)a.data + (size_t)r * a.ld; }

/* ---- argument checks (each names the op and the argument) ---- */
kd_status kd_cpu_check_f32(const char *op, const char *arg, kd_act a);
kd_status kd_cpu_check_shape(const char *op, const char *arg, kd_act a, int rows, int cols);

/* ---- weights ---- */
/* decode row r, columns [c0, c0+n) of a weight into dst as fp32 (_impl: simd chooses the AVX2
 * form, which gives the same bits; the plain call takes it where the CPU has AVX2) */
void kd_cpu_weight_row(const kd_weight *w, int64_t r, int64_t c0, int64_t n, float *dst);
void kd_cpu_weight_row_impl(const kd_weight *w, int64_t r, int64_t c0, int64_t n, float *dst, bool simd);
kd_status kd_cpu_check_weight(const char *op, const kd_weight *w);

/* dot product with a fixed summation order (8 partial sums), so a result never
 * depends on how many rows share a call: the CPU backend is batch-invariant. */
static inline float kd_dot(const float *a, const float *b, int n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* out[t, :] = x[t, :] W^T for fp32 rows: x [T, k] (ld ldx), W = weight rows [wrow0, wrow0+nout)
 * over its columns [wcol0, wcol0+k), out [T, nout] (ld ldo). Decodes each weight row once.
 * _impl: simd chooses the AVX2 forms (the same bits); the plain call takes them where it can. */
kd_status kd_cpu_matmul_wt(kd_backend *be, const float *x, int T, int ldx, int k, const kd_weight *w,
                           int64_t wrow0, int64_t wcol0, int nout, float *out, int ldo);
kd_status kd_cpu_matmul_wt_impl(kd_backend *be, const float *x, int T, int ldx, int k, const kd_weight *w,
                                int64_t wrow0, int64_t wcol0, int nout, float *out, int ldo, bool simd);

/* AVX2 forms of the loops above (cpu_avx2.c), bit for bit the same results; kd_cpu_has_avx2:
 * whether this CPU runs them (false where they are not built: KD_CPU_AVX2 0) */
bool kd_cpu_has_avx2(void);
#if defined(__x86_64__) && defined(__GNUC__)
#define KD_CPU_AVX2 1
/* out[t * ldo + j] = kd_dot(x row t, wr row j, k) for t < T, j < nb (wr: nb decoded rows of k) */
void kd_cpu_dots_avx2(const float *x, int T, int ldx, const float *wr, int nb, int k, float *out, int ldo);
float kd_cpu_dot_bf16_avx2(const float *x, const uint16_t *p, int n);
float kd_cpu_dot_int4_avx2(const float *x, const uint32_t *words, const uint16_t *scales, int group, int n);
void kd_cpu_decode_bf16_avx2(const uint16_t *p, int64_t n, float *dst);
/* whole groups of g columns from c0 (c0 and n multiples of g, g of 8) */
void kd_cpu_decode_int4_avx2(const uint32_t *words, const uint16_t *scales, int64_t g, int64_t c0, int64_t n,
                             float *dst);
#else
#define KD_CPU_AVX2 0
#endif

/* the ops (backend.h's KD_BACKEND_OPS), one family per file: cpu_elementwise.c (data movement,
 * norms, RoPE, the vocabulary reductions), cpu_matmul.c, cpu_attention.c, cpu_moe.c, cpu_ddtree.c */
#define KD_CPU_OP_DECL(name, params, args) kd_status kd_cpu_##name params;
KD_BACKEND_OPS(KD_CPU_OP_DECL)
#undef KD_CPU_OP_DECL
#endif
