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
#include "config_read.h"
#include "sample_rule.h"
#include <limits.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* bounds of the sizes: far above every published DeepSeek-V3 / Kimi layout (K2.6: hidden 7168,
 * 61 layers, 64 heads, 384 experts, 262144 positions), far below where size arithmetic
 * overflows. POSITIONS_MIN: room for a prompt and a speculative round (a drafter block and a
 * tree of its depth). */
enum {
    DIM_MAX = 1 << 16, HEAD_DIM_MAX = 4096, HEADS_MAX = 4096, LAYERS_MAX = 4096, WIDTH_MAX = 1 << 20,
    EXPERTS_MAX = 1 << 16, POSITIONS_MIN = 64, POSITIONS_MAX = 1 << 30
};

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
static kd_status parse_quant(const kd_cfg_ctx *c0, const cJSON *q, kd_config *cfg, char *gs_field, size_t gs_cap) {
    kd_cfg_ctx c = *c0;
    char where[64];
    snprintf(where, sizeof where, "%squantization_config.", c0->where);
    c.where = where;
    char qt[200];   /* file text quoted in a message */
    const cJSON *qm = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    if (!cJSON_IsString(qm))
        return kd_fail(KD_ERR_CONFIG, "%s: field '%squant_method' is missing (expected \"compressed-tensors\")", c.path, where);
    if (strcmp(qm->valuestring, "compressed-tensors") != 0)
        return kd_fail(KD_ERR_UNSUPPORTED,
                       "%s: field '%squant_method' is \"%s\": supported: \"compressed-tensors\" with format "
                       "\"pack-quantized\" (INT4 experts), or no quantization_config (bf16 weights)",
                       c.path, where, kd_printable(qm->valuestring, qt, sizeof qt));
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(q, "format");
    const cJSON *groups = cJSON_GetObjectItemCaseSensitive(q, "config_groups");
    if (!cJSON_IsObject(groups) || !groups->child)
        return kd_fail(KD_ERR_CONFIG, "%s: field '%sconfig_groups' is missing (expected an object of quantization groups)",
                       c.path, where);
    int bits = 0, gsize = 0;
    for (const cJSON *g = groups->child; g; g = g->next) {
        char gw[160];
        char gname[64];
        snprintf(gw, sizeof gw, "%sconfig_groups.%s.", where, kd_printable(g->string, gname, sizeof gname));
        const cJSON *gf = cJSON_GetObjectItemCaseSensitive(g, "format");
        const cJSON *f = cJSON_IsString(gf) ? gf : fmt;
        if (!cJSON_IsString(f))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sformat' is missing (expected \"pack-quantized\")", c.path, where);
        if (strcmp(f->valuestring, "pack-quantized") != 0)
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%sformat' is \"%s\": supported: \"pack-quantized\"", c.path,
                           f == gf ? gw : where, kd_printable(f->valuestring, qt, sizeof qt));
        const cJSON *w = cJSON_GetObjectItemCaseSensitive(g, "weights");
        if (!cJSON_IsObject(w))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sweights' is missing (expected an object)", c.path, gw);
        char ww[200];
        snprintf(ww, sizeof ww, "%sweights.", gw);
        kd_cfg_ctx cw = c;
        cw.where = ww;
        int nb, gs;
        bool sym;
        KD_TRY(kd_cfg_int(&cw, w, "num_bits", true, 0, INT_MIN, INT_MAX, &nb));
        if (nb != 4)
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%snum_bits' is %d: supported: 4", c.path, ww, nb);
        KD_TRY(kd_cfg_one_of(&cw, w, "type", "int", KD_ERR_UNSUPPORTED));
        KD_TRY(kd_cfg_one_of(&cw, w, "strategy", "group", KD_ERR_UNSUPPORTED));
        KD_TRY(kd_cfg_bool(&cw, w, "symmetric", true, &sym));
        if (!sym)
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%ssymmetric' is false: supported: symmetric INT4 (no zero point)",
                           c.path, ww);
        const cJSON *dyn = cJSON_GetObjectItemCaseSensitive(w, "dynamic");
        if (cJSON_IsTrue(dyn))
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%sdynamic' is true: supported: static weight scales", c.path, ww);
        KD_TRY(kd_cfg_int(&cw, w, "group_size", true, 0, 1, 1 << 20, &gs));
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
                           c.path, where, kd_json_type_name(ign));
        int n = cJSON_GetArraySize(ign);
        cfg->quant_ignore = calloc((size_t)(n > 0 ? n : 1), sizeof *cfg->quant_ignore);
        if (!cfg->quant_ignore) return kd_fail(KD_ERR_NOMEM, "%s: out of memory", c.path);
        int k = 0;
        for (const cJSON *e = ign->child; e; e = e->next, k++) {
            if (!cJSON_IsString(e))
                return kd_fail(KD_ERR_CONFIG, "%s: field '%signore' item %d: expected a string, got %s", c.path, where,
                               k, kd_json_type_name(e));
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
                                   c.path, where, k, kd_printable(e->valuestring, qt, sizeof qt), msg);
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

/* RoPE (config_read.h), and the softmax scale YaRN changes (HF yarn_apply_mscale: only
 * when mscale_all_dim is set) */
static kd_status parse_rope(const kd_cfg_ctx *c, const cJSON *t, kd_config *cfg) {
    KD_TRY(kd_cfg_rope(c, t, cfg->max_positions, &cfg->rope));
    double scale = pow((double)(cfg->qk_nope_dim + cfg->qk_rope_dim), -0.5);
    if (cfg->rope.kind == KD_ROPE_YARN && cfg->rope.mscale_all_dim != 0) {
        double m = kd_yarn_mscale(cfg->rope.factor, cfg->rope.mscale_all_dim);
        scale *= m * m;
    }
    cfg->softmax_scale = (float)scale;
    return KD_OK;
}

/* eos_token_id / bos_token_id of object o (the file's context c), in the vocabulary */
static kd_status parse_ids(const kd_cfg_ctx *c, const cJSON *o, kd_config *cfg) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(o, "eos_token_id");
    if (e && !cJSON_IsNull(e)) KD_TRY(kd_cfg_ids(c, e, "eos_token_id", cfg->vocab, &cfg->n_eos, cfg->eos, 8));
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(o, "bos_token_id");
    if (b && !cJSON_IsNull(b)) {
        if (cJSON_IsArray(b)) {
            char v[64];
            return kd_fail(KD_ERR_CONFIG, "%s: field '%sbos_token_id' is %s: expected one token id", c->path, c->where,
                           kd_json_value_text(b, v, sizeof v));
        }
        int n;
        KD_TRY(kd_cfg_ids(c, b, "bos_token_id", cfg->vocab, &n, &cfg->bos, 1));
    }
    return KD_OK;
}

/* generation_config.json, when present, overrides eos/bos */
static kd_status parse_generation(const char *dir, kd_config *cfg) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/generation_config.json", dir) >= (int)sizeof path)
        return kd_fail(KD_ERR_ARG, "%s: path too long", dir);
    bool missing = false;
    cJSON *g;
    kd_status st = kd_json_load(path, &g, &missing);
    if (st != KD_OK || missing) return st;
    kd_cfg_ctx c = {path, ""};
    st = parse_ids(&c, g, cfg);
    cJSON_Delete(g);
    return st;
}

static kd_status parse_text(const kd_cfg_ctx *c, const cJSON *root, const cJSON *t, kd_config *cfg) {
    const char *path = c->path, *w = c->where;
    /* shapes: required, positive and bounded (the bounds hold every published DeepSeek-V3 /
     * Kimi layout with room, and keep size arithmetic far from overflow) */
    KD_TRY(kd_cfg_int(c, t, "vocab_size", true, 0, 1, KD_SAMPLE_MAX_VOCAB, &cfg->vocab));
    KD_TRY(kd_cfg_int(c, t, "hidden_size", true, 0, 1, DIM_MAX, &cfg->hidden));
    KD_TRY(kd_cfg_int(c, t, "num_hidden_layers", true, 0, 1, LAYERS_MAX, &cfg->n_layers));
    KD_TRY(kd_cfg_int(c, t, "num_attention_heads", true, 0, 1, HEADS_MAX, &cfg->n_heads));
    KD_TRY(kd_cfg_int(c, t, "kv_lora_rank", true, 0, 1, DIM_MAX, &cfg->kv_lora_rank));
    KD_TRY(kd_cfg_int(c, t, "qk_nope_head_dim", true, 0, 1, HEAD_DIM_MAX, &cfg->qk_nope_dim));
    KD_TRY(kd_cfg_int(c, t, "qk_rope_head_dim", true, 0, 1, HEAD_DIM_MAX, &cfg->qk_rope_dim));
    KD_TRY(kd_cfg_int(c, t, "v_head_dim", true, 0, 1, HEAD_DIM_MAX, &cfg->v_head_dim));
    KD_TRY(kd_cfg_int(c, t, "intermediate_size", true, 0, 0, WIDTH_MAX, &cfg->intermediate));
    KD_TRY(kd_cfg_int(c, t, "moe_intermediate_size", true, 0, 0, WIDTH_MAX, &cfg->moe_intermediate));
    KD_TRY(kd_cfg_int(c, t, "n_routed_experts", true, 0, 0, EXPERTS_MAX, &cfg->n_experts));
    KD_TRY(kd_cfg_int(c, t, "num_experts_per_tok", true, 0, 0, EXPERTS_MAX, &cfg->n_experts_per_tok));
    KD_TRY(kd_cfg_int(c, t, "first_k_dense_replace", true, 0, 0, LAYERS_MAX, &cfg->first_k_dense));
    /* q_lora_rank: present; null = no low-rank q (q_proj) */
    const cJSON *ql = cJSON_GetObjectItemCaseSensitive(t, "q_lora_rank");
    if (!ql) return kd_fail(KD_ERR_CONFIG, "%s: field '%sq_lora_rank' is missing (expected an integer, or null for q_proj)", path, w);
    cfg->q_lora_rank = 0;
    if (!cJSON_IsNull(ql)) KD_TRY(kd_cfg_int(c, t, "q_lora_rank", true, 0, 1, DIM_MAX, &cfg->q_lora_rank));
    /* optional, with the HF DeepseekV3Config defaults */
    KD_TRY(kd_cfg_int(c, t, "n_shared_experts", false, 1, 0, EXPERTS_MAX, &cfg->n_shared_experts));
    KD_TRY(kd_cfg_int(c, t, "n_group", false, 8, INT_MIN, INT_MAX, &cfg->n_group));
    KD_TRY(kd_cfg_int(c, t, "topk_group", false, 4, INT_MIN, INT_MAX, &cfg->topk_group));
    KD_TRY(kd_cfg_int(c, t, "moe_layer_freq", false, 1, 1, LAYERS_MAX, &cfg->moe_layer_freq));
    KD_TRY(kd_cfg_int(c, t, "max_position_embeddings", false, 4096, POSITIONS_MIN, POSITIONS_MAX, &cfg->max_positions));
    KD_TRY(kd_cfg_bool(c, t, "norm_topk_prob", true, &cfg->norm_topk_prob));
    KD_TRY(kd_cfg_bool(c, t, "tie_word_embeddings", false, &cfg->tie_embeddings));
    if (!cJSON_GetObjectItemCaseSensitive(t, "tie_word_embeddings"))
        KD_TRY(kd_cfg_bool(c, root, "tie_word_embeddings", false, &cfg->tie_embeddings));
    KD_TRY(kd_cfg_float(c, t, "routed_scaling_factor", 2.5, true, &cfg->routed_scaling_factor));
    KD_TRY(kd_cfg_float(c, t, "rms_norm_eps", 1e-6, true, &cfg->rms_norm_eps));
    /* HF builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps (1e-6),
     * not config.rms_norm_eps; we match HF (docs/formats.md) */
    cfg->q_a_norm_eps = 1e-6f;
    cfg->kv_a_norm_eps = 1e-6f;
    int kvh;
    KD_TRY(kd_cfg_int(c, t, "num_key_value_heads", false, cfg->n_heads, 1, HEADS_MAX, &kvh));
    /* architectural switches we implement exactly one way: refuse the others */
    KD_TRY(kd_cfg_one_of(c, t, "hidden_act", "silu", KD_ERR_UNSUPPORTED));
    KD_TRY(kd_cfg_one_of(c, t, "scoring_func", "sigmoid", KD_ERR_UNSUPPORTED));
    KD_TRY(kd_cfg_one_of(c, t, "topk_method", "noaux_tc", KD_ERR_UNSUPPORTED));
    bool abias, inter;
    KD_TRY(kd_cfg_bool(c, t, "attention_bias", false, &abias));
    if (abias) return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%sattention_bias' is true: supported: false", path, w);
    KD_TRY(kd_cfg_bool(c, t, "rope_interleave", true, &inter));
    if (!inter) return kd_fail(KD_ERR_UNSUPPORTED, "%s: field '%srope_interleave' is false: supported: true (MLA pairs)", path, w);

    /* consistency */
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
    KD_TRY(parse_rope(c, t, cfg));

    /* quantization_config: in text_config, else at the top level */
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(t, "quantization_config");
    kd_cfg_ctx cq = *c;
    if ((!q || cJSON_IsNull(q)) && t != root) {
        q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
        cq.where = "";
    }
    if (q && !cJSON_IsNull(q)) {
        if (!cJSON_IsObject(q))
            return kd_fail(KD_ERR_CONFIG, "%s: field '%squantization_config': expected an object, got %s", path, cq.where,
                           kd_json_type_name(q));
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

    /* ids: config.json's top level, then text_config (generation_config.json overrides both) */
    cfg->bos = -1;
    cfg->n_eos = 0;
    kd_cfg_ctx croot = {path, ""};
    KD_TRY(parse_ids(&croot, root, cfg));
    if (t != root) KD_TRY(parse_ids(c, t, cfg));
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
    kd_cfg_ctx c = {path, ""};
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
            char v[200];
            st = kd_fail(KD_ERR_UNSUPPORTED, "%s: field 'text_config.model_type' is %s: supported: \"kimi_k2\", \"deepseek_v3\"",
                         path, kd_json_value_text(tmt, v, sizeof v));
            goto done;
        }
        snprintf(cfg->prefix, sizeof cfg->prefix, "language_model.");
    } else if (strcmp(mt->valuestring, "deepseek_v3") != 0 && strcmp(mt->valuestring, "kimi_k2") != 0) {
        char v[200];
        st = kd_fail(KD_ERR_UNSUPPORTED, "%s: field 'model_type' is %s: supported: \"deepseek_v3\", \"kimi_k2\", \"kimi_k25\"",
                     path, kd_json_value_text(mt, v, sizeof v));
        goto done;
    }
    st = parse_text(&c, root, t, cfg);
    if (st == KD_OK) st = parse_generation(dir, cfg);
done:
    cJSON_Delete(root);
    if (st != KD_OK) kd_config_free(cfg);
    return st;
}

void kd_rope_inv_freq(const kd_config *cfg, int dim, float *inv_freq) { kd_rope_params_inv_freq(&cfg->rope, dim, inv_freq); }
