/* tree.h: the DDTree draft tree (struct kd_tree) and the host-side helpers the
 * tree builder, the accept walk and the backends share.
 *
 * A tree is the root (node 0: the bonus token of the round) plus n drafted nodes
 * numbered 1..n in the order Algorithm 1 pops them (so every parent precedes its
 * children). For node i: token[i], parent[i] (-1 for the root), depth[i] (0 for the
 * root), rank[i] (its rank within its depth's top-K; -1 for the root and for chain
 * nodes) and score[i] (the summed log-prob of its prefix, double; 0 for the root).
 */
#ifndef KD_TREE_H
#define KD_TREE_H
#include "kdtree.h"
#include <stdbool.h>

enum { KD_TREE_MAX_DEPTH = 64 };   /* L (the depth limit) at most this */

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

/* the child of `node` whose token is `token`, or -1 */
int kd_tree_child(const kd_tree *t, int node, int32_t token);
#endif
