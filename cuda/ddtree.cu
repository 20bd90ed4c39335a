/* ddtree.cu: the DDTree round on the device (backend.h: tree_select, tree_stage, sample_rows,
 * tree_walk). Each op gives exactly what its CPU twin (core/cpu/cpu_ddtree.c) gives:
 *
 * tree_select  Algorithm 1 (core/tree.c) by one thread of one block: a binary heap of
 *              (score, parent, depth, rank) in shared memory (2B+1 entries), scores updated
 *              in double with the same operations in the same order (__d*_rn: no fma
 *              contraction), exact score ties ordered by rank tuples read up the parent
 *              chains. The other threads check the lists for NaN / +inf first and write
 *              the parents, depths and ancestor masks afterwards (one row per thread).
 * tree_stage   root token and positions (pos0 + depth); optionally the verify forward's
 *              inputs (ids, positions, mask) into the sequence's scratch.
 * sample_rows  the keyed sampling rule (core/sample.c) with one block per row. Masses are
 *              integers (sample_rule.h, the same code as the host) summed exactly in 128
 *              bits, so the parallel sums equal the host's sequential ones. The row order
 *              (logit descending, id ascending) is searched by radix on the order-preserving
 *              32-bit key of the logit: top-k by counts, the top-p nucleus by masses; the
 *              last kept id among equal logits and the drawn token by a two-level
 *              search (per-warp segment sums, then one warp scans its segment).
 * tree_walk    the accept walk: one block; each step every thread scans a slice of the
 *              nodes for the child (parent == cur, token == target[cur]); the smallest id
 *              wins (atomicMin), as the host's child lists are in pop order.
 * Every launch is checked; the kernels index only inside the arrays their callers sized. */
#include "cuda_internal.cuh"
#include "sample_rule.h"
#include <float.h>
#include <limits.h>

namespace {

constexpr int SEL_THREADS = 256;
constexpr int SEL_MAX_BUDGET = 4096;      /* heap + node arrays in shared memory: ~180 KB at 4096 */
constexpr int SMP_THREADS = 512;
constexpr int SMP_WARPS = SMP_THREADS / 32;
constexpr int WALK_THREADS = 256;
constexpr unsigned FULL = 0xffffffffu;

/* ------------------------------------------------------------------ tree_select */

/* a list value as Algorithm 1 reads it: NaN and -inf -> -FLT_MAX, +inf -> FLT_MAX */
__device__ __forceinline__ double list_value(const float *vals, int i) {
    float v = vals[i];
    if (!(v >= -FLT_MAX)) v = -FLT_MAX;
    else if (v > FLT_MAX) v = FLT_MAX;
    return (double)v;
}

struct sel_heap {
    double *score;
    int *parent, *dr;          /* dr = depth << 16 | rank */
    const int *np, *nd, *nr;   /* popped nodes: parent, depth, rank */
};

/* the rank tuple of heap entry e into out[0..depth) */
__device__ int entry_ranks(const sel_heap &h, int e, int *out) {
    int d = h.dr[e] >> 16;
    out[d - 1] = h.dr[e] & 0xffff;
    for (int p = h.parent[e]; p > 0; p = h.np[p]) out[h.nd[p] - 1] = h.nr[p];
    return d;
}

/* entry a pops before entry b */
__device__ bool entry_before(const sel_heap &h, int a, int b) {
    if (h.score[a] != h.score[b]) return h.score[a] > h.score[b];
    int ra[KD_TREE_MAX_DEPTH], rb[KD_TREE_MAX_DEPTH];
    int na = entry_ranks(h, a, ra), nb = entry_ranks(h, b, rb);
    int n = na < nb ? na : nb;
    for (int i = 0; i < n; i++)
        if (ra[i] != rb[i]) return ra[i] < rb[i];
    return na < nb;
}

__device__ __forceinline__ void entry_swap(sel_heap &h, int a, int b) {
    double s = h.score[a]; h.score[a] = h.score[b]; h.score[b] = s;
    int p = h.parent[a]; h.parent[a] = h.parent[b]; h.parent[b] = p;
    int x = h.dr[a]; h.dr[a] = h.dr[b]; h.dr[b] = x;
}

__device__ void heap_push(sel_heap &h, int &n, double score, int parent, int depth, int rank) {
    int i = n++;
    h.score[i] = score;
    h.parent[i] = parent;
    h.dr[i] = depth << 16 | rank;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!entry_before(h, i, p)) break;
        entry_swap(h, i, p);
        i = p;
    }
}

/* removes the top entry (the caller read it at index 0 first) */
__device__ void heap_pop(sel_heap &h, int &n) {
    n--;
    h.score[0] = h.score[n];
    h.parent[0] = h.parent[n];
    h.dr[0] = h.dr[n];
    int i = 0;
    for (;;) {
        int l = 2 * i + 1, r = l + 1, b = i;
        if (l < n && entry_before(h, l, b)) b = l;
        if (r < n && entry_before(h, r, b)) b = r;
        if (b == i) break;
        entry_swap(h, i, b);
        i = b;
    }
}

__global__ void __launch_bounds__(SEL_THREADS) tree_select_kernel(kd_dtree t, int L, int K, int budget) {
    extern __shared__ double sel_smem[];
    __shared__ int s_bad, s_n;
    const int H = 2 * budget + 1;
    double *hs = sel_smem;
    int *hpar = (int *)(hs + H);
    int *hdr = hpar + H;
    int *np = hdr + H;
    int *nd = np + (budget + 1);
    int *nr = nd + (budget + 1);
    const int tid = threadIdx.x;

    if (tid == 0) s_bad = INT_MAX;
    __syncthreads();
    const int total = L * K;
    for (int i = tid; i < total; i += blockDim.x) {
        float v = t.vals[i];
        if (v != v || v == INFINITY) atomicMin(&s_bad, i);
    }
    __syncthreads();

    if (tid == 0) {
        sel_heap h = { hs, hpar, hdr, np, nd, nr };
        np[0] = -1; nd[0] = 0; nr[0] = -1;
        int hn = 0, n = 0;
        heap_push(h, hn, list_value(t.vals, 0), 0, 1, 0);
        while (hn > 0 && n < budget) {
            double score = hs[0];
            int parent = hpar[0], d = hdr[0] >> 16, r = hdr[0] & 0xffff;
            heap_pop(h, hn);
            int i = ++n, row = (d - 1) * K;
            t.token[i] = t.ids[row + r];
            np[i] = parent;
            nd[i] = d;
            nr[i] = r;
            if (r + 1 < K)
                heap_push(h, hn, __dadd_rn(__dsub_rn(score, list_value(t.vals, row + r)), list_value(t.vals, row + r + 1)),
                          parent, d, r + 1);
            if (d < L) heap_push(h, hn, __dadd_rn(score, list_value(t.vals, d * K)), i, d + 1, 0);
        }
        s_n = n;
        int bad = s_bad;
        float bv = bad != INT_MAX ? t.vals[bad] : 0.0f;
        t.status[0] = bad == INT_MAX ? 0 : (bv != bv ? 1 : 2);
        t.status[1] = bad == INT_MAX ? 0 : bad;
        t.status[2] = n;
        t.status[3] = 0;
    }
    __syncthreads();
    const int n = s_n, words = (n + 1 + 63) / 64;
    for (int i = tid; i <= n; i += blockDim.x) {
        t.parent[i] = np[i];
        t.depth[i] = nd[i];
        uint64_t *row = t.vis + (size_t)i * words;
        for (int w = 0; w < words; w++) row[w] = 0;
        for (int a = i; a >= 0; a = np[a]) row[a >> 6] |= 1ull << (a & 63);   /* np[0] = -1 ends the chain */
    }
}

/* ------------------------------------------------------------------ tree_stage */

__global__ void tree_stage_kernel(kd_dtree t, int n, int32_t root, int32_t pos0, int32_t *ids, int32_t *pos_out,
                                  uint64_t *vis_out) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (size_t i = first; i <= (size_t)n; i += stride) {
        int32_t tok = i == 0 ? root : t.token[i];
        int32_t p = pos0 + (i == 0 ? 0 : t.depth[i]);
        if (i == 0) {
            t.token[0] = root;
            t.parent[0] = -1;
            t.depth[0] = 0;
        }
        t.pos[i] = p;
        if (ids) {
            ids[i] = tok;
            pos_out[i] = p;
        }
    }
    if (vis_out) {
        size_t words = (size_t)(n + 1 + 63) / 64, cnt = (size_t)(n + 1) * words;
        for (size_t j = first; j < cnt; j += stride) vis_out[j] = t.vis[j];
    }
}

/* ------------------------------------------------------------------ tree_walk */

__global__ void __launch_bounds__(WALK_THREADS) tree_walk_kernel(kd_dtree t, int n, int sampled) {
    /* three child slots: step k finds its child in slot k % 3 while thread 0 clears slot
     * (k + 1) % 3 for the next step (last read two steps ago, before the previous barrier) */
    __shared__ int s_child[3];
    const int tid = threadIdx.x, N = t.cap + 1;
    int32_t *hdr = t.result, *nodes = t.result + KD_DTREE_HDR, *toks = nodes + N;
    if (tid == 0) {
        for (int i = 0; i < KD_DTREE_HDR; i++) hdr[i] = 0;
        hdr[KD_DTREE_R_BUILD] = t.status[0];
        hdr[KD_DTREE_R_BUILD + 1] = t.status[1];
        hdr[KD_DTREE_R_N] = t.status[2];
        s_child[0] = s_child[1] = s_child[2] = INT_MAX;
    }
    __syncthreads();
    int cur = 0, tau = 0, step = 0;
    int32_t bonus = -1;
    for (;;) {                 /* every thread takes the same decisions (uniform control flow) */
        int32_t rs = sampled ? t.row_status[cur] : 0;
        if (rs) {
            if (tid == 0) {
                hdr[KD_DTREE_R_STATUS] = rs;
                hdr[KD_DTREE_R_NODE] = cur;
                hdr[KD_DTREE_R_POS] = t.pos[cur] + 1;
            }
            break;
        }
        if (tid == 0) {
            nodes[tau] = cur;
            toks[tau] = t.token[cur];
        }
        tau++;
        const int32_t next = t.target[cur];
        const int slot = step % 3;
        for (int j = cur + 1 + tid; j <= n; j += blockDim.x)
            if (t.parent[j] == cur && t.token[j] == next) {
                atomicMin(&s_child[slot], j);
                break;                 /* this thread's later j are larger */
            }
        if (tid == 0) s_child[(step + 1) % 3] = INT_MAX;
        __syncthreads();
        const int c = s_child[slot];
        if (c == INT_MAX || tau >= N) {
            bonus = next;
            break;
        }
        cur = c;
        step++;
    }
    if (tid == 0) {
        hdr[KD_DTREE_R_TAU] = tau;
        hdr[KD_DTREE_R_BONUS] = bonus;
    }
}

/* ------------------------------------------------------------------ sample_rows */

/* order-preserving key of a logit (larger logit -> larger key; -0 == +0); NaN never reaches it */
__device__ __forceinline__ uint32_t okey(float v) {
    if (v == 0.0f) v = 0.0f;
    uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float okey_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ kd_u128 u128_zero() { return kd_u128_of(0); }

__device__ __forceinline__ kd_u128 shfl_xor_u128(kd_u128 v, int o) {
    kd_u128 r;
    r.lo = (uint64_t)__shfl_xor_sync(FULL, (unsigned long long)v.lo, o);
    r.hi = (uint64_t)__shfl_xor_sync(FULL, (unsigned long long)v.hi, o);
    return r;
}
__device__ __forceinline__ kd_u128 shfl_up_u128(kd_u128 v, int o) {
    kd_u128 r;
    r.lo = (uint64_t)__shfl_up_sync(FULL, (unsigned long long)v.lo, o);
    r.hi = (uint64_t)__shfl_up_sync(FULL, (unsigned long long)v.hi, o);
    return r;
}
__device__ __forceinline__ kd_u128 shfl_u128(kd_u128 v, int src) {
    kd_u128 r;
    r.lo = (uint64_t)__shfl_sync(FULL, (unsigned long long)v.lo, src);
    r.hi = (uint64_t)__shfl_sync(FULL, (unsigned long long)v.hi, src);
    return r;
}
__device__ __forceinline__ kd_u128 warp_sum_u128(kd_u128 v) {
    for (int o = 16; o > 0; o >>= 1) v = kd_u128_add(v, shfl_xor_u128(v, o));
    return v;
}

/* the block's shared scratch for sample_rows */
struct smp_shared {
    unsigned long long wlo[SMP_WARPS], whi[SMP_WARPS];   /* per-warp u128 partials */
    float redf[32];
    int redi[32];
    unsigned int hcnt[256];                              /* radix histograms: counts */
    unsigned long long hlo[256], hhi[256];               /* radix histograms: masses */
    int sel_d;
    unsigned int sel_kr;
    unsigned long long sel_lo, sel_hi;
    int res;
};

/* exact sum over the block; every thread gets it */
__device__ kd_u128 block_sum_u128(kd_u128 v, smp_shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_u128(v);
    __syncthreads();                     /* the previous user of wlo/whi is done */
    if (lane == 0) { sh.wlo[warp] = v.lo; sh.whi[warp] = v.hi; }
    __syncthreads();
    kd_u128 r = u128_zero();
    for (int w = 0; w < SMP_WARPS; w++) {
        kd_u128 x; x.lo = sh.wlo[w]; x.hi = sh.whi[w];
        r = kd_u128_add(r, x);
    }
    return r;
}

__device__ int block_min_int(int v, smp_shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL, v, o));
    __syncthreads();
    if (lane == 0) sh.redi[warp] = v;
    __syncthreads();
    int r = INT_MAX;
    for (int w = 0; w < SMP_WARPS; w++) r = min(r, sh.redi[w]);
    return r;
}

__device__ float block_max_float(float v, smp_shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    __syncthreads();
    if (lane == 0) sh.redf[warp] = v;
    __syncthreads();
    float r = -INFINITY;
    for (int w = 0; w < SMP_WARPS; w++) r = fmaxf(r, sh.redf[w]);
    return r;
}

/* exact add of a u128 mass into histogram bucket b (low word atomically, its carry into the high word) */
__device__ __forceinline__ void hist_add(smp_shared &sh, int b, kd_u128 m) {
    if (m.lo == 0 && m.hi == 0) return;
    unsigned long long old = atomicAdd(&sh.hlo[b], (unsigned long long)m.lo);
    unsigned long long carry = old + (unsigned long long)m.lo < old ? 1ull : 0ull;
    unsigned long long hi = (unsigned long long)m.hi + carry;
    if (hi) atomicAdd(&sh.hhi[b], hi);
}

/* The smallest i in [0, V) whose inclusive prefix sum of f exceeds goal(total of f), or -1.
 * Each warp sums its contiguous segment; every thread finds the segment where the prefix
 * crosses; that warp scans it in chunks of 32 with a shuffle scan. f(i) is a u128. */
template <class F, class G>
__device__ int first_exceeding(const F &f, const G &goal, int V, smp_shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int seg = ((V + SMP_WARPS - 1) / SMP_WARPS + 31) & ~31;
    const int lo = warp * seg, hi = min(V, lo + seg);
    kd_u128 acc = u128_zero();
    for (int i = lo + lane; i < hi; i += 32) acc = kd_u128_add(acc, f(i));
    acc = warp_sum_u128(acc);
    __syncthreads();                     /* wlo/whi and res: earlier users are done */
    if (lane == 0) { sh.wlo[warp] = acc.lo; sh.whi[warp] = acc.hi; }
    if (threadIdx.x == 0) sh.res = -1;
    __syncthreads();
    kd_u128 total = u128_zero();
    for (int w = 0; w < SMP_WARPS; w++) {
        kd_u128 x; x.lo = sh.wlo[w]; x.hi = sh.whi[w];
        total = kd_u128_add(total, x);
    }
    const kd_u128 target = goal(total);
    kd_u128 cum = u128_zero();
    int sel = -1;
    for (int w = 0; w < SMP_WARPS; w++) {
        kd_u128 x; x.lo = sh.wlo[w]; x.hi = sh.whi[w];
        kd_u128 nx = kd_u128_add(cum, x);
        if (kd_u128_lt(target, nx)) { sel = w; break; }
        cum = nx;
    }
    if (sel >= 0 && warp == sel) {
        const int lo2 = sel * seg, hi2 = min(V, lo2 + seg);
        kd_u128 base = cum;
        for (int c0 = lo2; c0 < hi2; c0 += 32) {
            const int i = c0 + lane;
            kd_u128 incl = i < hi2 ? f(i) : u128_zero();
            for (int o = 1; o < 32; o <<= 1) {
                kd_u128 u = shfl_up_u128(incl, o);
                if (lane >= o) incl = kd_u128_add(incl, u);
            }
            const bool hit = i < hi2 && kd_u128_lt(target, kd_u128_add(base, incl));
            const unsigned b = __ballot_sync(FULL, hit);
            if (b) {
                if (lane == __ffs(b) - 1) sh.res = i;
                break;
            }
            base = kd_u128_add(base, shfl_u128(incl, 31));
        }
    }
    __syncthreads();
    return sh.res;
}

__global__ void __launch_bounds__(SMP_THREADS) sample_rows_kernel(const float *x, long long ld, int V, double T,
                                                                   int top_k, float top_p, uint64_t seed,
                                                                   const int32_t *pos, int pos_offset, int32_t *out,
                                                                   int32_t *code) {
    __shared__ smp_shared sh;
    const int tid = threadIdx.x, row = blockIdx.x;
    const float *xr = x + (size_t)row * (size_t)ld;

    /* 1. validate; the row max */
    float m = -INFINITY;
    int bad = INT_MAX;
    for (int i = tid; i < V; i += SMP_THREADS) {
        float v = xr[i];
        if (v != v || v == INFINITY) bad = min(bad, i);
        else m = fmaxf(m, v);
    }
    m = block_max_float(m, sh);
    bad = block_min_int(bad, sh);
    if (bad != INT_MAX || m == -INFINITY) {
        if (tid == 0) {
            int32_t c = KD_SAMPLE_ERR_ALLNEG;
            if (bad != INT_MAX) {
                float v = xr[bad];
                c = (v != v ? KD_SAMPLE_ERR_NAN : KD_SAMPLE_ERR_PINF) | (int32_t)((uint32_t)bad << 2);
            }
            code[row] = c;
            out[row] = -1;
        }
        return;
    }
    const double z = kd_rule_zmax(m, T);

    /* 2. top-k: the k-th of the order (kkey, kid); kept_k(i) = key > kkey || (key == kkey && i <= kid) */
    uint32_t kkey = 0;
    int kid = INT_MAX;
    if (top_k > 0 && top_k < V) {
        uint32_t prefix = 0, mask = 0;
        unsigned int kr = (unsigned)top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += SMP_THREADS) sh.hcnt[i] = 0;
            __syncthreads();
            for (int i = tid; i < V; i += SMP_THREADS) {
                uint32_t key = okey(xr[i]);
                if ((key & mask) == prefix) atomicAdd(&sh.hcnt[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                unsigned int cum = 0;
                int d = 255;
                for (; d > 0; d--) {
                    if (cum + sh.hcnt[d] >= kr) break;
                    cum += sh.hcnt[d];
                }
                sh.sel_d = d;
                sh.sel_kr = kr - cum;
            }
            __syncthreads();
            prefix |= (uint32_t)sh.sel_d << shift;
            mask |= 255u << shift;
            kr = sh.sel_kr;
            __syncthreads();
        }
        kkey = prefix;
        const uint32_t kk = kkey;
        /* the kr-th lowest id whose key is kkey */
        kid = first_exceeding([&](int i) { return kd_u128_of(okey(xr[i]) == kk ? 1u : 0u); },
                              [&](kd_u128) { return kd_u128_of(kr - 1); }, V, sh);
    }
    auto kept_k = [&](int i, uint32_t key) { return key > kkey || (key == kkey && i <= kid); };

    /* 3. top-p: the nucleus's last element (pkey, pid) by a radix search on masses */
    const bool topp = top_p > 0.0f && top_p < 1.0f;
    uint32_t pkey = 0;
    int pid = INT_MAX;
    if (topp) {
        for (int i = tid; i < 256; i += SMP_THREADS) { sh.hlo[i] = 0; sh.hhi[i] = 0; }
        __syncthreads();
        /* the kept mass S and the masses by the key's top byte (run-length: one atomic per run) */
        kd_u128 part = u128_zero(), run = u128_zero();
        int run_b = -1;
        for (int i = tid; i < V; i += SMP_THREADS) {
            float v = xr[i];
            uint32_t key = okey(v);
            if (!kept_k(i, key)) continue;
            uint64_t q = kd_rule_mass(v, T, z);
            part = kd_u128_add64(part, q);
            int b = (int)(key >> 24);
            if (b != run_b) {
                if (run_b >= 0) hist_add(sh, run_b, run);
                run_b = b;
                run = u128_zero();
            }
            run = kd_u128_add64(run, q);
        }
        if (run_b >= 0) hist_add(sh, run_b, run);
        const kd_u128 S = block_sum_u128(part, sh);     /* its barrier also completes the histogram */
        const kd_u128 G = kd_rule_top_p_goal(S, top_p);
        kd_u128 before = u128_zero();
        uint32_t prefix = 0, mask = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (shift < 24) {
                for (int i = tid; i < 256; i += SMP_THREADS) { sh.hlo[i] = 0; sh.hhi[i] = 0; }
                __syncthreads();
                run = u128_zero();
                run_b = -1;
                for (int i = tid; i < V; i += SMP_THREADS) {
                    float v = xr[i];
                    uint32_t key = okey(v);
                    if ((key & mask) != prefix || !kept_k(i, key)) continue;
                    uint64_t q = kd_rule_mass(v, T, z);
                    int b = (int)((key >> shift) & 255u);
                    if (b != run_b) {
                        if (run_b >= 0) hist_add(sh, run_b, run);
                        run_b = b;
                        run = u128_zero();
                    }
                    run = kd_u128_add64(run, q);
                }
                if (run_b >= 0) hist_add(sh, run_b, run);
                __syncthreads();
            }
            if (tid == 0) {   /* digits from the largest: the first whose mass reaches G */
                kd_u128 b = before;
                int d = 255;
                for (; d > 0; d--) {
                    kd_u128 h; h.lo = sh.hlo[d]; h.hi = sh.hhi[d];
                    kd_u128 nb = kd_u128_add(b, h);
                    if (!kd_u128_lt(nb, G)) break;
                    b = nb;
                }
                sh.sel_d = d;
                sh.sel_lo = b.lo;
                sh.sel_hi = b.hi;
            }
            __syncthreads();
            prefix |= (uint32_t)sh.sel_d << shift;
            mask |= 255u << shift;
            before.lo = sh.sel_lo;
            before.hi = sh.sel_hi;
            __syncthreads();
        }
        pkey = prefix;
        uint64_t qe = kd_rule_mass(okey_value(pkey), T, z);   /* equal logits: equal masses */
        if (qe == 0) qe = 1;                                   /* not reached: the crossing run has mass */
        const unsigned long long c = kd_u128_div64_ceil(kd_u128_sub(G, before), qe);
        const uint32_t pk = pkey;
        /* the c-th lowest kept id whose key is pkey */
        pid = first_exceeding([&](int i) { uint32_t key = okey(xr[i]); return kd_u128_of(key == pk && kept_k(i, key) ? 1u : 0u); },
                              [&](kd_u128) { return kd_u128_of(c - 1); }, V, sh);
    }
    auto kept = [&](int i, uint32_t key) {
        return kept_k(i, key) && (!topp || key > pkey || (key == pkey && i <= pid));
    };

    /* 4. the draw: the first kept id (ascending) whose prefix mass exceeds floor(U W / 2^53) */
    const uint64_t U = kd_rule_u53(seed, (int64_t)pos[row] + pos_offset);
    const int tok = first_exceeding(
        [&](int i) {
            float v = xr[i];
            uint32_t key = okey(v);
            return kd_u128_of(kept(i, key) ? kd_rule_mass(v, T, z) : 0u);
        },
        [&](kd_u128 W) { return kd_rule_target(U, W); }, V, sh);
    if (tid == 0) {
        out[row] = tok;
        code[row] = 0;
    }
}

}  // namespace

/* ------------------------------------------------------------------ entry points */

extern "C" kd_status kd_cuda_tree_select(kd_backend *be, const kd_dtree *t, int L, int K, int budget) {
    kd_cuda *c = kd_cuda_of(be);
    if (!t || L <= 0 || L > KD_TREE_MAX_DEPTH || K <= 0 || K > 0xffff || budget < 0 || budget > t->cap ||
        (long long)L * K > t->topk_cap)
        return kd_fail(KD_ERR_ARG, "cuda tree_select: L = %d, K = %d, budget = %d do not fit the tree (%d nodes, %d list "
                       "entries)", L, K, budget, t ? t->cap : 0, t ? t->topk_cap : 0);
    size_t smem = (2 * (size_t)budget + 1) * (sizeof(double) + 2 * sizeof(int)) + 3 * ((size_t)budget + 1) * sizeof(int);
    if (budget > SEL_MAX_BUDGET || smem > c->smem_optin)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda tree_select: budget %d needs %zu bytes of shared memory (at most %d "
                       "nodes, %zu bytes here)", budget, smem, SEL_MAX_BUDGET, c->smem_optin);
    KD_TRY(kd_cuda_smem(c, (const void *)tree_select_kernel, smem));
    tree_select_kernel<<<1, SEL_THREADS, smem, c->stream>>>(*t, L, K, budget);
    KD_CUDA_LAUNCH("tree_select_kernel");
    return KD_OK;
}

extern "C" kd_status kd_cuda_tree_stage(kd_backend *be, const kd_dtree *t, int n, int32_t root, int32_t pos0,
                                        int32_t *ids, int32_t *pos_out, uint64_t *vis_out) {
    kd_cuda *c = kd_cuda_of(be);
    if (!t || n < 0 || n > t->cap) return kd_fail(KD_ERR_ARG, "cuda tree_stage: %d nodes in a tree of %d", n, t ? t->cap : 0);
    if (ids && (!pos_out || !vis_out)) return kd_fail(KD_ERR_ARG, "cuda tree_stage: ids without positions or mask");
    size_t words = (size_t)(n + 1 + 63) / 64, work = ids ? (size_t)(n + 1) * words : (size_t)n + 1;
    int blocks = (int)((work + 255) / 256);
    if (blocks > 1024) blocks = 1024;
    tree_stage_kernel<<<blocks, 256, 0, c->stream>>>(*t, n, root, pos0, ids, pos_out, ids ? vis_out : NULL);
    KD_CUDA_LAUNCH("tree_stage_kernel");
    return KD_OK;
}

extern "C" kd_status kd_cuda_sample_rows(kd_backend *be, kd_act x, const kd_sampler *sp, const int32_t *pos,
                                         int pos_offset, int32_t *out, int32_t *code) {
    kd_cuda *c = kd_cuda_of(be);
    if (x.dtype != KD_F32)
        return kd_fail(KD_ERR_ARG, "cuda sample_rows: logits: expected f32, got %s", kd_dtype_name(x.dtype));
    if (x.rows < 0 || x.cols <= 0 || x.cols > KD_SAMPLE_MAX_VOCAB || (x.rows > 0 && (!x.data || x.ld < x.cols)))
        return kd_fail(KD_ERR_ARG, "cuda sample_rows: logits: bad view %d x %d (ld %d; at most %d columns)", x.rows,
                       x.cols, x.ld, KD_SAMPLE_MAX_VOCAB);
    if (!sp || !(sp->temperature > 0.0f)) return kd_fail(KD_ERR_ARG, "cuda sample_rows: a greedy sampler (use argmax)");
    if (!x.rows) return KD_OK;
    if (!pos || !out || !code) return kd_fail(KD_ERR_ARG, "cuda sample_rows: positions / out / code are NULL");
    sample_rows_kernel<<<x.rows, SMP_THREADS, 0, c->stream>>>((const float *)x.data, x.ld, x.cols,
                                                              (double)sp->temperature, sp->top_k, sp->top_p, sp->seed,
                                                              pos, pos_offset, out, code);
    KD_CUDA_LAUNCH("sample_rows_kernel");
    return KD_OK;
}

extern "C" kd_status kd_cuda_tree_walk(kd_backend *be, const kd_dtree *t, int n, int sampled) {
    kd_cuda *c = kd_cuda_of(be);
    if (!t || n < 0 || n > t->cap) return kd_fail(KD_ERR_ARG, "cuda tree_walk: %d nodes in a tree of %d", n, t ? t->cap : 0);
    tree_walk_kernel<<<1, WALK_THREADS, 0, c->stream>>>(*t, n, sampled);
    KD_CUDA_LAUNCH("tree_walk_kernel");
    return KD_OK;
}
