/* graph.cu: what makes a forward step capturable as a CUDA graph.
 *
 * A captured graph freezes every kernel argument. A decode or verify step is replayed at
 * a different sequence length each time, so the length must be read on the device: the
 * model keeps it in one int32 of its scratch (uploaded with the step's tokens), the new
 * latent rows are stored at rows *d_len.. (store_rows_at, here) and attention reads the
 * length itself (attention_at, mla.cu). Everything else a step touches already sits at
 * fixed addresses (weights, the sequence's cache and scratch, the backend's workspaces,
 * whose reallocation bumps ws_epoch so the model recaptures).
 *
 * Capture uses cudaStreamCaptureModeThreadLocal: a call that cannot be captured (a host
 * sync, an allocation) fails during the capture instead of running, the capture is then
 * discarded (graph_end reports it) and the model runs the step eagerly. A branch inside the
 * capture (backend.h: branch_begin) becomes a fork and a join of the graph; one still open at
 * the end (an op failed inside it) is closed and joined first, so the capture ends whole. */
#include "cuda_internal.cuh"

namespace {

/* dst rows r0 + i = src rows i (elements of type U, same dtype); rows past dst_rows, or a
 * negative r0, are not written (a defensive bound: the model checks len + n <= capacity) */
template <typename U>
__global__ void store_rows_kernel(U *dst, long long ldd, long long dst_rows, const int32_t *d_row0, const U *src,
                                  long long lds, int n, int cols) {
    kd_griddep_enter();
    const long long r0 = d_row0[0];
    const size_t total = (size_t)n * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / cols), c = (int)(i % cols);
        long long dr = r0 + r;
        if (r0 >= 0 && dr < dst_rows) dst[dr * ldd + c] = src[(size_t)r * lds + c];
    }
}

}  // namespace

extern "C" kd_status kd_cuda_store_rows_at(kd_backend *be, kd_act dst, const int32_t *d_len, kd_act src) {
    kd_cuda *c = kd_cuda_of(be);
    if (dst.dtype != src.dtype || dst.cols != src.cols || src.rows > dst.rows || src.rows < 0 ||
        (src.rows > 1 && src.ld < src.cols) || (dst.rows > 1 && dst.ld < dst.cols))
        return kd_fail(KD_ERR_ARG, "cuda store_rows_at: src %d x %d (%s, ld %d) into dst %d x %d (%s, ld %d): expected "
                       "the same dtype and cols, src rows <= dst rows", src.rows, src.cols, kd_dtype_name(src.dtype),
                       src.ld, dst.rows, dst.cols, kd_dtype_name(dst.dtype), dst.ld);
    if (!d_len) return kd_fail(KD_ERR_ARG, "cuda store_rows_at: the device length is NULL");
    if (src.rows == 0 || src.cols == 0) return KD_OK;
    if (!src.data || !dst.data) return kd_fail(KD_ERR_ARG, "cuda store_rows_at: NULL data");
    size_t es = kd_dtype_size(src.dtype), n = (size_t)src.rows * src.cols;
    int threads = 256;
    size_t b = (n + threads - 1) / threads, cap = (size_t)c->n_sms * 16;
    int blocks = (int)(b > cap ? cap : b < 1 ? 1 : b);
    if (es == 2)
        KD_TRY(kd_launch_pdl("store_rows_kernel", store_rows_kernel<uint16_t>, blocks, threads, 0, c->stream,
                             (uint16_t *)dst.data, dst.ld, dst.rows, d_len, (const uint16_t *)src.data, src.ld,
                             src.rows, src.cols));
    else if (es == 4)
        KD_TRY(kd_launch_pdl("store_rows_kernel", store_rows_kernel<uint32_t>, blocks, threads, 0, c->stream,
                             (uint32_t *)dst.data, dst.ld, dst.rows, d_len, (const uint32_t *)src.data, src.ld,
                             src.rows, src.cols));
    else
        return kd_fail(KD_ERR_ARG, "cuda store_rows_at: dtype %s: expected 2- or 4-byte elements",
                       kd_dtype_name(src.dtype));
    return KD_OK;
}

/* ---- capture and replay ---- */

extern "C" kd_status kd_cuda_graph_begin(kd_backend *be) {
    kd_cuda *c = kd_cuda_of(be);
    if (c->capturing) return kd_fail(KD_ERR_STATE, "cuda graph_begin: a capture is already open");
    if (c->branch) return kd_fail(KD_ERR_STATE, "cuda graph_begin: a branch is open");
    KD_TRY(kd_cuda_branch_join(c));   /* an eager branch's join cannot be captured */
    KD_CUDA(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    c->capturing = 1;
    return KD_OK;
}

extern "C" kd_status kd_cuda_graph_end(kd_backend *be, void **graph) {
    kd_cuda *c = kd_cuda_of(be);
    if (!graph) return kd_fail(KD_ERR_ARG, "cuda graph_end: graph is NULL");
    *graph = NULL;
    if (!c->capturing) return kd_fail(KD_ERR_STATE, "cuda graph_end: no capture is open");
    if (c->branch) kd_cuda_branch_end(be);
    kd_cuda_branch_join(c);   /* failures here invalidate the capture, which EndCapture reports */
    c->capturing = 0;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);   /* ends the capture even when it was invalidated */
    if (e != cudaSuccess || !g) {
        if (g) cudaGraphDestroy(g);
        return kd_cuda_fail(e != cudaSuccess ? e : cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture", __FILE__,
                            __LINE__);
    }
    cudaGraphExec_t x = NULL;
    e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        if (x) cudaGraphExecDestroy(x);
        return kd_cuda_fail(e, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
    *graph = (void *)x;
    return KD_OK;
}

extern "C" kd_status kd_cuda_graph_launch(kd_backend *be, void *graph) {
    kd_cuda *c = kd_cuda_of(be);
    if (!graph) return kd_fail(KD_ERR_ARG, "cuda graph_launch: graph is NULL");
    if (c->capturing) return kd_fail(KD_ERR_STATE, "cuda graph_launch: a capture is open");
    if (c->branch) return kd_fail(KD_ERR_STATE, "cuda graph_launch: a branch is open");
    KD_TRY(kd_cuda_branch_join(c));
    KD_CUDA(cudaGraphLaunch((cudaGraphExec_t)graph, c->stream));
    return KD_OK;
}

extern "C" void kd_cuda_graph_free(kd_backend *be, void *graph) {
    if (!graph) return;
    kd_cuda *c = kd_cuda_of(be);
    cudaSetDevice(be->device);
    if (!c->capturing) cudaStreamSynchronize(c->stream);   /* a launch of it may still be running */
    cudaGraphExecDestroy((cudaGraphExec_t)graph);
    cudaGetLastError();
}

extern "C" uint64_t kd_cuda_graph_epoch(kd_backend *be) { return kd_cuda_of(be)->ws_epoch; }
