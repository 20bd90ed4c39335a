/* cpu_backend.c: the CPU backend's table, memory, weights and shared helpers.
 *
 * Memory is host memory; upload/download are memcpy; every op runs synchronously.
 * weight_load keeps the mapped checkpoint bytes (w->src) as they are: weights are
 * decoded to fp32 one row at a time when an op reads them (kd_cpu_weight_row).
 * mem_usage tallies what the CUDA backend's does: the bytes of the loaded weights (here the
 * bytes the kernels read), alloc() buffers not yet freed, and the two work buffers. */
#include "cpu.h"
#include <stddef.h>
#include <stdlib.h>

/* two growable buffers: `work` for an op's own temporaries, `wrow` for the decoded
 * weight rows of kd_cpu_matmul_wt (an op holding `work` may call the matmul); the tallies
 * of mem_usage. */
typedef struct kd_cpu_impl {
    kd_cpu pub;
    float *wrow;
    size_t wrow_floats;
    uint64_t bytes_weights, bytes_alloc;
} kd_cpu_impl;

static kd_status grow(float **buf, size_t *have, size_t n, const char *what) {
    if (n <= *have) return KD_OK;
    size_t want = n < 4096 ? 4096 : n;
    float *p = realloc(*buf, want * sizeof(float));
    if (!p) return kd_fail(KD_ERR_NOMEM, "cpu backend: %s: cannot allocate %zu bytes", what, want * sizeof(float));
    *buf = p;
    *have = want;
    return KD_OK;
}

kd_status kd_cpu_work(kd_backend *be, size_t n, float **out) {
    kd_cpu_impl *c = be->impl;
    KD_TRY(grow(&c->pub.work, &c->pub.work_floats, n, "work buffer"));
    *out = c->pub.work;
    return KD_OK;
}

static kd_status wrow_buf(kd_backend *be, size_t n, float **out) {
    kd_cpu_impl *c = be->impl;
    KD_TRY(grow(&c->wrow, &c->wrow_floats, n, "weight row buffer"));
    *out = c->wrow;
    return KD_OK;
}

/* ---- half precision (IEEE binary16) ---- */
float kd_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) u = sign;
        else {                                   /* subnormal: renormalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            u = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
        }
    } else if (exp == 31) u = sign | 0x7f800000u | man << 13;
    else u = sign | (exp + 127 - 15) << 23 | man << 13;
    union { uint32_t u; float f; } v = { .u = u };
    return v.f;
}

uint16_t kd_f32_to_f16(float f) {
    union { uint32_t u; float f; } v = { .f = f };
    uint32_t sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);            /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);           /* overflow -> inf */
    if (a < 0x38800000u) {                                             /* subnormal or zero */
        if (a < 0x33000000u) return (uint16_t)sign;
        uint32_t man = (a & 0x7fffffu) | 0x800000u, shift = 126 - (a >> 23);
        uint32_t r = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a - 0x38000000u;                                      /* rebias 127 -> 15 */
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | r);
}

/* ---- checks ---- */
kd_status kd_cpu_check_f32(const char *op, const char *arg, kd_act a) {
    if (!a.data && a.rows > 0) return kd_fail(KD_ERR_ARG, "cpu %s: %s: NULL data", op, arg);
    if (a.dtype != KD_F32)
        return kd_fail(KD_ERR_ARG, "cpu %s: %s: expected f32 activations, got %s", op, arg, kd_dtype_name(a.dtype));
    if (a.rows < 0 || a.cols < 0 || (a.rows > 1 && a.ld < a.cols))
        return kd_fail(KD_ERR_ARG, "cpu %s: %s: bad view %d x %d (ld %d)", op, arg, a.rows, a.cols, a.ld);
    return KD_OK;
}

kd_status kd_cpu_check_shape(const char *op, const char *arg, kd_act a, int rows, int cols) {
    if (a.rows != rows || a.cols != cols)
        return kd_fail(KD_ERR_ARG, "cpu %s: %s: expected %d x %d, got %d x %d", op, arg, rows, cols, a.rows, a.cols);
    return KD_OK;
}

kd_status kd_cpu_check_weight(const char *op, const kd_weight *w) {
    const char *name = w && w->name ? w->name : "(unnamed)";
    if (!w || !w->src) return kd_fail(KD_ERR_ARG, "cpu %s: weight '%s' has no data", op, name);
    if (w->format == KD_W_INT4) {
        if (!w->src_scale) return kd_fail(KD_ERR_ARG, "cpu %s: INT4 weight '%s' has no scales", op, name);
        if (w->group <= 0 || w->cols % 8 || w->cols % w->group)
            return kd_fail(KD_ERR_ARG, "cpu %s: INT4 weight '%s': group %d and 8 must divide cols %lld",
                           op, name, w->group, (long long)w->cols);
    } else if (w->format != KD_W_BF16 && w->format != KD_W_F32)
        return kd_fail(KD_ERR_ARG, "cpu %s: weight '%s': unknown format %d", op, name, (int)w->format);
    return KD_OK;
}

/* ---- weight decoding ---- */
void kd_cpu_weight_row(const kd_weight *w, int64_t r, int64_t c0, int64_t n, float *dst) {
    kd_cpu_weight_row_impl(w, r, c0, n, dst, kd_cpu_has_avx2());
}

void kd_cpu_weight_row_impl(const kd_weight *w, int64_t r, int64_t c0, int64_t n, float *dst, bool simd) {
    switch (w->format) {
    case KD_W_BF16: {
        const uint16_t *p = (const uint16_t *)w->src + r * kd_weight_ld(w) + c0;
#if KD_CPU_AVX2
        if (simd) {
            kd_cpu_decode_bf16_avx2(p, n, dst);
            break;
        }
#endif
        for (int64_t i = 0; i < n; i++) {           /* bf16 -> f32: the 16 bits on top */
            uint32_t u = (uint32_t)p[i] << 16;
            memcpy(&dst[i], &u, sizeof u);
        }
        break;
    }
    case KD_W_F32:
        memcpy(dst, (const float *)w->src + r * kd_weight_ld(w) + c0, (size_t)n * sizeof(float));
        break;
    case KD_W_INT4: {
        /* nibble i of int32 word j is element 8j+i (low nibble first), offset binary:
         * W[r, c] = ((word >> 4*(c%8)) & 15) - 8) * scale[r, c / group] */
        const uint32_t *words = (const uint32_t *)w->src + r * (kd_weight_ld(w) / 8);
        const uint16_t *scales = (const uint16_t *)w->src_scale + r * (kd_weight_ld(w) / w->group);
        int64_t g = w->group;
        if (c0 % g == 0 && n % g == 0) {            /* whole groups: one scale per run of g/8 words */
#if KD_CPU_AVX2
            if (simd && g % 8 == 0) {
                kd_cpu_decode_int4_avx2(words, scales, g, c0, n, dst);
                break;
            }
#endif
            for (int64_t c = c0; c < c0 + n; c += g) {
                float sc = kd_bf16_to_f32(scales[c / g]);
                for (int64_t j = c / 8; j < (c + g) / 8; j++) {
                    uint32_t word = words[j];
                    float *d = dst + (j * 8 - c0);
                    for (int i = 0; i < 8; i++) d[i] = (float)((int)((word >> (4 * i)) & 15u) - 8) * sc;
                }
            }
            break;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t c = c0 + i;
            uint32_t u = (words[c >> 3] >> (4 * (c & 7))) & 15u;
            dst[i] = (float)((int)u - 8) * kd_bf16_to_f32(scales[c / g]);
        }
        break;
    }
    }
}

/* Dot products straight from the stored weight row, for calls with one or two rows of x
 * (decode), where decoding the row into a buffer first would cost as much as the product.
 * Same partial sums in the same order as kd_dot over the decoded row, so the result is
 * bit-identical to the batched path: a token's output does not depend on T. */
static float dot_bf16(const float *x, const uint16_t *p, int n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += x[i + j] * kd_bf16_to_f32(p[i + j]);
    float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) t += x[i] * kd_bf16_to_f32(p[i]);
    return t;
}

/* a whole INT4 row (cols = n, a multiple of 8 and of the group) */
static float dot_int4(const float *x, const uint32_t *words, const uint16_t *scales, int group, int n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int c = 0; c < n; c += group) {
        float sc = kd_bf16_to_f32(scales[c / group]);
        for (int i = c; i < c + group; i += 8) {
            uint32_t word = words[i / 8];
            for (int j = 0; j < 8; j++) s[j] += x[i + j] * ((float)((int)((word >> (4 * j)) & 15u) - 8) * sc);
        }
    }
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

kd_status kd_cpu_matmul_wt(kd_backend *be, const float *x, int T, int ldx, int k, const kd_weight *w,
                           int64_t wrow0, int64_t wcol0, int nout, float *out, int ldo) {
    return kd_cpu_matmul_wt_impl(be, x, T, ldx, k, w, wrow0, wcol0, nout, out, ldo, kd_cpu_has_avx2());
}

kd_status kd_cpu_matmul_wt_impl(kd_backend *be, const float *x, int T, int ldx, int k, const kd_weight *w,
                                int64_t wrow0, int64_t wcol0, int nout, float *out, int ldo, bool simd) {
    if (T <= 2 && w->format == KD_W_BF16) {
        for (int o = 0; o < nout; o++) {
            const uint16_t *p = (const uint16_t *)w->src + (wrow0 + o) * kd_weight_ld(w) + wcol0;
            for (int t = 0; t < T; t++) {
                const float *xt = x + (size_t)t * ldx;
#if KD_CPU_AVX2
                if (simd) {
                    out[(size_t)t * ldo + o] = kd_cpu_dot_bf16_avx2(xt, p, k);
                    continue;
                }
#endif
                out[(size_t)t * ldo + o] = dot_bf16(xt, p, k);
            }
        }
        return KD_OK;
    }
    if (T <= 2 && w->format == KD_W_INT4 && wcol0 == 0 && k == w->cols && w->group % 8 == 0) {
        int64_t wpr = kd_weight_ld(w) / 8, spr = kd_weight_ld(w) / w->group;
        for (int o = 0; o < nout; o++) {
            const uint32_t *words = (const uint32_t *)w->src + (wrow0 + o) * wpr;
            const uint16_t *scales = (const uint16_t *)w->src_scale + (wrow0 + o) * spr;
            for (int t = 0; t < T; t++) {
                const float *xt = x + (size_t)t * ldx;
#if KD_CPU_AVX2
                if (simd) {
                    out[(size_t)t * ldo + o] = kd_cpu_dot_int4_avx2(xt, words, scales, w->group, k);
                    continue;
                }
#endif
                out[(size_t)t * ldo + o] = dot_int4(xt, words, scales, w->group, k);
            }
        }
        return KD_OK;
    }
    enum { BLOCK = 8 };          /* weight rows decoded at once: x rows stay in cache across them */
    float *wr;
    KD_TRY(wrow_buf(be, (size_t)BLOCK * k, &wr));
    for (int o0 = 0; o0 < nout; o0 += BLOCK) {
        int nb = nout - o0 < BLOCK ? nout - o0 : BLOCK;
        for (int j = 0; j < nb; j++) kd_cpu_weight_row_impl(w, wrow0 + o0 + j, wcol0, k, wr + (size_t)j * k, simd);
#if KD_CPU_AVX2
        if (simd) {
            kd_cpu_dots_avx2(x, T, ldx, wr, nb, k, out + o0, ldo);
            continue;
        }
#endif
        for (int t = 0; t < T; t++) {
            const float *xt = x + (size_t)t * ldx;
            float *ot = out + (size_t)t * ldo + o0;
            for (int j = 0; j < nb; j++) ot[j] = kd_dot(xt, wr + (size_t)j * k, k);
        }
    }
    return KD_OK;
}

/* ---- memory ---- */
static void cpu_destroy(kd_backend *be) {
    if (!be) return;
    kd_cpu_impl *c = be->impl;
    if (c) { free(c->pub.work); free(c->wrow); free(c); }
    free(be);
}

/* an alloc() buffer starts ALLOC_HEADER bytes into its block, after its size, so that free()
 * can take it off the tally; max_align_t's alignment keeps the buffer as aligned as calloc's
 * block */
enum { ALLOC_HEADER = _Alignof(max_align_t) };
_Static_assert(ALLOC_HEADER >= sizeof(size_t), "the header holds the buffer's size");
static kd_status cpu_alloc(kd_backend *be, size_t bytes, void **ptr) {
    kd_cpu_impl *c = be->impl;
    unsigned char *block = bytes <= SIZE_MAX - ALLOC_HEADER ? calloc(1, ALLOC_HEADER + (bytes ? bytes : 1)) : NULL;
    if (!block) {
        *ptr = NULL;
        return kd_fail(KD_ERR_NOMEM, "cpu backend: cannot allocate %zu bytes", bytes);
    }
    memcpy(block, &bytes, sizeof bytes);
    c->bytes_alloc += bytes;
    *ptr = block + ALLOC_HEADER;
    return KD_OK;
}
static void cpu_free(kd_backend *be, void *ptr) {
    if (!ptr) return;
    kd_cpu_impl *c = be->impl;
    unsigned char *block = (unsigned char *)ptr - ALLOC_HEADER;
    size_t bytes;
    memcpy(&bytes, block, sizeof bytes);
    c->bytes_alloc -= bytes;
    free(block);
}
static void cpu_mem_usage(kd_backend *be, kd_mem_usage *out) {
    const kd_cpu_impl *c = be->impl;
    memset(out, 0, sizeof *out);
    out->weights = c->bytes_weights;
    out->buffers = c->bytes_alloc;
    out->workspace = (uint64_t)(c->pub.work_floats + c->wrow_floats) * sizeof(float);
}
static kd_status cpu_memcpy(kd_backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes) memmove(dst, src, bytes);
    return KD_OK;
}
static kd_status cpu_sync(kd_backend *be) { return KD_OK; }

static kd_status cpu_weight_load(kd_backend *be, kd_weight *w) {
    KD_TRY(kd_cpu_check_weight("weight_load", w));
    w->dev = (void *)w->src;           /* no copy: the mapping is the CPU's form */
    w->dev_scale = (void *)w->src_scale;
    ((kd_cpu_impl *)be->impl)->bytes_weights += kd_weight_held(w);
    return KD_OK;
}
static void cpu_weight_free(kd_backend *be, kd_weight *w) {
    if (!w) return;
    ((kd_cpu_impl *)be->impl)->bytes_weights -= kd_weight_held(w);   /* 0: never loaded, or freed already */
    w->dev = NULL;
    w->dev_scale = NULL;
}
static kd_status cpu_experts_load(kd_backend *be, kd_experts *e) {
    if (!e || !e->router || !e->gate || !e->up || !e->down || e->n <= 0)
        return kd_fail(KD_ERR_ARG, "cpu experts_load: incomplete expert table");
    e->table = NULL;
    return KD_OK;
}
static void cpu_experts_free(kd_backend *be, kd_experts *e) {}

static const kd_backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_memcpy,
    .download = cpu_memcpy,
    .sync = cpu_sync,
    .mem_usage = cpu_mem_usage,
    .weight_load = cpu_weight_load,
    .weight_free = cpu_weight_free,
    .experts_load = cpu_experts_load,
    .experts_free = cpu_experts_free,
#define KD_CPU_OP(name, params, args) .name = kd_cpu_##name,
    KD_BACKEND_OPS(KD_CPU_OP)
#undef KD_CPU_OP
};

kd_status kd_backend_cpu_create(kd_backend **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_backend_cpu_create: out is NULL");
    kd_backend *be = calloc(1, sizeof *be);
    kd_cpu_impl *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be); free(c);
        return kd_fail(KD_ERR_NOMEM, "kd_backend_cpu_create: out of memory");
    }
    be->ops = &cpu_ops;
    be->kind = KD_BACKEND_CPU;
    be->act_dtype = KD_F32;
    be->device = -1;
    be->impl = c;
    *out = be;
    return KD_OK;
}
