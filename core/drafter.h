/* drafter.h: the DFlash drafter's contract with the rest of the core.
 * The target forward keeps tap features (outputs of the drafter's target_layer_ids)
 * in each rank's s->rk[r].taps for the rows it processed; committed rows are handed to the
 * drafter with kd_draft_context_append, which projects them (fc, hidden_norm, each layer's
 * k_proj/v_proj, k_norm, RoPE) into the drafter's per-sequence K/V cache at once (each rank
 * its KV heads). */
#ifndef KD_DRAFTER_H
#define KD_DRAFTER_H
#include "model.h"

/* the target layers whose outputs the drafter reads, in config order */
int kd_drafter_taps(const struct kd_drafter *d, const int **taps);
/* rows[i] of the taps (the last forward; rows NULL: rows 0..n-1) join the drafter context, in
 * order; their positions continue the context (context length before the call + i). On an
 * error the context is as it was. */
kd_status kd_draft_context_append(kd_seq *s, const int32_t *rows, int n);
/* drop context entries at positions >= len (the sequence was truncated) */
kd_status kd_draft_context_truncate(kd_seq *s, int len);
void kd_draft_state_free(kd_seq *s);
/* the last kd_draft's log-probs, (block_size-1) x vocab fp32 on the backend, and its bonus token */
kd_status kd_draft_logprobs(kd_seq *s, kd_act *out, int32_t *bonus);
#endif
