/* config.c: config.json (+ generation_config.json) -> kd_config, validated.
 *
 * Layouts: model_type deepseek_v3 / kimi_k2 (fields at the top level, tensors unprefixed)
 * and the Kimi K2.5/K2.6 wrapper kimi_k25 (fields under text_config, tensors prefixed
 * "language_model."). Every error names the config file and the field, and says what
 * was expected. Derived numbers (softmax scale, RoPE amplitude, YaRN inverse frequencies)
 * follow HF transformers 5.x (models/deepseek_v3, modeling_rope_utils.py); docs/formats.md
 * lists where HF and the DeepSeek reference differ and which one we follow.
 */
#include "model.h"
#include "error.h"

#include "json.h"
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the parse context: which file, and the field path prefix ("" or "text_config.") */
typedef struct cfgctx {
    const char *path;      /* .../config.json */
    const char *where;     /* "" or "text_config." */
} cfgctx;

static const char *json_type_name(const cJSON *j) {
    if (!j) return "nothing";
    if (cJSON_IsNull(j)) return "null";
    if (cJSON_IsBool(j)) return "a boolean";
    if (cJSON_IsNumber(j)) return "a number";
    if (cJSON_IsString(j)) return "a string";
    if (cJSON_IsArray(j)) return "an array";
    if (cJSON_IsObject(j)) return "an object";
    return "an unknown value";
}

static bool is_int(const cJSON *j) {
    return cJSON_IsNumber(j) && j->valuedouble == floor(j->valuedouble) && fabs(j->valuedouble) < 2147483648.0;
}

/* integer field: required (missing -> error), or optional with a default. null counts as missing. */
static kd_status get_int(const cfgctx *c, const cJSON *o, const char *field, bool required, int def, int *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, field);
    if (!j || cJSON_IsNull(j)) {
        if (required) return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is missing (expected an integer)", c->path, c->where, field);
        *out = def;
        return KD_OK;
    }
    if (!is_int(j))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s': expected an integer, got %s", c->path, c->where, field,
                       json_type_name(j));
    *out = (int)j->valuedouble;
    return KD_OK;
}

static kd_status get_num(const cfgctx *c, const cJSON *o, const char *field, bool required, double def, double *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, field);
    if (!j || cJSON_IsNull(j)) {
        if (required) return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s' is missing (expected a number)", c->path, c->where, field);
        *out = def;
        return KD_OK;
    }
    if (!cJSON_IsNumber(j))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s': expected a number, got %s", c->path, c->where, field,
                       json_type_name(j));
    *out = j->valuedouble;
    return KD_OK;
}

static kd_status get_bool(const cfgctx *c, const cJSON *o, const char *field, bool def, bool *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, field);
    if (!j || cJSON_IsNull(j)) { *out = def; return KD_OK; }
    if (!cJSON_IsBool(j))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s': expected true or false, got %s", c->path, c->where, field,
                       json_type_name(j));
    *out = cJSON_IsTrue(j);
    return KD_OK;
}

/* optional string field that, when present, must be one of the allowed values */
static kd_status check_str(const cfgctx *c, const cJSON *o, const char *field, const char *allowed, kd_status code) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, field);
    if (!j || cJSON_IsNull(j)) return KD_OK;
    if (!cJSON_IsString(j))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s': expected a string, got %s", c->path, c->where, field,
                       json_type_name(j));
    char buf[256];
    snprintf(buf, sizeof buf, "%s", allowed);
    for (char *tok = strtok(buf, "|"); tok; tok = strtok(NULL, "|"))
        if (strcmp(tok, j->valuestring) == 0) return KD_OK;
    return kd_fail(code, "%s: field '%s%s' is \"%s\": supported: %s", c->path, c->where, field, j->valuestring, allowed);
}

/* eos ids: an integer or a list of integers */
static kd_status get_ids(const char *path, const char *field, const cJSON *j, int *n, int *ids, int max) {
    if (is_int(j)) { *n = 1; ids[0] = (int)j->valuedouble; return KD_OK; }
    if (!cJSON_IsArray(j))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s': expected an integer or a list of integers, got %s", path,
                       field, json_type_name(j));
    int k = 0;
    for (const cJSON *e = j->child; e; e = e->next) {
        if (!is_int(e))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%s': expected a list of integers, item %d is %s", path, field,
                           k, json_type_name(e));
        if (k == max) return kd_fail(KD_ERR_CONFIG, "%s: field '%s': more than %d ids", path, field, max);
        ids[k++] = (int)e->valuedouble;
    }
    *n = k;
    return KD_OK;
}

void kd_config_free(kd_config *cfg) {
    if (!cfg) return;
    for (int i = 0; i < cfg->n_quant_ignore; i++) free(cfg->quant_ignore[i]);
    free(cfg->quant_ignore);
    cfg->quant_ignore = NULL;
    cfg->n_quant_ignore = 0;
}

/* Python re pattern (as compressed-tensors writes them, matched with re.match: anchored at
 * the start) -> POSIX extended regex. Translates the escapes Python has and POSIX lacks. */
bool kd_regex_translate(const char *py, char *out, size_t cap);
bool kd_regex_translate(const char *py, char *out, size_t cap) {
    size_t o = 0;
#define PUT(s) do { const char *s_ = (s); size_t l_ = strlen(s_); if (o + l_ + 1 > cap) return false; \
                    memcpy(out + o, s_, l_); o += l_; } while (0)
    PUT("^(");
    for (const char *p = py; *p; p++) {
        if (p[0] == '(' && p[1] == '?' && p[2] == ':') { PUT("("); p += 2; continue; }
        if (p[0] == '\\' && p[1]) {
            switch (p[1]) {
            case 'd': PUT("[0-9]"); break;
            case 'D': PUT("[^0-9]"); break;
            case 'w': PUT("[A-Za-z0-9_]"); break;
            case 'W': PUT("[^A-Za-z0-9_]"); break;
            case 's': PUT("[[:space:]]"); break;
            case 'S': PUT("[^[:space:]]"); break;
            default: { char e[3] = {'\\', p[1], 0}; PUT(e); }
            }
            p++;
            continue;
        }
        char ch[2] = {*p, 0};
        PUT(ch);
    }
    PUT(")");
    out[o] = 0;
    return true;
#undef PUT
}

/* gs_field: receives the full name of the group_size field, for later errors */
static kd_status parse_quant(const cfgctx *c0, const cJSON *q, kd_config *cfg, char *gs_field, size_t gs_cap) {
    cfgctx c = *c0;
    char where[64];
    snprintf(where, sizeof where, "%squantization_config.", c0->where);
    c.where = where;
    const cJSON *qm = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    if (!cJSON_IsString(qm))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%squant_method' is missing (expected \"compressed-tensors\")", c.path, where);
    if (strcmp(qm->valuestring, "compressed-tensors") != 0)
        return kd_fail(KD_ERR_UNSUPPORTED,
                       "%s: field '%squant_method' is \"%s\": supported: \"compressed-tensors\" with format "
                       "\"pack-quantized\" (INT4 experts), or no quantization_config (bf16 weights)",
                       c.path, where, qm->valuestring);
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(q, "format");
    const cJSON *groups = cJSON_GetObjectItemCaseSensitive(q, "config_groups");
    if (!cJSON_IsObject(groups) || !groups->child)
        return kd_fail(KD_ERR_CONFIG, "%s: field '%sconfig_groups' is missing (expected an object of quantization groups)",
                       c.path, where);
    int bits = 0, gsize = 0;
    for (const cJSON *g = groups->child; g; g = g->next) {
        char gw[160];
        snprintf(gw, sizeof gw, "%sconfig_groups.%s.", where, g->string);
        const cJSON *gf = cJSON_GetObjectItemCaseSensitive(g, "format");
        const cJSON *f = cJSON_IsString(gf) ? gf : fmt;
        if (!cJSON_IsString(f))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sformat' is missing (expected \"pack-quantized\")", c.path, where);
        if (strcmp(f->valuestring, "pack-quantized") != 0)
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%sformat' is \"%s\": supported: \"pack-quantized\"", c.path,
                           f == gf ? gw : where, f->valuestring);
        const cJSON *w = cJSON_GetObjectItemCaseSensitive(g, "weights");
        if (!cJSON_IsObject(w))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sweights' is missing (expected an object)", c.path, gw);
        char ww[200];
        snprintf(ww, sizeof ww, "%sweights.", gw);
        cfgctx cw = c;
        cw.where = ww;
        int nb, gs;
        bool sym;
        KD_TRY(get_int(&cw, w, "num_bits", true, 0, &nb));
        if (nb != 4)
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%snum_bits' is %d: supported: 4", c.path, ww, nb);
        KD_TRY(check_str(&cw, w, "type", "int", KD_ERR_UNSUPPORTED));
        KD_TRY(check_str(&cw, w, "strategy", "group", KD_ERR_UNSUPPORTED));
        KD_TRY(get_bool(&cw, w, "symmetric", true, &sym));
        if (!sym)
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%ssymmetric' is false: supported: symmetric INT4 (no zero point)",
                           c.path, ww);
        const cJSON *dyn = cJSON_GetObjectItemCaseSensitive(w, "dynamic");
        if (cJSON_IsTrue(dyn))
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%sdynamic' is true: supported: static weight scales", c.path, ww);
        KD_TRY(get_int(&cw, w, "group_size", true, 0, &gs));
        if (gs <= 0)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sgroup_size' is %d: expected a positive integer", c.path, ww, gs);
        const cJSON *ia = cJSON_GetObjectItemCaseSensitive(g, "input_activations");
        if (ia && !cJSON_IsNull(ia))
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%sinput_activations' is set: supported: weight-only quantization (null)",
                           c.path, gw);
        if (bits && (nb != bits || gs != gsize))
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%sconfig_groups': groups with different num_bits/group_size "
                           "(%d/%d and %d/%d) are not supported", c.path, where, bits, gsize, nb, gs);
        bits = nb;
        gsize = gs;
        snprintf(gs_field, gs_cap, "%sgroup_size", ww);
    }
    cfg->experts_int4 = true;
    cfg->quant_bits = bits;
    cfg->quant_group = gsize;
    const cJSON *ign = cJSON_GetObjectItemCaseSensitive(q, "ignore");
    if (ign && !cJSON_IsNull(ign)) {
        if (!cJSON_IsArray(ign))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%signore': expected a list of module names / \"re:\" patterns, got %s",
                           c.path, where, json_type_name(ign));
        int n = cJSON_GetArraySize(ign);
        cfg->quant_ignore = calloc((size_t)(n > 0 ? n : 1), sizeof *cfg->quant_ignore);
        if (!cfg->quant_ignore) return kd_fail(KD_ERR_NOMEM, "%s: out of memory", c.path);
        int k = 0;
        for (const cJSON *e = ign->child; e; e = e->next, k++) {
            if (!cJSON_IsString(e))
                return kd_fail(KD_ERR_CONFIG, "%s: field '%signore' item %d: expected a string, got %s", c.path, where,
                               k, json_type_name(e));
            if (strncmp(e->valuestring, "re:", 3) == 0) {
                char pat[1024];
                regex_t re;
                if (!kd_regex_translate(e->valuestring + 3, pat, sizeof pat))
                    return kd_fail(KD_ERR_CONFIG, "%s: field '%signore' item %d: pattern too long", c.path, where, k);
                int rc = regcomp(&re, pat, REG_EXTENDED | REG_NOSUB);
                if (rc != 0) {
                    char msg[128];
                    regerror(rc, &re, msg, sizeof msg);
                    return kd_fail(KD_ERR_CONFIG, "%s: field '%signore' item %d \"%s\": not a usable regular expression: %s",
                                   c.path, where, k, e->valuestring, msg);
                }
                regfree(&re);
            }
            cfg->quant_ignore[k] = strdup(e->valuestring);
            if (!cfg->quant_ignore[k]) return kd_fail(KD_ERR_NOMEM, "%s: out of memory", c.path);
            cfg->n_quant_ignore = k + 1;
        }
    }
    return KD_OK;
}

/* RoPE: `rope_parameters` (transformers 5) or legacy `rope_scaling` + `rope_theta` */
static kd_status parse_rope(const cfgctx *c, const cJSON *t, kd_config *cfg) {
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(t, "rope_parameters");
    const char *rpname = "rope_parameters";
    if (!rp || cJSON_IsNull(rp)) { rp = cJSON_GetObjectItemCaseSensitive(t, "rope_scaling"); rpname = "rope_scaling"; }
    if (rp && cJSON_IsNull(rp)) rp = NULL;
    if (rp && !cJSON_IsObject(rp))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%s%s': expected an object or null, got %s", c->path, c->where, rpname,
                       json_type_name(rp));
    double theta;
    KD_TRY(get_num(c, t, "rope_theta", false, 10000.0, &theta));
    cfgctx cr = *c;
    char where[64];
    snprintf(where, sizeof where, "%s%s.", c->where, rpname);
    cr.where = where;
    if (rp) KD_TRY(get_num(&cr, rp, "rope_theta", false, theta, &theta));
    if (!(theta > 1.0))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%srope_theta' is %g: expected a number > 1", c->path, c->where, theta);
    cfg->rope_theta = (float)theta;
    cfg->rope_attn_factor = 1.0f;
    cfg->yarn = false;
    cfg->yarn_truncate = true;
    if (!rp) return KD_OK;
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(rp, "rope_type");
    if (!ty || cJSON_IsNull(ty)) ty = cJSON_GetObjectItemCaseSensitive(rp, "type");
    const char *type = "default";
    if (ty && !cJSON_IsNull(ty)) {
        if (!cJSON_IsString(ty))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%srope_type': expected a string, got %s", c->path, where,
                           json_type_name(ty));
        type = ty->valuestring;
    }
    if (strcmp(type, "default") == 0) return KD_OK;
    if (strcmp(type, "yarn") != 0)
        return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%srope_type' is \"%s\": supported: \"default\", \"yarn\"", c->path,
                       where, type);
    cfg->yarn = true;
    /* original_max_position_embeddings: a top-level field wins (as in HF), then the rope dict,
     * then max_position_embeddings */
    int omax;
    KD_TRY(get_int(&cr, rp, "original_max_position_embeddings", false, cfg->max_positions, &omax));
    KD_TRY(get_int(c, t, "original_max_position_embeddings", false, omax, &omax));
    if (omax <= 0)
        return kd_fail(KD_ERR_CONFIG, "%s: field '%soriginal_max_position_embeddings' is %d: expected > 0", c->path, where, omax);
    cfg->yarn_original_max_positions = omax;
    double factor, bf, bs, ms, msa, af;
    KD_TRY(get_num(&cr, rp, "factor", false, (double)cfg->max_positions / omax, &factor));
    if (!(factor > 0))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%sfactor' is %g: expected > 0", c->path, where, factor);
    KD_TRY(get_num(&cr, rp, "beta_fast", false, 32.0, &bf));
    KD_TRY(get_num(&cr, rp, "beta_slow", false, 1.0, &bs));
    if (bf == 0) bf = 32.0;   /* HF: `get("beta_fast") or 32` */
    if (bs == 0) bs = 1.0;
    if (!(bf > 0) || !(bs > 0))
        return kd_fail(KD_ERR_CONFIG, "%s: fields '%sbeta_fast'/'beta_slow' (%g/%g): expected positive numbers", c->path,
                       where, bf, bs);
    KD_TRY(get_num(&cr, rp, "mscale", false, 0.0, &ms));
    KD_TRY(get_num(&cr, rp, "mscale_all_dim", false, 0.0, &msa));
    KD_TRY(get_bool(&cr, rp, "truncate", true, &cfg->yarn_truncate));
    cfg->yarn_factor = (float)factor;
    cfg->yarn_beta_fast = (float)bf;
    cfg->yarn_beta_slow = (float)bs;
    cfg->yarn_mscale = (float)ms;
    cfg->yarn_mscale_all_dim = (float)msa;
    /* cos/sin amplitude (HF _compute_yarn_parameters: attention_factor) */
#define GET_MSCALE(s, m) ((s) <= 1.0 ? 1.0 : 0.1 * (m) * log(s) + 1.0)
    KD_TRY(get_num(&cr, rp, "attention_factor", false, NAN, &af));
    if (isnan(af)) {
        if (ms != 0 && msa != 0) af = GET_MSCALE(factor, ms) / GET_MSCALE(factor, msa);
        else af = GET_MSCALE(factor, 1.0);
    }
    cfg->rope_attn_factor = (float)af;
    /* softmax scale (HF yarn_apply_mscale: only when mscale_all_dim is set) */
    if (msa != 0) {
        double m = GET_MSCALE(factor, msa);
        cfg->softmax_scale = (float)(pow((double)(cfg->qk_nope_dim + cfg->qk_rope_dim), -0.5) * m * m);
    }
#undef GET_MSCALE
    return KD_OK;
}

static kd_status parse_generation(const char *dir, kd_config *cfg) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/generation_config.json", dir) >= (int)sizeof path)
        return kd_fail(KD_ERR_ARG, "%s: path too long", dir);
    bool missing = false;
    cJSON *g;
    kd_status st = kd_json_load(path, &g, &missing);
    if (st != KD_OK || missing) return st;
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(g, "eos_token_id");
    if (e && !cJSON_IsNull(e)) st = get_ids(path, "eos_token_id", e, &cfg->n_eos, cfg->eos, 8);
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(g, "bos_token_id");
    if (st == KD_OK && b && !cJSON_IsNull(b)) {
        if (!is_int(b)) st = kd_fail(KD_ERR_CONFIG, "%s: field 'bos_token_id': expected an integer, got %s", path,
                                     json_type_name(b));
        else cfg->bos = (int)b->valuedouble;
    }
    cJSON_Delete(g);
    return st;
}

static kd_status parse_text(const cfgctx *c, const cJSON *root, const cJSON *t, kd_config *cfg) {
    const char *path = c->path, *w = c->where;
    /* shapes: required */
    KD_TRY(get_int(c, t, "vocab_size", true, 0, &cfg->vocab));
    KD_TRY(get_int(c, t, "hidden_size", true, 0, &cfg->hidden));
    KD_TRY(get_int(c, t, "num_hidden_layers", true, 0, &cfg->n_layers));
    KD_TRY(get_int(c, t, "num_attention_heads", true, 0, &cfg->n_heads));
    KD_TRY(get_int(c, t, "kv_lora_rank", true, 0, &cfg->kv_lora_rank));
    KD_TRY(get_int(c, t, "qk_nope_head_dim", true, 0, &cfg->qk_nope_dim));
    KD_TRY(get_int(c, t, "qk_rope_head_dim", true, 0, &cfg->qk_rope_dim));
    KD_TRY(get_int(c, t, "v_head_dim", true, 0, &cfg->v_head_dim));
    KD_TRY(get_int(c, t, "intermediate_size", true, 0, &cfg->intermediate));
    KD_TRY(get_int(c, t, "moe_intermediate_size", true, 0, &cfg->moe_intermediate));
    KD_TRY(get_int(c, t, "n_routed_experts", true, 0, &cfg->n_experts));
    KD_TRY(get_int(c, t, "num_experts_per_tok", true, 0, &cfg->n_experts_per_tok));
    KD_TRY(get_int(c, t, "first_k_dense_replace", true, 0, &cfg->first_k_dense));
    /* q_lora_rank: present; null = no low-rank q (q_proj) */
    const cJSON *ql = cJSON_GetObjectItemCaseSensitive(t, "q_lora_rank");
    if (!ql) return kd_fail(KD_ERR_CONFIG, "%s: field '%sq_lora_rank' is missing (expected an integer, or null for q_proj)", path, w);
    cfg->q_lora_rank = 0;
    if (!cJSON_IsNull(ql)) {
        KD_TRY(get_int(c, t, "q_lora_rank", true, 0, &cfg->q_lora_rank));
        if (cfg->q_lora_rank <= 0)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sq_lora_rank' is %d: expected a positive integer or null", path, w,
                           cfg->q_lora_rank);
    }
    /* optional, with the HF DeepseekV3Config defaults */
    double d;
    KD_TRY(get_int(c, t, "n_shared_experts", false, 1, &cfg->n_shared_experts));
    KD_TRY(get_int(c, t, "n_group", false, 8, &cfg->n_group));
    KD_TRY(get_int(c, t, "topk_group", false, 4, &cfg->topk_group));
    KD_TRY(get_int(c, t, "moe_layer_freq", false, 1, &cfg->moe_layer_freq));
    KD_TRY(get_int(c, t, "max_position_embeddings", false, 4096, &cfg->max_positions));
    KD_TRY(get_bool(c, t, "norm_topk_prob", true, &cfg->norm_topk_prob));
    KD_TRY(get_bool(c, t, "tie_word_embeddings", false, &cfg->tie_embeddings));
    if (!cJSON_GetObjectItemCaseSensitive(t, "tie_word_embeddings"))
        KD_TRY(get_bool(c, root, "tie_word_embeddings", false, &cfg->tie_embeddings));
    KD_TRY(get_num(c, t, "routed_scaling_factor", false, 2.5, &d));
    cfg->routed_scaling_factor = (float)d;
    KD_TRY(get_num(c, t, "rms_norm_eps", false, 1e-6, &d));
    cfg->rms_norm_eps = (float)d;
    /* HF builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps (1e-6),
     * not config.rms_norm_eps; we match HF (docs/formats.md) */
    cfg->q_a_norm_eps = 1e-6f;
    cfg->kv_a_norm_eps = 1e-6f;
    int kvh;
    KD_TRY(get_int(c, t, "num_key_value_heads", false, cfg->n_heads, &kvh));
    /* architectural switches we implement exactly one way: refuse the others */
    KD_TRY(check_str(c, t, "hidden_act", "silu", KD_ERR_UNSUPPORTED));
    KD_TRY(check_str(c, t, "scoring_func", "sigmoid", KD_ERR_UNSUPPORTED));
    KD_TRY(check_str(c, t, "topk_method", "noaux_tc", KD_ERR_UNSUPPORTED));
    bool abias, inter;
    KD_TRY(get_bool(c, t, "attention_bias", false, &abias));
    if (abias) return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%sattention_bias' is true: supported: false", path, w);
    KD_TRY(get_bool(c, t, "rope_interleave", true, &inter));
    if (!inter) return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%srope_interleave' is false: supported: true (MLA pairs)", path, w);

    /* consistency */
#define POS(field, v) if ((v) <= 0) return kd_fail(KD_ERR_CONFIG, "%s: field '%s" field "' is %d: expected a positive integer", path, w, (v))
    POS("vocab_size", cfg->vocab);
    POS("hidden_size", cfg->hidden);
    POS("num_hidden_layers", cfg->n_layers);
    POS("num_attention_heads", cfg->n_heads);
    POS("kv_lora_rank", cfg->kv_lora_rank);
    POS("qk_nope_head_dim", cfg->qk_nope_dim);
    POS("qk_rope_head_dim", cfg->qk_rope_dim);
    POS("v_head_dim", cfg->v_head_dim);
    POS("max_position_embeddings", cfg->max_positions);
    POS("moe_layer_freq", cfg->moe_layer_freq);
    POS("num_key_value_heads", kvh);
#undef POS
    if (cfg->qk_rope_dim % 2)
        return kd_fail(KD_ERR_CONFIG, "%s: field '%sqk_rope_head_dim' is %d: expected an even number (rotary pairs)", path, w,
                       cfg->qk_rope_dim);
    if (cfg->n_heads % kvh || kvh != cfg->n_heads)
        return kd_fail(KD_ERR_CONFIG,
                       "%s: field '%snum_key_value_heads' is %d: MLA expands the latent into every head, so it must equal "
                       "num_attention_heads (%d)", path, w, kvh, cfg->n_heads);
    if (cfg->first_k_dense < 0 || cfg->first_k_dense > cfg->n_layers)
        return kd_fail(KD_ERR_CONFIG, "%s: field '%sfirst_k_dense_replace' is %d: expected 0..num_hidden_layers (%d)", path, w,
                       cfg->first_k_dense, cfg->n_layers);
    if (cfg->first_k_dense > 0 && cfg->intermediate <= 0)
        return kd_fail(KD_ERR_CONFIG, "%s: field '%sintermediate_size' is %d: expected a positive integer (dense layers exist)",
                       path, w, cfg->intermediate);
    if (cfg->first_k_dense < cfg->n_layers) {   /* there are MoE layers */
        if (cfg->moe_intermediate <= 0)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%smoe_intermediate_size' is %d: expected a positive integer", path, w,
                           cfg->moe_intermediate);
        if (cfg->n_experts < 2)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sn_routed_experts' is %d: expected at least 2", path, w, cfg->n_experts);
        if (cfg->n_experts_per_tok <= 0 || cfg->n_experts_per_tok > cfg->n_experts)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%snum_experts_per_tok' is %d: expected 1..n_routed_experts (%d)", path, w,
                           cfg->n_experts_per_tok, cfg->n_experts);
        if (cfg->n_shared_experts < 0)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sn_shared_experts' is %d: expected >= 0", path, w, cfg->n_shared_experts);
        if (cfg->n_group <= 0 || cfg->n_experts % cfg->n_group)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sn_group' is %d: expected a positive divisor of n_routed_experts (%d)",
                           path, w, cfg->n_group, cfg->n_experts);
        if (cfg->n_group > 1 && cfg->n_experts / cfg->n_group < 2)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sn_group' is %d: group scores take the top 2 experts of a group, so "
                           "each group needs >= 2 of the %d experts", path, w, cfg->n_group, cfg->n_experts);
        if (cfg->topk_group <= 0 || cfg->topk_group > cfg->n_group)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%stopk_group' is %d: expected 1..n_group (%d)", path, w,
                           cfg->topk_group, cfg->n_group);
        if (cfg->n_experts_per_tok > cfg->topk_group * (cfg->n_experts / cfg->n_group))
            return kd_fail(KD_ERR_CONFIG,
                           "%s: field '%snum_experts_per_tok' is %d: more than the %d experts in topk_group (%d) groups of %d",
                           path, w, cfg->n_experts_per_tok, cfg->topk_group * (cfg->n_experts / cfg->n_group),
                           cfg->topk_group, cfg->n_experts / cfg->n_group);
    }
    if (!(cfg->rms_norm_eps > 0))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%srms_norm_eps' is %g: expected a positive number", path, w,
                       (double)cfg->rms_norm_eps);
    if (!isfinite(cfg->routed_scaling_factor) || !(cfg->routed_scaling_factor > 0))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%srouted_scaling_factor' is %g: expected a positive number", path, w,
                       (double)cfg->routed_scaling_factor);

    cfg->softmax_scale = (float)pow((double)(cfg->qk_nope_dim + cfg->qk_rope_dim), -0.5);
    KD_TRY(parse_rope(c, t, cfg));

    /* quantization_config: in text_config, else at the top level */
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(t, "quantization_config");
    cfgctx cq = *c;
    if ((!q || cJSON_IsNull(q)) && t != root) {
        q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
        cq.where = "";
    }
    if (q && !cJSON_IsNull(q)) {
        if (!cJSON_IsObject(q))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%squantization_config': expected an object, got %s", path, cq.where,
                           json_type_name(q));
        char gsf[256];
        KD_TRY(parse_quant(&cq, q, cfg, gsf, sizeof gsf));
        int g = cfg->quant_group;
        if (cfg->first_k_dense < cfg->n_layers) {
            if (cfg->hidden % g || cfg->hidden % 8)
                return kd_fail(KD_ERR_CONFIG,
                               "%s: field '%s' is %d: it must divide hidden_size (%d), the "
                               "input dim of the INT4 gate/up experts (and that dim must be a multiple of 8)",
                               path, gsf, g, cfg->hidden);
            if (cfg->moe_intermediate % g || cfg->moe_intermediate % 8)
                return kd_fail(KD_ERR_CONFIG,
                               "%s: field '%s' is %d: it must divide moe_intermediate_size "
                               "(%d), the input dim of the INT4 down experts (and that dim must be a multiple of 8)",
                               path, gsf, g, cfg->moe_intermediate);
        }
    }

    /* ids from config.json (generation_config.json overrides eos/bos) */
    cfg->bos = -1;
    cfg->n_eos = 0;
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(t, "eos_token_id");
    const char *ewhere = w;
    if ((!e || cJSON_IsNull(e)) && t != root) { e = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id"); ewhere = ""; }
    if (e && !cJSON_IsNull(e)) {
        char f[64];
        snprintf(f, sizeof f, "%seos_token_id", ewhere);
        KD_TRY(get_ids(path, f, e, &cfg->n_eos, cfg->eos, 8));
    }
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(t, "bos_token_id");
    if ((!b || cJSON_IsNull(b)) && t != root) b = cJSON_GetObjectItemCaseSensitive(root, "bos_token_id");
    if (b && !cJSON_IsNull(b)) {
        if (!is_int(b)) return kd_fail(KD_ERR_CONFIG, "%s: field 'bos_token_id': expected an integer, got %s", path, json_type_name(b));
        cfg->bos = (int)b->valuedouble;
    }
    return KD_OK;
}

kd_status kd_config_load(const char *dir, kd_config *cfg) {
    if (!dir || !cfg) return kd_fail(KD_ERR_ARG, "kd_config_load: dir and cfg must not be NULL");
    memset(cfg, 0, sizeof *cfg);
    cfg->bos = -1;
    char path[4096];
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path)
        return kd_fail(KD_ERR_ARG, "%s: path too long", dir);
    cJSON *root;
    kd_status st = kd_json_load(path, &root, NULL);
    if (st != KD_OK) return st;
    cfgctx c = {path, ""};
    const cJSON *t = root;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt)) {
        st = kd_fail(KD_ERR_CONFIG, "%s: field 'model_type' is missing (expected \"deepseek_v3\", \"kimi_k2\" or \"kimi_k25\")", path);
        goto done;
    }
    if (strcmp(mt->valuestring, "kimi_k25") == 0) {
        t = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        if (!cJSON_IsObject(t)) {
            st = kd_fail(KD_ERR_CONFIG, "%s: field 'text_config' is missing (model_type kimi_k25 wraps the text model there)", path);
            goto done;
        }
        c.where = "text_config.";
        const cJSON *tmt = cJSON_GetObjectItemCaseSensitive(t, "model_type");
        if (tmt && !(cJSON_IsString(tmt) && (strcmp(tmt->valuestring, "kimi_k2") == 0 ||
                                              strcmp(tmt->valuestring, "deepseek_v3") == 0))) {
            st = kd_fail(KD_ERR_UNSUPPORTED, "%s: field 'text_config.model_type' is %s%s%s: supported: \"kimi_k2\", \"deepseek_v3\"",
                         path, cJSON_IsString(tmt) ? "\"" : "", cJSON_IsString(tmt) ? tmt->valuestring : json_type_name(tmt),
                         cJSON_IsString(tmt) ? "\"" : "");
            goto done;
        }
        snprintf(cfg->prefix, sizeof cfg->prefix, "language_model.");
    } else if (strcmp(mt->valuestring, "deepseek_v3") != 0 && strcmp(mt->valuestring, "kimi_k2") != 0) {
        st = kd_fail(KD_ERR_UNSUPPORTED, "%s: field 'model_type' is \"%s\": supported: \"deepseek_v3\", \"kimi_k2\", \"kimi_k25\"",
                     path, mt->valuestring);
        goto done;
    }
    st = parse_text(&c, root, t, cfg);
    if (st == KD_OK) st = parse_generation(dir, cfg);
done:
    cJSON_Delete(root);
    if (st != KD_OK) kd_config_free(cfg);
    return st;
}

/* HF _compute_default_rope_parameters / _compute_yarn_parameters, in double, stored as float */
void kd_rope_inv_freq(const kd_config *cfg, int dim, float *inv_freq) {
    double base = cfg->rope_theta;
    int half = dim / 2;
    if (!cfg->yarn) {
        for (int i = 0; i < half; i++) inv_freq[i] = (float)(1.0 / pow(base, (2.0 * i) / dim));
        return;
    }
    double factor = cfg->yarn_factor, omax = cfg->yarn_original_max_positions;
    const double two_pi = 6.283185307179586476925286766559;
    double low = dim * log(omax / (cfg->yarn_beta_fast * two_pi)) / (2.0 * log(base));
    double high = dim * log(omax / (cfg->yarn_beta_slow * two_pi)) / (2.0 * log(base));
    if (cfg->yarn_truncate) { low = floor(low); high = ceil(high); }
    if (low < 0) low = 0;
    if (high > dim - 1) high = dim - 1;
    if (low == high) high += 0.001;   /* HF: prevent a singular ramp */
    for (int i = 0; i < half; i++) {
        double pos = pow(base, (2.0 * i) / dim);
        double extra = 1.0 / pos, inter = 1.0 / (factor * pos);
        double ramp = (i - low) / (high - low);
        if (ramp < 0) ramp = 0;
        if (ramp > 1) ramp = 1;
        double ef = 1.0 - ramp;   /* extrapolation weight */
        inv_freq[i] = (float)(inter * (1.0 - ef) + extra * ef);
    }
}
