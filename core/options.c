/* options.c: the checks of kd_model_options and kd_seq_options, so that a bad field is an error
 * naming it before anything is loaded or allocated (zero in every field is the default). */
#include "model.h"
#include "error.h"

static kd_status check_graphs(const char *fn, const char *field, kd_graphs_mode v) {
    if (v == KD_GRAPHS_DEFAULT || v == KD_GRAPHS_CAPTURE || v == KD_GRAPHS_OFF || v == KD_GRAPHS_EAGER) return KD_OK;
    return kd_fail(KD_ERR_ARG, "%s: options.%s is %d: expected KD_GRAPHS_DEFAULT (0), KD_GRAPHS_CAPTURE (1), "
                   "KD_GRAPHS_OFF (2) or KD_GRAPHS_EAGER (3)", fn, field, (int)v);
}

kd_status kd_model_options_check(const kd_model_options *o) {
    const char *fn = "kd_model_open";
    if (o->backend != KD_BACKEND_CPU && o->backend != KD_BACKEND_CUDA)
        return kd_fail(KD_ERR_ARG, "%s: options.backend is %d: expected KD_BACKEND_CPU (0) or KD_BACKEND_CUDA (1)", fn,
                       (int)o->backend);
    if (o->tp < 0 || o->tp > KD_TP_MAX)
        return kd_fail(KD_ERR_ARG, "%s: options.tp is %d: expected 1..%d ranks (0 = one)", fn, o->tp, KD_TP_MAX);
    int tp = o->tp == 0 ? 1 : o->tp;
    if (o->n_device_list < 0 || o->n_device_list > KD_TP_MAX)
        return kd_fail(KD_ERR_ARG, "%s: options.n_device_list is %d: expected 0..%d", fn, o->n_device_list, KD_TP_MAX);
    if (o->n_device_list > 0 && o->n_device_list != tp)
        return kd_fail(KD_ERR_ARG, "%s: options.devices lists %d devices for tp %d: expected one per rank", fn,
                       o->n_device_list, tp);
    for (int i = 0; i < o->n_device_list; i++)
        if (o->devices[i] < 0)
            return kd_fail(KD_ERR_ARG, "%s: options.devices[%d] is %d: expected a device index >= 0", fn, i,
                           o->devices[i]);
    KD_TRY(check_graphs(fn, "graphs", o->graphs));
    KD_TRY(check_graphs(fn, "draft_graphs", o->draft_graphs));
    if (o->ddtree_round != KD_ROUND_DEFAULT && o->ddtree_round != KD_ROUND_BACKEND && o->ddtree_round != KD_ROUND_HOST)
        return kd_fail(KD_ERR_ARG, "%s: options.ddtree_round is %d: expected KD_ROUND_DEFAULT (0), KD_ROUND_BACKEND (1) "
                       "or KD_ROUND_HOST (2)", fn, (int)o->ddtree_round);
    if (o->mla_kernel != KD_MLA_DEFAULT && o->mla_kernel != KD_MLA_CUDA_CORES)
        return kd_fail(KD_ERR_ARG, "%s: options.mla_kernel is %d: expected KD_MLA_DEFAULT (0) or KD_MLA_CUDA_CORES (1)", fn,
                       (int)o->mla_kernel);
    const int vs = o->mla_value_slices;
    if (vs != 0 && vs != -1 && vs != 1 && vs != 2 && vs != 4)
        return kd_fail(KD_ERR_ARG, "%s: options.mla_value_slices is %d: expected 0 (by the shape rule), -1 (no split), "
                       "1, 2 or 4", fn, vs);
    const int rg = o->mla_row_groups;
    if (rg != 0 && rg != 1 && rg != 4)
        return kd_fail(KD_ERR_ARG, "%s: options.mla_row_groups is %d: expected 0 (by the shape rule), 1 or 4", fn, rg);
    if (o->shared_expert_branch < -1 || o->shared_expert_branch > 1)
        return kd_fail(KD_ERR_ARG, "%s: options.shared_expert_branch is %d: expected 0 (by the step's rows), 1 "
                       "(beside the routed experts) or -1 (in line)", fn, o->shared_expert_branch);
    return KD_OK;
}

kd_status kd_seq_options_check(const kd_seq_options *o) {
    if (o->max_rows < 0)
        return kd_fail(KD_ERR_ARG, "kd_seq_new: options.max_rows is %d: expected 0 (the default) or a positive "
                       "number of rows", o->max_rows);
    KD_TRY(check_graphs("kd_seq_new", "graphs", o->graphs));
    return check_graphs("kd_seq_new", "draft_graphs", o->draft_graphs);
}
