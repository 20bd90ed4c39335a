/* config_read.c: see config_read.h. RoPE follows HF transformers 5.x modeling_rope_utils.py
 * (_compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
 * _compute_yarn_parameters); docs/formats.md lists the fields. */
#include "config_read.h"
#include "error.h"
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *kd_json_type_name(const cJSON *j) {
    if (!j) return "nothing";
    if (cJSON_IsNull(j)) return "null";
    if (cJSON_IsBool(j)) return "a boolean";
    if (cJSON_IsNumber(j)) return "a number";
    if (cJSON_IsString(j)) return "a string";
    if (cJSON_IsArray(j)) return "an array";
    if (cJSON_IsObject(j)) return "an object";
    return "an unknown value";
}

const char *kd_json_value_text(const cJSON *j, char *buf, size_t cap) {
    if (cJSON_IsNumber(j)) {
        double v = j->valuedouble;
        if (!isfinite(v)) {   /* cJSON reads 1e999 as inf */
            snprintf(buf, cap, "%s", isnan(v) ? "NaN" : v > 0 ? "a number beyond the double range" : "a number below the double range");
            return buf;
        }
        if (v == floor(v) && fabs(v) < 1e15) {   /* an integer, as JSON writers print one */
            snprintf(buf, cap, "%.0f", v);
            return buf;
        }
        for (int prec = 1; prec <= 17; prec++) {
            snprintf(buf, cap, "%.*g", prec, v);
            if (strtod(buf, NULL) == v) break;
        }
        return buf;
    }
    if (cJSON_IsString(j)) {
        char q[200];
        snprintf(buf, cap, "\"%s\"", kd_printable(j->valuestring, q, sizeof q));
        return buf;
    }
    snprintf(buf, cap, "%s", cJSON_IsBool(j) ? (cJSON_IsTrue(j) ? "true" : "false") : kd_json_type_name(j));
    return buf;
}

static const cJSON *field_of(const cJSON *o, const char *field) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, field);
    return j && !cJSON_IsNull(j) ? j : NULL;
}

kd_status kd_cfg_int_value(const kd_cfg_ctx *c, const cJSON *j, const char *field, int item, int lo, int hi, int *out) {
    char v[64], at[24] = "";
    if (item >= 0) snprintf(at, sizeof at, "[%d]", item);
    if (!cJSON_IsNumber(j) || j->valuedouble != floor(j->valuedouble))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s%s' is %s: expected an integer", c->path, c->where, field, at,
                       kd_json_value_text(j, v, sizeof v));
    if (!(j->valuedouble >= lo && j->valuedouble <= hi))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s%s' is %s: expected an integer in %d..%d", c->path, c->where, field,
                       at, kd_json_value_text(j, v, sizeof v), lo, hi);
    *out = (int)j->valuedouble;
    return KD_OK;
}

kd_status kd_cfg_int(const kd_cfg_ctx *c, const cJSON *o, const char *field, bool required, int def, int lo, int hi,
                     int *out) {
    const cJSON *j = field_of(o, field);
    if (!j) {
        if (required) return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is missing (expected an integer)", c->path, c->where, field);
        *out = def;
        return KD_OK;
    }
    return kd_cfg_int_value(c, j, field, -1, lo, hi, out);
}

kd_status kd_cfg_double(const kd_cfg_ctx *c, const cJSON *o, const char *field, double def, bool positive, double *out) {
    const cJSON *j = field_of(o, field);
    if (!j) { *out = def; return KD_OK; }
    char v[64];
    if (!cJSON_IsNumber(j))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is %s: expected a number", c->path, c->where, field,
                       kd_json_value_text(j, v, sizeof v));
    double d = j->valuedouble;
    /* the float range bounds both kinds: every such number ends up in float arithmetic */
    if (!isfinite(d) || fabs(d) > FLT_MAX)
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is %s: expected a finite number (beyond the float range)",
                       c->path, c->where, field, kd_json_value_text(j, v, sizeof v));
    if (positive && !((float)d > 0))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is %s: expected a positive number%s", c->path, c->where, field,
                       kd_json_value_text(j, v, sizeof v), d > 0 ? " (it is 0 as a float)" : "");
    *out = d;
    return KD_OK;
}

kd_status kd_cfg_float(const kd_cfg_ctx *c, const cJSON *o, const char *field, double def, bool positive, float *out) {
    double d;
    KD_TRY(kd_cfg_double(c, o, field, def, positive, &d));
    *out = (float)d;
    return KD_OK;
}

kd_status kd_cfg_bool(const kd_cfg_ctx *c, const cJSON *o, const char *field, bool def, bool *out) {
    const cJSON *j = field_of(o, field);
    if (!j) { *out = def; return KD_OK; }
    char v[64];
    if (!cJSON_IsBool(j))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is %s: expected true or false", c->path, c->where, field,
                       kd_json_value_text(j, v, sizeof v));
    *out = cJSON_IsTrue(j);
    return KD_OK;
}

kd_status kd_cfg_one_of(const kd_cfg_ctx *c, const cJSON *o, const char *field, const char *allowed, kd_status code) {
    const cJSON *j = field_of(o, field);
    if (!j) return KD_OK;
    char v[256];
    if (!cJSON_IsString(j))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is %s: expected a string", c->path, c->where, field,
                       kd_json_value_text(j, v, sizeof v));
    size_t n = strlen(j->valuestring);
    for (const char *p = allowed; *p;) {
        const char *e = strchr(p, '|');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, j->valuestring, n) == 0) return KD_OK;
        p += len + (e ? 1 : 0);
    }
    return kd_fail(code, "%s: field '%s%s' is %s: supported: %s", c->path, c->where, field,
                   kd_json_value_text(j, v, sizeof v), allowed);
}

static kd_status check_id(const kd_cfg_ctx *c, const char *field, const cJSON *e, int item, int vocab, int *out) {
    char v[64], at[24] = "";
    if (item >= 0) snprintf(at, sizeof at, "[%d]", item);
    if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s%s' is %s: expected a token id (an integer)", c->path, c->where,
                       field, at, kd_json_value_text(e, v, sizeof v));
    if (!(e->valuedouble >= 0 && e->valuedouble < vocab))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s%s' is %s: expected a token id in the vocabulary [0, %d)", c->path,
                       c->where, field, at, kd_json_value_text(e, v, sizeof v), vocab);
    *out = (int)e->valuedouble;
    return KD_OK;
}

kd_status kd_cfg_ids(const kd_cfg_ctx *c, const cJSON *j, const char *field, int vocab, int *n, int *ids, int max) {
    if (!cJSON_IsArray(j)) {
        KD_TRY(check_id(c, field, j, -1, vocab, &ids[0]));
        *n = 1;
        return KD_OK;
    }
    int k = 0;
    for (const cJSON *e = j->child; e; e = e->next) {
        if (k == max) return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s': more than %d ids", c->path, c->where, field, max);
        KD_TRY(check_id(c, field, e, k, vocab, &ids[k]));
        k++;
    }
    *n = k;
    return KD_OK;
}

/* ---- RoPE ---- */

double kd_yarn_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0; }

static kd_status parse_yarn(const kd_cfg_ctx *c, const kd_cfg_ctx *cr, const cJSON *t, const cJSON *rp, int max_positions,
                            kd_rope_params *r) {
    /* original_max_position_embeddings: a field next to rope_parameters wins (as in HF), then
     * the one inside it, then max_position_embeddings */
    int omax;
    KD_TRY(kd_cfg_int(cr, rp, "original_max_position_embeddings", false, max_positions, 0, 1 << 30, &omax));
    KD_TRY(kd_cfg_int(c, t, "original_max_position_embeddings", false, omax, 0, 1 << 30, &omax));
    if (omax <= 0)
        return kd_fail(KD_ERR_CONFIG, "%s: field '%soriginal_max_position_embeddings' is %s: expected a positive integer "
                       "for YaRN", c->path, cr->where, omax ? "negative" : "missing (and so is max_position_embeddings)");
    r->original_max_positions = omax;
    KD_TRY(kd_cfg_double(cr, rp, "factor", max_positions > 0 ? (double)max_positions / omax : 0, true, &r->factor));
    KD_TRY(kd_cfg_double(cr, rp, "beta_fast", 32.0, false, &r->beta_fast));
    KD_TRY(kd_cfg_double(cr, rp, "beta_slow", 1.0, false, &r->beta_slow));
    if (r->beta_fast == 0) r->beta_fast = 32.0;   /* HF: `get("beta_fast") or 32` */
    if (r->beta_slow == 0) r->beta_slow = 1.0;
    if (!(r->beta_fast > 0) || !(r->beta_slow > 0))
        return kd_fail(KD_ERR_CONFIG, "%s: fields '%sbeta_fast'/'beta_slow' (%g/%g): expected positive numbers", c->path,
                       cr->where, r->beta_fast, r->beta_slow);
    KD_TRY(kd_cfg_double(cr, rp, "mscale", 0.0, false, &r->mscale));
    KD_TRY(kd_cfg_double(cr, rp, "mscale_all_dim", 0.0, false, &r->mscale_all_dim));
    KD_TRY(kd_cfg_bool(cr, rp, "truncate", true, &r->truncate));
    /* the cos/sin amplitude (HF attention_factor) */
    double af = r->mscale != 0 && r->mscale_all_dim != 0
                    ? kd_yarn_mscale(r->factor, r->mscale) / kd_yarn_mscale(r->factor, r->mscale_all_dim)
                    : kd_yarn_mscale(r->factor, 1.0);
    KD_TRY(kd_cfg_double(cr, rp, "attention_factor", af, true, &r->amp));
    return KD_OK;
}

kd_status kd_cfg_rope(const kd_cfg_ctx *c, const cJSON *t, int max_positions, kd_rope_params *r) {
    memset(r, 0, sizeof *r);
    r->kind = KD_ROPE_DEFAULT;
    r->amp = 1.0;
    r->truncate = true;
    const char *rpname = "rope_parameters";
    const cJSON *rp = field_of(t, rpname);
    if (!rp) { rpname = "rope_scaling"; rp = field_of(t, rpname); }
    char v[64];
    if (rp && !cJSON_IsObject(rp))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is %s: expected an object or null", c->path, c->where, rpname,
                       kd_json_value_text(rp, v, sizeof v));
    char where[96];
    snprintf(where, sizeof where, "%s%s.", c->where, rpname);
    kd_cfg_ctx cr = {c->path, where};
    KD_TRY(kd_cfg_double(c, t, "rope_theta", 10000.0, false, &r->theta));
    if (rp) KD_TRY(kd_cfg_double(&cr, rp, "rope_theta", r->theta, false, &r->theta));
    if (!(r->theta > 1.0))   /* log(theta) divides YaRN's ramp; a base <= 1 does not rotate */
        return kd_fail(KD_ERR_CONFIG, "%s: field '%srope_theta' is %.17g: expected a number > 1", c->path,
                       rp && field_of(rp, "rope_theta") ? where : c->where, r->theta);
    if (!rp) return KD_OK;
    const char *tyname = field_of(rp, "rope_type") ? "rope_type" : "type";
    KD_TRY(kd_cfg_one_of(&cr, rp, tyname, "default|linear|yarn|deepseek_yarn", KD_ERR_UNSUPPORTED));
    const cJSON *ty = field_of(rp, tyname);
    const char *type = ty ? ty->valuestring : "default";
    if (strcmp(type, "default") == 0) return KD_OK;
    if (strcmp(type, "linear") == 0) {
        r->kind = KD_ROPE_LINEAR;
        if (!field_of(rp, "factor"))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sfactor' is missing (expected a number > 0 for linear RoPE)",
                           c->path, where);
        return kd_cfg_double(&cr, rp, "factor", 0, true, &r->factor);
    }
    r->kind = KD_ROPE_YARN;
    return parse_yarn(c, &cr, t, rp, max_positions, r);
}

void kd_rope_params_inv_freq(const kd_rope_params *r, int dim, float *inv_freq) {
    double base = r->theta;
    int half = dim / 2;
    double low = 0, high = 0;
    if (r->kind == KD_ROPE_YARN) {
        const double two_pi = 6.283185307179586476925286766559;
        double omax = r->original_max_positions;
        low = dim * log(omax / (r->beta_fast * two_pi)) / (2.0 * log(base));
        high = dim * log(omax / (r->beta_slow * two_pi)) / (2.0 * log(base));
        if (r->truncate) { low = floor(low); high = ceil(high); }
        if (low < 0) low = 0;
        if (high > dim - 1) high = dim - 1;
        if (low == high) high += 0.001;   /* HF: prevent a singular ramp */
    }
    for (int i = 0; i < half; i++) {
        double pos = pow(base, (2.0 * i) / dim);
        double inv = 1.0 / pos;
        if (r->kind == KD_ROPE_LINEAR) inv = 1.0 / (r->factor * pos);
        else if (r->kind == KD_ROPE_YARN) {
            double ramp = (i - low) / (high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double ef = 1.0 - ramp;       /* the extrapolation (unscaled) weight */
            inv = 1.0 / (r->factor * pos) * (1.0 - ef) + inv * ef;
        }
        inv_freq[i] = (float)inv;
    }
}
