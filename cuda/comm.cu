/* comm.cu: the CUDA communicator (core/comm.h) between the ranks of a tensor-parallel model.
 *
 * Two forms, chosen from the ranks' devices when it is made:
 * - NCCL, ranks on distinct devices: one ncclComm_t per rank, all from ncclCommInitRank over one
 *   ncclUniqueId (made here; a multi-node job would pass it out of band), initialised together
 *   inside ncclGroupStart/End from the creating thread, as NCCL allows for one process driving
 *   several GPUs. A collective is one NCCL call on the rank's backend stream, so it is captured
 *   when the rank's step graph is (graph.cu captures in cudaStreamCaptureModeThreadLocal, the
 *   mode NCCL asks for when each GPU has its own thread). The sum is NCCL's, in x's dtype: a bf16
 *   activation is reduced in bf16 arithmetic (each add rounded to bf16, in NCCL's ring or tree
 *   order), which keeps the wire at 2 bytes an element; every rank still ends with the same bits,
 *   because NCCL reduces each element once and copies the result to every rank. A caller that
 *   wants fp32 accumulation passes an fp32 view.
 * - The loopback, ranks that all share one device (NCCL refuses two ranks on one device): each
 *   rank records an event on its stream when its input is ready and meets the others at a host
 *   barrier; the last to arrive makes its stream wait on every rank's event, launches one kernel
 *   that sums the N buffers in rank order 0..N-1 in fp32 (rounded once to x's dtype) and writes
 *   the result to every rank's buffer, and records a done event that every other rank's stream
 *   waits on. Arrival order does not matter (the kernel and its order are the same whoever
 *   launches it), so every rank gets identical bits, equal to the CPU communicator's fold.
 *   The loopback cannot run inside a graph capture: its cross-rank event waits would join
 *   separate captures, which CUDA refuses; it says so (KD_ERR_UNSUPPORTED) before the barrier,
 *   and the model keeps step graphs off for ranks that share a device (docs/architecture.md).
 *
 * Failure: abort marks the communicator so that ranks in or entering a collective return
 * KD_ERR_STATE ("another rank failed"). For NCCL it also stops the operations that wait on
 * the missing rank on the GPU: ncclCommRevoke where the library has it (2.28.x; it stops them
 * without freeing the communicator, so a rank entering a call at that instant stays safe),
 * else ncclCommAbort. reset (all ranks idle) makes fresh NCCL communicators and marks the
 * backends' graphs stale (their captured collectives name the old ones). */
#include "cuda_internal.cuh"
#include <nccl.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "comm.h"
}

namespace {

enum { MAX_RANKS = 8, MSG = 512 };
enum coll_op { OP_ALL_REDUCE, OP_ALL_GATHER };

/* what each rank brought to a loopback collective */
struct loop_call {
    int op;
    kd_act x;                  /* all-reduce */
    const void *src;           /* all-gather */
    void *dst;
    size_t bytes;
};

struct cuda_comm {
    int n;
    int devices[MAX_RANKS];
    kd_backend *be[MAX_RANKS];
    bool loopback;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool aborted;
    /* NCCL */
    ncclComm_t nccl[MAX_RANKS];   /* after an abort: revoked (or freed, NULL); reset frees and remakes them */
    /* loopback: the barrier of the current collective and its result */
    int arrived;
    unsigned long long generation;
    loop_call call[MAX_RANKS];
    cudaEvent_t ready[MAX_RANKS];
    cudaEvent_t done;
    kd_status round_status;
    char round_msg[MSG];
};

struct ptr_table { void *p[MAX_RANKS]; };

/* ---- the loopback kernels ---- */

/* element i of every buffer <- buf[0][i] + buf[1][i] + ... + buf[n-1][i], in fp32, left to right */
__global__ void loop_sum_kernel(ptr_table bufs, int n_ranks, int dt, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float acc = kd_ld(bufs.p[0], dt, i);
        for (int r = 1; r < n_ranks; r++) acc += kd_ld(bufs.p[r], dt, i);
        for (int r = 0; r < n_ranks; r++) kd_st(bufs.p[r], dt, i, acc);
    }
}

/* the same sum, 8 bf16 elements (16 bytes) a thread: every pointer 16-byte aligned, n a multiple of 8;
 * each element is added in the same order as above, so the bits are the same */
__global__ void loop_sum_bf16x8_kernel(ptr_table bufs, int n_ranks, size_t n8) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float acc[8];
        uint4 v = ((const uint4 *)bufs.p[0])[i];
        const bf16 *e = (const bf16 *)&v;
        for (int j = 0; j < 8; j++) acc[j] = __bfloat162float(e[j]);
        for (int r = 1; r < n_ranks; r++) {
            v = ((const uint4 *)bufs.p[r])[i];
            for (int j = 0; j < 8; j++) acc[j] += __bfloat162float(e[j]);
        }
        bf16 *o = (bf16 *)&v;
        for (int j = 0; j < 8; j++) o[j] = __float2bfloat16(acc[j]);
        for (int r = 0; r < n_ranks; r++) ((uint4 *)bufs.p[r])[i] = v;
    }
}

/* dst[d][s*words + j] <- src[s][j] for every destination rank d and source rank s (U: a word) */
template <typename U>
__global__ void loop_gather_kernel(ptr_table src, ptr_table dst, int n_ranks, size_t words) {
    const size_t total = (size_t)n_ranks * n_ranks * words;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t j = i % words, s = (i / words) % n_ranks, d = i / (words * n_ranks);
        ((U *)dst.p[d])[s * words + j] = ((const U *)src.p[s])[j];
    }
}

int grid_for(kd_backend *be, size_t n) {
    const size_t b = (n + 255) / 256, cap = (size_t)kd_cuda_of(be)->n_sms * 8;
    return (int)(b < 1 ? 1 : b > cap ? cap : b);
}

/* ---- checks shared by both forms ---- */

const char *op_name(int op) { return op == OP_ALL_REDUCE ? "all-reduce" : "all-gather"; }

kd_status check_rank(const cuda_comm *c, int rank, const kd_backend *be, int op) {
    if (rank < 0 || rank >= c->n)
        return kd_fail(KD_ERR_ARG, "cuda comm %s: rank %d outside [0, %d)", op_name(op), rank, c->n);
    if (!be || be->kind != KD_BACKEND_CUDA || be->device != c->devices[rank])
        return kd_fail(KD_ERR_ARG, "cuda comm %s on rank %d: expected a CUDA backend on device %d, got %s", op_name(op),
                       rank, c->devices[rank], !be ? "NULL" : be->kind != KD_BACKEND_CUDA ? "another backend kind" :
                       "a backend on another device");
    return KD_OK;
}

/* x must be one flat run of elements: NCCL and the loopback kernel see it as a count */
kd_status check_act(int rank, kd_act x) {
    if (!kd_cuda_float_dtype(x.dtype))
        return kd_fail(KD_ERR_ARG, "cuda comm all-reduce on rank %d: dtype %s: expected f32, bf16 or f16", rank,
                       kd_dtype_name(x.dtype));
    if (x.rows < 0 || x.cols < 0 || (x.rows > 1 && x.ld != x.cols))
        return kd_fail(KD_ERR_ARG, "cuda comm all-reduce on rank %d: x is %d x %d with ld %d: expected contiguous rows "
                       "(ld == cols)", rank, x.rows, x.cols, x.ld);
    if (!x.data && x.rows && x.cols) return kd_fail(KD_ERR_ARG, "cuda comm all-reduce on rank %d: x.data is NULL", rank);
    return KD_OK;
}

/* the text starts as the CPU communicator's does: the rank threads (core/ranks.c) tell a rank that
 * failed on its own from one that stopped because another did by this prefix */
kd_status comm_state(cuda_comm *c, int rank, int op) {
    return kd_fail(KD_ERR_STATE, "communicator: another rank failed (the CUDA %s on rank %d, device %d, was "
                   "abandoned; reset the communicator when every rank is idle)", op_name(op), rank, c->devices[rank]);
}

/* ---- NCCL ---- */

kd_status nccl_fail(ncclResult_t r, ncclComm_t comm, const char *what) {
    const char *last = comm ? ncclGetLastError(comm) : ncclGetLastError(NULL);
    return kd_fail(KD_ERR_BACKEND, "%s: %s%s%s", what, ncclGetErrorString(r), last && *last ? ": " : "",
                   last ? last : "");
}

/* ncclCommRevoke exists from NCCL 2.28.x on: looked up in the loaded library, so an older 2.28
 * still loads (abort then frees the comms at once with ncclCommAbort) */
typedef ncclResult_t (*revoke_fn)(ncclComm_t, int);
revoke_fn nccl_revoke(void) {
    void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    revoke_fn f = lib ? (revoke_fn)dlsym(lib, "ncclCommRevoke") : NULL;
    if (lib) dlclose(lib);
    return f;
}

/* one comm per rank over one fresh unique id; on failure none is left */
kd_status nccl_init(cuda_comm *c) {
    ncclUniqueId id;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return nccl_fail(r, NULL, "NCCL ncclGetUniqueId");
    memset(c->nccl, 0, sizeof c->nccl);
    r = ncclGroupStart();
    for (int i = 0; i < c->n && r == ncclSuccess; i++) {
        if (cudaSetDevice(c->devices[i]) != cudaSuccess) {
            cudaGetLastError();
            r = ncclUnhandledCudaError;
            break;
        }
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 1;
        cfg.commName = "kdtree tp";
        r = ncclCommInitRankConfig(&c->nccl[i], c->n, id, i, &cfg);
    }
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess) r = e;
    if (r == ncclSuccess) return KD_OK;
    char devs[64] = "";
    for (int i = 0, o = 0; i < c->n && o < (int)sizeof devs - 4; i++)
        o += snprintf(devs + o, sizeof devs - (size_t)o, "%s%d", i ? "," : "", c->devices[i]);
    kd_status st = nccl_fail(r, NULL, "NCCL init");
    kd_fail_context(st, "cuda comm: NCCL communicators for %d ranks on devices %s", c->n, devs);
    for (int i = 0; i < c->n; i++)
        if (c->nccl[i]) {
            cudaSetDevice(c->devices[i]);
            ncclCommAbort(c->nccl[i]);
            c->nccl[i] = NULL;
        }
    return st;
}

/* frees every comm without waiting for peers (ncclCommAbort is local; ncclCommDestroy of several
 * comms in turn from one thread can wait on the ones not yet destroyed) */
void nccl_free(cuda_comm *c) {
    for (int i = 0; i < c->n; i++)
        if (c->nccl[i]) {
            cudaSetDevice(c->devices[i]);
            ncclCommAbort(c->nccl[i]);
            c->nccl[i] = NULL;
        }
}

ncclDataType_t nccl_dtype(kd_dtype t) {
    return t == KD_BF16 ? ncclBfloat16 : t == KD_F16 ? ncclFloat16 : ncclFloat32;
}

/* the rank's comm, or NULL when the communicator is aborted (the caller reports that) */
ncclComm_t nccl_comm_of(cuda_comm *c, int rank) {
    pthread_mutex_lock(&c->mu);
    ncclComm_t comm = c->aborted ? NULL : c->nccl[rank];
    pthread_mutex_unlock(&c->mu);
    return comm;
}

kd_status nccl_result(cuda_comm *c, int rank, int op, ncclResult_t r, ncclComm_t comm) {
    if (r == ncclSuccess) return KD_OK;
    pthread_mutex_lock(&c->mu);
    bool aborted = c->aborted;
    pthread_mutex_unlock(&c->mu);
    if (aborted) return comm_state(c, rank, op);   /* the comm may be gone: do not ask it */
    char what[96];
    snprintf(what, sizeof what, "NCCL %s on rank %d (device %d)", op_name(op), rank, c->devices[rank]);
    return nccl_fail(r, comm, what);
}

kd_status nccl_all_reduce(cuda_comm *c, int rank, kd_backend *be, kd_act x) {
    ncclComm_t comm = nccl_comm_of(c, rank);
    if (!comm) return comm_state(c, rank, OP_ALL_REDUCE);
    KD_CUDA(cudaSetDevice(c->devices[rank]));
    const size_t n = (size_t)x.rows * (size_t)x.cols;
    ncclResult_t r = ncclAllReduce(x.data, x.data, n, nccl_dtype(x.dtype), ncclSum, comm, kd_cuda_of(be)->stream);
    return nccl_result(c, rank, OP_ALL_REDUCE, r, comm);
}

kd_status nccl_all_gather(cuda_comm *c, int rank, kd_backend *be, const void *src, void *dst, size_t bytes) {
    ncclComm_t comm = nccl_comm_of(c, rank);
    if (!comm) return comm_state(c, rank, OP_ALL_GATHER);
    KD_CUDA(cudaSetDevice(c->devices[rank]));
    ncclResult_t r = ncclAllGather(src, dst, bytes, ncclUint8, comm, kd_cuda_of(be)->stream);
    return nccl_result(c, rank, OP_ALL_GATHER, r, comm);
}

/* ---- the loopback ---- */

/* every rank brought the same collective of the same shape (else the round fails on every rank) */
kd_status loop_check_round(const cuda_comm *c) {
    const loop_call *a = &c->call[0];
    for (int r = 1; r < c->n; r++) {
        const loop_call *b = &c->call[r];
        if (b->op != a->op)
            return kd_fail(KD_ERR_ARG, "cuda loopback: rank %d called %s while rank 0 called %s", r, op_name(b->op),
                           op_name(a->op));
        if (a->op == OP_ALL_REDUCE && (b->x.rows != a->x.rows || b->x.cols != a->x.cols || b->x.dtype != a->x.dtype))
            return kd_fail(KD_ERR_ARG, "cuda loopback all-reduce: rank %d has %d x %d %s, rank 0 has %d x %d %s", r,
                           b->x.rows, b->x.cols, kd_dtype_name(b->x.dtype), a->x.rows, a->x.cols,
                           kd_dtype_name(a->x.dtype));
        if (a->op == OP_ALL_GATHER && b->bytes != a->bytes)
            return kd_fail(KD_ERR_ARG, "cuda loopback all-gather: rank %d sends %zu bytes, rank 0 sends %zu", r,
                           b->bytes, a->bytes);
    }
    return KD_OK;
}

/* the last rank to arrive: on its stream, wait for every rank's input, run the collective, record done */
kd_status loop_launch(cuda_comm *c, kd_backend *be) {
    KD_TRY(loop_check_round(c));
    cudaStream_t s = kd_cuda_of(be)->stream;
    for (int r = 0; r < c->n; r++) KD_CUDA(cudaStreamWaitEvent(s, c->ready[r], 0));
    ptr_table a = {}, b = {};
    const loop_call *k = &c->call[0];
    if (k->op == OP_ALL_REDUCE) {
        const size_t n = (size_t)k->x.rows * (size_t)k->x.cols;
        bool x8 = k->x.dtype == KD_BF16 && n % 8 == 0;
        for (int r = 0; r < c->n; r++) {
            a.p[r] = c->call[r].x.data;
            x8 = x8 && (uintptr_t)a.p[r] % 16 == 0;
        }
        if (x8) loop_sum_bf16x8_kernel<<<grid_for(be, n / 8), 256, 0, s>>>(a, c->n, n / 8);
        else if (n) loop_sum_kernel<<<grid_for(be, n), 256, 0, s>>>(a, c->n, (int)k->x.dtype, n);
        if (n) KD_CUDA_LAUNCH("loopback sum kernel");
    } else if (k->bytes) {
        bool words = k->bytes % 4 == 0;
        for (int r = 0; r < c->n; r++) {
            a.p[r] = (void *)c->call[r].src;
            b.p[r] = c->call[r].dst;
            words = words && (uintptr_t)a.p[r] % 4 == 0 && (uintptr_t)b.p[r] % 4 == 0;
        }
        const size_t n = words ? k->bytes / 4 : k->bytes, total = n * (size_t)c->n * (size_t)c->n;
        if (words) loop_gather_kernel<uint32_t><<<grid_for(be, total), 256, 0, s>>>(a, b, c->n, n);
        else loop_gather_kernel<uint8_t><<<grid_for(be, total), 256, 0, s>>>(a, b, c->n, n);
        KD_CUDA_LAUNCH("loop_gather_kernel");
    }
    KD_CUDA(cudaEventRecord(c->done, s));
    return KD_OK;
}

kd_status loop_collective(cuda_comm *c, int rank, kd_backend *be, const loop_call *mine) {
    const int op = mine->op;
    cudaStream_t s = kd_cuda_of(be)->stream;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    KD_CUDA(cudaStreamIsCapturing(s, &cap));
    if (cap != cudaStreamCaptureStatusNone)
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda loopback %s on rank %d: %d ranks share device %d, and their cross-rank "
                       "waits cannot be captured in separate graphs; run these steps without graphs", op_name(op),
                       rank, c->n, c->devices[rank]);
    KD_CUDA(cudaSetDevice(c->devices[rank]));
    KD_CUDA(cudaEventRecord(c->ready[rank], s));

    pthread_mutex_lock(&c->mu);
    if (c->aborted) {
        pthread_mutex_unlock(&c->mu);
        return comm_state(c, rank, op);
    }
    c->call[rank] = *mine;
    if (++c->arrived == c->n) {
        kd_status st = loop_launch(c, be);
        c->round_status = st;
        if (st != KD_OK) snprintf(c->round_msg, sizeof c->round_msg, "%s", kd_last_error());
        c->arrived = 0;
        c->generation++;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        return st;
    }
    const unsigned long long g = c->generation;
    while (c->generation == g && !c->aborted) pthread_cond_wait(&c->cv, &c->mu);
    if (c->generation == g) {   /* aborted before the round ran */
        c->arrived--;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        return comm_state(c, rank, op);
    }
    const kd_status st = c->round_status;
    char msg[MSG];
    if (st != KD_OK) memcpy(msg, c->round_msg, sizeof msg);
    pthread_mutex_unlock(&c->mu);
    if (st != KD_OK) return kd_fail(st, "%s", msg);
    /* done was recorded in this round, and the next round re-records it only after this rank
     * arrives again, so the wait names this round's kernel */
    KD_CUDA(cudaStreamWaitEvent(s, c->done, 0));
    return KD_OK;
}

/* ---- the table ---- */

cuda_comm *impl_of(kd_comm *k) { return (cuda_comm *)k->impl; }

kd_status comm_all_reduce(kd_comm *k, int rank, kd_backend *be, kd_act x) {
    cuda_comm *c = impl_of(k);
    KD_TRY(check_rank(c, rank, be, OP_ALL_REDUCE));
    KD_TRY(check_act(rank, x));
    if (!c->loopback) return nccl_all_reduce(c, rank, be, x);
    loop_call mine = {};
    mine.op = OP_ALL_REDUCE;
    mine.x = x;
    return loop_collective(c, rank, be, &mine);
}

kd_status comm_all_gather(kd_comm *k, int rank, kd_backend *be, const void *src, void *dst, size_t bytes) {
    cuda_comm *c = impl_of(k);
    KD_TRY(check_rank(c, rank, be, OP_ALL_GATHER));
    if (bytes && (!src || !dst))
        return kd_fail(KD_ERR_ARG, "cuda comm all-gather on rank %d: src or dst is NULL", rank);
    if (!c->loopback) return nccl_all_gather(c, rank, be, src, dst, bytes);
    loop_call mine = {};
    mine.op = OP_ALL_GATHER;
    mine.src = src;
    mine.dst = dst;
    mine.bytes = bytes;
    return loop_collective(c, rank, be, &mine);
}

void comm_abort(kd_comm *k) {
    cuda_comm *c = impl_of(k);
    pthread_mutex_lock(&c->mu);
    const bool first = !c->aborted;
    c->aborted = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (!first || c->loopback) return;
    /* stop what waits on the GPU for the rank that failed */
    revoke_fn revoke = nccl_revoke();
    for (int i = 0; i < c->n; i++) {
        if (!c->nccl[i]) continue;
        cudaSetDevice(c->devices[i]);
        if (revoke) revoke(c->nccl[i], 0);
        else {
            ncclCommAbort(c->nccl[i]);
            c->nccl[i] = NULL;
        }
    }
}

/* all ranks idle: a loopback waits until every rank has left the barrier; NCCL comms are made anew */
void comm_reset(kd_comm *k) {
    cuda_comm *c = impl_of(k);
    pthread_mutex_lock(&c->mu);
    while (c->aborted && c->arrived > 0) pthread_cond_wait(&c->cv, &c->mu);
    const bool was_aborted = c->aborted;
    pthread_mutex_unlock(&c->mu);
    if (!was_aborted) return;
    if (!c->loopback) {
        int prev = 0;
        cudaGetDevice(&prev);
        nccl_free(c);
        const kd_status st = nccl_init(c);
        cudaSetDevice(prev);
        if (st != KD_OK) return;   /* stays aborted: the next collective says so */
        for (int i = 0; i < c->n; i++) kd_cuda_of(c->be[i])->ws_epoch++;   /* graphs name the old comms */
    }
    pthread_mutex_lock(&c->mu);
    c->aborted = false;
    pthread_mutex_unlock(&c->mu);
}

void comm_destroy(kd_comm *k) {
    if (!k) return;
    cuda_comm *c = impl_of(k);
    if (c) {
        nccl_free(c);
        for (int i = 0; i < c->n; i++)
            if (c->ready[i]) {
                cudaSetDevice(c->devices[i]);
                cudaEventDestroy(c->ready[i]);
            }
        if (c->done) cudaEventDestroy(c->done);
        cudaGetLastError();
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->cv);
        free(c);
    }
    free(k);
}

const kd_comm_ops cuda_comm_ops = {comm_all_reduce, comm_all_gather, comm_abort, comm_reset, comm_destroy};

/* ranks either all share one device (loopback) or all sit on distinct ones (NCCL) */
kd_status check_devices(int n, const int *devices, kd_backend *const *backends, bool *loopback) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda comm: no usable CUDA device (cudaGetDeviceCount: %s)",
                       cudaGetErrorString(e));
    }
    int same = 0, repeats = 0;
    for (int r = 0; r < n; r++) {
        if (devices[r] < 0 || devices[r] >= count)
            return kd_fail(KD_ERR_ARG, "cuda comm: rank %d: device %d does not exist (%d device%s)", r, devices[r], count,
                           count == 1 ? "" : "s");
        if (!backends[r] || backends[r]->kind != KD_BACKEND_CUDA || backends[r]->device != devices[r])
            return kd_fail(KD_ERR_ARG, "cuda comm: rank %d: expected a CUDA backend on device %d", r, devices[r]);
        same += devices[r] == devices[0];
        for (int q = 0; q < r; q++) repeats += devices[q] == devices[r];
    }
    *loopback = n > 1 && same == n;
    if (repeats && !*loopback)
        return kd_fail(KD_ERR_ARG, "cuda comm: %d ranks on devices with repeats but not all on one: expected every rank on "
                       "its own device (NCCL) or every rank on the same device (loopback)", n);
    return KD_OK;
}

kd_status loop_events(cuda_comm *c) {
    KD_CUDA(cudaSetDevice(c->devices[0]));
    for (int i = 0; i < c->n; i++) KD_CUDA(cudaEventCreateWithFlags(&c->ready[i], cudaEventDisableTiming));
    KD_CUDA(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming));
    return KD_OK;
}

}  // namespace

extern "C" kd_status kd_comm_cuda_create(int n_ranks, const int *devices, kd_backend *const *backends, kd_comm **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_comm_cuda_create: out is NULL");
    *out = NULL;
    if (n_ranks < 1 || n_ranks > MAX_RANKS)
        return kd_fail(KD_ERR_ARG, "kd_comm_cuda_create: %d ranks: expected 1..%d", n_ranks, (int)MAX_RANKS);
    if (!devices || !backends) return kd_fail(KD_ERR_ARG, "kd_comm_cuda_create: devices or backends is NULL");
    bool loopback = false;
    KD_TRY(check_devices(n_ranks, devices, backends, &loopback));
    kd_comm *k = (kd_comm *)calloc(1, sizeof *k);
    cuda_comm *c = (cuda_comm *)calloc(1, sizeof *c);
    if (!k || !c) {
        free(k);
        free(c);
        return kd_fail(KD_ERR_NOMEM, "kd_comm_cuda_create: out of host memory");
    }
    c->n = n_ranks;
    c->loopback = loopback;
    memcpy(c->devices, devices, (size_t)n_ranks * sizeof *devices);
    memcpy(c->be, backends, (size_t)n_ranks * sizeof *backends);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    k->ops = &cuda_comm_ops;
    k->n_ranks = n_ranks;
    k->impl = c;
    int prev = 0;
    cudaGetDevice(&prev);
    kd_status st = loopback ? loop_events(c) : nccl_init(c);
    cudaSetDevice(prev);
    if (st != KD_OK) {
        comm_destroy(k);
        return st;
    }
    *out = k;
    return KD_OK;
}
