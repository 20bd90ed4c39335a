/* comm_cuda_none.c: kd_comm_cuda_create in a build without CUDA (the CUDA build has it in
 * cuda/comm.cu), so callers need no #ifdef to learn that the CUDA communicator is missing. */
#include "comm.h"
#include "error.h"

#ifndef KD_WITH_CUDA
kd_status kd_comm_cuda_create(int n_ranks, const int *devices, kd_backend *const *backends, kd_comm **out) {
    if (out) *out = NULL;
    return kd_fail(KD_ERR_UNSUPPORTED, "kd_comm_cuda_create: this build has no CUDA (built with CUDA=0)");
}
#endif
