/* config_read.h: the one reader of config.json fields, shared by the target (config.c) and
 * the DFlash drafter (drafter.c): typed fields with defaults, ranges and messages that name
 * the file and the field and quote the file's own value; token ids checked against a
 * vocabulary; RoPE (default / linear / YaRN) parsed once and its inverse frequencies. */
#ifndef KD_CONFIG_READ_H
#define KD_CONFIG_READ_H
#include "kdtree.h"
#include <cjson/cJSON.h>
#include <stdbool.h>

/* which file, and the field path prefix of the object being read ("" or "text_config.") */
typedef struct kd_cfg_ctx {
    const char *path;
    const char *where;
} kd_cfg_ctx;

const char *kd_json_type_name(const cJSON *j);
/* the value as the file may have written it: the shortest text that reads back as the same
 * number ("1e-300", "2.5"), or a string's printable form */
const char *kd_json_value_text(const cJSON *j, char *buf, size_t cap);

/* An integer field in [lo, hi]. Missing or null: an error when required, else def. */
kd_status kd_cfg_int(const kd_cfg_ctx *c, const cJSON *o, const char *field, bool required, int def, int lo, int hi,
                     int *out);
/* the same for a value already found: j is field (item >= 0: its item [item]) */
kd_status kd_cfg_int_value(const kd_cfg_ctx *c, const cJSON *j, const char *field, int item, int lo, int hi, int *out);
/* A number that stays finite as a float (1e300 is refused), and when `positive` stays above
 * 0 as a float (1e-300 is refused, quoted as written). Missing or null: def. */
kd_status kd_cfg_float(const kd_cfg_ctx *c, const cJSON *o, const char *field, double def, bool positive, float *out);
/* the same kept as a double (RoPE arithmetic runs in double) */
kd_status kd_cfg_double(const kd_cfg_ctx *c, const cJSON *o, const char *field, double def, bool positive, double *out);
kd_status kd_cfg_bool(const kd_cfg_ctx *c, const cJSON *o, const char *field, bool def, bool *out);
/* an optional string that, when present, is one of `allowed` ("a|b|c"); else `code` */
kd_status kd_cfg_one_of(const kd_cfg_ctx *c, const cJSON *o, const char *field, const char *allowed, kd_status code);
/* token ids: one integer or a list of at most max, each in [0, vocab) */
kd_status kd_cfg_ids(const kd_cfg_ctx *c, const cJSON *j, const char *field, int vocab, int *n, int *ids, int max);

/* ---- RoPE ---- */
typedef enum kd_rope_kind { KD_ROPE_DEFAULT, KD_ROPE_LINEAR, KD_ROPE_YARN } kd_rope_kind;
typedef struct kd_rope_params {
    kd_rope_kind kind;
    double theta;
    double factor;                 /* linear and YaRN */
    double beta_fast, beta_slow, mscale, mscale_all_dim;   /* YaRN */
    int original_max_positions;    /* YaRN */
    bool truncate;                 /* YaRN: floor/ceil the ramp (HF rope_parameters.truncate) */
    double amp;                    /* cos/sin amplitude (HF attention_factor) */
} kd_rope_params;

/* rope_parameters (transformers 5) or rope_scaling, with rope_theta at the top or inside,
 * from object t; max_positions: max_position_embeddings (YaRN's default factor) */
kd_status kd_cfg_rope(const kd_cfg_ctx *c, const cJSON *t, int max_positions, kd_rope_params *out);
/* HF _compute_default/linear/yarn_parameters' inverse frequencies for `dim` rotary dims
 * (double math, stored as float; dim/2 values) */
void kd_rope_params_inv_freq(const kd_rope_params *r, int dim, float *inv_freq);
/* HF yarn_get_mscale */
double kd_yarn_mscale(double scale, double mscale);
#endif
