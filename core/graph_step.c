/* graph_step.c: capture once, replay later (graph_step.h). */
#include "graph_step.h"
#include "error.h"
#include <stdio.h>

void kd_graph_slot_drop(kd_model *m, kd_graph_slot *g) {
    if (!g->exec) return;
    m->be->ops->graph_free(m->be, g->exec);
    g->exec = NULL;
    if (m->graphs_held) m->graphs_held--;
}

kd_status kd_graph_run(kd_model *m, kd_graph_slot *g, kd_graph_body body, void *ctx, const char *what) {
    kd_backend *be = m->be;
    if (g->exec && g->epoch != be->ops->graph_epoch(be)) kd_graph_slot_drop(m, g);   /* a workspace moved */
    if (g->exec) {
        KD_TRY(be->ops->graph_launch(be, g->exec));
        m->graph_launches++;
        return KD_OK;
    }
    if (g->runs == 0 || g->failures >= 2) {      /* warm-up (sizes the workspaces), or not capturable */
        g->runs++;
        return body(ctx);
    }
    uint64_t epoch = be->ops->graph_epoch(be);
    void *exec = NULL;
    kd_status st = be->ops->graph_begin(be);
    if (st == KD_OK) {
        st = body(ctx);
        kd_status st_end = be->ops->graph_end(be, &exec);     /* always ends the capture */
        if (st == KD_OK) st = st_end;
    }
    if (st == KD_OK && exec && be->ops->graph_epoch(be) == epoch) {
        g->exec = exec;
        g->epoch = epoch;
        g->runs++;
        m->graphs_held++;
        m->graph_captures++;
        KD_TRY(be->ops->graph_launch(be, exec));
        m->graph_launches++;
        return KD_OK;
    }
    /* the capture failed: nothing of it ran; run the step eagerly */
    if (what)
        fprintf(stderr, "kdtree: %s: graph capture failed, running eagerly: %s\n", what,
                st != KD_OK ? kd_last_error() : "workspace epoch changed");
    if (exec) be->ops->graph_free(be, exec);
    g->failures++;
    g->runs++;
    m->graph_fallbacks++;
    return body(ctx);
}
