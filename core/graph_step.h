/* graph_step.h: one fixed-shape backend step run through a CUDA graph (docs/architecture.md
 * "Step graphs"). Shared by the target's decode / verify steps (model.c) and the drafter's
 * draft pass (drafter.c). Private to the core.
 *
 * A slot holds at most one captured step. kd_graph_run(m, slot, body, ctx, what):
 *   - a slot holding a graph captured under an older workspace epoch drops it;
 *   - a held graph is launched (m->graph_launches);
 *   - the first run of a slot (it sizes the backend's workspaces, which must not grow inside a
 *     capture), and every run after two failed captures, calls body(ctx) eagerly;
 *   - otherwise body(ctx) is captured (nothing runs), and the graph is kept and launched
 *     (m->graph_captures, m->graphs_held); a failed capture (a call that cannot be captured,
 *     a workspace epoch that moved) is discarded and body(ctx) runs eagerly instead
 *     (m->graph_fallbacks; `what` not NULL: a line on stderr saying why).
 * body must enqueue the same work at every call (every argument at a fixed address) and
 * must not upload, download, sync or allocate: its inputs go up before kd_graph_run. */
#ifndef KD_GRAPH_STEP_H
#define KD_GRAPH_STEP_H
#include "model.h"

typedef struct kd_graph_slot {
    void *exec;          /* the captured step, or NULL */
    uint64_t epoch;      /* the backend's workspace epoch at capture */
    int runs, failures;
} kd_graph_slot;

typedef kd_status (*kd_graph_body)(void *ctx);

kd_status kd_graph_run(kd_model *m, kd_graph_slot *g, kd_graph_body body, void *ctx, const char *what);
/* free the slot's graph (if any); runs and failures are kept */
void kd_graph_slot_drop(kd_model *m, kd_graph_slot *g);
#endif
