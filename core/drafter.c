/* drafter.c: the DFlash drafter: config, weights, per-sequence context cache, draft pass.
 *
 * A DFlash drafter (z-lab DFlashDraftModel) is a stack of Qwen3-style layers with no embedding
 * and no lm_head of its own: the block [bonus, MASK x (bs-1)] is embedded with the TARGET's table
 * and the drafter's normed output goes through the TARGET's lm_head. It is conditioned on the
 * target through "tap" features: the outputs of the target decoder layers target_layer_ids,
 * concatenated, projected by fc and normed by hidden_norm, then injected as K/V into every
 * drafter layer (that layer's k_proj/k_norm/RoPE and v_proj; no input_layernorm).
 *
 * The per-sequence state keeps, per layer, the K/V of the committed context (positions
 * 0..ctx_len-1) in rows [0, ctx_len) of a [capacity + bs] buffer; a draft pass writes the block's
 * K/V into rows [ctx_len, ctx_len + bs) and attends bidirectionally over all of them, so the block
 * is never part of the context (the reference's crop(start)). Context rows are added eagerly when
 * the target commits tokens (kd_draft_context_append), so a draft pass costs one block forward.
 *
 * Everything runs through backend ops (backend.h); docs/dflash.md documents format and numerics.
 *
 * Draft graphs (docs/architecture.md "Step graphs"): on a backend with the graph ops (CUDA) the
 * draft pass can run on a device-length path and be captured once per sequence as a graph
 * (graph_step.h): the context length, the block's ids and positions go up in one copy into
 * rank 0's in; the block's K/V rows are finished in scratch (kn, vt) and stored at rows *dlen.. with
 * store_rows_at; attention runs as attention_at over the whole cache (past = *dlen). The same
 * kernels on the same values as the host-length path, so the same bits. The mode is resolved
 * when the drafter is attached, from the sequence's draft_graphs option (kdtree.h: DEFAULT
 * follows the model's draft_graphs, else the sequence's graphs; OFF keeps the draft pass on the
 * host-length path). The context append stays eager (a variable number of rows per call). */
#include "drafter.h"
#include "comm.h"
#include "forward.h"
#include "graph_step.h"
#include "error.h"
#include "sample.h"
#include "json.h"
#include "config_read.h"
#include "sample_rule.h"
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { KD_DRAFT_MAX_TAPS = 16, KD_DRAFT_CHUNK = 64 };

typedef struct kd_dcfg {
    int n_layers, hidden, n_heads, n_kv_heads, head_dim, intermediate, block_size, mask_token_id;
    int n_taps, taps[KD_DRAFT_MAX_TAPS];
    int vocab;                  /* -1 when config.json omits vocab_size */
    int num_target_layers;      /* -1 when omitted */
    int max_positions;          /* 0 when omitted */
    float eps;
    kd_rope_params rope;        /* rotate-half over the full head dim (config_read.h) */
    int *window;                /* per layer: 0 = full attention, else sliding_window */
} kd_dcfg;

typedef struct kd_dlayer {
    kd_weight attn_norm, ffn_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, gate, up, down;
} kd_dlayer;

/* One rank's part of the drafter (at tp 1 the whole of it; docs/dflash.md "Several devices"): its
 * heads of q_proj, k_proj and v_proj and o_proj's matching input columns, its part of the MLP's
 * intermediate dim (gate / up rows, down's input columns), hidden / tp of fc's output rows; every
 * norm whole. */
typedef struct kd_drafter_rank {
    kd_backend *be;             /* the target rank's backend; NULL when inspecting */
    kd_weight fc, hidden_norm, norm;
    kd_dlayer *layers;
    float *inv_freq;            /* backend memory, head_dim/2 */
    kd_rope rope;
} kd_drafter_rank;

struct kd_drafter {
    kd_dcfg cfg;
    kd_model *target;           /* NULL: opened for inspection only (no weights loaded) */
    int tp;                     /* the target's ranks (1 when inspecting) */
    int heads, kv_heads, inter; /* one rank's widths: n_heads, n_kv_heads, intermediate over tp */
    kd_drafter_rank *ranks;     /* [tp] */
    kd_st_set files;
    bool files_open;
    char dir[1024];
    int n_seqs;                 /* sequences with this drafter attached */
    bool closed;                /* closed by its owner while sequences still use it */
};

/* One rank's per-sequence state. Per layer the K/V of its KV heads for the committed context
 * (rows [0, ctx_len)) and the block; the block's activations (o: the attention's and the MLP's
 * output, fp32 partial sums at tp > 1 as the target's, completed by the all-reduce); the inputs
 * on the backend; at tp > 1 its shard of the draft's logits and every rank's (the all-gather's
 * destination, rank 0 lays them side by side into the log-probs), and the same for fc's output. */
typedef struct kd_draft_rank {
    kd_act *k, *v;              /* per layer [cap + bs, kv_heads * head_dim], act dtype */
    void *scratch;              /* backend memory, carved into the views below */
    kd_act x, h, q, kt, att, o, m;   /* block activations (m: the MLP's silu(gate) * up) */
    kd_act f, fn;               /* context fusion, KD_DRAFT_CHUNK rows */
    kd_act kn, vt;              /* device-length path: the block's normed+roped K and its V */
    int32_t *in;                /* backend memory: [dlen | pad | ids | pos], see IN_* */
    int32_t *ids, *pos;         /* into in: max(bs, chunk) ints each */
    int32_t *host_in;           /* host image of in[0 .. in_pos(nid) + nid); rank 0's also stages the
                                   draft pass's inputs, which every rank uploads */
    void *gather_buf;           /* tp > 1: the one buffer of the four views below */
    kd_act shard;               /* [bs-1, vocab/tp] f32: this rank's logits */
    void *all;                  /* tp x [bs-1, vocab/tp] f32: every rank's */
    kd_act fpart;               /* [chunk, hidden/tp]: this rank's columns of fc's output */
    void *fall;                 /* tp x [chunk, hidden/tp]: every rank's */
} kd_draft_rank;

struct kd_draft_state {
    int ctx_len, cap;           /* committed context rows, capacity of the context */
    kd_draft_rank *rk;          /* [tp] */
    int nid;                    /* ints of ids / pos */
    kd_act logprobs;            /* rank 0: [bs-1, vocab] f32 */
    int32_t *argmax;            /* rank 0: bs-1 ids, kd_draft_argmax */
    int32_t bonus;              /* the root token of the last draft */
    bool have_logprobs;
    kd_graphs_mode graph_mode;  /* resolved at attach (forward.h); off at tp > 1 */
    bool graph_verbose;
    kd_graph_slot graph;        /* the captured draft pass */
};

/* layout of a rank's in (int32 indices): the length, then ids and pos on 64-byte boundaries */
enum { IN_DLEN = 0, IN_IDS = 16 };
static int in_pos(int nid) { return IN_IDS + ((nid + 15) & ~15); }

/* ------------------------------------------------------------------ config.json */

static const char *cfg_file(const char *dir, char *buf, size_t n) {
    snprintf(buf, n, "%s/config.json", dir);
    return buf;
}

/* a required integer in 1..hi */
static kd_status json_positive(const kd_cfg_ctx *c, const cJSON *o, const char *key, int hi, int *out) {
    return kd_cfg_int(c, o, key, true, 0, 1, hi, out);
}

/* HF DFlash default taps when dflash_config lacks target_layer_ids (z-lab build_target_layer_ids) */
static void default_taps(int n_target, int n_draft, kd_dcfg *c) {
    if (n_draft == 1) { c->n_taps = 1; c->taps[0] = n_target / 2; return; }
    c->n_taps = n_draft;
    double start = 1, span = (double)(n_target - 3) - start;
    for (int i = 0; i < n_draft; i++) c->taps[i] = (int)lround(start + i * span / (n_draft - 1));
}

static kd_status parse_config(const char *dir, kd_dcfg *c) {
    char file[1100];
    cfg_file(dir, file, sizeof file);
    memset(c, 0, sizeof *c);
    cJSON *root;
    kd_status jst = kd_json_load(file, &root, NULL);
    if (jst == KD_ERR_IO) return kd_fail_context(jst, "DFlash drafter (expected a drafter directory)");
    if (jst != KD_OK) return jst;
    kd_status st = KD_OK;
#define CK(expr) do { st = (expr); if (st != KD_OK) goto done; } while (0)
    const cJSON *arch = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    if (arch) {
        bool ok = false;
        const cJSON *a;
        cJSON_ArrayForEach(a, arch) if (cJSON_IsString(a) && !strcmp(a->valuestring, "DFlashDraftModel")) ok = true;
        if (!ok) {
            const cJSON *a0 = cJSON_IsArray(arch) ? cJSON_GetArrayItem(arch, 0) : NULL;
            char v[200];
            st = kd_fail(KD_ERR_CONFIG, "%s: field 'architectures': expected [\"DFlashDraftModel\"], got %s",
                         file, a0 ? kd_json_value_text(a0, v, sizeof v) : "something else");
            goto done;
        }
    }
    kd_cfg_ctx cc = {file, ""}, cd = {file, "dflash_config."};
    CK(json_positive(&cc, root, "hidden_size", 1 << 16, &c->hidden));
    CK(json_positive(&cc, root, "num_hidden_layers", 4096, &c->n_layers));
    CK(json_positive(&cc, root, "num_attention_heads", 4096, &c->n_heads));
    CK(kd_cfg_int(&cc, root, "num_key_value_heads", false, c->n_heads, INT_MIN, INT_MAX, &c->n_kv_heads));
    CK(json_positive(&cc, root, "intermediate_size", 1 << 20, &c->intermediate));
    CK(kd_cfg_int(&cc, root, "head_dim", false, c->hidden / c->n_heads, INT_MIN, 4096, &c->head_dim));
    CK(kd_cfg_int(&cc, root, "block_size", true, 0, INT_MIN, 1024, &c->block_size));
    CK(kd_cfg_int(&cc, root, "vocab_size", false, -1, 1, KD_SAMPLE_MAX_VOCAB, &c->vocab));
    CK(kd_cfg_int(&cc, root, "num_target_layers", false, -1, 1, 4096, &c->num_target_layers));
    CK(kd_cfg_int(&cc, root, "max_position_embeddings", false, 0, 64, 1 << 30, &c->max_positions));
    CK(kd_cfg_float(&cc, root, "rms_norm_eps", 1e-6, true, &c->eps));
    if (c->n_kv_heads <= 0 || c->n_heads % c->n_kv_heads) {
        st = kd_fail(KD_ERR_CONFIG, "%s: field 'num_key_value_heads': %d must be positive and divide "
                     "num_attention_heads %d", file, c->n_kv_heads, c->n_heads);
        goto done;
    }
    if (c->head_dim <= 0 || c->head_dim % 2) {
        st = kd_fail(KD_ERR_CONFIG, "%s: field 'head_dim': expected a positive even integer (RoPE pairs), got %d",
                     file, c->head_dim);
        goto done;
    }
    if (c->block_size < 2) {
        st = kd_fail(KD_ERR_CONFIG, "%s: field 'block_size': expected >= 2 (bonus + at least one drafted depth), "
                     "got %d", file, c->block_size);
        goto done;
    }
    CK(kd_cfg_one_of(&cc, root, "hidden_act", "silu", KD_ERR_UNSUPPORTED));
    const cJSON *bias = cJSON_GetObjectItemCaseSensitive(root, "attention_bias");
    if (bias && cJSON_IsTrue(bias)) {
        st = kd_fail(KD_ERR_UNSUPPORTED, "%s: field 'attention_bias': true is not supported (expected false)", file);
        goto done;
    }
    /* dflash_config */
    const cJSON *dc = cJSON_GetObjectItemCaseSensitive(root, "dflash_config");
    if (!dc || !cJSON_IsObject(dc)) {
        st = kd_fail(KD_ERR_CONFIG, "%s: field 'dflash_config' is missing (expected an object with "
                     "mask_token_id and target_layer_ids)", file);
        goto done;
    }
    /* in the target's vocabulary: check_target */
    CK(kd_cfg_int(&cd, dc, "mask_token_id", true, 0, 0, INT_MAX, &c->mask_token_id));
    const cJSON *tl = cJSON_GetObjectItemCaseSensitive(dc, "target_layer_ids");
    if (tl && !cJSON_IsNull(tl)) {
        int n = cJSON_IsArray(tl) ? cJSON_GetArraySize(tl) : -1;
        if (n < 1 || n > KD_DRAFT_MAX_TAPS) {
            st = kd_fail(KD_ERR_CONFIG, "%s: field 'dflash_config.target_layer_ids': expected a list of 1..%d "
                         "layer ids", file, KD_DRAFT_MAX_TAPS);
            goto done;
        }
        c->n_taps = n;
        for (int i = 0; i < n; i++) {
            /* in the target's layers: check_target */
            CK(kd_cfg_int_value(&cd, cJSON_GetArrayItem(tl, i), "target_layer_ids", i, 0, INT_MAX, &c->taps[i]));
        }
    } else {
        if (c->num_target_layers <= 0) {
            st = kd_fail(KD_ERR_CONFIG, "%s: field 'dflash_config.target_layer_ids' is missing and so is "
                         "'num_target_layers' (one of them is needed to pick the tap layers)", file);
            goto done;
        }
        if (c->n_layers > KD_DRAFT_MAX_TAPS) {
            st = kd_fail(KD_ERR_CONFIG, "%s: default tap layers for %d drafter layers: at most %d taps supported",
                         file, c->n_layers, KD_DRAFT_MAX_TAPS);
            goto done;
        }
        default_taps(c->num_target_layers, c->n_layers, c);
    }
    CK(kd_cfg_rope(&cc, root, c->max_positions, &c->rope));
    /* per-layer attention kind */
    c->window = calloc((size_t)c->n_layers, sizeof(int));
    if (!c->window) { st = kd_fail(KD_ERR_NOMEM, "%s: cannot allocate layer table", file); goto done; }
    int sw;
    CK(kd_cfg_int(&cc, root, "sliding_window", false, 0, 0, INT_MAX, &sw));
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
    if (lt && !cJSON_IsNull(lt)) {
        if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != c->n_layers) {
            st = kd_fail(KD_ERR_CONFIG, "%s: field 'layer_types': expected a list of %d entries (num_hidden_layers)",
                         file, c->n_layers);
            goto done;
        }
        for (int i = 0; i < c->n_layers; i++) {
            const cJSON *e = cJSON_GetArrayItem(lt, i);
            const char *s = cJSON_IsString(e) ? e->valuestring : "";
            if (!strcmp(s, "full_attention")) c->window[i] = 0;
            else if (!strcmp(s, "sliding_attention")) {
                if (sw <= 0) {
                    st = kd_fail(KD_ERR_CONFIG, "%s: field 'sliding_window': layer_types[%d] is sliding_attention "
                                 "but sliding_window is not a positive integer", file, i);
                    goto done;
                }
                c->window[i] = sw;
            } else {
                char v[200];
                st = kd_fail(KD_ERR_CONFIG, "%s: field 'layer_types[%d]' is %s: expected \"full_attention\" or "
                             "\"sliding_attention\"", file, i, kd_json_value_text(e, v, sizeof v));
                goto done;
            }
        }
    } else {
        /* Qwen3Config without layer_types: sliding from max_window_layers on when use_sliding_window */
        const cJSON *use = cJSON_GetObjectItemCaseSensitive(root, "use_sliding_window");
        if (use && cJSON_IsTrue(use)) {
            int mwl;
            CK(kd_cfg_int(&cc, root, "max_window_layers", false, 28, 0, INT_MAX, &mwl));
            if (sw <= 0) {
                st = kd_fail(KD_ERR_CONFIG, "%s: field 'sliding_window': use_sliding_window is true but "
                             "sliding_window is not a positive integer", file);
                goto done;
            }
            for (int i = 0; i < c->n_layers; i++) c->window[i] = i >= mwl ? sw : 0;
        }
    }
done:
#undef CK
    cJSON_Delete(root);
    if (st != KD_OK) { free(c->window); c->window = NULL; }
    return st;
}

/* the checks against the target model: everything the drafter borrows from it must fit */
static kd_status check_target(const char *dir, const kd_dcfg *c, const kd_model *m) {
    char file[1100];
    cfg_file(dir, file, sizeof file);
    const kd_config *t = &m->cfg;
    if (c->hidden != t->hidden)
        return kd_fail(KD_ERR_CONFIG, "%s: field 'hidden_size': drafter %d != target hidden_size %d (the drafter "
                       "uses the target's embedding and lm_head)", file, c->hidden, t->hidden);
    if (c->vocab >= 0 && c->vocab != t->vocab)
        return kd_fail(KD_ERR_CONFIG, "%s: field 'vocab_size': drafter %d != target vocab_size %d", file, c->vocab,
                       t->vocab);
    if (c->mask_token_id >= t->vocab)
        return kd_fail(KD_ERR_CONFIG, "%s: field 'dflash_config.mask_token_id': %d is outside the target "
                       "vocabulary [0, %d)", file, c->mask_token_id, t->vocab);
    if (c->num_target_layers >= 0 && c->num_target_layers != t->n_layers)
        return kd_fail(KD_ERR_CONFIG, "%s: field 'num_target_layers': drafter %d != target num_hidden_layers %d",
                       file, c->num_target_layers, t->n_layers);
    for (int i = 0; i < c->n_taps; i++) {
        if (c->taps[i] >= t->n_layers)
            return kd_fail(KD_ERR_CONFIG, "%s: field 'dflash_config.target_layer_ids[%d]': layer %d is out of "
                           "range for a target with %d layers (expected 0..%d)", file, i, c->taps[i],
                           t->n_layers, t->n_layers - 2);
        /* HF's hidden_states[n_layers] is the output AFTER the final norm, unlike every other tap
         * (a raw residual); no published drafter taps the last layer, so it is refused, not guessed */
        if (c->taps[i] == t->n_layers - 1)
            return kd_fail(KD_ERR_UNSUPPORTED, "%s: field 'dflash_config.target_layer_ids[%d]': layer %d is the "
                           "target's last layer, whose HF hidden state is taken after the final norm; taps on "
                           "it are not supported (expected 0..%d)", file, i, c->taps[i], t->n_layers - 2);
    }
    return KD_OK;
}

/* ------------------------------------------------------------------ weights */

typedef enum { WHOLE, ROWS, COLS } dsplit;   /* how a tensor splits over the ranks */

/* rank r's part of tensor `name` ([rows, cols]; cols 1: a vector) into w, loaded on its backend:
 * whole, rows [r rows/tp, +rows/tp), or columns [r cols/tp, +cols/tp) (a view with the tensor's
 * row stride in ld) */
static kd_status bind_weight(kd_drafter *d, int r, const char *name, int64_t rows, int64_t cols, dsplit sp,
                             kd_weight *w) {
    char alt[256];
    const kd_st_tensor *t = kd_st_find(&d->files, name);
    if (!t) {
        snprintf(alt, sizeof alt, "model.%s", name);
        t = kd_st_find(&d->files, alt);
    }
    if (!t)
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s' is missing (also tried 'model.%s')", d->dir, name, name);
    const char *file = d->files.files[t->file].path;
    if (t->dtype != KD_ST_BF16 && t->dtype != KD_ST_F32)
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected dtype BF16 or F32, got %s", file, t->name,
                       t->dtype_name);
    bool vec = cols == 1;
    bool ok = vec ? (t->ndim == 1 && t->shape[0] == rows)
                  : (t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols);
    if (!ok) {
        char got[128] = "[", *p = got + 1;
        for (int i = 0; i < t->ndim && p < got + sizeof got - 24; i++)
            p += snprintf(p, (size_t)(got + sizeof got - p), "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        snprintf(p, (size_t)(got + sizeof got - p), "]");
        if (vec)
            return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected shape [%lld], got %s", file, t->name,
                           (long long)rows, got);
        return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected shape [%lld, %lld], got %s", file, t->name,
                       (long long)rows, (long long)cols, got);
    }
    size_t esz = t->dtype == KD_ST_BF16 ? 2 : 4;
    memset(w, 0, sizeof *w);
    w->name = t->name;
    w->format = t->dtype == KD_ST_BF16 ? KD_W_BF16 : KD_W_F32;
    w->rows = rows;
    w->cols = cols;
    w->src = t->data;
    if (sp == ROWS && d->tp > 1) {
        w->rows = rows / d->tp;
        w->src = (const char *)t->data + (size_t)r * (size_t)w->rows * (size_t)cols * esz;
    } else if (sp == COLS && d->tp > 1) {
        w->cols = cols / d->tp;
        w->ld = cols;
        w->src = (const char *)t->data + (size_t)r * (size_t)w->cols * esz;
    }
    kd_backend *be = d->ranks[r].be;
    if (be) {
        kd_status st = be->ops->weight_load(be, w);
        if (st != KD_OK) return kd_fail_context(st, "%s: loading tensor '%s' (rank %d)", file, t->name, r);
    }
    return KD_OK;
}

static void free_weight(kd_backend *be, kd_weight *w) {
    if (be && w->dev) be->ops->weight_free(be, w);
    w->dev = NULL;
}

static kd_status load_weights(kd_drafter *d, int r) {
    const kd_dcfg *c = &d->cfg;
    kd_drafter_rank *R = &d->ranks[r];
    int64_t H = c->hidden, qd = (int64_t)c->n_heads * c->head_dim, kvd = (int64_t)c->n_kv_heads * c->head_dim;
    KD_TRY(bind_weight(d, r, "fc.weight", H, (int64_t)c->n_taps * H, ROWS, &R->fc));
    KD_TRY(bind_weight(d, r, "hidden_norm.weight", H, 1, WHOLE, &R->hidden_norm));
    KD_TRY(bind_weight(d, r, "norm.weight", H, 1, WHOLE, &R->norm));
    for (int i = 0; i < c->n_layers; i++) {
        kd_dlayer *L = &R->layers[i];
        char n[128];
#define W(field, suffix, rr, cc, sp) do { snprintf(n, sizeof n, "layers.%d.%s", i, suffix); \
        KD_TRY(bind_weight(d, r, n, rr, cc, sp, &L->field)); } while (0)
        W(attn_norm, "input_layernorm.weight", H, 1, WHOLE);
        W(ffn_norm, "post_attention_layernorm.weight", H, 1, WHOLE);
        W(q_proj, "self_attn.q_proj.weight", qd, H, ROWS);
        W(k_proj, "self_attn.k_proj.weight", kvd, H, ROWS);
        W(v_proj, "self_attn.v_proj.weight", kvd, H, ROWS);
        W(o_proj, "self_attn.o_proj.weight", H, qd, COLS);
        W(q_norm, "self_attn.q_norm.weight", c->head_dim, 1, WHOLE);
        W(k_norm, "self_attn.k_norm.weight", c->head_dim, 1, WHOLE);
        W(gate, "mlp.gate_proj.weight", c->intermediate, H, ROWS);
        W(up, "mlp.up_proj.weight", c->intermediate, H, ROWS);
        W(down, "mlp.down_proj.weight", H, c->intermediate, COLS);
#undef W
    }
    return KD_OK;
}

/* rank r's RoPE table (head_dim / 2 inverse frequencies) on its backend */
static kd_status load_rope(kd_drafter *d, int r) {
    kd_drafter_rank *R = &d->ranks[r];
    int half = d->cfg.head_dim / 2;
    float *host = malloc((size_t)half * sizeof(float));
    if (!host) return kd_fail(KD_ERR_NOMEM, "%s: cannot allocate RoPE table", d->dir);
    kd_rope_params_inv_freq(&d->cfg.rope, d->cfg.head_dim, host);
    kd_status st = R->be->ops->alloc(R->be, (size_t)half * sizeof(float), (void **)&R->inv_freq);
    if (st == KD_OK) st = R->be->ops->upload(R->be, R->inv_freq, host, (size_t)half * sizeof(float));
    free(host);
    if (st != KD_OK) return kd_fail_context(st, "%s: RoPE table (rank %d)", d->dir, r);
    R->rope = (kd_rope){.dim = d->cfg.head_dim, .interleaved = false, .attn_factor = (float)d->cfg.rope.amp,
                        .inv_freq = R->inv_freq};
    return KD_OK;
}

static void drafter_destroy(kd_drafter *d) {
    if (!d) return;
    for (int r = 0; d->ranks && r < d->tp; r++) {
        kd_drafter_rank *R = &d->ranks[r];
        if (R->layers) {
            for (int i = 0; i < d->cfg.n_layers; i++) {
                kd_dlayer *L = &R->layers[i];
                kd_weight *ws[] = {&L->attn_norm, &L->ffn_norm, &L->q_proj, &L->k_proj, &L->v_proj, &L->o_proj,
                                   &L->q_norm, &L->k_norm, &L->gate, &L->up, &L->down};
                for (size_t j = 0; j < sizeof ws / sizeof *ws; j++) free_weight(R->be, ws[j]);
            }
            free(R->layers);
        }
        free_weight(R->be, &R->fc);
        free_weight(R->be, &R->hidden_norm);
        free_weight(R->be, &R->norm);
        if (R->be && R->inv_freq) R->be->ops->free(R->be, R->inv_freq);
    }
    free(d->ranks);
    if (d->files_open) kd_st_close(&d->files);
    free(d->cfg.window);
    kd_model *m = d->target;
    free(d);
    if (m) kd_model_unref(m);        /* the reference kd_drafter_open took */
}

static bool file_exists(const char *dir, const char *name) {
    char p[1100];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, R_OK) == 0;
}

/* the widths split over the target's ranks (heads, KV heads, intermediate, fc's output rows), or
 * an error naming the field */
static kd_status check_split(const char *dir, const kd_dcfg *c, int tp) {
    char file[1100];
    cfg_file(dir, file, sizeof file);
    const struct { const char *field; int value; } w[] = {
        {"num_attention_heads", c->n_heads}, {"num_key_value_heads", c->n_kv_heads},
        {"intermediate_size", c->intermediate}, {"hidden_size", c->hidden}};
    for (size_t i = 0; i < sizeof w / sizeof *w; i++)
        if (w[i].value % tp)
            return kd_fail(KD_ERR_CONFIG, "%s: field '%s': %d does not split over the target's %d ranks (the "
                           "drafter's attention splits by heads, its MLP by the intermediate dim, fc by its output rows)", file, w[i].field,
                           w[i].value, tp);
    return KD_OK;
}

kd_status kd_drafter_open(const char *dir, kd_model *target, kd_drafter **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_drafter_open: argument 'out' is NULL");
    *out = NULL;
    if (!dir) return kd_fail(KD_ERR_ARG, "kd_drafter_open: argument 'dir' is NULL");
    kd_drafter *d = calloc(1, sizeof *d);
    if (!d) return kd_fail(KD_ERR_NOMEM, "kd_drafter_open(%s): cannot allocate the drafter", dir);
    snprintf(d->dir, sizeof d->dir, "%s", dir);
    d->tp = 1;
    kd_status st = parse_config(dir, &d->cfg);
    if (st != KD_OK) goto fail;
    if (target) {
        st = check_target(dir, &d->cfg, target);
        if (st == KD_OK) st = check_split(dir, &d->cfg, target->tp);
        if (st != KD_OK) goto fail;
        d->tp = target->tp;
    }
    d->heads = d->cfg.n_heads / d->tp;
    d->kv_heads = d->cfg.n_kv_heads / d->tp;
    d->inter = d->cfg.intermediate / d->tp;
    d->ranks = calloc((size_t)d->tp, sizeof *d->ranks);
    if (!d->ranks) { st = kd_fail(KD_ERR_NOMEM, "%s: cannot allocate %d ranks", dir, d->tp); goto fail; }
    for (int r = 0; r < d->tp; r++) {
        d->ranks[r].layers = calloc((size_t)d->cfg.n_layers, sizeof *d->ranks[r].layers);
        if (!d->ranks[r].layers) { st = kd_fail(KD_ERR_NOMEM, "%s: cannot allocate %d layers", dir, d->cfg.n_layers); goto fail; }
    }
    if (target) {
        d->target = target;
        target->n_seqs++;                /* the target outlives its drafter (model.h) */
        st = kd_st_open_dir(dir, true, &d->files);
        if (st != KD_OK) { kd_fail_context(st, "loading drafter %s", dir); goto fail; }
        d->files_open = true;
        for (int r = 0; r < d->tp && st == KD_OK; r++) {
            d->ranks[r].be = target->ranks[r].be;
            st = load_weights(d, r);
            if (st == KD_OK) st = load_rope(d, r);
        }
        if (st != KD_OK) goto fail;
    } else if (file_exists(dir, "model.safetensors") || file_exists(dir, "model.safetensors.index.json")) {
        /* inspection only: validate names, dtypes and shapes from the headers, load nothing */
        st = kd_st_open_dir(dir, false, &d->files);
        if (st != KD_OK) { kd_fail_context(st, "inspecting drafter %s", dir); goto fail; }
        d->files_open = true;
        st = load_weights(d, 0);
        if (st != KD_OK) goto fail;
    }
    *out = d;
    return KD_OK;
fail:
    drafter_destroy(d);
    return st;
}

void kd_drafter_close(kd_drafter *d) {
    if (!d) return;
    if (d->n_seqs > 0) { d->closed = true; return; }   /* freed when its last sequence lets go */
    drafter_destroy(d);
}

kd_status kd_drafter_get_info(const kd_drafter *d, kd_drafter_info *out) {
    if (!d || !out) return kd_fail(KD_ERR_ARG, "kd_drafter_get_info: argument '%s' is NULL", d ? "out" : "d");
    memset(out, 0, sizeof *out);
    const kd_dcfg *c = &d->cfg;
    out->n_layers = c->n_layers;
    out->hidden = c->hidden;
    out->n_heads = c->n_heads;
    out->n_kv_heads = c->n_kv_heads;
    out->head_dim = c->head_dim;
    out->intermediate = c->intermediate;
    out->block_size = c->block_size;
    out->mask_token_id = c->mask_token_id;
    out->n_taps = c->n_taps;
    for (int i = 0; i < c->n_taps; i++) out->taps[i] = c->taps[i];
    return KD_OK;
}

int kd_drafter_taps(const struct kd_drafter *d, const int **taps) {
    if (!d) { if (taps) *taps = NULL; return 0; }
    if (taps) *taps = d->cfg.taps;
    return d->cfg.n_taps;
}

/* ------------------------------------------------------------------ per-sequence state */

/* a [rows, cols] view's bytes, rounded up to 256 */
static size_t act_bytes(int rows, int cols, kd_dtype dt) {
    return ((size_t)rows * cols * kd_dtype_size(dt) + 255) & ~(size_t)255;
}

/* the view [rows, cols] at base + *off, and *off past it */
static kd_act act_at(void *base, size_t *off, int rows, int cols, kd_dtype dt) {
    kd_act a = {.data = (char *)base + *off, .rows = rows, .cols = cols, .ld = cols, .dtype = dt};
    *off += act_bytes(rows, cols, dt);
    return a;
}

/* rank r's buffers, and the target's tap features it keeps there */
static void rank_state_free(kd_seq *s, int r) {
    kd_draft_rank *k = &s->draft->rk[r];
    kd_backend *be = s->model->ranks[r].be;
    for (int i = 0; i < s->drafter->cfg.n_layers; i++) {
        if (k->k && k->k[i].data) be->ops->free(be, k->k[i].data);
        if (k->v && k->v[i].data) be->ops->free(be, k->v[i].data);
    }
    free(k->k);
    free(k->v);
    if (k->scratch) be->ops->free(be, k->scratch);
    if (k->in) be->ops->free(be, k->in);
    free(k->host_in);
    if (k->gather_buf) be->ops->free(be, k->gather_buf);
    kd_seq_rank *S = &s->rk[r];
    if (S->taps.data) be->ops->free(be, S->taps.data);
    memset(&S->taps, 0, sizeof S->taps);
}

void kd_draft_state_free(kd_seq *s) {
    if (!s || !s->draft) return;
    kd_draft_state *ds = s->draft;
    kd_drafter *d = s->drafter;
    kd_backend *be = s->model->be;
    kd_graph_slot_drop(s->model, &ds->graph);     /* before the buffers it points at */
    for (int r = 0; ds->rk && r < s->model->tp; r++) rank_state_free(s, r);
    free(ds->rk);
    if (ds->logprobs.data) be->ops->free(be, ds->logprobs.data);
    if (ds->argmax) be->ops->free(be, ds->argmax);
    free(ds);
    s->draft = NULL;
    s->drafter = NULL;
    if (d) {
        d->n_seqs--;
        if (d->closed && d->n_seqs == 0) drafter_destroy(d);
    }
}

/* rank r's state (struct kd_draft_rank) and its copy of the target's tap features, on its backend */
static kd_status rank_state_alloc(kd_seq *s, int r) {
    kd_drafter *d = s->drafter;
    const kd_dcfg *c = &d->cfg;
    kd_model *m = s->model;
    kd_backend *be = m->ranks[r].be;
    kd_draft_state *ds = s->draft;
    kd_draft_rank *k = &ds->rk[r];
    kd_dtype dt = be->act_dtype;
    kd_dtype pt = kd_partial_dtype(m->tp, dt);   /* o: partial sums at tp > 1 */
    int bs = c->block_size, H = c->hidden, kvd = d->kv_heads * c->head_dim, qd = d->heads * c->head_dim;
    int ch = KD_DRAFT_CHUNK, nid = ds->nid, rows_kt = bs > ch ? bs : ch;
    kd_status st;
#define CK(expr, fmt, ...) do { st = (expr); if (st != KD_OK) \
        return kd_fail_context(st, "kd_seq_attach_drafter: rank %d: " fmt, r, __VA_ARGS__); } while (0)
    k->k = calloc((size_t)c->n_layers, sizeof(kd_act));
    k->v = calloc((size_t)c->n_layers, sizeof(kd_act));
    if (!k->k || !k->v) return kd_fail(KD_ERR_NOMEM, "kd_seq_attach_drafter: cannot allocate layer tables");
    size_t rows = (size_t)ds->cap + bs, kv_bytes = rows * kvd * kd_dtype_size(dt);
    for (int i = 0; i < c->n_layers; i++) {
        CK(be->ops->alloc(be, kv_bytes, &k->k[i].data), "drafter K cache layer %d (%zu rows x %d)", i, rows, kvd);
        CK(be->ops->alloc(be, kv_bytes, &k->v[i].data), "drafter V cache layer %d (%zu rows x %d)", i, rows, kvd);
        k->k[i].rows = k->v[i].rows = (int)rows;
        k->k[i].cols = k->v[i].cols = k->k[i].ld = k->v[i].ld = kvd;
        k->k[i].dtype = k->v[i].dtype = dt;
    }
    /* scratch: block activations (bs rows) and context fusion (chunk rows) */
    size_t need = act_bytes(bs, H, dt) * 2 + act_bytes(bs, H, pt) + act_bytes(bs, qd, dt) * 2 +
                  act_bytes(rows_kt, kvd, dt) + act_bytes(bs, d->inter, dt) + act_bytes(ch, H, dt) * 2 +
                  act_bytes(bs, kvd, dt) * 2;
    CK(be->ops->alloc(be, need, &k->scratch), "scratch (%zu bytes)", need);
    size_t off = 0;
    k->x = act_at(k->scratch, &off, bs, H, dt);
    k->h = act_at(k->scratch, &off, bs, H, dt);
    k->o = act_at(k->scratch, &off, bs, H, pt);
    k->q = act_at(k->scratch, &off, bs, qd, dt);
    k->att = act_at(k->scratch, &off, bs, qd, dt);
    k->kt = act_at(k->scratch, &off, rows_kt, kvd, dt);
    k->m = act_at(k->scratch, &off, bs, d->inter, dt);
    k->f = act_at(k->scratch, &off, ch, H, dt);
    k->fn = act_at(k->scratch, &off, ch, H, dt);
    k->kn = act_at(k->scratch, &off, bs, kvd, dt);
    k->vt = act_at(k->scratch, &off, bs, kvd, dt);
    size_t in_ints = (size_t)in_pos(nid) + nid;
    CK(be->ops->alloc(be, in_ints * sizeof(int32_t), (void **)&k->in), "draft inputs (%zu ints)", in_ints);
    k->ids = k->in + IN_IDS;
    k->pos = k->in + in_pos(nid);
    k->host_in = calloc(in_ints, sizeof(int32_t));
    if (!k->host_in) return kd_fail(KD_ERR_NOMEM, "kd_seq_attach_drafter: out of host memory for the input staging");
    /* the target keeps its tap features here for the rows of each forward */
    kd_act *taps = &s->rk[r].taps;
    int tapc = c->n_taps * m->cfg.hidden;
    CK(be->ops->alloc(be, (size_t)s->out_cap * tapc * kd_dtype_size(dt), &taps->data), "tap features (%d rows x %d)",
       s->out_cap, tapc);
    taps->rows = s->out_cap;
    taps->cols = taps->ld = tapc;
    taps->dtype = dt;
    if (m->tp > 1) {
        int lr = bs - 1, Vs = m->split.vocab, Hs = H / m->tp;
        size_t ab = act_bytes(m->tp * lr, Vs, KD_F32);
        size_t bytes = act_bytes(lr, Vs, KD_F32) + ab + act_bytes(ch, Hs, dt) + act_bytes(m->tp * ch, Hs, dt);
        CK(be->ops->alloc(be, bytes, &k->gather_buf), "the logit and feature shards (%zu bytes)", bytes);
        off = 0;
        k->shard = act_at(k->gather_buf, &off, lr, Vs, KD_F32);
        k->all = (char *)k->gather_buf + off;
        off += ab;
        k->fpart = act_at(k->gather_buf, &off, ch, Hs, dt);
        k->fall = (char *)k->gather_buf + off;
    }
#undef CK
    return KD_OK;
}

kd_status kd_seq_attach_drafter(kd_seq *s, kd_drafter *d) {
    if (!s || !d) return kd_fail(KD_ERR_ARG, "kd_seq_attach_drafter: argument '%s' is NULL", s ? "d" : "s");
    if (d->closed) return kd_fail(KD_ERR_STATE, "kd_seq_attach_drafter: the drafter %s is closed", d->dir);
    if (!d->target)
        return kd_fail(KD_ERR_STATE, "kd_seq_attach_drafter: the drafter %s was opened for inspection only "
                       "(no target model, no weights)", d->dir);
    if (d->target != s->model)
        return kd_fail(KD_ERR_ARG, "kd_seq_attach_drafter: the drafter %s is bound to another target model than "
                       "this sequence's", d->dir);
    if (s->drafter) return kd_fail(KD_ERR_STATE, "kd_seq_attach_drafter: the sequence already has a drafter");
    if (s->len != 0 || s->pending != 0)
        return kd_fail(KD_ERR_STATE, "kd_seq_attach_drafter: the sequence must be empty (len %d, pending %d): the "
                       "drafter's context must hold every committed token", s->len, s->pending);
    const kd_dcfg *c = &d->cfg;
    kd_model *m = s->model;
    kd_backend *be = m->be;
    int bs = c->block_size, V = m->cfg.vocab, ch = KD_DRAFT_CHUNK;
    kd_draft_state *ds = calloc(1, sizeof *ds);
    if (!ds) return kd_fail(KD_ERR_NOMEM, "kd_seq_attach_drafter: cannot allocate the drafter state");
    s->draft = ds;
    s->drafter = d;
    d->n_seqs++;
    ds->cap = s->capacity;
    ds->nid = bs > ch ? bs : ch;
    kd_status st = KD_OK;
    ds->rk = calloc((size_t)m->tp, sizeof *ds->rk);
    if (!ds->rk) { st = kd_fail(KD_ERR_NOMEM, "kd_seq_attach_drafter: out of host memory"); goto fail; }
    for (int r = 0; r < m->tp && st == KD_OK; r++) st = rank_state_alloc(s, r);
    if (st != KD_OK) goto fail;
    st = be->ops->alloc(be, (size_t)(bs - 1) * V * sizeof(float), &ds->logprobs.data);
    if (st == KD_OK) st = be->ops->alloc(be, (size_t)(bs - 1) * sizeof(int32_t), (void **)&ds->argmax);
    if (st != KD_OK) { kd_fail_context(st, "kd_seq_attach_drafter: draft buffers"); goto fail; }
    /* at tp > 1 the draft pass runs eagerly on every rank, as the target's steps do */
    ds->graph_mode = m->tp > 1 ? KD_GRAPHS_OFF : kd_graphs_resolve(be, s->draft_graphs);
    ds->graph_verbose = m->opt.graphs_verbose != 0;
    ds->logprobs.rows = bs - 1;
    ds->logprobs.cols = ds->logprobs.ld = V;
    ds->logprobs.dtype = KD_F32;
    return KD_OK;
fail:
    kd_draft_state_free(s);
    return st;
}

/* project n feature rows into every layer's context K/V (rank r's KV heads) at positions
 * p0..p0+n-1: the rows pick[0..n) of `span` (a view of consecutive rows of its taps), or all of
 * them in order (pick NULL). The whole span goes through fc as one view and the picked rows are
 * gathered after it: the fc weight (n_taps x hidden x hidden, 616 MB at K2.6) is read once a
 * window of accepted rows, not once a run of adjacent ones. A row's bits do not depend on the
 * others in the view. */
static kd_status append_rows(kd_seq *s, int r, kd_act span, const int32_t *pick, int n, int p0) {
    kd_drafter *d = s->drafter;
    kd_draft_rank *k = &s->draft->rk[r];
    const kd_drafter_rank *R = &d->ranks[r];
    kd_backend *be = R->be;
    const kd_backend_ops *op = be->ops;
    const kd_dcfg *c = &d->cfg;
    int kvh = d->kv_heads, hd = c->head_dim, ip = in_pos(s->draft->nid);
    int32_t *h = k->host_in;   /* positions (and picks) up in one copy, laid out as k->in */
    for (int i = 0; i < n; i++) {
        h[ip + i] = p0 + i;
        if (pick) h[IN_IDS + i] = pick[i];
    }
    if (pick) KD_TRY(op->upload(be, k->ids, h + IN_IDS, (size_t)(ip + n - IN_IDS) * sizeof(int32_t)));
    else KD_TRY(op->upload(be, k->pos, h + ip, (size_t)n * sizeof(int32_t)));
    kd_act f = kd_act_rows(k->f, 0, span.rows), kt = kd_act_rows(k->kt, 0, n), xn;   /* xn: the n normed rows */
    if (s->model->comm) {   /* this rank's hidden / tp columns (fc's rows), then every rank's */
        kd_act part = kd_act_rows(k->fpart, 0, span.rows);
        KD_TRY(op->linear(be, span, &R->fc, part));
        KD_TRY(kd_gather_columns(s->model, r, be, part, k->fall, &f));
    } else {
        KD_TRY(op->linear(be, span, &R->fc, f));
    }
    if (pick) {
        kd_act g = kd_act_rows(k->fn, 0, n);
        KD_TRY(op->gather_rows(be, g, f, k->ids, n));
        xn = kd_act_rows(k->f, 0, n);
        KD_TRY(op->rmsnorm(be, g, &R->hidden_norm, c->eps, xn));
    } else {
        xn = kd_act_rows(k->fn, 0, n);
        KD_TRY(op->rmsnorm(be, f, &R->hidden_norm, c->eps, xn));
    }
    for (int l = 0; l < c->n_layers; l++) {
        const kd_dlayer *L = &R->layers[l];
        kd_act kc = kd_act_rows(k->k[l], p0, n), vc = kd_act_rows(k->v[l], p0, n);
        KD_TRY(op->linear(be, xn, &L->k_proj, kt));
        kd_act kt_h = {.data = kt.data, .rows = n * kvh, .cols = hd, .ld = hd, .dtype = kt.dtype};
        kd_act kc_h = {.data = kc.data, .rows = n * kvh, .cols = hd, .ld = hd, .dtype = kc.dtype};
        KD_TRY(op->rmsnorm(be, kt_h, &L->k_norm, c->eps, kc_h));
        KD_TRY(op->rope(be, kc, kvh, hd, 0, k->pos, &R->rope));
        KD_TRY(op->linear(be, xn, &L->v_proj, vc));
    }
    return KD_OK;
}

typedef struct append_job {
    kd_seq *s;
    const int32_t *rows;   /* NULL: rows 0..n-1 */
    int n;
} append_job;

/* rank r's part of kd_draft_context_append: windows of increasing rows within KD_DRAFT_CHUNK of
 * their first (an accepted path is one window; a window of adjacent rows needs no gather), from
 * its own copy of the tap features, at positions ctx_len.. */
static kd_status append_rank(void *ctx, int r) {
    const append_job *j = ctx;
    kd_seq *s = j->s;
    kd_act taps = s->rk[r].taps;
#define ROW(k) (j->rows ? j->rows[k] : (k))
    int i = 0, p0 = s->draft->ctx_len;
    while (i < j->n) {
        int r0 = ROW(i), e = i + 1;
        while (e < j->n && ROW(e) > ROW(e - 1) && ROW(e) - r0 < KD_DRAFT_CHUNK) e++;
        int cnt = e - i, span = ROW(e - 1) - r0 + 1;
        int32_t pick[KD_DRAFT_CHUNK];
        for (int q = 0; q < cnt; q++) pick[q] = ROW(i + q) - r0;
        kd_status st = append_rows(s, r, kd_act_rows(taps, r0, span), span == cnt ? NULL : pick, cnt, p0);
        if (st != KD_OK) return kd_fail_context(st, "drafter context append (rows %d..%d)", r0, ROW(e - 1));
        p0 += cnt;
        i = e;
    }
#undef ROW
    return KD_OK;
}

kd_status kd_draft_context_append(kd_seq *s, const int32_t *rows, int n) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_draft_context_append: argument 's' is NULL");
    if (!s->draft) return KD_OK;          /* no drafter attached: nothing keeps a context */
    kd_draft_state *ds = s->draft;
    if (n < 0) return kd_fail(KD_ERR_ARG, "kd_draft_context_append: n = %d, expected >= 0", n);
    if (ds->ctx_len + n > ds->cap)
        return kd_fail(KD_ERR_CAPACITY, "kd_draft_context_append: drafter context %d + %d rows exceeds the "
                       "sequence capacity %d", ds->ctx_len, n, ds->cap);
    for (int i = 0; i < n; i++) {
        int r = rows ? rows[i] : i;
        if (r < 0 || r >= s->out_rows || r >= s->rk[0].taps.rows)
            return kd_fail(KD_ERR_ARG, "kd_draft_context_append: rows[%d] = %d is outside the last forward's "
                           "%d rows", i, r, s->out_rows);
    }
    /* all rows or none: on a failure the context keeps its length (the rows written past it are
     * not part of it); not kd_draft_context_truncate, which drops the pending draft: the context
     * is as it was, so the draft still holds */
    append_job job = {s, rows, n};
    KD_TRY(kd_ranks_run(s->model, append_rank, &job));
    ds->ctx_len += n;
    if (n > 0) ds->have_logprobs = false;   /* the context grew: the last draft was for a shorter one */
    return KD_OK;
}

kd_status kd_draft_context_truncate(kd_seq *s, int len) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_draft_context_truncate: argument 's' is NULL");
    if (len < 0) return kd_fail(KD_ERR_ARG, "kd_draft_context_truncate: len = %d, expected >= 0", len);
    if (!s->draft) return KD_OK;
    if (len < s->draft->ctx_len) {
        s->draft->ctx_len = len;
        s->draft->have_logprobs = false;
    }
    return KD_OK;
}

/* rank r's draft pass over the block whose ids and positions are in its ids / pos: the layers
 * over its heads and its part of the MLP (at tp > 1 the all-reduce completes o_proj's and down's
 * partial sums, as in the target's forward), the final norm of rows 1..bs-1 (the MASK positions),
 * then the log-probs into ds->logprobs: at tp 1 through the whole lm_head; at tp > 1 each rank
 * multiplies by its vocabulary shard, an all-gather brings every shard to every rank, and rank 0
 * lays them side by side and takes log_softmax (no rank holds the whole head). d_len NULL: the
 * context length is the host's p0 (the block's K/V written straight into cache rows p0..); else
 * the device int32 holding it (graph modes, tp 1; see the top of the file). Enqueues backend ops
 * and the collectives only. */
static kd_status draft_body(kd_seq *s, int r, int p0, const int32_t *d_len) {
    kd_drafter *d = s->drafter;
    kd_draft_state *ds = s->draft;
    kd_draft_rank *k = &ds->rk[r];
    const kd_drafter_rank *R = &d->ranks[r];
    kd_model *m = s->model;
    kd_backend *be = R->be;
    const kd_backend_ops *op = be->ops;
    const kd_dcfg *c = &d->cfg;
    int bs = c->block_size, nh = d->heads, kvh = d->kv_heads, hd = c->head_dim;
    kd_status st;
#define T(expr, what) do { st = (expr); if (st != KD_OK) return kd_fail_context(st, "kd_draft: %s", what); } while (0)
    T(op->embed(be, &m->ranks[r].embed, k->ids, k->x), "embed (target table)");
    kd_act qh = {.data = k->q.data, .rows = bs * nh, .cols = hd, .ld = hd, .dtype = k->q.dtype};
    kd_act kt = kd_act_rows(k->kt, 0, bs);
    kd_act kt_h = {.data = kt.data, .rows = bs * kvh, .cols = hd, .ld = hd, .dtype = kt.dtype};
    kd_act kn_h = {.data = k->kn.data, .rows = bs * kvh, .cols = hd, .ld = hd, .dtype = k->kn.dtype};
    float scale = 1.0f / sqrtf((float)hd);
    /* each residual add computes the next normed input with it (add_rmsnorm), except the last
     * layer's: the final norm covers the MASK rows only */
    T(op->rmsnorm(be, k->x, &R->layers[0].attn_norm, c->eps, k->h), "input_layernorm");
    for (int l = 0; l < c->n_layers; l++) {
        const kd_dlayer *L = &R->layers[l];
        /* q: per-head q_norm then RoPE (att is free scratch of the same shape until attention) */
        T(op->linear(be, k->h, &L->q_proj, k->att), "q_proj");
        kd_act att_h = {.data = k->att.data, .rows = bs * nh, .cols = hd, .ld = hd, .dtype = k->att.dtype};
        T(op->rmsnorm(be, att_h, &L->q_norm, c->eps, qh), "q_norm");
        T(op->rope(be, k->q, nh, hd, 0, k->pos, &R->rope), "rope q");
        /* the block's K/V go to rows [p0, p0+bs) of the cache, after the committed context */
        T(op->linear(be, k->h, &L->k_proj, kt), "k_proj");
        if (d_len) {
            /* finished in scratch, stored at rows *d_len..; attention reads the length itself */
            T(op->rmsnorm(be, kt_h, &L->k_norm, c->eps, kn_h), "k_norm");
            T(op->rope(be, k->kn, kvh, hd, 0, k->pos, &R->rope), "rope k");
            T(op->store_rows_at(be, k->k[l], d_len, k->kn), "store k");
            T(op->linear(be, k->h, &L->v_proj, k->vt), "v_proj");
            T(op->store_rows_at(be, k->v[l], d_len, k->vt), "store v");
            T(op->attention_at(be, k->q, nh, hd, k->k[l], k->v[l], kvh, d_len, false, NULL, c->window[l], scale,
                               k->att), "attention");
        } else {
            kd_act kc = kd_act_rows(k->k[l], p0, bs), vc = kd_act_rows(k->v[l], p0, bs);
            kd_act kc_h = {.data = kc.data, .rows = bs * kvh, .cols = hd, .ld = hd, .dtype = kc.dtype};
            T(op->rmsnorm(be, kt_h, &L->k_norm, c->eps, kc_h), "k_norm");
            T(op->rope(be, kc, kvh, hd, 0, k->pos, &R->rope), "rope k");
            T(op->linear(be, k->h, &L->v_proj, vc), "v_proj");
            kd_act keys = kd_act_rows(k->k[l], 0, p0 + bs), vals = kd_act_rows(k->v[l], 0, p0 + bs);
            T(op->attention(be, k->q, nh, hd, keys, vals, kvh, p0, false, NULL, c->window[l], scale, k->att),
              "attention");
        }
        T(op->linear(be, k->att, &L->o_proj, k->o), "o_proj");
        T(kd_add_reduced(m, r, be, k->o, k->x, &L->ffn_norm, c->eps, k->h), "residual + post_attention_layernorm");
        T(op->linear_swiglu(be, k->h, &L->gate, &L->up, k->m), "gate_proj + up_proj + swiglu");
        T(op->linear(be, k->m, &L->down, k->o), "down_proj");
        const kd_weight *next = l + 1 < c->n_layers ? &R->layers[l + 1].attn_norm : NULL;
        T(kd_add_reduced(m, r, be, k->o, k->x, next, c->eps, k->h), "residual (+ the next input_layernorm)");
    }
    kd_act y = kd_act_rows(k->h, 0, bs - 1);
    T(op->rmsnorm(be, kd_act_rows(k->x, 1, bs - 1), &R->norm, c->eps, y), "norm");
    if (!m->comm) {
        T(op->linear(be, y, &m->ranks[0].lm_head, ds->logprobs), "lm_head (target)");
    } else {
        T(op->linear(be, y, &m->ranks[r].lm_head, k->shard), "lm_head (target, this rank's vocabulary shard)");
        T(kd_gather_columns(m, r, be, k->shard, k->all, r == 0 ? &ds->logprobs : NULL), "the logit shards");
        if (r != 0) return KD_OK;
    }
    T(op->log_softmax(be, ds->logprobs), "log_softmax");
#undef T
    return KD_OK;
}

/* draft_body on the device-length path, as a kd_graph_body (tp 1) */
static kd_status draft_body_at(void *ctx) {
    kd_seq *s = ctx;
    return draft_body(s, 0, 0, s->draft->rk[0].in + IN_DLEN);
}

/* rank r's draft pass at tp > 1: its inputs up from the host staging, then the body */
static kd_status draft_rank(void *ctx, int r) {
    kd_seq *s = ctx;
    kd_draft_state *ds = s->draft;
    kd_backend *be = s->model->ranks[r].be;
    size_t n = (size_t)in_pos(ds->nid) + s->drafter->cfg.block_size;
    kd_status st = be->ops->upload(be, ds->rk[r].in, ds->rk[0].host_in, n * sizeof(int32_t));
    if (st != KD_OK) return kd_fail_context(st, "kd_draft: rank %d: upload inputs", r);
    return draft_body(s, r, ds->ctx_len, NULL);
}

kd_status kd_draft(kd_seq *s, int32_t bonus, float *logprobs_dst) {
    if (!s) return kd_fail(KD_ERR_ARG, "kd_draft: argument 's' is NULL");
    if (!s->draft) return kd_fail(KD_ERR_STATE, "kd_draft: no drafter attached to this sequence (kd_seq_attach_drafter)");
    kd_draft_state *ds = s->draft;
    kd_model *m = s->model;
    kd_backend *be = m->be;
    const kd_dcfg *c = &s->drafter->cfg;
    int V = m->cfg.vocab;
    if (bonus < 0 || bonus >= V)
        return kd_fail(KD_ERR_ARG, "kd_draft: bonus token %d is outside the vocabulary [0, %d)", bonus, V);
    if (ds->ctx_len != s->len)
        return kd_fail(KD_ERR_STATE, "kd_draft: the drafter context holds %d tokens but the sequence has %d "
                       "committed: the target forward did not hand over its tap features", ds->ctx_len, s->len);
    int bs = c->block_size, p0 = ds->ctx_len, ip = in_pos(ds->nid);
    ds->have_logprobs = false;
    kd_status st;
#define T(expr, what) do { st = (expr); if (st != KD_OK) return kd_fail_context(st, "kd_draft: %s", what); } while (0)
    /* the length, the block [bonus, MASK x (bs-1)] and its positions, staged once and sent up in
     * one copy a rank */
    int32_t *h = ds->rk[0].host_in;
    h[IN_DLEN] = p0;
    for (int i = 0; i < bs; i++) { h[IN_IDS + i] = i ? c->mask_token_id : bonus; h[ip + i] = p0 + i; }
    if (m->tp > 1) {
        KD_TRY(kd_ranks_run(m, draft_rank, s));
    } else {
        T(be->ops->upload(be, ds->rk[0].in, h, (size_t)(ip + bs) * sizeof(int32_t)), "upload inputs");
        if (ds->graph_mode == KD_GRAPHS_CAPTURE) {
            char what[64];
            if (ds->graph_verbose) snprintf(what, sizeof what, "draft pass (%d rows)", bs);
            KD_TRY(kd_graph_run(m, &ds->graph, draft_body_at, s, ds->graph_verbose ? what : NULL));
        } else {         /* off: the host-length path; eager: the device-length path, not captured */
            KD_TRY(draft_body(s, 0, p0, ds->graph_mode == KD_GRAPHS_EAGER ? ds->rk[0].in + IN_DLEN : NULL));
        }
    }
    if (logprobs_dst)
        T(be->ops->download(be, logprobs_dst, ds->logprobs.data, (size_t)(bs - 1) * V * sizeof(float)), "download");
#undef T
    ds->bonus = bonus;
    ds->have_logprobs = true;
    return KD_OK;
}

kd_status kd_draft_argmax(kd_seq *s, int32_t *ids_dst) {
    if (!s || !ids_dst) return kd_fail(KD_ERR_ARG, "kd_draft_argmax: argument '%s' is NULL", s ? "ids_dst" : "s");
    if (!s->draft) return kd_fail(KD_ERR_STATE, "kd_draft_argmax: no drafter attached to this sequence");
    kd_draft_state *ds = s->draft;
    if (!ds->have_logprobs)
        return kd_fail(KD_ERR_STATE, "kd_draft_argmax: no draft since the context last changed (call kd_draft)");
    kd_backend *be = s->model->be;
    KD_TRY(be->ops->argmax(be, ds->logprobs, ds->argmax));
    KD_TRY(be->ops->download(be, ids_dst, ds->argmax, (size_t)ds->logprobs.rows * sizeof(int32_t)));
    return kd_argmax_check(ids_dst, ds->logprobs.rows, "kd_draft_argmax", "the drafter forward's log-prob");
}

kd_status kd_draft_logprobs(kd_seq *s, kd_act *out, int32_t *bonus) {
    if (!s || !out || !bonus) return kd_fail(KD_ERR_ARG, "kd_draft_logprobs: a pointer argument is NULL");
    if (!s->draft) return kd_fail(KD_ERR_STATE, "kd_draft_logprobs: no drafter attached to this sequence");
    if (!s->draft->have_logprobs)
        return kd_fail(KD_ERR_STATE, "kd_draft_logprobs: no draft since the context last changed (call kd_draft)");
    *out = s->draft->logprobs;
    *bonus = s->draft->bonus;
    return KD_OK;
}
