/* ddtree.c: one DDTree round on a sequence, after the tree is built:
 *   kd_verify  one target forward over root + nodes at positions len + depth, each
 *              token seeing the committed past, its ancestors and itself; KV for all
 *              1+n rows is written at slots len..len+n and left pending.
 *   kd_accept  one target token per node (greedy argmax, or the keyed sampling rule of
 *              sample.c with the position of the token the node produces: len+depth+1),
 *              walk from the root along the child whose token equals the current
 *              node's target token; tau = accepted nodes incl. the root; bonus = the
 *              target token of the last accepted node (the next round's root).
 *   kd_commit  gather the accepted rows' KV into place (len += tau) and hand their tap
 *              features to the drafter context.
 * On the backend (kd_ddtree_on_device, tree.h) everything runs on the sequence's backend
 * (backend.h: tree_stage, argmax / sample_rows, tree_walk, gather_rows) on the tree's backend
 * copy (tree.h): a tree built there by kd_tree_build_drafted is staged straight into the
 * verify forward's inputs, and accept downloads one small result (tau, bonus, the accepted
 * nodes and tokens). A tree built on the host is uploaded once by kd_verify. Otherwise the
 * round runs on the host as it did before the device round (accept_host, kd_seq_compact).
 * The round is a small state machine in s->phase (IDLE -> VERIFIED -> ACCEPTED -> IDLE);
 * the tree remembers which sequence verified it and its own version at that time,
 * so a tree changed after verify (or another tree) cannot be accepted or committed.
 */
#include "tree.h"
#include "sample.h"
#include "sample_rule.h"
#include "error.h"
#include "model.h"
#include "drafter.h"
#include "forward.h"
#include <string.h>
#include <stdio.h>
#include <stdlib.h>

/* the round on the backend's ops: rank 0's (at tp > 1 the logits rows are gathered whole onto
 * rank 0 for accept, KD_GATHER_ROWS at a time, and commit moves every rank's cache from the
 * accepted nodes the result brought to the host) */
static bool round_on_device(const kd_seq *s) {
    return kd_ddtree_on_device(s->model);
}

enum { ACCEPT_MAX = (int)(sizeof(((kd_seq *)0)->accepted) / sizeof(int32_t)) };

static const char *phase_name(kd_seq_phase p) {
    switch (p) {
    case KD_PHASE_IDLE: return "idle";
    case KD_PHASE_VERIFIED: return "verified";
    case KD_PHASE_ACCEPTED: return "accepted";
    }
    return "?";
}

/* the round on s belongs to t, and t is unchanged since kd_verify */
static kd_status check_round_tree(const kd_seq *s, const kd_tree *t, const char *fn) {
    if (t->verified_by != (const void *)s || t->verified_version != t->version)
        return kd_fail(KD_ERR_STATE, "%s: this tree is not the one verified on this sequence%s", fn,
                       t->verified_by == (const void *)s ? " (it changed after kd_verify)" : "");
    if (s->out_rows != t->n + 1)
        return kd_fail(KD_ERR_STATE, "%s: the last forward has %d output rows, the verified tree %d nodes", fn,
                       s->out_rows, t->n + 1);
    return KD_OK;
}

/* the host-side checks kd_forward makes, for a tree staged on the backend */
static kd_status check_staged(const kd_seq *s, int T) {
    if (s->pending > 0)
        return kd_fail(KD_ERR_STATE, "kd_verify: %d rows of the last masked (tree) forward are still pending: "
                       "commit them (kd_commit / kd_seq_compact) or drop them (kd_seq_truncate) first", s->pending);
    if ((int64_t)s->len + T > s->capacity)
        return kd_fail(KD_ERR_CAPACITY, "kd_verify: %d tree tokens after %d cached would exceed the sequence "
                       "capacity of %d tokens", T, s->len, s->capacity);
    if (T > s->out_cap)
        return kd_fail(KD_ERR_CAPACITY, "kd_verify: a tree of %d tokens exceeds the %d rows per forward of this "
                       "sequence", T, s->out_cap);
    return KD_OK;
}

/* a tree with a host copy: kd_forward with host arrays (it validates the tokens), and the
 * nodes uploaded for accept */
static kd_status verify_host_tree(kd_seq *s, kd_tree *t, int T) {
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)T);
    int words = (T + 63) / 64;
    uint64_t *vis = malloc(sizeof(uint64_t) * (size_t)T * (size_t)words);
    kd_status st = KD_OK;
    if (!pos || !vis) st = kd_fail(KD_ERR_NOMEM, "kd_verify: cannot allocate the mask of %d tree tokens", T);
    if (st == KD_OK) {
        for (int i = 0; i < T; i++) pos[i] = s->len + t->depth[i];
        kd_tree_mask(t->parent, t->n, vis);
        if (round_on_device(s)) st = kd_tree_to_backend(t, s->model, "kd_verify");
    }
    if (st == KD_OK && round_on_device(s)) {
        kd_backend *be = s->model->be;
        st = be->ops->tree_stage(be, &t->dev, t->n, t->token[0], s->len, NULL, NULL, NULL);
    }
    if (st == KD_OK) {
        st = kd_forward(s, t->token, T, pos, vis);
        if (st != KD_OK) kd_fail_context(st, "kd_verify (%d tree tokens at position %d)", T, s->len);
    }
    free(pos);
    free(vis);
    return st;
}

/* a tree on the backend: staged into the forward's input regions, no host round trip */
static kd_status verify_dev_tree(kd_seq *s, kd_tree *t, int T) {
    KD_TRY(check_staged(s, T));
    kd_backend *be = s->model->be;
    kd_fwd_plan p;
    kd_fwd_plan_make(s->model, s->out_cap, &p);
    char *sc = (char *)s->rk[0].scratch;
    uint64_t *d_vis = (uint64_t *)(sc + p.vis);
    KD_TRY(be->ops->tree_stage(be, &t->dev, t->n, t->token[0], s->len, (int32_t *)(sc + p.ids),
                               (int32_t *)(sc + p.pos), d_vis));
    /* tokens NULL: the inputs are staged (model.c); the host keeps no positions */
    kd_status st = kd_model_forward(s, NULL, T, NULL, d_vis);
    if (st != KD_OK) kd_fail_context(st, "kd_verify (%d tree tokens at position %d)", T, s->len);
    return st;
}

kd_status kd_verify(kd_seq *s, kd_tree *t) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_verify: sequence is NULL");
    if (!t) return kd_fail(KD_ERR_ARG, "kd_verify: tree is NULL");
    if (s->phase != KD_PHASE_IDLE)
        return kd_fail(KD_ERR_STATE, "kd_verify: a round is open on this sequence (phase %s): %s first",
                       phase_name(s->phase), s->phase == KD_PHASE_VERIFIED ? "accept and commit it" : "commit it");
    if (t->token[0] < 0)
        return kd_fail(KD_ERR_STATE, "kd_verify: the tree's root token is not set (kd_tree_set_root with the bonus token)");
    if (t->token[0] >= s->model->cfg.vocab)
        return kd_fail(KD_ERR_ARG, "kd_verify: the tree's root token %d is outside the vocabulary [0, %d)",
                       (int)t->token[0], s->model->cfg.vocab);
    if (t->depth_bound + 1 > ACCEPT_MAX)
        return kd_fail(KD_ERR_ARG, "kd_verify: tree depth %d: expected at most %d (longest accepted path)",
                       t->depth_bound, ACCEPT_MAX - 1);
    int T = t->n + 1;
    /* built on another backend, or for several ranks (each gets the host arrays) */
    if (!t->host_valid && (t->model != s->model || s->model->tp > 1)) KD_TRY(kd_tree_host(t, "kd_verify"));
    kd_status st = t->host_valid ? verify_host_tree(s, t, T) : verify_dev_tree(s, t, T);
    if (st != KD_OK) return st;
    s->phase = KD_PHASE_VERIFIED;
    s->n_accepted = 0;
    t->verified_by = s;
    t->verified_version = t->version;
    return KD_OK;
}

/* ---- accept on the host (kd_ddtree_on_device false): targets from downloaded argmax ids or
 * logits rows (sampled lazily along the walk), the walk on the host arrays ---- */
typedef struct targets {
    kd_seq *s;
    const kd_tree *t;
    const kd_sampler *sp;
    int32_t *greedy;          /* all rows' argmax, or NULL when sampling */
    float *row;
    uint64_t *q;
    int32_t *a;
} targets;

static kd_status target_of(targets *g, int node, int32_t *tok) {
    if (g->greedy) { *tok = g->greedy[node]; return KD_OK; }
    int32_t pos = g->s->len + g->t->depth[node] + 1;
    kd_status st = kd_seq_sample_row(g->s, node, g->sp, pos, g->row, g->q, g->a, tok);
    if (st != KD_OK) return kd_fail_context(st, "kd_accept: node %d (position %d)", node, (int)pos);
    return KD_OK;
}

static kd_status accept_host(kd_seq *s, kd_tree *t, const kd_sampler *sp, int32_t *acc, int32_t *toks, int *tau_out,
                             int32_t *bonus) {
    KD_TRY(kd_tree_host(t, "kd_accept"));
    targets g = { s, t, sp, NULL, NULL, NULL, NULL };
    int V = s->model->cfg.vocab, T = t->n + 1;
    kd_status st = KD_OK;
    if (kd_sampler_is_greedy(sp)) {
        g.greedy = malloc(sizeof(int32_t) * (size_t)T);
        if (!g.greedy) st = kd_fail(KD_ERR_NOMEM, "kd_accept: cannot allocate %d target tokens", T);
        else if ((st = kd_seq_argmax(s, g.greedy)) != KD_OK) kd_fail_context(st, "kd_accept (a tree of %d nodes)", t->n);
    } else {
        g.row = malloc(sizeof(float) * (size_t)V);
        g.q = malloc(sizeof(uint64_t) * (size_t)V);
        g.a = malloc(sizeof(int32_t) * 2 * (size_t)V);
        if (!g.row || !g.q || !g.a) st = kd_fail(KD_ERR_NOMEM, "kd_accept: cannot allocate sampling scratch (vocab %d)", V);
    }
    int tau = 0;
    int32_t next = -1;
    if (st == KD_OK) {
        int cur = 0;
        acc[tau++] = 0;
        st = target_of(&g, 0, &next);
        while (st == KD_OK) {
            int c = kd_tree_child(t, cur, next);
            if (c < 0) break;
            acc[tau++] = c;          /* tau <= max_depth + 1 <= ACCEPT_MAX (checked in verify) */
            cur = c;
            st = target_of(&g, cur, &next);
        }
    }
    free(g.greedy); free(g.row); free(g.q); free(g.a);
    if (st != KD_OK) return st;
    for (int i = 0; i < tau; i++) toks[i] = t->token[acc[i]];
    *tau_out = tau;
    *bonus = next;
    return KD_OK;
}

/* ---- accept on the backend: targets (argmax / sample_rows) and the walk run there; one
 * download brings the result (header, accepted nodes, their tokens), checked here ---- */
static kd_status accept_device(kd_seq *s, kd_tree *t, const kd_sampler *sp, int32_t *acc, int32_t *toks,
                               int *tau_out, int32_t *bonus) {
    if (!t->dev_valid || t->model != s->model)
        return kd_fail(KD_ERR_STATE, "kd_accept: the verified tree has no copy on the sequence's backend");
    kd_backend *be = s->model->be;
    const kd_dtree *d = &t->dev;
    int n = t->n, T = n + 1;
    if (s->model->cfg.vocab > KD_SAMPLE_MAX_VOCAB)
        return kd_fail(KD_ERR_UNSUPPORTED, "kd_accept: vocabulary %d above %d", s->model->cfg.vocab, KD_SAMPLE_MAX_VOCAB);
    bool greedy = kd_sampler_is_greedy(sp);
    int chunk = kd_whole_rows_chunk(s->model, T);
    for (int c0 = 0; c0 < T; c0 += chunk) {   /* every node's target, over rows whole on rank 0 */
        int k = T - c0 < chunk ? T - c0 : chunk;
        kd_act rows;
        KD_TRY(kd_seq_rows_whole(s, c0, k, &rows));
        if (greedy) KD_TRY(be->ops->argmax(be, rows, d->target + c0));
        else KD_TRY(be->ops->sample_rows(be, rows, sp, d->pos + c0, 1, d->target + c0, d->row_status + c0));
    }
    KD_TRY(be->ops->tree_walk(be, d, n, greedy ? 0 : 1));

    /* the one download of the round: header, nodes[N] (the first tau used), tokens[bound] */
    int N = d->cap + 1, bound = t->depth_bound + 1;
    if (bound > T) bound = T;
    size_t words = (size_t)KD_DTREE_HDR + (size_t)N + (size_t)bound;
    int32_t stack[KD_DTREE_HDR + KD_SEQ_MAX_ROWS + ACCEPT_MAX];
    int32_t *r = words <= sizeof stack / sizeof stack[0] ? stack : malloc(words * sizeof(int32_t));
    if (!r) return kd_fail(KD_ERR_NOMEM, "kd_accept: cannot allocate %zu bytes for the result", words * 4);
    kd_status st = be->ops->download(be, r, d->result, words * sizeof(int32_t));
    int tau = st == KD_OK ? r[KD_DTREE_R_TAU] : 0;
    if (st == KD_OK && r[KD_DTREE_R_BUILD]) {
        int32_t status[3] = { r[KD_DTREE_R_BUILD], r[KD_DTREE_R_BUILD + 1], n };
        st = kd_tree_build_error(t, status, "kd_accept");
    }
    if (st == KD_OK && r[KD_DTREE_R_STATUS]) {
        kd_sample_fail(r[KD_DTREE_R_STATUS]);
        st = kd_fail_context(KD_ERR_ARG, "kd_accept: node %d (position %d)", (int)r[KD_DTREE_R_NODE],
                             (int)r[KD_DTREE_R_POS]);
    }
    if (st == KD_OK && greedy && r[KD_DTREE_R_BONUS] < 0 && tau >= 1 && tau <= bound) {
        /* the walk stopped at a node whose argmax is an error code (backend.h): no child matches it */
        int node = r[KD_DTREE_HDR + tau - 1];   /* at depth tau - 1 */
        st = kd_fail_context(kd_logit_fail("argmax", -r[KD_DTREE_R_BONUS]), "kd_accept: node %d (the verify "
                             "forward's output row %d, position %d)", node, node, s->len + tau);
    }
    if (st == KD_OK && (r[KD_DTREE_R_N] != n || tau < 1 || tau > bound || r[KD_DTREE_R_BONUS] < 0 ||
                        r[KD_DTREE_R_BONUS] >= s->model->cfg.vocab))
        st = kd_fail(KD_ERR_BACKEND, "kd_accept: the backend's walk returned tau %d, bonus %d over %d nodes (expected "
                     "1..%d over %d)", tau, (int)r[KD_DTREE_R_BONUS], (int)r[KD_DTREE_R_N], bound, n);
    for (int i = 0; st == KD_OK && i < tau; i++) {   /* commit gathers these rows on the backend */
        int32_t v = r[KD_DTREE_HDR + i];
        if (v < 0 || v > n || (i == 0 ? v != 0 : v <= r[KD_DTREE_HDR + i - 1]))
            st = kd_fail(KD_ERR_BACKEND, "kd_accept: the backend's walk returned node %d at step %d (tree of %d nodes)",
                         (int)v, i, n);
    }
    if (st == KD_OK) {
        memcpy(acc, r + KD_DTREE_HDR, sizeof(int32_t) * (size_t)tau);
        memcpy(toks, r + KD_DTREE_HDR + N, sizeof(int32_t) * (size_t)tau);
        *tau_out = tau;
        *bonus = r[KD_DTREE_R_BONUS];
    }
    if (r != stack) free(r);
    return st;
}

kd_status kd_accept(kd_seq *s, kd_tree *t, const kd_sampler *sp, int32_t *accepted_nodes,
                    int32_t *accepted_tokens, int *n_accepted, int32_t *bonus) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_accept: sequence is NULL");
    if (!t) return kd_fail(KD_ERR_ARG, "kd_accept: tree is NULL");
    KD_TRY(kd_sampler_check(sp, "kd_accept"));
    if (s->phase == KD_PHASE_IDLE)
        return kd_fail(KD_ERR_STATE, "kd_accept: accept before verify (no verified tree on this sequence)");
    if (s->phase == KD_PHASE_ACCEPTED)
        return kd_fail(KD_ERR_STATE, "kd_accept: this round was already accepted: commit it first");
    KD_TRY(check_round_tree(s, t, "kd_accept"));
    int32_t acc[ACCEPT_MAX], toks[ACCEPT_MAX], next = -1;
    int tau = 0;
    bool on_device = round_on_device(s);
    KD_TRY(on_device ? accept_device(s, t, sp, acc, toks, &tau, &next) : accept_host(s, t, sp, acc, toks, &tau, &next));
    for (int i = 0; i < tau; i++) {
        s->accepted[i] = acc[i];
        if (accepted_nodes) accepted_nodes[i] = acc[i];
        if (accepted_tokens) accepted_tokens[i] = toks[i];
    }
    s->n_accepted = tau;
    s->phase = KD_PHASE_ACCEPTED;
    t->accepted_on_device = on_device;
    if (n_accepted) *n_accepted = tau;
    if (bonus) *bonus = next;
    return KD_OK;
}

kd_status kd_commit(kd_seq *s, kd_tree *t) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_commit: sequence is NULL");
    if (!t) return kd_fail(KD_ERR_ARG, "kd_commit: tree is NULL");
    if (s->phase == KD_PHASE_IDLE)
        return kd_fail(KD_ERR_STATE, "kd_commit: no accepted round to commit (commit before verify/accept, or commit twice)");
    if (s->phase == KD_PHASE_VERIFIED)
        return kd_fail(KD_ERR_STATE, "kd_commit: commit before accept (call kd_accept on the verified tree first)");
    KD_TRY(check_round_tree(s, t, "kd_commit"));
    int start = s->len, tau = s->n_accepted;
    bool on_device = t->accepted_on_device;   /* else accepted on the host: the ids go up for the compaction */
    if (on_device && (!t->dev_valid || t->model != s->model))
        return kd_fail(KD_ERR_STATE, "kd_commit: the accepted round's tree is not on the sequence's backend");
    /* drafter context first (a failed append leaves it as it was, and the round open); the
     * compaction's arguments cannot fail here (kd_accept took the path from this round's
     * pending rows, and nothing changes them before commit: forward refuses and truncate ends
     * the round), so a compaction that fails is a backend failure, which drops the rows from
     * `start` on, the context's with them */
    if (s->drafter) {
        kd_status st = kd_draft_context_append(s, s->accepted, tau);
        if (st != KD_OK) return kd_fail_context(st, "kd_commit: appending %d accepted rows to the drafter context", tau);
    }
    /* on one rank the kept slots are already in its backend memory; several ranks take them from
     * the host (kd_accept downloaded them) */
    kd_status st = on_device && s->model->tp == 1 ? kd_seq_compact_staged(s, start, t->dev.result + KD_DTREE_HDR, tau)
                                                  : kd_seq_compact(s, start, s->accepted, tau);
    if (st != KD_OK) return kd_fail_context(st, "kd_commit: compacting %d accepted rows at %d", tau, start);
    t->verified_by = NULL;
    return KD_OK;
}
