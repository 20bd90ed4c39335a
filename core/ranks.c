/* ranks.c: the rank threads of a tensor-parallel model (model.h: kd_ranks_run).
 *
 * A model with tp > 1 owns tp - 1 persistent threads, one for each rank past rank 0; rank 0
 * runs on the caller's thread (so its error text is already there), the others wait for a job,
 * run it on their rank and report. One thread per rank is also what CUDA needs (one thread per
 * GPU for NCCL and graph capture). A rank that fails aborts the communicator, so ranks blocked
 * in a collective return instead of waiting for it; kd_ranks_run returns once every rank is
 * back, resets the communicator and hands the caller the failing rank's message (kd_last_error
 * is thread-local: a worker's text is copied across). */
#include "model.h"
#include "comm.h"
#include "error.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MSG_MAX = 1024 };

typedef struct worker {
    struct kd_workers *pool;
    int rank;
    pthread_t thread;
} worker;

struct kd_workers {
    kd_model *m;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t job;                 /* jobs posted */
    kd_rank_fn fn;
    void *ctx;
    int running;                  /* ranks of the current job not yet back */
    bool stop;
    worker *w;                    /* [tp]: entry 0 unused (rank 0 is the caller) */
    int started;
    kd_status *st;                /* [tp] the current job's statuses */
    char (*msg)[MSG_MAX];         /* [tp] their messages */
};

static const char ABORTED_PREFIX[] = "communicator: another rank failed";

static void record(struct kd_workers *p, int rank, kd_status st) {
    p->st[rank] = st;
    if (st == KD_OK) return;
    snprintf(p->msg[rank], MSG_MAX, "%s", kd_last_error());
    p->m->comm->ops->abort(p->m->comm);
}

static void *worker_main(void *arg) {
    worker *w = arg;
    struct kd_workers *p = w->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->job == seen) pthread_cond_wait(&p->go, &p->mu);
        if (p->stop) break;
        seen = p->job;
        kd_rank_fn fn = p->fn;
        void *ctx = p->ctx;
        pthread_mutex_unlock(&p->mu);
        kd_status st = fn(ctx, w->rank);
        pthread_mutex_lock(&p->mu);
        record(p, w->rank, st);
        if (--p->running == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

kd_status kd_workers_start(kd_model *m) {
    if (m->tp <= 1) return KD_OK;
    struct kd_workers *p = calloc(1, sizeof *p);
    if (p) {
        p->w = calloc((size_t)m->tp, sizeof *p->w);
        p->st = calloc((size_t)m->tp, sizeof *p->st);
        p->msg = calloc((size_t)m->tp, sizeof *p->msg);
    }
    if (!p || !p->w || !p->st || !p->msg) {
        if (p) { free(p->w); free(p->st); free(p->msg); }
        free(p);
        return kd_fail(KD_ERR_NOMEM, "kd_model_open: cannot allocate the rank threads' state");
    }
    p->m = m;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    m->workers = p;
    for (int r = 1; r < m->tp; r++) {
        p->w[r].pool = p;
        p->w[r].rank = r;
        if (pthread_create(&p->w[r].thread, NULL, worker_main, &p->w[r]) != 0)
            return kd_fail(KD_ERR_NOMEM, "kd_model_open: cannot start the thread of rank %d", r);   /* stop joins the started */
        p->started = r;
    }
    return KD_OK;
}

void kd_workers_stop(kd_model *m) {
    struct kd_workers *p = m->workers;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int r = 1; r <= p->started; r++) pthread_join(p->w[r].thread, NULL);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->mu);
    free(p->w);
    free(p->st);
    free(p->msg);
    free(p);
    m->workers = NULL;
}

kd_status kd_ranks_run(kd_model *m, kd_rank_fn fn, void *ctx) {
    if (m->tp <= 1) return fn(ctx, 0);
    struct kd_workers *p = m->workers;
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->running = m->tp - 1;
    for (int r = 0; r < m->tp; r++) p->st[r] = KD_OK;
    p->job++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);

    kd_status st0 = fn(ctx, 0);
    pthread_mutex_lock(&p->mu);
    record(p, 0, st0);
    while (p->running > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    m->comm->ops->reset(m->comm);

    /* the first rank that failed on its own; else the first that failed at all */
    int bad = -1;
    for (int r = 0; r < m->tp; r++) {
        if (p->st[r] == KD_OK) continue;
        bool secondary = !strncmp(p->msg[r], ABORTED_PREFIX, sizeof ABORTED_PREFIX - 1);
        if (bad < 0 || (!secondary && !strncmp(p->msg[bad], ABORTED_PREFIX, sizeof ABORTED_PREFIX - 1))) bad = r;
    }
    if (bad < 0) return KD_OK;
    return kd_fail(p->st[bad], "rank %d of %d: %s", bad, m->tp, p->msg[bad]);
}
