/* testing_faults.c: backend failures on demand (kd_test_fail_op in kdtree_testing.h), so the
 * specs can check what the engine promises after a failed backend op: a clear error, and a
 * sequence that is consistent and usable (not only the happy path). One op fails differently:
 * tree_walk succeeds but returns a path that starts at node 1, not the root, as a faulty
 * backend could; the engine's own check of the walk must refuse it.
 *
 * The model's backend keeps its state; only its op table is swapped for a copy in which one
 * op counts its calls and fails once the count runs out. One injection at a time (a testing
 * hook, not engine state): a second call moves it, after < 0 restores the backend's table, and
 * so does the backend's destroy (as testing_graphs.c's emulation does), so a model closed with
 * an injection on leaves no pointer behind. */
#include "error.h"
#include "model.h"
#include "kdtree_testing.h"
#include <string.h>

static struct {
    kd_backend *be;                 /* whose table is swapped (NULL: none) */
    const kd_backend_ops *orig;
    kd_backend_ops ops;
    const char *op;
    int left;                       /* successful calls still allowed */
} g_fault;

static kd_status fault_check(void) {
    if (g_fault.left > 0) {
        g_fault.left--;
        return KD_OK;
    }
    return kd_fail(KD_ERR_BACKEND, "backend op %s failed (injected by kd_test_fail_op)", g_fault.op);
}
static kd_status fault_upload(kd_backend *be, void *dst, const void *src, size_t bytes) {
    KD_TRY(fault_check());
    return g_fault.orig->upload(be, dst, src, bytes);
}
static kd_status fault_copy(kd_backend *be, kd_act dst, kd_act src) {
    KD_TRY(fault_check());
    return g_fault.orig->copy(be, dst, src);
}
static kd_status fault_mla_rope_store(kd_backend *be, kd_act q, kd_act qfull, int n_heads, kd_act kva,
                                     const kd_weight *w, float eps, const int32_t *pos, const kd_rope *r, kd_act cache,
                                     int row0, const int32_t *d_len) {
    KD_TRY(fault_check());
    return g_fault.orig->mla_rope_store(be, q, qfull, n_heads, kva, w, eps, pos, r, cache, row0, d_len);
}
static kd_status fault_move_rows(kd_backend *be, const kd_act *caches, int n_caches, int src0, const int32_t *rows,
                                 int n, int dst0) {
    KD_TRY(fault_check());
    return g_fault.orig->move_rows(be, caches, n_caches, src0, rows, n, dst0);
}
static kd_status fault_tree_walk(kd_backend *be, const kd_dtree *t, int n, int sampled) {
    KD_TRY(g_fault.orig->tree_walk(be, t, n, sampled));
    if (g_fault.left > 0) {
        g_fault.left--;
        return KD_OK;
    }
    const int32_t wrong = 1;   /* the path's first node, where the walk must start at the root (0) */
    return g_fault.orig->upload(be, t->result + KD_DTREE_HDR, &wrong, sizeof wrong);
}

static void fault_clear(void) {
    if (g_fault.be) g_fault.be->ops = g_fault.orig;
    memset(&g_fault, 0, sizeof g_fault);
}
static void fault_destroy(kd_backend *be) {
    const kd_backend_ops *orig = g_fault.orig;
    fault_clear();
    orig->destroy(be);
}

int kd_test_fault_active(const kd_model *m) { return m && m->be && g_fault.be == m->be; }

kd_status kd_test_fail_op(kd_model *m, const char *op, int after) {
    if (!m || !m->be) return kd_fail(KD_ERR_ARG, "kd_test_fail_op: model is NULL or has no backend");
    if (after < 0) {
        fault_clear();
        return KD_OK;
    }
    if (!op) return kd_fail(KD_ERR_ARG, "kd_test_fail_op: op is NULL");
    fault_clear();
    kd_backend_ops ops = *m->be->ops;
    ops.destroy = fault_destroy;
    const char *name;   /* a literal: the caller's string need not outlive the injection */
    if (!strcmp(op, "upload")) {
        ops.upload = fault_upload;
        name = "upload";
    } else if (!strcmp(op, "copy")) {
        ops.copy = fault_copy;
        name = "copy";
    } else if (!strcmp(op, "mla_rope_store")) {
        ops.mla_rope_store = fault_mla_rope_store;
        name = "mla_rope_store";
    } else if (!strcmp(op, "move_rows")) {
        ops.move_rows = fault_move_rows;
        name = "move_rows";
    } else if (!strcmp(op, "tree_walk")) {
        ops.tree_walk = fault_tree_walk;
        name = "tree_walk";
    } else {
        return kd_fail(KD_ERR_ARG, "kd_test_fail_op: op '%s': expected upload, copy, mla_rope_store, move_rows or "
                       "tree_walk", op);
    }
    g_fault.be = m->be;
    g_fault.orig = m->be->ops;
    g_fault.ops = ops;
    g_fault.op = name;
    g_fault.left = after;
    m->be->ops = &g_fault.ops;
    return KD_OK;
}
