/* slice_cuda.h: the CUDA pieces of scripts/bench/model_slice_bench.c (plain C interface):
 * CUDA events on the backend's own stream, the copy / read ceilings measured in the same
 * run, and what the device is. Built only for `make bench` (scripts/bench/slice_cuda.cu);
 * without it the bench times with the host clock between syncs. */
#ifndef KD_SLICE_CUDA_H
#define KD_SLICE_CUDA_H
#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif
/* n timing events, recorded on be's stream */
kd_status kd_slice_ev_init(kd_backend *be, int n);
void kd_slice_ev_fini(void);
kd_status kd_slice_ev_mark(int i);                    /* record event i (0 <= i < n) */
kd_status kd_slice_ev_ms(int a, int b, float *ms);    /* waits for event b; ms from a to b */
/* ceilings: cudaMemcpyAsync device to device (GB/s of bytes read + written) and a
 * read-only kernel of 16-byte streaming loads (GB/s read); bytes per buffer */
kd_status kd_slice_ceilings(kd_backend *be, size_t bytes, double *copy_gbs, double *read_gbs);
/* the device: name, SMs, memory (GiB), L2 (MB), driver and runtime versions */
kd_status kd_slice_device(kd_backend *be, char *name, size_t cap, int *sms, double *mem_gib, double *l2_mb,
                          int *driver, int *runtime);
/* the latency of one all-reduce (sum) of a [rows, cols] bf16 tensor through NCCL on one rank
 * (ncclCommInitRank with nranks 1 on be's device), `reps` of them captured in one CUDA graph on
 * be's stream: the median over 10 graph launches (after 3 warm-up) / reps, in microseconds.
 * Out of place, so every call moves the bytes (in place, one rank has nothing to do). */
kd_status kd_slice_allreduce_us(kd_backend *be, int rows, int cols, int reps, double *us);
/* cudaProfilerStart (on) / cudaProfilerStop (off), after a sync of be's stream: the window that
 * `ncu --profile-from-start off` profiles */
kd_status kd_slice_profiler(kd_backend *be, int on);
#ifdef __cplusplus
}
#endif
#endif
