/* tree.cu: per-row reductions over the vocabulary: log_softmax (in place), argmax, top-k.
 * log_softmax, argmax and top-k: several blocks per row, then a merge. Fixed
 * reduction orders or total orders, so a row's result never depends on the other rows. Order of
 * equal values: the lower id first (argmax and top-k), and NaN loses to everything, exactly as
 * core/cpu/cpu_elementwise.c; argmax reports a row's first NaN / +inf column as -code
 * (sample_rule.h) as the CPU op does.
 *
 * top-k (k up to 16384, V up to 2^31): passes over the row, several blocks per row each (a single
 * block's pass over a whole row is latency-bound: about 100 us for 163840 ids on the H200), append
 * a superset of the row's top k to the row's candidate slots, and one block per row sorts them
 * (bitonic, in shared memory). A small k (about 20 x k candidates fit the slots twice over: K = B
 * up to 128 at V = 163840) takes one pass: each block appends its 8192-id slice's keys from the
 * slice's k-th up, found by rounds of a shared histogram (topk_slice_kernel), and the sorting block
 * first narrows them to their k-th. A larger k takes three: a histogram of the keys' top 11 bits
 * finds the bin that holds the k-th largest value; when the bins from the top down to it hold
 * more than twice k ids (flat rows: thousands in the k-th's bin), a second row histogram, of that
 * bin's keys by their next 11 bits, narrows the cut to the sub-bin that holds the k-th; a third
 * pass appends the keys from the cut up. Where the candidates do not fit the slots (many equal
 * values), a radix select finds the k-th largest value in four 8-bit passes over the row, then
 * one ordered pass collects everything above it plus the lowest-id entries equal to it, and a
 * bitonic sort in shared memory orders the k candidates by (value desc, id asc). */
#include "cuda_internal.cuh"
#include "sample_rule.h"

namespace {

constexpr int ROW_THREADS = 1024;
constexpr int TOPK_MAX = 16384;
constexpr int TK_BITS = 11, TK_BINS = 1 << TK_BITS;   /* the first histogram: the key's top 11 bits */
constexpr int TK_SLICE = 4096;                        /* ids per block of that histogram */
constexpr int TK_CAND = 8192;                         /* most candidate slots per row */

__device__ __forceinline__ float ld_row(const void *x, int dt, size_t i) { return kd_ld(x, dt, i); }

/* log_softmax: each block takes LSM_SLICE ids of a row (one block's pass over a whole
 * 163840-id row is latency-bound), LSM_PER a thread, held in registers so that their loads are
 * in flight together: its max and its sum of exp(x - max) (lsm_part_kernel); then every block of
 * the row merges the row's partials in slice order, the same sums in every block, and writes
 * its slice's x - lse (lsm_apply_kernel). A slice with no value above -inf adds 0. */
constexpr int LSM_THREADS = 256, LSM_PER = 8, LSM_SLICE = LSM_THREADS * LSM_PER;
struct lsm_part { float m, s; };

__global__ void __launch_bounds__(LSM_THREADS) lsm_part_kernel(const void *x, int dt, long long ld, int cols,
                                                               lsm_part *part) {
    kd_griddep_enter();
    __shared__ float red[32];
    const size_t base = (size_t)blockIdx.y * ld;
    const int c0 = blockIdx.x * LSM_SLICE + threadIdx.x;
    float v[LSM_PER], m = -INFINITY;
#pragma unroll
    for (int j = 0; j < LSM_PER; j++) {
        const int c = c0 + j * LSM_THREADS;
        v[j] = c < cols ? ld_row(x, dt, base + c) : -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < LSM_PER; j++) m = fmaxf(m, v[j]);
    m = kd_block_max(m, red);
    float s = 0.0f;
    if (m > -INFINITY)
#pragma unroll
        for (int j = 0; j < LSM_PER; j++)
            if (c0 + j * LSM_THREADS < cols) s += expf(v[j] - m);
    s = kd_block_sum(s, red);
    if (threadIdx.x == 0) part[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = lsm_part{ m, s };
}

__global__ void __launch_bounds__(LSM_THREADS) lsm_apply_kernel(void *x, int dt, long long ld, int cols,
                                                                const lsm_part *part) {
    kd_griddep_enter();
    __shared__ float s_lse;
    const size_t base = (size_t)blockIdx.y * ld;
    const int c0 = blockIdx.x * LSM_SLICE + threadIdx.x;
    float v[LSM_PER];
#pragma unroll
    for (int j = 0; j < LSM_PER; j++) {
        const int c = c0 + j * LSM_THREADS;
        v[j] = c < cols ? ld_row(x, dt, base + c) : 0.0f;
    }
    if (threadIdx.x == 0) {
        const lsm_part *p = part + (size_t)blockIdx.y * gridDim.x;
        float m = -INFINITY, s = 0.0f;
        for (int i = 0; i < (int)gridDim.x; i++) m = fmaxf(m, p[i].m);
        for (int i = 0; i < (int)gridDim.x; i++)
            if (p[i].m > -INFINITY) s += p[i].s * expf(p[i].m - m);
        s_lse = m + logf(s);
    }
    __syncthreads();
    const float lse = s_lse;
#pragma unroll
    for (int j = 0; j < LSM_PER; j++) {
        const int c = c0 + j * LSM_THREADS;
        if (c < cols) kd_st(x, dt, base + c, v[j] - lse);
    }
}

/* a beats b: larger value, or equal and lower id; NaN loses to everything */
__device__ __forceinline__ bool beats(float va, int ia, float vb, int ib) {
    if (va != va) return false;
    if (vb != vb) return true;
    return va > vb || (va == vb && ia < ib);
}

/* argmax: each block reduces AM_SLICE ids of a row to a partial (value, id, first bad code),
 * several blocks per row, as one block's pass over a whole row is latency-bound; then one warp
 * per row merges the row's partials. beats is a total order on (value, id) and the code a
 * minimum, so the merge order cannot change the result. */
constexpr int AM_SLICE = 8192;
constexpr int AM_NONE = 0x7fffffff;   /* no id yet / no bad column */
struct am_part { float v; int i; int bad; };

__device__ __forceinline__ void am_merge(am_part &a, const am_part &b) {
    a.bad = min(a.bad, b.bad);
    if (b.i != AM_NONE && (a.i == AM_NONE || beats(b.v, b.i, a.v, a.i))) { a.v = b.v; a.i = b.i; }
}

__device__ __forceinline__ am_part am_warp_merge(am_part p) {
    for (int o = 16; o > 0; o >>= 1) {
        const am_part q = {__shfl_xor_sync(0xffffffffu, p.v, o), __shfl_xor_sync(0xffffffffu, p.i, o),
                           __shfl_xor_sync(0xffffffffu, p.bad, o)};
        am_merge(p, q);
    }
    return p;
}

/* the partial of row blockIdx.y's ids [blockIdx.x * AM_SLICE, + AM_SLICE), into part (rows x gridDim.x) */
__global__ void __launch_bounds__(256) argmax_part_kernel(const void *x, int dt, long long ld, int cols, am_part *part) {
    kd_griddep_enter();
    __shared__ am_part sp[8];
    const size_t base = (size_t)blockIdx.y * ld;
    const int lo = blockIdx.x * AM_SLICE, hi = min(cols, lo + AM_SLICE);
    am_part p = {NAN, AM_NONE, AM_NONE};   /* bad: the smallest code, the first bad column (its kind below it) */
    for (int c = lo + threadIdx.x; c < hi; c += blockDim.x) {
        const float v = ld_row(x, dt, base + c);
        const int32_t code = kd_rule_logit_code(v, c);
        if (code && code < p.bad) p.bad = code;
        if (p.i == AM_NONE || beats(v, c, p.v, p.i)) { p.v = v; p.i = c; }
    }
    p = am_warp_merge(p);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sp[warp] = p;
    __syncthreads();
    if (warp == 0) {
        p = lane < (int)(blockDim.x >> 5) ? sp[lane] : am_part{NAN, AM_NONE, AM_NONE};
        p = am_warp_merge(p);
        if (lane == 0) part[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = p;
    }
}

/* one warp per row: the row's argmax, or -code of its first NaN / +inf column (sample_rule.h) */
__global__ void argmax_merge_kernel(const am_part *part, int nparts, int rows, int32_t *out) {
    kd_griddep_enter();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;   /* whole warps */
    am_part p = {NAN, AM_NONE, AM_NONE};
    for (int j = lane; j < nparts; j += 32) am_merge(p, part[(size_t)row * nparts + j]);
    p = am_warp_merge(p);
    if (lane == 0) out[row] = p.bad != AM_NONE ? -p.bad : p.i == AM_NONE ? 0 : p.i;
}

/* The three passes over a row (histogram, sub-histogram, gather) take TK_SLICE ids a block of
 * TK_THREADS, TK_PER a thread: column slice_col(j) of row blockIdx.y for the thread's j-th. Their
 * keys are loaded into registers first, all in flight together: a loop that waits on each load
 * before the next is latency-bound (TK_PER dependent trips to L2 or DRAM a pass). */
constexpr int TK_THREADS = 256, TK_PER = TK_SLICE / TK_THREADS;
/* (the slice pass of a small k, topk_slice_kernel, takes wider slices with the same helpers) */
template <int THREADS = TK_THREADS, int PER = TK_PER>
__device__ __forceinline__ int slice_col(int j) { return blockIdx.x * (THREADS * PER) + j * THREADS + threadIdx.x; }
/* the thread's keys; bit j of the result: column slice_col(j) is inside the row */
template <int THREADS = TK_THREADS, int PER = TK_PER>
__device__ __forceinline__ int slice_keys(const void *x, int dt, long long ld, int cols, uint32_t *key) {
    static_assert(PER <= 32, "the mask holds a bit a key");
    const size_t base = (size_t)blockIdx.y * ld;
    int ok = 0;
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int c = slice_col<THREADS, PER>(j);
        key[j] = c < cols ? kd_float_key(ld_row(x, dt, base + c)) : 0u;
        if (c < cols) ok |= 1 << j;
    }
    return ok;
}
__device__ __forceinline__ unsigned long long topk_cand(uint32_t key, int col) {   /* value, then the lower id */
    return ((unsigned long long)key << 32) | (unsigned long long)(0xffffffffu - (uint32_t)col);
}
/* a slot for each lane with in set, taken from *count by one atomic add a warp (the lanes in lane
 * order); every lane of the warp calls it */
__device__ __forceinline__ unsigned int warp_slot(unsigned int *count, bool in) {
    const unsigned m = __ballot_sync(0xffffffffu, in);
    const int lane = threadIdx.x & 31;
    unsigned int base = 0;
    if (lane == 0 && m) base = atomicAdd(count, (unsigned)__popc(m));
    return __shfl_sync(0xffffffffu, base, 0) + (unsigned)__popc(m & ((1u << lane) - 1u));
}

/* h[bin] += 1 for each lane with in set, one shared atomic per distinct bin of the warp: a row's
 * keys crowd into few bins (a float key's top bits are its sign and exponent: every log-prob in
 * [-32, -16) shares 4 of them), and 32 lanes adding to one address take 32 turns. A warp with no
 * lane in skips the match (the narrower passes count few of their keys). */
__device__ __forceinline__ void warp_bin_add(unsigned int *h, uint32_t bin, bool in) {
    if (!__any_sync(0xffffffffu, in)) return;
    const unsigned peers = __match_any_sync(0xffffffffu, in ? bin : 0xffffffffu);
    if (in && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&h[bin], (unsigned)__popc(peers));
}

/* the row histogram of the keys' top TK_BITS bits, TK_SLICE ids per block, rows on grid.y */
__global__ void __launch_bounds__(TK_THREADS) topk_hist_kernel(const void *x, int dt, long long ld, int cols,
                                                        unsigned int *hist) {
    kd_griddep_enter();
    __shared__ unsigned int h[TK_BINS];
    uint32_t key[TK_PER];
    const int ok = slice_keys(x, dt, ld, cols, key);
    for (int i = threadIdx.x; i < TK_BINS; i += blockDim.x) h[i] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < TK_PER; j++) warp_bin_add(h, key[j] >> (32 - TK_BITS), (ok >> j) & 1);
    __syncthreads();
    unsigned int *g = hist + (size_t)blockIdx.y * TK_BINS;
    for (int i = threadIdx.x; i < TK_BINS; i += blockDim.x)
        if (h[i]) atomicAdd(&g[i], h[i]);
}

/* declared here, defined below: topk_hist2_kernel needs it before topk_kernel does */
struct top_bin { int bin; unsigned int through; };
__device__ __forceinline__ top_bin find_top_bin(const unsigned int *h, unsigned int need, int lane);

/* for a row whose top bins down to the k-th's hold more than wide ids (hist: topk_hist_kernel's
 * counts): the row histogram of that bin's keys by their next TK_BITS bits, TK_SLICE ids per
 * block, into hist2; other rows' blocks return at once */
__global__ void __launch_bounds__(TK_THREADS) topk_hist2_kernel(const void *x, int dt, long long ld, int cols, int k, int wide,
                                                         const unsigned int *hist, unsigned int *hist2) {
    kd_griddep_enter();
    __shared__ unsigned int h[TK_BINS];
    __shared__ int s_tb;
    __shared__ bool s_wide;
    const int tid = threadIdx.x;
    uint32_t key[TK_PER];   /* in flight while warp 0 finds the bin (a row that is not wide drops them) */
    const int ok = slice_keys(x, dt, ld, cols, key);
    if (tid < 32) {
        const top_bin t = find_top_bin(hist + (size_t)blockIdx.y * TK_BINS, (unsigned)k, tid);
        if (tid == 0) { s_tb = t.bin; s_wide = t.through > (unsigned)wide; }
    }
    for (int i = tid; i < TK_BINS; i += blockDim.x) h[i] = 0;
    __syncthreads();
    if (!s_wide) return;
    const uint32_t tb = (uint32_t)s_tb;
#pragma unroll
    for (int j = 0; j < TK_PER; j++)
        warp_bin_add(h, (key[j] >> (32 - 2 * TK_BITS)) & (TK_BINS - 1), ((ok >> j) & 1) && (key[j] >> (32 - TK_BITS)) == tb);
    __syncthreads();
    unsigned int *g = hist2 + (size_t)blockIdx.y * TK_BINS;
    for (int i = tid; i < TK_BINS; i += blockDim.x)
        if (h[i]) atomicAdd(&g[i], h[i]);
}

/* one warp: the bin of h (TK_BINS counts, the largest keys in the top bin) that holds the
 * need-th largest key (1 <= need <= the sum of h), and the count of that bin and every bin
 * above it, on every lane. Two rounds of loads, all of a round in flight together: each lane
 * sums its 64 bins (lane 0 the top ones) and a scan across the lanes finds the lane L whose bins
 * reach need; then each lane takes two of L's bins and a second scan finds the bin. (A lane
 * walking its bins one load at a time took up to 64 dependent trips to L2.) */
__device__ __forceinline__ unsigned int warp_incl_sum(unsigned int v, int lane) {
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    return v;
}
__device__ __forceinline__ top_bin find_top_bin(const unsigned int *h, unsigned int need, int lane) {
    constexpr int PER = TK_BINS / 32;
    static_assert(PER == 64, "the second round takes two of a lane's bins a lane");
    const uint4 *mine = (const uint4 *)(h + TK_BINS - PER * (lane + 1));   /* 256-byte aligned */
    uint4 q[PER / 4];
#pragma unroll
    for (int j = 0; j < PER / 4; j++) q[j] = mine[j];
    unsigned int sum = 0;
#pragma unroll
    for (int j = 0; j < PER / 4; j++) sum += q[j].x + q[j].y + q[j].z + q[j].w;
    const unsigned int incl = warp_incl_sum(sum, lane);
    const int L = __ffs(__ballot_sync(0xffffffffu, incl >= need)) - 1;
    const unsigned int before = __shfl_sync(0xffffffffu, incl - sum, L), need2 = need - before;
    const int top = TK_BINS - 1 - L * PER - 2 * lane;   /* this lane's bins of L's: top, top - 1 */
    const unsigned int a = h[top], b = h[top - 1];
    const unsigned int incl2 = warp_incl_sum(a + b, lane);
    const int L2 = __ffs(__ballot_sync(0xffffffffu, incl2 >= need2)) - 1;
    const bool first = incl2 - b >= need2;   /* bin top already reaches need2 */
    top_bin r = {first ? top : top - 1, before + (first ? incl2 - b : incl2)};
    r.bin = __shfl_sync(0xffffffffu, r.bin, L2);
    r.through = __shfl_sync(0xffffffffu, r.through, L2);
    return r;
}

/* one warp: a row's cut (the least key kept: the start of the bin that holds the k-th key, or of
 * its sub-bin when the bins down to it hold more than wide keys and hist2 has counted that bin)
 * and how many keys are at or above it, on every lane */
struct top_cut { uint32_t key; unsigned int count; };
__device__ __forceinline__ top_cut find_cut(const unsigned int *h, const unsigned int *h2, unsigned int k,
                                            unsigned int wide, int lane) {
    const top_bin t = find_top_bin(h, k, lane);
    top_cut c = {(uint32_t)t.bin << (32 - TK_BITS), t.through};
    if (t.through > wide) {   /* the t.through - h[t.bin] keys above bin t.bin are all kept */
        const unsigned int above = t.through - h[t.bin];
        const top_bin s = find_top_bin(h2, k - above, lane);
        c.key |= (uint32_t)s.bin << (32 - 2 * TK_BITS);
        c.count = above + s.through;
    }
    return c;
}

/* the keys from each row's cut up, TK_SLICE ids per block, appended in any order to the row's
 * cap slots of cand (composite keys: value, then the lower id first), their number in ncand
 * (zeroed by the caller); rows with more than cap such keys keep 0 there and are left to
 * topk_kernel's radix select. The order of the
 * slots does not matter: topk_kernel sorts them by a key that no two ids share. */
__global__ void __launch_bounds__(TK_THREADS) topk_gather_kernel(const void *x, int dt, long long ld, int cols, int k, int wide,
                                                          int cap, const unsigned int *hist, const unsigned int *hist2,
                                                          unsigned int *ncand, unsigned long long *cand) {
    kd_griddep_enter();
    __shared__ uint32_t s_cut;
    __shared__ bool s_fits;
    const int tid = threadIdx.x, lane = tid & 31;
    const size_t row = blockIdx.y;
    uint32_t key[TK_PER];   /* in flight while warp 0 finds the cut */
    const int ok = slice_keys(x, dt, ld, cols, key);
    if (tid < 32) {
        const top_cut c = find_cut(hist + row * TK_BINS, hist2 + row * TK_BINS, (unsigned)k, (unsigned)wide, lane);
        if (tid == 0) { s_cut = c.key; s_fits = c.count <= (unsigned)cap; }
    }
    __syncthreads();
    if (!s_fits) return;
    const uint32_t cut = s_cut;
    unsigned long long *out = cand + row * cap;
#pragma unroll
    for (int j = 0; j < TK_PER; j++) {   /* whole warps take each j together: the ballot below */
        const bool in = ((ok >> j) & 1) && key[j] >= cut;
        const unsigned int slot = warp_slot(&ncand[row], in);
        if (in) out[slot] = topk_cand(key[j], slice_col(j));
    }
}

/* The need-th largest of a block's keys (key[j] for the bits j of ok; need at least 1 and at most
 * their number) by three rounds of the shared histogram h over the keys that match the digits
 * found so far (11, 11 and 10 bits); s2: two shared words. Every thread of the block calls it. */
template <int PER>
__device__ uint32_t block_kth(const uint32_t (&key)[PER], unsigned int ok, unsigned int need, unsigned int *h,
                              unsigned int *s2) {
    const int tid = threadIdx.x, lane = tid & 31;
    uint32_t kth = 0;
#pragma unroll
    for (int r = 0; r < 3; r++) {
        const int shift = r == 0 ? 21 : r == 1 ? 10 : 0, width = r < 2 ? TK_BITS : 10;
        for (int i = tid; i < TK_BINS; i += blockDim.x) h[i] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const bool in = ((ok >> j) & 1) && (r == 0 || (key[j] >> (shift + width)) == kth);
            warp_bin_add(h, (key[j] >> shift) & ((1u << width) - 1u), in);
        }
        __syncthreads();
        if (tid < 32) {
            const top_bin t = find_top_bin(h, need, lane);
            if (lane == 0) { s2[0] = (unsigned)t.bin; s2[1] = t.through - h[t.bin]; }
        }
        __syncthreads();
        kth = (kth << width) | s2[0];
        need -= s2[1];
        __syncthreads();   /* h and s2 are rewritten by the next round */
    }
    return kth;
}

/* The slice pass of a small k (topk_by_slices): each block takes TS_SLICE ids of a row and appends
 * every key from its slice's k-th largest up (its slice's top k, and any key equal to the k-th) to
 * the row's cap slots of cand, in any order, their number in ncand (zeroed by the caller); a slice
 * of k ids or fewer appends them all. The row's top k are among them: about slices x k keys, which
 * topk_kernel narrows to its k-th. Slots past cap are not written and the count goes on, so a row of
 * many ties (ncand > cap) is left to topk_kernel's radix select. */
constexpr int TS_THREADS = 512, TS_PER = 16, TS_SLICE = TS_THREADS * TS_PER;
__global__ void __launch_bounds__(TS_THREADS) topk_slice_kernel(const void *x, int dt, long long ld, int cols, int k,
                                                                int cap, unsigned int *ncand,
                                                                unsigned long long *cand) {
    kd_griddep_enter();
    __shared__ __align__(16) unsigned int h[TK_BINS];
    __shared__ unsigned int s2[2], s_n, s_base;
    const int tid = threadIdx.x, lane = tid & 31;
    const size_t row = blockIdx.y;
    uint32_t key[TS_PER];
    const int ok = slice_keys<TS_THREADS, TS_PER>(x, dt, ld, cols, key);
    if (tid == 0) s_n = 0;
    /* the slice's k-th largest key (0: a slice of k ids or fewer, all kept); block_kth's barriers,
     * or the one here, come before s_n is added to. Its rounds count only the keys from lo up: the
     * k-th largest of the threads' maxima is at or below the slice's k-th (k threads hold a key
     * from it up; a slice of more than k ids has more than k threads holding one, or all
     * TS_THREADS, so lo exists when k < TS_THREADS), and finding it adds one key a thread to the
     * histogram, not every key */
    uint32_t kth = 0;
    if (cols - (int)blockIdx.x * TS_SLICE > k) {
        uint32_t lo = 0;
        if (k < TS_THREADS) {
            uint32_t tmax[1] = {0};
#pragma unroll
            for (int j = 0; j < TS_PER; j++)
                if (((ok >> j) & 1) && key[j] > tmax[0]) tmax[0] = key[j];
            lo = block_kth<1>(tmax, ok != 0, (unsigned)k, h, s2);
        }
        unsigned int from_lo = 0;
#pragma unroll
        for (int j = 0; j < TS_PER; j++)
            if (((ok >> j) & 1) && key[j] >= lo) from_lo |= 1u << j;
        kth = block_kth<TS_PER>(key, from_lo, (unsigned)k, h, s2);
    } else {
        __syncthreads();
    }
    /* append: a slot per warp in the block's run (s_n), then the block's run in the row's (ncand) */
    unsigned int wn = 0;
#pragma unroll
    for (int j = 0; j < TS_PER; j++) wn += __popc(__ballot_sync(0xffffffffu, ((ok >> j) & 1) && key[j] >= kth));
    unsigned int wbase = 0;
    if (lane == 0 && wn) wbase = atomicAdd(&s_n, wn);
    __syncthreads();
    if (tid == 0) s_base = atomicAdd(&ncand[row], s_n);
    __syncthreads();
    unsigned int pos = s_base + __shfl_sync(0xffffffffu, wbase, 0);
    unsigned long long *out = cand + row * cap;
#pragma unroll
    for (int j = 0; j < TS_PER; j++) {
        const bool in = ((ok >> j) & 1) && key[j] >= kth;
        const unsigned m = __ballot_sync(0xffffffffu, in);
        const unsigned int slot = pos + (unsigned)__popc(m & ((1u << lane) - 1u));
        if (in && slot < (unsigned)cap) out[slot] = topk_cand(key[j], slice_col<TS_THREADS, TS_PER>(j));
        pos += (unsigned)__popc(m);
    }
}

/* The candidate slots of a row, for k's power of two kp. The slice pass serves k whose slices'
 * candidates (about slices x k) fit the slots twice over, its slots that (a power of two, at
 * least 2048); the histograms and the gather take 4 kp (at least 2048, at most TK_CAND): twice
 * the most keys a row has after the second histogram, unless many keys tie there. */
__host__ __device__ __forceinline__ bool topk_by_slices(int cols, int kp) {
    return (long long)((cols + TS_SLICE - 1) / TS_SLICE) * kp * 2 <= TK_CAND;
}
__host__ __device__ __forceinline__ int topk_slice_cap(int cols, int kp) {
    int cap = 2048;
    while (cap < 2 * ((cols + TS_SLICE - 1) / TS_SLICE) * kp) cap <<= 1;   /* <= TK_CAND: topk_by_slices */
    return cap;
}
__host__ __device__ __forceinline__ int topk_gather_cap(int kp) {
    return 4 * kp < 2048 ? 2048 : 4 * kp < TK_CAND ? 4 * kp : TK_CAND;
}

/* One block per row. With gcand / ncand (the cap slots per row of topk_gather_kernel or
 * topk_slice_kernel, and how many they filled): a row whose candidates fit its slots (0 < ncand <=
 * cap: they hold the top k) sorts them, or, when they are many more than k, those from their k-th
 * up (block_kth, over the candidates in registers); else (or without gcand) the radix select
 * below finds the k-th over the row and collects the top k. Either way the sort orders a superset
 * of the top k by the same (key desc, id asc), so both give the same lists. */
constexpr int TK_CAND_PER = TK_CAND / ROW_THREADS;   /* a thread's candidates */
__global__ void __launch_bounds__(ROW_THREADS, 1) topk_kernel(const void *x, int dt, long long ld, int cols, int k,
                                                           int kpow2, int cap, const unsigned int *ncand,
                                                           const unsigned long long *gcand, float *vals,
                                                           int32_t *ids) {
    kd_griddep_enter();
    extern __shared__ unsigned long long cand[];     /* max(cap, kpow2) composite keys */
    __shared__ unsigned int hist[256];
    __shared__ __align__(16) unsigned int bins[TK_BINS];
    __shared__ unsigned int s_sel[3];
    __shared__ unsigned int warp_cnt[32];
    __shared__ unsigned int s_ngt, s_neq_taken;
    const size_t base = (size_t)blockIdx.x * ld;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    int nsort = kpow2;

    const unsigned int n = gcand ? ncand[blockIdx.x] : 0;   /* the row's candidates, if they fit */
    const bool gathered = n > 0 && n <= (unsigned)cap;
    if (gathered) {
        const unsigned long long *g = gcand + (size_t)blockIdx.x * cap;
        unsigned long long e[TK_CAND_PER];
        uint32_t key[TK_CAND_PER];
        unsigned int ok = 0;
#pragma unroll
        for (int j = 0; j < TK_CAND_PER; j++) {
            const int i = j * ROW_THREADS + tid;
            e[j] = i < (int)n ? g[i] : 0ull;
            key[j] = (uint32_t)(e[j] >> 32);
            if (i < (int)n) ok |= 1u << j;
        }
        if (tid == 0) s_ngt = 0;
        /* many more than k (the slices' candidates): the k-th of them first; its barriers order s_ngt */
        uint32_t kth = 0;
        if (n > 2u * (unsigned)kpow2) kth = block_kth<TK_CAND_PER>(key, ok, (unsigned)k, bins, s_sel);
        else __syncthreads();
#pragma unroll
        for (int j = 0; j < TK_CAND_PER; j++) {   /* the candidates from the k-th up, in any order */
            const bool in = ((ok >> j) & 1) && key[j] >= kth;
            const unsigned int slot = warp_slot(&s_ngt, in);
            if (in) cand[slot] = e[j];
        }
        __syncthreads();
        const int kept = (int)s_ngt;
        nsort = 1;
        while (nsort < kept) nsort <<= 1;   /* <= cap: a power of two */
        for (int i = kept + tid; i < nsort; i += blockDim.x) cand[i] = 0ull;   /* padding sorts last */
        __syncthreads();
    } else {

    /* radix select of the k-th largest key */
    uint32_t prefix = 0, mask = 0;
    unsigned int kr = (unsigned)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int c = tid; c < cols; c += blockDim.x) {
            uint32_t key = kd_float_key(ld_row(x, dt, base + c));
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            unsigned int cum = 0;
            int d = 255;
            for (; d > 0; d--) {
                if (cum + hist[d] >= kr) break;
                cum += hist[d];
            }
            s_sel[0] = (unsigned)d;
            s_sel[1] = kr - cum;
            s_sel[2] = hist[d];   /* after the last pass: how many keys equal the k-th */
        }
        __syncthreads();
        prefix |= s_sel[0] << shift;
        mask |= 255u << shift;
        kr = s_sel[1];
        __syncthreads();
    }
    const uint32_t kth = prefix;           /* the k-th largest key */
    const unsigned int n_eq_take = kr;     /* how many entries equal to it are kept (lowest ids) */

    /* collect: all keys > kth (any slot), and the first n_eq_take keys == kth in id order */
    if (tid == 0) { s_ngt = 0; s_neq_taken = 0; }
    for (int i = tid; i < kpow2; i += blockDim.x) cand[i] = 0ull;   /* padding sorts last */
    __syncthreads();
    const unsigned int n_gt_total = (unsigned)k - n_eq_take;
    /* every key >= kth is kept (no tie at the k-th, the usual case): one pass with no barriers;
     * else the equal keys go in id order, a barrier per slice of the row */
    const bool take_all = s_sel[2] == n_eq_take;
    for (int c0 = 0; take_all && c0 < cols; c0 += blockDim.x) {
        const int c = c0 + tid;
        const uint32_t key = c < cols ? kd_float_key(ld_row(x, dt, base + c)) : 0u;
        const bool in = c < cols && key >= kth;
        const unsigned int slot = warp_slot(&s_ngt, in);
        if (in) cand[slot] = topk_cand(key, c);
    }
    for (int c0 = 0; !take_all && c0 < cols; c0 += blockDim.x) {
        int c = c0 + tid;
        uint32_t key = c < cols ? kd_float_key(ld_row(x, dt, base + c)) : 0u;
        bool gt = c < cols && key > kth, eq = c < cols && key == kth;
        if (gt) {
            unsigned int slot = atomicAdd(&s_ngt, 1u);
            cand[slot] = topk_cand(key, c);
        }
        unsigned int m = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) warp_cnt[warp] = __popc(m);
        __syncthreads();
        unsigned int before = s_neq_taken;
        for (int w = 0; w < warp; w++) before += warp_cnt[w];
        unsigned int rank = before + __popc(m & ((1u << lane) - 1u));
        if (eq && rank < n_eq_take)
            cand[n_gt_total + rank] = topk_cand(key, c);
        __syncthreads();
        if (tid == 0) {
            unsigned int tot = 0;
            for (int w = 0; w < nw; w++) tot += warp_cnt[w];
            s_neq_taken += tot;
        }
        __syncthreads();
    }
    }
    /* bitonic sort, descending */
    for (int size = 2; size <= nsort; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < nsort; i += blockDim.x) {
                int j = i ^ stride;
                if (j > i) {
                    bool desc = (i & size) == 0;
                    unsigned long long a = cand[i], b = cand[j];
                    if (desc ? a < b : a > b) { cand[i] = b; cand[j] = a; }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k; i += blockDim.x) {
        int id = (int)(0xffffffffu - (uint32_t)(cand[i] & 0xffffffffull));
        ids[(size_t)blockIdx.x * k + i] = id;
        vals[(size_t)blockIdx.x * k + i] = ld_row(x, dt, base + id);
    }
}

static kd_status check_rows(const char *op, kd_act x) {
    if (!kd_cuda_float_dtype(x.dtype))
        return kd_fail(KD_ERR_ARG, "cuda %s: x: expected f32/bf16 values, got %s", op, kd_dtype_name(x.dtype));
    if (x.rows < 0 || x.cols <= 0 || (x.rows > 0 && !x.data))
        return kd_fail(KD_ERR_ARG, "cuda %s: x: bad view %d x %d", op, x.rows, x.cols);
    if (x.rows > 0x7fffffff) return kd_fail(KD_ERR_ARG, "cuda %s: too many rows", op);
    return KD_OK;
}

/* the row-pass launches put a row on each grid.y index, so they take at most ROWS_PER_LAUNCH
 * rows at a time: f(xr, r0) for each such run xr of x's rows from r0, stopping at an error */
constexpr int ROWS_PER_LAUNCH = 65535;
template <class F> kd_status each_launch_rows(kd_act x, F f) {
    for (int r0 = 0; r0 < x.rows; r0 += ROWS_PER_LAUNCH)
        KD_TRY(f(kd_act_rows(x, r0, x.rows - r0 < ROWS_PER_LAUNCH ? x.rows - r0 : ROWS_PER_LAUNCH), r0));
    return KD_OK;
}

}  // namespace

extern "C" kd_status kd_cuda_log_softmax(kd_backend *be, kd_act x) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(check_rows("log_softmax", x));
    if (!x.rows) return KD_OK;
    const int nparts = (x.cols + LSM_SLICE - 1) / LSM_SLICE;
    const int rows = x.rows < ROWS_PER_LAUNCH ? x.rows : ROWS_PER_LAUNCH;
    lsm_part *part = NULL;
    KD_TRY(kd_cuda_ws(be, KD_WS_TREE, (size_t)rows * nparts * sizeof(lsm_part), (void **)&part));
    return each_launch_rows(x, [&](kd_act xr, int) {
        const dim3 grid((unsigned)nparts, (unsigned)xr.rows);
        KD_TRY(kd_launch_pdl("lsm_part_kernel", lsm_part_kernel, grid, LSM_THREADS, 0, c->stream, xr.data, xr.dtype,
                             xr.ld, xr.cols, part));
        KD_TRY(kd_launch_pdl("lsm_apply_kernel", lsm_apply_kernel, grid, LSM_THREADS, 0, c->stream, xr.data, xr.dtype,
                             xr.ld, xr.cols, part));
        return KD_OK;
    });
}

extern "C" kd_status kd_cuda_argmax(kd_backend *be, kd_act x, int32_t *out) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(check_rows("argmax", x));
    if (!x.rows) return KD_OK;
    if (!out) return kd_fail(KD_ERR_ARG, "cuda argmax: out is NULL");
    const int nparts = (x.cols + AM_SLICE - 1) / AM_SLICE;
    const int rows = x.rows < ROWS_PER_LAUNCH ? x.rows : ROWS_PER_LAUNCH;
    am_part *part = NULL;
    KD_TRY(kd_cuda_ws(be, KD_WS_TREE, (size_t)rows * nparts * sizeof(am_part), (void **)&part));
    return each_launch_rows(x, [&](kd_act xr, int r0) {
        KD_TRY(kd_launch_pdl("argmax_part_kernel", argmax_part_kernel, dim3((unsigned)nparts, (unsigned)xr.rows), 256,
                             0, c->stream, xr.data, xr.dtype, xr.ld, xr.cols, part));
        KD_TRY(kd_launch_pdl("argmax_merge_kernel", argmax_merge_kernel, (xr.rows + 7) / 8, 256, 0, c->stream, part,
                             nparts, xr.rows, out + r0));
        return KD_OK;
    });
}

extern "C" kd_status kd_cuda_topk(kd_backend *be, kd_act x, int k, float *vals, int32_t *ids) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(check_rows("topk", x));
    if (k <= 0 || k > x.cols) return kd_fail(KD_ERR_ARG, "cuda topk: k = %d must be in [1, %d]", k, x.cols);
    if (k > TOPK_MAX) return kd_fail(KD_ERR_UNSUPPORTED, "cuda topk: k = %d is above the supported %d", k, TOPK_MAX);
    if (!x.rows) return KD_OK;
    if (!vals || !ids) return kd_fail(KD_ERR_ARG, "cuda topk: vals/ids are NULL");
    int kp = 1;
    while (kp < k) kp <<= 1;
    /* the passes over the rows (several blocks per row each) let most rows skip the radix passes:
     * for a small k the slice pass (topk_slice_kernel), else the histograms and the gather; grid.y
     * bounds the rows they take. cap = kp: neither (the radix select). */
    const bool fits = x.rows <= ROWS_PER_LAUNCH, by_slices = fits && topk_by_slices(x.cols, kp);
    const int cap = by_slices ? topk_slice_cap(x.cols, kp) : fits && kp < TK_CAND ? topk_gather_cap(kp) : kp;
    unsigned int *ncand = NULL;
    unsigned long long *gcand = NULL;
    if (cap > kp) {
        const size_t n = by_slices ? 0 : (size_t)x.rows * TK_BINS, ncap = (size_t)x.rows * cap;
        void *ws = NULL;   /* the slots, then the bins (both 16-byte aligned: find_top_bin) and ncand, zeroed */
        const size_t counts = (2 * n + (size_t)x.rows) * sizeof(unsigned int);
        KD_TRY(kd_cuda_ws(be, KD_WS_TREE, ncap * sizeof(unsigned long long) + counts, &ws));
        gcand = (unsigned long long *)ws;
        unsigned int *bins = (unsigned int *)(gcand + ncap), *bins2 = bins + n;   /* cap: a multiple of 2048 */
        ncand = bins2 + n;
        KD_CUDA(cudaMemsetAsync(bins, 0, counts, c->stream));
        if (by_slices) {
            const dim3 grid((unsigned)((x.cols + TS_SLICE - 1) / TS_SLICE), (unsigned)x.rows);
            KD_TRY(kd_launch_pdl("topk_slice_kernel", topk_slice_kernel, grid, TS_THREADS, 0, c->stream, x.data,
                                 x.dtype, x.ld, x.cols, k, cap, ncand, gcand));
        } else {
            const dim3 grid((unsigned)((x.cols + TK_SLICE - 1) / TK_SLICE), (unsigned)x.rows);
            KD_TRY(kd_launch_pdl("topk_hist_kernel", topk_hist_kernel, grid, TK_THREADS, 0, c->stream, x.data, x.dtype,
                                 x.ld, x.cols, bins));
            KD_TRY(kd_launch_pdl("topk_hist2_kernel", topk_hist2_kernel, grid, TK_THREADS, 0, c->stream, x.data, x.dtype,
                                 x.ld, x.cols, k, 2 * kp, bins, bins2));
            KD_TRY(kd_launch_pdl("topk_gather_kernel", topk_gather_kernel, grid, TK_THREADS, 0, c->stream, x.data,
                                 x.dtype, x.ld, x.cols, k, 2 * kp, cap, bins, bins2, ncand, gcand));
        }
    }
    size_t smem = (size_t)cap * sizeof(unsigned long long);
    KD_TRY(kd_cuda_smem(c, (const void *)topk_kernel, smem));
    KD_TRY(kd_launch_pdl("topk_kernel", topk_kernel, x.rows, ROW_THREADS, smem, c->stream, x.data, x.dtype, x.ld,
                         x.cols, k, kp, cap, ncand, gcand, vals, ids));
    return KD_OK;
}
