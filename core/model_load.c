/* model_load.c: a checkpoint directory -> a kd_model on a backend; kd_inspect.
 *
 * One walk over the tensors the config says the model has (bind_model) serves both
 * kd_model_open (map the files, check every tensor, hand each weight to the backend)
 * and kd_inspect (headers only: check the same names, dtypes and shapes, and add up
 * the bytes by kind). Tensors the walk does not ask for (other towers such as
 * vision_tower.* and mm_projector.*, MTP layers past num_hidden_layers) are skipped
 * and counted.
 *
 * Which Linear modules are INT4: with a compressed-tensors quantization_config every
 * nn.Linear is quantized unless its module name matches the `ignore` list (plain names
 * exactly, "re:" patterns with Python re.match semantics, i.e. anchored at the start).
 * A name is tried both as written in the checkpoint (with the "language_model." prefix)
 * and without the prefix. Embeddings, norms and the router are not Linear: never INT4.
 *
 * Errors name the file and tensor and say what was expected; on any failure everything
 * made so far is freed.
 */
#include "model.h"
#include "error.h"

#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool kd_regex_translate(const char *py, char *out, size_t cap);   /* config.c */

/* byte classes of kd_inspect. attention: everything under self_attn (with the q_a/kv_a latent
 * norms, as kimi_k2.md counts it); norms: the per-layer input/post-attention norms and the final norm */
enum kind { K_ATTN, K_DENSE, K_SHARED, K_ROUTED, K_ROUTER, K_EMBED, K_LMHEAD, K_NORM, K_N };

typedef struct loader {
    const kd_config *cfg;
    const kd_st_set *set;
    const char *dir;
    kd_model *m;             /* NULL: check only (kd_inspect) */
    kd_backend *be;
    regex_t *re;             /* compiled ignore patterns (NULL entries: plain names) */
    bool *is_re;
    int n_pat;
    uint64_t bytes[K_N];
    uint64_t routed_read;    /* routed expert bytes one token reads: per layer top_k / n of them */
    uint64_t embed_row;      /* one row of the embedding table */
    int n_used;
} loader;

/* ---- small helpers ---- */

static const char *file_of(const loader *L, const kd_st_tensor *t) { return L->set->files[t->file].path; }

static void shape_str(char *buf, size_t cap, const int64_t *shape, int ndim) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (int i = 0; i < ndim && o < cap - 24; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    snprintf(buf + o, cap - o, "]");
}

static kd_status find(const loader *L, const char *name, const char *expect, const kd_st_tensor **out) {
    *out = kd_st_find(L->set, name);
    if (!*out) return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s' is missing (expected %s)", L->dir, name, expect);
    return KD_OK;
}

static kd_status check_shape(const loader *L, const kd_st_tensor *t, int ndim, int64_t d0, int64_t d1) {
    bool ok = t->ndim == ndim && t->shape[0] == d0 && (ndim < 2 || t->shape[1] == d1);
    if (ok) return KD_OK;
    int64_t want[2] = {d0, d1};
    char w[64], g[160];
    shape_str(w, sizeof w, want, ndim);
    shape_str(g, sizeof g, t->shape, t->ndim);
    return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected shape %s, got %s", file_of(L, t), t->name, w, g);
}

static bool in_mapping(const kd_st_set *set, const void *p) {
    for (int i = 0; i < set->n_files; i++) {
        const char *b = set->files[i].map;
        if (b && (const char *)p >= b && (const char *)p < b + set->files[i].size) return true;
    }
    return false;
}

/* the mapped bytes, or an aligned private copy when the file places them unaligned */
static kd_status aligned_src(const kd_st_tensor *t, size_t align, const void **out) {
    if (((uintptr_t)t->data % align) == 0) { *out = t->data; return KD_OK; }
    void *p = malloc(t->nbytes ? t->nbytes : 1);
    if (!p) return kd_fail(KD_ERR_NOMEM, "tensor '%s': cannot allocate %llu bytes", t->name, (unsigned long long)t->nbytes);
    memcpy(p, t->data, t->nbytes);
    *out = p;
    return KD_OK;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
    if (e == 0) {
        if (man == 0) u = sign;
        else {
            int k = -1;
            do { man <<= 1; k++; } while (!(man & 0x400u));
            u = sign | (uint32_t)(127 - 15 - k) << 23 | (man & 0x3ffu) << 13;
        }
    } else if (e == 31) u = sign | 0x7f800000u | man << 13;
    else u = sign | (e + 127 - 15) << 23 | man << 13;
    union { uint32_t u; float f; } v = {.u = u};
    return v.f;
}

/* f32 host copy of a BF16/F16 tensor (or the F32 bytes themselves, aligned) */
static kd_status as_f32(const kd_st_tensor *t, const void **out) {
    if (t->dtype == KD_ST_F32) return aligned_src(t, 4, out);
    uint64_t n = t->nbytes / 2;
    float *p = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!p) return kd_fail(KD_ERR_NOMEM, "tensor '%s': cannot allocate %llu floats", t->name, (unsigned long long)n);
    const unsigned char *s = t->data;
    for (uint64_t i = 0; i < n; i++) {
        uint16_t h = (uint16_t)(s[2 * i] | s[2 * i + 1] << 8);
        if (t->dtype == KD_ST_BF16) {
            union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
            p[i] = v.f;
        } else p[i] = half_to_float(h);
    }
    *out = p;
    return KD_OK;
}

/* ---- which modules are INT4 ---- */

static bool pattern_match(const loader *L, const char *module) {
    for (int i = 0; i < L->n_pat; i++) {
        if (L->is_re[i]) {
            if (regexec(&L->re[i], module, 0, NULL, 0) == 0) return true;
        } else if (strcmp(L->cfg->quant_ignore[i], module) == 0) return true;
    }
    return false;
}

/* module: the full checkpoint name without ".weight" */
static bool is_quantized(const loader *L, const char *module) {
    if (!L->cfg->experts_int4) return false;
    if (pattern_match(L, module)) return false;
    size_t lp = strlen(L->cfg->prefix);
    if (lp && strncmp(module, L->cfg->prefix, lp) == 0 && pattern_match(L, module + lp)) return false;
    return true;
}

static void loader_free_patterns(loader *L) {
    for (int i = 0; i < L->n_pat; i++)
        if (L->is_re[i]) regfree(&L->re[i]);
    free(L->re);
    free(L->is_re);
    L->re = NULL;
    L->is_re = NULL;
    L->n_pat = 0;
}

static kd_status loader_init(loader *L, const kd_config *cfg, const kd_st_set *set, const char *dir, kd_model *m) {
    memset(L, 0, sizeof *L);
    L->cfg = cfg;
    L->set = set;
    L->dir = dir;
    L->m = m;
    L->be = m ? m->be : NULL;
    int n = cfg->n_quant_ignore;
    if (n == 0) return KD_OK;
    L->re = calloc((size_t)n, sizeof *L->re);
    L->is_re = calloc((size_t)n, sizeof *L->is_re);
    if (!L->re || !L->is_re) { loader_free_patterns(L); return kd_fail(KD_ERR_NOMEM, "%s: out of memory", dir); }
    for (int i = 0; i < n; i++) {
        const char *p = cfg->quant_ignore[i];
        if (strncmp(p, "re:", 3) != 0) { L->n_pat = i + 1; continue; }
        char pat[1024];
        if (!kd_regex_translate(p + 3, pat, sizeof pat) || regcomp(&L->re[i], pat, REG_EXTENDED | REG_NOSUB) != 0) {
            loader_free_patterns(L);
            return kd_fail(KD_ERR_CONFIG, "%s/config.json: quantization_config.ignore item %d \"%s\": not a usable regular expression",
                           dir, i, p);
        }
        L->is_re[i] = true;
        L->n_pat = i + 1;
    }
    return KD_OK;
}

/* ---- binding one weight ---- */

static kd_status backend_load(loader *L, kd_weight *w) {
    kd_status st = L->be->ops->weight_load(L->be, w);
    if (st != KD_OK) {
        /* the backend did not take it: drop our private copies and the binding */
        if (w->src && !in_mapping(L->set, w->src)) free((void *)w->src);
        if (w->src_scale && !in_mapping(L->set, w->src_scale)) free((void *)w->src_scale);
        const char *name = w->name;
        memset(w, 0, sizeof *w);
        return kd_fail_context(st, "loading tensor '%s'", name ? name : "?");
    }
    return KD_OK;
}

/* a bf16 (or f32/f16) matrix [rows, cols], or a vector [rows] when cols == 0 */
static kd_status bind_dense(loader *L, kd_weight *w, enum kind kind, const char *name, int64_t rows, int64_t cols) {
    const kd_st_tensor *t;
    char expect[96];
    if (cols) snprintf(expect, sizeof expect, "BF16 [%lld, %lld]", (long long)rows, (long long)cols);
    else snprintf(expect, sizeof expect, "BF16 or F32 [%lld]", (long long)rows);
    KD_TRY(find(L, name, expect, &t));
    if (t->dtype != KD_ST_BF16 && t->dtype != KD_ST_F32 && t->dtype != KD_ST_F16)
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype BF16 (or F32/F16), got %s", file_of(L, t), name,
                       t->dtype_name);
    KD_TRY(check_shape(L, t, cols ? 2 : 1, rows, cols));
    L->bytes[kind] += t->nbytes;
    L->n_used++;
    if (!L->m) return KD_OK;
    memset(w, 0, sizeof *w);
    w->rows = rows;
    w->cols = cols ? cols : 1;
    if (t->dtype == KD_ST_BF16) {
        w->format = KD_W_BF16;
        KD_TRY(aligned_src(t, 2, &w->src));
    } else {
        w->format = KD_W_F32;    /* F16 is widened to F32 once, here */
        KD_TRY(as_f32(t, &w->src));
    }
    w->name = t->name;
    return backend_load(L, w);
}

/* compressed-tensors pack-quantized INT4: M.weight_packed / weight_scale / weight_shape */
static kd_status bind_int4(loader *L, kd_weight *w, enum kind kind, const char *module, int64_t rows, int64_t cols) {
    int g = L->cfg->quant_group;
    char np[512], ns[512], nsh[512], expect[160];
    snprintf(np, sizeof np, "%s.weight_packed", module);
    snprintf(ns, sizeof ns, "%s.weight_scale", module);
    snprintf(nsh, sizeof nsh, "%s.weight_shape", module);
    const kd_st_tensor *tp = kd_st_find(L->set, np), *ts, *tsh;
    if (!tp) {
        char nw[512];
        snprintf(nw, sizeof nw, "%s.weight", module);
        if (kd_st_find(L->set, nw))
            return kd_fail(KD_ERR_FORMAT,
                           "%s: tensor '%s' is missing: quantization_config (pack-quantized INT4, module not in 'ignore') "
                           "expects INT4 weights for '%s', but the checkpoint holds '%s'", L->dir, np, module, nw);
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s' is missing (expected I32 [%lld, %lld], INT4 packed 8 per word)",
                       L->dir, np, (long long)rows, (long long)(cols / 8));
    }
    if (tp->dtype != KD_ST_I32)
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype I32 (8 INT4 codes per word), got %s", file_of(L, tp),
                       np, tp->dtype_name);
    KD_TRY(check_shape(L, tp, 2, rows, cols / 8));
    snprintf(expect, sizeof expect, "BF16 [%lld, %lld], one scale per group of %d", (long long)rows,
             (long long)(cols / g), g);
    KD_TRY(find(L, ns, expect, &ts));
    if (ts->dtype != KD_ST_BF16)
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype BF16, got %s", file_of(L, ts), ns, ts->dtype_name);
    KD_TRY(check_shape(L, ts, 2, rows, cols / g));
    KD_TRY(find(L, nsh, "I64 [2] = [out, in]", &tsh));
    if (tsh->dtype != KD_ST_I64 && tsh->dtype != KD_ST_I32)
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype I64, got %s", file_of(L, tsh), nsh, tsh->dtype_name);
    KD_TRY(check_shape(L, tsh, 1, 2, 0));
    if (tsh->data) {
        int64_t v[2];
        for (int i = 0; i < 2; i++) {
            if (tsh->dtype == KD_ST_I64) memcpy(&v[i], (const char *)tsh->data + 8 * i, 8);
            else { int32_t x; memcpy(&x, (const char *)tsh->data + 4 * i, 4); v[i] = x; }
        }
        if (v[0] != rows || v[1] != cols)
            return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected the values [%lld, %lld], got [%lld, %lld]",
                           file_of(L, tsh), nsh, (long long)rows, (long long)cols, (long long)v[0], (long long)v[1]);
    }
    L->bytes[kind] += tp->nbytes + ts->nbytes + tsh->nbytes;
    L->n_used += 3;
    if (!L->m) return KD_OK;
    memset(w, 0, sizeof *w);
    w->format = KD_W_INT4;
    w->rows = rows;
    w->cols = cols;
    w->group = g;
    w->name = tp->name;
    kd_status st = aligned_src(tp, 4, &w->src);
    if (st == KD_OK) st = aligned_src(ts, 2, &w->src_scale);
    if (st != KD_OK) {
        if (w->src && !in_mapping(L->set, w->src)) free((void *)w->src);
        memset(w, 0, sizeof *w);
        return st;
    }
    return backend_load(L, w);
}

/* an nn.Linear [out = rows, in = cols]: INT4 or dense, by the quantization config */
static kd_status bind_linear(loader *L, kd_weight *w, enum kind kind, const char *module, int64_t rows, int64_t cols) {
    if (is_quantized(L, module)) return bind_int4(L, w, kind, module, rows, cols);
    char name[512];
    snprintf(name, sizeof name, "%s.weight", module);
    if (!kd_st_find(L->set, name)) {
        char np[512];
        snprintf(np, sizeof np, "%s.weight_packed", module);
        if (kd_st_find(L->set, np))
            return kd_fail(KD_ERR_FORMAT,
                           "%s: tensor '%s' is missing: the checkpoint holds INT4 '%s', but %s", L->dir, name, np,
                           L->cfg->experts_int4 ? "quantization_config.ignore lists this module as unquantized"
                                                : "config.json has no quantization_config");
    }
    return bind_dense(L, w, kind, name, rows, cols);
}

/* ---- the model walk ---- */

static kd_status bind_layer(loader *L, int l, kd_layer *ly) {
    const kd_config *c = L->cfg;
    char base[128], n[512];
    snprintf(base, sizeof base, "%smodel.layers.%d.", c->prefix, l);
    int64_t H = c->n_heads, qk = c->qk_nope_dim + c->qk_rope_dim;
#define NAME(s) (snprintf(n, sizeof n, "%s%s", base, s), n)
    KD_TRY(bind_dense(L, &ly->attn_norm, K_NORM, NAME("input_layernorm.weight"), c->hidden, 0));
    KD_TRY(bind_dense(L, &ly->ffn_norm, K_NORM, NAME("post_attention_layernorm.weight"), c->hidden, 0));
    if (c->q_lora_rank > 0) {
        KD_TRY(bind_linear(L, &ly->q_a, K_ATTN, NAME("self_attn.q_a_proj"), c->q_lora_rank, c->hidden));
        KD_TRY(bind_dense(L, &ly->q_a_norm, K_ATTN, NAME("self_attn.q_a_layernorm.weight"), c->q_lora_rank, 0));
        KD_TRY(bind_linear(L, &ly->q_b, K_ATTN, NAME("self_attn.q_b_proj"), H * qk, c->q_lora_rank));
    } else {
        KD_TRY(bind_linear(L, &ly->q_proj, K_ATTN, NAME("self_attn.q_proj"), H * qk, c->hidden));
    }
    KD_TRY(bind_linear(L, &ly->kv_a, K_ATTN, NAME("self_attn.kv_a_proj_with_mqa"), c->kv_lora_rank + c->qk_rope_dim, c->hidden));
    KD_TRY(bind_dense(L, &ly->kv_a_norm, K_ATTN, NAME("self_attn.kv_a_layernorm.weight"), c->kv_lora_rank, 0));
    KD_TRY(bind_linear(L, &ly->kv_b, K_ATTN, NAME("self_attn.kv_b_proj"), H * (c->qk_nope_dim + c->v_head_dim), c->kv_lora_rank));
    KD_TRY(bind_linear(L, &ly->o_proj, K_ATTN, NAME("self_attn.o_proj"), c->hidden, H * c->v_head_dim));
    ly->is_moe = l >= c->first_k_dense;   /* HF: layer_idx >= first_k_dense_replace (moe_layer_freq unused) */
    if (!ly->is_moe) {
        KD_TRY(bind_linear(L, &ly->mlp_gate, K_DENSE, NAME("mlp.gate_proj"), c->intermediate, c->hidden));
        KD_TRY(bind_linear(L, &ly->mlp_up, K_DENSE, NAME("mlp.up_proj"), c->intermediate, c->hidden));
        KD_TRY(bind_linear(L, &ly->mlp_down, K_DENSE, NAME("mlp.down_proj"), c->hidden, c->intermediate));
        return KD_OK;
    }
    int E = c->n_experts;
    int64_t I = c->moe_intermediate;
    KD_TRY(bind_dense(L, &ly->router, K_ROUTER, NAME("mlp.gate.weight"), E, c->hidden));
    /* e_score_correction_bias: f32 for the router (selection only) */
    {
        const kd_st_tensor *t;
        KD_TRY(find(L, NAME("mlp.gate.e_score_correction_bias"), "F32 [n_routed_experts]", &t));
        if (t->dtype != KD_ST_F32 && t->dtype != KD_ST_BF16 && t->dtype != KD_ST_F16)
            return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype F32 (or BF16/F16), got %s", file_of(L, t), n,
                           t->dtype_name);
        KD_TRY(check_shape(L, t, 1, E, 0));
        L->bytes[K_ROUTER] += t->nbytes;
        L->n_used++;
        if (L->m) {
            kd_weight *w = &ly->router_bias;
            memset(w, 0, sizeof *w);
            w->format = KD_W_F32;
            w->rows = E;
            w->cols = 1;
            KD_TRY(as_f32(t, &w->src));
            w->name = t->name;
            KD_TRY(backend_load(L, w));
            void *dev = NULL;
            KD_TRY(L->be->ops->alloc(L->be, (size_t)E * sizeof(float), &dev));
            ly->experts.bias = dev;
            KD_TRY(L->be->ops->upload(L->be, dev, w->src, (size_t)E * sizeof(float)));
        }
    }
    if (c->n_shared_experts > 0) {
        int64_t S = (int64_t)c->n_shared_experts * I;
        KD_TRY(bind_linear(L, &ly->mlp_gate, K_SHARED, NAME("mlp.shared_experts.gate_proj"), S, c->hidden));
        KD_TRY(bind_linear(L, &ly->mlp_up, K_SHARED, NAME("mlp.shared_experts.up_proj"), S, c->hidden));
        KD_TRY(bind_linear(L, &ly->mlp_down, K_SHARED, NAME("mlp.shared_experts.down_proj"), c->hidden, S));
    }
    kd_experts *e = &ly->experts;
    if (L->m) {
        e->n = E;
        e->top_k = c->n_experts_per_tok;
        e->n_group = c->n_group;
        e->topk_group = c->topk_group;
        e->norm_topk_prob = c->norm_topk_prob;
        e->routed_scaling_factor = c->routed_scaling_factor;
        e->gate = calloc((size_t)E, sizeof *e->gate);
        e->up = calloc((size_t)E, sizeof *e->up);
        e->down = calloc((size_t)E, sizeof *e->down);
        if (!e->gate || !e->up || !e->down) return kd_fail(KD_ERR_NOMEM, "%s: layer %d: cannot allocate the expert table", L->dir, l);
    }
    uint64_t before = L->bytes[K_ROUTED];
    kd_weight scratch;   /* check-only walks bind into nothing (bind_* leave it untouched) */
    for (int j = 0; j < E; j++) {
        char m[256];
        kd_weight *g = L->m ? &e->gate[j] : &scratch, *u = L->m ? &e->up[j] : &scratch, *d = L->m ? &e->down[j] : &scratch;
        snprintf(m, sizeof m, "mlp.experts.%d.gate_proj", j);
        KD_TRY(bind_linear(L, g, K_ROUTED, NAME(m), I, c->hidden));
        snprintf(m, sizeof m, "mlp.experts.%d.up_proj", j);
        KD_TRY(bind_linear(L, u, K_ROUTED, NAME(m), I, c->hidden));
        snprintf(m, sizeof m, "mlp.experts.%d.down_proj", j);
        KD_TRY(bind_linear(L, d, K_ROUTED, NAME(m), c->hidden, I));
    }
    L->routed_read += (L->bytes[K_ROUTED] - before) * (uint64_t)c->n_experts_per_tok / (uint64_t)E;
    if (L->m) {
        e->router = &ly->router;   /* set: experts_load has run (kd_model_close calls experts_free) */
        kd_status st = L->be->ops->experts_load(L->be, e);
        if (st != KD_OK) { e->router = NULL; return kd_fail_context(st, "%s: layer %d: loading the experts", L->dir, l); }
    }
#undef NAME
    return KD_OK;
}

static kd_status bind_model(loader *L) {
    const kd_config *c = L->cfg;
    kd_model *m = L->m;
    char n[256];
    snprintf(n, sizeof n, "%smodel.embed_tokens.weight", c->prefix);
    kd_weight scratch;
    KD_TRY(bind_dense(L, m ? &m->embed : &scratch, K_EMBED, n, c->vocab, c->hidden));
    {
        const kd_st_tensor *t = kd_st_find(L->set, n);
        L->embed_row = t->nbytes / (uint64_t)c->vocab;
    }
    for (int l = 0; l < c->n_layers; l++) {
        kd_layer scratch_layer;
        kd_layer *ly = m ? &m->layers[l] : &scratch_layer;
        if (!m) memset(ly, 0, sizeof *ly);
        KD_TRY(bind_layer(L, l, ly));
    }
    snprintf(n, sizeof n, "%smodel.norm.weight", c->prefix);
    KD_TRY(bind_dense(L, m ? &m->final_norm : &scratch, K_NORM, n, c->hidden, 0));
    if (c->tie_embeddings) {
        if (m) m->lm_head = m->embed;   /* shares the embedding's backend form; freed once */
    } else {
        snprintf(n, sizeof n, "%slm_head", c->prefix);
        KD_TRY(bind_linear(L, m ? &m->lm_head : &scratch, K_LMHEAD, n, c->vocab, c->hidden));
    }
    return KD_OK;
}

/* ---- freeing ---- */

static void free_weight(kd_model *m, kd_weight *w) {
    if (!w->name) return;
    if (m->be) m->be->ops->weight_free(m->be, w);
    if (w->src && !in_mapping(&m->files, w->src)) free((void *)w->src);
    if (w->src_scale && !in_mapping(&m->files, w->src_scale)) free((void *)w->src_scale);
    memset(w, 0, sizeof *w);
}

static void free_model(kd_model *m) {
    if (!m) return;
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layers; l++) {
            kd_layer *ly = &m->layers[l];
            kd_experts *e = &ly->experts;
            if (e->router && m->be) m->be->ops->experts_free(m->be, e);
            e->router = NULL;
            for (int j = 0; j < e->n; j++) {
                if (e->gate) free_weight(m, &e->gate[j]);
                if (e->up) free_weight(m, &e->up[j]);
                if (e->down) free_weight(m, &e->down[j]);
            }
            free(e->gate);
            free(e->up);
            free(e->down);
            if (e->bias && m->be) m->be->ops->free(m->be, (void *)e->bias);
            kd_weight *ws[] = {&ly->attn_norm, &ly->ffn_norm, &ly->q_a, &ly->q_a_norm, &ly->q_b, &ly->q_proj,
                               &ly->kv_a, &ly->kv_a_norm, &ly->kv_b, &ly->o_proj, &ly->mlp_gate, &ly->mlp_up,
                               &ly->mlp_down, &ly->router, &ly->router_bias};
            for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) free_weight(m, ws[i]);
        }
        free(m->layers);
    }
    if (!m->cfg.tie_embeddings) free_weight(m, &m->lm_head);   /* tied: a copy of embed */
    free_weight(m, &m->embed);
    free_weight(m, &m->final_norm);
    if (m->rope_inv_freq && m->be) m->be->ops->free(m->be, m->rope_inv_freq);
    if (m->be) m->be->ops->destroy(m->be);
    kd_st_close(&m->files);
    kd_config_free(&m->cfg);
    free(m);
}

/* ---- public ---- */

kd_status kd_model_load_weights(kd_model *m) {
    if (!m || !m->be) return kd_fail(KD_ERR_ARG, "kd_model_load_weights: model and backend must be set");
    m->layers = calloc((size_t)m->cfg.n_layers, sizeof *m->layers);
    if (!m->layers) return kd_fail(KD_ERR_NOMEM, "%s: cannot allocate %d layers", m->dir, m->cfg.n_layers);
    loader L;
    KD_TRY(loader_init(&L, &m->cfg, &m->files, m->dir, m));
    kd_status st = bind_model(&L);
    loader_free_patterns(&L);
    if (st != KD_OK) return st;
    /* RoPE inverse frequencies on the backend */
    int half = m->cfg.qk_rope_dim / 2;
    float host[512];
    float *inv = half <= 512 ? host : malloc((size_t)half * sizeof(float));
    if (!inv) return kd_fail(KD_ERR_NOMEM, "%s: out of memory", m->dir);
    kd_rope_inv_freq(&m->cfg, m->cfg.qk_rope_dim, inv);
    void *dev = NULL;
    st = m->be->ops->alloc(m->be, (size_t)half * sizeof(float), &dev);
    if (st == KD_OK) {
        m->rope_inv_freq = dev;
        st = m->be->ops->upload(m->be, dev, inv, (size_t)half * sizeof(float));
    }
    if (inv != host) free(inv);
    if (st != KD_OK) return st;
    m->rope.dim = m->cfg.qk_rope_dim;
    m->rope.interleaved = true;
    m->rope.attn_factor = (float)m->cfg.rope.amp;
    m->rope.inv_freq = m->rope_inv_freq;
    return m->be->ops->sync(m->be);
}

kd_status kd_model_open(const char *dir, const kd_model_options *opt, kd_model **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_model_open: out must not be NULL");
    *out = NULL;
    if (!dir) return kd_fail(KD_ERR_ARG, "kd_model_open: dir must not be NULL");
    kd_model_options def = {KD_BACKEND_CPU, 0, 1};
    if (!opt) opt = &def;
    if (opt->backend != KD_BACKEND_CPU && opt->backend != KD_BACKEND_CUDA)
        return kd_fail(KD_ERR_ARG, "kd_model_open: options.backend is %d: expected KD_BACKEND_CPU (0) or KD_BACKEND_CUDA (1)",
                       (int)opt->backend);
    if (opt->n_devices > 1)
        return kd_fail(KD_ERR_UNSUPPORTED, "kd_model_open: options.n_devices is %d: tensor parallelism is not built yet (use 1)",
                       opt->n_devices);
    if (strlen(dir) >= sizeof ((kd_model *)0)->dir)
        return kd_fail(KD_ERR_ARG, "kd_model_open: directory path longer than %zu bytes", sizeof ((kd_model *)0)->dir - 1);
    kd_model *m = calloc(1, sizeof *m);
    if (!m) return kd_fail(KD_ERR_NOMEM, "kd_model_open: out of memory");
    snprintf(m->dir, sizeof m->dir, "%s", dir);
    kd_status st = kd_config_load(dir, &m->cfg);
    if (st == KD_OK) st = kd_st_open_dir(dir, true, &m->files);
    if (st == KD_OK) {
        if (opt->backend == KD_BACKEND_CPU) {
            st = kd_backend_cpu_create(&m->be);
        } else {
#ifdef KD_WITH_CUDA
            st = kd_backend_cuda_create(opt->device, &m->be);
#else
            st = kd_fail(KD_ERR_UNSUPPORTED, "kd_model_open: the CUDA backend is not compiled into this build (no nvcc)");
#endif
        }
    }
    if (st == KD_OK) st = kd_model_load_weights(m);
    if (st != KD_OK) {
        free_model(m);
        return st;
    }
    *out = m;
    return KD_OK;
}

void kd_model_close(kd_model *m) {
    if (!m) return;
    if (m->n_seqs > 0) { m->closing = true; return; }
    free_model(m);
}

void kd_model_unref(kd_model *m) {
    if (!m) return;
    if (m->n_seqs > 0) m->n_seqs--;
    if (m->closing && m->n_seqs == 0) free_model(m);
}

static uint64_t weight_bytes(const kd_weight *w) {
    if (!w->name) return 0;
    return kd_weight_bytes(w);
}

static void fill_info(const kd_config *c, kd_model_info *o) {
    memset(o, 0, sizeof *o);
    o->n_layers = c->n_layers;
    o->first_k_dense = c->first_k_dense;
    o->hidden = c->hidden;
    o->vocab = c->vocab;
    o->n_heads = c->n_heads;
    o->q_lora_rank = c->q_lora_rank;
    o->kv_lora_rank = c->kv_lora_rank;
    o->qk_nope_dim = c->qk_nope_dim;
    o->qk_rope_dim = c->qk_rope_dim;
    o->v_head_dim = c->v_head_dim;
    o->intermediate = c->intermediate;
    o->moe_intermediate = c->moe_intermediate;
    o->n_experts = c->n_experts;
    o->n_experts_per_tok = c->n_experts_per_tok;
    o->n_shared_experts = c->n_shared_experts;
    o->n_group = c->n_group;
    o->topk_group = c->topk_group;
    o->norm_topk_prob = c->norm_topk_prob;
    o->expert_bits = 16;
    o->expert_group = 0;
    o->max_positions = c->max_positions;
    o->rms_norm_eps = c->rms_norm_eps;
    o->routed_scaling_factor = c->routed_scaling_factor;
    o->rope_theta = (float)c->rope.theta;
    o->softmax_scale = c->softmax_scale;
    o->n_eos = c->n_eos;
    for (int i = 0; i < c->n_eos && i < 8; i++) o->eos[i] = c->eos[i];
    o->bos = c->bos;
}

/* experts are INT4 when the config quantizes and does not ignore the first MoE layer's expert 0 */
static void expert_format(const kd_config *c, const loader *L, kd_model_info *o) {
    if (!c->experts_int4 || c->first_k_dense >= c->n_layers) return;
    char mod[256];
    snprintf(mod, sizeof mod, "%smodel.layers.%d.mlp.experts.0.gate_proj", c->prefix, c->first_k_dense);
    if (is_quantized(L, mod)) { o->expert_bits = c->quant_bits; o->expert_group = c->quant_group; }
}

kd_status kd_model_get_info(const kd_model *m, kd_model_info *out) {
    if (!m || !out) return kd_fail(KD_ERR_ARG, "kd_model_get_info: model and out must not be NULL");
    fill_info(&m->cfg, out);
    out->backend = m->be ? m->be->kind : KD_BACKEND_CPU;
    /* which format the experts were loaded in */
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++)
        if (m->layers[l].is_moe && m->layers[l].experts.gate && m->layers[l].experts.gate[0].format == KD_W_INT4) {
            out->expert_bits = m->cfg.quant_bits;
            out->expert_group = m->layers[l].experts.gate[0].group;
            break;
        }
    uint64_t b = weight_bytes(&m->embed) + weight_bytes(&m->final_norm);
    if (!m->cfg.tie_embeddings) b += weight_bytes(&m->lm_head);
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
        const kd_layer *ly = &m->layers[l];
        const kd_weight *ws[] = {&ly->attn_norm, &ly->ffn_norm, &ly->q_a, &ly->q_a_norm, &ly->q_b, &ly->q_proj,
                                 &ly->kv_a, &ly->kv_a_norm, &ly->kv_b, &ly->o_proj, &ly->mlp_gate, &ly->mlp_up,
                                 &ly->mlp_down, &ly->router, &ly->router_bias};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) b += weight_bytes(ws[i]);
        for (int j = 0; ly->experts.gate && j < ly->experts.n; j++)
            b += weight_bytes(&ly->experts.gate[j]) + weight_bytes(&ly->experts.up[j]) + weight_bytes(&ly->experts.down[j]);
    }
    out->bytes_weights = b;
    return KD_OK;
}

kd_status kd_inspect(const char *dir, kd_inspect_report *out) {
    if (!dir || !out) return kd_fail(KD_ERR_ARG, "kd_inspect: dir and out must not be NULL");
    memset(out, 0, sizeof *out);
    kd_config cfg;
    KD_TRY(kd_config_load(dir, &cfg));
    kd_st_set set;
    kd_status st = kd_st_open_dir(dir, false, &set);
    if (st != KD_OK) { kd_config_free(&cfg); return st; }
    loader L;
    st = loader_init(&L, &cfg, &set, dir, NULL);
    if (st == KD_OK) {
        st = bind_model(&L);
        if (st == KD_OK) {
            const kd_config *c = &cfg;
            fill_info(c, &out->info);
            expert_format(c, &L, &out->info);
            out->info.backend = KD_BACKEND_CPU;
            out->n_tensors = set.n_tensors;
            out->n_files = set.n_files;
            out->n_skipped = set.n_tensors - L.n_used;
            out->bytes_attention = L.bytes[K_ATTN];
            out->bytes_dense_mlp = L.bytes[K_DENSE];
            out->bytes_shared_experts = L.bytes[K_SHARED];
            out->bytes_routed_experts = L.bytes[K_ROUTED];
            out->bytes_router = L.bytes[K_ROUTER];
            out->bytes_embed = L.bytes[K_EMBED];
            out->bytes_lm_head = L.bytes[K_LMHEAD];
            out->bytes_norms = L.bytes[K_NORM];
            uint64_t total = 0;
            for (int k = 0; k < K_N; k++) total += L.bytes[k];
            out->bytes_total = total;
            out->info.bytes_weights = total;
            out->bytes_per_token_kv = (uint64_t)c->n_layers * (uint64_t)(c->kv_lora_rank + c->qk_rope_dim) * 2u;
            /* one batch-1 decode step reads every weight once, except: of the embedding
             * table one row (the lm_head when tied reads it whole), of each MoE layer's
             * routed experts top_k of n */
            uint64_t rd = total - L.bytes[K_EMBED] - L.bytes[K_ROUTED] + L.routed_read;
            rd += c->tie_embeddings ? L.bytes[K_EMBED] : L.embed_row;
            out->bytes_read_per_token = rd;
        }
        loader_free_patterns(&L);
    }
    kd_st_close(&set);
    kd_config_free(&cfg);
    return st;
}
