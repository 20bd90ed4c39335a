/* kdtree_testing_ddtree.h: the op test surface of the DDTree round ops (backend.h:
 * topk + tree_select, sample_rows, tree_walk), not part of the engine's API.
 *
 * Each call runs one op on host inputs on the CPU or the CUDA backend and returns host
 * outputs, so a spec (spec/gpu_round_spec.lua) can compare the device against the host
 * definitions (kd_tree_build, kd_sample_logits, the accept walk).
 * FFI-clean like kdtree.h: the spec feeds it to ffi.cdef after kdtree.h. */
#ifndef KDTREE_TESTING_DDTREE_H
#define KDTREE_TESTING_DDTREE_H
#include "kdtree.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct kd_test_dd kd_test_dd;

/* kind: KD_BACKEND_CPU or KD_BACKEND_CUDA (device index for CUDA) */
kd_status kd_test_dd_new(kd_backend_kind kind, int device, kd_test_dd **out);
void kd_test_dd_free(kd_test_dd *h);

/* The kd_tree_build_drafted path: per-depth top-K (K = min(budget, V)) of log-probs [L, V]
 * (fp32, uploaded as given), then tree_select. Outputs of 1 + budget entries (entry 0 is the
 * root: token -1, parent -1, depth 0): tokens, parents, depths; vis (1+n) x ceil((1+n)/64)
 * words (room for (1+budget) x ceil((1+budget)/64)); status[4] = {bad value 0/1 NaN/2 +inf,
 * its index, n, 0}; *n = nodes built. KD_ERR_UNSUPPORTED: the backend cannot select that budget. */
kd_status kd_test_dd_tree(kd_test_dd *h, const float *logprobs, int L, int V, int budget, int *n, int32_t *tokens,
                          int32_t *parents, int32_t *depths, uint64_t *vis, int32_t *status);

/* sample_rows on rows x V fp32 logits at positions[i] (+ 0): out[i] the token, code[i] 0 or
 * the row's error code (kind | column << 2: 1 NaN, 2 +inf, 3 every logit -inf) */
kd_status kd_test_dd_sample(kd_test_dd *h, const float *logits, int rows, int V, const kd_sampler *sp,
                            const int32_t *positions, int32_t *out, int32_t *code);

/* tree_walk over a tree of 1+n nodes given on the host (tokens, parents, depths; tokens[0] the
 * root) with targets[1+n] and, when sampled, row codes[1+n]; the walk's header (8 words:
 * status, failing node, its position (pos0 = 100: position = 100 + depth + 1), tau, bonus,
 * n, build status x2), nodes[1+n] and toks[1+n] come back */
kd_status kd_test_dd_walk(kd_test_dd *h, const int32_t *tokens, const int32_t *parents, const int32_t *depths, int n,
                          const int32_t *targets, const int32_t *codes, int sampled, int32_t *hdr, int32_t *nodes,
                          int32_t *toks);

#ifdef __cplusplus
}
#endif
#endif
