/* testing.c: the op test surface of kdtree_testing.h. Each entry point builds the op's
 * operands on the chosen backend from host arrays, runs the one op through the backend
 * table (exactly as the model code calls it), downloads the result as fp32 and frees
 * everything it made, also when the op fails. */
#include "kdtree_testing.h"
#include "backend.h"
#include "error.h"
#include "cpu/cpu.h"
#include "model.h"
#include "sample.h"
#include "sample_rule.h"
#include "comm.h"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

struct kd_test_backend {
    kd_backend *be;
};

/* every device buffer and weight one call made, freed together */
enum { ARENA_MAX = 64 };
typedef struct arena {
    kd_backend *be;
    void *ptr[ARENA_MAX];
    int n;
    kd_weight *w[ARENA_MAX];
    int nw;
} arena;

static void arena_free(arena *a) {
    for (int i = 0; i < a->nw; i++) a->be->ops->weight_free(a->be, a->w[i]);
    for (int i = 0; i < a->n; i++) a->be->ops->free(a->be, a->ptr[i]);
    a->n = a->nw = 0;
}

static kd_status dev_alloc(arena *a, size_t bytes, void **p) {
    if (a->n >= ARENA_MAX) return kd_fail(KD_ERR_ARG, "test surface: too many buffers in one call");
    KD_TRY(a->be->ops->alloc(a->be, bytes ? bytes : 16, p));
    a->ptr[a->n++] = *p;
    return KD_OK;
}

static kd_status dev_copy_in(arena *a, const void *host, size_t bytes, void **p) {
    KD_TRY(dev_alloc(a, bytes, p));
    if (bytes && host) KD_TRY(a->be->ops->upload(a->be, *p, host, bytes));
    return KD_OK;
}

static void host_convert(const float *src, void *dst, kd_dtype dt, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (dt == KD_F32) ((float *)dst)[i] = src[i];
        else if (dt == KD_BF16) ((uint16_t *)dst)[i] = kd_f32_to_bf16(src[i]);
        else ((uint16_t *)dst)[i] = kd_f32_to_f16(src[i]);
    }
}
static void host_unconvert(const void *src, float *dst, kd_dtype dt, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (dt == KD_F32) dst[i] = ((const float *)src)[i];
        else if (dt == KD_BF16) dst[i] = kd_bf16_to_f32(((const uint16_t *)src)[i]);
        else dst[i] = kd_f16_to_f32(((const uint16_t *)src)[i]);
    }
}

/* a dense [rows, cols] activation of dtype dt holding host (or zeros when host is NULL) */
static kd_status up_act(arena *a, const float *host, int rows, int cols, kd_dtype dt, kd_act *out) {
    size_t n = (size_t)rows * cols, es = kd_dtype_size(dt);
    void *p;
    KD_TRY(dev_alloc(a, n * es, &p));
    if (host && n) {
        void *tmp = malloc(n * es);
        if (!tmp) return kd_fail(KD_ERR_NOMEM, "test surface: cannot allocate %zu host bytes", n * es);
        host_convert(host, tmp, dt, n);
        kd_status st = a->be->ops->upload(a->be, p, tmp, n * es);
        free(tmp);
        KD_TRY(st);
    }
    *out = (kd_act){p, rows, cols, cols, dt};
    return KD_OK;
}

/* dense download of a view with ld == cols */
static kd_status down_act(arena *a, kd_act v, float *host) {
    size_t n = (size_t)v.rows * v.cols, es = kd_dtype_size(v.dtype);
    if (!n) return KD_OK;
    void *tmp = malloc(n * es);
    if (!tmp) return kd_fail(KD_ERR_NOMEM, "test surface: cannot allocate %zu host bytes", n * es);
    kd_status st = a->be->ops->download(a->be, tmp, v.data, n * es);
    if (st == KD_OK) host_unconvert(tmp, host, v.dtype, n);
    free(tmp);
    return st;
}

static kd_status up_weight(arena *a, const kd_test_weight *tw, const char *name, kd_weight *w) {
    if (!tw || !tw->data) return kd_fail(KD_ERR_ARG, "test surface: weight '%s' has no data", name);
    if (tw->format < 0 || tw->format > 2)
        return kd_fail(KD_ERR_ARG, "test surface: weight '%s': format %d (0 bf16, 1 f32, 2 int4)", name, tw->format);
    if (a->nw >= ARENA_MAX) return kd_fail(KD_ERR_ARG, "test surface: too many weights in one call");
    memset(w, 0, sizeof *w);
    w->name = name;
    w->format = tw->format == 0 ? KD_W_BF16 : tw->format == 1 ? KD_W_F32 : KD_W_INT4;
    w->rows = tw->rows;
    w->cols = tw->cols;
    w->group = tw->group;
    w->src = tw->data;
    w->src_scale = tw->scale;
    KD_TRY(a->be->ops->weight_load(a->be, w));
    a->w[a->nw++] = w;
    return KD_OK;
}

#define RUN(expr) do { st = (expr); if (st != KD_OK) goto done; } while (0)

kd_status kd_test_raw_backend_new(kd_backend_kind kind, int device, const kd_model_options *opt,
                                  struct kd_backend **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_test_raw_backend_new: out is NULL");
    *out = NULL;
    if (opt) KD_TRY(kd_model_options_check(opt));
    if (kind == KD_BACKEND_CPU) return kd_backend_cpu_create(out);
    if (kind != KD_BACKEND_CUDA) return kd_fail(KD_ERR_ARG, "kd_test_raw_backend_new: unknown backend kind %d", (int)kind);
#ifdef KD_WITH_CUDA
    return kd_backend_cuda_create(device, opt, out);
#else
    return kd_fail(KD_ERR_UNSUPPORTED, "kd_test_raw_backend_new: this build has no CUDA backend");
#endif
}

kd_status kd_test_backend_new(kd_backend_kind kind, int device, const kd_model_options *opt, kd_test_backend **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_test_backend_new: out is NULL");
    *out = NULL;
    kd_backend *be = NULL;
    KD_TRY(kd_test_raw_backend_new(kind, device, opt, &be));
    kd_test_backend *tb = calloc(1, sizeof *tb);
    if (!tb) {
        be->ops->destroy(be);
        return kd_fail(KD_ERR_NOMEM, "kd_test_backend_new: out of memory");
    }
    tb->be = be;
    *out = tb;
    return KD_OK;
}

void kd_test_backend_free(kd_test_backend *tb) {
    if (!tb) return;
    if (tb->be) tb->be->ops->destroy(tb->be);
    free(tb);
}

int kd_test_backend_act_bytes(const kd_test_backend *tb) { return tb ? (int)kd_dtype_size(tb->be->act_dtype) : 0; }

const char *kd_test_op_name(int i) {
#define OP_NAME(name, params, args) #name,
    static const char *const names[] = {KD_BACKEND_OPS(OP_NAME)};
#undef OP_NAME
    return i >= 0 && i < (int)(sizeof names / sizeof names[0]) ? names[i] : NULL;
}

void kd_test_round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = kd_bf16_to_f32(kd_f32_to_bf16(x[i]));
}
void kd_test_to_bf16(const float *x, uint16_t *bits, size_t n) {
    for (size_t i = 0; i < n; i++) bits[i] = kd_f32_to_bf16(x[i]);
}

static kd_status check_tb(const kd_test_backend *tb, const char *op) {
    if (!tb || !tb->be) return kd_fail(KD_ERR_ARG, "kd_test_%s: no backend", op);
    return KD_OK;
}

kd_status kd_test_copy(kd_test_backend *tb, const float *src, int rows, int cols, int dst_dtype, float *out) {
    KD_TRY(check_tb(tb, "copy"));
    kd_dtype dt = dst_dtype == 0 ? KD_F32 : dst_dtype == 1 ? KD_F16 : KD_BF16;
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act s, d, back;
    RUN(up_act(&a, src, rows, cols, KD_F32, &s));
    RUN(up_act(&a, NULL, rows, cols, dt, &d));
    RUN(up_act(&a, NULL, rows, cols, KD_F32, &back));
    RUN(be->ops->copy(be, d, s));
    RUN(be->ops->copy(be, back, d));
    RUN(down_act(&a, back, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_embed(kd_test_backend *tb, const kd_test_weight *table, const int32_t *ids, int n, float *out) {
    KD_TRY(check_tb(tb, "embed"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_weight w;
    kd_act o;
    void *d_ids;
    RUN(up_weight(&a, table, "test.embed", &w));
    RUN(dev_copy_in(&a, ids, sizeof(int32_t) * (size_t)n, &d_ids));
    RUN(up_act(&a, NULL, n, (int)table->cols, be->act_dtype, &o));
    RUN(be->ops->embed(be, &w, d_ids, o));
    RUN(down_act(&a, o, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_add(kd_test_backend *tb, const float *x, const float *y, int rows, int cols, float s, int use_scale,
                      float *out) {
    KD_TRY(check_tb(tb, "add"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act dx, dy;
    RUN(up_act(&a, x, rows, cols, be->act_dtype, &dx));
    RUN(up_act(&a, y, rows, cols, be->act_dtype, &dy));
    RUN(use_scale ? be->ops->scale_add(be, dx, dy, s) : be->ops->add(be, dx, dy));
    RUN(down_act(&a, dx, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_swiglu(kd_test_backend *tb, const float *gate, const float *up, int rows, int cols, float *out) {
    KD_TRY(check_tb(tb, "swiglu"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act g, u, o;
    RUN(up_act(&a, gate, rows, cols, be->act_dtype, &g));
    RUN(up_act(&a, up, rows, cols, be->act_dtype, &u));
    RUN(up_act(&a, NULL, rows, cols, be->act_dtype, &o));
    RUN(be->ops->swiglu(be, g, u, o));
    RUN(down_act(&a, o, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_rmsnorm(kd_test_backend *tb, const float *x, int rows, int cols, const kd_test_weight *w, float eps,
                          float *out) {
    KD_TRY(check_tb(tb, "rmsnorm"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_weight dw;
    kd_act dx, o;
    RUN(up_weight(&a, w, "test.norm", &dw));
    RUN(up_act(&a, x, rows, cols, be->act_dtype, &dx));
    RUN(up_act(&a, NULL, rows, cols, be->act_dtype, &o));
    RUN(be->ops->rmsnorm(be, dx, &dw, eps, o));
    RUN(down_act(&a, o, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_add_rmsnorm(kd_test_backend *tb, const float *x, const float *y, int rows, int cols,
                              const kd_test_weight *w, float eps, float *x_out, float *out) {
    KD_TRY(check_tb(tb, "add_rmsnorm"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_weight dw;
    kd_act dx, dy, o;
    RUN(up_weight(&a, w, "test.norm", &dw));
    RUN(up_act(&a, x, rows, cols, be->act_dtype, &dx));
    RUN(up_act(&a, y, rows, cols, be->act_dtype, &dy));
    RUN(up_act(&a, NULL, rows, cols, be->act_dtype, &o));
    RUN(be->ops->add_rmsnorm(be, dx, dy, &dw, eps, o));
    RUN(down_act(&a, dx, x_out));
    RUN(down_act(&a, o, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_rope(kd_test_backend *tb, const float *x, int rows, int cols, int n_heads, int head_stride,
                       int offset, const int32_t *pos, int dim, int interleaved, float attn_factor,
                       const float *inv_freq, float *out) {
    KD_TRY(check_tb(tb, "rope"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act dx;
    void *d_pos, *d_if;
    RUN(up_act(&a, x, rows, cols, be->act_dtype, &dx));
    RUN(dev_copy_in(&a, pos, sizeof(int32_t) * (size_t)rows, &d_pos));
    RUN(dev_copy_in(&a, inv_freq, sizeof(float) * (size_t)(dim > 0 ? dim / 2 : 0), &d_if));
    kd_rope r = {.dim = dim, .interleaved = interleaved != 0, .attn_factor = attn_factor, .inv_freq = d_if};
    RUN(be->ops->rope(be, dx, n_heads, head_stride, offset, d_pos, &r));
    RUN(down_act(&a, dx, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_mla_rope_store(kd_test_backend *tb, const float *q, int rows, int q_cols, int n_heads, float *qfull,
                                 int f_cols, const float *kva, int kv_cols, const kd_test_weight *w, float eps,
                                 const int32_t *pos, int dim, int interleaved, float attn_factor,
                                 const float *inv_freq, float *cache, int cache_rows, int row0, int dev_len) {
    KD_TRY(check_tb(tb, "mla_rope_store"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act dq, dqf, dkva, dc;
    kd_weight dw;
    void *d_pos, *d_if, *d_len = NULL;
    RUN(up_weight(&a, w, "test.kv_a_norm", &dw));
    RUN(up_act(&a, q, rows, q_cols, be->act_dtype, &dq));
    RUN(up_act(&a, qfull, rows, f_cols, be->act_dtype, &dqf));
    RUN(up_act(&a, kva, rows, kv_cols, be->act_dtype, &dkva));
    RUN(up_act(&a, cache, cache_rows, kv_cols, be->act_dtype, &dc));
    RUN(dev_copy_in(&a, pos, sizeof(int32_t) * (size_t)rows, &d_pos));
    RUN(dev_copy_in(&a, inv_freq, sizeof(float) * (size_t)(dim > 0 ? dim / 2 : 0), &d_if));
    if (dev_len >= 0) RUN(dev_copy_in(&a, &dev_len, sizeof(int32_t), &d_len));
    kd_rope r = {.dim = dim, .interleaved = interleaved != 0, .attn_factor = attn_factor, .inv_freq = d_if};
    RUN(be->ops->mla_rope_store(be, dq, dqf, n_heads, dkva, &dw, eps, d_pos, &r, dc, row0, d_len));
    RUN(down_act(&a, dqf, qfull));
    RUN(down_act(&a, dc, cache));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_gather_rows(kd_test_backend *tb, const float *src, int src_rows, int cols, const int32_t *idx, int n,
                              int inplace, int dst_row0, float *out) {
    KD_TRY(check_tb(tb, "gather_rows"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act s, d;
    void *d_idx;
    if (n < 0 || (inplace && (dst_row0 < 0 || dst_row0 + n > src_rows)))
        return kd_fail(KD_ERR_ARG, "kd_test_gather_rows: %d rows at %d do not fit %d rows", n, dst_row0, src_rows);
    RUN(up_act(&a, src, src_rows, cols, be->act_dtype, &s));
    RUN(dev_copy_in(&a, idx, sizeof(int32_t) * (size_t)n, &d_idx));
    if (inplace) {
        d = kd_act_rows(s, dst_row0, n);
        RUN(be->ops->gather_rows(be, d, s, d_idx, n));
        RUN(down_act(&a, s, out));
    } else {
        RUN(up_act(&a, NULL, n, cols, be->act_dtype, &d));
        RUN(be->ops->gather_rows(be, d, s, d_idx, n));
        RUN(down_act(&a, d, out));
    }
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_move_rows(kd_test_backend *tb, const float *src, int n_caches, int rows, int cols, int src0,
                            const int32_t *idx, int n, int dst0, float *out) {
    KD_TRY(check_tb(tb, "move_rows"));
    if (n_caches <= 0 || n_caches > 256 || n < 0 || !src || !out || (n > 0 && !idx))
        return kd_fail(KD_ERR_ARG, "kd_test_move_rows: %d caches (1..256), %d rows, src / idx / out given", n_caches, n);
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act all, caches[256];   /* the caches one after another in one buffer */
    void *d_idx = NULL;
    RUN(up_act(&a, src, n_caches * rows, cols, be->act_dtype, &all));
    for (int l = 0; l < n_caches; l++) caches[l] = kd_act_rows(all, l * rows, rows);
    if (n > 0) RUN(dev_copy_in(&a, idx, sizeof(int32_t) * (size_t)n, &d_idx));
    RUN(be->ops->move_rows(be, caches, n_caches, src0, (const int32_t *)d_idx, n, dst0));
    RUN(down_act(&a, all, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_linear(kd_test_backend *tb, const float *x, int M, const kd_test_weight *w, int out_f32, float *out) {
    KD_TRY(check_tb(tb, "linear"));
    if (!w) return kd_fail(KD_ERR_ARG, "kd_test_linear: weight is NULL");
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_weight dw;
    kd_act dx, o;
    RUN(up_weight(&a, w, "test.linear", &dw));
    RUN(up_act(&a, x, M, (int)w->cols, be->act_dtype, &dx));
    RUN(up_act(&a, NULL, M, (int)w->rows, out_f32 ? KD_F32 : be->act_dtype, &o));
    RUN(be->ops->linear(be, dx, &dw, o));
    RUN(down_act(&a, o, out));
done:
    arena_free(&a);
    return st;
}

/* the two-weight products: linear_pair (out [M, w0.rows + w1.rows]) or linear_swiglu (w0 the gate,
 * w1 the up weight; out [M, w0.rows]) */
static kd_status weight_pair_op(kd_test_backend *tb, const char *what, bool swiglu, const float *x, int M,
                                const kd_test_weight *w0, const kd_test_weight *w1, int out_f32, float *out) {
    KD_TRY(check_tb(tb, what));
    if (!w0 || !w1) return kd_fail(KD_ERR_ARG, "kd_test_%s: a weight is NULL", what);
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_weight d0, d1;
    kd_act dx, o;
    RUN(up_weight(&a, w0, "test.gate", &d0));
    RUN(up_weight(&a, w1, "test.up", &d1));
    RUN(up_act(&a, x, M, (int)w0->cols, be->act_dtype, &dx));
    RUN(up_act(&a, NULL, M, (int)(swiglu ? w0->rows : w0->rows + w1->rows), out_f32 ? KD_F32 : be->act_dtype, &o));
    RUN(swiglu ? be->ops->linear_swiglu(be, dx, &d0, &d1, o) : be->ops->linear_pair(be, dx, &d0, &d1, o));
    RUN(down_act(&a, o, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_linear_pair(kd_test_backend *tb, const float *x, int M, const kd_test_weight *w0,
                              const kd_test_weight *w1, int out_f32, float *out) {
    return weight_pair_op(tb, "linear_pair", false, x, M, w0, w1, out_f32, out);
}

kd_status kd_test_linear_swiglu(kd_test_backend *tb, const float *x, int M, const kd_test_weight *gate,
                                const kd_test_weight *up, int out_f32, float *out) {
    return weight_pair_op(tb, "linear_swiglu", true, x, M, gate, up, out_f32, out);
}

static kd_status cpu_forms(const float *x, int T, const kd_test_weight *tw, float *out_c, float *out_simd) {
    if (!tw || !out_c || !out_simd || (x && T <= 0))
        return kd_fail(KD_ERR_ARG, "kd_test_cpu_*_forms: a NULL argument or T = %d", T);
    if (!kd_cpu_has_avx2()) return kd_fail(KD_ERR_UNSUPPORTED, "kd_test_cpu_*_forms: this CPU or build has no AVX2");
    kd_backend *be;
    KD_TRY(kd_backend_cpu_create(&be));
    arena a = {.be = be};
    kd_status st;
    kd_weight w;
    RUN(up_weight(&a, tw, "test.cpu_forms", &w));
    for (int simd = 0; simd < 2; simd++) {
        float *out = simd ? out_simd : out_c;
        if (x) RUN(kd_cpu_matmul_wt_impl(be, x, T, (int)w.cols, (int)w.cols, &w, 0, 0, (int)w.rows, out, (int)w.rows,
                                         simd));
        else
            for (int64_t r = 0; r < w.rows; r++) kd_cpu_weight_row_impl(&w, r, 0, w.cols, out + r * w.cols, simd);
    }
done:
    arena_free(&a);
    be->ops->destroy(be);
    return st;
}

kd_status kd_test_cpu_matmul_forms(const float *x, int T, const kd_test_weight *w, float *out_c, float *out_simd) {
    if (!x) return kd_fail(KD_ERR_ARG, "kd_test_cpu_matmul_forms: x is NULL");
    return cpu_forms(x, T, w, out_c, out_simd);
}

kd_status kd_test_cpu_decode_forms(const kd_test_weight *w, float *out_c, float *out_simd) {
    return cpu_forms(NULL, 0, w, out_c, out_simd);
}

kd_status kd_test_head_matmul(kd_test_backend *tb, const float *x, int rows, int xcols, int n_heads, int xstride,
                              int k, const kd_test_weight *w, int wstride, int wrow0, int transposed, int ocols,
                              int ostride, int out_cols, float *out) {
    KD_TRY(check_tb(tb, "head_matmul"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_weight dw;
    kd_act dx, o;
    RUN(up_weight(&a, w, "test.head_matmul", &dw));
    RUN(up_act(&a, x, rows, xcols, be->act_dtype, &dx));
    RUN(up_act(&a, NULL, rows, out_cols, be->act_dtype, &o));
    RUN(be->ops->head_matmul(be, dx, n_heads, xstride, k, &dw, wstride, wrow0, transposed != 0, o, ocols, ostride));
    RUN(down_act(&a, o, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_attention(kd_test_backend *tb, const float *q, int T, int q_cols, int n_heads, int head_dim,
                            const float *k, int S, int k_cols, const float *v, int v_cols, int v_from_k,
                            int n_kv_heads, int past, int causal, const uint64_t *visible, int window, float scale,
                            int out_cols, float *out) {
    KD_TRY(check_tb(tb, "attention"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act dq, dk, dv, o;
    void *d_vis = NULL;
    if (v_from_k && v_cols > k_cols)
        return kd_fail(KD_ERR_ARG, "kd_test_attention: value view of %d cols inside %d key cols", v_cols, k_cols);
    RUN(up_act(&a, q, T, q_cols, be->act_dtype, &dq));
    RUN(up_act(&a, k, S, k_cols, be->act_dtype, &dk));
    if (v_from_k) {
        dv = kd_act_cols(dk, 0, v_cols);
    } else {
        RUN(up_act(&a, v, S, v_cols, be->act_dtype, &dv));
    }
    if (visible) RUN(dev_copy_in(&a, visible, sizeof(uint64_t) * (size_t)T * (size_t)((T + 63) / 64), &d_vis));
    RUN(up_act(&a, NULL, T, out_cols, be->act_dtype, &o));
    RUN(be->ops->attention(be, dq, n_heads, head_dim, dk, dv, n_kv_heads, past, causal != 0, d_vis, window, scale, o));
    RUN(down_act(&a, o, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_moe(kd_test_backend *tb, const float *x, int T, int H, int n, int top_k, int n_group,
                      int topk_group, int norm_topk_prob, float routed_scaling_factor, const kd_test_weight *router,
                      const float *bias, const kd_test_weight *gate, const kd_test_weight *up,
                      const kd_test_weight *down, const float *shared, float *out) {
    KD_TRY(check_tb(tb, "moe"));
    if (n <= 0 || !gate || !up || !down || !router)
        return kd_fail(KD_ERR_ARG, "kd_test_moe: %d experts, weights missing", n);
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_weight rw;
    kd_weight *ws = calloc((size_t)3 * n, sizeof *ws);
    kd_experts e;
    memset(&e, 0, sizeof e);
    bool loaded = false;
    kd_act dx, o, sh = {0};
    void *d_bias = NULL;
    int nw = 0;
    if (!ws) return kd_fail(KD_ERR_NOMEM, "kd_test_moe: out of memory");
    RUN(up_weight(&a, router, "test.router", &rw));
    if (bias) RUN(dev_copy_in(&a, bias, sizeof(float) * (size_t)n, &d_bias));
    /* expert weights: loaded here and freed at the end (the arena holds at most 64) */
    for (int i = 0; i < n; i++) {
        const kd_test_weight *src[3] = {&gate[i], &up[i], &down[i]};
        static const char *names[3] = {"test.expert.gate", "test.expert.up", "test.expert.down"};
        for (int j = 0; j < 3; j++) {
            kd_weight *w = &ws[j * n + i];
            memset(w, 0, sizeof *w);
            w->name = names[j];
            w->format = src[j]->format == 0 ? KD_W_BF16 : src[j]->format == 1 ? KD_W_F32 : KD_W_INT4;
            w->rows = src[j]->rows;
            w->cols = src[j]->cols;
            w->group = src[j]->group;
            w->src = src[j]->data;
            w->src_scale = src[j]->scale;
            RUN(be->ops->weight_load(be, w));
            nw = j * n + i + 1 > nw ? j * n + i + 1 : nw;
        }
    }
    e.n = n;
    e.top_k = top_k;
    e.n_group = n_group;
    e.topk_group = topk_group;
    e.norm_topk_prob = norm_topk_prob != 0;
    e.routed_scaling_factor = routed_scaling_factor;
    e.router = &rw;
    e.bias = d_bias;
    e.gate = ws;
    e.up = ws + n;
    e.down = ws + 2 * n;
    RUN(be->ops->experts_load(be, &e));
    loaded = true;
    RUN(up_act(&a, x, T, H, be->act_dtype, &dx));
    RUN(up_act(&a, NULL, T, H, be->act_dtype, &o));
    if (shared) RUN(up_act(&a, shared, T, H, be->act_dtype, &sh));
    RUN(be->ops->moe(be, dx, &e, sh, o));
    RUN(down_act(&a, o, out));
done:
    if (loaded) be->ops->experts_free(be, &e);
    for (int i = 0; i < 3 * n; i++)
        if (ws[i].dev) be->ops->weight_free(be, &ws[i]);
    (void)nw;
    free(ws);
    arena_free(&a);
    return st;
}

/* rows of fp32 values on the backend (f32 on every backend, as logits are) */
kd_status kd_test_log_softmax(kd_test_backend *tb, const float *x, int rows, int cols, float *out) {
    KD_TRY(check_tb(tb, "log_softmax"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act dx;
    RUN(up_act(&a, x, rows, cols, KD_F32, &dx));
    RUN(be->ops->log_softmax(be, dx));
    RUN(down_act(&a, dx, out));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_sample_shards(const float *row, int vocab, int n_shards, const kd_sampler *sp, int32_t position,
                                int32_t *dst) {
    if (!row || !dst || !sp || vocab <= 0 || n_shards < 1 || n_shards > KD_TP_MAX || vocab % n_shards)
        return kd_fail(KD_ERR_ARG, "kd_test_sample_shards: a row of %d in %d shards: expected 1..%d shards dividing it",
                       vocab, n_shards, KD_TP_MAX);
    if (kd_sampler_is_greedy(sp)) return kd_fail(KD_ERR_ARG, "kd_test_sample_shards: the sampler is greedy");
    KD_TRY(kd_sampler_check(sp, "kd_test_sample_shards"));
    kd_shard sh[KD_TP_MAX];
    int n = vocab / n_shards;
    for (int k = 0; k < n_shards; k++) sh[k] = (kd_shard){row + (size_t)k * n, n, k * n};
    uint64_t *q = malloc(sizeof(uint64_t) * (size_t)vocab);
    int32_t *a = malloc(sizeof(int32_t) * 2 * (size_t)vocab);
    kd_status st = q && a ? KD_OK : kd_fail(KD_ERR_NOMEM, "kd_test_sample_shards: out of memory");
    if (st == KD_OK) {
        int32_t code = kd_sample_shards_code(sh, n_shards, sp, position, q, a, dst);
        if (code) st = kd_sample_fail(code);
    }
    free(q);
    free(a);
    return st;
}

/* the rule's exp as sample_rule.h first wrote it: rint, ldexp, the product converted */
static uint64_t rule_mass_libm(float x, double T, double z) {
    const double a = (T == 1.0 ? (double)x : (double)x / T) - z;
    if (!(a >= -708.0)) return 0;
    const double k = rint(a * 0x1.71547652b82fep+0);
    double r = fma(-k, 0x1.62e42fee00000p-1, a);
    r = fma(-k, 0x1.a39ef35793c76p-33, r);
    static const double c[] = {0x1.6124613a86d09p-33, 0x1.1eed8eff8d898p-29, 0x1.ae64567f544e4p-26,
                               0x1.27e4fb7789f5cp-22, 0x1.71de3a556c734p-19, 0x1.a01a01a01a01ap-16,
                               0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10, 0x1.1111111111111p-7,
                               0x1.5555555555555p-5,  0x1.5555555555555p-3,  0.5, 1.0, 1.0};
    double p = c[0];
    for (int i = 1; i < 14; i++) p = fma(p, r, c[i]);
    return (uint64_t)(ldexp(p, (int)k) * 0x1p62);
}

long kd_test_rule_mass_mismatches(long n, uint64_t seed, long *checked) {
    static const double Ts[] = {1.0f, 0.8f, 0.7f, 1.3f, 0.01f, 100.0f};   /* temperatures are floats */
    long bad = 0, done = 0;
    uint64_t s = seed;
    for (long i = 0; i < n; i++) {
        s = kd_rule_mix64(s + (uint64_t)i);
        const double T = Ts[i % 6];
        const float m = (float)((int64_t)(s >> 20) % 4000) / 16.0f;
        float x = m - (float)((s >> 1) % 100000) / 1000.0f * (float)(1 + (s >> 50) % 20);
        if (i % 7 == 0) x = m - (float)(i % 1000) * 0x1p-20f;
        if (i % 11 == 0) {
            const uint32_t u = (uint32_t)(s >> 7);
            memcpy(&x, &u, 4);
            if (x != x || isinf(x) || x > m) x = m;
        }
        const kd_rule_row row = kd_rule_row_of(m, T);
        bad += row.z != (T == 1.0 ? (double)m : (double)m / T);
        bad += kd_rule_mass(x, row) != rule_mass_libm(x, T, row.z);
        done++;
    }
    for (double a = -708.5; a <= 0.0; a += 0x1p-12) {   /* x = 0, z = -a */
        const kd_rule_row row = {1.0, 1.0, -a};
        bad += kd_rule_mass(0.0f, row) != rule_mass_libm(0.0f, 1.0, -a);
        done++;
    }
    if (checked) *checked = done;
    return bad;
}

typedef struct comm_job {
    kd_comm *c;
    int rank, rows, cols, ld, fail_rank;
    float *bufs, *gathered;
    kd_status st, again;
    pthread_barrier_t *reset_point;
} comm_job;

static void *comm_rank(void *arg) {
    comm_job *j = arg;
    kd_act x = {j->bufs + (size_t)j->rank * j->rows * j->ld, j->rows, j->cols, j->ld, KD_F32};
    if (j->rank == j->fail_rank) {
        j->c->ops->abort(j->c);
        j->st = KD_ERR_BACKEND;
    } else {
        j->st = j->c->ops->all_reduce_sum(j->c, j->rank, NULL, x);
        if (j->st == KD_OK)
            j->st = j->c->ops->all_gather(j->c, j->rank, NULL, x.data, j->gathered + (size_t)j->rank * j->c->n_ranks * j->cols,
                                          sizeof(float) * (size_t)j->cols);
    }
    if (j->fail_rank < 0) return NULL;
    /* every rank is back: rank 0 resets, then all reduce again */
    pthread_barrier_wait(j->reset_point);
    if (j->rank == 0) j->c->ops->reset(j->c);
    pthread_barrier_wait(j->reset_point);
    j->again = j->c->ops->all_reduce_sum(j->c, j->rank, NULL, x);
    return NULL;
}

kd_status kd_test_comm_cpu(int n_ranks, int rows, int cols, int ld, float *bufs, float *gathered, int fail_rank,
                           int32_t *status) {
    if (n_ranks < 1 || n_ranks > KD_TP_MAX || rows < 1 || cols < 1 || ld < cols || !bufs || !gathered || !status ||
        fail_rank >= n_ranks)
        return kd_fail(KD_ERR_ARG, "kd_test_comm_cpu: %d ranks of %d x %d (ld %d), fail_rank %d", n_ranks, rows, cols,
                       ld, fail_rank);
    kd_comm *c;
    KD_TRY(kd_comm_cpu_create(n_ranks, &c));
    comm_job jobs[KD_TP_MAX];
    pthread_t th[KD_TP_MAX];
    pthread_barrier_t reset_point;
    pthread_barrier_init(&reset_point, NULL, (unsigned)n_ranks);
    int started = 0;
    for (int r = 0; r < n_ranks; r++) {
        jobs[r] = (comm_job){c, r, rows, cols, ld, fail_rank, bufs, gathered, KD_OK, KD_OK, &reset_point};
        if (pthread_create(&th[r], NULL, comm_rank, &jobs[r]) != 0) break;
        started++;
    }
    for (int r = 0; r < started; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&reset_point);
    c->ops->destroy(c);
    if (started < n_ranks) return kd_fail(KD_ERR_NOMEM, "kd_test_comm_cpu: cannot start %d threads", n_ranks);
    status[n_ranks] = 0;
    for (int r = 0; r < n_ranks; r++) {
        status[r] = (int32_t)jobs[r].st;
        if (!status[n_ranks]) status[n_ranks] = (int32_t)jobs[r].again;
    }
    return KD_OK;
}

kd_status kd_test_argmax(kd_test_backend *tb, const float *x, int rows, int cols, int32_t *out) {
    KD_TRY(check_tb(tb, "argmax"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act dx;
    void *d_out;
    RUN(up_act(&a, x, rows, cols, KD_F32, &dx));
    RUN(dev_alloc(&a, sizeof(int32_t) * (size_t)rows, &d_out));
    RUN(be->ops->argmax(be, dx, d_out));
    RUN(be->ops->download(be, out, d_out, sizeof(int32_t) * (size_t)rows));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_topk(kd_test_backend *tb, const float *x, int rows, int cols, int k, float *vals, int32_t *ids) {
    KD_TRY(check_tb(tb, "topk"));
    kd_backend *be = tb->be;
    arena a = {.be = be};
    kd_status st;
    kd_act dx;
    void *d_v, *d_i;
    RUN(up_act(&a, x, rows, cols, KD_F32, &dx));
    RUN(dev_alloc(&a, sizeof(float) * (size_t)rows * (k > 0 ? k : 1), &d_v));
    RUN(dev_alloc(&a, sizeof(int32_t) * (size_t)rows * (k > 0 ? k : 1), &d_i));
    RUN(be->ops->topk(be, dx, k, d_v, d_i));
    RUN(be->ops->download(be, vals, d_v, sizeof(float) * (size_t)rows * k));
    RUN(be->ops->download(be, ids, d_i, sizeof(int32_t) * (size_t)rows * k));
done:
    arena_free(&a);
    return st;
}

kd_status kd_test_rope_inv_freq(const char *dir, int dim, float *inv_freq) {
    if (!dir || !inv_freq) return kd_fail(KD_ERR_ARG, "kd_test_rope_inv_freq: dir and inv_freq must not be NULL");
    kd_config cfg;
    KD_TRY(kd_config_load(dir, &cfg));
    kd_rope_inv_freq(&cfg, dim, inv_freq);
    kd_config_free(&cfg);
    return KD_OK;
}
