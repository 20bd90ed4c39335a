/* ddtree.cu: the DDTree round on the device (backend.h: tree_select, tree_stage, sample_rows,
 * tree_walk). Each op gives exactly what its CPU twin (core/cpu/cpu_ddtree.c) gives:
 *
 * tree_select  Algorithm 1 (core/tree.c) in one block, by one of two paths; status word 3 says
 *              which (1: parallel).
 *              Parallel: Algorithm 1 pops the nodes in the order (key descending, rank tuple
 *              ascending) of the whole tree when every key is at most its predecessor's (its
 *              parent's, its previous sibling's), and each popped key is the one the heap
 *              computes when it is exact: then (s - a[r]) + a[r+1] = s' + a[r+1] for the
 *              parent's key s'. So when the lists fall along each row and hold no value above 0
 *              below depth 1, the path takes a threshold t from a binned count of the nodes by
 *              cost (a convolution per depth, twice: the second over the first's range), lists
 *              every node whose key (parent's key + its value, one rounding) is at least t level
 *              by level (children: a binary search; their slots: a block scan), sorts them
 *              (bitonic), keeps the first min(budget, K + .. + K^L) and checks each kept key exact
 *              (TwoSum's error is 0) and each parent first. Any condition failing (rounded sums,
 *              too many nodes at t, depths past SEL_FAST_DEPTH, NaN) hands the tree to:
 *              One node at a time: warp 0 keeps the frontier of
 *              (score, parent, depth, rank) entries in shared memory, unordered; each pop
 *              takes its first entry in pop order by a scan of the lanes' slots and two warp
 *              max reductions of the score's order-preserving 64-bit key (a pop is a chain of
 *              dependent instructions: ncu counted ~235 per pop with a butterfly of doubles);
 *              exact score ties are ordered by rank tuples read up the parent chains, on a
 *              slow path taken only when two entries share the best key. Scores are
 *              updated in double with the same
 *              operations in the same order as the host (__d*_rn: no fma contraction). The
 *              other threads check the lists for NaN / +inf first and write the parents,
 *              depths and ancestor masks afterwards (one row per thread).
 * tree_stage   root token and positions (pos0 + depth); optionally the verify forward's
 *              inputs (ids, positions, mask) into the sequence's scratch.
 * sample_rows  the keyed sampling rule (core/sample.c). Masses are integers (sample_rule.h,
 *              the same code as the host) summed exactly in 128 bits, so the parallel sums
 *              equal the host's sequential ones whatever their grouping. The passes over a
 *              whole row run over several blocks per row (SMP_SLICE ids each, a thread's loaded
 *              together), as one block's pass over a 163840-id row is latency-bound: each
 *              slice's max and first NaN / +inf id (smp_max_kernel); with top-k / top-p, each
 *              slice's histogram by distance below the row max, counts and masses for top-p
 *              (smp_bins_kernel); each slice's kept mass (smp_mass_kernel). The cut of top-k /
 *              top-p (the last kept element of the order logit descending, id ascending;
 *              sample_cut_kernel, a block per row)
 *              comes from the bins that can hold it (smp_plan_kernel): their ids are gathered
 *              over several blocks per row (smp_gather_kernel) and sorted in shared memory
 *              (cut_by_bins); when they start at the max every kept id
 *              is there and the draw is made from them; otherwise the gather also sums each
 *              slice's mass in the bins before them (all kept) and the cut adds the kept
 *              candidates', so no pass follows the cut. Rows whose bins are too crowded (ties)
 *              fall back to radix passes on the logit's 32-bit key (cut_by_radix) and the kept-
 *              mass pass. The draw over a row (smp_draw_kernel, a block per row) finds the
 *              slice where the slices' kept-mass prefix passes its target and searches that
 *              slice alone. min-p zeroes the masses below its floor; with a cut or a floor the
 *              passes queue the values that need an exp, so a warp's exps are not spent on lanes
 *              that need none. Prefix searches (the draw, and the radix path's
 *              last kept id among equal logits) sum tiles, find the crossing tile by one block
 *              scan and scan that tile with one warp. Logits far below the max get mass 0
 *              without the exp (smp_mass says why that is exact).
 * tree_walk    the accept walk: one block; each step every thread scans a slice of the
 *              nodes for the child (parent == cur, token == target[cur]); the smallest id
 *              wins (atomicMin), as the host's child lists are in pop order.
 * Every launch is checked; the kernels index only inside the arrays their callers sized. */
#include "cuda_internal.cuh"
#include "sample_rule.h"
#include <float.h>
#include <limits.h>

namespace {

constexpr int SEL_THREADS = 512;
constexpr int SEL_MAX_BUDGET = 4096;      /* frontier + node arrays in shared memory: ~180 KB at 4096 */
constexpr int SEL_FAST_DEPTH = 16;        /* the parallel path: depths (its rank tuples), ... */
constexpr int SEL_FAST_CAP = 2048;        /* ... nodes it enumerates, ... */
constexpr int SEL_BINS = 128;             /* ... bins of its count estimate, */
constexpr int SEL_PASSES = 4;             /* ... count passes at most, */
constexpr int SEL_PARTS = SEL_THREADS / SEL_BINS;   /* threads a bin in the estimate's convolutions */
constexpr int SMP_THREADS = 512;
constexpr int SMP_WARPS = SMP_THREADS / 32;
constexpr int SMP_TILES = SMP_THREADS;    /* a prefix search's segments: one per thread in its scan */
constexpr int SMP_BINS = 1024;            /* the cut's fast path: bins below the row max ... */
constexpr double SMP_SPAN = 44.0;         /* ... covering x/T in [m/T - 44, m/T] (below: every mass is 0) */
constexpr int SMP_CAP = 2048;             /* ... and at most this many ids in the bins that hold the cut */
constexpr int SMP_SLICE = 8192;           /* ids per block of the row-wide passes (max, bins, mass) ... */
constexpr int SMP_PER = SMP_SLICE / SMP_THREADS;   /* ... SMP_PER a thread, loaded together */
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

/* a score's key: unsigned and in the scores' order (scores are finite: list values are clamped).
 * -0 is keyed as +0, as they compare equal; the sign of a zero score changes no later sum's value
 * or order (the tree outputs no score). Finite scores key above 0, the parallel path's padding. */
__device__ __forceinline__ unsigned long long score_key(double s) {
    const unsigned long long b = (unsigned long long)__double_as_longlong(s == 0.0 ? 0.0 : s);
    return b >> 63 ? ~b : b | 0x8000000000000000ull;
}
__device__ __forceinline__ double key_score(unsigned long long k) {
    return __longlong_as_double((long long)(k >> 63 ? k & 0x7fffffffffffffffull : ~k));
}

/* ---- the parallel path (see the top of the file) */

struct sel_fast {                /* its shared memory, for cap nodes */
    double *key;                 /* each listed node's score, */
    int *par, *dr;               /* its parent (listing index; -1: the root), depth << 16 | rank */
    unsigned long long *skey;    /* the sort: score keys, */
    int *sidx;                   /* and listing indices */
    int *offs;                   /* a level's child offsets (cap + 1), then each node's number */
    float *bins, *cnt, *part, *tot;   /* the count estimate: per-depth deficit bins, convolutions */
};

__host__ __device__ inline size_t sel_fast_bytes(int cap) {
    return (size_t)cap * (2 * sizeof(double) + 3 * sizeof(int)) + ((size_t)cap + 1) * sizeof(int) +
           (size_t)(SEL_FAST_DEPTH * SEL_BINS + 3 * SEL_BINS + SEL_THREADS) * sizeof(float);
}

__device__ sel_fast sel_fast_at(void *base, int cap) {
    sel_fast f;
    f.key = (double *)base;
    f.skey = (unsigned long long *)(f.key + cap);
    f.par = (int *)(f.skey + cap);
    f.dr = f.par + cap;
    f.sidx = f.dr + cap;
    f.offs = f.sidx + cap;
    f.bins = (float *)(f.offs + cap + 1);
    f.cnt = f.bins + SEL_FAST_DEPTH * SEL_BINS;   /* two rows: a depth's counts and the next's */
    f.tot = f.cnt + 2 * SEL_BINS;
    f.part = f.tot + SEL_BINS;                    /* SEL_THREADS partial sums */
    return f;
}

/* The count estimate. A node's cost is the distance of its key below the best depth-1 value: the
 * sum of its deficits, a[0][0] - a[0][r] at depth 1 and -a[d][r] below (>= 0 on the lists this
 * path takes). Each deficit binned as floor(deficit / w), cnt[j] counts a depth's nodes whose
 * binned deficits sum to j (the next depth's: a convolution with that depth's bins) and tot every
 * depth's. A node whose binned sum is j costs less than w (j + L), and one costing at most w j
 * has a binned sum of at most j. Returns the first J whose cumulative count reaches need, or
 * SEL_BINS when the bins hold fewer nodes. Counts are floats, exact up to 2^24 and saturated. */
__device__ int sel_count_bins(const sel_fast &f, const float *vals, int L, int K, double a00, double w, float need) {
    __shared__ int s_j;
    const int tid = threadIdx.x;
    for (int i = tid; i < L * SEL_BINS; i += blockDim.x) f.bins[i] = 0.0f;
    __syncthreads();
    for (int i = tid; i < L * K; i += blockDim.x) {
        const int d = i / K;
        const double v = list_value(vals, i), deficit = d ? -v : a00 - v;
        const double b = w > 0.0 ? floor(deficit / w) : (deficit == 0.0 ? 0.0 : (double)SEL_BINS);
        if (b < SEL_BINS) atomicAdd(&f.bins[d * SEL_BINS + (int)b], 1.0f);
    }
    __syncthreads();
    float *cur = f.cnt, *nxt = f.cnt + SEL_BINS;
    for (int j = tid; j < SEL_BINS; j += blockDim.x) cur[j] = f.tot[j] = f.bins[j];
    __syncthreads();
    const int j = tid % SEL_BINS, q = tid / SEL_BINS;   /* SEL_PARTS threads a bin */
    for (int d = 1; d < L; d++) {
        const float *bd = f.bins + d * SEL_BINS;
        float s = 0.0f;
        for (int i = q; i <= j; i += SEL_PARTS) s += cur[i] * bd[j - i];
        f.part[q * SEL_BINS + j] = s;
        __syncthreads();
        if (tid < SEL_BINS) {
            float c = 0.0f;
            for (int p = 0; p < SEL_PARTS; p++) c += f.part[p * SEL_BINS + tid];
            nxt[tid] = fminf(c, 1e30f);
            f.tot[tid] = fminf(f.tot[tid] + c, 1e30f);
        }
        __syncthreads();
        float *x = cur;
        cur = nxt;
        nxt = x;
    }
    if (tid < 32) {   /* a lane's SEL_BINS / 32 bins, a scan across the lanes, the crossing lane's walk */
        constexpr int PER = SEL_BINS / 32;
        float sum = 0.0f;
        for (int k = 0; k < PER; k++) sum += f.tot[tid * PER + k];
        float incl = sum;
        for (int o = 1; o < 32; o <<= 1) {
            const float u = __shfl_up_sync(FULL, incl, o);
            if (tid >= o) incl += u;
        }
        const unsigned hit = __ballot_sync(FULL, incl >= need);
        if (tid == 0) s_j = SEL_BINS;
        __syncwarp();
        if (hit && tid == __ffs(hit) - 1) {
            int jj = tid * PER + PER - 1;   /* float rounding of huge counts: the lane's last bin */
            float c = incl - sum;
            for (int k = 0; k < PER; k++)
                if ((c += f.tot[tid * PER + k]) >= need) { jj = tid * PER + k; break; }
            s_j = jj;
        }
    }
    __syncthreads();
    return s_j;
}

/* x[0..n) -> their exclusive prefix sums and x[n] = the total, which every thread gets */
__device__ int sel_scan(int *x, int n) {
    __shared__ int s_warp[SEL_THREADS / 32], s_total;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = (n + blockDim.x - 1) / blockDim.x, lo = min(n, tid * per), hi = min(n, lo + per);
    int sum = 0;
    for (int i = lo; i < hi; i++) sum += x[i];
    int incl = sum;
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(FULL, incl, o);
        if (lane >= o) incl += u;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (tid < 32) {
        const int nw = (int)(blockDim.x >> 5);
        int w = tid < nw ? s_warp[tid] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(FULL, w, o);
            if (tid >= o) w += u;
        }
        if (tid < nw) s_warp[tid] = w;   /* inclusive over warps */
    }
    __syncthreads();
    int run = incl - sum + (warp ? s_warp[warp - 1] : 0);
    for (int i = lo; i < hi; i++) {
        const int v = x[i];
        x[i] = run;
        run += v;
    }
    if (tid == (int)blockDim.x - 1) { x[n] = run; s_total = run; }
    __syncthreads();
    return s_total;
}

/* Every node whose key is at least t, level by level into f (the children of a node of key k:
 * the ranks r with k + a[d][r] >= t, a prefix of the list, as the keys fall with the rank: a
 * binary search). Returns how many, or -1 past cap. */
__device__ int sel_enumerate(const sel_fast &f, const float *vals, int L, int K, double t, int cap) {
    __shared__ int s_c;
    const int tid = threadIdx.x;
    if (tid == 0) s_c = 0;
    __syncthreads();
    for (int r = tid; r < K; r += blockDim.x)
        if (list_value(vals, r) >= t && (r + 1 == K || !(list_value(vals, r + 1) >= t))) s_c = r + 1;
    __syncthreads();
    int s = 0, e = s_c;
    if (e > cap) return -1;
    for (int r = tid; r < e; r += blockDim.x) {
        f.key[r] = list_value(vals, r);
        f.par[r] = -1;
        f.dr[r] = 1 << 16 | r;
    }
    __syncthreads();
    for (int d = 1; d < L && e > s; d++) {
        const int np = e - s, row = d * K;
        for (int p = tid; p < np; p += blockDim.x) {
            const double k = f.key[s + p];
            int lo = 0, hi = K;   /* the first rank whose key falls below t */
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (__dadd_rn(k, list_value(vals, row + mid)) >= t) lo = mid + 1;
                else hi = mid;
            }
            f.offs[p] = lo;
        }
        __syncthreads();
        const int total = sel_scan(f.offs, np);
        if (total > cap - e) return -1;
        for (int o = tid; o < total; o += blockDim.x) {
            int lo = 0, hi = np;   /* the parent: the last p with offs[p] <= o */
            while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (f.offs[mid] <= o) lo = mid;
                else hi = mid;
            }
            const int r = o - f.offs[lo], i = e + o;
            f.key[i] = __dadd_rn(f.key[s + lo], list_value(vals, row + r));
            f.par[i] = s + lo;
            f.dr[i] = (d + 1) << 16 | r;
        }
        __syncthreads();
        s = e;
        e += total;
    }
    return e;
}

/* enumerated node a pops before b (b = -1: the sort's padding, after everything) */
__device__ bool sel_before(const sel_fast &f, unsigned long long ka, int a, unsigned long long kb, int b) {
    if (ka != kb) return ka > kb;
    if (a < 0 || b < 0) return a >= 0 && b < 0;
    int ra[SEL_FAST_DEPTH], rb[SEL_FAST_DEPTH];
    const int na = f.dr[a] >> 16, nb = f.dr[b] >> 16;
    for (int u = a; u >= 0; u = f.par[u]) ra[(f.dr[u] >> 16) - 1] = f.dr[u] & 0xffff;
    for (int u = b; u >= 0; u = f.par[u]) rb[(f.dr[u] >> 16) - 1] = f.dr[u] & 0xffff;
    const int n = na < nb ? na : nb;
    for (int i = 0; i < n; i++)
        if (ra[i] != rb[i]) return ra[i] < rb[i];
    return na < nb;
}

/* p + q == s exactly (s = p + q rounded): TwoSum's error term is zero */
__device__ __forceinline__ bool sum_exact(double p, double q, double s) {
    const double qq = __dsub_rn(s, p), pp = __dsub_rn(s, qq);
    return __dadd_rn(__dsub_rn(p, pp), __dsub_rn(q, qq)) == 0.0;
}

/* The parallel path: nodes 1..n into t.token and np / nd / nr, n returned; -1 when its conditions
 * fail (the caller pops one node at a time instead). The whole block calls it. */
__device__ int select_parallel(const kd_dtree &t, const float *vals, const int32_t *ids, int L, int K, int budget,
                               int cap, void *work, int *np, int *nd, int *nr) {
    __shared__ int s_fail;
    const sel_fast f = sel_fast_at(work, cap);
    const int tid = threadIdx.x;
    long long total = 0, level = 1;   /* Algorithm 1 pops min(budget, K + ... + K^L) nodes */
    for (int d = 0; d < L && total < budget; d++) {
        level = min(level * K, (long long)budget);
        total += level;
    }
    const int need = (int)min(total, (long long)budget);

    /* the threshold t: a cost bound R that need nodes are within (the need-th depth-1 value, or the
     * sum of the lists' last values), the estimate's J over bins of R / span (so that every node
     * within R is in the bins), then again over bins of the bound w (J + L) it gives while that
     * bound halves: its margin over the need-th node's cost is L bins, which crowded lists (every
     * depth's values within a few bins) would otherwise fill past cap */
    const double a00 = list_value(vals, 0);
    double R = a00 - list_value(vals, K - 1);
    for (int d = 1; d < L; d++) R -= list_value(vals, d * K + K - 1);
    if (K >= budget) R = fmin(R, a00 - list_value(vals, budget - 1));
    if (!(R <= 1e300)) return -1;
    const int span = SEL_BINS - L - 1;
    double bound = R;
    for (int pass = 0; pass < SEL_PASSES; pass++) {
        const double w = bound / span;
        const int J = sel_count_bins(f, vals, L, K, a00, w, (float)need);
        if (J >= SEL_BINS) return -1;
        bound = fmin(bound, w * (J + L));
        if (2 * (J + L) > span) break;
    }
    const int n_enum = sel_enumerate(f, vals, L, K, a00 - bound, cap);
    if (n_enum < need) return -1;   /* past cap, or short of need (the estimate's rounding) */

    /* the pop order: key descending, rank tuple ascending (bitonic, padded to a power of two) */
    int P = 1;
    while (P < n_enum) P <<= 1;
    for (int i = tid; i < P; i += blockDim.x) {
        f.skey[i] = i < n_enum ? score_key(f.key[i]) : 0ull;
        f.sidx[i] = i < n_enum ? i : -1;
    }
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < P / 2; i += blockDim.x) {
                const int lo = ((i & ~(stride - 1)) << 1) | (i & (stride - 1)), hi = lo + stride;
                const unsigned long long ka = f.skey[lo], kb = f.skey[hi];
                const int a = f.sidx[lo], b = f.sidx[hi];
                if ((lo & size) == 0 ? sel_before(f, kb, b, ka, a) : sel_before(f, ka, a, kb, b)) {
                    f.skey[lo] = kb; f.skey[hi] = ka;
                    f.sidx[lo] = b; f.sidx[hi] = a;
                }
            }
            __syncthreads();
        }

    /* the first need nodes are the pops when each key is exact (each popped node's key is then
     * the one the heap computes); node numbers in offs, parents must come first */
    if (tid == 0) s_fail = 0;
    for (int i = tid; i < n_enum; i += blockDim.x) f.offs[i] = INT_MAX;
    __syncthreads();
    for (int i = tid; i < need; i += blockDim.x) {
        const int u = f.sidx[i], d = f.dr[u] >> 16, r = f.dr[u] & 0xffff;
        if (d > 1 && !sum_exact(f.key[f.par[u]], list_value(vals, (d - 1) * K + r), f.key[u])) s_fail = 1;
        f.offs[u] = i + 1;
    }
    __syncthreads();
    for (int i = tid; i < need; i += blockDim.x) {
        const int u = f.sidx[i], d = f.dr[u] >> 16, r = f.dr[u] & 0xffff;
        const int p = f.par[u] < 0 ? 0 : f.offs[f.par[u]];
        if (p > i) s_fail = 1;
        np[i + 1] = p;
        nd[i + 1] = d;
        nr[i + 1] = r;
        t.token[i + 1] = ids[(d - 1) * K + r];
    }
    if (tid == 0) { np[0] = -1; nd[0] = 0; nr[0] = -1; }
    __syncthreads();
    return s_fail ? -1 : need;
}

/* ---- the sequential path */

struct sel_front {
    unsigned long long *key;
    int *parent, *dr;          /* dr = depth << 16 | rank */
    const int *np, *nd, *nr;   /* popped nodes: parent, depth, rank */
};

/* the rank tuple of frontier entry e into out[0..depth) */
__device__ int entry_ranks(const sel_front &h, int e, int *out) {
    int d = h.dr[e] >> 16;
    out[d - 1] = h.dr[e] & 0xffff;
    for (int p = h.parent[e]; p > 0; p = h.np[p]) out[h.nd[p] - 1] = h.nr[p];
    return d;
}

/* entry a pops before entry b */
__device__ bool entry_before(const sel_front &h, int a, int b) {
    if (h.key[a] != h.key[b]) return h.key[a] > h.key[b];
    int ra[KD_TREE_MAX_DEPTH], rb[KD_TREE_MAX_DEPTH];
    int na = entry_ranks(h, a, ra), nb = entry_ranks(h, b, rb);
    int n = na < nb ? na : nb;
    for (int i = 0; i < n; i++)
        if (ra[i] != rb[i]) return ra[i] < rb[i];
    return na < nb;
}

/* the frontier's first entry in pop order when two or more share the best key: each lane its
 * slots, then a butterfly (entry_before is a strict total order, so every lane ends on the same
 * entry) */
__device__ int first_of_ties(const sel_front &h, int fn, int lane) {
    int bi = -1;
    for (int e = lane; e < fn; e += 32)
        if (bi < 0 || entry_before(h, e, bi)) bi = e;
    for (int o = 16; o > 0; o >>= 1) {
        const int oi = __shfl_xor_sync(FULL, bi, o);
        if (oi >= 0 && oi != bi && (bi < 0 || entry_before(h, oi, bi))) bi = oi;
    }
    return bi;
}

/* Algorithm 1's pops by warp 0 (lane 0 writes, __syncwarp publishes to the other lanes): nodes
 * 1..n into t.token and np / nd / nr, n returned on every lane */
__device__ int select_sequential(const kd_dtree &t, const float *vals, const int32_t *ids, int L, int K, int budget,
                                 void *work, int *np, int *nd, int *nr) {
    const int H = 2 * budget + 1, lane = threadIdx.x;
    unsigned long long *hk = (unsigned long long *)work;
    int *hpar = (int *)(hk + H);
    int *hdr = hpar + H;
    const sel_front h = { hk, hpar, hdr, np, nd, nr };
    if (lane == 0) {
        np[0] = -1; nd[0] = 0; nr[0] = -1;
        hk[0] = score_key(list_value(vals, 0)); hpar[0] = 0; hdr[0] = 1 << 16;
    }
    __syncwarp();
    int fn = 1, n = 0;   /* frontier entries [0, fn); nodes popped */
    while (fn > 0 && n < budget) {
        /* the best key: each lane its slots (tie: another of them has its best key), then
         * the warp's max, high word first */
        unsigned long long bk = 0;   /* below every entry's key */
        int bi = -1;
        bool tie = false;
        for (int e = lane; e < fn; e += 32) {
            const unsigned long long k = hk[e];
            if (k > bk) { bk = k; bi = e; tie = false; }
            else if (k == bk) tie = true;
        }
        const unsigned mh = __reduce_max_sync(FULL, (unsigned)(bk >> 32));
        const unsigned ml = __reduce_max_sync(FULL, (unsigned)(bk >> 32) == mh ? (unsigned)bk : 0u);
        const unsigned long long mk = (unsigned long long)mh << 32 | ml;
        const unsigned win = __ballot_sync(FULL, bk == mk), tied = __ballot_sync(FULL, bk == mk && tie);
        bi = (__popc(win) == 1 && !tied) ? __shfl_sync(FULL, bi, __ffs(win) - 1) : first_of_ties(h, fn, lane);
        const double bs = key_score(mk);
        const int parent = hpar[bi], d = hdr[bi] >> 16, r = hdr[bi] & 0xffff;
        const int i = ++n, row = (d - 1) * K;
        const bool sib = r + 1 < K, child = d < L;
        __syncwarp();    /* every lane has read entry bi */
        if (lane == 0) {
            t.token[i] = ids[row + r];
            np[i] = parent;
            nd[i] = d;
            nr[i] = r;
            int m = fn - 1;   /* the last entry fills the popped slot; the new ones go after it */
            hk[bi] = hk[m]; hpar[bi] = hpar[m]; hdr[bi] = hdr[m];
            if (sib) {
                hk[m] = score_key(__dadd_rn(__dsub_rn(bs, list_value(vals, row + r)), list_value(vals, row + r + 1)));
                hpar[m] = parent;
                hdr[m] = d << 16 | (r + 1);
                m++;
            }
            if (child) {
                hk[m] = score_key(__dadd_rn(bs, list_value(vals, d * K)));
                hpar[m] = i;
                hdr[m] = (d + 1) << 16;
            }
        }
        fn += (sib ? 1 : 0) + (child ? 1 : 0) - 1;
        __syncwarp();
    }
    return n;
}

/* the dynamic shared memory: the work region (the frontier, or the parallel path's cap nodes),
 * the popped nodes' parent / depth / rank, and the staged lists */
__host__ __device__ inline size_t sel_work_bytes(int budget, int cap) {
    const size_t front = (2 * (size_t)budget + 1) * (sizeof(unsigned long long) + 2 * sizeof(int));
    const size_t fast = cap ? sel_fast_bytes(cap) : 0;
    return ((front > fast ? front : fast) + 7) & ~(size_t)7;
}
__host__ __device__ inline size_t sel_smem_bytes(int L, int K, int budget, int cap, bool staged) {
    return sel_work_bytes(budget, cap) + 3 * ((size_t)budget + 1) * sizeof(int) +
           (staged ? (size_t)L * K * (sizeof(float) + sizeof(int32_t)) : 0);
}

/* the parallel path's room: 8 x budget nodes (a power of two, 64 to SEL_FAST_CAP) where the lists
 * are staged, the depth and budget allow it and its shared memory fits smem_max; else 0 (off) */
__host__ __device__ inline int sel_cap(int L, int K, int budget, bool staged, size_t smem_max) {
    int cap = 64;
    while (cap < 8 * budget && cap < SEL_FAST_CAP) cap <<= 1;
    const bool fits = staged && L <= SEL_FAST_DEPTH && 2 * budget <= cap &&
                      sel_smem_bytes(L, K, budget, cap, true) <= smem_max;
    return fits ? cap : 0;
}

/* staged: the L x K lists are copied into shared memory first (where kd_cuda_tree_select finds
 * room), so the selection's reads of them wait on shared memory, not on L2. cap > 0: the
 * parallel path may run, over at most cap nodes (it needs the lists staged). */
__global__ void __launch_bounds__(SEL_THREADS) tree_select_kernel(kd_dtree t, int L, int K, int budget, bool staged,
                                                                  int cap) {
    kd_griddep_enter();
    extern __shared__ double sel_smem[];
    __shared__ int s_bad, s_n, s_fast;
    char *work = (char *)sel_smem;
    int *np = (int *)(work + sel_work_bytes(budget, cap));
    int *nd = np + (budget + 1);
    int *nr = nd + (budget + 1);
    float *s_vals = (float *)(nr + (budget + 1));
    int32_t *s_ids = (int32_t *)(s_vals + L * K);
    const int tid = threadIdx.x;

    if (tid == 0) {
        s_bad = INT_MAX;
        s_fast = cap > 0 && staged && budget > 0 && L <= SEL_FAST_DEPTH;
    }
    __syncthreads();
    const int total = L * K;
    for (int i = tid; i < total; i += blockDim.x) {
        float v = t.vals[i];
        if (v != v || v == INFINITY) atomicMin(&s_bad, i);
        if (staged) {
            s_vals[i] = v;
            s_ids[i] = t.ids[i];
        }
        /* the parallel path's lists: each row falling, and no value above 0 below depth 1 */
        const int r = i % K;
        if ((r + 1 < K && list_value(t.vals, i) < list_value(t.vals, i + 1)) || (i >= K && r == 0 && !(v <= 0.0f)))
            s_fast = 0;
    }
    __syncthreads();
    const float *vals = staged ? s_vals : t.vals;
    const int32_t *ids = staged ? s_ids : t.ids;

    int n = s_fast && s_bad == INT_MAX ? select_parallel(t, vals, ids, L, K, budget, cap, work, np, nd, nr) : -1;
    const bool parallel = n >= 0;
    if (!parallel && tid < 32) {
        n = select_sequential(t, vals, ids, L, K, budget, work, np, nd, nr);
        if (tid == 0) s_n = n;
    }
    if (tid == 0) {
        if (parallel) s_n = n;
        int bad = s_bad;
        float bv = bad != INT_MAX ? t.vals[bad] : 0.0f;
        t.status[0] = bad == INT_MAX ? 0 : (bv != bv ? 1 : 2);
        t.status[1] = bad == INT_MAX ? 0 : bad;
        t.status[3] = parallel;
    }
    __syncthreads();
    n = s_n;
    if (tid == 0) t.status[2] = n;
    const int words = (n + 1 + 63) / 64;
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
    kd_griddep_enter();
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
    kd_griddep_enter();
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

/* The block's shared scratch for sample_rows (dynamic shared memory, SMP_SMEM bytes).
 * bins: the fast path's histogram of the row by distance below the max; cand: the candidates
 * of the bins that hold the cut, sorted in place; tiles: the prefix searches' segment sums. */
struct smp_shared {
    unsigned long long wlo[SMP_WARPS], whi[SMP_WARPS];   /* per-warp u128 partials */
    unsigned int hcnt[256];                              /* radix histograms: counts (fallback) */
    unsigned long long hlo[256], hhi[256];               /* radix histograms: masses (fallback) */
    unsigned int bcnt[SMP_BINS];                         /* fast path's plan: counts by bin */
    unsigned long long blo[SMP_BINS], bhi[SMP_BINS];     /* fast path's plan: masses by bin (sums of 32-bit halves) */
    unsigned long long cand[SMP_CAP];                    /* fast path: (key << 32 | ~id), sorted descending */
    unsigned long long tlo[SMP_TILES], thi[SMP_TILES];   /* segment sums of a prefix search */
    int sel_d;
    unsigned int sel_kr;
    unsigned long long sel_lo, sel_hi;
    int res, tile, cut;
    int first;                                           /* fast path: the drawn candidate */
    unsigned int cnt_lo;                                 /* fast path: elements in bins below lo */
    unsigned long long mlo_lo, mlo_hi, tot_lo, tot_hi;   /* fast path: mass below lo; the row's mass */
};
constexpr size_t SMP_SMEM = sizeof(smp_shared);
/* a candidate of the cut's fast path: (key << 32 | ~id), so that descending order is the row's
 * order (logit descending, id ascending) */
__device__ __forceinline__ unsigned long long smp_cand(uint32_t key, int id) {
    return (unsigned long long)key << 32 | (0xffffffffu - (uint32_t)id);
}
__device__ __forceinline__ uint32_t smp_cand_key(unsigned long long e) { return (uint32_t)(e >> 32); }
__device__ __forceinline__ int smp_cand_id(unsigned long long e) { return (int)(0xffffffffu - (uint32_t)e); }

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

/* inclusive prefix sum over the warp's lanes */
__device__ __forceinline__ kd_u128 warp_incl_scan_u128(kd_u128 v) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        kd_u128 u = shfl_up_u128(v, o);
        if (lane >= o) v = kd_u128_add(v, u);
    }
    return v;
}

/* exact exclusive prefix sum over the block's threads (in thread order); *total = the sum */
__device__ kd_u128 block_excl_scan_u128(kd_u128 v, kd_u128 *total, smp_shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const kd_u128 incl = warp_incl_scan_u128(v);
    __syncthreads();                     /* the previous user of wlo/whi is done */
    if (lane == 31) { sh.wlo[warp] = incl.lo; sh.whi[warp] = incl.hi; }
    __syncthreads();
    kd_u128 before = u128_zero(), tot = u128_zero();
    for (int w = 0; w < SMP_WARPS; w++) {
        kd_u128 x; x.lo = sh.wlo[w]; x.hi = sh.whi[w];
        if (w < warp) before = kd_u128_add(before, x);
        tot = kd_u128_add(tot, x);
    }
    *total = tot;
    return kd_u128_sub(kd_u128_add(before, incl), v);
}

/* the block's max of m and min of bad, on every thread (blocks of SMP_THREADS) */
__device__ void block_max_bad(float &m, int &bad) {
    __shared__ float rf[SMP_WARPS];
    __shared__ int ri[SMP_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
        bad = min(bad, __shfl_xor_sync(FULL, bad, o));
    }
    __syncthreads();                     /* the previous users of rf / ri are done */
    if (lane == 0) { rf[warp] = m; ri[warp] = bad; }
    __syncthreads();
    m = -INFINITY;
    bad = INT_MAX;
    for (int w = 0; w < SMP_WARPS; w++) { m = fmaxf(m, rf[w]); bad = min(bad, ri[w]); }
}

/* a slice's max over its finite logits, and its first NaN / +inf id (INT_MAX: none) */
struct smp_max_part { float m; int bad; };

/* exact add of a u128 mass into bucket b of (lo, hi) (low word atomically, its carry into the high word) */
__device__ __forceinline__ void u128_atomic_add(unsigned long long *lo, unsigned long long *hi, int b, kd_u128 m) {
    if (m.lo == 0 && m.hi == 0) return;
    unsigned long long old = atomicAdd(&lo[b], (unsigned long long)m.lo);
    unsigned long long carry = old + (unsigned long long)m.lo < old ? 1ull : 0ull;
    unsigned long long h = (unsigned long long)m.hi + carry;
    if (h) atomicAdd(&hi[b], h);
}
__device__ __forceinline__ void hist_add(smp_shared &sh, int b, kd_u128 m) { u128_atomic_add(sh.hlo, sh.hhi, b, m); }

/* The smallest i in [0, V) whose inclusive prefix sum of f exceeds goal(total of f), or -1.
 * The row is cut into at most SMP_TILES tiles of a multiple of 32 ids; each warp sums whole
 * tiles (coalesced), one block scan finds the tile where the prefix crosses, and warp 0 scans
 * that tile in chunks of 32. f(i) is a u128; every sum is exact, so the answer does not depend
 * on how the sums are grouped. */
template <class F, class G>
__device__ int first_exceeding(const F &f, const G &goal, int V, smp_shared &sh) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ts = ((V + SMP_TILES - 1) / SMP_TILES + 31) & ~31, nt = (V + ts - 1) / ts;
    for (int t = warp; t < SMP_TILES; t += SMP_WARPS) {
        kd_u128 acc = u128_zero();
        if (t < nt)
            for (int i = t * ts + lane, hi = min(V, (t + 1) * ts); i < hi; i += 32) acc = kd_u128_add(acc, f(i));
        acc = warp_sum_u128(acc);
        if (lane == 0) { sh.tlo[t] = acc.lo; sh.thi[t] = acc.hi; }
    }
    __syncthreads();
    if (tid == 0) { sh.tile = -1; sh.res = -1; }
    kd_u128 mine; mine.lo = sh.tlo[tid]; mine.hi = sh.thi[tid];   /* SMP_TILES == SMP_THREADS */
    kd_u128 total;
    const kd_u128 before = block_excl_scan_u128(mine, &total, sh);   /* its barriers order the writes above */
    const kd_u128 target = goal(total);
    if (!kd_u128_lt(target, before) && kd_u128_lt(target, kd_u128_add(before, mine))) {   /* at most one tile */
        sh.tile = tid;
        sh.sel_lo = before.lo;
        sh.sel_hi = before.hi;
    }
    __syncthreads();
    const int t = sh.tile;
    if (t >= 0 && warp == 0) {
        const int lo = t * ts, hi = min(V, lo + ts);
        kd_u128 base; base.lo = sh.sel_lo; base.hi = sh.sel_hi;
        for (int c0 = lo; c0 < hi; c0 += 32) {
            const int i = c0 + lane;
            const kd_u128 incl = warp_incl_scan_u128(i < hi ? f(i) : u128_zero());
            const bool hit = i < hi && kd_u128_lt(target, kd_u128_add(base, incl));
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

/* For warp 0: the first bin b (of SMP_BINS) whose inclusive prefix of f reaches goal (>= goal),
 * and the prefix before it (*before); -1 if the whole sum stays below goal. */
template <class F>
__device__ int warp_first_reaching(const F &f, kd_u128 goal, kd_u128 *before) {
    constexpr int PER = SMP_BINS / 32;
    const int lane = threadIdx.x & 31;
    kd_u128 s = u128_zero();
    for (int j = 0; j < PER; j++) s = kd_u128_add(s, f(lane * PER + j));
    const kd_u128 incl = warp_incl_scan_u128(s);
    const unsigned bb = __ballot_sync(FULL, !kd_u128_lt(incl, goal));
    if (!bb) return -1;
    const int L = __ffs(bb) - 1;
    int res = -1;
    kd_u128 c = kd_u128_sub(incl, s);
    if (lane == L)
        for (int j = 0; j < PER; j++) {
            kd_u128 n = kd_u128_add(c, f(L * PER + j));
            if (!kd_u128_lt(n, goal)) { res = L * PER + j; break; }
            c = n;
        }
    *before = shfl_u128(c, L);
    return __shfl_sync(FULL, res, L);
}

/* For warp 0: the sum of f over the bins below b */
template <class F>
__device__ kd_u128 warp_prefix(const F &f, int b) {
    kd_u128 s = u128_zero();
    for (int j = threadIdx.x & 31; j < b; j += 32) s = kd_u128_add(s, f(j));
    return warp_sum_u128(s);
}

/* a token's mass under the rule (sample_rule.h) with min-p: below qmin it is 0. A logit far below
 * the max has mass 0 without the exp, found in float where it can be and in double where not.
 * afloor is -44 (exp < 2^-63: trunc(w * 2^62) = 0), or with min-p log(Q * 2^-62) less 2^-30
 * (exp(a) < Q * 2^-62: q < Q), the polynomial being within a few ulp of exp and the device's log
 * within one. Against the exact e = (x - m) / T the rule's a = RN(RN(x/T) - RN(m/T)) errs by at
 * most (|x| + |m|) / T * 2^-51 (three roundings).
 *  - float: d = (m - x) * (1/T) errs from -e by under 2^-22 of it (three roundings), so where
 *    (|x| + |m|) / T < 2^41 (a's error under 2^-10), d > (-afloor + 2^-9)(1 + 2^-19) puts a below
 *    afloor - 2^-10. 1/T must be a normal float (T < 2^100) for those bounds.
 *  - double: ap = (x - m) / T is within (|x| + |m|) / T * 2^-51 of e, so ap + err (err twice that
 *    and more) below afloor puts a below it too.
 * A value neither test rules out gets its exp: a "maybe" that is 0 costs time, never a mass. */
struct smp_mass {
    float m;
    kd_rule_row row;
    double afloor;
    float invTf, thrf;   /* the float test's 1/T and threshold */
    uint64_t qmin;
    smp_mass() = default;
    __device__ smp_mass(float m_, double T, uint64_t qmin_)
        : m(m_), row(kd_rule_row_of(m_, T)),
          afloor(qmin_ ? fmax(-44.0, log(ldexp((double)qmin_, -62)) - 0x1p-30) : -44.0),
          invTf(T < 0x1p100 ? (float)row.invT : 0.0f), qmin(qmin_) {
        thrf = __double2float_ru((-afloor + 0x1p-9) * (1.0 + 0x1p-19));   /* here: nvcc's host pass compiles the list */
    }
    /* false: v's mass is 0 for sure (no exp needed) */
    __device__ __forceinline__ bool maybe(float v) const {
        if (v == -INFINITY) return false;
        if (!((m - v) * invTf > thrf)) return true;   /* near the max (or invTf = 0): the exp decides */
        if ((fabsf(v) + fabsf(m)) * invTf < 0x1p40f) return false;
        const double vd = (double)v;
        const double ap = (vd - (double)m) * row.invT;
        const double err = (fabs(vd) + (double)fabsf(m)) * row.invT * 0x1p-48;
        return ap + err >= afloor;
    }
    /* the mass of a value maybe() let through */
    __device__ __forceinline__ uint64_t exact(float v) const {
        const uint64_t q = kd_rule_mass(v, row);
        return q >= qmin ? q : 0;
    }
    __device__ __forceinline__ uint64_t operator()(float v) const { return maybe(v) ? exact(v) : 0; }
};

/* a row's max and first NaN / +inf id (bad) from its S slices' parts, on every thread of the
 * block; true, with the row's mass rule, when it has neither a bad logit nor only -inf ones */
__device__ bool smp_row_rule(const smp_max_part *parts, int S, double T, uint64_t qmin, smp_mass &mass, int &bad) {
    float m = -INFINITY;
    bad = INT_MAX;
    for (int j = threadIdx.x; j < S; j += SMP_THREADS) { m = fmaxf(m, parts[j].m); bad = min(bad, parts[j].bad); }
    block_max_bad(m, bad);
    if (bad != INT_MAX || m == -INFINITY) return false;
    mass = smp_mass(m, T, qmin);
    return true;
}

/* bitonic sort of a[0..np) (np a power of two) by the block, descending or ascending */
__device__ void bitonic_sort(unsigned long long *a, int np, bool descending) {
    for (int size = 2; size <= np; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int j = threadIdx.x; j < np; j += SMP_THREADS) {
                const int o = j ^ stride;
                if (o > j) {
                    const bool down = ((j & size) == 0) == descending;
                    const unsigned long long x = a[j], y = a[o];
                    if (down ? x < y : x > y) { a[j] = y; a[o] = x; }
                }
            }
            __syncthreads();
        }
}

/* a logit's bin = its distance below the row max m in steps of SPAN * T / (SMP_BINS - 1); the last
 * bin holds the rest (their masses are all 0, as the mass of x/T - m/T < -43.99 truncates to 0).
 * Non-increasing in the logit; equal logits (+0 and -0 too) share a bin. */
struct smp_binner {
    float m, bscale;
    __device__ smp_binner(float m_, double T) : m(m_), bscale((float)fmin((double)(SMP_BINS - 1) / (SMP_SPAN * T), 1e30)) {}
    __device__ __forceinline__ int operator()(float v) const {
        const float d = m - v;
        if (d == 0.0f) return 0;
        const float s = d * bscale;
        return s < (float)(SMP_BINS - 1) ? (int)s : SMP_BINS - 1;
    }
};

/* masses by bin for top-p, unless top-k is small: then the bins before the k-th's hold fewer than
 * SMP_CAP / 2 ids, all gathered (no exp over the rest of the row) */
__host__ __device__ __forceinline__ bool smp_bin_mass(bool topk, bool topp, int top_k) {
    return topp && (!topk || top_k > SMP_CAP / 2);
}

/* the id of this thread's j-th value in slice blockIdx.x of a row */
__device__ __forceinline__ int slice_id(int j) { return blockIdx.x * SMP_SLICE + j * SMP_THREADS + threadIdx.x; }

/* this thread's SMP_PER values of slice blockIdx.x of row xr (0 past V), their loads in flight
 * together (a pass that waits on each load in turn is latency-bound) */
__device__ __forceinline__ void slice_values(const float *xr, int V, float *xv) {
#pragma unroll
    for (int j = 0; j < SMP_PER; j++) xv[j] = slice_id(j) < V ? xr[slice_id(j)] : 0.0f;
}

/* a bin's mass as the sums of its masses' 32-bit halves (smp_bins_kernel): add l and h to them, in
 * shared or global memory (zeros skipped: most bins of a far tail get none) */
__device__ __forceinline__ void halves_add(unsigned long long *lo, unsigned long long *hi, unsigned long long l,
                                           unsigned long long h) {
    if (l) atomicAdd(lo, l);
    if (h) atomicAdd(hi, h);
}
/* those sums' value, h * 2^32 + l */
__device__ __forceinline__ kd_u128 halves_value(unsigned long long l, unsigned long long h) {
    return kd_u128_add(kd_u128_shl(kd_u128_of(h), 32), kd_u128_of(l));
}

/* For a sampler with top-k / top-p: slice blockIdx.x of row blockIdx.y's counts by bin (all but
 * the last bin's) and, where smp_bin_mass, masses by bin, added into the row's SMP_BINS entries of
 * gcnt / glo / ghi (zeroed by the caller). A mass q < 2^63 is added as its two 32-bit halves, each
 * into a 64-bit sum (glo: the low halves, ghi: the high ones; a row of at most 2^29 ids cannot
 * carry out of them), so no add needs the old value back for a carry: the adds are fire-and-forget
 * reductions, and integer sums, in any order. With masses, the block's count of a bin rides in its
 * low halves' sum from bit SMP_CNT_SHIFT up (a slice's low halves sum to less than 2^45): two
 * shared adds a value, not three (the pass is bound by them). A warp whose lanes share a bin adds
 * once. Rows with a bad logit or no finite one are left out. */
constexpr int SMP_CNT_SHIFT = 45;
static_assert(SMP_SLICE <= (1 << (64 - SMP_CNT_SHIFT)) && (unsigned long long)SMP_SLICE << 32 <= 1ull << SMP_CNT_SHIFT,
              "a slice's count and low halves share a 64-bit sum");
__global__ void __launch_bounds__(SMP_THREADS) smp_bins_kernel(const float *x, long long ld, int V, double T,
                                                               uint64_t qmin, bool bin_mass, const smp_max_part *pm,
                                                               unsigned int *gcnt, unsigned long long *glo,
                                                               unsigned long long *ghi) {
    kd_griddep_enter();
    __shared__ unsigned int bcnt[SMP_BINS];                        /* counts alone */
    __shared__ unsigned long long blo[SMP_BINS], bhi[SMP_BINS];   /* with masses: count << SHIFT + low halves, high */
    const int tid = threadIdx.x, lane = tid & 31, S = gridDim.x;
    smp_mass mass;
    int bad;
    if (!smp_row_rule(pm + (size_t)blockIdx.y * S, S, T, qmin, mass, bad)) return;   /* the whole block */
    const smp_binner bin_of(mass.m, T);
    for (int b = tid; b < SMP_BINS; b += SMP_THREADS) { bcnt[b] = 0; blo[b] = 0; bhi[b] = 0; }
    __syncthreads();
    float xv[SMP_PER];
    slice_values(x + (size_t)blockIdx.y * (size_t)ld, V, xv);
    constexpr unsigned long long ONE = 1ull << SMP_CNT_SHIFT;
#pragma unroll
    for (int j = 0; j < SMP_PER; j++) {   /* whole warps iterate together: the ballot below */
        const int i = slice_id(j);
        int b = SMP_BINS - 1;
        uint64_t q = 0;
        if (i < V) {
            const float v = xv[j];
            b = bin_of(v);
            if (bin_mass && b < SMP_BINS - 1) q = mass(v);
        }
        const bool counted = b < SMP_BINS - 1;
        const int b0 = __shfl_sync(FULL, b, 0);
        unsigned long long ql = (q & 0xffffffffu) + ONE, qh = q >> 32;
        const bool whole = __ballot_sync(FULL, counted && b == b0) == FULL;
        if (whole && bin_mass) {   /* (counts alone: the warp adds 32) */
            for (int o = 16; o > 0; o >>= 1) {
                ql += __shfl_xor_sync(FULL, ql, o);
                qh += __shfl_xor_sync(FULL, qh, o);
            }
        }
        if (whole ? lane == 0 : counted) {
            const int bb = whole ? b0 : b;
            if (bin_mass) halves_add(&blo[bb], &bhi[bb], ql, qh);
            else atomicAdd(&bcnt[bb], whole ? 32u : 1u);
        }
    }
    __syncthreads();
    const size_t o = (size_t)blockIdx.y * SMP_BINS;
    for (int b = tid; b < SMP_BINS; b += SMP_THREADS) {
        const unsigned int n = bin_mass ? (unsigned int)(blo[b] >> SMP_CNT_SHIFT) : bcnt[b];
        if (n) atomicAdd(&gcnt[o + b], n);
        halves_add(&glo[o + b], &ghi[o + b], blo[b] & (ONE - 1), bhi[b]);
    }
}

/* The fast path of the cut (top-k and / or top-p). A bin (smp_binner) is monotone in the logit,
 * so the order of the row (logit descending, id ascending) visits the bins in ascending order.
 * smp_plan_kernel finds from the row's counts (and masses for top-p without a small top-k) by bin
 * the bins [lo, hi] that can hold the cut; smp_gather_kernel gathers their ids over several
 * blocks per row into the row's SMP_CAP slots; cut_by_bins sorts them in shared memory. The plan
 * is not fast (the radix path decides) when those bins hold more than SMP_CAP ids (e.g. a row of
 * equal logits). */
struct smp_plan {
    unsigned long long mlo_lo, mlo_hi, tot_lo, tot_hi;   /* mass below bin lo; the row's mass */
    float m;                                             /* the row max (the binner's) */
    int lo, hi, fast;                                    /* the candidate bins [lo, hi] */
    unsigned int cnt_lo, ncand;                          /* ids in bins below lo; ids gathered */
};

/* One block per row after smp_bins_kernel (gcnt / glo / ghi): the row's plan (fast = 0 for a row
 * with a bad logit or no finite one: sample_cut_kernel reports it) */
__global__ void __launch_bounds__(SMP_THREADS) smp_plan_kernel(int V, double T, int top_k, float top_p, uint64_t qmin,
                                                               const smp_max_part *pm, int S, const unsigned int *gcnt,
                                                               const unsigned long long *glo,
                                                               const unsigned long long *ghi, smp_plan *plans) {
    kd_griddep_enter();
    extern __shared__ double sel_smem[];
    smp_shared &sh = *reinterpret_cast<smp_shared *>(sel_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, row = blockIdx.x;
    smp_mass mass;
    int bad;
    if (!smp_row_rule(pm + (size_t)row * S, S, T, qmin, mass, bad)) {
        if (tid == 0) plans[row].fast = 0;
        return;
    }
    const bool topk = top_k > 0 && top_k < V, topp = top_p > 0.0f && top_p < 1.0f;
    const bool bin_mass = smp_bin_mass(topk, topp, top_k);
    const size_t ob = (size_t)row * SMP_BINS;
    for (int b = tid; b < SMP_BINS; b += SMP_THREADS) { sh.bcnt[b] = gcnt[ob + b]; sh.blo[b] = glo[ob + b]; sh.bhi[b] = ghi[ob + b]; }
    __syncthreads();
    if (warp != 0) return;
    kd_u128 counted = warp_sum_u128([&] {
        kd_u128 s = u128_zero();
        for (int b = lane; b < SMP_BINS - 1; b += 32) s = kd_u128_add64(s, sh.bcnt[b]);
        return s;
    }());
    const unsigned int tail = (unsigned)V - (unsigned)counted.lo;
    auto cnt = [&](int b) { return kd_u128_of(b < SMP_BINS - 1 ? sh.bcnt[b] : tail); };
    auto mas = [&](int b) { return halves_value(sh.blo[b], sh.bhi[b]); };
    kd_u128 ignore;
    int lo, hi;
    if (topk) {
        hi = warp_first_reaching(cnt, kd_u128_of((uint64_t)top_k), &ignore);   /* found: the counts sum to V */
        lo = hi;
        if (top_k <= SMP_CAP / 2) lo = 0;   /* fewer than k ids before the k-th's bin: gather them all */
        if (bin_mass) {   /* the nucleus ends no earlier than where the smallest possible goal is reached */
            const kd_u128 s_lo = warp_prefix(mas, hi);
            lo = warp_first_reaching(mas, kd_rule_top_p_goal(s_lo, top_p), &ignore);
            if (lo < 0 || lo > hi) lo = hi;   /* not reached: s_lo reaches its own goal before bin hi */
        }
    } else {
        const kd_u128 S_all = warp_prefix(mas, SMP_BINS);
        hi = warp_first_reaching(mas, kd_rule_top_p_goal(S_all, top_p), &ignore);   /* found: the goal is <= S */
        lo = hi;
    }
    const kd_u128 below = warp_prefix(cnt, lo), through = warp_prefix(cnt, hi + 1);
    const kd_u128 mbelow = warp_prefix(mas, lo), mtot = warp_prefix(mas, SMP_BINS);
    if (lane == 0) {
        smp_plan p;
        p.mlo_lo = mbelow.lo; p.mlo_hi = mbelow.hi;
        p.tot_lo = mtot.lo; p.tot_hi = mtot.hi;
        p.m = mass.m;
        p.lo = lo;
        p.hi = hi;
        p.fast = hi >= 0 && through.lo - below.lo <= (uint64_t)SMP_CAP;
        p.cnt_lo = (unsigned)below.lo;
        p.ncand = 0;
        plans[row] = p;
    }
}

/* The block's sum of the masses of its SMP_PER values a thread (xv, slice blockIdx.x) that
 * take(id, value) keeps, into *out. QUEUED: the values that need an exp (taken, not surely 0) are
 * queued by the warp and then evaluated 32 at a time, for a cut or a min-p floor, which leave a few
 * lanes of most rounds (a warp pays an exp for every round any lane of it needs one); where every
 * value may need one, the queue's stores and its loop without unrolling cost more than they save
 * (T 1 over 257 rows of 163840: 250.5 -> 290.7 us, H200), so that pass is built without it. */
template <bool QUEUED, class F>
__device__ void slice_mass(const smp_mass &mass, const float *xv, const F &take, kd_u128 *out) {
    __shared__ unsigned long long wlo[SMP_WARPS], whi[SMP_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    kd_u128 acc = u128_zero();
    if constexpr (!QUEUED) {
#pragma unroll
        for (int j = 0; j < SMP_PER; j++)
            if (take(slice_id(j), xv[j])) acc = kd_u128_add64(acc, mass(xv[j]));
    } else {
        __shared__ float queue[SMP_WARPS][32 * SMP_PER];
        float *wq = queue[warp];
        int n = 0;
#pragma unroll
        for (int j = 0; j < SMP_PER; j++) {   /* whole warps iterate together: the ballot */
            const bool need = take(slice_id(j), xv[j]) && mass.maybe(xv[j]);
            const unsigned bal = __ballot_sync(FULL, need);
            if (need) wq[n + __popc(bal & ((1u << lane) - 1u))] = xv[j];
            n += __popc(bal);
        }
        __syncwarp();
        for (int k = lane; k < n; k += 32) acc = kd_u128_add64(acc, mass.exact(wq[k]));
    }
    acc = warp_sum_u128(acc);
    if (lane == 0) { wlo[warp] = acc.lo; whi[warp] = acc.hi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        kd_u128 r = u128_zero();
        for (int w = 0; w < SMP_WARPS; w++) { kd_u128 v; v.lo = wlo[w]; v.hi = whi[w]; r = kd_u128_add(r, v); }
        *out = r;
    }
}

/* slice blockIdx.x of row blockIdx.y, for a fast plan: the (key << 32 | ~id) of its ids in bins
 * [lo, hi] into the row's SMP_CAP slots of cand (in no set order: cut_by_bins sorts them). Where
 * the row is drawn over (lo > 0: bins below lo are kept but not gathered), also the slice's mass
 * in bins below lo into pw (rows x gridDim.x); sample_cut_kernel adds the kept candidates'. */
__global__ void __launch_bounds__(SMP_THREADS) smp_gather_kernel(const float *x, long long ld, int V, double T,
                                                                 uint64_t qmin, smp_plan *plans,
                                                                 unsigned long long *cand, kd_u128 *pw) {
    kd_griddep_enter();
    constexpr int PER = SMP_SLICE / SMP_THREADS;
    smp_plan *p = plans + blockIdx.y;
    if (!p->fast) return;   /* the whole block */
    const int lane = threadIdx.x & 31, blo = p->lo, bhi = p->hi;
    const smp_binner bin_of(p->m, T);
    const float *xr = x + (size_t)blockIdx.y * (size_t)ld;
    unsigned long long *out = cand + (size_t)blockIdx.y * SMP_CAP;
    const int lo = blockIdx.x * SMP_SLICE, hi = min(V, lo + SMP_SLICE);
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {   /* every load first: one block's pass is latency-bound */
        const int i = lo + j * SMP_THREADS + threadIdx.x;
        v[j] = i < hi ? xr[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int i = lo + j * SMP_THREADS + threadIdx.x;
        const int b = i < hi ? bin_of(v[j]) : -1;
        const bool in = b >= blo && b <= bhi;
        const unsigned bal = __ballot_sync(FULL, in);
        if (!bal) continue;   /* warp-uniform */
        unsigned base = 0;
        if (lane == 0) base = atomicAdd(&p->ncand, (unsigned)__popc(bal));
        base = __shfl_sync(FULL, base, 0);
        if (in) out[base + __popc(bal & ((1u << lane) - 1u))] = smp_cand(kd_float_key(v[j]), i);
    }
    if (blo > 0)   /* uniform over the block */
        slice_mass<true>(smp_mass(p->m, T, qmin), v, [&](int i, float val) { return i < hi && bin_of(val) < blo; },
                         pw + (size_t)blockIdx.y * gridDim.x + blockIdx.x);
}

/* the cut from a fast plan's gathered ids (false: the plan is not fast); sh.cand[0..nkept) are
 * the kept candidates, in the row's order */
__device__ bool cut_by_bins(const smp_mass &mass, int top_k, float top_p, bool topk, bool topp, const smp_plan *plan,
                            const unsigned long long *gathered, uint32_t *ckey, int *cid, int *nkept, smp_shared &sh) {
    const int tid = threadIdx.x;
    if (!plan->fast) return false;   /* uniform over the block */
    const int n = (int)plan->ncand;
    if (tid == 0) {
        sh.cnt_lo = plan->cnt_lo;
        sh.mlo_lo = plan->mlo_lo; sh.mlo_hi = plan->mlo_hi;
        sh.tot_lo = plan->tot_lo; sh.tot_hi = plan->tot_hi;
        sh.cut = INT_MAX;
    }
    /* 3. the candidates, padded to a power of two with 0 (below every real entry), sorted */
    int np = 1;
    while (np < n) np <<= 1;
    for (int j = tid; j < np; j += SMP_THREADS) sh.cand[j] = j < n ? gathered[j] : 0ull;
    __syncthreads();
    bitonic_sort(sh.cand, np, true);   /* descending: the row's order */
    /* 4. the cut: top-k's k-th of the order; top-p's first prefix (within top-k) whose mass reaches G */
    const int ik = topk ? top_k - (int)sh.cnt_lo - 1 : n - 1;   /* 0 <= ik < n: bin hi holds the k-th */
    if (!topp) {
        if (tid == 0) sh.cut = ik;
    } else {
        constexpr int PER = SMP_CAP / SMP_THREADS;
        kd_u128 q[PER], part = u128_zero();
        for (int j = 0; j < PER; j++) {
            const int c = tid * PER + j;
            const unsigned long long e = c <= ik ? sh.cand[c] : 0ull;
            q[j] = kd_u128_of(c <= ik ? mass(kd_float_of_key(smp_cand_key(e))) : 0u);
            part = kd_u128_add(part, q[j]);
        }
        kd_u128 total;
        kd_u128 run = block_excl_scan_u128(part, &total, sh);
        kd_u128 mbelow; mbelow.lo = sh.mlo_lo; mbelow.hi = sh.mlo_hi;
        kd_u128 S; S.lo = sh.tot_lo; S.hi = sh.tot_hi;
        if (topk) S = kd_u128_add(mbelow, total);   /* the mass through the k-th */
        const kd_u128 G = kd_rule_top_p_goal(S, top_p);
        run = kd_u128_add(run, mbelow);
        for (int j = 0; j < PER; j++) {
            const int c = tid * PER + j;
            run = kd_u128_add(run, q[j]);
            if (c <= ik && !kd_u128_lt(run, G)) { atomicMin(&sh.cut, c); break; }
        }
    }
    __syncthreads();
    const int c = sh.cut;   /* found: the candidates through ik reach G (the mass through the k-th is S) */
    *ckey = smp_cand_key(sh.cand[c]);
    *cid = smp_cand_id(sh.cand[c]);
    *nkept = c + 1;   /* with lo = 0, every kept id */
    return true;
}

/* The draw when every kept id is a candidate (cut_by_bins with lo = 0): sh.cand[0..nk) hold the
 * kept ids in the row's order; sorted by id, their masses are scanned by the block, and the
 * first whose inclusive prefix exceeds floor(U W / 2^53) is the token, as in the pass over the row. */
__device__ int draw_from_candidates(const float *xr, int nk, const smp_mass &mass, uint64_t U, smp_shared &sh) {
    constexpr int PER = SMP_CAP / SMP_THREADS;
    const int tid = threadIdx.x;
    int np = 1;
    while (np < nk) np <<= 1;
    for (int j = tid; j < np; j += SMP_THREADS)   /* ids; the padding (~0) sorts last */
        sh.cand[j] = j < nk ? (unsigned long long)smp_cand_id(sh.cand[j]) : ~0ull;
    if (tid == 0) sh.first = INT_MAX;
    __syncthreads();
    bitonic_sort(sh.cand, np, false);
    uint64_t q[PER];
    kd_u128 part = u128_zero();
    for (int j = 0; j < PER; j++) {
        const int c = tid * PER + j;
        q[j] = c < nk ? mass(xr[(int)sh.cand[c]]) : 0u;
        part = kd_u128_add64(part, q[j]);
    }
    kd_u128 W;
    kd_u128 run = block_excl_scan_u128(part, &W, sh);
    const kd_u128 target = kd_rule_target(U, W);
    for (int j = 0; j < PER; j++) {
        run = kd_u128_add64(run, q[j]);
        if (tid * PER + j < nk && kd_u128_lt(target, run)) { atomicMin(&sh.first, tid * PER + j); break; }
    }
    __syncthreads();
    return (int)sh.cand[sh.first];   /* found: target < W */
}

/* The masses of the kept ids whose key matches prefix under mask, by the key's byte at shift,
 * added into sh.hlo / sh.hhi (run-length: one atomic per run of equal bytes); returns this
 * thread's sum of those masses. */
template <class K>
__device__ kd_u128 radix_mass_pass(const float *xr, int V, const smp_mass &mass, const K &kept_k, uint32_t mask,
                                   uint32_t prefix, int shift, smp_shared &sh) {
    kd_u128 part = u128_zero(), run = u128_zero();
    int run_b = -1;
    for (int i = threadIdx.x; i < V; i += SMP_THREADS) {
        const float v = xr[i];
        const uint32_t key = kd_float_key(v);
        if ((key & mask) != prefix || !kept_k(i, key)) continue;
        const uint64_t q = mass(v);
        part = kd_u128_add64(part, q);
        const int b = (int)((key >> shift) & 255u);
        if (b != run_b) {
            if (run_b >= 0) hist_add(sh, run_b, run);
            run_b = b;
            run = u128_zero();
        }
        run = kd_u128_add64(run, q);
    }
    if (run_b >= 0) hist_add(sh, run_b, run);
    return part;
}

/* The radix path of the cut, for the rows the bins cannot split finely enough (ties, huge top-k):
 * top-k's k-th of the order (kkey, kid) by 8-bit radix passes on counts, then top-p's last
 * element (pkey, pid) by radix passes on masses; the cut is top-p's when it is on. */
__device__ void cut_by_radix(const float *xr, int V, const smp_mass &mass, int top_k, float top_p, bool topk,
                             bool topp, uint32_t *ckey, int *cid, smp_shared &sh) {
    const int tid = threadIdx.x;
    uint32_t kkey = 0;
    int kid = INT_MAX;
    if (topk) {
        uint32_t prefix = 0, mask = 0;
        unsigned int kr = (unsigned)top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += SMP_THREADS) sh.hcnt[i] = 0;
            __syncthreads();
            for (int i = tid; i < V; i += SMP_THREADS) {
                uint32_t key = kd_float_key(xr[i]);
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
        kid = first_exceeding([&](int i) { return kd_u128_of(kd_float_key(xr[i]) == kk ? 1u : 0u); },
                              [&](kd_u128) { return kd_u128_of(kr - 1); }, V, sh);
    }
    *ckey = kkey;
    *cid = kid;
    if (!topp) return;
    auto kept_k = [&](int i, uint32_t key) { return !topk || key > kkey || (key == kkey && i <= kid); };
    for (int i = tid; i < 256; i += SMP_THREADS) { sh.hlo[i] = 0; sh.hhi[i] = 0; }
    __syncthreads();
    /* the kept mass S and the masses by the key's top byte */
    const kd_u128 part = radix_mass_pass(xr, V, mass, kept_k, 0u, 0u, 24, sh);
    const kd_u128 S = block_sum_u128(part, sh);     /* its barrier also completes the histogram */
    const kd_u128 G = kd_rule_top_p_goal(S, top_p);
    kd_u128 before = u128_zero();
    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (shift < 24) {
            for (int i = tid; i < 256; i += SMP_THREADS) { sh.hlo[i] = 0; sh.hhi[i] = 0; }
            __syncthreads();
            radix_mass_pass(xr, V, mass, kept_k, mask, prefix, shift, sh);
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
    const uint32_t pk = prefix;
    uint64_t qe = mass(kd_float_of_key(pk));   /* equal logits: equal masses (min-p included) */
    if (qe == 0) qe = 1;                  /* not reached: the crossing run has mass */
    const unsigned long long c = kd_u128_div64_ceil(kd_u128_sub(G, before), qe);
    /* the c-th lowest kept id whose key is pkey */
    *ckey = pk;
    *cid = first_exceeding([&](int i) { uint32_t key = kd_float_key(xr[i]); return kd_u128_of(key == pk && kept_k(i, key) ? 1u : 0u); },
                           [&](kd_u128) { return kd_u128_of(c - 1); }, V, sh);
}

/* slice blockIdx.x of row blockIdx.y: its max part, into pm (rows x gridDim.x) */
__global__ void __launch_bounds__(SMP_THREADS) smp_max_kernel(const float *x, long long ld, int V, smp_max_part *pm) {
    kd_griddep_enter();
    float xv[SMP_PER];
    slice_values(x + (size_t)blockIdx.y * (size_t)ld, V, xv);
    float m = -INFINITY;
    int bad = INT_MAX;
#pragma unroll
    for (int j = 0; j < SMP_PER; j++) {
        const int i = slice_id(j);
        const float v = xv[j];
        if (i >= V) break;
        if (v != v || v == INFINITY) bad = min(bad, i);
        else m = fmaxf(m, v);
    }
    block_max_bad(m, bad);
    if (threadIdx.x == 0) pm[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = smp_max_part{m, bad};
}

/* a row's cut for the draw over the row: the kept ids are those with key > key, or key == key
 * and id <= id; draw: how the row is drawn */
enum {
    SMP_DRAWN,           /* from its candidates, by sample_cut_kernel (they are every kept id) */
    SMP_DRAW_PASS,       /* over the row, its slices' kept masses from smp_mass_kernel */
    SMP_DRAW_GATHERED,   /* over the row, its slices' kept masses from smp_gather_kernel and sample_cut_kernel */
};
struct smp_cut { uint32_t key; int id; int draw; };

/* is id i (of key kd_float_key(x[i])) kept: every id without a cut (c NULL) */
__device__ __forceinline__ bool smp_kept(const smp_cut *c, int i, uint32_t key) {
    return !c || key > c->key || (key == c->key && i <= c->id);
}

/* a row with a NaN / +inf logit (its first at bad) or no finite one: its code, by thread 0 */
__device__ void smp_report_bad(const float *xr, int bad, int row, int32_t *out, int32_t *code) {
    if (threadIdx.x != 0) return;
    int32_t c = KD_SAMPLE_ERR_ALLNEG;
    if (bad != INT_MAX) {
        const float v = xr[bad];
        c = (v != v ? KD_SAMPLE_ERR_NAN : KD_SAMPLE_ERR_PINF) | (int32_t)((uint32_t)bad << 2);
    }
    code[row] = c;
    out[row] = -1;
}

/* slice blockIdx.x of row blockIdx.y's kept mass (every id without cuts; with them, the ids of
 * the row's cut, for SMP_DRAW_PASS rows), into pw (rows x gridDim.x); rows with a bad logit or no
 * finite one, and the others with cuts, are left out (smp_draw_kernel does not read their pw, or
 * the gather and the cut wrote it). QUEUED (slice_mass): the sampler has a cut or a min-p floor. */
template <bool QUEUED>
__global__ void __launch_bounds__(SMP_THREADS) smp_mass_kernel(const float *x, long long ld, int V, double T,
                                                               uint64_t qmin, const smp_max_part *pm,
                                                               const smp_cut *cuts, kd_u128 *pw) {
    kd_griddep_enter();
    const int S = gridDim.x;
    const smp_cut *c = QUEUED && cuts ? cuts + blockIdx.y : NULL;   /* the plain pass has none (cuts is NULL) */
    if (c && c->draw != SMP_DRAW_PASS) return;   /* the block */
    smp_mass mass;
    int bad;
    if (!smp_row_rule(pm + (size_t)blockIdx.y * S, S, T, qmin, mass, bad)) return;
    float xv[SMP_PER];
    slice_values(x + (size_t)blockIdx.y * (size_t)ld, V, xv);
    slice_mass<QUEUED>(mass, xv, [&](int i, float v) { return i < V && smp_kept(c, i, kd_float_key(v)); },
                       pw + (size_t)blockIdx.y * S + blockIdx.x);
}

/* With top-k / top-p, one block per row after smp_max_kernel (pm), smp_plan_kernel (plans) and
 * smp_gather_kernel (cand, pw): a bad row's code; else the cut (the last kept element of the order
 * after top-k and top-p) into cuts[row] and, when every kept id is a gathered candidate, the draw
 * from them; else the kept candidates' masses added into pw by slice (a fast plan: pw holds the
 * rest of the kept mass), or the draw left to smp_mass_kernel's pass (the radix path) */
__global__ void __launch_bounds__(SMP_THREADS) sample_cut_kernel(const float *x, long long ld, int V, double T,
                                                                  int top_k, float top_p, uint64_t qmin, uint64_t seed,
                                                                  const smp_max_part *pm, int S, const smp_plan *plans,
                                                                  const unsigned long long *cand, kd_u128 *pw,
                                                                  const int32_t *pos, int pos_offset, smp_cut *cuts,
                                                                  int32_t *out, int32_t *code) {
    kd_griddep_enter();
    extern __shared__ double sel_smem[];
    smp_shared &sh = *reinterpret_cast<smp_shared *>(sel_smem);
    const int tid = threadIdx.x, row = blockIdx.x;
    const float *xr = x + (size_t)row * (size_t)ld;
    smp_mass mass;
    int bad;
    if (!smp_row_rule(pm + (size_t)row * S, S, T, qmin, mass, bad)) {
        smp_report_bad(xr, bad, row, out, code);
        return;
    }
    const bool topk = top_k > 0 && top_k < V, topp = top_p > 0.0f && top_p < 1.0f;
    uint32_t ckey = 0;
    int cid = INT_MAX, nkept = 0, draw = SMP_DRAW_PASS, tok = -1;
    if (!cut_by_bins(mass, top_k, top_p, topk, topp, plans + row, cand + (size_t)row * SMP_CAP, &ckey, &cid, &nkept, sh)) {
        cut_by_radix(xr, V, mass, top_k, top_p, topk, topp, &ckey, &cid, sh);
    } else if (plans[row].lo == 0) {
        tok = draw_from_candidates(xr, nkept, mass, kd_rule_u53(seed, (int64_t)pos[row] + pos_offset), sh);
        draw = SMP_DRAWN;
    } else {
        kd_u128 *pr = pw + (size_t)row * S;
        for (int j = tid; j < nkept; j += SMP_THREADS) {
            const unsigned long long e = sh.cand[j];
            const int id = smp_cand_id(e);
            u128_atomic_add(reinterpret_cast<unsigned long long *>(&pr[id / SMP_SLICE].lo),
                            reinterpret_cast<unsigned long long *>(&pr[id / SMP_SLICE].hi), 0,
                            kd_u128_of(mass(kd_float_of_key(smp_cand_key(e)))));
        }
        draw = SMP_DRAW_GATHERED;
    }
    if (tid == 0) {
        cuts[row] = smp_cut{ckey, cid, draw};
        if (draw == SMP_DRAWN) {
            out[row] = tok;
            code[row] = 0;
        }
    }
}

/* One block per row, after smp_mass_kernel: the draw, the first kept id (ascending) whose prefix
 * mass exceeds floor(U W / 2^53). Warp 0 finds the slice where the slices' prefix (S u128 sums,
 * 32 a round) passes the target; then warp w holds ids [DRAW_SEG w, DRAW_SEG (w + 1)) of that
 * slice in registers (lane l: ids 32 j + l), one scan over the warps' sums finds the warp whose
 * ids cross and that warp scans its SMP_PER rounds of 32. Every load of a round is in flight
 * together (a thread walking the slices, or a warp its tiles, one load at a time was
 * latency-bound), and every sum is exact, so grouping them so changes no draw. Without cuts it
 * also reports the bad rows; with them it draws only the rows not drawn already. */
constexpr int DRAW_SEG = 32 * SMP_PER;
static_assert(SMP_WARPS * DRAW_SEG == SMP_SLICE && SMP_WARPS <= 32, "the warps hold a slice, one lane a warp's sum");
__global__ void __launch_bounds__(SMP_THREADS) smp_draw_kernel(const float *x, long long ld, int V, double T,
                                                                uint64_t qmin, uint64_t seed, const smp_max_part *pm,
                                                                const smp_cut *cuts, const kd_u128 *pw,
                                                                int S, const int32_t *pos, int pos_offset,
                                                                int32_t *out, int32_t *code) {
    kd_griddep_enter();
    extern __shared__ double sel_smem[];
    smp_shared &sh = *reinterpret_cast<smp_shared *>(sel_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, row = blockIdx.x;
    const float *xr = x + (size_t)row * (size_t)ld;
    smp_mass mass;
    int bad;
    const smp_cut *c = cuts ? cuts + row : NULL;
    if (!smp_row_rule(pm + (size_t)row * S, S, T, qmin, mass, bad)) {
        if (!c) smp_report_bad(xr, bad, row, out, code);   /* with cuts, sample_cut_kernel did */
        return;
    }
    if (c && c->draw == SMP_DRAWN) return;
    if (warp == 0) {
        const uint64_t U = kd_rule_u53(seed, (int64_t)pos[row] + pos_offset);
        const kd_u128 *w = pw + (size_t)row * S;
        kd_u128 W = u128_zero();
        for (int j = lane; j < S; j += 32) W = kd_u128_add(W, w[j]);
        W = warp_sum_u128(W);
        const kd_u128 target = kd_rule_target(U, W);   /* < W, unless W is 0: then the last slice */
        int first = -1;
        kd_u128 before = u128_zero();
        for (int j0 = 0; j0 < S && first < 0; j0 += 32) {
            const bool in = j0 + lane < S;
            const kd_u128 v = in ? w[j0 + lane] : u128_zero();
            const kd_u128 incl = warp_incl_scan_u128(v);
            const unsigned b = __ballot_sync(FULL, in && kd_u128_lt(target, kd_u128_add(before, incl)));
            if (b) {
                const int L = __ffs(b) - 1;
                first = j0 + L;
                before = kd_u128_add(before, shfl_u128(kd_u128_sub(incl, v), L));
            } else {
                before = kd_u128_add(before, shfl_u128(incl, 31));
            }
        }
        if (first < 0) { first = S - 1; before = kd_u128_sub(W, w[S - 1]); }
        if (lane == 0) {
            const kd_u128 rest = kd_u128_sub(target, before);   /* the target inside slice first */
            sh.first = first;
            sh.sel_lo = rest.lo;
            sh.sel_hi = rest.hi;
        }
    }
    __syncthreads();
    const int lo = sh.first * SMP_SLICE, n = min(V, lo + SMP_SLICE) - lo, seg = warp * DRAW_SEG;
    kd_u128 rest;
    rest.lo = sh.sel_lo;
    rest.hi = sh.sel_hi;
    float xv[SMP_PER];
#pragma unroll
    for (int j = 0; j < SMP_PER; j++) xv[j] = seg + 32 * j + lane < n ? xr[lo + seg + 32 * j + lane] : 0.0f;
    uint64_t m[SMP_PER];
    kd_u128 sum = u128_zero();
#pragma unroll
    for (int j = 0; j < SMP_PER; j++) {
        const int i = lo + seg + 32 * j + lane;
        m[j] = seg + 32 * j + lane < n && smp_kept(c, i, kd_float_key(xv[j])) ? mass(xv[j]) : 0u;
        sum = kd_u128_add64(sum, m[j]);
    }
    sum = warp_sum_u128(sum);
    if (lane == 0) { sh.wlo[warp] = sum.lo; sh.whi[warp] = sum.hi; }
    __syncthreads();
    kd_u128 ws = u128_zero();
    if (lane < SMP_WARPS) { ws.lo = sh.wlo[lane]; ws.hi = sh.whi[lane]; }
    const kd_u128 wincl = warp_incl_scan_u128(ws);
    const unsigned wb = __ballot_sync(FULL, lane < SMP_WARPS && kd_u128_lt(rest, wincl));
    if (!wb) {   /* not reached: the target is past the slice's mass */
        if (tid == 0) { out[row] = -1; code[row] = 0; }
        return;
    }
    if (warp != __ffs(wb) - 1) return;
    kd_u128 base = shfl_u128(kd_u128_sub(wincl, ws), warp);
#pragma unroll
    for (int j = 0; j < SMP_PER; j++) {
        const kd_u128 incl = warp_incl_scan_u128(kd_u128_of(m[j]));
        const unsigned b = __ballot_sync(FULL, kd_u128_lt(rest, kd_u128_add(base, incl)));
        if (b) {
            if (lane == 0) { out[row] = lo + seg + 32 * j + __ffs(b) - 1; code[row] = 0; }
            return;
        }
        base = kd_u128_add(base, shfl_u128(incl, 31));
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
    if (budget > SEL_MAX_BUDGET || sel_smem_bytes(L, K, budget, 0, false) > c->smem_optin)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda tree_select: budget %d needs %zu bytes of shared memory (at most %d "
                       "nodes, %zu bytes here)", budget, sel_smem_bytes(L, K, budget, 0, false), SEL_MAX_BUDGET,
                       c->smem_optin);
    /* the lists staged in shared memory where they fit (L = 7, K = 256: 14 KB more), and room for
     * the parallel path where that fits too */
    const bool staged = sel_smem_bytes(L, K, budget, 0, true) <= c->smem_optin;
    const int cap = sel_cap(L, K, budget, staged, c->smem_optin);
    const size_t smem = sel_smem_bytes(L, K, budget, cap, staged);
    KD_TRY(kd_cuda_smem(c, (const void *)tree_select_kernel, smem));
    KD_TRY(kd_launch_pdl("tree_select_kernel", tree_select_kernel, 1, SEL_THREADS, smem, c->stream, *t, L, K, budget,
                         staged, cap));
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
    KD_TRY(kd_launch_pdl("tree_stage_kernel", tree_stage_kernel, blocks, 256, 0, c->stream, *t, n, root, pos0, ids,
                         pos_out, ids ? vis_out : NULL));
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
    KD_TRY(kd_cuda_smem(c, (const void *)smp_plan_kernel, SMP_SMEM));
    KD_TRY(kd_cuda_smem(c, (const void *)sample_cut_kernel, SMP_SMEM));
    KD_TRY(kd_cuda_smem(c, (const void *)smp_draw_kernel, SMP_SMEM));
    const bool topk = sp->top_k > 0 && sp->top_k < x.cols, topp = sp->top_p > 0.0f && sp->top_p < 1.0f, cut = topk || topp;
    const double T = (double)sp->temperature;
    const uint64_t qmin = kd_rule_min_p_floor(sp->min_p);
    const int S = (x.cols + SMP_SLICE - 1) / SMP_SLICE;
    const int chunk = x.rows < 65535 ? x.rows : 65535;   /* rows on grid.y */
    const size_t nparts = (size_t)chunk * S, nbins = cut ? (size_t)chunk * SMP_BINS : 0;
    const size_t ncand = cut ? (size_t)chunk * SMP_CAP : 0, nplans = cut ? (size_t)chunk : 0;
    /* the 8-byte arrays first: aligned */
    const size_t hist_bytes = nbins * (2 * sizeof(unsigned long long) + sizeof(unsigned int));
    void *ws = NULL;
    KD_TRY(kd_cuda_ws(be, KD_WS_TREE, nparts * (sizeof(kd_u128) + sizeof(smp_max_part)) + hist_bytes +
                                          ncand * sizeof(unsigned long long) + nplans * sizeof(smp_plan) +
                                          (size_t)chunk * sizeof(smp_cut), &ws));
    kd_u128 *pw = (kd_u128 *)ws;
    unsigned long long *cand = (unsigned long long *)(pw + nparts);
    smp_plan *plans = (smp_plan *)(cand + ncand);
    unsigned long long *glo = (unsigned long long *)(plans + nplans), *ghi = glo + nbins;
    unsigned int *gcnt = (unsigned int *)(ghi + nbins);
    smp_max_part *pm = (smp_max_part *)(gcnt + nbins);
    smp_cut *cuts = cut ? (smp_cut *)(pm + nparts) : NULL;
    for (int r0 = 0; r0 < x.rows; r0 += chunk) {
        const kd_act xr = kd_act_rows(x, r0, x.rows - r0 < chunk ? x.rows - r0 : chunk);
        const float *xd = (const float *)xr.data;
        const dim3 grid((unsigned)S, (unsigned)xr.rows);
        KD_TRY(kd_launch_pdl("smp_max_kernel", smp_max_kernel, grid, SMP_THREADS, 0, c->stream, xd, xr.ld, xr.cols,
                             pm));
        if (cut) {
            KD_CUDA(cudaMemsetAsync(glo, 0, hist_bytes, c->stream));
            KD_TRY(kd_launch_pdl("smp_bins_kernel", smp_bins_kernel, grid, SMP_THREADS, 0, c->stream, xd, xr.ld,
                                 xr.cols, T, qmin, smp_bin_mass(topk, topp, sp->top_k), pm, gcnt, glo, ghi));
            KD_TRY(kd_launch_pdl("smp_plan_kernel", smp_plan_kernel, xr.rows, SMP_THREADS, SMP_SMEM, c->stream, xr.cols,
                                 T, sp->top_k, sp->top_p, qmin, pm, S, gcnt, glo, ghi, plans));
            KD_TRY(kd_launch_pdl("smp_gather_kernel", smp_gather_kernel, grid, SMP_THREADS, 0, c->stream, xd, xr.ld,
                                 xr.cols, T, qmin, plans, cand, pw));
            KD_TRY(kd_launch_pdl("sample_cut_kernel", sample_cut_kernel, xr.rows, SMP_THREADS, SMP_SMEM, c->stream, xd,
                                 xr.ld, xr.cols, T, sp->top_k, sp->top_p, qmin, sp->seed, pm, S, plans, cand, pw,
                                 pos + r0, pos_offset, cuts, out + r0, code + r0));
        }
        KD_TRY(kd_launch_pdl("smp_mass_kernel", cut || qmin ? smp_mass_kernel<true> : smp_mass_kernel<false>, grid,
                             SMP_THREADS, 0, c->stream, xd, xr.ld, xr.cols, T, qmin, pm, cuts, pw));
        KD_TRY(kd_launch_pdl("smp_draw_kernel", smp_draw_kernel, xr.rows, SMP_THREADS, SMP_SMEM, c->stream, xd, xr.ld,
                             xr.cols, T, qmin, sp->seed, pm, cuts, pw, S, pos + r0, pos_offset, out + r0, code + r0));
    }
    return KD_OK;
}

extern "C" kd_status kd_cuda_tree_walk(kd_backend *be, const kd_dtree *t, int n, int sampled) {
    kd_cuda *c = kd_cuda_of(be);
    if (!t || n < 0 || n > t->cap) return kd_fail(KD_ERR_ARG, "cuda tree_walk: %d nodes in a tree of %d", n, t ? t->cap : 0);
    KD_TRY(kd_launch_pdl("tree_walk_kernel", tree_walk_kernel, 1, WALK_THREADS, 0, c->stream, *t, n, sampled));
    return KD_OK;
}
