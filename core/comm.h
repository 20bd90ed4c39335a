/* comm.h: the communicator between the ranks of a tensor-parallel model (docs/architecture.md
 * "Several devices"). The model's forward calls all_reduce_sum twice per layer on every rank,
 * each rank on its own thread; an implementation fixes the order of the sum so that every rank
 * ends with bit-identical values, which keeps every rank on the same path (the same accepted
 * tokens, the same collectives) without a broadcast.
 * Implementations: core/comm_cpu.c (in-process ranks, host memory), cuda/comm.cu (NCCL between
 * devices, a loopback for ranks that share one). */
#ifndef KD_COMM_H
#define KD_COMM_H
#include "backend.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct kd_comm kd_comm;
typedef struct kd_comm_ops {
    /* x (rank r's backend memory) <- the elementwise sum over all ranks' x. Every rank ends with
     * bit-identical values; the order of the sum is fixed by the implementation (CPU and loopback:
     * rank 0 + rank 1 + ... left to right, accumulated in fp32). Called on rank r's own thread;
     * CPU blocks until all ranks arrive; CUDA enqueues on be's stream (capturable in a graph). */
    kd_status (*all_reduce_sum)(kd_comm *c, int rank, kd_backend *be, kd_act x);
    /* every rank's `bytes` at src -> dst[rank*bytes ...] on every rank (backend memory) */
    kd_status (*all_gather)(kd_comm *c, int rank, kd_backend *be, const void *src, void *dst, size_t bytes);
    /* a rank that fails marks the communicator so that ranks waiting in a collective return
     * KD_ERR_STATE ("another rank failed") instead of waiting forever; reset clears it when all
     * ranks are idle again. */
    void (*abort)(kd_comm *c);
    void (*reset)(kd_comm *c);
    void (*destroy)(kd_comm *c);
} kd_comm_ops;
struct kd_comm { const kd_comm_ops *ops; int n_ranks; void *impl; };

kd_status kd_comm_cpu_create(int n_ranks, kd_comm **out);                          /* core/comm_cpu.c */
/* devices[r] for each rank; ranks on distinct devices use NCCL (ncclCommInitRank over one shared
 * ncclUniqueId, one comm per rank); ranks that share a device use the loopback (a fixed-order
 * sum kernel over peer buffers on that device, ordered with events). KD_ERR_UNSUPPORTED without CUDA. */
kd_status kd_comm_cuda_create(int n_ranks, const int *devices, kd_backend *const *backends, kd_comm **out);  /* cuda/comm.cu */
#ifdef __cplusplus
}
#endif
#endif
