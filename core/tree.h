/* tree.h: the DDTree draft tree (struct kd_tree) and the host-side helpers the
 * tree builder, the accept walk and the backends share.
 *
 * A tree is the root (node 0: the bonus token of the round) plus n drafted nodes
 * numbered 1..n in the order Algorithm 1 pops them (so every parent precedes its
 * children). For node i: token[i], parent[i] (-1 for the root), depth[i] (0 for the
 * root), rank[i] (its rank within its depth's top-K; -1 for the root, for chain
 * nodes and for nodes built on the backend) and score[i] (the summed log-prob of its
 * prefix, double; 0 for the root and for nodes built on the backend).
 *
 * Two copies: the host arrays below and a backend copy (dev, in the backend memory of
 * `model`). kd_tree_build / kd_tree_set_chain write the host copy; kd_verify uploads its
 * nodes once (for accept on the backend). kd_tree_build_drafted builds on the backend and
 * leaves the host copy stale until someone asks for it (kd_tree_nodes, kd_tree_visibility):
 * a DDTree round on a drafted tree moves no tree data to the host. The root token (token[0]) always lives on
 * the host and is written to the backend copy by kd_verify.
 */
#ifndef KD_TREE_H
#define KD_TREE_H
#include "kdtree.h"
#include "backend.h"
#include <stdbool.h>

struct kd_tree {
    int n;                 /* drafted nodes (root excluded) */
    int cap;               /* allocated entries (>= 1 + n) */
    int32_t *token, *parent, *depth, *rank;
    double *score;
    int32_t *first_child, *next_sibling;   /* child lists in pop order (-1 = none) */
    int max_depth;
    /* round bookkeeping: which sequence verified this tree, and the tree's version
     * at that time (any change of the tree bumps version and voids the round) */
    uint64_t version;
    const void *verified_by;
    uint64_t verified_version;
    /* the backend copy */
    kd_model *model;       /* whose backend holds dev (the tree holds a reference on it), or NULL */
    void *dev_buf;         /* the one backend allocation dev points into */
    size_t dev_bytes;      /* its size (on model->mem_trees while it is held) */
    kd_dtree dev;
    bool host_valid;       /* the host arrays hold nodes 1..n (token[0] is always valid) */
    bool dev_valid;        /* dev holds nodes 0..n (token[0] is staged by kd_verify), and the mask
                              when the tree was built there (a drafted build) */
    int dev_K;             /* the build's K (to name a bad draft value) */
    int depth_bound;       /* max_depth when host_valid, else an upper bound of it */
    bool accepted_on_device;   /* the last kd_accept of this tree ran on the backend (its result is there) */
};

/* Per row of scores [L, V]: the K best (value descending, equal values: lower id
 * first) of the row's log-probs (is_logprobs = 0: fp32 logits - logsumexp, see
 * tree.c; 1: the values as given), with -inf clamped to -FLT_MAX.
 * vals/ids: L x K. Errors (NaN, +inf, a logits row without a finite value) name the
 * row and column. */
kd_status kd_tree_topk_rows(const float *scores, int L, int V, int K, int is_logprobs,
                            float *vals, int32_t *ids);

/* Algorithm 1 on precomputed per-depth top-K lists (vals/ids: L x K, each row
 * descending). Keeps the root token. */
kd_status kd_tree_build_topk(kd_tree *t, const float *vals, const int32_t *ids, int L, int K,
                             int budget);

/* Algorithm 1 on plain arrays (the CPU backend's tree_select runs this): nodes 1..*n_out
 * into token/parent/depth/rank/score (1 + budget entries each; entry 0 is left alone).
 * List values are read as doubles with NaN and -inf clamped to -FLT_MAX and +inf to FLT_MAX
 * (the callers report NaN / +inf; clamping keeps the result a well-formed tree). */
kd_status kd_tree_select_host(const float *vals, const int32_t *ids, int L, int K, int budget, int32_t *token,
                              int32_t *parent, int32_t *depth, int32_t *rank, double *score, int *n_out);
/* the number of nodes Algorithm 1 pops: min(budget, K + K^2 + ... + K^L) */
int kd_tree_count(int L, int K, int budget);
/* the ancestor-only mask of nodes 0..n from their parents (rows of ceil((n+1)/64) words) */
void kd_tree_mask(const int32_t *parent, int n, uint64_t *dst);

/* lay out a backend copy for cap nodes and topk_cap list entries in the buffer at base
 * (NULL: only measure); returns its size in bytes */
size_t kd_dtree_layout(kd_dtree *d, void *base, int cap, int topk_cap);
/* make the host arrays hold the tree (downloads a tree built on the backend) */
kd_status kd_tree_host(kd_tree *t, const char *fn);
/* make t->dev hold the tree's nodes on m's backend for kd_accept (uploads the host copy when
 * needed; not the mask: a tree with a host copy is verified from the host arrays) */
kd_status kd_tree_to_backend(kd_tree *t, kd_model *m, const char *fn);
/* report a bad value the backend build saw (status word 0 set), or an unexpected node count */
kd_status kd_tree_build_error(const kd_tree *t, const int32_t *status, const char *fn);

/* Where the DDTree round runs (kd_model_options.ddtree_round): true = on the backend's ops
 * (tree_select, tree_stage, sample_rows / argmax, tree_walk, device-side compaction), false =
 * on the host as before the device round (top-K lists, logits rows or argmax ids and the
 * accepted ids travel through the host). */
bool kd_ddtree_on_device(const kd_model *m);

/* the child of `node` whose token is `token`, or -1 (host view) */
int kd_tree_child(const kd_tree *t, int node, int32_t token);
#endif
