/* mla.cu: attention over cached rows (MLA absorbed as MQA with a 576-d key and 512-d
 * value; GQA for the drafter), for prefill, decode and tree verification.
 *
 * Layout (the same as core/cpu/cpu_attention.c): query head h is q[:, h*head_dim, +head_dim);
 * kv head g's key is the first head_dim cols of k[:, g*kstride..] (kstride = k.cols / Hkv),
 * its value the first dv cols of v[:, g*vstride..] (vstride = v.cols / Hkv, dv = out.cols / Hq);
 * query head h reads kv head h / (Hq / Hkv). Query t sits at cache row past + t.
 *
 * Flash-decoding with a split that never depends on T: each query's visible keys are
 * listed in order (its "ordinals": rows 0..past-1, then the new rows it may see, in row
 * order), and cut into fixed chunks of ordinals. One block computes one chunk for some
 * (query, head) rows and writes (max, sum, o) per row; a merge kernel combines the chunks in
 * chunk order. A token therefore sees exactly the same chunks and the same arithmetic
 * whether it is decoded alone (past = p, T = 1), sits at row p of a causal prefill, or is
 * a tree node whose ancestors sit at scattered rows: in all three its visible keys are the
 * same rows' contents in the same order. That is what makes greedy DDTree reproduce greedy
 * autoregressive decoding bit for bit.
 *
 * Two kernels, chosen by the model's shapes only (never by T, the context or the buffers):
 *  - tensor cores (mla_tc.cuh, key dim <= 576 and value dim <= 512: K2.6's MLA, the drafter,
 *    the tiny models): mma.sync bf16 with heads (and, for few heads, queries) as the M
 *    dimension, so one staged key/value tile serves up to 64 (query, head) rows; chunks of
 *    512 ordinals; its header states why a row's bits do not depend on the batch.
 *  - CUDA cores (below, attn_chunk_kernel: chunks of 256 ordinals, fp32 FMA), for larger
 *    head dims, and for every shape when the model's mla_kernel option is KD_MLA_CUDA_CORES
 *    (the previous path, kept for comparison and as a fallback).
 * Both are batch-invariant each; they are not bit-identical to each other. */
#include "cuda_internal.cuh"
#include "mla_mma.cuh"
#include "mla_tc.cuh"
#include <stdlib.h>
#include <string.h>
#include <math.h>

namespace {

constexpr int CHUNK = 256;     /* ordinals per split: fixed, never derived from T or S */
constexpr int KT = 32;         /* keys per shared-memory tile; 16 where 32 does not fit (sm_120 at
                                  MLA dims): only the tiling changes, not any sum's order */
constexpr int HT_MAX = 8;      /* query heads per block */
constexpr int THREADS = 256;
constexpr int DV_MAX = 512;

struct AttnArgs {
    const void *q; long long ldq;
    const void *k; long long ldk; int kstride;
    const void *v; long long ldv; int vstride;
    int T, S, past, Hq, Hkv, G, hd, dv, HT, n_tiles, kld;
    bool causal; int window; float scale;
    const int32_t *vis_list; const int32_t *vis_cnt;   /* bitmask mode: per query, visible new rows */
    int t0;                    /* first query of this batch */
    const int32_t *d_past;     /* attention_at: past read on the device (S = past + T, S above is the bound) */
    int nc_max;                /* chunks per query slot in the partial buffers */
    float *pm, *pl, *po;       /* partials [tb][Hq][nc_max] (+ [dv] for po) */
};

/* the past rows and the key rows of this call: host values, or (attention_at) the length
 * read on the device, clamped to the bound a.S - a.T (the caller checks len + T <= capacity) */
__device__ __forceinline__ int2 past_and_rows(const AttnArgs &a) {
    if (!a.d_past) return make_int2(a.past, a.S);
    int p = min(max(a.d_past[0], 0), a.S - a.T);
    return make_int2(p, p + a.T);
}
__device__ __forceinline__ int n_visible(const AttnArgs &a, int past, int S, int t) {
    if (a.vis_list) return past + a.vis_cnt[t];
    if (a.causal) return min(S, past + t + 1);
    return S;
}
__device__ __forceinline__ int ordinal_row(const AttnArgs &a, int past, int t, int o) {
    if (a.vis_list && o >= past) return past + a.vis_list[(size_t)t * a.T + (o - past)];
    return o;
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool pred) {
    unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* Load rows row_s[j0 .. j0+KTT) (ncols bf16 each, from base + row*ld) into a [KTT][kld] tile,
 * zero-filling missing rows and the columns past ncols (up to kld). ASYNC: 16-byte cp.async
 * (needs 16-byte aligned rows and ncols % 8 == 0), else plain loads; same tile either way. */
template <bool ASYNC, int KTT>
__device__ __forceinline__ void load_tile(bf16 *dst, int kld, const bf16 *base, long long ld, int ncols,
                                          const int *row_s, int j0, int n_in) {
    const int chunks = kld / 8;
    for (int i = threadIdx.x; i < KTT * chunks; i += THREADS) {
        int j = i / chunks, cc = (i % chunks) * 8;
        int r = j0 + j < n_in ? row_s[j0 + j] : -1;
        bf16 *d = dst + j * kld + cc;
        if (ASYNC) {
            bool ok = r >= 0 && cc < ncols;
            cp_async16(d, ok ? (const void *)(base + (size_t)r * ld + cc) : (const void *)base, ok);
        } else {
            for (int e = 0; e < 8; e++)
                d[e] = (r >= 0 && cc + e < ncols) ? base[(size_t)r * ld + cc + e] : __float2bfloat16(0.0f);
        }
    }
}

/* grid: x = chunk, y = query within the batch, z = kv head * n_tiles + head tile */
template <bool ASYNC, int KTT>
__global__ void __launch_bounds__(THREADS) attn_chunk_kernel(AttnArgs a) {
    kd_griddep_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    const int c = blockIdx.x, tb = blockIdx.y, t = a.t0 + tb;
    const int g = blockIdx.z / a.n_tiles, h0 = g * a.G + (blockIdx.z % a.n_tiles) * a.HT;
    const int nh = min(a.HT, g * a.G + a.G - h0);
    const int2 ps = past_and_rows(a);
    const int past = ps.x;
    const int nvis = n_visible(a, past, ps.y, t);
    const int o0 = c * CHUNK;
    if (o0 >= nvis) return;
    const int n_in = min(CHUNK, nvis - o0);
    const int tid = threadIdx.x;
    const int hd8 = (a.hd + 7) & ~7;
    const int kld = a.kld;                                     /* bf16 per smem row: 8 * odd */

    float *q_s = (float *)smem;                                /* [HT][hd8], zero padded */
    float *s_s = q_s + HT_MAX * hd8;                           /* [HT][CHUNK] */
    int *row_s = (int *)(s_s + HT_MAX * CHUNK);                /* [CHUNK] */
    bf16 *kv_s = (bf16 *)(row_s + CHUNK);                      /* [2][KTT][kld] */
    __shared__ float m_s[HT_MAX], l_s[HT_MAX];

    const bf16 *kbase = (const bf16 *)a.k + (size_t)g * a.kstride;
    const bf16 *vbase = (const bf16 *)a.v + (size_t)g * a.vstride;
    for (int i = tid; i < HT_MAX * hd8; i += THREADS) {
        int h = i / hd8, d = i % hd8;
        q_s[i] = (h < nh && d < a.hd)
                     ? __bfloat162float(((const bf16 *)a.q)[(size_t)t * a.ldq + (size_t)(h0 + h) * a.hd + d]) : 0.0f;
    }
    for (int i = tid; i < CHUNK; i += THREADS) row_s[i] = i < n_in ? ordinal_row(a, past, t, o0 + i) : -1;
    __syncthreads();

    const int qrow = past + t;
    const int ntiles = (n_in + KTT - 1) / KTT;
    const int stage = KTT * kld;
    /* pass 1: scores, thread = (head hh, key jj); K tiles double-buffered */
    load_tile<ASYNC, KTT>(kv_s, kld, kbase, a.ldk, a.hd, row_s, 0, n_in);
    if (ASYNC) cp_async_commit();
    for (int ti = 0; ti < ntiles; ti++) {
        if (ti + 1 < ntiles) {
            load_tile<ASYNC, KTT>(kv_s + ((ti + 1) & 1) * stage, kld, kbase, a.ldk, a.hd, row_s, (ti + 1) * KTT, n_in);
            if (ASYNC) { cp_async_commit(); cp_async_wait<1>(); }
        } else if (ASYNC) {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16 *ks = kv_s + (ti & 1) * stage;
        for (int i = tid; i < HT_MAX * KTT; i += THREADS) {
            int hh = i / KTT, jj = i % KTT, j = ti * KTT + jj;
            if (hh >= nh || j >= n_in) continue;
            int r = row_s[j];
            float s = -INFINITY;
            if (!(a.window > 0 && qrow - r >= a.window)) {
                const float4 *qh = (const float4 *)(q_s + hh * hd8);
                const uint4 *kr = (const uint4 *)(ks + jj * kld);
                float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
                for (int cc = 0; cc < hd8 / 8; cc++) {
                    uint4 kw = kr[cc];
                    float4 qa = qh[2 * cc], qb = qh[2 * cc + 1];
                    float2 k01 = __bfloat1622float2(*(const __nv_bfloat162 *)&kw.x);
                    float2 k23 = __bfloat1622float2(*(const __nv_bfloat162 *)&kw.y);
                    float2 k45 = __bfloat1622float2(*(const __nv_bfloat162 *)&kw.z);
                    float2 k67 = __bfloat1622float2(*(const __nv_bfloat162 *)&kw.w);
                    p0 = fmaf(qa.x, k01.x, p0); p1 = fmaf(qa.y, k01.y, p1);
                    p2 = fmaf(qa.z, k23.x, p2); p3 = fmaf(qa.w, k23.y, p3);
                    p0 = fmaf(qb.x, k45.x, p0); p1 = fmaf(qb.y, k45.y, p1);
                    p2 = fmaf(qb.z, k67.x, p2); p3 = fmaf(qb.w, k67.y, p3);
                }
                s = ((p0 + p1) + (p2 + p3)) * a.scale;
            }
            s_s[hh * CHUNK + j] = s;
        }
        __syncthreads();
    }
    /* prefetch the first V tile while the softmax runs */
    load_tile<ASYNC, KTT>(kv_s, kld, vbase, a.ldv, a.dv, row_s, 0, n_in);
    if (ASYNC) cp_async_commit();
    /* per head: chunk max, p = exp(s - m), l = sum p (warp hh owns head hh; fixed order) */
    const int warp = tid >> 5, lane = tid & 31;
    if (warp < nh) {
        float *sh = s_s + warp * CHUNK;
        float m = -INFINITY;
        for (int j = lane; j < n_in; j += 32) m = fmaxf(m, sh[j]);
        m = kd_warp_max(m);
        float l = 0.0f;
        for (int j = lane; j < n_in; j += 32) {
            float p = sh[j] == -INFINITY ? 0.0f : expf(sh[j] - m);
            sh[j] = p;
            l += p;
        }
        l = kd_warp_sum(l);
        if (lane == 0) { m_s[warp] = m; l_s[warp] = l; }
    }
    /* pass 2: o[h][d] = sum_j p[h][j] v[j][d], j ascending; thread owns dims 2*tid, 2*tid+1 */
    float acc[HT_MAX][2];
#pragma unroll
    for (int h = 0; h < HT_MAX; h++) acc[h][0] = acc[h][1] = 0.0f;
    const int d0 = 2 * tid;
    for (int ti = 0; ti < ntiles; ti++) {
        if (ti + 1 < ntiles) {
            __syncthreads();   /* the buffer being refilled was read two tiles ago */
            load_tile<ASYNC, KTT>(kv_s + ((ti + 1) & 1) * stage, kld, vbase, a.ldv, a.dv, row_s, (ti + 1) * KTT, n_in);
            if (ASYNC) { cp_async_commit(); cp_async_wait<1>(); }
        } else if (ASYNC) {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16 *vs = kv_s + (ti & 1) * stage;
        int jn = min(KTT, n_in - ti * KTT);
        if (d0 < a.dv) {
            for (int jj = 0; jj < jn; jj++) {
                float2 vv = __bfloat1622float2(*(const __nv_bfloat162 *)(vs + jj * kld + d0));
                const float *pj = s_s + ti * KTT + jj;
#pragma unroll
                for (int h = 0; h < HT_MAX; h++) {
                    float p = pj[h * CHUNK];
                    acc[h][0] = fmaf(p, vv.x, acc[h][0]);
                    acc[h][1] = fmaf(p, vv.y, acc[h][1]);
                }
            }
        }
    }
    /* partials */
#pragma unroll
    for (int h = 0; h < HT_MAX; h++) {
        if (h >= nh) continue;
        size_t slot = ((size_t)tb * a.Hq + h0 + h) * a.nc_max + c;
        if (tid == 0) { a.pm[slot] = m_s[h]; a.pl[slot] = l_s[h]; }
        if (d0 < a.dv) a.po[slot * a.dv + d0] = acc[h][0];
        if (d0 + 1 < a.dv) a.po[slot * a.dv + d0 + 1] = acc[h][1];
    }
}

/* grid: x = query head, y = query within the batch; chunks merged in chunk order */
__global__ void attn_merge_kernel(AttnArgs a, void *out, int odt, long long ldo) {
    kd_griddep_enter();
    const int h = blockIdx.x, tb = blockIdx.y, t = a.t0 + tb;
    const int2 ps = past_and_rows(a);
    int nvis = n_visible(a, ps.x, ps.y, t);
    int nc = (nvis + CHUNK - 1) / CHUNK;
    size_t base = ((size_t)tb * a.Hq + h) * a.nc_max;
    float M = -INFINITY;
    for (int c = 0; c < nc; c++) M = fmaxf(M, a.pm[base + c]);
    float L = 0.0f;
    for (int c = 0; c < nc; c++) if (a.pm[base + c] != -INFINITY) L += a.pl[base + c] * expf(a.pm[base + c] - M);
    for (int d = threadIdx.x; d < a.dv; d += blockDim.x) {
        float o = 0.0f;
        for (int c = 0; c < nc; c++)
            if (a.pm[base + c] != -INFINITY) o += a.po[(base + c) * a.dv + d] * expf(a.pm[base + c] - M);
        kd_st(out, odt, (size_t)t * ldo + (size_t)h * a.dv + d, M == -INFINITY || L == 0.0f ? 0.0f : o / L);
    }
}

/* bitmask -> ordered list of visible new rows per query (one warp per query) */
__global__ void vis_list_kernel(const uint64_t *visible, int T, int32_t *list, int32_t *cnt) {
    kd_griddep_enter();
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= T) return;
    int words = (T + 63) / 64, n = 0;
    for (int j0 = 0; j0 < T; j0 += 32) {
        int j = j0 + lane;
        bool b = j < T && ((visible[(size_t)t * words + (j >> 6)] >> (j & 63)) & 1ull);
        unsigned m = __ballot_sync(0xffffffffu, b);
        if (b) list[(size_t)t * T + n + __popc(m & ((1u << lane) - 1u))] = j;
        n += __popc(m);
    }
    if (lane == 0) cnt[t] = n;
}

/* One call's workspace (KD_WS_ATTN), shared by both kernels: the ordered visible new rows of
 * each of the T queries (tree masks only; built here on the device) and the (m, l, o)
 * partials of a batch of up to `tbatch` queries, the batch bounded by 512 MB of partials and
 * by max_batch (the grid's y limit). */
struct AttnWork {
    const int32_t *vis_list, *vis_cnt;
    float *pm, *pl, *po;
    float *ps;   /* score_cols floats a partial slot after po (the split path's S), or NULL */
    int tbatch;
};
static kd_status attn_work(kd_backend *be, const uint64_t *visible, int T, int n_heads, int nc_max, int dv,
                           int score_cols, int max_batch, AttnWork *w) {
    kd_cuda *c = kd_cuda_of(be);
    size_t list_bytes = visible ? ((size_t)T * T + T) * sizeof(int32_t) : 0;
    list_bytes = (list_bytes + 255) & ~(size_t)255;
    size_t per_q = (size_t)n_heads * nc_max * (dv + 2 + score_cols) * sizeof(float);
    size_t cap = (size_t)512 << 20;
    int tbatch = (int)(cap / per_q);
    if (tbatch < 1) tbatch = 1;
    if (tbatch > T) tbatch = T;
    if (tbatch > max_batch) tbatch = max_batch;
    void *ws;
    KD_TRY(kd_cuda_ws(be, KD_WS_ATTN, list_bytes + per_q * tbatch + 256, &ws));
    char *p = (char *)ws;
    w->vis_list = w->vis_cnt = NULL;
    if (visible) {
        int32_t *list = (int32_t *)p, *cnt = list + (size_t)T * T;
        KD_TRY(kd_launch_pdl("vis_list_kernel", vis_list_kernel, (T + 7) / 8, 256, 0, c->stream, visible, T, list,
                             cnt));
        w->vis_list = list;
        w->vis_cnt = cnt;
    }
    w->pm = (float *)(p + list_bytes);
    w->pl = w->pm + (size_t)tbatch * n_heads * nc_max;
    w->po = w->pl + (size_t)tbatch * n_heads * nc_max;
    w->ps = score_cols ? w->po + (size_t)tbatch * n_heads * nc_max * dv : NULL;
    w->tbatch = tbatch;
    return KD_OK;
}

/* k and v rows can be fetched with 16-byte cp.async (both kernels' ASYNC path) */
static bool kv_async(kd_act k, kd_act v, int head_dim, int dv, int kstride, int vstride) {
    return head_dim % 8 == 0 && dv % 8 == 0 && k.ld % 8 == 0 && v.ld % 8 == 0 && kstride % 8 == 0 &&
           vstride % 8 == 0 && ((uintptr_t)k.data & 15) == 0 && ((uintptr_t)v.data & 15) == 0;
}

static kd_status check_act(const char *arg, kd_act a) {
    if (!kd_cuda_float_dtype(a.dtype))
        return kd_fail(KD_ERR_ARG, "cuda attention: %s: expected f32/bf16 activations, got %s", arg,
                       kd_dtype_name(a.dtype));
    if (!a.data && a.rows > 0) return kd_fail(KD_ERR_ARG, "cuda attention: %s: NULL data", arg);
    return KD_OK;
}

}  // namespace


/* The kernel's choices come from kd_model_options at the backend's creation (kd_cuda):
 * mla_kernel = KD_MLA_CUDA_CORES puts every shape on the CUDA-core kernel; mla_value_slices: by
 * default small grids take 16-row blocks of 8 warps split into value slices by tc_shape's rule;
 * -1: the 2-warp 16-row blocks as before; 1, 2 or 4 (tests, benches): force that many slices
 * (capped at DVP / 128, DVP = dv padded to a power of two) where tc_shape takes the 16-row blocks
 * of 8 warps (cp.async loads, DVP >= 128, the shared memory fits); mla_row_groups = 1 or 4 forces
 * that many row groups per block (tc_shape still takes 1 where 4 does not fit the shared memory). */

/* a launch shape's kernel and its shared memory, checked against the device's and granted */
static kd_status tc_prepare(kd_cuda *c, mla::TcShape sh, int DVP, int HDP, bool async, int head_dim, int dv,
                            mla::TcKernel *fn, size_t *smem) {
    *smem = mla::tc_smem_bytes(HDP, sh.rg, sh.kw);
    if (*smem > c->smem_optin)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda attention: key dim %d needs %zu bytes of shared memory (device has %zu)",
                       head_dim, *smem, c->smem_optin);
    *fn = mla::tc_kernel(DVP, async, sh);
    if (!*fn)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda attention: no tensor-core kernel for value dim %d (padded %d)", dv, DVP);
    return kd_cuda_smem(c, (const void *)*fn, *smem);
}

/* the tensor-core path (mla_tc.cuh); arguments already checked by attention_impl */
static kd_status attention_tc(kd_backend *be, kd_act q, int n_heads, int head_dim, kd_act k, kd_act v,
                              int n_kv_heads, int past, const int32_t *d_past, bool causal, const uint64_t *visible,
                              int window, float scale, kd_act out, int kstride, int vstride, int dv) {
    using namespace mla;
    kd_cuda *c = kd_cuda_of(be);
    const int T = q.rows, S = k.rows, G = n_heads / n_kv_heads;
    TcArgs a;
    memset(&a, 0, sizeof a);
    a.q = (const uint16_t *)q.data; a.ldq = q.ld;
    a.k = (const uint16_t *)k.data; a.ldk = k.ld; a.kstride = kstride;
    a.v = (const uint16_t *)v.data; a.ldv = v.ld; a.vstride = vstride;
    a.T = T; a.S = S; a.past = past; a.Hq = n_heads; a.G = G; a.hd = head_dim; a.dv = dv;
    a.HDP = (head_dim + 63) / 64 * 64;
    a.causal = causal; a.window = window;
    a.scale2 = scale * 1.4426950408889634f;
    a.d_past = d_past;
    a.nc_max = (S + TC_CHUNK - 1) / TC_CHUNK;
    a.qvec = head_dim % 8 == 0 && q.ld % 8 == 0 && ((uintptr_t)q.data & 15) == 0;
    const bool async = kv_async(k, v, head_dim, dv, kstride, vstride);
    const int DVP = tc_dv_padded(dv);

    /* the block shape (tc_shape: row groups, warps, value slices); the bits depend on none of it */
    const long long ncq = tc_max_chunks(S, past, T, causal, visible != NULL, d_past != NULL);
    const bool wide_fits = tc_wide_offsets_fit(S, k.ld, v.ld);
    const TcShape sh = tc_shape(ncq, T, G, n_kv_heads, DVP, a.HDP, async, wide_fits, c->n_sms, c->smem_optin, c->mla_rg,
                                c->mla_vsplit);
    const TcShape sh_tail = visible ? tc_tail_shape(sh, tc_tail_chunks(T), T, G, n_kv_heads, DVP, a.HDP, async,
                                                    wide_fits, c->n_sms, c->smem_optin, c->mla_rg, c->mla_vsplit)
                                    : sh;
    TcKernel fn, fn_tail = NULL;
    size_t smem, smem_tail = 0;
    KD_TRY(tc_prepare(c, sh, DVP, a.HDP, async, head_dim, dv, &fn, &smem));
    if (visible) KD_TRY(tc_prepare(c, sh_tail, DVP, a.HDP, async, head_dim, dv, &fn_tail, &smem_tail));
    const bool split = tc_split(sh), split_tail = tc_split(sh_tail);
    const size_t ssmem = tc_scores_smem_bytes(a.HDP);
    if (split || split_tail) KD_TRY(kd_cuda_smem(c, (const void *)tc_scores_kernel, ssmem));
    AttnWork w;
    KD_TRY(attn_work(be, visible, T, n_heads, a.nc_max, dv, split || split_tail ? TC_CHUNK : 0, 65535 / ((G + 15) / 16),
                     &w));   /* grid y: 16-row blocks */
    const int tbatch = w.tbatch;
    a.vis_list = w.vis_list; a.vis_cnt = w.vis_cnt;
    a.pm = w.pm; a.pl = w.pl; a.po = w.po; a.ps = w.ps;

    for (int t0 = 0; t0 < T; t0 += tbatch) {
        const int tb = T - t0 < tbatch ? T - t0 : tbatch;
        a.t0 = t0;
        a.tb = tb;
        /* shared launch: chunks whose ordinals are the same rows for every query */
        const int nsh = tc_shared_chunks(S, past, t0, tb, causal, visible != NULL, d_past != NULL);
        if (nsh > 0) {
            const int rbs = tc_row_blocks((long long)tb * G, sh);
            a.tail = 0;
            a.rows_fastest = tc_rows_fastest(sh);
            dim3 grid(a.rows_fastest ? rbs : nsh, a.rows_fastest ? nsh : rbs, n_kv_heads * sh.vs);
            if (split)
                KD_TRY(kd_launch_pdl("tc_scores_kernel (shared)", tc_scores_kernel, dim3(nsh * TS_KB, rbs, n_kv_heads),
                                     TS_NTH, ssmem, c->stream, a));
            KD_TRY(kd_launch_pdl("tc_chunk_kernel (shared)", fn, grid, tc_threads(sh), smem, c->stream, a));
        }
        /* tail launch (tree mask): chunks reaching into the new rows, one query per block */
        if (visible) {
            a.tail = 1;
            a.rows_fastest = false;
            a.rb_per_q = tc_row_blocks(G, sh_tail);
            dim3 grid(tc_tail_chunks(T), tb * a.rb_per_q, n_kv_heads * sh_tail.vs);
            if (split_tail)
                KD_TRY(kd_launch_pdl("tc_scores_kernel (tail)", tc_scores_kernel, dim3(grid.x * TS_KB, grid.y, n_kv_heads),
                                     TS_NTH, ssmem, c->stream, a));
            KD_TRY(kd_launch_pdl("tc_chunk_kernel (tail)", fn_tail, grid, tc_threads(sh_tail), smem_tail, c->stream, a));
        }
        int mt = dv < 256 ? ((dv + 31) / 32) * 32 : 256;
        const size_t msm = tc_merge_smem(a.nc_max);
        KD_TRY(kd_cuda_smem(c, (const void *)tc_merge_kernel, msm));
        KD_TRY(kd_launch_pdl("tc_merge_kernel", tc_merge_kernel, dim3(n_heads, tb), mt, msm, c->stream, a, out.data,
                             out.dtype, out.ld));
    }
    return KD_OK;
}

/* attention (d_past NULL: past is the host's) or attention_at (past = *d_past, read by the
 * kernels; k and v rows are the bound, the grid and the partials are sized for it and the
 * chunks past a query's visible keys exit at once, so the arithmetic is the same) */
static kd_status attention_impl(kd_backend *be, kd_act q, int n_heads, int head_dim, kd_act k, kd_act v,
                                int n_kv_heads, int past, const int32_t *d_past, bool causal, const uint64_t *visible,
                                int window, float scale, kd_act out) {
    kd_cuda *c = kd_cuda_of(be);
    if (d_past) past = 0;
    KD_TRY(check_act("q", q));
    KD_TRY(check_act("k", k));
    KD_TRY(check_act("v", v));
    KD_TRY(check_act("out", out));
    int T = q.rows, S = k.rows;
    if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || q.cols < n_heads * head_dim)
        return kd_fail(KD_ERR_ARG, "cuda attention: %d query heads of %d dims over %d kv heads (q has %d cols)", n_heads,
                       head_dim, n_kv_heads, q.cols);
    int kstride = k.cols / n_kv_heads, vstride = v.cols / n_kv_heads, dv = out.cols / n_heads;
    if (kstride < head_dim || dv <= 0 || vstride < dv || v.rows != S || out.rows != T || past < 0 ||
        ((causal || visible || d_past) && past + T > S))
        return kd_fail(KD_ERR_ARG, "cuda attention: k %d x %d, v %d x %d, out %d x %d, %d queries after %d past rows: "
                       "expected k cols >= %d*%d, v cols >= %d*(out cols / %d), past + T <= rows", k.rows, k.cols, v.rows,
                       v.cols, out.rows, out.cols, T, past, n_kv_heads, head_dim, n_kv_heads, n_heads);
    if (q.dtype != KD_BF16 || k.dtype != KD_BF16 || v.dtype != KD_BF16)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda attention: q, k, v must be bf16 (the backend's activations), got %s, %s, %s",
                       kd_dtype_name(q.dtype), kd_dtype_name(k.dtype), kd_dtype_name(v.dtype));
    if (dv > DV_MAX || head_dim > 1024)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda attention: value dim %d (max %d) / key dim %d (max 1024)", dv, DV_MAX,
                       head_dim);
    if (T == 0) return KD_OK;
    if (S == 0) return kd_fail(KD_ERR_ARG, "cuda attention: no key rows");
    /* the path depends on the model's shapes and the device only (never on T or the context) */
    if (kd_cuda_of(be)->mla_tc && head_dim <= mla::TC_HD_MAX && dv <= mla::TC_DV_MAX &&
        mla::tc_smem_bytes((head_dim + 63) / 64 * 64, 1) <= kd_cuda_of(be)->smem_optin)
        return attention_tc(be, q, n_heads, head_dim, k, v, n_kv_heads, past, d_past, causal, visible, window, scale,
                            out, kstride, vstride, dv);

    AttnArgs a = {};
    a.q = q.data; a.ldq = q.ld;
    a.k = k.data; a.ldk = k.ld; a.kstride = kstride;
    a.v = v.data; a.ldv = v.ld; a.vstride = vstride;
    a.T = T; a.S = S; a.past = past; a.Hq = n_heads; a.Hkv = n_kv_heads; a.G = n_heads / n_kv_heads;
    a.hd = head_dim; a.dv = dv;
    a.HT = a.G < HT_MAX ? a.G : HT_MAX;
    a.n_tiles = (a.G + a.HT - 1) / a.HT;
    a.causal = causal; a.window = window; a.scale = scale;
    a.d_past = d_past;
    a.nc_max = (S + CHUNK - 1) / CHUNK;

    /* smem rows of kld bf16: a multiple of 8 with an odd count of 16-byte units, so the
     * 16-byte fragment reads of 8 consecutive rows hit 8 different bank groups */
    int units = ((head_dim > dv ? head_dim : dv) + 7) / 8;
    if (units % 2 == 0) units++;
    a.kld = units * 8;
    int hd8 = (head_dim + 7) & ~7;
    auto smem_for = [&](int kt) {
        return (size_t)HT_MAX * hd8 * 4 + (size_t)HT_MAX * CHUNK * 4 + CHUNK * 4 + (size_t)2 * kt * a.kld * 2;
    };
    const int kt = smem_for(KT) <= c->smem_optin ? KT : KT / 2;   /* the device decides, never T */
    size_t smem = smem_for(kt);
    if (smem > c->smem_optin)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda attention: key dim %d needs %zu bytes of shared memory (device has %zu)",
                       head_dim, smem, c->smem_optin);
    const bool async = kv_async(k, v, head_dim, dv, kstride, vstride);
    void (*chunk_fn)(AttnArgs) = kt == KT ? (async ? attn_chunk_kernel<true, KT> : attn_chunk_kernel<false, KT>)
                                          : (async ? attn_chunk_kernel<true, KT / 2> : attn_chunk_kernel<false, KT / 2>);
    KD_TRY(kd_cuda_smem(c, (const void *)chunk_fn, smem));

    /* the workspace and the visibility lists once the launch is known to fit */
    AttnWork w;
    KD_TRY(attn_work(be, visible, T, n_heads, a.nc_max, dv, 0, 65535, &w));
    const int tbatch = w.tbatch;
    a.vis_list = w.vis_list; a.vis_cnt = w.vis_cnt;
    a.pm = w.pm; a.pl = w.pl; a.po = w.po;

    for (int t0 = 0; t0 < T; t0 += tbatch) {
        int tb = T - t0 < tbatch ? T - t0 : tbatch;
        a.t0 = t0;
        /* chunks: enough for the query that sees the most keys (<= S) */
        int max_vis = d_past ? S : visible ? past + T : causal ? past + t0 + tb : S;
        if (max_vis > S) max_vis = S;
        int nc = (max_vis + CHUNK - 1) / CHUNK;
        if (nc < 1) nc = 1;
        dim3 grid(nc, tb, n_kv_heads * a.n_tiles);
        KD_TRY(kd_launch_pdl("attn_chunk_kernel", chunk_fn, grid, THREADS, smem, c->stream, a));
        int mt = dv < 256 ? ((dv + 31) / 32) * 32 : 256;
        KD_TRY(kd_launch_pdl("attn_merge_kernel", attn_merge_kernel, dim3(n_heads, tb), mt, 0, c->stream, a, out.data,
                             out.dtype, out.ld));
    }
    return KD_OK;
}

extern "C" kd_status kd_cuda_attention(kd_backend *be, kd_act q, int n_heads, int head_dim, kd_act k, kd_act v,
                                       int n_kv_heads, int past, bool causal, const uint64_t *visible, int window,
                                       float scale, kd_act out) {
    return attention_impl(be, q, n_heads, head_dim, k, v, n_kv_heads, past, NULL, causal, visible, window, scale, out);
}

extern "C" kd_status kd_cuda_attention_at(kd_backend *be, kd_act q, int n_heads, int head_dim, kd_act k, kd_act v,
                                          int n_kv_heads, const int32_t *d_len, bool causal, const uint64_t *visible,
                                          int window, float scale, kd_act out) {
    if (!d_len) return kd_fail(KD_ERR_ARG, "cuda attention_at: the device length is NULL");
    return attention_impl(be, q, n_heads, head_dim, k, v, n_kv_heads, 0, d_len, causal, visible, window, scale, out);
}
