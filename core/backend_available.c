/* backend_available.c: kd_backend_available(), the public "can this build run backend X
 * here" question. The CPU backend always can; the CUDA backend when it was compiled in
 * (KD_WITH_CUDA) and a device can actually be opened: we create and destroy a backend on
 * device 0, so a machine with the CUDA runtime but no usable GPU answers 0. */
#include "backend.h"

int kd_backend_available(kd_backend_kind kind) {
    if (kind == KD_BACKEND_CPU) return 1;
    if (kind == KD_BACKEND_CUDA) {
#ifdef KD_WITH_CUDA
        kd_backend *be = NULL;
        if (kd_backend_cuda_create(0, NULL, &be) != KD_OK || !be) return 0;
        be->ops->destroy(be);
        return 1;
#else
        return 0;
#endif
    }
    return 0;
}
