/* sample.h: the sampling rule shared by kd_sample_logits, kd_seq_sample and
 * kd_accept (and mirrored bit for bit by the device implementation, cuda/ddtree.cu;
 * the arithmetic both share is in sample_rule.h).
 * The rule itself is documented in sample.c and docs/ddtree.md. */
#ifndef KD_SAMPLE_H
#define KD_SAMPLE_H
#include "kdtree.h"
#include <stdbool.h>

/* the keyed uniform draw in [0, 1): a pure function of (seed, position) */
double kd_rng_uniform(uint64_t seed, int64_t position);
/* true when sp asks for greedy argmax (NULL or temperature <= 0) */
bool kd_sampler_is_greedy(const kd_sampler *sp);
/* validate a sampler's fields (names the field on error) */
kd_status kd_sampler_check(const kd_sampler *sp, const char *fn);
/* greedy argmax of a host row, ties to the lower id; NaN or +inf is an error */
kd_status kd_argmax_row(const float *logits, int vocab, int32_t *dst);
/* one token from a host row of logits; scratch: qscratch vocab uint64s, iscratch vocab
 * int32s. The sampler is assumed checked (kd_sampler_check). */
kd_status kd_sample_row(const float *logits, int vocab, const kd_sampler *sp, int32_t position,
                        uint64_t *qscratch, int32_t *iscratch, int32_t *dst);
/* the same for a sampler that is not greedy, without setting an error message: returns 0,
 * or the row's error code (kind | column << 2, sample_rule.h), which kd_sample_fail reports */
int32_t kd_sample_row_code(const float *logits, int vocab, const kd_sampler *sp, int32_t position,
                           uint64_t *qscratch, int32_t *iscratch, int32_t *dst);
kd_status kd_sample_fail(int32_t code);
/* the rows of an argmax op's result (backend.h: -code for a row with NaN / +inf): the first
 * such row reported as "FN: ROWS row R: argmax: logits[C] is NaN: ..." */
kd_status kd_argmax_check(const int32_t *ids, int rows, const char *fn, const char *rows_name);
/* the same report for any op ("argmax", "sample"): "OP: logits[COL] is NaN: ..." */
kd_status kd_logit_fail(const char *op, int32_t code);
/* a row held in shards (tensor parallel, one per rank): x[0..n) are the logits of ids
 * [id0, id0 + n); shards in ascending, adjacent id ranges */
typedef struct kd_shard {
    const float *x;
    int n;
    int32_t id0;
} kd_shard;
/* kd_sample_row_code over the shards (the same token as over the whole row; sample.c says how
 * the shards merge); scratch: qscratch vocab uint64s, iscratch 2 * vocab int32s (vocab when
 * there is one shard) */
/* one token from output row i of a sequence's last forward (greedy or keyed), from its ranks'
 * logits shards (brought down into row, vocab floats); scratch as kd_sample_shards_code */
kd_status kd_seq_sample_row(kd_seq *s, int i, const kd_sampler *sp, int32_t position, float *row,
                            uint64_t *qscratch, int32_t *iscratch, int32_t *dst);
int32_t kd_sample_shards_code(const kd_shard *shards, int n_shards, const kd_sampler *sp, int32_t position,
                              uint64_t *qscratch, int32_t *iscratch, int32_t *dst);
#endif
