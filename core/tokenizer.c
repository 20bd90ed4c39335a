/* tokenizer.c: Kimi K2.6's tokenizer, tiktoken byte-pair encoding (kimi_k2.md section 4).
 *
 * Files of a checkpoint directory: `tiktoken.model`, one `base64(token bytes) rank` per line
 * (ranks 0..n_base-1 are the base ids), and `tokenizer_config.json`, whose added_tokens_decoder
 * names some of the KD_TOKENIZER_SPECIAL_SLOTS special ids that follow (the others are
 * `<|reserved_token_{id}|>`, as Kimi's TikTokenTokenizer names them).
 *
 * Encoding is tiktoken's: the text is cut into pieces by Kimi's pre-tokenizer pattern (PCRE2,
 * UTF-8 with Unicode properties); a piece that is a token is that token, otherwise its bytes
 * are merged pairwise, always the adjacent pair whose bytes have the lowest rank (leftmost on
 * ties), until no pair is a token. With special parsing on, special-token strings in the
 * text become their ids and the ordinary text between them is encoded as above. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "kdtree.h"
#include "error.h"
#include "json.h"
#include <pcre2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Kimi's pattern; its class intersections [A&&[^\p{Han}]] (fancy-regex) are written as
 * (?:(?!\p{Han})[A]), which PCRE2 takes */
#define NOT_HAN_UPPER "(?:(?!\\p{Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])"
#define NOT_HAN_LOWER "(?:(?!\\p{Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])"
#define CONTRACTION "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
static const char KIMI_PATTERN[] =
    "[\\p{Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?" NOT_HAN_UPPER "*" NOT_HAN_LOWER "+" CONTRACTION
    "|[^\\r\\n\\p{L}\\p{N}]?" NOT_HAN_UPPER "+" NOT_HAN_LOWER "*" CONTRACTION
    "|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";

struct kd_tokenizer {
    int n_base, n_ids;         /* base ranks; base + special slots */
    unsigned char *bytes;      /* every id's bytes, concatenated */
    size_t *off;               /* id -> its bytes: bytes + off[id], off[id + 1] - off[id] long */
    int32_t *slot;             /* open-addressing table of base ranks by their bytes, -1 = empty */
    uint32_t slot_mask;
    bool special_first[256];   /* the first bytes of the special strings */
    pcre2_code *re;
};

static uint32_t hash_bytes(const unsigned char *p, size_t n) {
    uint32_t h = 2166136261u;   /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

/* the base rank whose bytes are p[0..n), or -1 */
static int32_t rank_of(const kd_tokenizer *t, const unsigned char *p, size_t n) {
    for (uint32_t i = hash_bytes(p, n) & t->slot_mask;; i = (i + 1) & t->slot_mask) {
        int32_t r = t->slot[i];
        if (r < 0) return -1;
        if (t->off[r + 1] - t->off[r] == n && !memcmp(t->bytes + t->off[r], p, n)) return r;
    }
}

/* standard base64 (with '=' padding) of s[0..n) into out; the decoded length, or -1 */
static long base64_decode(const char *s, size_t n, unsigned char *out) {
    static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    if (n == 0 || n % 4) return -1;
    long len = 0;
    for (size_t i = 0; i < n; i += 4) {
        uint32_t v = 0;
        int pad = 0;
        for (int j = 0; j < 4; j++) {
            char c = s[i + j];
            const char *q = c ? strchr(alphabet, c) : NULL;
            if (c == '=' && i + 4 == n && j >= 2) { pad++; v <<= 6; continue; }
            if (!q || pad) return -1;
            v = v << 6 | (uint32_t)(q - alphabet);
        }
        out[len++] = (unsigned char)(v >> 16);
        if (pad < 2) out[len++] = (unsigned char)(v >> 8);
        if (pad < 1) out[len++] = (unsigned char)v;
    }
    return len;
}

static kd_status read_file(const char *path, char **text, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return kd_fail(KD_ERR_IO, "%s: cannot open", path);
    char *buf = NULL;
    size_t len = 0, cap = 0, got;
    do {
        if (len + 65536 > cap) {
            cap = cap ? 2 * cap : 1 << 20;
            char *nb = realloc(buf, cap + 1);
            if (!nb) { free(buf); fclose(f); return kd_fail(KD_ERR_NOMEM, "%s: out of memory reading it", path); }
            buf = nb;
        }
        got = fread(buf + len, 1, cap - len, f);
        len += got;
    } while (got > 0);
    bool bad = ferror(f);
    fclose(f);
    if (bad) { free(buf); return kd_fail(KD_ERR_IO, "%s: read error", path); }
    buf[len] = 0;
    *text = buf;
    *n = len;
    return KD_OK;
}

/* tiktoken.model -> the base ranks' bytes (t->bytes, t->off[0..n_base]) */
static kd_status load_ranks(kd_tokenizer *t, const char *path) {
    char *text = NULL;
    size_t n = 0;
    KD_TRY(read_file(path, &text, &n));
    kd_status st = KD_OK;
    int lines = 0;
    for (size_t i = 0; i < n; i++) lines += text[i] == '\n';
    if (n && text[n - 1] != '\n') lines++;
    /* every line's bytes into scratch, their place and length by rank; then copied in rank order */
    long *len_of = calloc((size_t)lines + 1, sizeof *len_of);
    unsigned char *scratch = malloc(n + 1);
    size_t *at = malloc(((size_t)lines + 1) * sizeof *at);
    if (!len_of || !scratch || !at) { st = kd_fail(KD_ERR_NOMEM, "%s: out of memory", path); goto done; }
    for (int r = 0; r < lines; r++) len_of[r] = -1;
    size_t used = 0;
    int line = 0;
    for (char *p = text; p < text + n; line++) {
        char *end = memchr(p, '\n', (size_t)(text + n - p));
        if (!end) end = text + n;
        char *sp = memchr(p, ' ', (size_t)(end - p));
        char *rank_end;
        long rank = sp ? strtol(sp + 1, &rank_end, 10) : -1;
        if (!sp || rank_end == sp + 1 || (rank_end != end && !(rank_end + 1 == end && *rank_end == '\r'))) {
            st = kd_fail(KD_ERR_FORMAT, "%s: line %d: expected `base64 rank`", path, line + 1);
            goto done;
        }
        if (rank < 0 || rank >= lines || len_of[rank] >= 0) {
            st = kd_fail(KD_ERR_FORMAT, "%s: line %d: rank %ld is %s", path, line + 1, rank,
                         rank < 0 || rank >= lines ? "outside 0..lines-1" : "listed twice");
            goto done;
        }
        long len = base64_decode(p, (size_t)(sp - p), scratch + used);
        if (len <= 0) { st = kd_fail(KD_ERR_FORMAT, "%s: line %d: the token is not base64", path, line + 1); goto done; }
        len_of[rank] = len;
        at[rank] = used;
        used += (size_t)len;
        p = end + 1;
    }
    t->n_base = lines;
    t->bytes = malloc(used + 1);
    t->off = malloc(((size_t)lines + KD_TOKENIZER_SPECIAL_SLOTS + 1) * sizeof *t->off);
    if (!t->bytes || !t->off) { st = kd_fail(KD_ERR_NOMEM, "%s: out of memory", path); goto done; }
    size_t o = 0;
    for (int r = 0; r < lines; r++) {
        t->off[r] = o;
        memcpy(t->bytes + o, scratch + at[r], (size_t)len_of[r]);
        o += (size_t)len_of[r];
    }
    t->off[lines] = o;
done:
    free(len_of);
    free(scratch);
    free(at);
    free(text);
    return st;
}

static kd_status build_table(kd_tokenizer *t, const char *path) {
    uint32_t size = 1024;
    while (size < 2u * (uint32_t)t->n_base) size <<= 1;
    t->slot = malloc(size * sizeof *t->slot);
    if (!t->slot) return kd_fail(KD_ERR_NOMEM, "%s: out of memory", path);
    memset(t->slot, 0xff, size * sizeof *t->slot);
    t->slot_mask = size - 1;
    for (int r = 0; r < t->n_base; r++) {
        const unsigned char *p = t->bytes + t->off[r];
        size_t n = t->off[r + 1] - t->off[r];
        if (rank_of(t, p, n) >= 0) return kd_fail(KD_ERR_FORMAT, "%s: rank %d repeats the bytes of rank %d", path, r, rank_of(t, p, n));
        uint32_t i = hash_bytes(p, n) & t->slot_mask;
        while (t->slot[i] >= 0) i = (i + 1) & t->slot_mask;
        t->slot[i] = r;
    }
    for (int b = 0; b < 256; b++) {   /* every piece must come apart into tokens */
        unsigned char c = (unsigned char)b;
        if (rank_of(t, &c, 1) < 0) return kd_fail(KD_ERR_FORMAT, "%s: byte 0x%02x has no rank", path, b);
    }
    return KD_OK;
}

/* the special ids' strings after the base ranks: tokenizer_config.json's added_tokens_decoder,
 * reserved names for the rest */
static kd_status load_specials(kd_tokenizer *t, const char *path) {
    cJSON *root = NULL;
    bool missing = false;
    KD_TRY(kd_json_load(path, &root, &missing));
    const char *name[KD_TOKENIZER_SPECIAL_SLOTS] = {0};
    const cJSON *dec = root ? cJSON_GetObjectItemCaseSensitive(root, "added_tokens_decoder") : NULL;
    kd_status st = KD_OK;
    if (dec && !cJSON_IsObject(dec)) {
        st = kd_fail(KD_ERR_CONFIG, "%s: added_tokens_decoder: expected an object", path);
        goto done;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, dec) {
        char *end;
        long id = strtol(e->string, &end, 10);
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (*end || id < t->n_base || id >= t->n_base + KD_TOKENIZER_SPECIAL_SLOTS) {
            st = kd_fail(KD_ERR_CONFIG, "%s: added_tokens_decoder: id \"%s\" is not one of the special ids %d..%d", path,
                         e->string, t->n_base, t->n_base + KD_TOKENIZER_SPECIAL_SLOTS - 1);
            goto done;
        }
        if (!cJSON_IsString(content) || !content->valuestring[0]) {
            st = kd_fail(KD_ERR_CONFIG, "%s: added_tokens_decoder[\"%s\"].content: expected a non-empty string", path,
                         e->string);
            goto done;
        }
        name[id - t->n_base] = content->valuestring;
    }
    char reserved[KD_TOKENIZER_SPECIAL_SLOTS][40];
    size_t extra = 0;
    for (int i = 0; i < KD_TOKENIZER_SPECIAL_SLOTS; i++) {
        if (!name[i]) {
            snprintf(reserved[i], sizeof reserved[i], "<|reserved_token_%d|>", t->n_base + i);
            name[i] = reserved[i];
        }
        extra += strlen(name[i]);
    }
    size_t base = t->off[t->n_base];
    unsigned char *nb = realloc(t->bytes, base + extra + 1);
    if (!nb) { st = kd_fail(KD_ERR_NOMEM, "%s: out of memory", path); goto done; }
    t->bytes = nb;
    size_t o = base;
    for (int i = 0; i < KD_TOKENIZER_SPECIAL_SLOTS; i++) {
        size_t n = strlen(name[i]);
        memcpy(t->bytes + o, name[i], n);
        t->special_first[(unsigned char)name[i][0]] = true;
        o += n;
        t->off[t->n_base + i + 1] = o;
    }
    t->n_ids = t->n_base + KD_TOKENIZER_SPECIAL_SLOTS;
done:
    cJSON_Delete(root);
    return st;
}

kd_status kd_tokenizer_open(const char *dir, kd_tokenizer **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_tokenizer_open: out is NULL");
    *out = NULL;
    if (!dir) return kd_fail(KD_ERR_ARG, "kd_tokenizer_open: dir is NULL");
    kd_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return kd_fail(KD_ERR_NOMEM, "kd_tokenizer_open: out of memory");
    char path[4096];
    snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    kd_status st = load_ranks(t, path);
    if (st == KD_OK) st = build_table(t, path);
    if (st == KD_OK) {
        snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
        st = load_specials(t, path);
    }
    if (st == KD_OK) {
        int err;
        PCRE2_SIZE at;
        t->re = pcre2_compile((PCRE2_SPTR)KIMI_PATTERN, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &at, NULL);
        if (!t->re) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(err, msg, sizeof msg);
            st = kd_fail(KD_ERR_BACKEND, "kd_tokenizer_open: PCRE2 rejects the pre-tokenizer pattern at %zu: %s",
                         (size_t)at, (const char *)msg);
        } else {
            pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE);   /* where PCRE2 has no JIT, it interprets */
        }
    }
    if (st != KD_OK) {
        kd_tokenizer_close(t);
        return kd_fail_context(st, "kd_tokenizer_open(%s)", dir);
    }
    *out = t;
    return KD_OK;
}

void kd_tokenizer_close(kd_tokenizer *t) {
    if (!t) return;
    pcre2_code_free(t->re);
    free(t->bytes);
    free(t->off);
    free(t->slot);
    free(t);
}

int kd_tokenizer_n_base(const kd_tokenizer *t) { return t ? t->n_base : 0; }
int kd_tokenizer_n_ids(const kd_tokenizer *t) { return t ? t->n_ids : 0; }

/* the ids being written: count all, store those that fit */
typedef struct sink {
    int32_t *ids;
    size_t cap, n;
} sink;
static void put(sink *s, int32_t id) {
    if (s->n < s->cap) s->ids[s->n] = id;
    s->n++;
}

/* one pre-tokenizer piece: tiktoken's byte-pair merge (parts[i] = the start of part i and the
 * rank of the bytes of parts i and i + 1 together) */
typedef struct part {
    size_t start;
    int32_t rank;   /* -1: not a token (tiktoken's Rank::MAX) */
} part;
static int32_t pair_rank(const kd_tokenizer *t, const unsigned char *p, const part *parts, size_t n_parts, size_t i) {
    return i + 2 < n_parts ? rank_of(t, p + parts[i].start, parts[i + 2].start - parts[i].start) : -1;
}
static kd_status encode_piece(const kd_tokenizer *t, const unsigned char *p, size_t n, part *parts, sink *s) {
    int32_t whole = rank_of(t, p, n);
    if (whole >= 0) { put(s, whole); return KD_OK; }
    size_t np = n + 1;   /* parts 0..n-1 are the bytes, part n the end */
    for (size_t i = 0; i < np; i++) parts[i].start = i;
    for (size_t i = 0; i < np; i++) parts[i].rank = pair_rank(t, p, parts, np, i);
    for (;;) {
        size_t best = np;
        for (size_t i = 0; i + 1 < np; i++)
            if (parts[i].rank >= 0 && (best == np || parts[i].rank < parts[best].rank)) best = i;
        if (best == np) break;
        memmove(parts + best + 1, parts + best + 2, (np - best - 2) * sizeof *parts);   /* part best takes best + 1 */
        np--;
        parts[best].rank = pair_rank(t, p, parts, np, best);
        if (best > 0) parts[best - 1].rank = pair_rank(t, p, parts, np, best - 1);
    }
    for (size_t i = 0; i + 1 < np; i++) put(s, rank_of(t, p + parts[i].start, parts[i + 1].start - parts[i].start));
    return KD_OK;
}

/* text[0..n) of one segment (between special tokens), `base` bytes into the caller's text */
static kd_status encode_ordinary(const kd_tokenizer *t, const unsigned char *text, size_t n, size_t base,
                                 pcre2_match_data *md, part *parts, sink *s) {
    size_t at = 0;
    uint32_t check = 0;   /* the first match checks the whole segment's UTF-8; the rest need not */
    while (at < n) {
        int rc = pcre2_match(t->re, text, n, at, check, md, NULL);
        check = PCRE2_NO_UTF_CHECK;
        if (rc == PCRE2_ERROR_NOMATCH) break;   /* the pattern covers every character: not reached */
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof msg);
            if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21)
                return kd_fail(KD_ERR_ARG, "kd_tokenizer_encode: the text is not UTF-8 at byte %zu: %s",
                               base + (size_t)pcre2_get_startchar(md), (const char *)msg);
            return kd_fail(KD_ERR_BACKEND, "kd_tokenizer_encode: PCRE2 match at byte %zu: %s", base + at,
                           (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        KD_TRY(encode_piece(t, text + ov[0], ov[1] - ov[0], parts, s));
        at = ov[1];
    }
    return KD_OK;
}

/* the earliest special string in text[from..n) (the longest where several start there) */
static bool next_special(const kd_tokenizer *t, const unsigned char *text, size_t n, size_t from, size_t *at,
                         int32_t *id) {
    bool found = false;
    for (size_t i = from; i < n && !found; i++) {
        if (!t->special_first[text[i]]) continue;
        size_t best = 0;
        for (int k = t->n_base; k < t->n_ids; k++) {
            size_t len = t->off[k + 1] - t->off[k];
            if (len > best && len <= n - i && !memcmp(text + i, t->bytes + t->off[k], len)) {
                best = len;
                *id = k;
                *at = i;
                found = true;
            }
        }
    }
    return found;
}

kd_status kd_tokenizer_encode(const kd_tokenizer *t, const char *text, size_t n_bytes, int parse_special,
                              int32_t *ids, size_t cap, size_t *n_ids) {
    if (!t || (!text && n_bytes) || (!ids && cap) || !n_ids)
        return kd_fail(KD_ERR_ARG, "kd_tokenizer_encode: NULL argument (tokenizer %p, text %p, ids %p, n_ids %p)",
                       (const void *)t, (const void *)text, (void *)ids, (void *)n_ids);
    *n_ids = 0;
    const unsigned char *u = (const unsigned char *)text;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->re, NULL);
    part *parts = malloc((n_bytes + 1) * sizeof *parts);
    if (!md || !parts) {
        pcre2_match_data_free(md);
        free(parts);
        return kd_fail(KD_ERR_NOMEM, "kd_tokenizer_encode: out of memory for %zu bytes of text", n_bytes);
    }
    sink s = {ids, cap, 0};
    kd_status st = KD_OK;
    size_t pos = 0;
    while (st == KD_OK && pos < n_bytes) {
        size_t at = n_bytes;
        int32_t id = -1;
        if (parse_special && !next_special(t, u, n_bytes, pos, &at, &id)) at = n_bytes;
        st = encode_ordinary(t, u + pos, at - pos, pos, md, parts, &s);
        if (st == KD_OK && at < n_bytes) {
            put(&s, id);
            at += t->off[id + 1] - t->off[id];
        }
        pos = at;
    }
    pcre2_match_data_free(md);
    free(parts);
    if (st != KD_OK) return st;
    *n_ids = s.n;
    if (s.n > cap) return kd_fail(KD_ERR_ARG, "kd_tokenizer_encode: ids has room for %zu, the text needs %zu", cap, s.n);
    return KD_OK;
}

kd_status kd_tokenizer_decode(const kd_tokenizer *t, const int32_t *ids, size_t n_ids, char *out, size_t cap,
                              size_t *n_bytes) {
    if (!t || (!ids && n_ids) || (!out && cap) || !n_bytes)
        return kd_fail(KD_ERR_ARG, "kd_tokenizer_decode: NULL argument (tokenizer %p, ids %p, out %p, n_bytes %p)",
                       (const void *)t, (const void *)ids, (void *)out, (void *)n_bytes);
    *n_bytes = 0;
    size_t n = 0;
    for (size_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_ids)
            return kd_fail(KD_ERR_ARG, "kd_tokenizer_decode: ids[%zu] = %d is outside 0..%d", i, ids[i], t->n_ids - 1);
        size_t len = t->off[ids[i] + 1] - t->off[ids[i]];
        if (n + len <= cap) memcpy(out + n, t->bytes + t->off[ids[i]], len);
        n += len;
    }
    *n_bytes = n;
    if (n > cap && out)
        return kd_fail(KD_ERR_ARG, "kd_tokenizer_decode: out has room for %zu bytes, the ids need %zu", cap, n);
    return KD_OK;
}

kd_status kd_tokenizer_special(const kd_tokenizer *t, const char *name, int32_t *id) {
    if (!t || !name || !id) return kd_fail(KD_ERR_ARG, "kd_tokenizer_special: NULL argument");
    size_t n = strlen(name);
    for (int k = t->n_base; k < t->n_ids; k++)
        if (t->off[k + 1] - t->off[k] == n && !memcmp(t->bytes + t->off[k], name, n)) {
            *id = k;
            return KD_OK;
        }
    return kd_fail(KD_ERR_ARG, "kd_tokenizer_special: \"%s\" is not a special token", name);
}
