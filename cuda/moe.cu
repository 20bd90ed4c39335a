/* moe.cu: the routed experts of a MoE layer on the GPU, with no host round trip.
 *
 * 1. router logits = x @ router^T in fp32 (our GEMM, fp32 output);
 * 2. route (one block per token): s = sigmoid(logits), choice = s + bias (selection only),
 *    group-limited top-k (group score = sum of the top-2 choices of each group; groups
 *    outside the topk_group best get choice = -inf, as transformers 5.x and the CPU twin),
 *    top_k experts by choice (equal values: lower expert id first), weights = s of the
 *    chosen, normalised (+1e-20) when norm_topk_prob, times routed_scaling_factor. The
 *    chosen experts are then listed in ascending id (the CPU twin's and HF's sum order).
 * 3. INT4 experts: the W4A16 grouped kernel (cuda/w4a16.cuh) takes ids and weights.
 *    bf16 experts: tokens are grouped per expert on the GPU (counts, offsets, slots),
 *    gate and up as grouped GEMMs over the gathered rows, SwiGLU, down as a grouped
 *    GEMM in fp32, then each token sums its top_k rows in ascending expert id.
 * Batch invariance: a gathered row's GEMM result depends only on that row (linear.cu),
 * the combine order is fixed per token, so which slot a row lands in changes nothing. */
#include "cuda_internal.cuh"
#include <stdlib.h>

/* the backend's form of one layer's experts (kd_experts.table) */
typedef struct kd_cuda_experts {
    int n, inter, hidden;
    bool int4;
    bool mixed;                               /* formats differ between experts (quantization ignore list) */
    const bf16 **d_gate, **d_up, **d_down;    /* device arrays of n weight pointers (bf16 experts) */
} kd_cuda_experts;

namespace {

constexpr int ROUTE_THREADS = 256;
constexpr int TOPK_MAX = 32;
constexpr int ROUTE_LANE_MAX = 16;   /* the one-warp top-k: up to 512 experts (K2.6: 384) */
static_assert(ROUTE_LANE_MAX == 16, "route_kernel's per-lane tree (16 -> 8 -> 4 -> 1 keys) is written out for 16");

__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

/* a choice as a key whose unsigned order is `better`'s: the value's kd_float_key above the
 * complement of the id, so equal values put the lower id first. A NaN keys below every number (a
 * NaN choice comes of a NaN logit, whose token's output is NaN whichever experts it takes); 0 is
 * below every key (a lane's slot past n, or one taken). */
__device__ __forceinline__ unsigned long long route_key(float v, int i) {
    return (unsigned long long)kd_float_key(v) << 32 | (unsigned)~i;
}
__device__ __forceinline__ unsigned long long key_max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

/* block argmax over v[0..n) skipping taken (ties: lower index); every thread gets the index */
__device__ int block_best(const float *v, const unsigned char *taken, int n, float *rv, int *ri) {
    float bv = -INFINITY;
    int bi = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        if (taken[i]) continue;
        if (bi < 0 || better(v[i], i, bv, bi)) { bv = v[i]; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || better(ov, oi, bv, bi))) { bv = ov; bi = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { rv[warp] = bv; ri[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (ri[w] >= 0 && (bi < 0 || better(rv[w], ri[w], bv, bi))) { bv = rv[w]; bi = ri[w]; }
        ri[0] = bi;
    }
    __syncthreads();
    int r = ri[0];
    __syncthreads();
    return r;
}

/* one block per token; smem: choice[n] floats, scores[n] floats, taken[n] bytes */
__global__ void __launch_bounds__(ROUTE_THREADS) route_kernel(const float *logits, int n, const float *bias, int n_group,
                                                              int topk_group, int top_k, bool norm, float scaling,
                                                              int32_t *ids, float *weights) {
    kd_griddep_enter();
    extern __shared__ float sm[];
    float *score = sm, *choice = sm + n, *gscore = choice + n;
    unsigned char *taken = (unsigned char *)(gscore + (n_group > 1 ? n_group : 1));
    __shared__ float rv[32];
    __shared__ int ri[32];
    __shared__ int sel[TOPK_MAX];
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float s = 1.0f / (1.0f + expf(-logits[(size_t)t * n + i]));
        score[i] = s;
        choice[i] = s + (bias ? bias[i] : 0.0f);
    }
    __syncthreads();
    if (n_group > 1) {
        int per = n / n_group;
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            float a = -INFINITY, b = -INFINITY;
            for (int i = g * per; i < (g + 1) * per; i++) {
                float c = choice[i];
                if (c > a) { b = a; a = c; } else if (c > b) b = c;
            }
            gscore[g] = per >= 2 ? a + b : a;
            taken[g] = 0;
        }
        __syncthreads();
        for (int j = 0; j < topk_group && j < n_group; j++) {
            int b = block_best(gscore, taken, n_group, rv, ri);
            if (threadIdx.x == 0) taken[b] = 1;
            __syncthreads();
        }
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            if (!taken[i / per]) choice[i] = -INFINITY;
        __syncthreads();
    }
    if (n <= 32 * ROUTE_LANE_MAX) {
        /* one warp: lane l holds the keys of experts l + 32 j in registers; a round takes the
         * lanes' best keys through two warp reductions (the value's high word, then the id word
         * among the lanes holding that value), where a shuffle tree of `better` took ten
         * dependent shuffles. The key orders as `better` does (NaN aside), so the experts are
         * block_best's. */
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            unsigned long long key[ROUTE_LANE_MAX];
#pragma unroll
            for (int j = 0; j < ROUTE_LANE_MAX; j++) {
                const int i = lane + 32 * j;
                key[j] = i < n ? route_key(choice[i], i) : 0ull;
            }
            for (int r = 0; r < top_k; r++) {
                unsigned long long m[ROUTE_LANE_MAX / 2];   /* the lane's best: a tree of 4 steps, not a chain of 15 */
#pragma unroll
                for (int j = 0; j < 8; j++) m[j] = key_max(key[j], key[j + 8]);
#pragma unroll
                for (int j = 0; j < 4; j++) m[j] = key_max(m[j], m[j + 4]);
                const unsigned long long best = key_max(key_max(m[0], m[2]), key_max(m[1], m[3]));
                const unsigned hi = __reduce_max_sync(0xffffffffu, (unsigned)(best >> 32));
                const unsigned lo = __reduce_max_sync(0xffffffffu, (unsigned)(best >> 32) == hi ? (unsigned)best : 0u);
                const unsigned long long won = (unsigned long long)hi << 32 | lo;
#pragma unroll
                for (int j = 0; j < ROUTE_LANE_MAX; j++)
                    if (key[j] == won) key[j] = 0ull;
                if (lane == 0) sel[r] = (int)~lo;
            }
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) taken[i] = 0;
        __syncthreads();
        for (int j = 0; j < top_k; j++) {
            int b = block_best(choice, taken, n, rv, ri);
            if (threadIdx.x == 0) { taken[b] = 1; sel[j] = b; }
            __syncthreads();
        }
    }
    __syncthreads();
    /* the weights (their sum in selection order, as the CPU twin adds them) and the ascending-id
     * listing: lane j takes the j-th choice and finds its place by counting the smaller ids */
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int id = lane < top_k ? sel[lane] : 0x7fffffff;
        float w = lane < top_k ? score[id] : 0.0f, sum = 0.0f;
        int place = 0;
        for (int j = 0; j < top_k; j++) {
            sum += __shfl_sync(0xffffffffu, w, j);
            place += __shfl_sync(0xffffffffu, id, j) < id;
        }
        if (lane < top_k) {
            if (norm) w /= sum + 1e-20f;
            w *= scaling;
            ids[(size_t)t * top_k + place] = id;
            weights[(size_t)t * top_k + place] = w;
        }
    }
}

/* counts per expert, offsets, a slot per (token, j), the source token per slot (one block) */
__global__ void group_kernel(const int32_t *ids, int P, int top_k, int n, int32_t *off, int32_t *cursor,
                             int32_t *slot_of, int32_t *src_tok) {
    kd_griddep_enter();
    for (int e = threadIdx.x; e <= n; e += blockDim.x) { off[e] = 0; if (e < n) cursor[e] = 0; }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) atomicAdd(&off[ids[p] + 1], 1);
    __syncthreads();
    if (threadIdx.x == 0)
        for (int e = 0; e < n; e++) off[e + 1] += off[e];
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        int e = ids[p];
        int s = off[e] + atomicAdd(&cursor[e], 1);
        slot_of[p] = s;
        src_tok[s] = p / top_k;
    }
}

/* out[t] = sum_j w[t,j] * y[slot(t,j)], j ascending (expert id order); then + shared[t] (out's
 * dtype; NULL: none) as the add op adds it: to the sum rounded to out's dtype */
__global__ void combine_kernel(const float *y, int H, const int32_t *slot_of, const float *w, int top_k,
                               const void *shared, long long lds, void *out, int odt, long long ldo, int T) {
    kd_griddep_enter();
    size_t n = (size_t)T * H;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(i / H), d = (int)(i % H);
        float s = 0.0f;
        for (int j = 0; j < top_k; j++) {
            int p = t * top_k + j;
            s = fmaf(w[p], y[(size_t)slot_of[p] * H + d], s);
        }
        if (shared) s = kd_round(odt, s) + kd_ld(shared, odt, (size_t)t * lds + d);
        kd_st(out, odt, (size_t)t * ldo + d, s);
    }
}

}  // namespace

namespace {
/* acc[tok[i]] += w[i] * y[i] (rows of H); tokens are distinct within one expert */
__global__ void scatter_add_kernel(float *acc, int H, const int32_t *tok, const float *w, const float *y, int m) {
    kd_griddep_enter();
    size_t n = (size_t)m * H;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / H), d = (int)(i % H);
        float *a = acc + (size_t)tok[r] * H + d;
        *a = fmaf(w[r], y[(size_t)r * H + d], *a);
    }
}
}  // namespace

/* Experts of different formats in one layer (modules the quantization ignore list keeps dense
 * next to INT4 ones, or f32 experts): ids come back to the host and each used expert runs as
 * plain linears over its gathered tokens, in ascending expert id, adding into an fp32
 * accumulator, so every token sums its experts in the same order as the CPU twin. */
static kd_status moe_mixed(kd_backend *be, kd_act x, const kd_experts *e, const int32_t *d_ids, const float *d_w,
                           kd_act shared, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    int T = x.rows, H = x.cols, K = e->top_k, I = (int)e->gate[0].rows;
    size_t P = (size_t)T * K;
    int32_t *ids = (int32_t *)malloc(P * sizeof(int32_t) * 2);
    float *w = (float *)malloc(P * sizeof(float) * 2);
    if (!ids || !w) { free(ids); free(w); return kd_fail(KD_ERR_NOMEM, "cuda moe: out of host memory"); }
    int32_t *tok = ids + P;
    float *tw = w + P;
    kd_status st = be->ops->download(be, ids, d_ids, P * sizeof(int32_t));
    if (st == KD_OK) st = be->ops->download(be, w, d_w, P * sizeof(float));
    /* device scratch: acc [T,H] f32 | xs [T,H] bf16 | g, u [T,I] bf16 | y [T,H] f32 | tok [T] | w [T] */
    size_t o_acc = 0, o_xs = o_acc + (size_t)T * H * 4, o_g = o_xs + (((size_t)T * H * 2 + 255) & ~(size_t)255);
    size_t o_u = o_g + (((size_t)T * I * 2 + 255) & ~(size_t)255), o_y = o_u + (((size_t)T * I * 2 + 255) & ~(size_t)255);
    size_t o_tok = o_y + (size_t)T * H * 4, o_tw = o_tok + (((size_t)T * 4 + 255) & ~(size_t)255);
    void *ws = NULL;
    if (st == KD_OK) st = kd_cuda_ws(be, KD_WS_MOE2, o_tw + (size_t)T * 4, &ws);
    char *b = (char *)ws;
    if (st == KD_OK) {
        cudaError_t err = cudaMemsetAsync(b + o_acc, 0, (size_t)T * H * 4, c->stream);
        if (err != cudaSuccess) st = kd_cuda_fail(err, "cudaMemsetAsync (moe accumulator)", __FILE__, __LINE__);
    }
    for (int ex = 0; ex < e->n && st == KD_OK; ex++) {
        int m = 0;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++)
                if (ids[(size_t)t * K + j] == ex) { tok[m] = t; tw[m] = w[(size_t)t * K + j]; m++; }
        if (!m) continue;
        int32_t *dtok = (int32_t *)(b + o_tok);
        float *dtw = (float *)(b + o_tw);
        st = be->ops->upload(be, dtok, tok, (size_t)m * 4);
        if (st == KD_OK) st = be->ops->upload(be, dtw, tw, (size_t)m * 4);
        kd_act xs = {b + o_xs, m, H, H, KD_BF16}, g = {b + o_g, m, I, I, KD_BF16}, u = {b + o_u, m, I, I, KD_BF16};
        kd_act y = {b + o_y, m, H, H, KD_F32};
        if (st == KD_OK) st = kd_cuda_gather_rows(be, xs, x, dtok, m);
        if (st == KD_OK) st = kd_cuda_linear(be, xs, &e->gate[ex], g);
        if (st == KD_OK) st = kd_cuda_linear(be, xs, &e->up[ex], u);
        if (st == KD_OK) st = kd_cuda_swiglu(be, g, u, g);
        if (st == KD_OK) st = kd_cuda_linear(be, g, &e->down[ex], y);
        if (st == KD_OK) {
            int blocks = (int)(((size_t)m * H + 255) / 256);
            st = kd_launch_pdl("scatter_add_kernel", scatter_add_kernel, blocks, 256, 0, c->stream,
                               (float *)(b + o_acc), H, dtok, dtw, (float *)y.data, m);
        }
    }
    if (st == KD_OK) {
        kd_act acc = {b + o_acc, T, H, H, KD_F32};
        st = kd_cuda_copy(be, out, acc);
    }
    if (st == KD_OK && shared.data) st = kd_cuda_add(be, out, shared);   /* the rare mixed layer keeps the add apart */
    free(ids);
    free(w);
    return st;
}

extern "C" kd_status kd_cuda_experts_load(kd_backend *be, kd_experts *e) {
    if (!e || !e->router || !e->gate || !e->up || !e->down || e->n <= 0)
        return kd_fail(KD_ERR_ARG, "cuda experts_load: incomplete expert table");
    const kd_weight *g0 = &e->gate[0];
    int I = (int)g0->rows, H = (int)g0->cols;
    bool mixed = false;
    for (int i = 0; i < e->n; i++) {
        const kd_weight *ws[3] = {&e->gate[i], &e->up[i], &e->down[i]};
        for (int j = 0; j < 3; j++) {
            const kd_weight *w = ws[j];
            long long er = j < 2 ? I : H, ec = j < 2 ? H : I;
            if (!w->dev || w->rows != er || w->cols != ec)
                return kd_fail(KD_ERR_ARG, "cuda experts_load: expert %d weight '%s' is [%lld, %lld] (loaded: %s); "
                               "expected [%lld, %lld] like '%s'", i, w->name ? w->name : "?", (long long)w->rows,
                               (long long)w->cols, w->dev ? "yes" : "no", er, ec, g0->name ? g0->name : "?");
            if (w->format != g0->format || w->format == KD_W_F32) mixed = true;
            if (w->format == KD_W_BF16 && ((uintptr_t)w->dev & 15) != 0)
                return kd_fail(KD_ERR_ARG, "cuda experts_load: weight '%s' is not 16-byte aligned", w->name ? w->name : "?");
        }
    }
    kd_cuda_experts *t = (kd_cuda_experts *)calloc(1, sizeof *t);
    if (!t) return kd_fail(KD_ERR_NOMEM, "cuda experts_load: out of host memory");
    t->n = e->n;
    t->inter = I;
    t->hidden = H;
    t->mixed = mixed;
    t->int4 = !mixed && g0->format == KD_W_INT4;
    if (!mixed && !t->int4) {
        size_t bytes = (size_t)e->n * sizeof(void *);
        const bf16 **host = (const bf16 **)malloc(3 * bytes);
        if (!host) { free(t); return kd_fail(KD_ERR_NOMEM, "cuda experts_load: out of host memory"); }
        for (int i = 0; i < e->n; i++) {
            host[i] = (const bf16 *)e->gate[i].dev;
            host[e->n + i] = (const bf16 *)e->up[i].dev;
            host[2 * e->n + i] = (const bf16 *)e->down[i].dev;
        }
        void *d = NULL;
        cudaError_t err = cudaMalloc(&d, 3 * bytes);
        if (err == cudaSuccess) err = cudaMemcpy(d, host, 3 * bytes, cudaMemcpyHostToDevice);
        free(host);
        if (err != cudaSuccess) {
            if (d) cudaFree(d);
            free(t);
            return kd_cuda_fail(err, "cudaMalloc/cudaMemcpy (expert pointer table)", __FILE__, __LINE__);
        }
        t->d_gate = (const bf16 **)d;
        t->d_up = t->d_gate + e->n;
        t->d_down = t->d_gate + 2 * e->n;
    }
    e->table = t;
#if KD_HAVE_W4A16
    if (t->int4) {
        kd_status st = kd_cuda_w4a16_experts_load(be, e);
        if (st != KD_OK) { free(t); e->table = NULL; return st; }
    }
#else
    if (t->int4) {
        free(t);
        e->table = NULL;
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda experts_load: INT4 experts need the W4A16 kernels (not in this build)");
    }
#endif
    return KD_OK;
}

extern "C" void kd_cuda_experts_free(kd_backend *be, kd_experts *e) {
    if (!e || !e->table) return;
    kd_cuda_experts *t = (kd_cuda_experts *)e->table;
#if KD_HAVE_W4A16
    if (t->int4) kd_cuda_w4a16_experts_free(be, e);
#endif
    if (t->d_gate) cudaFree((void *)t->d_gate);
    free(t);
    e->table = NULL;
}

extern "C" kd_status kd_cuda_moe(kd_backend *be, kd_act x, const kd_experts *e, kd_act shared, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    if (!e || !e->table)
        return kd_fail(KD_ERR_STATE, "cuda moe: the expert table is not loaded (experts_load was not called)");
    const kd_cuda_experts *t = (const kd_cuda_experts *)e->table;
    int T = x.rows, H = x.cols, n = e->n, K = e->top_k, I = t->inter;
    if (out.rows != T || out.cols != H || H != t->hidden)
        return kd_fail(KD_ERR_ARG, "cuda moe: x %d x %d, out %d x %d; experts take %d wide rows", x.rows, x.cols, out.rows,
                       out.cols, t->hidden);
    if (K <= 0 || K > n || K > TOPK_MAX || (e->n_group > 1 && (n % e->n_group || e->topk_group <= 0 ||
                                                                e->topk_group > e->n_group)))
        return kd_fail(KD_ERR_ARG, "cuda moe: bad expert table (n %d, top_k %d (max %d), n_group %d, topk_group %d)", n, K,
                       TOPK_MAX, e->n_group, e->topk_group);
    if (!e->router || !e->router->dev || e->router->rows != n || e->router->cols != H)
        return kd_fail(KD_ERR_ARG, "cuda moe: router '%s' must be loaded as [%d, %d]",
                       e->router && e->router->name ? e->router->name : "?", n, H);
    if (x.dtype != KD_BF16 && x.dtype != KD_F32)
        return kd_fail(KD_ERR_ARG, "cuda moe: x must be bf16 or f32, got %s", kd_dtype_name(x.dtype));
    if (shared.data && (shared.rows != T || shared.cols != H || shared.dtype != out.dtype || shared.data == out.data))
        return kd_fail(KD_ERR_ARG, "cuda moe: shared %d x %d %s must be out's shape and dtype (%d x %d %s), apart from it",
                       shared.rows, shared.cols, kd_dtype_name(shared.dtype), T, H, kd_dtype_name(out.dtype));
    if (T == 0) return KD_OK;

    /* routing workspace: logits [T,n] f32 | ids [T,K] | w [T,K] | off [n+1] | cursor [n] | slot_of [T*K] | src [T*K] */
    size_t P = (size_t)T * K;
    size_t o_logits = 0, o_ids = o_logits + (size_t)T * n * 4, o_w = o_ids + P * 4, o_off = o_w + P * 4;
    size_t o_cur = o_off + (size_t)(n + 1) * 4, o_slot = o_cur + (size_t)n * 4, o_src = o_slot + P * 4;
    size_t total = o_src + P * 4;
    void *ws;
    KD_TRY(kd_cuda_ws(be, KD_WS_MOE, total, &ws));
    char *b = (char *)ws;
    float *logits = (float *)(b + o_logits), *wsel = (float *)(b + o_w);
    int32_t *ids = (int32_t *)(b + o_ids), *off = (int32_t *)(b + o_off), *cursor = (int32_t *)(b + o_cur);
    int32_t *slot_of = (int32_t *)(b + o_slot), *src_tok = (int32_t *)(b + o_src);

    kd_act lg = {logits, T, n, n, KD_F32};
    KD_TRY(kd_cuda_linear(be, x, e->router, lg));
    int ng = e->n_group > 1 ? e->n_group : 1;
    size_t smem = (size_t)(2 * n + ng) * sizeof(float) + (size_t)(n > ng ? n : ng) + 16;
    KD_TRY(kd_cuda_smem(c, (const void *)route_kernel, smem));
    KD_TRY(kd_launch_pdl("route_kernel", route_kernel, T, ROUTE_THREADS, smem, c->stream, logits, n, e->bias,
                         e->n_group, e->topk_group, K, e->norm_topk_prob, e->routed_scaling_factor, ids, wsel));

    if (!t->int4) KD_TRY(kd_cuda_branch_join(c));   /* shared's writer, before any read of it */
    if (t->mixed) return moe_mixed(be, x, e, ids, wsel, shared, out);
    if (t->int4) {
#if KD_HAVE_W4A16
        return kd_cuda_w4a16_moe(be, x, e, ids, wsel, shared, out);
#else
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda moe: INT4 experts need the W4A16 kernels (not in this build)");
#endif
    }

    KD_TRY(kd_launch_pdl("group_kernel", group_kernel, 1, 1024, 0, c->stream, ids, (int)P, K, n, off, cursor, slot_of,
                         src_tok));

    /* expert activations: gate [P,I] | up [P,I] (act dtype) | y [P,H] f32 */
    size_t asz = 2;
    size_t o_g = 0, o_u = o_g + P * I * asz, o_y = (o_u + P * I * asz + 255) & ~(size_t)255;
    void *ws2;
    KD_TRY(kd_cuda_ws(be, KD_WS_MOE2, o_y + P * H * 4, &ws2));
    bf16 *hg = (bf16 *)((char *)ws2 + o_g), *hu = (bf16 *)((char *)ws2 + o_u);
    float *y = (float *)((char *)ws2 + o_y);

    kd_gemm_args g = {};
    g.A = x.data; g.a_dtype = x.dtype; g.lda = x.ld; g.a_rows = src_tok;
    g.b_kmajor = true; g.ldb = H; g.b_ptrs = t->d_gate;
    g.C = hg; g.c_dtype = KD_BF16; g.ldc = I;
    g.row_off = off; g.M = T; g.N = I; g.K = H; g.batch = n;
    KD_TRY(kd_cuda_gemm(be, &g));
    g.b_ptrs = t->d_up; g.C = hu;
    KD_TRY(kd_cuda_gemm(be, &g));
    kd_act ag = {hg, (int)P, I, I, KD_BF16}, au = {hu, (int)P, I, I, KD_BF16};
    KD_TRY(kd_cuda_swiglu(be, ag, au, ag));
    kd_gemm_args d = {};
    d.A = hg; d.a_dtype = KD_BF16; d.lda = I; d.a_rows = NULL;
    d.b_kmajor = true; d.ldb = I; d.b_ptrs = t->d_down;
    d.C = y; d.c_dtype = KD_F32; d.ldc = H;
    d.row_off = off; d.M = T; d.N = H; d.K = I; d.batch = n;
    KD_TRY(kd_cuda_gemm(be, &d));

    size_t tot = (size_t)T * H;
    int blocks = (int)((tot + 255) / 256);
    if (blocks > 16 * c->n_sms) blocks = 16 * c->n_sms;
    KD_TRY(kd_launch_pdl("combine_kernel", combine_kernel, blocks, 256, 0, c->stream, y, H, slot_of, wsel, K,
                         shared.data, shared.ld, out.data, out.dtype, out.ld, T));
    return KD_OK;
}
