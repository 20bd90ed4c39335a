/* griddep.cuh: programmatic dependent launch inside a kernel (sm_90 and later; no-ops before), one
 * definition for the backend's kernels (cuda_internal.cuh, launched by kd_launch_pdl) and the
 * W4A16 ones (w4a16_device.cuh, their own launch in w4a16.cu).
 *
 * A kernel launched with programmatic stream serialization may begin while the kernel before it in
 * the stream still runs, so its launch and block set-up overlap that kernel's tail. Until its
 * kd_griddep_wait it may only read what no kernel of a step writes (the weights) and write nothing;
 * kd_griddep_wait returns once the grid before it has completed and its writes are visible.
 * kd_griddep_release lets the next launch begin; it comes after the wait, never before (released
 * at entry, a third launch's blocks crowd the two running ones: w4a16_skinny.cu), so at most one
 * grid waits behind the running one. A kernel that never calls it releases at its end. Most
 * kernels start with kd_griddep_enter; the GEMM requests its first weight stages first. */
#ifndef KD_GRIDDEP_CUH
#define KD_GRIDDEP_CUH

__device__ __forceinline__ void kd_griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void kd_griddep_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}
__device__ __forceinline__ void kd_griddep_enter() {
    kd_griddep_wait();
    kd_griddep_release();
}

#endif
