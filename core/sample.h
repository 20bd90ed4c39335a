/* sample.h: the sampling rule shared by kd_sample_logits, kd_seq_sample and
 * kd_accept (and to be mirrored bit for bit by a device implementation).
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
/* greedy argmax of a host row, ties to the lower id; NaN is an error */
kd_status kd_argmax_row(const float *logits, int vocab, int32_t *dst);
/* one token from a host row of logits; scratch: wscratch vocab doubles,
 * iscratch 2*vocab int32s. The sampler is assumed checked (kd_sampler_check). */
kd_status kd_sample_row(const float *logits, int vocab, const kd_sampler *sp, int32_t position,
                        double *wscratch, int32_t *iscratch, int32_t *dst);
#endif
