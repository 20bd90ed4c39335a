/* comm_cpu.c: the in-process communicator of CPU ranks (comm.h).
 *
 * Every rank's buffers are host memory, so a collective is two barriers around plain loops:
 *   all_reduce_sum: each rank posts its view, barrier; rank r sums its share of the rows
 *     (rows [r*R/n, (r+1)*R/n)) over all ranks' views in rank order, rank 0 + rank 1 + ...
 *     left to right in fp32, into the shared result buffer; barrier; every rank copies the
 *     whole result into its own view. Each element is summed exactly once, by one thread, in
 *     one order, and every rank copies the same bits: every rank holds identical values.
 *     (A rank writes its view only after the second barrier, when every read of it is done;
 *     the result buffer is next written after the next call's first barrier, which a rank
 *     reaches only once it has copied this one.)
 *   all_gather: each rank posts its source, barrier; each copies every source into its dst;
 *     barrier (the sources stay valid until every rank has read them).
 * abort() wakes every waiter with KD_ERR_STATE; reset() clears it once the ranks are idle. */
#include "comm.h"
#include "error.h"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct cpu_comm {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;              /* ranks at the current barrier */
    uint64_t generation;      /* barriers completed */
    bool aborted;
    kd_act *views;            /* [n] the posted all-reduce views */
    const void **srcs;        /* [n] the posted all-gather sources */
    float *sum;               /* the all-reduce result, rows x cols */
    size_t sum_floats;
} cpu_comm;

static kd_status aborted_error(void) {
    return kd_fail(KD_ERR_STATE, "communicator: another rank failed (this collective was abandoned)");
}

/* all ranks arrive, or the communicator is aborted */
static kd_status barrier(cpu_comm *c, int n) {
    pthread_mutex_lock(&c->mu);
    if (c->aborted) { pthread_mutex_unlock(&c->mu); return aborted_error(); }
    uint64_t gen = c->generation;
    if (++c->arrived == n) {
        c->arrived = 0;
        c->generation++;
        pthread_cond_broadcast(&c->cv);
    } else {
        while (gen == c->generation && !c->aborted) pthread_cond_wait(&c->cv, &c->mu);
    }
    bool ab = c->aborted && gen == c->generation;
    pthread_mutex_unlock(&c->mu);
    return ab ? aborted_error() : KD_OK;
}

static float *row_f32(kd_act a, int row) { return (float *)a.data + (size_t)row * (size_t)a.ld; }

static kd_status cpu_all_reduce_sum(kd_comm *cm, int rank, kd_backend *be, kd_act x) {
    (void)be;
    cpu_comm *c = cm->impl;
    int n = cm->n_ranks;
    if (x.dtype != KD_F32)
        return kd_fail(KD_ERR_ARG, "cpu all_reduce_sum: rank %d: expected an F32 view, got %s", rank, kd_dtype_name(x.dtype));
    if (n == 1) return KD_OK;
    size_t need = (size_t)x.rows * (size_t)x.cols;
    /* read before the first barrier: nobody changes sum_floats until every rank has passed it */
    bool grow = need > c->sum_floats;
    c->views[rank] = x;
    KD_TRY(barrier(c, n));
    if (grow) {              /* every rank took this branch: one more barrier while rank 0 grows it */
        if (rank == 0) {
            float *p = realloc(c->sum, need * sizeof(float));
            if (p) { c->sum = p; c->sum_floats = need; }
        }
        KD_TRY(barrier(c, n));
        if (c->sum_floats < need) return kd_fail(KD_ERR_NOMEM, "cpu all_reduce_sum: cannot allocate %zu floats", need);
    }
    for (int r = 1; r < n; r++)
        if (c->views[r].rows != x.rows || c->views[r].cols != x.cols)
            return kd_fail(KD_ERR_ARG, "cpu all_reduce_sum: rank %d posted %d x %d, rank 0 %d x %d", r,
                           c->views[r].rows, c->views[r].cols, c->views[0].rows, c->views[0].cols);
    int r0 = (int)((int64_t)x.rows * rank / n), r1 = (int)((int64_t)x.rows * (rank + 1) / n);
    for (int row = r0; row < r1; row++) {
        float *dst = c->sum + (size_t)row * x.cols;
        memcpy(dst, row_f32(c->views[0], row), (size_t)x.cols * sizeof(float));
        for (int r = 1; r < n; r++) {
            const float *src = row_f32(c->views[r], row);
            for (int k = 0; k < x.cols; k++) dst[k] += src[k];
        }
    }
    KD_TRY(barrier(c, n));
    for (int row = 0; row < x.rows; row++)
        memcpy(row_f32(x, row), c->sum + (size_t)row * x.cols, (size_t)x.cols * sizeof(float));
    return KD_OK;
}

static kd_status cpu_all_gather(kd_comm *cm, int rank, kd_backend *be, const void *src, void *dst, size_t bytes) {
    (void)be;
    cpu_comm *c = cm->impl;
    int n = cm->n_ranks;
    c->srcs[rank] = src;
    KD_TRY(barrier(c, n));
    for (int r = 0; r < n; r++) memcpy((char *)dst + (size_t)r * bytes, c->srcs[r], bytes);
    return barrier(c, n);
}

static void cpu_abort(kd_comm *cm) {
    cpu_comm *c = cm->impl;
    pthread_mutex_lock(&c->mu);
    c->aborted = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void cpu_reset(kd_comm *cm) {
    cpu_comm *c = cm->impl;
    pthread_mutex_lock(&c->mu);
    c->aborted = false;
    c->arrived = 0;
    pthread_mutex_unlock(&c->mu);
}

static void cpu_destroy(kd_comm *cm) {
    if (!cm) return;
    cpu_comm *c = cm->impl;
    if (c) {
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
        free(c->views);
        free(c->srcs);
        free(c->sum);
        free(c);
    }
    free(cm);
}

static const kd_comm_ops cpu_comm_ops = {
    .all_reduce_sum = cpu_all_reduce_sum,
    .all_gather = cpu_all_gather,
    .abort = cpu_abort,
    .reset = cpu_reset,
    .destroy = cpu_destroy,
};

kd_status kd_comm_cpu_create(int n_ranks, kd_comm **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_comm_cpu_create: out is NULL");
    *out = NULL;
    if (n_ranks < 1) return kd_fail(KD_ERR_ARG, "kd_comm_cpu_create: %d ranks: expected at least 1", n_ranks);
    kd_comm *cm = calloc(1, sizeof *cm);
    cpu_comm *c = calloc(1, sizeof *c);
    if (c) {
        c->views = calloc((size_t)n_ranks, sizeof *c->views);
        c->srcs = calloc((size_t)n_ranks, sizeof *c->srcs);
    }
    if (!cm || !c || !c->views || !c->srcs) {
        if (c) { free(c->views); free(c->srcs); }
        free(c);
        free(cm);
        return kd_fail(KD_ERR_NOMEM, "kd_comm_cpu_create: out of memory");
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    cm->ops = &cpu_comm_ops;
    cm->n_ranks = n_ranks;
    cm->impl = c;
    *out = cm;
    return KD_OK;
}

/* The CUDA communicator lives in cuda/comm.cu; a build without CUDA answers with this stand-in.
 * Not a weak symbol: from a static archive (libkdtree_internal.a) the linker would take a weak
 * definition it meets first and never pull in cuda/comm.o. */
#ifndef KD_WITH_CUDA
kd_status kd_comm_cuda_create(int n_ranks, const int *devices, kd_backend *const *backends, kd_comm **out) {
    (void)devices;
    (void)backends;
    if (out) *out = NULL;
    return kd_fail(KD_ERR_UNSUPPORTED, "kd_comm_cuda_create: %d CUDA ranks need the NCCL communicator "
                   "(cuda/comm.cu), which this build does not have", n_ranks);
}
#endif
