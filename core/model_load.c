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
#include "plan.h"
#include "comm.h"
#include "error.h"

#include <regex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool kd_regex_translate(const char *py, char *out, size_t cap);   /* config.c */

/* byte classes of kd_inspect (kd_wkind, plan.h). attention: everything under self_attn (with the
 * q_a/kv_a latent norms, as kimi_k2.md counts it); norms: the per-layer input/post-attention norms
 * and the final norm */

/* bytes loaded per rank, for kd_model_options.progress: the ranks add as they load, the
 * thread that called kd_model_open (rank 0's) reports */
typedef struct load_progress {
    const kd_model_options *opt;
    _Atomic uint64_t done[KD_TP_MAX];
    uint64_t total[KD_TP_MAX];     /* each rank's part of the weights (a check-only walk) */
    uint64_t next;                 /* rank 0's bytes at which to report next */
} load_progress;

typedef struct loader {
    const kd_config *cfg;
    const kd_st_set *set;    /* NULL: no weight files (lookup makes the tensors the config implies) */
    const char *dir;
    kd_model *m;             /* NULL: check only (kd_inspect) */
    kd_backend *be;          /* the backend of the rank being bound */
    int rank, tp;            /* which part of a split weight it gets (model.h: kd_rank) */
    uint64_t part_bytes;     /* the bytes of this rank's parts (as kd_weight_bytes counts them) */
    load_progress *prog;     /* NULL: no progress to report */
    regex_t *re;             /* compiled ignore patterns (NULL entries: plain names) */
    bool *is_re;
    int n_pat;
    uint64_t bytes[KD_WK_N];    /* as stored */
    uint64_t rank_share[KD_WK_N], replicated[KD_WK_N];   /* kd_tally's rank and replicated */
    kd_st_tensor virt[3];       /* lookup's made tensors: an INT4 weight needs three at once */
    char virt_name[3][512];
    int next_virt;
    uint64_t routed_read;    /* routed expert bytes one token reads: per layer top_k / n of them */
    uint64_t embed_row;      /* one row of the embedding table */
    int n_used;
} loader;

/* ---- small helpers ---- */

static const char *file_of(const loader *L, const kd_st_tensor *t) {
    return L->set ? L->set->files[t->file].path : "(no weight files: the tensor config.json implies)";
}

static uint64_t st_dtype_size(kd_st_dtype dt) {
    return dt == KD_ST_I64 ? 8 : dt == KD_ST_F32 || dt == KD_ST_I32 ? 4 : 2;
}

/* the tensor `name` from the headers (NULL when absent), or, with no weight files, the one the
 * config implies: dtype dt, shape [d0] (ndim 1) or [d0, d1], no data */
static const kd_st_tensor *lookup(loader *L, const char *name, kd_st_dtype dt, int ndim, int64_t d0, int64_t d1) {
    if (L->set) return kd_st_find(L->set, name);
    int i = L->next_virt;
    L->next_virt = (i + 1) % 3;
    kd_st_tensor *t = &L->virt[i];
    memset(t, 0, sizeof *t);
    snprintf(L->virt_name[i], sizeof L->virt_name[i], "%s", name);
    t->name = L->virt_name[i];
    t->dtype = dt;
    snprintf(t->dtype_name, sizeof t->dtype_name, "%s", kd_st_dtype_name(dt));
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = ndim > 1 ? d1 : 0;
    t->nbytes = (uint64_t)d0 * (uint64_t)(ndim > 1 ? d1 : 1) * st_dtype_size(dt);
    t->file = -1;
    return t;
}

/* a tensor the walk used: its stored bytes, and one rank's share of the bytes its backend form
 * holds (split tensors: 1/tp of them, exact once kd_plan_check_tp passed) */
static void count(loader *L, kd_wkind kind, kd_split sp, uint64_t stored, uint64_t held) {
    L->bytes[kind] += stored;
    if (sp == KD_SPLIT_NONE) {
        L->rank_share[kind] += held;
        L->replicated[kind] += held;
    } else {
        L->rank_share[kind] += held / (uint64_t)L->tp;
    }
}

static void shape_str(char *buf, size_t cap, const int64_t *shape, int ndim) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (int i = 0; i < ndim && o < cap - 24; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    snprintf(buf + o, cap - o, "]");
}

static kd_status find(loader *L, const char *name, const char *expect, kd_st_dtype dt, int ndim, int64_t d0, int64_t d1,
                      const kd_st_tensor **out) {
    *out = lookup(L, name, dt, ndim, d0, d1);
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

/* A rank's part of a weight: rows [r0, r0+nr) and columns [c0, c0+nc) of a tensor `cols` wide. */
typedef struct part {
    int64_t r0, nr, c0, nc, cols;
} part;

/* the part's bytes (elements of esz bytes; for INT4 codes, words): a pointer into the mapping
 * with the tensor's row stride in *ld (0 when the part spans whole rows), or a packed private
 * copy of the part when the mapping places them unaligned */
static kd_status slice_src(const kd_st_tensor *t, size_t esz, const part *p, const void **out, int64_t *ld) {
    const char *b = (const char *)t->data + ((size_t)p->r0 * (size_t)p->cols + (size_t)p->c0) * esz;
    *ld = p->nc < p->cols ? p->cols : 0;
    if (((uintptr_t)b % esz) == 0) { *out = b; return KD_OK; }
    size_t row = (size_t)p->nc * esz, n = row * (size_t)p->nr;
    char *q = malloc(n ? n : 1);
    if (!q) return kd_fail(KD_ERR_NOMEM, "tensor '%s': cannot allocate %zu bytes", t->name, n);
    for (int64_t r = 0; r < p->nr; r++) memcpy(q + (size_t)r * row, b + (size_t)r * (size_t)p->cols * esz, row);
    *out = q;
    *ld = 0;
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

/* f32 form of the part of a BF16/F16 tensor (a packed copy), or of an F32 one (slice_src) */
static kd_status as_f32(const kd_st_tensor *t, const part *p, const void **out, int64_t *ld) {
    if (t->dtype == KD_ST_F32) return slice_src(t, 4, p, out, ld);
    uint64_t n = (uint64_t)p->nr * (uint64_t)p->nc;
    float *d = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!d) return kd_fail(KD_ERR_NOMEM, "tensor '%s': cannot allocate %llu floats", t->name, (unsigned long long)n);
    const unsigned char *s = t->data;
    for (int64_t r = 0; r < p->nr; r++)
        for (int64_t c = 0; c < p->nc; c++) {
            size_t i = (size_t)(p->r0 + r) * (size_t)p->cols + (size_t)(p->c0 + c);
            uint16_t h = (uint16_t)(s[2 * i] | s[2 * i + 1] << 8);
            union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
            d[(size_t)r * (size_t)p->nc + (size_t)c] = t->dtype == KD_ST_BF16 ? v.f : half_to_float(h);
        }
    *out = d;
    *ld = 0;
    return KD_OK;
}

/* the part of a [rows, cols] weight that rank L->rank holds (kd_model_open checked that tp
 * divides the split width) */
static part part_of(const loader *L, kd_split sp, int64_t rows, int64_t cols) {
    part p = {0, rows, 0, cols, cols};
    if (sp == KD_SPLIT_ROWS) { p.nr = rows / L->tp; p.r0 = p.nr * L->rank; }
    if (sp == KD_SPLIT_COLS) { p.nc = cols / L->tp; p.c0 = p.nc * L->rank; }
    return p;
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
    L->tp = 1;
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

static void report(load_progress *p, int n_ranks) {
    for (int r = 0; r < n_ranks; r++) p->opt->progress(p->opt->progress_ctx, r, atomic_load(&p->done[r]), p->total[r]);
}

static kd_status backend_load(loader *L, kd_weight *w) {
    kd_status st = L->be->ops->weight_load(L->be, w);
    load_progress *p = L->prog;
    if (st == KD_OK && p) {
        uint64_t done = atomic_fetch_add(&p->done[L->rank], kd_weight_bytes(w)) + kd_weight_bytes(w);
        if (L->rank == 0 && p->opt->progress && done >= p->next) {      /* about every 1% of rank 0's part */
            p->next = done + p->total[0] / 100 + 1;
            report(p, L->tp);
        }
    }
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
static kd_status bind_dense(loader *L, kd_weight *w, kd_wkind kind, const char *name, int64_t rows, int64_t cols) {
    const kd_st_tensor *t;
    char expect[96];
    if (cols) snprintf(expect, sizeof expect, "BF16 [%lld, %lld]", (long long)rows, (long long)cols);
    else snprintf(expect, sizeof expect, "BF16 or F32 [%lld]", (long long)rows);
    KD_TRY(find(L, name, expect, KD_ST_BF16, cols ? 2 : 1, rows, cols, &t));
    if (t->dtype != KD_ST_BF16 && t->dtype != KD_ST_F32 && t->dtype != KD_ST_F16)
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype BF16 (or F32/F16), got %s", file_of(L, t), name,
                       t->dtype_name);
    KD_TRY(check_shape(L, t, cols ? 2 : 1, rows, cols));
    /* held as loaded: BF16 as is, F32 as is, F16 widened to F32 (below) */
    kd_split sp = kd_split_of(name);
    count(L, kind, sp, t->nbytes, (uint64_t)rows * (uint64_t)(cols ? cols : 1) * (t->dtype == KD_ST_BF16 ? 2u : 4u));
    L->n_used++;
    part p = part_of(L, sp, rows, cols ? cols : 1);
    L->part_bytes += (uint64_t)p.nr * (uint64_t)p.nc * (t->dtype == KD_ST_BF16 ? 2u : 4u);   /* F16 is widened */
    if (!L->m) return KD_OK;
    memset(w, 0, sizeof *w);
    w->rows = p.nr;
    w->cols = p.nc;
    if (t->dtype == KD_ST_BF16) {
        w->format = KD_W_BF16;
        KD_TRY(slice_src(t, 2, &p, &w->src, &w->ld));
    } else {
        w->format = KD_W_F32;    /* F16 is widened to F32 once, here */
        KD_TRY(as_f32(t, &p, &w->src, &w->ld));
    }
    w->name = t->name;
    return backend_load(L, w);
}

/* compressed-tensors pack-quantized INT4: M.weight_packed / weight_scale / weight_shape */
static kd_status bind_int4(loader *L, kd_weight *w, kd_wkind kind, const char *module, int64_t rows, int64_t cols) {
    int g = L->cfg->quant_group;
    char np[512], ns[512], nsh[512], expect[160];
    snprintf(np, sizeof np, "%s.weight_packed", module);
    snprintf(ns, sizeof ns, "%s.weight_scale", module);
    snprintf(nsh, sizeof nsh, "%s.weight_shape", module);
    const kd_st_tensor *tp = lookup(L, np, KD_ST_I32, 2, rows, cols / 8), *ts, *tsh;
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
    KD_TRY(find(L, ns, expect, KD_ST_BF16, 2, rows, cols / g, &ts));
    if (ts->dtype != KD_ST_BF16)
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype BF16, got %s", file_of(L, ts), ns, ts->dtype_name);
    KD_TRY(check_shape(L, ts, 2, rows, cols / g));
    KD_TRY(find(L, nsh, "I64 [2] = [out, in]", KD_ST_I64, 1, 2, 0, &tsh));
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
    kd_split sp = kd_split_of(module);
    if (L->tp > 1 && sp == KD_SPLIT_COLS && (cols % L->tp || (cols / L->tp) % g || (cols / L->tp) % 8))
        return kd_fail(KD_ERR_ARG, "%s: INT4 tensor '%s' [%lld, %lld]: tp %d cannot split its %lld input columns into "
                       "whole scale groups of %d (and whole 8-code words)", file_of(L, tp), np, (long long)rows,
                       (long long)cols, L->tp, (long long)cols, g);
    /* no backend keeps weight_shape */
    count(L, kind, sp, tp->nbytes + ts->nbytes + tsh->nbytes, tp->nbytes + ts->nbytes);
    L->n_used += 3;
    part p = part_of(L, sp, rows, cols);
    L->part_bytes += (uint64_t)p.nr * (uint64_t)p.nc / 2 + (uint64_t)p.nr * (uint64_t)(p.nc / g) * 2;
    if (!L->m) return KD_OK;
    memset(w, 0, sizeof *w);
    w->format = KD_W_INT4;
    w->rows = p.nr;
    w->cols = p.nc;
    w->group = g;
    w->name = tp->name;
    part pc = {p.r0, p.nr, p.c0 / 8, p.nc / 8, cols / 8}, ps = {p.r0, p.nr, p.c0 / g, p.nc / g, cols / g};
    int64_t ld_codes = 0, ld_scales = 0;
    kd_status st = slice_src(tp, 4, &pc, &w->src, &ld_codes);
    if (st == KD_OK) st = slice_src(ts, 2, &ps, &w->src_scale, &ld_scales);
    /* one stride in elements for both; a part copied out of an unaligned mapping is packed in both */
    if (st == KD_OK && (ld_codes == 0) != (ld_scales == 0)) {
        if (w->src_scale && !in_mapping(L->set, w->src_scale)) free((void *)w->src_scale);
        w->src_scale = NULL;
        st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': its codes and scales are aligned differently in the mapping",
                     file_of(L, ts), ns);
    }
    w->ld = ld_codes ? cols : 0;
    if (st != KD_OK) {
        if (w->src && !in_mapping(L->set, w->src)) free((void *)w->src);
        memset(w, 0, sizeof *w);
        return st;
    }
    return backend_load(L, w);
}

/* an nn.Linear [out = rows, in = cols]: INT4 or dense, by the quantization config */
static kd_status bind_linear(loader *L, kd_weight *w, kd_wkind kind, const char *module, int64_t rows, int64_t cols) {
    if (is_quantized(L, module)) return bind_int4(L, w, kind, module, rows, cols);
    char name[512];
    snprintf(name, sizeof name, "%s.weight", module);
    if (L->set && !kd_st_find(L->set, name)) {
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
    KD_TRY(bind_dense(L, &ly->attn_norm, KD_WK_NORM, NAME("input_layernorm.weight"), c->hidden, 0));
    KD_TRY(bind_dense(L, &ly->ffn_norm, KD_WK_NORM, NAME("post_attention_layernorm.weight"), c->hidden, 0));
    if (c->q_lora_rank > 0) {
        KD_TRY(bind_linear(L, &ly->q_a, KD_WK_ATTN, NAME("self_attn.q_a_proj"), c->q_lora_rank, c->hidden));
        KD_TRY(bind_dense(L, &ly->q_a_norm, KD_WK_ATTN, NAME("self_attn.q_a_layernorm.weight"), c->q_lora_rank, 0));
        KD_TRY(bind_linear(L, &ly->q_b, KD_WK_ATTN, NAME("self_attn.q_b_proj"), H * qk, c->q_lora_rank));
    } else {
        KD_TRY(bind_linear(L, &ly->q_proj, KD_WK_ATTN, NAME("self_attn.q_proj"), H * qk, c->hidden));
    }
    KD_TRY(bind_linear(L, &ly->kv_a, KD_WK_ATTN, NAME("self_attn.kv_a_proj_with_mqa"), c->kv_lora_rank + c->qk_rope_dim, c->hidden));
    KD_TRY(bind_dense(L, &ly->kv_a_norm, KD_WK_ATTN, NAME("self_attn.kv_a_layernorm.weight"), c->kv_lora_rank, 0));
    KD_TRY(bind_linear(L, &ly->kv_b, KD_WK_ATTN, NAME("self_attn.kv_b_proj"), H * (c->qk_nope_dim + c->v_head_dim), c->kv_lora_rank));
    KD_TRY(bind_linear(L, &ly->o_proj, KD_WK_ATTN, NAME("self_attn.o_proj"), c->hidden, H * c->v_head_dim));
    ly->is_moe = l >= c->first_k_dense;   /* HF: layer_idx >= first_k_dense_replace (moe_layer_freq unused) */
    if (!ly->is_moe) {
        KD_TRY(bind_linear(L, &ly->mlp_gate, KD_WK_DENSE, NAME("mlp.gate_proj"), c->intermediate, c->hidden));
        KD_TRY(bind_linear(L, &ly->mlp_up, KD_WK_DENSE, NAME("mlp.up_proj"), c->intermediate, c->hidden));
        KD_TRY(bind_linear(L, &ly->mlp_down, KD_WK_DENSE, NAME("mlp.down_proj"), c->hidden, c->intermediate));
        return KD_OK;
    }
    int E = c->n_experts;
    int64_t I = c->moe_intermediate;
    KD_TRY(bind_dense(L, &ly->router, KD_WK_ROUTER, NAME("mlp.gate.weight"), E, c->hidden));
    /* e_score_correction_bias: f32 for the router (selection only) */
    {
        const kd_st_tensor *t;
        KD_TRY(find(L, NAME("mlp.gate.e_score_correction_bias"), "F32 [n_routed_experts]", KD_ST_F32, 1, E, 0, &t));
        if (t->dtype != KD_ST_F32 && t->dtype != KD_ST_BF16 && t->dtype != KD_ST_F16)
            return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype F32 (or BF16/F16), got %s", file_of(L, t), n,
                           t->dtype_name);
        KD_TRY(check_shape(L, t, 1, E, 0));
        count(L, KD_WK_ROUTER, KD_SPLIT_NONE, t->nbytes, (uint64_t)E * sizeof(float));   /* held as F32 */
        L->n_used++;
        L->part_bytes += (uint64_t)E * 4;
        if (L->m) {
            kd_weight *w = &ly->router_bias;
            memset(w, 0, sizeof *w);
            w->format = KD_W_F32;
            w->rows = E;
            w->cols = 1;
            part whole = {0, E, 0, 1, 1};
            KD_TRY(as_f32(t, &whole, &w->src, &w->ld));
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
        KD_TRY(bind_linear(L, &ly->mlp_gate, KD_WK_SHARED, NAME("mlp.shared_experts.gate_proj"), S, c->hidden));
        KD_TRY(bind_linear(L, &ly->mlp_up, KD_WK_SHARED, NAME("mlp.shared_experts.up_proj"), S, c->hidden));
        KD_TRY(bind_linear(L, &ly->mlp_down, KD_WK_SHARED, NAME("mlp.shared_experts.down_proj"), c->hidden, S));
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
    uint64_t before = L->bytes[KD_WK_ROUTED];
    kd_weight scratch;   /* check-only walks bind into nothing (bind_* leave it untouched) */
    for (int j = 0; j < E; j++) {
        char m[256];
        kd_weight *g = L->m ? &e->gate[j] : &scratch, *u = L->m ? &e->up[j] : &scratch, *d = L->m ? &e->down[j] : &scratch;
        snprintf(m, sizeof m, "mlp.experts.%d.gate_proj", j);
        KD_TRY(bind_linear(L, g, KD_WK_ROUTED, NAME(m), I, c->hidden));
        snprintf(m, sizeof m, "mlp.experts.%d.up_proj", j);
        KD_TRY(bind_linear(L, u, KD_WK_ROUTED, NAME(m), I, c->hidden));
        snprintf(m, sizeof m, "mlp.experts.%d.down_proj", j);
        KD_TRY(bind_linear(L, d, KD_WK_ROUTED, NAME(m), c->hidden, I));
    }
    L->routed_read += (L->bytes[KD_WK_ROUTED] - before) * (uint64_t)c->n_experts_per_tok / (uint64_t)E;
    if (L->m) {
        e->router = &ly->router;   /* set: experts_load has run (kd_model_close calls experts_free) */
        kd_status st = L->be->ops->experts_load(L->be, e);
        if (st != KD_OK) { e->router = NULL; return kd_fail_context(st, "%s: layer %d: loading the experts", L->dir, l); }
    }
#undef NAME
    return KD_OK;
}

/* the walk for rank L->rank (m NULL: check only) */
static kd_status bind_model(loader *L) {
    const kd_config *c = L->cfg;
    kd_rank *R = L->m ? &L->m->ranks[L->rank] : NULL;
    char n[256];
    snprintf(n, sizeof n, "%smodel.embed_tokens.weight", c->prefix);
    kd_weight scratch;
    KD_TRY(bind_dense(L, R ? &R->embed : &scratch, KD_WK_EMBED, n, c->vocab, c->hidden));
    L->embed_row = L->bytes[KD_WK_EMBED] / (uint64_t)c->vocab;   /* the walk's first tensor */
    for (int l = 0; l < c->n_layers; l++) {
        kd_layer scratch_layer;
        kd_layer *ly = R ? &R->layers[l] : &scratch_layer;
        if (!R) memset(ly, 0, sizeof *ly);
        KD_TRY(bind_layer(L, l, ly));
    }
    snprintf(n, sizeof n, "%smodel.norm.weight", c->prefix);
    KD_TRY(bind_dense(L, R ? &R->final_norm : &scratch, KD_WK_NORM, n, c->hidden, 0));
    if (c->tie_embeddings) {
        /* the embedding's form, its rows of this rank's vocabulary (never freed on its own) */
        if (R) {
            part p = part_of(L, KD_SPLIT_ROWS, c->vocab, c->hidden);
            size_t off = (size_t)p.r0 * (size_t)c->hidden * (R->embed.format == KD_W_F32 ? 4 : 2);
            R->lm_head = R->embed;
            R->lm_head.rows = p.nr;
            R->lm_head.src = (const char *)R->embed.src + off;
            if (R->embed.dev) R->lm_head.dev = (char *)R->embed.dev + off;
        }
    } else {
        snprintf(n, sizeof n, "%slm_head", c->prefix);
        KD_TRY(bind_linear(L, R ? &R->lm_head : &scratch, KD_WK_LMHEAD, n, c->vocab, c->hidden));
    }
    return KD_OK;
}

/* ---- freeing ---- */

static void free_weight(kd_model *m, kd_backend *be, kd_weight *w) {
    if (!w->name) return;
    if (be) be->ops->weight_free(be, w);
    if (w->src && !in_mapping(&m->files, w->src)) free((void *)w->src);
    if (w->src_scale && !in_mapping(&m->files, w->src_scale)) free((void *)w->src_scale);
    memset(w, 0, sizeof *w);
}

static void free_rank(kd_model *m, kd_rank *R) {
    kd_backend *be = R->be;
    if (R->layers) {
        for (int l = 0; l < m->cfg.n_layers; l++) {
            kd_layer *ly = &R->layers[l];
            kd_experts *e = &ly->experts;
            if (e->router && be) be->ops->experts_free(be, e);
            e->router = NULL;
            for (int j = 0; j < e->n; j++) {
                if (e->gate) free_weight(m, be, &e->gate[j]);
                if (e->up) free_weight(m, be, &e->up[j]);
                if (e->down) free_weight(m, be, &e->down[j]);
            }
            free(e->gate);
            free(e->up);
            free(e->down);
            if (e->bias && be) be->ops->free(be, (void *)e->bias);
            kd_weight *ws[] = {&ly->attn_norm, &ly->ffn_norm, &ly->q_a, &ly->q_a_norm, &ly->q_b, &ly->q_proj,
                               &ly->kv_a, &ly->kv_a_norm, &ly->kv_b, &ly->o_proj, &ly->mlp_gate, &ly->mlp_up,
                               &ly->mlp_down, &ly->router, &ly->router_bias};
            for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) free_weight(m, be, ws[i]);
        }
        free(R->layers);
    }
    if (!m->cfg.tie_embeddings) free_weight(m, be, &R->lm_head);   /* tied: a view of embed */
    free_weight(m, be, &R->embed);
    free_weight(m, be, &R->final_norm);
    if (R->rope_inv_freq && be) be->ops->free(be, R->rope_inv_freq);
    if (be) be->ops->destroy(be);
}

static void free_model(kd_model *m) {
    if (!m) return;
    kd_workers_stop(m);
    for (int r = 0; m->ranks && r < m->tp; r++) free_rank(m, &m->ranks[r]);
    free(m->ranks);
    if (m->comm) m->comm->ops->destroy(m->comm);
    kd_st_close(&m->files);
    kd_config_free(&m->cfg);
    free(m);
}

/* ---- public ---- */

/* the loader of rank r's part (m NULL: a check-only walk, which adds up part_bytes) */
static kd_status rank_loader(loader *L, kd_model *m, const kd_config *cfg, const kd_st_set *set, const char *dir,
                             int r, int tp) {
    KD_TRY(loader_init(L, cfg, set, dir, m));
    L->rank = r;
    L->tp = tp;
    return KD_OK;
}

/* rank r's weights and small buffers (RoPE table, router biases) on its backend */
static kd_status load_rank(kd_model *m, int r, load_progress *prog) {
    kd_rank *R = &m->ranks[r];
    R->layers = calloc((size_t)m->cfg.n_layers, sizeof *R->layers);
    if (!R->layers) return kd_fail(KD_ERR_NOMEM, "%s: cannot allocate %d layers", m->dir, m->cfg.n_layers);
    loader L;
    KD_TRY(rank_loader(&L, m, &m->cfg, &m->files, m->dir, r, m->tp));
    L.be = R->be;
    L.prog = prog;
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
    st = R->be->ops->alloc(R->be, (size_t)half * sizeof(float), &dev);
    if (st == KD_OK) {
        R->rope_inv_freq = dev;
        st = R->be->ops->upload(R->be, dev, inv, (size_t)half * sizeof(float));
    }
    if (inv != host) free(inv);
    if (st != KD_OK) return st;
    R->rope.dim = m->cfg.qk_rope_dim;
    R->rope.interleaved = true;
    R->rope.attn_factor = (float)m->cfg.rope.amp;
    R->rope.inv_freq = R->rope_inv_freq;
    return R->be->ops->sync(R->be);
}

typedef struct load_job {
    kd_model *m;
    load_progress *prog;
} load_job;

static kd_status load_job_run(void *ctx, int r) {
    load_job *j = ctx;
    return load_rank(j->m, r, j->prog);
}

/* every rank's part, the ranks in parallel on their threads (each reads only its slices of the
 * mapping); progress (when asked for) on the caller's thread */
static kd_status load_weights(kd_model *m, const kd_model_options *opt) {
    load_progress prog;
    memset(&prog, 0, sizeof prog);
    prog.opt = opt;
    for (int r = 0; opt->progress && r < m->tp; r++) {
        loader L;
        KD_TRY(rank_loader(&L, NULL, &m->cfg, &m->files, m->dir, r, m->tp));
        kd_status st = bind_model(&L);
        loader_free_patterns(&L);
        KD_TRY(st);
        prog.total[r] = L.part_bytes;
    }
    load_job job = {m, &prog};
    KD_TRY(kd_ranks_run(m, load_job_run, &job));
    if (opt->progress) report(&prog, m->tp);
    return KD_OK;
}

/* Refuse before any weight is read when a rank will not fit its device: the per-GPU plan
 * (kd_plan_tp) of the weights and the smallest sequence against the free memory of the rank's
 * device, shared evenly by the ranks that run on it. The CPU backend is not checked (host
 * memory is the operating system's to give). */
static kd_status check_fits(const kd_model *m, const kd_model_options *opt) {
    if (opt->backend == KD_BACKEND_CPU) return KD_OK;
    uint64_t avail = UINT64_MAX;
    for (int r = 0; r < m->tp; r++) {
        kd_backend *be = m->ranks[r].be;
        if (!be->ops->mem_usage) continue;
        kd_mem_usage u;
        memset(&u, 0, sizeof u);
        be->ops->mem_usage(be, &u);
        int sharing = 0;
        for (int q = 0; q < m->tp; q++) sharing += m->ranks[q].be->device == be->device;
        if (u.device_free / (uint64_t)sharing < avail) avail = u.device_free / (uint64_t)sharing;
    }
    if (avail == UINT64_MAX || avail == 0) return KD_OK;
    kd_plan_report rep;
    kd_status st = kd_plan_tp(&m->cfg, m->tp, avail, 1, &rep);
    return st == KD_OK ? KD_OK : kd_fail_context(st, "kd_model_open: %s", m->dir);
}

static kd_status open_backends(kd_model *m, const kd_model_options *opt) {
    for (int r = 0; r < m->tp; r++) {
        kd_rank *R = &m->ranks[r];
        if (opt->backend == KD_BACKEND_CPU) {
            KD_TRY(kd_backend_cpu_create(&R->be));
            continue;
        }
#ifdef KD_WITH_CUDA
        int dev = opt->n_device_list > 0 ? opt->devices[r] : r;
        kd_status st = kd_backend_cuda_create(dev, opt, &R->be);
        if (st != KD_OK && m->tp > 1) return kd_fail_context(st, "kd_model_open: rank %d of %d", r, m->tp);
        KD_TRY(st);
#else
        return kd_fail(KD_ERR_UNSUPPORTED, "kd_model_open: the CUDA backend is not compiled into this build (no nvcc)");
#endif
    }
    m->be = m->ranks[0].be;
    if (m->tp == 1) return KD_OK;
    if (opt->backend == KD_BACKEND_CPU) KD_TRY(kd_comm_cpu_create(m->tp, &m->comm));
    else {
        kd_backend *bes[KD_TP_MAX];
        int devs[KD_TP_MAX];
        for (int r = 0; r < m->tp; r++) {
            bes[r] = m->ranks[r].be;
            devs[r] = bes[r]->device;
        }
        KD_TRY(kd_comm_cuda_create(m->tp, devs, bes, &m->comm));
    }
    return kd_workers_start(m);
}

kd_status kd_model_open(const char *dir, const kd_model_options *opt, kd_model **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_model_open: out must not be NULL");
    *out = NULL;
    if (!dir) return kd_fail(KD_ERR_ARG, "kd_model_open: dir must not be NULL");
    kd_model_options def;
    memset(&def, 0, sizeof def);
    if (!opt) opt = &def;
    KD_TRY(kd_model_options_check(opt));
    int tp = opt->tp == 0 ? 1 : opt->tp;
    if (strlen(dir) >= sizeof ((kd_model *)0)->dir)
        return kd_fail(KD_ERR_ARG, "kd_model_open: directory path longer than %zu bytes", sizeof ((kd_model *)0)->dir - 1);
    kd_model *m = calloc(1, sizeof *m);
    if (!m) return kd_fail(KD_ERR_NOMEM, "kd_model_open: out of memory");
    snprintf(m->dir, sizeof m->dir, "%s", dir);
    m->opt = *opt;
    m->tp = tp;
    m->ranks = calloc((size_t)tp, sizeof *m->ranks);
    kd_status st = m->ranks ? kd_config_load(dir, &m->cfg) : kd_fail(KD_ERR_NOMEM, "kd_model_open: out of memory");
    if (st == KD_OK) {
        st = kd_plan_check_tp(&m->cfg, tp);
        if (st == KD_OK) m->split = kd_widths_of(&m->cfg, tp);
        else kd_fail_context(st, "kd_model_open: %s/config.json: options.tp", dir);
    }
    if (st == KD_OK) st = kd_st_open_dir(dir, true, &m->files);
    if (st == KD_OK) st = open_backends(m, opt);
    if (st == KD_OK) st = check_fits(m, opt);
    if (st == KD_OK) st = load_weights(m, opt);
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
    out->tp = m->tp;
    out->heads_per_rank = m->split.heads;
    out->intermediate_per_rank = m->split.intermediate;
    out->moe_intermediate_per_rank = m->split.moe_intermediate;
    out->vocab_per_rank = m->split.vocab;
    /* which format the experts were loaded in */
    const kd_rank *R0 = &m->ranks[0];
    for (int l = 0; R0->layers && l < m->cfg.n_layers; l++)
        if (R0->layers[l].is_moe && R0->layers[l].experts.gate && R0->layers[l].experts.gate[0].format == KD_W_INT4) {
            out->expert_bits = m->cfg.quant_bits;
            out->expert_group = R0->layers[l].experts.gate[0].group;
            break;
        }
    /* every rank's weights */
    uint64_t b = 0;
    for (int r = 0; r < m->tp; r++) {
        const kd_rank *R = &m->ranks[r];
        b += weight_bytes(&R->embed) + weight_bytes(&R->final_norm);
        if (!m->cfg.tie_embeddings) b += weight_bytes(&R->lm_head);
        for (int l = 0; R->layers && l < m->cfg.n_layers; l++) {
            const kd_layer *ly = &R->layers[l];
            const kd_weight *ws[] = {&ly->attn_norm, &ly->ffn_norm, &ly->q_a, &ly->q_a_norm, &ly->q_b, &ly->q_proj,
                                     &ly->kv_a, &ly->kv_a_norm, &ly->kv_b, &ly->o_proj, &ly->mlp_gate, &ly->mlp_up,
                                     &ly->mlp_down, &ly->router, &ly->router_bias};
            for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) b += weight_bytes(ws[i]);
            for (int j = 0; ly->experts.gate && j < ly->experts.n; j++)
                b += weight_bytes(&ly->experts.gate[j]) + weight_bytes(&ly->experts.up[j]) +
                     weight_bytes(&ly->experts.down[j]);
        }
    }
    out->bytes_weights = b;
    return KD_OK;
}

/* the walk without loading, over the headers (set) or the config alone (set NULL) */
static kd_status walk(loader *L, const kd_config *cfg, const kd_st_set *set, const char *dir, int tp) {
    KD_TRY(loader_init(L, cfg, set, dir, NULL));
    L->tp = tp;
    kd_status st = bind_model(L);
    if (st != KD_OK) loader_free_patterns(L);
    return st;
}

kd_status kd_weights_tally(const kd_config *cfg, const kd_st_set *set, const char *dir, int tp, kd_tally *out) {
    if (!cfg || !out || tp < 1) return kd_fail(KD_ERR_ARG, "kd_weights_tally: cfg, out and tp >= 1 are required");
    memset(out, 0, sizeof *out);
    loader L;
    KD_TRY(walk(&L, cfg, set, dir ? dir : "(config)", tp));
    for (int k = 0; k < KD_WK_N; k++) {
        out->stored[k] = L.bytes[k];
        out->rank[k] = L.rank_share[k];
        out->replicated[k] = L.replicated[k];
    }
    out->routed_read = L.routed_read;
    out->embed_row = L.embed_row;
    out->n_used = L.n_used;
    loader_free_patterns(&L);
    return KD_OK;
}

kd_status kd_open_headers(const char *dir, kd_config *cfg, kd_st_set *set, bool *files) {
    memset(set, 0, sizeof *set);
    KD_TRY(kd_config_load(dir, cfg));
    *files = kd_st_dir_has_weights(dir);
    kd_status st = *files ? kd_st_open_dir(dir, false, set) : KD_OK;
    if (st != KD_OK) kd_config_free(cfg);
    return st;
}

/* Without weight files (a directory holding config.json only) the bytes come from the config's
 * dims and quantization_config: n_files is 0 and n_tensors counts the tensors the walk implied. */
kd_status kd_inspect(const char *dir, kd_inspect_report *out) {
    if (!dir || !out) return kd_fail(KD_ERR_ARG, "kd_inspect: dir and out must not be NULL");
    memset(out, 0, sizeof *out);
    kd_config cfg;
    kd_st_set set;
    bool files;
    KD_TRY(kd_open_headers(dir, &cfg, &set, &files));
    loader L;
    kd_status st = walk(&L, &cfg, files ? &set : NULL, dir, 1);
    if (st == KD_OK) {
        const kd_config *c = &cfg;
        fill_info(c, &out->info);
        expert_format(c, &L, &out->info);
        out->info.backend = KD_BACKEND_CPU;
        out->n_tensors = files ? set.n_tensors : L.n_used;
        out->n_files = set.n_files;
        out->n_skipped = out->n_tensors - L.n_used;
        out->bytes_attention = L.bytes[KD_WK_ATTN];
        out->bytes_dense_mlp = L.bytes[KD_WK_DENSE];
        out->bytes_shared_experts = L.bytes[KD_WK_SHARED];
        out->bytes_routed_experts = L.bytes[KD_WK_ROUTED];
        out->bytes_router = L.bytes[KD_WK_ROUTER];
        out->bytes_embed = L.bytes[KD_WK_EMBED];
        out->bytes_lm_head = L.bytes[KD_WK_LMHEAD];
        out->bytes_norms = L.bytes[KD_WK_NORM];
        uint64_t total = 0;
        for (int k = 0; k < KD_WK_N; k++) total += L.bytes[k];
        out->bytes_total = total;
        out->info.bytes_weights = total;
        out->bytes_per_token_kv = (uint64_t)c->n_layers * (uint64_t)(c->kv_lora_rank + c->qk_rope_dim) * 2u;
        /* one batch-1 decode step reads every weight once, except: of the embedding
         * table one row (the lm_head when tied reads it whole), of each MoE layer's
         * routed experts top_k of n */
        uint64_t rd = total - L.bytes[KD_WK_EMBED] - L.bytes[KD_WK_ROUTED] + L.routed_read;
        rd += c->tie_embeddings ? L.bytes[KD_WK_EMBED] : L.embed_row;
        out->bytes_read_per_token = rd;
        loader_free_patterns(&L);
    }
    kd_st_close(&set);
    kd_config_free(&cfg);
    return st;
}
