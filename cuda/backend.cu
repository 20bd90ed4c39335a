/* backend.cu: the CUDA backend's table, its device, stream and memory, and weight loading.
 *
 * One kd_backend drives one GPU (be->device). Every entry point first makes that device
 * current, so one host thread can drive several backends (tensor parallel, later). All
 * work goes to the backend's own stream in order; download() and sync() wait for it.
 *
 * Weights: bf16 and f32 tensors are copied from the memory-mapped checkpoint straight to
 * the device (cudaMemcpy from the mapping: no second full host copy); INT4 experts are
 * repacked by the W4A16 code (cuda/w4a16.cuh) into the layout its kernels stream.
 *
 * Several GPUs: one backend per rank; the collectives between ranks are the communicator's
 * (cuda/comm.cu, core/comm.h), which enqueues on each rank's backend stream. */
#include "cuda_internal.cuh"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

kd_status kd_cuda_fail(cudaError_t e, const char *call, const char *file, int line) {
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();   /* clear the sticky-free error so the engine stays usable */
        return kd_fail(KD_ERR_NOMEM, "cuda: %s at %s:%d: %s", call, base, line, cudaGetErrorString(e));
    }
    cudaGetLastError();
    return kd_fail(KD_ERR_BACKEND, "cuda: %s at %s:%d: %s", call, base, line, cudaGetErrorString(e));
}

kd_status kd_cublas_fail(cublasStatus_t e, const char *call, const char *file, int line) {
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    return kd_fail(e == CUBLAS_STATUS_ALLOC_FAILED ? KD_ERR_NOMEM : KD_ERR_BACKEND, "cublas: %s at %s:%d: %s", call,
                   base, line, cublasGetStatusString(e));
}

static const char *ws_name(int which) {
    static const char *names[KD_WS_COUNT] = {"gemm split-K partials", "attention partials", "moe routing",
                                             "moe expert activations", "top-k / argmax workspace", "staging",
                                             "w4a16 workspace", "swiglu up product"};
    return which >= 0 && which < KD_WS_COUNT ? names[which] : "workspace";
}

/* The limit is the device's, not the backend's: ranks that share a device (the loopback) each
 * have a backend, and a backend that set a smaller limit after another had set a larger one
 * would make the other's later launch fail while its table says the larger limit stands. So the
 * limit only ever rises (read, raise, under one lock for the process), and then each backend's
 * table of limits it has seen stays true. */
static pthread_mutex_t smem_lock = PTHREAD_MUTEX_INITIALIZER;

static kd_status raise_smem_limit(const void *fn, size_t smem) {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, fn);
    if (e == cudaSuccess && (size_t)attr.maxDynamicSharedSizeBytes < smem)
        e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return kd_cuda_fail(e, "cudaFuncSetAttribute (dynamic shared memory)", __FILE__, __LINE__);
    return KD_OK;
}

kd_status kd_cuda_smem(kd_cuda *c, const void *fn, size_t smem) {
    int i = 0;
    while (i < c->n_smem_set && c->smem_set[i].fn != fn) i++;
    if (i < c->n_smem_set && c->smem_set[i].smem >= smem) return KD_OK;
    pthread_mutex_lock(&smem_lock);
    const kd_status st = raise_smem_limit(fn, smem);
    pthread_mutex_unlock(&smem_lock);
    KD_TRY(st);
    if (i == c->n_smem_set) {
        if (i == (int)(sizeof c->smem_set / sizeof c->smem_set[0])) return KD_OK;   /* table full: ask every time */
        c->n_smem_set++;
    }
    c->smem_set[i].fn = fn;
    c->smem_set[i].smem = smem;
    return KD_OK;
}

kd_status kd_cuda_ws(kd_backend *be, int which, size_t bytes, void **ptr) {
    kd_cuda *c = kd_cuda_of(be);
    void **ws = &c->ws[c->branch][which];
    size_t *have = &c->ws_bytes[c->branch][which];
    if (bytes <= *have && *ws) {
        *ptr = *ws;
        return KD_OK;
    }
    if (c->capturing)   /* a captured graph cannot grow it (that waits and reallocates): the caller runs eagerly */
        return kd_fail(KD_ERR_STATE, "cuda: the %s would grow to %zu bytes during a graph capture", ws_name(which),
                       bytes);
    size_t want = bytes + bytes / 4;          /* headroom: fewer regrowths */
    if (want < ((size_t)1 << 20)) want = (size_t)1 << 20;
    if (*ws) {
        KD_CUDA(cudaStreamSynchronize(c->stream));   /* in-flight kernels of this queue may still read it */
        c->ws_epoch++;                               /* graphs captured with the old one are stale */
        cudaFree(*ws);
        c->bytes_workspace -= *have;
        *ws = NULL;
        *have = 0;
    }
    cudaError_t e = cudaMalloc(ws, want);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *ws = NULL;
        return kd_fail(e == cudaErrorMemoryAllocation ? KD_ERR_NOMEM : KD_ERR_BACKEND,
                       "cuda: cannot allocate %zu bytes of device memory for the %s on device %d: %s", want,
                       ws_name(which), c->device, cudaGetErrorString(e));
    }
    /* a new workspace starts zeroed: the GEMM's split-K tile counters rely on it (linear.cu) */
    e = cudaMemsetAsync(*ws, 0, want, c->stream);
    if (e != cudaSuccess) {
        cudaFree(*ws);
        *ws = NULL;
        return kd_cuda_fail(e, "cudaMemsetAsync (new workspace)", __FILE__, __LINE__);
    }
    *have = want;
    c->bytes_workspace += want;
    *ptr = *ws;
    return KD_OK;
}

/* ---- the branch (backend.h: branch_begin): queue[1] starts after queue[0]'s work so far
 * (fork_ev) and queue[0] waits for queue[1]'s at the join (join_ev); in a capture these are the
 * graph's fork and join edges ---- */
kd_status kd_cuda_branch_join(kd_cuda *c) {
    if (!c->branch_open) return KD_OK;
    KD_CUDA(cudaStreamWaitEvent(c->queue[0], c->join_ev, 0));
    c->branch_open = false;
    return KD_OK;
}

extern "C" kd_status kd_cuda_branch_begin(kd_backend *be) {
    kd_cuda *c = kd_cuda_of(be);
    if (c->branch) return kd_fail(KD_ERR_STATE, "cuda branch_begin: a branch is already open (no branch_end)");
    KD_TRY(kd_cuda_branch_join(c));
    KD_CUDA(cudaEventRecord(c->fork_ev, c->queue[0]));
    KD_CUDA(cudaStreamWaitEvent(c->queue[1], c->fork_ev, 0));
    c->branch = 1;
    c->stream = c->queue[1];
    return KD_OK;
}

extern "C" kd_status kd_cuda_branch_end(kd_backend *be) {
    kd_cuda *c = kd_cuda_of(be);
    if (!c->branch) return kd_fail(KD_ERR_STATE, "cuda branch_end: no branch is open");
    c->branch = 0;
    c->stream = c->queue[0];
    KD_CUDA(cudaEventRecord(c->join_ev, c->queue[1]));
    c->branch_open = true;
    return KD_OK;
}

/* ---- memory ---- */
static kd_status set_dev(kd_backend *be) {
    KD_CUDA(cudaSetDevice(be->device));
    return KD_OK;
}

static void cuda_destroy(kd_backend *be) {
    if (!be) return;
    kd_cuda *c = kd_cuda_of(be);
    if (c) {
        cudaSetDevice(be->device);
        for (int q = 0; q < 2; q++)
            if (c->queue[q]) cudaStreamSynchronize(c->queue[q]);
        for (int q = 0; q < 2; q++)
            for (int i = 0; i < KD_WS_COUNT; i++) if (c->ws[q][i]) cudaFree(c->ws[q][i]);
        free(c->bufs);
        if (c->cublas) cublasDestroy(c->cublas);
        for (int q = 0; q < 2; q++)
            if (c->queue[q]) cudaStreamDestroy(c->queue[q]);
        if (c->fork_ev) cudaEventDestroy(c->fork_ev);
        if (c->join_ev) cudaEventDestroy(c->join_ev);
        free(c);
    }
    free(be);
}

static kd_status cuda_alloc(kd_backend *be, size_t bytes, void **ptr) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(set_dev(be));
    *ptr = NULL;
    cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 16);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *ptr = NULL;
        return kd_fail(e == cudaErrorMemoryAllocation ? KD_ERR_NOMEM : KD_ERR_BACKEND,
                       "cuda: cannot allocate %zu bytes of device memory (backend buffer) on device %d: %s", bytes,
                       be->device, cudaGetErrorString(e));
    }
    e = cudaMemsetAsync(*ptr, 0, bytes ? bytes : 16, c->stream);
    if (e != cudaSuccess) {
        cudaFree(*ptr);
        *ptr = NULL;
        return kd_cuda_fail(e, "cudaMemsetAsync (zero-fill)", __FILE__, __LINE__);
    }
    if (c->n_bufs == c->cap_bufs) {        /* remember the size, so free() can account for it */
        int cap = c->cap_bufs ? 2 * c->cap_bufs : 64;
        kd_cuda_buf *nb = (kd_cuda_buf *)realloc(c->bufs, (size_t)cap * sizeof *nb);
        if (!nb) {
            cudaFree(*ptr);
            *ptr = NULL;
            return kd_fail(KD_ERR_NOMEM, "cuda: out of host memory for the buffer table");
        }
        c->bufs = nb;
        c->cap_bufs = cap;
    }
    c->bufs[c->n_bufs].ptr = *ptr;
    c->bufs[c->n_bufs].bytes = bytes;
    c->n_bufs++;
    c->bytes_alloc += bytes;
    return KD_OK;
}

static void cuda_free(kd_backend *be, void *ptr) {
    if (!ptr) return;
    kd_cuda *c = kd_cuda_of(be);
    for (int i = c->n_bufs - 1; i >= 0; i--)
        if (c->bufs[i].ptr == ptr) {
            c->bytes_alloc = c->bytes_alloc > c->bufs[i].bytes ? c->bytes_alloc - c->bufs[i].bytes : 0;
            c->bufs[i] = c->bufs[--c->n_bufs];
            break;
        }
    cudaSetDevice(be->device);
    cudaFree(ptr);   /* waits for the device; frees are rare (sequence close) */
}

static void cuda_mem_usage(kd_backend *be, kd_mem_usage *out) {
    kd_cuda *c = kd_cuda_of(be);
    memset(out, 0, sizeof *out);
    out->weights = c->bytes_weights;
    out->buffers = c->bytes_alloc;
    out->workspace = c->bytes_workspace;
    size_t fr = 0, tot = 0;
    if (cudaSetDevice(be->device) == cudaSuccess && cudaMemGetInfo(&fr, &tot) == cudaSuccess) {
        out->device_free = fr;
        out->device_total = tot;
    }
    cudaGetLastError();
}

static kd_status cuda_upload(kd_backend *be, void *dst, const void *src, size_t bytes) {
    kd_cuda *c = kd_cuda_of(be);
    if (!bytes) return KD_OK;
    KD_TRY(set_dev(be));
    KD_TRY(kd_cuda_branch_join(c));
    KD_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    /* the host buffer may be reused by the caller at once: pageable copies are staged by
     * the driver before returning, but wait anyway so pinned callers are safe too */
    KD_CUDA(cudaStreamSynchronize(c->stream));
    return KD_OK;
}

static kd_status cuda_download(kd_backend *be, void *dst, const void *src, size_t bytes) {
    kd_cuda *c = kd_cuda_of(be);
    if (!bytes) return KD_OK;
    KD_TRY(set_dev(be));
    KD_TRY(kd_cuda_branch_join(c));
    KD_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    KD_CUDA(cudaStreamSynchronize(c->stream));
    return KD_OK;
}

static kd_status cuda_sync(kd_backend *be) {
    kd_cuda *c = kd_cuda_of(be);
    KD_TRY(set_dev(be));
    KD_TRY(kd_cuda_branch_join(c));
    KD_CUDA(cudaStreamSynchronize(c->stream));
    return KD_OK;
}

/* ---- weights ---- */
/* rows of row_bytes each, src_pitch bytes apart in the host mapping (a rank's column slice of a
 * wider tensor), packed into one device allocation */
static kd_status dev_copy_of(kd_backend *be, const void *src, size_t row_bytes, size_t src_pitch, size_t rows,
                             const char *what, const char *name, void **out) {
    kd_cuda *c = kd_cuda_of(be);
    size_t bytes = row_bytes * rows;
    *out = NULL;
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 16);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *out = NULL;
        return kd_fail(e == cudaErrorMemoryAllocation ? KD_ERR_NOMEM : KD_ERR_BACKEND,
                       "cuda: cannot allocate %zu bytes of device memory for %s of weight '%s' on device %d: %s", bytes,
                       what, name, be->device, cudaGetErrorString(e));
    }
    e = cudaMemcpy2DAsync(*out, row_bytes, src, src_pitch, row_bytes, rows, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaFree(*out);
        *out = NULL;
        return kd_cuda_fail(e, "cudaMemcpy2DAsync (weight upload)", __FILE__, __LINE__);
    }
    return KD_OK;
}


static kd_status cuda_weight_load(kd_backend *be, kd_weight *w) {
    kd_cuda *c = kd_cuda_of(be);
    const char *name = w && w->name ? w->name : "(unnamed)";
    if (!w || !w->src) return kd_fail(KD_ERR_ARG, "cuda weight_load: weight '%s' has no data", name);
    if (w->rows <= 0 || w->cols <= 0)
        return kd_fail(KD_ERR_ARG, "cuda weight_load: weight '%s' has shape [%lld, %lld]", name, (long long)w->rows,
                       (long long)w->cols);
    KD_TRY(set_dev(be));
    size_t cols = (size_t)w->cols, ld = (size_t)kd_weight_ld(w), rows = (size_t)w->rows;
    switch (w->format) {
    case KD_W_BF16:
        KD_TRY(dev_copy_of(be, w->src, cols * 2, ld * 2, rows, "the bf16 values", name, &w->dev));
        break;
    case KD_W_F32:
        KD_TRY(dev_copy_of(be, w->src, cols * 4, ld * 4, rows, "the f32 values", name, &w->dev));
        break;
    case KD_W_INT4:
        if (!w->src_scale) return kd_fail(KD_ERR_ARG, "cuda weight_load: INT4 weight '%s' has no scales", name);
        if (w->group <= 0 || w->cols % 8 || w->cols % w->group)
            return kd_fail(KD_ERR_ARG, "cuda weight_load: INT4 weight '%s': group %d and 8 must divide cols %lld", name,
                           w->group, (long long)w->cols);
#if KD_HAVE_W4A16
        KD_TRY(kd_cuda_w4a16_repack(be, w));
        break;
#else
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda weight_load: INT4 weight '%s': this build has no W4A16 kernels", name);
#endif
    default:
        return kd_fail(KD_ERR_ARG, "cuda weight_load: weight '%s': unknown format %d", name, (int)w->format);
    }
    /* as the memory walk counts it (INT4: the codes and bf16 scales at the checkpoint's size; the
     * repacked form pads them to 16-row tiles and 64-column chunks) */
    c->bytes_weights += kd_weight_held(w);
    return KD_OK;
}

static void cuda_weight_free(kd_backend *be, kd_weight *w) {
    if (!w) return;
    kd_cuda *c = kd_cuda_of(be);
    cudaSetDevice(be->device);
    const uint64_t b = kd_weight_held(w);
    if (w->dev) cudaFree(w->dev);   /* one allocation: an INT4 weight's scales live inside it */
    c->bytes_weights = c->bytes_weights > b ? c->bytes_weights - b : 0;
    w->dev = NULL;
    w->dev_scale = NULL;
}

/* ---- the op table: each entry makes the backend's device current first ---- */
#define KD_DEV_WRAP(ret, name, params, args) \
    static ret name##_dev params { KD_TRY(set_dev(be)); return kd_cuda_##name args; }
#define KD_DEV_WRAP_OP(name, params, args) KD_DEV_WRAP(kd_status, name, params, args)

KD_BACKEND_OPS(KD_DEV_WRAP_OP)
KD_DEV_WRAP(kd_status, experts_load, (kd_backend *be, kd_experts *e), (be, e))
KD_DEV_WRAP(kd_status, graph_begin, (kd_backend *be), (be))
KD_DEV_WRAP(kd_status, graph_end, (kd_backend *be, void **g), (be, g))
KD_DEV_WRAP(kd_status, graph_launch, (kd_backend *be, void *g), (be, g))
KD_DEV_WRAP(kd_status, branch_begin, (kd_backend *be), (be))
KD_DEV_WRAP(kd_status, branch_end, (kd_backend *be), (be))

static void experts_free_dev(kd_backend *be, kd_experts *e) {
    cudaSetDevice(be->device);
    kd_cuda_experts_free(be, e);
}

static kd_backend_ops make_ops() {
    kd_backend_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.destroy = cuda_destroy;
    o.alloc = cuda_alloc;
    o.free = cuda_free;
    o.upload = cuda_upload;
    o.download = cuda_download;
    o.sync = cuda_sync;
    o.weight_load = cuda_weight_load;
    o.weight_free = cuda_weight_free;
    o.experts_load = experts_load_dev;
    o.experts_free = experts_free_dev;
#define KD_DEV_ENTRY(name, params, args) o.name = name##_dev;
    KD_BACKEND_OPS(KD_DEV_ENTRY)
#undef KD_DEV_ENTRY
    o.graph_begin = graph_begin_dev;
    o.graph_end = graph_end_dev;
    o.graph_launch = graph_launch_dev;
    o.graph_free = kd_cuda_graph_free;
    o.graph_epoch = kd_cuda_graph_epoch;
    o.branch_begin = branch_begin_dev;
    o.branch_end = branch_end_dev;
    o.mem_usage = cuda_mem_usage;
    return o;
}
static const kd_backend_ops cuda_ops = make_ops();

extern "C" kd_status kd_backend_cuda_create(int device, const kd_model_options *opt, kd_backend **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_backend_cuda_create: out is NULL");
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kd_fail(KD_ERR_UNSUPPORTED, "cuda: no usable CUDA device (cudaGetDeviceCount: %s)", cudaGetErrorString(e));
    }
    if (device < 0 || device >= count)
        return kd_fail(KD_ERR_ARG, "cuda: device %d does not exist (%d device%s)", device, count, count == 1 ? "" : "s");
    kd_backend *be = (kd_backend *)calloc(1, sizeof *be);
    kd_cuda *c = (kd_cuda *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return kd_fail(KD_ERR_NOMEM, "kd_backend_cuda_create: out of host memory");
    }
    be->ops = &cuda_ops;
    be->kind = KD_BACKEND_CUDA;
    be->act_dtype = KD_BF16;
    be->device = device;
    be->impl = c;
    c->device = device;
    const kd_model_options none = {};
    if (!opt) opt = &none;
    c->mla_tc = opt->mla_kernel != KD_MLA_CUDA_CORES;
    c->mla_vsplit = opt->mla_value_slices == 0 ? 8 : opt->mla_value_slices < 0 ? 0 : opt->mla_value_slices;
    c->mla_rg = opt->mla_row_groups;
    kd_status st = KD_OK;
    cudaDeviceProp prop;
    e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device);
    for (int q = 0; q < 2 && e == cudaSuccess; q++) e = cudaStreamCreateWithFlags(&c->queue[q], cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->fork_ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->join_ev, cudaEventDisableTiming);
    c->stream = c->queue[0];
    if (e != cudaSuccess) {
        st = kd_cuda_fail(e, "creating the backend (cudaSetDevice / properties / streams / events)", __FILE__, __LINE__);
        cuda_destroy(be);
        return st;
    }
    c->n_sms = prop.multiProcessorCount;
    c->smem_optin = prop.sharedMemPerBlockOptin;
    *out = be;
    return KD_OK;
}
