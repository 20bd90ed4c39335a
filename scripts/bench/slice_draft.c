/* slice_draft.c: the DFlash draft pass at the K2.6 drafter's dims, on the slice (issue 17).
 * Included by model_slice_bench.c (it shares that file's RNG, timing marks, tables and checks).
 *
 * A random drafter is written to a temporary directory as a real checkpoint (config.json and a
 * bf16 model.safetensors, the names z-lab's DFlash uses) and opened on the slice with
 * kd_drafter_open, so the engine's own loader and draft pass run: Kimi K2.6 DFlash dims (6 qwen3
 * layers, hidden 7168, 64 heads, 8 KV heads, head_dim 128, intermediate 18432, block 8, 6 taps:
 * 6.48 GiB) or, with --tiny, models/tiny-k2.6-dflash's. The drafter shares the target's embedding
 * and lm_head; its taps are spread over the slice's layers (the slice has 4 of K2.6's 61; which
 * layers are tapped does not change the pass).
 *
 * Per context: a sequence with the drafter attached is prefilled to ctx tokens (the target forward
 * hands its tap features to the drafter context), then kd_draft passes are timed (2 warm-up, then
 * n, median) with step graphs off and captured (eager, the device-length path uncaptured, on a
 * backend without graphs or with --no-graphs). Roofline: the bytes a pass must read (every drafter
 * layer weight once, the final norm, the target's whole lm_head for the bs - 1 MASK rows, and the
 * context's K/V in every layer) over the copy ceiling. Check: one pass's log-probs bit-identical
 * in both modes. */

typedef struct draft_dims {
    const char *name;
    int layers, heads, kv_heads, head_dim, inter, block, n_taps;
} draft_dims;
static const draft_dims K26_DRAFT = {"Kimi K2.6 DFlash dims", 6, 64, 8, 128, 18432, 8, 6};
static const draft_dims TINY_DRAFT = {"tiny (models/tiny-k2.6-dflash dims)", 2, 4, 2, 32, 256, 8, 2};

/* one bf16 tensor of a safetensors file: its name, shape and the range of its random values */
typedef struct st_tensor {
    char name[96];
    int64_t rows, cols;   /* cols 0: a vector of rows values */
    float lo, hi;
} st_tensor;

static int64_t st_count(const st_tensor *t) { return t->rows * (t->cols ? t->cols : 1); }

/* the drafter's tensors (config dims d over a target of hidden D) into t (room for 3 + 11 layers) */
static int drafter_tensors(const draft_dims *d, int D, st_tensor *t) {
    int n = 0, q = d->heads * d->head_dim, kv = d->kv_heads * d->head_dim;
    float a = 1.0f / sqrtf((float)D), b = 1.0f / sqrtf((float)d->inter), c = 1.0f / sqrtf((float)q);
#define T(nm, r, cl, l0, h0) do { snprintf(t[n].name, sizeof t[n].name, "%s", nm); \
        t[n].rows = (r); t[n].cols = (cl); t[n].lo = (l0); t[n].hi = (h0); n++; } while (0)
    char nm[96];
    T("fc.weight", D, (int64_t)d->n_taps * D, -a, a);
    T("hidden_norm.weight", D, 0, 0.9f, 1.1f);
    T("norm.weight", D, 0, 0.9f, 1.1f);
    for (int l = 0; l < d->layers; l++) {
#define L(part, r, cl, l0, h0) do { snprintf(nm, sizeof nm, "layers.%d.%s.weight", l, part); T(nm, r, cl, l0, h0); } while (0)
        L("input_layernorm", D, 0, 0.9f, 1.1f);
        L("post_attention_layernorm", D, 0, 0.9f, 1.1f);
        L("self_attn.q_proj", q, D, -a, a);
        L("self_attn.k_proj", kv, D, -a, a);
        L("self_attn.v_proj", kv, D, -a, a);
        L("self_attn.o_proj", D, q, -c, c);
        L("self_attn.q_norm", d->head_dim, 0, 0.9f, 1.1f);
        L("self_attn.k_norm", d->head_dim, 0, 0.9f, 1.1f);
        L("mlp.gate_proj", d->inter, D, -a, a);
        L("mlp.up_proj", d->inter, D, -a, a);
        L("mlp.down_proj", D, d->inter, -b, b);
#undef L
    }
#undef T
    return n;
}

/* the safetensors header of t[0..n) (bf16, packed in order), padded with spaces to 8 bytes */
static char *st_header(const st_tensor *t, int n, size_t *len) {
    size_t cap = 256 + (size_t)n * 200, at = 0;
    char *h = xmalloc(cap, "safetensors header");
    int64_t off = 0;
    at += (size_t)snprintf(h + at, cap - at, "{");
    for (int i = 0; i < n; i++) {
        int64_t bytes = 2 * st_count(&t[i]);
        if (t[i].cols)
            at += (size_t)snprintf(h + at, cap - at, "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":[%lld,%lld],"
                                   "\"data_offsets\":[%lld,%lld]}", i ? "," : "", t[i].name, (long long)t[i].rows,
                                   (long long)t[i].cols, (long long)off, (long long)(off + bytes));
        else
            at += (size_t)snprintf(h + at, cap - at, "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":[%lld],"
                                   "\"data_offsets\":[%lld,%lld]}", i ? "," : "", t[i].name, (long long)t[i].rows,
                                   (long long)off, (long long)(off + bytes));
        off += bytes;
    }
    at += (size_t)snprintf(h + at, cap - at, "}");
    while (at % 8) h[at++] = ' ';
    *len = at;
    return h;
}

/* config.json and model.safetensors of a random drafter at dims d for the target config c */
static uint64_t write_drafter(const char *dir, const draft_dims *d, const kd_config *c) {
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) { fprintf(stderr, "FATAL: cannot write %s\n", path); exit(2); }
    fprintf(f, "{\"architectures\": [\"DFlashDraftModel\"], \"model_type\": \"qwen3\", \"block_size\": %d,\n"
            " \"num_target_layers\": %d, \"dflash_config\": {\"mask_token_id\": %d, \"target_layer_ids\": [",
            d->block, c->n_layers, c->vocab - 2);
    for (int i = 0; i < d->n_taps; i++) fprintf(f, "%s%d", i ? ", " : "", i % (c->n_layers - 1));
    fprintf(f, "]},\n \"vocab_size\": %d, \"hidden_size\": %d, \"intermediate_size\": %d, \"num_hidden_layers\": %d,\n"
            " \"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d, \"hidden_act\": \"silu\",\n"
            " \"attention_bias\": false, \"rms_norm_eps\": 1e-05, \"rope_theta\": 50000.0,\n"
            " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 64.0, \"beta_fast\": 32.0, \"beta_slow\": 1.0,\n"
            "   \"mscale\": 1.0, \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096},\n"
            " \"max_position_embeddings\": 262144, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\"}\n",
            c->vocab, c->hidden, d->inter, d->layers, d->heads, d->kv_heads, d->head_dim);
    if (fclose(f) != 0) { fprintf(stderr, "FATAL: cannot write %s\n", path); exit(2); }

    st_tensor t[3 + 11 * 16];
    int n = drafter_tensors(d, c->hidden, t);
    size_t hlen;
    char *h = st_header(t, n, &hlen);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    f = fopen(path, "wb");
    uint64_t len64 = hlen, bytes = 0;
    if (!f || fwrite(&len64, 8, 1, f) != 1 || fwrite(h, 1, hlen, f) != hlen) { fprintf(stderr, "FATAL: cannot write %s\n", path); exit(2); }
    free(h);
    enum { CHUNK = 1 << 24 };
    uint16_t *buf = xmalloc((size_t)CHUNK * 2, "drafter weights");
    for (int i = 0; i < n; i++)
        for (int64_t left = st_count(&t[i]); left > 0;) {
            size_t k = left < CHUNK ? (size_t)left : CHUNK;
            fill_bf16(buf, k, t[i].lo, t[i].hi);
            if (fwrite(buf, 2, k, f) != k) { fprintf(stderr, "FATAL: cannot write %s\n", path); exit(2); }
            left -= (int64_t)k;
            bytes += 2 * k;
        }
    free(buf);
    if (fclose(f) != 0) { fprintf(stderr, "FATAL: cannot write %s\n", path); exit(2); }
    return bytes;
}

/* bytes one draft pass must read at context ctx (see the top) */
static double draft_bytes(const draft_dims *d, const kd_config *c, int ctx) {
    double D = c->hidden, q = (double)d->heads * d->head_dim, kv = (double)d->kv_heads * d->head_dim;
    double layer = 2.0 * (D * q * 2 + D * kv * 2 + 3.0 * D * d->inter + 2 * D + 2.0 * d->head_dim);
    double cache = 2.0 * 2.0 * kv * (ctx + d->block);
    return d->layers * (layer + cache) + 2.0 * D + 2.0 * (double)c->vocab * D;
}

/* a sequence of capacity cap with the drafter attached and its draft pass in graph mode `mode`,
 * prefilled with the ctx tokens tok */
static kd_seq *draft_seq(kd_model *m, kd_drafter *dr, int cap, const int32_t *tok, int ctx, kd_graphs_mode mode) {
    kd_seq *s = NULL;
    const kd_seq_options so = { .graphs = KD_GRAPHS_OFF, .draft_graphs = mode };
    CK(kd_seq_new_opts(m, cap, &so, &s));
    CK(kd_seq_attach_drafter(s, dr));
    CK(kd_forward(s, tok, ctx, NULL, NULL));
    return s;
}

/* median ms of n timed draft passes (2 warm-up first); *replayed: passes that called no op */
static double time_drafts(kd_seq *s, const opts *o, int *n_out, int *replayed) {
    double w[2];
    for (int i = 0; i < 2; i++) {
        mark(0);
        CK(kd_draft(s, 7, NULL));
        mark(1);
        w[i] = mark_ms(0, 1);
    }
    int n = n_steps_for(o, w[0] < w[1] ? w[0] : w[1]);
    double *t = xmalloc((size_t)n * sizeof(double), "times");
    *replayed = 0;
    for (int i = 0; i < n; i++) {
        long calls = g_op_calls;
        mark(0);
        CK(kd_draft(s, 7, NULL));
        mark(1);
        t[i] = mark_ms(0, 1);
        if (g_op_calls == calls) (*replayed)++;
    }
    double ms = median_of(t, n);
    free(t);
    *n_out = n;
    return ms;
}

static void draft_rows(const opts *o, kd_model *m, const draft_dims *d) {
    const kd_config *c = &m->cfg;
    char dir[] = "/tmp/kd_draft_bench_XXXXXX";
    if (!mkdtemp(dir)) { fprintf(stderr, "FATAL: mkdtemp\n"); exit(2); }
    printf("writing a random drafter (%s) to %s ...\n", d->name, dir);
    fflush(stdout);
    uint64_t t0 = kd_time_ns();
    uint64_t bytes = write_drafter(dir, d, c);
    uint64_t t1 = kd_time_ns();
    kd_drafter *dr = NULL;
    CK(kd_drafter_open(dir, m, &dr));
    double open_s = (double)(kd_time_ns() - t1) * 1e-9;
    char hb[64];
    md("\n### The draft pass (DFlash), %s\n\n%d layers, hidden %d, %d heads, %d KV heads, head_dim %d, intermediate "
       "%d, block %d, %d taps; random bf16 weights (%s) written as a checkpoint in %.1f s, opened with "
       "kd_drafter_open in %.1f s. One pass = `kd_draft` (the block [bonus, MASK x %d] through the layers, then the "
       "target's lm_head and log_softmax over %d rows); %s; median of n passes after 2 warm-up passes. Bytes = "
       "every drafter weight once + the target's lm_head + the context's K/V in every layer; roofline = bytes / "
       "copy ceiling (%.0f GB/s).\n\n",
       d->name, d->layers, c->hidden, d->heads, d->kv_heads, d->head_dim, d->inter, d->block, d->n_taps,
       human((double)bytes, hb, sizeof hb), (double)(t1 - t0) * 1e-9, open_s, d->block - 1, d->block - 1,
       g_events ? "CUDA events around it" : "host clock between syncs", g_copy_gbs);
    md("| ctx | graphs | bytes read | roofline ms | pass ms (median) | of roofline | n | replays |\n"
       "|---|---|---|---|---|---|---|---|\n");
    int ctx_k26[] = {1024, 8192}, ctx_tiny[] = {64, 300};
    const int *ctxs = o->tiny ? ctx_tiny : ctx_k26;
    /* the second mode: captured where the backend has graphs, else the device-length path eager */
    kd_graphs_mode second = o->graphs && graphs_available() ? KD_GRAPHS_CAPTURE : KD_GRAPHS_EAGER;
    const char *second_name = second == KD_GRAPHS_CAPTURE ? "captured" : "eager";
    size_t V = (size_t)c->vocab, rows = (size_t)(d->block - 1);
    float *lp[2] = {xmalloc(rows * V * sizeof(float), "log-probs"), xmalloc(rows * V * sizeof(float), "log-probs")};
    int differ = 0;
    for (int ci = 0; ci < 2; ci++) {
        int ctx = ctxs[ci];
        double b = draft_bytes(d, c, ctx), roof = b / (g_copy_gbs * 1e9) * 1e3;
        int32_t *tok = xmalloc((size_t)ctx * sizeof(int32_t), "prompt");
        for (int i = 0; i < ctx; i++) tok[i] = irand(c->vocab);
        for (int gi = 0; gi < 2; gi++) {
            kd_seq *s = draft_seq(m, dr, ctx + d->block + 16, tok, ctx, gi ? second : KD_GRAPHS_OFF);
            int n, replayed;
            double ms = time_drafts(s, o, &n, &replayed);
            md("| %d | %s | %s | %.3f | **%.3f** | %.0f%% | %d | %d/%d |\n", ctx, gi ? second_name : "off",
               human(b, hb, sizeof hb), roof, ms, 100.0 * roof / ms, n, replayed, n);
            CK(kd_draft(s, 7, lp[gi]));
            kd_seq_free(s);
        }
        free(tok);
        if (memcmp(lp[0], lp[1], rows * V * sizeof(float)) != 0) {
            md("\n- FAIL: ctx %d: the draft pass's log-probs differ between graphs off and %s\n", ctx, second_name);
            differ++;
        }
    }
    if (!differ) md("\n- ok: the draft pass's log-probs with graphs off and %s, bit for bit at every context\n", second_name);
    g_fail += differ;
    /* where a pass's time goes: one profiled pass at the first context (graphs off) */
    int32_t *tok = xmalloc((size_t)ctxs[0] * sizeof(int32_t), "prompt");
    for (int i = 0; i < ctxs[0]; i++) tok[i] = irand(c->vocab);
    kd_seq *s = draft_seq(m, dr, ctxs[0] + d->block + 16, tok, ctxs[0], KD_GRAPHS_OFF);
    CK(kd_draft(s, 7, NULL));   /* the workspaces, before the marks */
    double cat[C_N] = {0}, total, ops;
    int calls;
    prof_start();
    CK(kd_draft(s, 7, NULL));
    prof_finish(cat, &total, &ops, &calls);
    md("\n#### Where a draft pass's time goes (one profiled pass, graphs off: %s around every backend op, ms)\n\n",
       g_events ? "CUDA events" : "host clock + sync");
    prof_header("ctx | ops", 2);
    md("| %d | %d |", ctxs[0], calls);
    prof_row(cat, total, ops);
    kd_seq_free(s);
    free(tok);
    free(lp[0]);
    free(lp[1]);
    kd_drafter_close(dr);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    remove(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    remove(path);
    rmdir(dir);
}
