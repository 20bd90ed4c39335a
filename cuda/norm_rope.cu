/* norm_rope.cu: the CUDA backend's row-wise ops: copy/convert, embedding lookup,
 * residual adds, SwiGLU, RMSNorm, RoPE (interleaved and rotate-half), row gathers.
 * Math in fp32, stored in the destination's dtype (bf16 activations on this backend).
 * Each row is computed the same way whatever the row count (RMSNorm's sum of squares
 * uses a block layout fixed by the row width), so all of these are batch-invariant. */
#include "cuda_internal.cuh"

namespace {

constexpr int EW_THREADS = 256;

static int ew_blocks(const kd_cuda *c, size_t n) {
    size_t b = (n + EW_THREADS - 1) / EW_THREADS;
    size_t cap = (size_t)c->n_sms * 16;
    if (b > cap) b = cap;
    return b < 1 ? 1 : (int)b;
}

__global__ void convert_kernel(void *dst, int ddt, long long ldd, const void *src, int sdt, long long lds,
                               int rows, int cols) {
    kd_griddep_enter();
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / cols), c = (int)(i % cols);
        kd_st(dst, ddt, (size_t)r * ldd + c, kd_ld(src, sdt, (size_t)r * lds + c));
    }
}

/* same-dtype rows, in units U (16, 8, 4 or 2 bytes: the widest that every row start and the row
 * width allow). A kernel rather than cudaMemcpy2DAsync: in a step graph a memcpy node ends the
 * chain of programmatic dependent launches (the kernel after it cannot start early) */
template <typename U>
__global__ void copy_rows_kernel(U *dst, long long ldd, const U *src, long long lds, int rows, int cols) {
    kd_griddep_enter();
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / cols), c = (int)(i % cols);
        dst[(size_t)r * ldd + c] = src[(size_t)r * lds + c];
    }
}

__global__ void embed_kernel(const void *table, int tdt, long long V, int H, const int32_t *ids,
                             void *out, int odt, long long ldo, int rows) {
    kd_griddep_enter();
    size_t n = (size_t)rows * H;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / H), c = (int)(i % H);
        int id = ids[r];
        float v = (id >= 0 && id < V) ? kd_ld(table, tdt, (size_t)id * H + c) : 0.0f;
        kd_st(out, odt, (size_t)r * ldo + c, v);
    }
}

__global__ void scale_add_kernel(void *x, int xdt, long long ldx, const void *y, int ydt, long long ldy,
                                 float s, int rows, int cols) {
    kd_griddep_enter();
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / cols), c = (int)(i % cols);
        size_t xi = (size_t)r * ldx + c;
        float yv = kd_round(xdt, kd_ld(y, ydt, (size_t)r * ldy + c));   /* y as x's dtype holds it (backend.h) */
        kd_st(x, xdt, xi, kd_ld(x, xdt, xi) + (s == 1.0f ? yv : s * yv));
    }
}

__global__ void swiglu_kernel(const void *g, int gdt, long long ldg, const void *u, int udt, long long ldu,
                              void *o, int odt, long long ldo, int rows, int cols) {
    kd_griddep_enter();
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / cols), c = (int)(i % cols);
        float gv = kd_ld(g, gdt, (size_t)r * ldg + c), uv = kd_ld(u, udt, (size_t)r * ldu + c);
        kd_st(o, odt, (size_t)r * ldo + c, gv / (1.0f + expf(-gv)) * uv);
    }
}

/* The norms hold a row in registers: thread t of the NTH takes the columns t, t + NTH, t + 2 NTH,
 * ... in that order (the order of its partial sum of squares), COLS of them at most, all loaded at
 * once, so a pass waits on one memory latency; and a kernel requests the weight before its grid
 * dependency wait (no kernel of a step writes a weight), under the previous kernel's tail. NTH and
 * COLS are compile-time, so a column's load is one instruction at an immediate offset from the
 * thread's first, and a piece branches on the dtype once, not per column. ncu, H100: one 7168-row
 * add_rmsnorm of a TP-8 rank's decode step took 12.9 us with runtime block sizes and per-column
 * dtype branches, each warp issuing one instruction every 8.5 cycles through some 1800. Rows wider
 * than COLS x NTH go in pieces of that, x and w re-read for the scaling. Every sum is in the same
 * order, so the bits do not depend on how the row is held. */
struct NormShape {
    int threads, cols;
};
/* from the width alone (the order of a row's sums): 1024 threads of 8 columns for 2049..8192
 * columns (a hidden row: 256 threads of 32 took 10 us under ncu in a TP-8 rank's decode step,
 * one SM's warps each walking 96 loads and their sums), 256 from 1024, else 128, 64 or 32; 8
 * columns a thread where that holds the row, else 32 (in pieces past 8192) */
static inline NormShape norm_shape(long long d) {
    if (d > 2048 && d <= 8192) return {1024, 8};
    const int nth = d >= 1024 ? 256 : d >= 256 ? 128 : d >= 64 ? 64 : 32;
    return {nth, d <= 8LL * nth ? 8 : 32};
}
/* the instance of norm kernel K (template <int NTH, int COLS>) for shape s */
#define NORM_KERNEL(K, s)                                                                              \
    ((s).threads == 32 ? K<32, 8> : (s).threads == 64 ? K<64, 8> : (s).threads == 128 ? K<128, 8> \
     : (s).threads == 1024 ? K<1024, 8> : (s).cols == 8 ? K<256, 8> : K<256, 32>)

template <typename T> __device__ __forceinline__ float to_f32(T v) { return (float)v; }
template <> __device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ void from_f32(float v, float *d) { *d = v; }
__device__ __forceinline__ void from_f32(float v, bf16 *d) { *d = __float2bfloat16(v); }
__device__ __forceinline__ void from_f32(float v, __half *d) { *d = __float2half(v); }
template <int DT> struct DtypeOf { typedef bf16 T; };
template <> struct DtypeOf<KD_F32> { typedef float T; };
template <> struct DtypeOf<KD_F16> { typedef __half T; };

template <int NTH, int COLS, int DT>
__device__ __forceinline__ void piece_load(const void *p, size_t b, int d, int c0, float (&v)[COLS]) {
    typedef typename DtypeOf<DT>::T T;
    const T *q = (const T *)p + b + c0 + threadIdx.x;
    const int left = d - c0 - (int)threadIdx.x;   /* column k is in when k NTH < left */
#pragma unroll
    for (int k = 0; k < COLS; k++) v[k] = k * NTH < left ? to_f32(q[k * NTH]) : 0.0f;
}
/* this thread's columns of the piece from column c0 of a row at p + b (d wide): zeros past d */
template <int NTH, int COLS>
__device__ __forceinline__ void row_piece(const void *p, int dt, size_t b, int d, int c0, float (&v)[COLS]) {
    if (dt == KD_BF16) piece_load<NTH, COLS, KD_BF16>(p, b, d, c0, v);
    else if (dt == KD_F32) piece_load<NTH, COLS, KD_F32>(p, b, d, c0, v);
    else piece_load<NTH, COLS, KD_F16>(p, b, d, c0, v);
}
template <int NTH, int COLS, int DT>
__device__ __forceinline__ void piece_store(void *p, size_t b, int d, int c0, const float (&v)[COLS]) {
    typedef typename DtypeOf<DT>::T T;
    T *q = (T *)p + b + c0 + threadIdx.x;
    const int left = d - c0 - (int)threadIdx.x;
#pragma unroll
    for (int k = 0; k < COLS; k++)
        if (k * NTH < left) from_f32(v[k], &q[k * NTH]);   /* kd_st's rounding */
}
/* v to this thread's columns of the piece (row_piece's), rounded to dt as kd_st rounds */
template <int NTH, int COLS>
__device__ __forceinline__ void row_piece_store(void *p, int dt, size_t b, int d, int c0, const float (&v)[COLS]) {
    if (dt == KD_BF16) piece_store<NTH, COLS, KD_BF16>(p, b, d, c0, v);
    else if (dt == KD_F32) piece_store<NTH, COLS, KD_F32>(p, b, d, c0, v);
    else piece_store<NTH, COLS, KD_F16>(p, b, d, c0, v);
}
/* v as a store to dtype dt leaves it (kd_round) */
template <int COLS> __device__ __forceinline__ void row_piece_round(int dt, float (&v)[COLS]) {
    if (dt == KD_BF16) {
#pragma unroll
        for (int k = 0; k < COLS; k++) v[k] = kd_round(KD_BF16, v[k]);
    } else if (dt == KD_F16) {
#pragma unroll
        for (int k = 0; k < COLS; k++) v[k] = kd_round(KD_F16, v[k]);
    }
}

/* o = w * (x * inv) over the row, inv from ss (this thread's sum of squares): xv holds this
 * thread's piece of x and w0 its first piece of w when the row is one piece */
template <int NTH, int COLS>
__device__ __forceinline__ void row_norm_scale(const void *x, int xdt, size_t xb, const void *w, int wdt, int d,
                                               float ss, float eps, float *red, const float (&xv)[COLS],
                                               const float (&w0)[COLS], void *o, int odt, size_t ob) {
    ss = kd_block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int c0 = 0; c0 < d; c0 += COLS * NTH) {
        float xp[COLS], wp[COLS];
        if (d <= COLS * NTH) {
#pragma unroll
            for (int k = 0; k < COLS; k++) { xp[k] = xv[k]; wp[k] = w0[k]; }
        } else {
            row_piece<NTH, COLS>(x, xdt, xb, d, c0, xp);
            row_piece<NTH, COLS>(w, wdt, 0, d, c0, wp);
        }
#pragma unroll
        for (int k = 0; k < COLS; k++) xp[k] = wp[k] * (xp[k] * inv);
        row_piece_store<NTH, COLS>(o, odt, ob, d, c0, xp);
    }
}

/* o = rmsnorm(x) * w for the row at x + xb (d wide), w0 its weight's first piece (row_piece) */
template <int NTH, int COLS>
__device__ __forceinline__ void row_rmsnorm(const void *x, int xdt, size_t xb, const void *w, int wdt, int d,
                                            const float (&w0)[COLS], float eps, float *red, void *o, int odt,
                                            size_t ob) {
    float xv[COLS], ss = 0.0f;
    for (int c0 = 0; c0 < d; c0 += COLS * NTH) {
        row_piece<NTH, COLS>(x, xdt, xb, d, c0, xv);
#pragma unroll
        for (int k = 0; k < COLS; k++) ss += xv[k] * xv[k];   /* past d: + 0, exactly */
    }
    row_norm_scale<NTH, COLS>(x, xdt, xb, w, wdt, d, ss, eps, red, xv, w0, o, odt, ob);
}

/* one block of NTH threads (norm_shape) per (row, segment of d columns) */
template <int NTH, int COLS>
__global__ void __launch_bounds__(NTH) rmsnorm_kernel(const void *x, int xdt, long long ldx, const void *w, int wdt,
                                                      int d, int segs, float eps, void *o, int odt, long long ldo) {
    float w0[COLS];
    row_piece<NTH, COLS>(w, wdt, 0, d, 0, w0);
    kd_griddep_enter();
    __shared__ float red[32];
    int r = blockIdx.x / segs, s0 = (blockIdx.x % segs) * d;
    row_rmsnorm<NTH, COLS>(x, xdt, (size_t)r * ldx + s0, w, wdt, d, w0, eps, red, o, odt, (size_t)r * ldo + s0);
}

/* one block per row: x += y, then out = rmsnorm(x) * w. The norm reads the sum as stored (rounded
 * to x's dtype), and the shape, column order and block sum are rmsnorm_kernel's at one segment,
 * so the bits are those of scale_add_kernel followed by rmsnorm_kernel */
template <int NTH, int COLS>
__global__ void __launch_bounds__(NTH) add_rmsnorm_kernel(void *x, int xdt, long long ldx, const void *y, int ydt,
                                                          long long ldy, const void *w, int wdt, int d, float eps,
                                                          void *o, int odt, long long ldo) {
    float w0[COLS];
    row_piece<NTH, COLS>(w, wdt, 0, d, 0, w0);
    kd_griddep_enter();
    __shared__ float red[32];
    const size_t xb = (size_t)blockIdx.x * ldx, yb = (size_t)blockIdx.x * ldy, ob = (size_t)blockIdx.x * ldo;
    float xv[COLS], ss = 0.0f;
    for (int c0 = 0; c0 < d; c0 += COLS * NTH) {
        float yv[COLS];
        row_piece<NTH, COLS>(x, xdt, xb, d, c0, xv);
        row_piece<NTH, COLS>(y, ydt, yb, d, c0, yv);
        row_piece_round(xdt, yv);   /* y as x's dtype holds it (scale_add_kernel) */
#pragma unroll
        for (int k = 0; k < COLS; k++) xv[k] += yv[k];
        row_piece_round(xdt, xv);   /* the sum as the store leaves it */
        row_piece_store<NTH, COLS>(x, xdt, xb, d, c0, xv);
#pragma unroll
        for (int k = 0; k < COLS; k++) ss += xv[k] * xv[k];   /* past d: + 0, exactly */
    }
    row_norm_scale<NTH, COLS>(x, xdt, xb, w, wdt, d, ss, eps, red, xv, w0, o, odt, ob);
}

/* RoPE of pair i at position p: the angle in fp32 (as HF), its cos and sin in double, rounded */
__device__ __forceinline__ void rope_cos_sin(int p, const float *inv_freq, int i, float amp, float *c, float *s) {
    float ang = (float)p * inv_freq[i];
    double sd, cd;
    sincos((double)ang, &sd, &cd);
    *c = (float)cd * amp;
    *s = (float)sd * amp;
}
/* pair i of the rope dims at src + sb, rotated, to dst + db (may be the same place) */
__device__ __forceinline__ void rope_pair(const void *src, int sdt, size_t sb, void *dst, int ddt, size_t db, int i,
                                          int half, bool interleaved, float c, float s) {
    int ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
    float a = kd_ld(src, sdt, sb + ia), b = kd_ld(src, sdt, sb + ib);
    kd_st(dst, ddt, db + ia, a * c - b * s);
    kd_st(dst, ddt, db + ib, b * c + a * s);
}

/* one thread per (row, head, pair) */
__global__ void rope_kernel(void *x, int xdt, long long ldx, int rows, int n_heads, int head_stride, int offset,
                            const int32_t *pos, const float *inv_freq, int half, bool interleaved, float amp) {
    kd_griddep_enter();
    size_t n = (size_t)rows * n_heads * half;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(idx % half);
        size_t rest = idx / half;
        int h = (int)(rest % n_heads), t = (int)(rest / n_heads);
        float c, s;
        rope_cos_sin(pos[t], inv_freq, i, amp, &c, &s);
        size_t base = (size_t)t * ldx + (size_t)h * head_stride + offset;
        rope_pair(x, xdt, base, x, xdt, base, i, half, interleaved, c, s);
    }
}

/* mla_rope_store: grid (T, 1 + query blocks). Block (t, 0) writes cache row start + t: the latent's
 * norm by rmsnorm_kernel's passes (this block has its shape, norm_shape(c)), then the rope
 * pairs; blocks (t, y >= 1) rope the query's pairs (y - 1) * blockDim + tid of row t. Each value is
 * rmsnorm_kernel's or rope_kernel's, so the bits are those of the ops it replaces. */
struct MlaRopeStore {
    const void *q; int qdt; long long ldq; int qs;
    void *qf; int fdt; long long ldf; int fs;
    int n_heads;
    const void *kva; int kdt; long long ldk; int c;
    const void *w; int wdt; float eps;
    const int32_t *pos; const float *inv_freq; int half; bool interleaved; float amp;
    void *cache; int cdt; long long ldc; long long cache_rows; int row0; const int32_t *d_len;
};
template <int NTH, int COLS>
__global__ void __launch_bounds__(NTH) mla_rope_store_kernel(MlaRopeStore a) {
    float w0[COLS];
    if (blockIdx.y == 0) row_piece<NTH, COLS>(a.w, a.wdt, 0, a.c, 0, w0);
    kd_griddep_enter();
    __shared__ float red[32];
    const int t = blockIdx.x, p = a.pos[t], d = 2 * a.half;
    if (blockIdx.y > 0) {
        const int j = (int)(blockIdx.y - 1) * (int)blockDim.x + threadIdx.x;
        if (j >= a.n_heads * a.half) return;
        const int h = j / a.half, i = j % a.half;
        float c, s;
        rope_cos_sin(p, a.inv_freq, i, a.amp, &c, &s);
        rope_pair(a.q, a.qdt, (size_t)t * a.ldq + (size_t)h * a.qs + a.qs - d, a.qf, a.fdt,
                  (size_t)t * a.ldf + (size_t)h * a.fs + a.fs - d, i, a.half, a.interleaved, c, s);
        return;
    }
    const long long row = (long long)a.row0 + (a.d_len ? a.d_len[0] : 0) + t;
    if (row < 0 || row >= a.cache_rows) return;   /* a defensive bound: the model checks len + T <= capacity */
    const size_t xb = (size_t)t * a.ldk, ob = (size_t)row * a.ldc;
    row_rmsnorm<NTH, COLS>(a.kva, a.kdt, xb, a.w, a.wdt, a.c, w0, a.eps, red, a.cache, a.cdt, ob);
    for (int i = threadIdx.x; i < a.half; i += blockDim.x) {
        float c, s;
        rope_cos_sin(p, a.inv_freq, i, a.amp, &c, &s);
        rope_pair(a.kva, a.kdt, xb + a.c, a.cache, a.cdt, ob + a.c, i, a.half, a.interleaved, c, s);
    }
}

__global__ void gather_kernel(void *dst, int ddt, long long ldd, const void *src, int sdt, long long lds,
                              long long src_rows, const int32_t *rows, int n, int cols) {
    kd_griddep_enter();
    size_t total = (size_t)n * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / cols), c = (int)(i % cols);
        int sr = rows[r];
        float v = (sr >= 0 && sr < src_rows) ? kd_ld(src, sdt, (size_t)sr * lds + c) : 0.0f;
        kd_st(dst, ddt, (size_t)r * ldd + c, v);
    }
}

/* same-dtype gather of raw bytes (also for integer views), 4-byte words when possible */
__global__ void gather_bytes_kernel(char *dst, long long ldd_b, const char *src, long long lds_b, long long src_rows,
                                    const int32_t *rows, int n, long long row_bytes) {
    kd_griddep_enter();
    size_t total = (size_t)n * row_bytes;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / row_bytes);
        long long c = (long long)(i % row_bytes);
        int sr = rows[r];
        dst[(size_t)r * ldd_b + c] = (sr >= 0 && sr < src_rows) ? src[(size_t)sr * lds_b + c] : 0;
    }
}

/* move_rows: blockIdx.y a cache of the launch, each thread its W-sized column chunks of every
 * moved row in the order of i: a row moves toward row 0 or stays, so that order overwrites no row
 * still to be read, and no other thread touches these columns. MOVE_BATCH rows are loaded before
 * they are stored: each one's source lies above every row stored before it. */
constexpr int MOVE_CACHES = 64;   /* caches a launch (their pointers travel in its parameters) */
constexpr int MOVE_BATCH = 8;
struct MoveRows {
    char *base[MOVE_CACHES];
};
template <typename W>
__global__ void move_rows_kernel(MoveRows p, long long ld_w, long long row_w, int src0, const int32_t *rows, int n,
                                 int dst0) {
    kd_griddep_enter();
    W *b = (W *)p.base[blockIdx.y];
    for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < row_w; c += (long long)gridDim.x * blockDim.x)
        for (int i0 = 0; i0 < n; i0 += MOVE_BATCH) {
            const int m = min(MOVE_BATCH, n - i0);
            W v[MOVE_BATCH];
#pragma unroll
            for (int j = 0; j < MOVE_BATCH; j++)
                if (j < m) v[j] = b[(size_t)(src0 + rows[i0 + j]) * ld_w + c];
#pragma unroll
            for (int j = 0; j < MOVE_BATCH; j++)
                if (j < m) b[(size_t)(dst0 + i0 + j) * ld_w + c] = v[j];
        }
}

static kd_status check_view(const char *op, const char *arg, kd_act a) {
    if (!a.data && a.rows > 0 && a.cols > 0) return kd_fail(KD_ERR_ARG, "cuda %s: %s: NULL data", op, arg);
    if (a.rows < 0 || a.cols < 0 || (a.rows > 1 && a.ld < a.cols))
        return kd_fail(KD_ERR_ARG, "cuda %s: %s: bad view %d x %d (ld %d)", op, arg, a.rows, a.cols, a.ld);
    if (!kd_cuda_float_dtype(a.dtype))
        return kd_fail(KD_ERR_ARG, "cuda %s: %s: expected f32/bf16/f16 activations, got %s", op, arg,
                       kd_dtype_name(a.dtype));
    return KD_OK;
}
static kd_status check_shape(const char *op, const char *arg, kd_act a, int rows, int cols) {
    if (a.rows != rows || a.cols != cols)
        return kd_fail(KD_ERR_ARG, "cuda %s: %s: expected %d x %d, got %d x %d", op, arg, rows, cols, a.rows, a.cols);
    return KD_OK;
}
static int wdtype(const kd_weight *w) { return w->format == KD_W_F32 ? KD_F32 : KD_BF16; }

}  // namespace

/* rows of `row` bytes, ld* bytes apart, in units U */
template <typename U>
static kd_status copy_rows(const kd_cuda *c, void *dst, size_t ldd, const void *src, size_t lds, int rows, size_t row) {
    const int cols = (int)(row / sizeof(U));
    return kd_launch_pdl("copy_rows_kernel", copy_rows_kernel<U>, ew_blocks(c, (size_t)rows * cols), EW_THREADS, 0,
                         c->stream, (U *)dst, (long long)(ldd / sizeof(U)), (const U *)src, (long long)(lds / sizeof(U)),
                         rows, cols);
}

extern "C" kd_status kd_cuda_copy(kd_backend *be, kd_act dst, kd_act src) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(check_shape("copy", "dst", dst, src.rows, src.cols));
    if (src.rows == 0 || src.cols == 0) return KD_OK;
    if (src.dtype == dst.dtype) {
        if (!src.data || !dst.data) return kd_fail(KD_ERR_ARG, "cuda copy: NULL data");
        if ((src.rows > 1 && src.ld < src.cols) || (dst.rows > 1 && dst.ld < dst.cols))
            return kd_fail(KD_ERR_ARG, "cuda copy: bad view (src ld %d, dst ld %d for %d cols)", src.ld, dst.ld, src.cols);
        const size_t es = kd_dtype_size(src.dtype), row = (size_t)src.cols * es;
        const size_t lds = (size_t)(src.rows > 1 ? src.ld : src.cols) * es;
        const size_t ldd = (size_t)(dst.rows > 1 ? dst.ld : dst.cols) * es;
        const size_t bits = (uintptr_t)src.data | (uintptr_t)dst.data | lds | ldd | row;
        if ((bits & 15) == 0) return copy_rows<uint4>(c, dst.data, ldd, src.data, lds, src.rows, row);
        if ((bits & 7) == 0) return copy_rows<uint2>(c, dst.data, ldd, src.data, lds, src.rows, row);
        if ((bits & 3) == 0) return copy_rows<uint32_t>(c, dst.data, ldd, src.data, lds, src.rows, row);
        return copy_rows<uint16_t>(c, dst.data, ldd, src.data, lds, src.rows, row);
    }
    KD_TRY(check_view("copy", "dst", dst));
    KD_TRY(check_view("copy", "src", src));
    size_t n = (size_t)src.rows * src.cols;
    KD_TRY(kd_launch_pdl("convert_kernel", convert_kernel, ew_blocks(c, n), EW_THREADS, 0, c->stream, dst.data,
                         dst.dtype, dst.ld, src.data, src.dtype, src.ld, src.rows, src.cols));
    return KD_OK;
}

extern "C" kd_status kd_cuda_embed(kd_backend *be, const kd_weight *table, const int32_t *ids, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    const char *name = table && table->name ? table->name : "?";
    if (!table || !table->dev) return kd_fail(KD_ERR_STATE, "cuda embed: table '%s' is not loaded", name);
    KD_TRY(check_view("embed", "out", out));
    if (table->format == KD_W_INT4 || out.cols != table->cols)
        return kd_fail(KD_ERR_ARG, "cuda embed: table '%s' is %lld wide (bf16/f32 expected), out has %d cols", name,
                       (long long)table->cols, out.cols);
    if (out.rows == 0) return KD_OK;
    /* ids are device memory: the model validates them on the host (kd_forward); an id out of
     * range here gives a zero row rather than a wild read */
    size_t n = (size_t)out.rows * out.cols;
    KD_TRY(kd_launch_pdl("embed_kernel", embed_kernel, ew_blocks(c, n), EW_THREADS, 0, c->stream, table->dev,
                         wdtype(table), table->rows, (int)table->cols, ids, out.data, out.dtype, out.ld, out.rows));
    return KD_OK;
}

extern "C" kd_status kd_cuda_scale_add(kd_backend *be, kd_act x, kd_act y, float s) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(check_view("add", "x", x));
    KD_TRY(check_view("add", "y", y));
    KD_TRY(check_shape("add", "y", y, x.rows, x.cols));
    size_t n = (size_t)x.rows * x.cols;
    if (!n) return KD_OK;
    KD_TRY(kd_launch_pdl("scale_add_kernel", scale_add_kernel, ew_blocks(c, n), EW_THREADS, 0, c->stream, x.data,
                         x.dtype, x.ld, y.data, y.dtype, y.ld, s, x.rows, x.cols));
    return KD_OK;
}

extern "C" kd_status kd_cuda_add(kd_backend *be, kd_act x, kd_act y) { return kd_cuda_scale_add(be, x, y, 1.0f); }

extern "C" kd_status kd_cuda_swiglu(kd_backend *be, kd_act gate, kd_act up, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(check_view("swiglu", "gate", gate));
    KD_TRY(check_view("swiglu", "up", up));
    KD_TRY(check_view("swiglu", "out", out));
    KD_TRY(check_shape("swiglu", "up", up, gate.rows, gate.cols));
    KD_TRY(check_shape("swiglu", "out", out, gate.rows, gate.cols));
    size_t n = (size_t)gate.rows * gate.cols;
    if (!n) return KD_OK;
    KD_TRY(kd_launch_pdl("swiglu_kernel", swiglu_kernel, ew_blocks(c, n), EW_THREADS, 0, c->stream, gate.data,
                         gate.dtype, gate.ld, up.data, up.dtype, up.ld, out.data, out.dtype, out.ld, gate.rows,
                         gate.cols));
    return KD_OK;
}

extern "C" kd_status kd_cuda_add_rmsnorm(kd_backend *be, kd_act x, kd_act y, const kd_weight *w, float eps,
                                         kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    const char *name = w && w->name ? w->name : "?";
    KD_TRY(check_view("add_rmsnorm", "x", x));
    KD_TRY(check_view("add_rmsnorm", "y", y));
    KD_TRY(check_view("add_rmsnorm", "out", out));
    KD_TRY(check_shape("add_rmsnorm", "y", y, x.rows, x.cols));
    KD_TRY(check_shape("add_rmsnorm", "out", out, x.rows, x.cols));
    if (!w || !w->dev) return kd_fail(KD_ERR_STATE, "cuda add_rmsnorm: weight '%s' is not loaded", name);
    if (w->format == KD_W_INT4 || w->rows * w->cols != x.cols)
        return kd_fail(KD_ERR_ARG, "cuda add_rmsnorm: weight '%s' has %lld entries, expected the %d cols of a row", name,
                       (long long)(w->rows * w->cols), x.cols);
    if (x.rows == 0) return KD_OK;
    const NormShape ns = norm_shape(x.cols);
    KD_TRY(kd_launch_pdl("add_rmsnorm_kernel", NORM_KERNEL(add_rmsnorm_kernel, ns), (unsigned)x.rows, ns.threads, 0,
                         c->stream, x.data, x.dtype, x.ld, y.data, y.dtype, y.ld, w->dev, wdtype(w), x.cols, eps, out.data,
                         out.dtype, out.ld));
    return KD_OK;
}

extern "C" kd_status kd_cuda_rmsnorm(kd_backend *be, kd_act x, const kd_weight *w, float eps, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    const char *name = w && w->name ? w->name : "?";
    KD_TRY(check_view("rmsnorm", "x", x));
    KD_TRY(check_view("rmsnorm", "out", out));
    KD_TRY(check_shape("rmsnorm", "out", out, x.rows, x.cols));
    if (!w || !w->dev) return kd_fail(KD_ERR_STATE, "cuda rmsnorm: weight '%s' is not loaded", name);
    long long d = w->rows * w->cols;
    if (w->format == KD_W_INT4 || d <= 0 || x.cols % d)
        return kd_fail(KD_ERR_ARG, "cuda rmsnorm: weight '%s' has %lld entries, which must divide the %d cols", name, d,
                       x.cols);
    if (x.rows == 0) return KD_OK;
    int segs = (int)(x.cols / d);
    long long blocks = (long long)x.rows * segs;
    if (blocks > 0x7fffffff) return kd_fail(KD_ERR_ARG, "cuda rmsnorm: too many rows (%d x %d segments)", x.rows, segs);
    const NormShape ns = norm_shape(d);
    KD_TRY(kd_launch_pdl("rmsnorm_kernel", NORM_KERNEL(rmsnorm_kernel, ns), (unsigned)blocks, ns.threads, 0, c->stream,
                         x.data, x.dtype, x.ld, w->dev, wdtype(w), (int)d, segs, eps, out.data, out.dtype, out.ld));
    return KD_OK;
}

extern "C" kd_status kd_cuda_rope(kd_backend *be, kd_act x, int n_heads, int head_stride, int offset,
                                  const int32_t *pos, const kd_rope *r) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(check_view("rope", "x", x));
    if (!r || !r->inv_freq || r->dim <= 0 || r->dim % 2 || offset < 0 || n_heads <= 0 ||
        offset + r->dim > head_stride || (long long)(n_heads - 1) * head_stride + offset + r->dim > x.cols)
        return kd_fail(KD_ERR_ARG, "cuda rope: dims [%d, %d) of %d heads of stride %d do not fit %d cols", offset,
                       offset + (r ? r->dim : 0), n_heads, head_stride, x.cols);
    if (!pos && x.rows > 0) return kd_fail(KD_ERR_ARG, "cuda rope: positions are NULL");
    size_t n = (size_t)x.rows * n_heads * (r->dim / 2);
    if (!n) return KD_OK;
    KD_TRY(kd_launch_pdl("rope_kernel", rope_kernel, ew_blocks(c, n), EW_THREADS, 0, c->stream, x.data, x.dtype, x.ld,
                         x.rows, n_heads, head_stride, offset, pos, r->inv_freq, r->dim / 2, r->interleaved,
                         r->attn_factor));
    return KD_OK;
}

extern "C" kd_status kd_cuda_mla_rope_store(kd_backend *be, kd_act q, kd_act qfull, int n_heads, kd_act kva,
                                            const kd_weight *w, float eps, const int32_t *pos, const kd_rope *r,
                                            kd_act cache, int row0, const int32_t *d_len) {
    kd_cuda *c = kd_cuda_of(be);
    const char *name = w && w->name ? w->name : "?";
    KD_TRY(check_view("mla_rope_store", "q", q));
    KD_TRY(check_view("mla_rope_store", "qfull", qfull));
    KD_TRY(check_view("mla_rope_store", "kva", kva));
    KD_TRY(check_view("mla_rope_store", "cache", cache));
    if (!w || !w->dev) return kd_fail(KD_ERR_STATE, "cuda mla_rope_store: weight '%s' is not loaded", name);
    int d = r && r->inv_freq ? r->dim : 0;
    if (d <= 0 || d % 2 || n_heads <= 0 || q.cols % n_heads || qfull.cols % n_heads || q.cols / n_heads < d ||
        qfull.cols / n_heads < d || kva.cols <= d || cache.cols != kva.cols || w->format == KD_W_INT4 ||
        w->rows * w->cols != kva.cols - d || q.rows != kva.rows || qfull.rows != kva.rows || (kva.rows > 0 && !pos))
        return kd_fail(KD_ERR_ARG, "cuda mla_rope_store: rope dim %d, %d heads: q %d x %d, qfull %d x %d, kva %d x %d, "
                       "cache %d cols, norm '%s' %lld entries (expected heads wider than the rope dim, kva's cols "
                       "= the cache's = norm + rope dim, one row of each per position)", d, n_heads, q.rows, q.cols,
                       qfull.rows, qfull.cols, kva.rows, kva.cols, cache.cols, name, (long long)(w->rows * w->cols));
    if (!d_len && (row0 < 0 || (long long)row0 + kva.rows > cache.rows))
        return kd_fail(KD_ERR_ARG, "cuda mla_rope_store: rows [%d, %lld) outside the %d cache rows", row0,
                       (long long)row0 + kva.rows, cache.rows);
    if (kva.rows == 0) return KD_OK;
    MlaRopeStore a;
    a.q = q.data; a.qdt = q.dtype; a.ldq = q.ld; a.qs = q.cols / n_heads;
    a.qf = qfull.data; a.fdt = qfull.dtype; a.ldf = qfull.ld; a.fs = qfull.cols / n_heads;
    a.n_heads = n_heads;
    a.kva = kva.data; a.kdt = kva.dtype; a.ldk = kva.ld; a.c = kva.cols - d;
    a.w = w->dev; a.wdt = wdtype(w); a.eps = eps;
    a.pos = pos; a.inv_freq = r->inv_freq; a.half = d / 2; a.interleaved = r->interleaved; a.amp = r->attn_factor;
    a.cache = cache.data; a.cdt = cache.dtype; a.ldc = cache.ld; a.cache_rows = cache.rows; a.row0 = row0;
    a.d_len = d_len;
    const NormShape ns = norm_shape(a.c);
    const long long qblocks = ((long long)n_heads * a.half + ns.threads - 1) / ns.threads;
    if (qblocks >= 65535) return kd_fail(KD_ERR_ARG, "cuda mla_rope_store: %d heads is too many", n_heads);
    return kd_launch_pdl("mla_rope_store_kernel", NORM_KERNEL(mla_rope_store_kernel, ns),
                         dim3((unsigned)kva.rows, (unsigned)(1 + qblocks)), ns.threads, 0, c->stream, a);
}

extern "C" kd_status kd_cuda_move_rows(kd_backend *be, const kd_act *caches, int n_caches, int src0, const int32_t *rows,
                                       int n, int dst0) {
    kd_cuda *c = kd_cuda_of(be);
    if (n_caches < 0 || n < 0 || (n_caches > 0 && !caches) || (n > 0 && n_caches > 0 && !rows))
        return kd_fail(KD_ERR_ARG, "cuda move_rows: %d rows of %d caches (NULL caches or rows)", n, n_caches);
    if (n_caches == 0 || n == 0) return KD_OK;
    const kd_act a = caches[0];
    bool aligned = true;
    for (int l = 0; l < n_caches; l++) {
        const kd_act x = caches[l];
        if (x.rows != a.rows || x.cols != a.cols || x.ld != a.ld || x.dtype != a.dtype || !x.data || x.ld < x.cols)
            return kd_fail(KD_ERR_ARG, "cuda move_rows: cache %d is %d x %d (ld %d) %s%s, cache 0 %d x %d (ld %d) %s", l,
                           x.rows, x.cols, x.ld, kd_dtype_name(x.dtype), x.data ? "" : " with no data", a.rows, a.cols,
                           a.ld, kd_dtype_name(a.dtype));
        aligned = aligned && (uintptr_t)x.data % 16 == 0;
    }
    /* the rows themselves are backend memory: the caller checks them (backend.h) */
    if (src0 < 0 || dst0 < 0 || (long long)dst0 + n > a.rows || src0 >= a.rows)
        return kd_fail(KD_ERR_ARG, "cuda move_rows: %d rows from %d to %d: outside the %d cache rows", n, src0, dst0,
                       a.rows);
    const size_t es = kd_dtype_size(a.dtype), row_b = (size_t)a.cols * es, ld_b = (size_t)a.ld * es;
    aligned = aligned && row_b % 16 == 0 && ld_b % 16 == 0;
    const size_t w = aligned ? 16 : 1, row_w = row_b / w;
    const int threads = 128;
    const unsigned bx = (unsigned)((row_w + threads - 1) / threads < 64 ? (row_w + threads - 1) / threads : 64);
    for (int l0 = 0; l0 < n_caches; l0 += MOVE_CACHES) {
        const int nl = n_caches - l0 < MOVE_CACHES ? n_caches - l0 : MOVE_CACHES;
        MoveRows p = {};
        for (int l = 0; l < nl; l++) p.base[l] = (char *)caches[l0 + l].data;
        const dim3 grid(bx, (unsigned)nl);
        if (aligned)
            KD_TRY(kd_launch_pdl("move_rows_kernel", move_rows_kernel<uint4>, grid, threads, 0, c->stream, p,
                                 (long long)(ld_b / w), (long long)row_w, src0, rows, n, dst0));
        else
            KD_TRY(kd_launch_pdl("move_rows_kernel", move_rows_kernel<unsigned char>, grid, threads, 0, c->stream, p,
                                 (long long)(ld_b / w), (long long)row_w, src0, rows, n, dst0));
    }
    return KD_OK;
}

extern "C" kd_status kd_cuda_gather_rows(kd_backend *be, kd_act dst, kd_act src, const int32_t *rows, int n) {
    kd_cuda *c = kd_cuda_of(be);
    if (n < 0 || n > dst.rows || dst.cols != src.cols)
        return kd_fail(KD_ERR_ARG, "cuda gather_rows: %d rows of %d cols into a %d x %d view", n, src.cols, dst.rows,
                       dst.cols);
    if (n == 0 || src.cols == 0) return KD_OK;
    if (!rows) return kd_fail(KD_ERR_ARG, "cuda gather_rows: rows is NULL");
    /* rows are device memory (validated by the caller on the host); out-of-range rows give zeros.
     * In-place compaction (dst and src in one buffer) goes through a staging copy, so no block
     * reads a row another block is overwriting. */
    size_t des = kd_dtype_size(dst.dtype), ses = kd_dtype_size(src.dtype);
    const char *s_lo = (const char *)src.data, *s_hi = s_lo + ((size_t)(src.rows - 1) * src.ld + src.cols) * ses;
    const char *d_lo = (const char *)dst.data, *d_hi = d_lo + ((size_t)(n - 1) * dst.ld + dst.cols) * des;
    bool overlap = src.rows > 0 && d_lo < s_hi && s_lo < d_hi;
    kd_act out = dst;
    if (overlap) {
        void *tmp;
        KD_TRY(kd_cuda_ws(be, KD_WS_TMP, (size_t)n * dst.cols * des, &tmp));
        out.data = tmp;
        out.ld = dst.cols;
    }
    size_t total = (size_t)n * src.cols;
    if (src.dtype == dst.dtype) {
        KD_TRY(kd_launch_pdl("gather_bytes_kernel", gather_bytes_kernel, ew_blocks(c, total * ses), EW_THREADS, 0,
                             c->stream, (char *)out.data, (long long)out.ld * des, (const char *)src.data,
                             (long long)src.ld * ses, src.rows, rows, n, (long long)src.cols * ses));
    } else {
        KD_TRY(check_view("gather_rows", "dst", dst));
        KD_TRY(check_view("gather_rows", "src", src));
        KD_TRY(kd_launch_pdl("gather_kernel", gather_kernel, ew_blocks(c, total), EW_THREADS, 0, c->stream, out.data,
                             out.dtype, out.ld, src.data, src.dtype, src.ld, src.rows, rows, n, src.cols));
    }
    if (overlap) {
        kd_act staged = out;
        staged.rows = n;
        kd_act d = dst;
        d.rows = n;
        KD_TRY(kd_cuda_copy(be, d, staged));
    }
    return KD_OK;
}
