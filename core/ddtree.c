/* ddtree.c: one DDTree round on a sequence, after the tree is built:
 *   kd_verify  one target forward over root + nodes at positions len + depth, each
 *              token seeing the committed past, its ancestors and itself; KV for all
 *              1+n rows is written at slots len..len+n and left pending.
 *   kd_accept  one target token per node (greedy argmax, or the keyed sampling rule of
 *              sample.c with the position of the token the node produces: len+depth+1),
 *              walk from the root along the child whose token equals the current
 *              node's target token; tau = accepted nodes incl. the root; bonus = the
 *              target token of the last accepted node (the next round's root).
 *   kd_commit  gather the accepted rows' KV into place (kd_seq_compact: len += tau) and
 *              hand their tap features to the drafter context.
 * The round is a small state machine in s->phase (IDLE -> VERIFIED -> ACCEPTED -> IDLE);
 * the tree remembers which sequence verified it and its own version at that time,
 * so a tree changed after verify (or another tree) cannot be accepted or committed.
 */
#include "tree.h"
#include "sample.h"
#include "error.h"
#include "model.h"
#include "drafter.h"
#include <stdio.h>
#include <stdlib.h>

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

kd_status kd_verify(kd_seq *s, kd_tree *t) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_verify: sequence is NULL");
    if (!t) return kd_fail(KD_ERR_ARG, "kd_verify: tree is NULL");
    if (s->phase != KD_PHASE_IDLE)
        return kd_fail(KD_ERR_STATE, "kd_verify: a round is open on this sequence (phase %s): %s first",
                       phase_name(s->phase), s->phase == KD_PHASE_VERIFIED ? "accept and commit it" : "commit it");
    if (t->token[0] < 0)
        return kd_fail(KD_ERR_STATE, "kd_verify: the tree's root token is not set (kd_tree_set_root with the bonus token)");
    if (t->max_depth + 1 > ACCEPT_MAX)
        return kd_fail(KD_ERR_ARG, "kd_verify: tree depth %d: expected at most %d (longest accepted path)",
                       t->max_depth, ACCEPT_MAX - 1);
    int T = t->n + 1, words = (T + 63) / 64;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)T);
    uint64_t *vis = malloc(sizeof(uint64_t) * (size_t)T * (size_t)words);
    kd_status st = KD_OK;
    if (!pos || !vis) st = kd_fail(KD_ERR_NOMEM, "kd_verify: cannot allocate the mask of %d tree tokens", T);
    if (st == KD_OK) {
        for (int i = 0; i < T; i++) pos[i] = s->len + t->depth[i];
        st = kd_tree_visibility(t, vis);
    }
    if (st == KD_OK) {
        st = kd_forward(s, t->token, T, pos, vis);
        if (st != KD_OK) kd_fail_context(st, "kd_verify (%d tree tokens at position %d)", T, s->len);
    }
    free(pos);
    free(vis);
    if (st != KD_OK) return st;
    s->phase = KD_PHASE_VERIFIED;
    s->n_accepted = 0;
    t->verified_by = s;
    t->verified_version = t->version;
    return KD_OK;
}

/* target tokens, computed lazily along the walk (sampled) or all at once (greedy) */
typedef struct targets {
    kd_seq *s;
    const kd_tree *t;
    const kd_sampler *sp;
    int32_t *greedy;          /* all rows' argmax, or NULL when sampling */
    float *row;
    double *w;
    int32_t *a;
} targets;

static kd_status target_of(targets *g, int node, int32_t *tok) {
    if (g->greedy) { *tok = g->greedy[node]; return KD_OK; }
    int V = g->s->model->cfg.vocab;
    int32_t pos = g->s->len + g->t->depth[node] + 1;
    KD_TRY(kd_seq_logits(g->s, node, 1, g->row));
    kd_status st = kd_sample_row(g->row, V, g->sp, pos, g->w, g->a, tok);
    if (st != KD_OK) return kd_fail_context(st, "kd_accept: node %d (position %d)", node, (int)pos);
    return KD_OK;
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

    targets g = { s, t, sp, NULL, NULL, NULL, NULL };
    int V = s->model->cfg.vocab, T = t->n + 1;
    kd_status st = KD_OK;
    if (kd_sampler_is_greedy(sp)) {
        g.greedy = malloc(sizeof(int32_t) * (size_t)T);
        if (!g.greedy) st = kd_fail(KD_ERR_NOMEM, "kd_accept: cannot allocate %d target tokens", T);
        else st = kd_seq_argmax(s, g.greedy);
    } else {
        g.row = malloc(sizeof(float) * (size_t)V);
        g.w = malloc(sizeof(double) * (size_t)V);
        g.a = malloc(sizeof(int32_t) * 2 * (size_t)V);
        if (!g.row || !g.w || !g.a) st = kd_fail(KD_ERR_NOMEM, "kd_accept: cannot allocate sampling scratch (vocab %d)", V);
    }
    int32_t acc[ACCEPT_MAX];
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
    free(g.greedy); free(g.row); free(g.w); free(g.a);
    if (st != KD_OK) return st;

    for (int i = 0; i < tau; i++) {
        s->accepted[i] = acc[i];
        if (accepted_nodes) accepted_nodes[i] = acc[i];
        if (accepted_tokens) accepted_tokens[i] = t->token[acc[i]];
    }
    s->n_accepted = tau;
    s->phase = KD_PHASE_ACCEPTED;
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
    /* drafter context first: if compaction then fails, roll the context back */
    if (s->drafter) {
        kd_status st = kd_draft_context_append(s, s->accepted, tau);
        if (st != KD_OK) return kd_fail_context(st, "kd_commit: appending %d accepted rows to the drafter context", tau);
    }
    kd_status st = kd_seq_compact(s, start, s->accepted, tau);
    if (st != KD_OK) {
        if (s->drafter) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", kd_last_error());
            kd_draft_context_truncate(s, start);
            kd_fail(st, "%s", msg);
        }
        return kd_fail_context(st, "kd_commit: compacting %d accepted rows at %d", tau, start);
    }
    s->phase = KD_PHASE_IDLE;
    t->verified_by = NULL;
    return KD_OK;
}
