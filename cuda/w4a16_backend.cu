/* w4a16_backend.cu: the W4A16 kernels (w4a16.cu) as the CUDA backend calls them:
 * weight repack at load, linear on an INT4 weight, and the routed experts of a layer.
 *
 * Workspace: everything transient lives in the backend's KD_WS_W4A16 workspace (load-time
 * staging of the raw checkpoint bytes, f32 -> bf16 activation copies, the MoE's grouping
 * and expert activations). The GEMMs keep their split-K partials in shared memory. */
#include "cuda_internal.cuh"
#include <pthread.h>
#include <stdlib.h>

namespace {

size_t al256(size_t x) { return (x + 255) & ~(size_t)255; }

__global__ void to_bf16_kernel(const void *src, int sdt, long long lds, int rows, int cols, bf16 *dst, long long ldd) {
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / cols), c = (int)(i % cols);
        dst[(size_t)r * ldd + c] = __float2bfloat16_rn(kd_ld(src, sdt, (size_t)r * lds + c));
    }
}

/* the bytes of x's bf16 copy for the kernels, 0 when they stream x itself (bf16, 16-byte
 * aligned, ld % 8 == 0): the one test of whether a copy is needed */
size_t bf16_view_bytes(kd_act x) {
    if (x.dtype == KD_BF16 && ((uintptr_t)x.data & 15) == 0 && (x.ld & 7) == 0) return 0;
    return al256((size_t)x.rows * ((x.cols + 7) & ~7LL) * 2);
}

/* x as bf16 rows the kernels can stream: x itself, or a copy at the front of `scratch`, which
 * takes bf16_view_bytes(x) there */
kd_status bf16_view(kd_backend *be, kd_act x, void *scratch, const bf16 **out, long long *ld) {
    kd_cuda *c = kd_cuda_of(be);
    if (bf16_view_bytes(x) == 0) {
        *out = (const bf16 *)x.data;
        *ld = x.ld;
        return KD_OK;
    }
    long long ldd = (x.cols + 7) & ~7LL;
    bf16 *d = (bf16 *)scratch;
    size_t n = (size_t)x.rows * x.cols;
    int blocks = (int)((n + 255) / 256);
    if (blocks > c->n_sms * 16) blocks = c->n_sms * 16;
    if (blocks < 1) blocks = 1;
    to_bf16_kernel<<<blocks, 256, 0, c->stream>>>(x.data, x.dtype, x.ld, x.rows, x.cols, d, ldd);
    KD_CUDA_LAUNCH("to_bf16_kernel");
    *out = d;
    *ld = ldd;
    return KD_OK;
}

/* the device tables of the layers' experts, keyed by the kd_experts they belong to */
struct TableEntry {
    const kd_experts *key;
    kd_w4a16_expert *dev;
    int n;
};
pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
TableEntry *g_tables = NULL;
int g_n_tables = 0, g_cap_tables = 0;

kd_w4a16_expert *find_table(const kd_experts *e) {
    kd_w4a16_expert *r = NULL;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_n_tables; i++)
        if (g_tables[i].key == e) { r = g_tables[i].dev; break; }
    pthread_mutex_unlock(&g_lock);
    return r;
}

}  // namespace

extern "C" kd_status kd_cuda_w4a16_repack(kd_backend *be, kd_weight *w) {
    kd_cuda *c = kd_cuda_of(be);
    const char *name = w && w->name ? w->name : "(unnamed)";
    if (!w || !w->src || !w->src_scale)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 repack: weight '%s' has no codes or scales", name);
    if (w->rows > 0x7fffffff || w->cols > 0x7fffffff)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 repack: weight '%s' [%lld, %lld] is too large", name, (long long)w->rows,
                       (long long)w->cols);
    int n = (int)w->rows, k = (int)w->cols, g = w->group;
    KD_TRY(kd_w4a16_check(n, k, g, name));
    size_t raw_codes = (size_t)n * (k / 8) * 4, raw_scales = (size_t)n * (k / g) * 2;
    size_t codes = kd_w4a16_codes_bytes(n, k), scales = kd_w4a16_scales_bytes(n, k, g);
    void *stage;
    KD_TRY(kd_cuda_ws(be, KD_WS_W4A16, al256(raw_codes) + raw_scales, &stage));
    void *dev = NULL;
    cudaError_t e = cudaMalloc(&dev, al256(codes) + scales);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kd_fail(e == cudaErrorMemoryAllocation ? KD_ERR_NOMEM : KD_ERR_BACKEND,
                       "cuda: cannot allocate %zu bytes of device memory for INT4 weight '%s' (codes + scales) on device "
                       "%d: %s", al256(codes) + scales, name, be->device, cudaGetErrorString(e));
    }
    char *st = (char *)stage;
    /* a column slice (kd_weight.ld > cols) comes out of its rows in the mapping, packed */
    size_t ld = (size_t)kd_weight_ld(w);
    e = cudaMemcpy2DAsync(st, (size_t)(k / 8) * 4, w->src, ld / 8 * 4, (size_t)(k / 8) * 4, (size_t)n,
                          cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess)
        e = cudaMemcpy2DAsync(st + al256(raw_codes), (size_t)(k / g) * 2, w->src_scale, ld / (size_t)g * 2,
                              (size_t)(k / g) * 2, (size_t)n, cudaMemcpyHostToDevice, c->stream);
    if (e != cudaSuccess) {
        cudaFree(dev);
        return kd_cuda_fail(e, "cudaMemcpy2DAsync (INT4 weight staging)", __FILE__, __LINE__);
    }
    kd_status s = kd_w4a16_repack((const int32_t *)st, (const uint16_t *)(st + al256(raw_codes)), n, k, g, dev,
                                  (char *)dev + al256(codes), c->stream);
    if (s != KD_OK) {
        cudaFree(dev);
        return kd_fail_context(s, "weight '%s'", name);
    }
    /* the mapped source pages may be released by the caller after load: wait for the copies */
    e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaFree(dev);
        return kd_cuda_fail(e, "cudaStreamSynchronize (INT4 repack)", __FILE__, __LINE__);
    }
    w->dev = dev;
    w->dev_scale = (char *)dev + al256(codes);
    return KD_OK;
}

extern "C" kd_status kd_cuda_w4a16_linear(kd_backend *be, kd_act x, const kd_weight *w, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    const char *name = w && w->name ? w->name : "?";
    if (!w || !w->dev || !w->dev_scale)
        return kd_fail(KD_ERR_STATE, "cuda w4a16 linear: INT4 weight '%s' is not loaded", name);
    if (x.cols != w->cols || out.cols != w->rows || x.rows != out.rows)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 linear: weight '%s' [%lld, %lld]: x [%d, %d], out [%d, %d]", name,
                       (long long)w->rows, (long long)w->cols, x.rows, x.cols, out.rows, out.cols);
    if (out.dtype != KD_BF16 && out.dtype != KD_F32)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 linear '%s': out must be bf16 or f32, got %s", name,
                       kd_dtype_name(out.dtype));
    if (x.dtype != KD_BF16 && x.dtype != KD_F32)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 linear '%s': x must be bf16 or f32, got %s", name, kd_dtype_name(x.dtype));
    if (x.rows == 0) return KD_OK;
    int n = (int)w->rows, k = (int)w->cols, m = x.rows;
    void *ws = NULL;
    const size_t xb = bf16_view_bytes(x);
    if (xb) KD_TRY(kd_cuda_ws(be, KD_WS_W4A16, xb, &ws));
    const bf16 *xv;
    long long ldx;
    KD_TRY(bf16_view(be, x, ws, &xv, &ldx));
    kd_status s = kd_w4a16_gemm(w->dev, w->dev_scale, n, k, w->group, xv, ldx, m, out.data, out.ld,
                                out.dtype == KD_F32, 0, c->stream);
    if (s != KD_OK) return kd_fail_context(s, "linear '%s'", name);
    return KD_OK;
}

extern "C" kd_status kd_cuda_w4a16_experts_load(kd_backend *be, kd_experts *e) {
    (void)be;
    if (!e || e->n <= 0 || !e->gate || !e->up || !e->down)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 experts_load: incomplete expert table");
    const kd_weight *g0 = &e->gate[0], *d0 = &e->down[0];
    for (int i = 0; i < e->n; i++) {
        const kd_weight *ws[3] = {&e->gate[i], &e->up[i], &e->down[i]};
        for (int j = 0; j < 3; j++) {
            const kd_weight *w = ws[j];
            const kd_weight *ref = j < 2 ? g0 : d0;
            if (w->format != KD_W_INT4 || !w->dev || !w->dev_scale || w->rows != ref->rows || w->cols != ref->cols ||
                w->group != g0->group)
                return kd_fail(KD_ERR_ARG, "cuda w4a16 experts_load: expert %d weight '%s' [%lld, %lld] group %d "
                               "(loaded: %s) does not match '%s' [%lld, %lld] group %d", i, w->name ? w->name : "?",
                               (long long)w->rows, (long long)w->cols, w->group, w->dev ? "yes" : "no",
                               ref->name ? ref->name : "?", (long long)ref->rows, (long long)ref->cols, g0->group);
        }
    }
    if (d0->rows != g0->cols || d0->cols != g0->rows)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 experts_load: down '%s' is [%lld, %lld], gate '%s' is [%lld, %lld]",
                       d0->name ? d0->name : "?", (long long)d0->rows, (long long)d0->cols, g0->name ? g0->name : "?",
                       (long long)g0->rows, (long long)g0->cols);
    size_t bytes = (size_t)e->n * sizeof(kd_w4a16_expert);
    kd_w4a16_expert *host = (kd_w4a16_expert *)malloc(bytes);
    if (!host) return kd_fail(KD_ERR_NOMEM, "cuda w4a16 experts_load: out of host memory (%zu bytes)", bytes);
    for (int i = 0; i < e->n; i++) {
        host[i].gate_codes = e->gate[i].dev; host[i].gate_scales = e->gate[i].dev_scale;
        host[i].up_codes = e->up[i].dev;     host[i].up_scales = e->up[i].dev_scale;
        host[i].down_codes = e->down[i].dev; host[i].down_scales = e->down[i].dev_scale;
    }
    void *dev = NULL;
    cudaError_t err = cudaMalloc(&dev, bytes);
    if (err == cudaSuccess) err = cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice);
    free(host);
    if (err != cudaSuccess) {
        if (dev) cudaFree(dev);
        return kd_cuda_fail(err, "cudaMalloc/cudaMemcpy (INT4 expert table)", __FILE__, __LINE__);
    }
    pthread_mutex_lock(&g_lock);
    if (g_n_tables == g_cap_tables) {
        int cap = g_cap_tables ? 2 * g_cap_tables : 64;
        TableEntry *t = (TableEntry *)realloc(g_tables, (size_t)cap * sizeof *t);
        if (!t) {
            pthread_mutex_unlock(&g_lock);
            cudaFree(dev);
            return kd_fail(KD_ERR_NOMEM, "cuda w4a16 experts_load: out of host memory");
        }
        g_tables = t;
        g_cap_tables = cap;
    }
    g_tables[g_n_tables].key = e;
    g_tables[g_n_tables].dev = (kd_w4a16_expert *)dev;
    g_tables[g_n_tables].n = e->n;
    g_n_tables++;
    pthread_mutex_unlock(&g_lock);
    return KD_OK;
}

extern "C" void kd_cuda_w4a16_experts_free(kd_backend *be, kd_experts *e) {
    (void)be;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_n_tables; i++) {
        if (g_tables[i].key != e) continue;
        cudaFree(g_tables[i].dev);
        g_tables[i] = g_tables[--g_n_tables];
        break;
    }
    pthread_mutex_unlock(&g_lock);
}

extern "C" kd_status kd_cuda_w4a16_moe(kd_backend *be, kd_act x, const kd_experts *e, const int32_t *ids,
                                       const float *weights, kd_act shared, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    kd_w4a16_expert *table = e ? find_table(e) : NULL;
    if (!table)
        return kd_fail(KD_ERR_STATE, "cuda w4a16 moe: this layer's INT4 experts have no device table "
                       "(kd_cuda_w4a16_experts_load was not called)");
    const kd_weight *g0 = &e->gate[0];
    kd_w4a16_moe_shape s = {e->n, e->top_k, (int)g0->cols, (int)g0->rows, g0->group};
    if (x.cols != s.hidden || out.cols != s.hidden || out.rows != x.rows)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 moe: x [%d, %d], out [%d, %d]; the experts take %d wide rows", x.rows,
                       x.cols, out.rows, out.cols, s.hidden);
    if (out.dtype != KD_BF16 && out.dtype != KD_F32)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 moe: out must be bf16 or f32, got %s", kd_dtype_name(out.dtype));
    if (x.dtype != KD_BF16 && x.dtype != KD_F32)
        return kd_fail(KD_ERR_ARG, "cuda w4a16 moe: x must be bf16 or f32, got %s", kd_dtype_name(x.dtype));
    if (x.rows == 0) return KD_OK;
    size_t xb = bf16_view_bytes(x), mb = kd_w4a16_moe_ws_bytes(&s, x.rows);
    void *ws;
    KD_TRY(kd_cuda_ws(be, KD_WS_W4A16, xb + mb, &ws));   /* xb: a multiple of 256 */
    const bf16 *xv;
    long long ldx;
    KD_TRY(bf16_view(be, x, ws, &xv, &ldx));
    /* the shared expert's branch, if one is open, is joined right before the combine reads it */
    const bool join = shared.data && c->branch_open;
    kd_status st = kd_w4a16_moe(&s, table, xv, ldx, x.rows, ids, weights, shared.data, shared.ld,
                                join ? c->join_ev : NULL, out.data, out.ld, out.dtype == KD_F32, (char *)ws + xb, mb,
                                c->stream);
    if (st != KD_OK) return kd_fail_context(st, "moe");
    if (join) c->branch_open = false;
    return KD_OK;
}
