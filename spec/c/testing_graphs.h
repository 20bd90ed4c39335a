/* testing_graphs.h: a host emulation of the backend's step-graph ops, for specs (not part
 * of the engine's API; FFI-clean like kdtree.h, loaded by spec/graphs_spec.lua).
 *
 * kd_testing_emulate_graphs gives a CPU model's backend the optional ops a CUDA backend
 * has for step graphs: store_rows_at and attention_at read the length from backend (here
 * host) memory when they run, and a "capture" records the op calls with their arguments
 * instead of running them; a launch replays the record. That is what a CUDA graph does
 * with kernel arguments, so the core's graph path (model.c) can be proven on any machine:
 * a step whose record bakes in a host value that changes per step (a length, a row offset)
 * replays wrong. Calls that a CUDA capture refuses (upload, download, sync, alloc, free,
 * and ops the forward does not use) fail the emulated capture too. One emulated model at
 * a time per process; the model must be on the CPU backend. */
#ifndef KDTREE_TESTING_GRAPHS_H
#define KDTREE_TESTING_GRAPHS_H
#include "kdtree.h"
#ifdef __cplusplus
extern "C" {
#endif

kd_status kd_testing_emulate_graphs(kd_model *m);
/* pretend a workspace was reallocated: graphs captured before are stale */
void kd_testing_graphs_bump_epoch(kd_model *m);
/* recorded op calls replayed so far (a check that replays really ran) */
uint64_t kd_testing_graphs_replayed_ops(void);
/* the next n captures fail as if a call the capture refuses had been made */
void kd_testing_graphs_refuse(int n);

#ifdef __cplusplus
}
#endif
#endif
