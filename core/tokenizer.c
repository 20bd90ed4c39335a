/* tokenizer.c: Kimi K2.6's tokenizer, tiktoken byte-pair encoding (kimi_k2.md section 4).
 *
 * Files of a checkpoint directory: `tiktoken.model`, one `base64(token bytes) rank` per line
 * (ranks 0..n_base-1 are the base ids), and `tokenizer_config.json`, whose added_tokens_decoder
 * names some of the KD_TOKENIZER_SPECIAL_SLOTS special ids that follow (the others are
 * `<|reserved_token_{id}|>`, as Kimi's TikTokenTokenizer names them).
 *
 * Encoding is Kimi's TikTokenTokenizer.encode: the text is first cut into chunks of at most
 * 400000 characters, each chunk into runs of at most 25000 consecutive whitespace or
 * non-whitespace characters (Python's str.isspace), and each run is encoded on its own as
 * tiktoken does: with special parsing on, special-token strings become their ids; the text
 * between them is cut into pieces by Kimi's pre-tokenizer pattern (PCRE2, UTF-8 with Unicode
 * properties); a piece that is a token is that token, otherwise its bytes are merged pairwise,
 * always the adjacent pair whose bytes have the lowest rank (leftmost on ties), until no pair
 * is a token. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "kdtree.h"
#include "error.h"
#include "json.h"
#include <pcre2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Kimi's pattern as tiktoken's regex engine reads it. Its class intersections [A&&[^\p{Han}]]
 * (fancy-regex) are written as (?:(?!Han)[A]), which PCRE2 takes. Two meanings differ between
 * the engines and are spelled out: \p{Han} is the Script property there, while PCRE2 (10.40 on)
 * takes Script_Extensions, which adds CJK punctuation such as 。「」・ (so \p{sc:Han}); and
 * \s is Unicode's White_Space there, while PCRE2's also takes U+180E (so the class WS). */
#define HAN "\\p{sc:Han}"
#define WS "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"
#define NOT_HAN_UPPER "(?:(?!" HAN ")[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])"
#define NOT_HAN_LOWER "(?:(?!" HAN ")[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])"
#define CONTRACTION "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
static const char KIMI_PATTERN[] =
    "[" HAN "]+"
    "|[^\\r\\n\\p{L}\\p{N}]?" NOT_HAN_UPPER "*" NOT_HAN_LOWER "+" CONTRACTION
    "|[^\\r\\n\\p{L}\\p{N}]?" NOT_HAN_UPPER "+" NOT_HAN_LOWER "*" CONTRACTION
    "|\\p{N}{1,3}"
    "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*"
    "|[" WS "]*[\\r\\n]+"
    "|[" WS "]+(?![^" WS "])"
    "|[" WS "]+";

/* ids by their bytes: open addressing, -1 = empty */
typedef struct id_table {
    int32_t *slot;
    uint32_t mask;
} id_table;

struct kd_tokenizer {
    int n_base;                /* base ranks; the special ids follow (id_count) */
    unsigned char *bytes;      /* every id's bytes, concatenated */
    size_t *off;               /* id -> its bytes: bytes + off[id], off[id + 1] - off[id] long */
    id_table ranks;            /* the base ranks */
    id_table specials;         /* the special ids (the lowest id of a repeated string) */
    int n_special_lens;
    size_t special_lens[KD_TOKENIZER_SPECIAL_SLOTS];   /* their distinct lengths, longest first */
    bool special_single[256];            /* the special strings of one byte */
    uint64_t special_pair[65536 / 64];   /* the first two bytes of the longer ones, a bit each */
    pcre2_code *re;
};

static uint32_t hash_bytes(const unsigned char *p, size_t n) {
    uint32_t h = 2166136261u;   /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

static int id_count(const kd_tokenizer *t) { return t->n_base + KD_TOKENIZER_SPECIAL_SLOTS; }
/* the bytes of an id (base or special), *len long */
static const unsigned char *id_bytes(const kd_tokenizer *t, int id, size_t *len) {
    *len = t->off[id + 1] - t->off[id];
    return t->bytes + t->off[id];
}

/* a table with room for n ids (at most half full) */
static bool table_init(id_table *tab, int n) {
    uint32_t size = 16;
    while (size < 2u * (uint32_t)n) size <<= 1;
    tab->slot = malloc(size * sizeof *tab->slot);
    if (!tab->slot) return false;
    memset(tab->slot, 0xff, size * sizeof *tab->slot);
    tab->mask = size - 1;
    return true;
}
/* the id of tab whose bytes are p[0..n), or -1 */
static int32_t table_find(const kd_tokenizer *t, const id_table *tab, const unsigned char *p, size_t n) {
    for (uint32_t i = hash_bytes(p, n) & tab->mask;; i = (i + 1) & tab->mask) {
        int32_t r = tab->slot[i];
        if (r < 0) return -1;
        size_t len;
        const unsigned char *b = id_bytes(t, r, &len);
        if (len == n && !memcmp(b, p, n)) return r;
    }
}
/* id into tab, unless an id with its bytes is there: then that id, else -1 (one probe) */
static int32_t table_insert(const kd_tokenizer *t, id_table *tab, int32_t id) {
    size_t n;
    const unsigned char *p = id_bytes(t, id, &n);
    uint32_t i = hash_bytes(p, n) & tab->mask;
    for (; tab->slot[i] >= 0; i = (i + 1) & tab->mask) {
        size_t len;
        const unsigned char *b = id_bytes(t, tab->slot[i], &len);
        if (len == n && !memcmp(b, p, n)) return tab->slot[i];
    }
    tab->slot[i] = id;
    return -1;
}
/* the base rank whose bytes are p[0..n), or -1 */
static int32_t rank_of(const kd_tokenizer *t, const unsigned char *p, size_t n) { return table_find(t, &t->ranks, p, n); }

/* a base64 digit's value, or -1 */
static int base64_digit(char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}
/* standard base64 (with '=' padding) of s[0..n) into out; the decoded length, or -1 */
static long base64_decode(const char *s, size_t n, unsigned char *out) {
    if (n == 0 || n % 4) return -1;
    long len = 0;
    for (size_t i = 0; i < n; i += 4) {
        uint32_t v = 0;
        int pad = 0;
        for (int j = 0; j < 4; j++) {
            const char c = s[i + j];
            const int d = base64_digit(c);
            if (c == '=' && i + 4 == n && j >= 2) { pad++; v <<= 6; continue; }
            if (d < 0 || pad) return -1;
            v = v << 6 | (uint32_t)d;
        }
        out[len++] = (unsigned char)(v >> 16);
        if (pad < 2) out[len++] = (unsigned char)(v >> 8);
        if (pad < 1) out[len++] = (unsigned char)v;
    }
    return len;
}

/* tiktoken.model -> the base ranks' bytes (t->bytes, t->off[0..n_base]) */
static kd_status load_ranks(kd_tokenizer *t, const char *path) {
    char *text = NULL;
    size_t n = 0;
    KD_TRY(kd_read_text(path, &text, &n, NULL));
    kd_status st = KD_OK;
    int lines = 0;   /* tokens: the lines that are not empty */
    for (size_t i = 0; i < n; i++)
        if (text[i] != '\n' && text[i] != '\r' && (i == 0 || text[i - 1] == '\n')) lines++;
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
        char *stop = end > p && end[-1] == '\r' ? end - 1 : end;   /* CRLF */
        if (stop == p) { p = end + 1; continue; }                   /* empty lines are skipped, as tiktoken does */
        char *sp = memchr(p, ' ', (size_t)(stop - p));
        char *rank_end = NULL;
        long rank = sp && sp + 1 < stop && sp[1] >= '0' && sp[1] <= '9' ? strtol(sp + 1, &rank_end, 10) : -1;
        if (rank < 0 || rank_end != stop) {
            st = kd_fail(KD_ERR_FORMAT, "%s: line %d: expected `base64 rank`", path, line + 1);
            goto done;
        }
        if (rank >= lines) {
            st = kd_fail(KD_ERR_FORMAT, "%s: line %d: rank %ld is past the %d tokens of the file", path, line + 1, rank,
                         lines);
            goto done;
        }
        if (len_of[rank] >= 0) {
            st = kd_fail(KD_ERR_FORMAT, "%s: line %d: rank %ld is listed twice", path, line + 1, rank);
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
    if (!table_init(&t->ranks, t->n_base)) return kd_fail(KD_ERR_NOMEM, "%s: out of memory", path);
    for (int r = 0; r < t->n_base; r++) {
        int32_t same = table_insert(t, &t->ranks, r);
        if (same >= 0) return kd_fail(KD_ERR_FORMAT, "%s: rank %d repeats the bytes of rank %d", path, r, same);
    }
    for (int b = 0; b < 256; b++) {   /* every piece must come apart into tokens */
        unsigned char c = (unsigned char)b;
        if (rank_of(t, &c, 1) < 0) return kd_fail(KD_ERR_FORMAT, "%s: byte 0x%02x has no rank", path, b);
    }
    return KD_OK;
}

/* the UTF-8 character at p (n bytes left): its length, and its code point in *c; 0 when the
 * bytes are not one (overlong, surrogate, past U+10FFFF, cut short) */
static size_t utf8_char(const unsigned char *p, size_t n, uint32_t *c) {
    if (p[0] < 0x80) { *c = p[0]; return 1; }
    size_t len = p[0] >= 0xF0 ? 4 : p[0] >= 0xE0 ? 3 : p[0] >= 0xC0 ? 2 : 0;
    if (!len || len > n || p[0] > 0xF4) return 0;
    uint32_t v = p[0] & (0x7F >> len);
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        v = v << 6 | (p[i] & 0x3F);
    }
    static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < least[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
    *c = v;
    return len;
}
/* whether p[0..n) is UTF-8 throughout */
static bool utf8_valid(const unsigned char *p, size_t n) {
    uint32_t c;
    for (size_t i = 0, len; i < n; i += len)
        if (!(len = utf8_char(p + i, n - i, &c))) return false;
    return true;
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
        char qid[64];
        kd_printable(e->string, qid, sizeof qid);
        if (*end || id < t->n_base || id >= t->n_base + KD_TOKENIZER_SPECIAL_SLOTS) {
            st = kd_fail(KD_ERR_CONFIG, "%s: added_tokens_decoder: id \"%s\" is not one of the special ids %d..%d", path,
                         qid, t->n_base, t->n_base + KD_TOKENIZER_SPECIAL_SLOTS - 1);
            goto done;
        }
        if (!cJSON_IsString(content) || !content->valuestring[0] ||
            !utf8_valid((const unsigned char *)content->valuestring, strlen(content->valuestring))) {
            /* matching one mid-character would hand PCRE2 text cut inside a character */
            st = kd_fail(KD_ERR_CONFIG, "%s: added_tokens_decoder[\"%s\"].content: expected a non-empty UTF-8 string",
                         path, qid);
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
        if (n == 1) t->special_single[(unsigned char)name[i][0]] = true;
        else {
            unsigned pair = (unsigned char)name[i][0] << 8 | (unsigned char)name[i][1];
            t->special_pair[pair / 64] |= 1ull << pair % 64;
        }
        o += n;
        t->off[t->n_base + i + 1] = o;
    }
    if (!table_init(&t->specials, KD_TOKENIZER_SPECIAL_SLOTS)) {
        st = kd_fail(KD_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    for (int i = 0; i < KD_TOKENIZER_SPECIAL_SLOTS; i++) {
        table_insert(t, &t->specials, t->n_base + i);   /* a repeated string keeps its first id */
        size_t n = strlen(name[i]), k = 0;
        while (k < (size_t)t->n_special_lens && t->special_lens[k] > n) k++;
        if (k < (size_t)t->n_special_lens && t->special_lens[k] == n) continue;
        memmove(t->special_lens + k + 1, t->special_lens + k, (t->n_special_lens - k) * sizeof *t->special_lens);
        t->special_lens[k] = n;
        t->n_special_lens++;
    }
done:
    cJSON_Delete(root);
    return st;
}

kd_status kd_tokenizer_open(const char *dir, kd_tokenizer **out) {
    if (!out) return kd_fail(KD_ERR_ARG, "kd_tokenizer_open: out is NULL");
    *out = NULL;
    if (!dir) return kd_fail(KD_ERR_ARG, "kd_tokenizer_open: dir is NULL");
    char ranks[4096], config[4096];
    if (snprintf(ranks, sizeof ranks, "%s/tiktoken.model", dir) >= (int)sizeof ranks ||
        snprintf(config, sizeof config, "%s/tokenizer_config.json", dir) >= (int)sizeof config)
        return kd_fail(KD_ERR_ARG, "%s: path too long", dir);
    kd_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return kd_fail(KD_ERR_NOMEM, "kd_tokenizer_open: out of memory");
    kd_status st = load_ranks(t, ranks);
    if (st == KD_OK) st = build_table(t, ranks);
    if (st == KD_OK) st = load_specials(t, config);
    if (st == KD_OK) {
        int err;
        PCRE2_SIZE at;
        t->re = pcre2_compile((PCRE2_SPTR)KIMI_PATTERN, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &at, NULL);
        if (!t->re) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(err, msg, sizeof msg);
            st = kd_fail(KD_ERR_UNSUPPORTED, "kd_tokenizer_open: PCRE2 rejects the pre-tokenizer pattern at %zu: %s",
                         (size_t)at, (const char *)msg);
        } else {
            pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE);   /* where PCRE2 has no JIT, it interprets */
        }
    }
    if (st != KD_OK) {
        kd_tokenizer_close(t);
        return kd_fail_context(st, "loading tokenizer %s", dir);
    }
    *out = t;
    return KD_OK;
}

void kd_tokenizer_close(kd_tokenizer *t) {
    if (!t) return;
    pcre2_code_free(t->re);
    free(t->bytes);
    free(t->off);
    free(t->ranks.slot);
    free(t->specials.slot);
    free(t);
}

int kd_tokenizer_n_base(const kd_tokenizer *t) { return t ? t->n_base : 0; }
int kd_tokenizer_n_ids(const kd_tokenizer *t) { return t ? id_count(t) : 0; }

/* the ids being written: count all, store those that fit */
typedef struct sink {
    int32_t *ids;
    size_t cap, n;
} sink;
static void put(sink *s, int32_t id) {
    if (s->n < s->cap) s->ids[s->n] = id;
    s->n++;
}

/* One pre-tokenizer piece, merged as tiktoken's _byte_pair_merge merges it: always the
 * adjacent pair of parts whose joined bytes have the lowest rank, the leftmost of equals. A
 * min-heap of (rank, left part) finds it in log time (tiktoken scans all pairs each time,
 * quadratic in a long piece); entries left stale by a merge are skipped when popped. Parts are
 * named by their first byte, so part order is byte order and the heap's tie-break is tiktoken's. */
typedef struct pair {
    int32_t rank;
    uint32_t left;
} pair;
typedef struct merge_buf {     /* scratch for the longest piece seen so far */
    uint32_t *next;            /* part -> the next part's first byte (n: none; never past n) */
    uint32_t *prev;            /* part -> the previous part (UINT32_MAX: none) */
    int32_t *rank;             /* part -> the rank of it joined with its next part, -1 none */
    pair *heap;
    size_t cap;                /* bytes of piece the arrays hold */
} merge_buf;

static kd_status merge_room(merge_buf *b, size_t n) {
    if (n <= b->cap) return KD_OK;
    if (n > UINT32_MAX / 4) return kd_fail(KD_ERR_ARG, "kd_tokenizer_encode: a piece of %zu bytes is too long", n);
    size_t cap = n < 256 ? 256 : n;
    uint32_t *next = realloc(b->next, cap * sizeof *next);
    if (next) b->next = next;
    uint32_t *prev = realloc(b->prev, cap * sizeof *prev);
    if (prev) b->prev = prev;
    int32_t *rank = realloc(b->rank, cap * sizeof *rank);
    if (rank) b->rank = rank;
    pair *heap = realloc(b->heap, 3 * cap * sizeof *heap);   /* n at first, two more per merge */
    if (heap) b->heap = heap;
    if (!next || !prev || !rank || !heap) return kd_fail(KD_ERR_NOMEM, "kd_tokenizer_encode: out of memory");
    b->cap = cap;
    return KD_OK;
}
static bool pair_before(pair a, pair b) { return a.rank < b.rank || (a.rank == b.rank && a.left < b.left); }
static void heap_push(pair *h, size_t *n, pair x) {
    size_t i = (*n)++;
    while (i > 0 && pair_before(x, h[(i - 1) / 2])) { h[i] = h[(i - 1) / 2]; i = (i - 1) / 2; }
    h[i] = x;
}
static pair heap_pop(pair *h, size_t *n) {
    pair top = h[0], x = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && pair_before(h[c + 1], h[c])) c++;
        if (!pair_before(h[c], x)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = x;
    return top;
}
/* the rank of part i joined with its next part (n bytes in the piece) */
static int32_t joined_rank(const kd_tokenizer *t, const unsigned char *p, size_t n, const merge_buf *b, uint32_t i) {
    uint32_t j = b->next[i];
    if (j >= n) return -1;
    return rank_of(t, p + i, b->next[j] - i);
}
static kd_status encode_piece(const kd_tokenizer *t, const unsigned char *p, size_t n, merge_buf *b, sink *s) {
    int32_t whole = rank_of(t, p, n);
    if (whole >= 0) { put(s, whole); return KD_OK; }
    KD_TRY(merge_room(b, n));
    size_t heap_n = 0;
    for (uint32_t i = 0; i < n; i++) {
        b->next[i] = i + 1;
        b->prev[i] = i ? i - 1 : UINT32_MAX;
    }
    for (uint32_t i = 0; i < n; i++) {
        b->rank[i] = joined_rank(t, p, n, b, i);
        if (b->rank[i] >= 0) heap_push(b->heap, &heap_n, (pair){b->rank[i], i});
    }
    while (heap_n) {
        pair top = heap_pop(b->heap, &heap_n);
        uint32_t i = top.left;
        if (b->rank[i] != top.rank) continue;   /* stale: part i was merged away or changed */
        uint32_t j = b->next[i];                /* part i takes part j */
        b->next[i] = b->next[j];
        if (b->next[j] < n) b->prev[b->next[j]] = i;
        b->rank[j] = -1;
        b->rank[i] = joined_rank(t, p, n, b, i);
        if (b->rank[i] >= 0) heap_push(b->heap, &heap_n, (pair){b->rank[i], i});
        uint32_t h = b->prev[i];
        if (h != UINT32_MAX) {
            b->rank[h] = joined_rank(t, p, n, b, h);
            if (b->rank[h] >= 0) heap_push(b->heap, &heap_n, (pair){b->rank[h], h});
        }
    }
    for (uint32_t i = 0; i < n; i = b->next[i]) put(s, rank_of(t, p + i, b->next[i] - i));
    return KD_OK;
}

/* what one encode call matches with: the match data, and a JIT stack of up to 16 MB (the
 * default 32 KB overflows on a word of about 10000 characters, and the interpreter then matched
 * it all again; a run of Kimi's split is at most 25000 characters) */
typedef struct matcher {
    pcre2_match_data *md;
    pcre2_match_context *mc;
    pcre2_jit_stack *stack;
} matcher;
static void matcher_free(matcher *mt) {
    pcre2_match_data_free(mt->md);
    pcre2_match_context_free(mt->mc);
    pcre2_jit_stack_free(mt->stack);
}
static kd_status matcher_new(const kd_tokenizer *t, matcher *mt) {
    mt->md = pcre2_match_data_create_from_pattern(t->re, NULL);
    mt->mc = pcre2_match_context_create(NULL);
    mt->stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, NULL);
    if (!mt->md || !mt->mc) {   /* no JIT stack: PCRE2's default one */
        matcher_free(mt);
        return kd_fail(KD_ERR_NOMEM, "kd_tokenizer_encode: out of memory");
    }
    if (mt->stack) pcre2_jit_stack_assign(mt->mc, NULL, mt->stack);
    return KD_OK;
}

/* text[0..n) of one segment (valid UTF-8, between special tokens), `base` bytes into the
 * caller's text */
static kd_status encode_ordinary(const kd_tokenizer *t, const unsigned char *text, size_t n, size_t base,
                                 const matcher *mt, merge_buf *mb, sink *s) {
    size_t at = 0;
    while (at < n) {
        int rc = pcre2_match(t->re, text, n, at, PCRE2_NO_UTF_CHECK, mt->md, mt->mc);
        /* past even the matcher's JIT stack: the interpreter takes it on the heap */
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(t->re, text, n, at, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, mt->md, mt->mc);
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(mt->md);
        if (rc < 0 || ov[0] != at || ov[1] <= at) {   /* the pattern matches every character: not reached */
            PCRE2_UCHAR msg[160] = "the pattern left a character unmatched";
            if (rc < 0) pcre2_get_error_message(rc, msg, sizeof msg);
            return kd_fail(rc == PCRE2_ERROR_NOMEMORY ? KD_ERR_NOMEM : KD_ERR_UNSUPPORTED,
                           "kd_tokenizer_encode: PCRE2 match at byte %zu: %s", base + at,
                           (const char *)msg);
        }
        KD_TRY(encode_piece(t, text + ov[0], ov[1] - ov[0], mb, s));
        at = ov[1];
    }
    return KD_OK;
}

/* whether a special string may start at text[i] (n bytes in all): a cheap filter, so that
 * text full of '<' or '[' is not compared with every special string at each of them */
static bool special_may_start(const kd_tokenizer *t, const unsigned char *text, size_t n, size_t i) {
    if (t->special_single[text[i]]) return true;
    if (i + 1 >= n) return false;
    unsigned pair = text[i] << 8 | text[i + 1];
    return t->special_pair[pair / 64] >> pair % 64 & 1;
}

/* the earliest special string in text[from..n) (the longest where several start there): its
 * place, id and length */
static bool next_special(const kd_tokenizer *t, const unsigned char *text, size_t n, size_t from, size_t *at,
                         int32_t *id, size_t *len_out) {
    for (size_t i = from; i < n; i++) {
        if (!special_may_start(t, text, n, i)) continue;
        for (int k = 0; k < t->n_special_lens; k++) {   /* longest first */
            const size_t len = t->special_lens[k];
            const int32_t s = len <= n - i ? table_find(t, &t->specials, text + i, len) : -1;
            if (s >= 0) {
                *id = s;
                *at = i;
                *len_out = len;
                return true;
            }
        }
    }
    return false;
}

/* one run of Kimi's split (see the top): special strings and the ordinary text between them */
static kd_status encode_run(const kd_tokenizer *t, const unsigned char *u, size_t from, size_t to, int parse_special,
                            const matcher *mt, merge_buf *mb, sink *s) {
    size_t pos = from;
    while (pos < to) {
        size_t at = to, len = 0;
        int32_t id = -1;
        if (parse_special) next_special(t, u, to, pos, &at, &id, &len);
        KD_TRY(encode_ordinary(t, u + pos, at - pos, pos, mt, mb, s));
        if (at < to) put(s, id);
        pos = at + len;
    }
    return KD_OK;
}

/* Python's str.isspace: bidirectional class WS, B or S, or category Zs */
static bool py_isspace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
enum { KIMI_CHUNK_CHARS = 400000, KIMI_RUN_CHARS = 25000 };

kd_status kd_tokenizer_encode(const kd_tokenizer *t, const char *text, size_t n_bytes, int parse_special,
                              int32_t *ids, size_t cap, size_t *n_ids) {
    if (!t || (!text && n_bytes) || (!ids && cap) || !n_ids)
        return kd_fail(KD_ERR_ARG, "kd_tokenizer_encode: NULL argument (tokenizer %p, text %p, ids %p, n_ids %p)",
                       (const void *)t, (const void *)text, (void *)ids, (void *)n_ids);
    *n_ids = 0;
    const unsigned char *u = (const unsigned char *)text;
    matcher mt;
    KD_TRY(matcher_new(t, &mt));
    merge_buf mb = {0};
    sink s = {ids, cap, 0};
    kd_status st = KD_OK;
    /* Kimi's split: runs [start, i) end where a chunk ends or a same-class stretch grows too long */
    size_t start = 0, chunk_chars = 0, run_chars = 0;
    bool run_space = false;
    for (size_t i = 0; i < n_bytes;) {
        uint32_t c;
        size_t len = utf8_char(u + i, n_bytes - i, &c);
        if (!len) {
            st = kd_fail(KD_ERR_ARG, "kd_tokenizer_encode: the text is not UTF-8 at byte %zu", i);
            break;
        }
        if (chunk_chars == KIMI_CHUNK_CHARS) {   /* a new chunk: a new run */
            st = encode_run(t, u, start, i, parse_special, &mt, &mb, &s);
            if (st != KD_OK) break;
            start = i;
            chunk_chars = 0;
        }
        const bool space = py_isspace(c);
        if (chunk_chars == 0 || space != run_space) {
            run_space = space;
            run_chars = 1;
        } else if (++run_chars > KIMI_RUN_CHARS) {
            st = encode_run(t, u, start, i, parse_special, &mt, &mb, &s);
            if (st != KD_OK) break;
            start = i;
            run_chars = 1;
        }
        chunk_chars++;
        i += len;
    }
    if (st == KD_OK) st = encode_run(t, u, start, n_bytes, parse_special, &mt, &mb, &s);
    matcher_free(&mt);
    free(mb.next);
    free(mb.prev);
    free(mb.rank);
    free(mb.heap);
    if (st != KD_OK) return st;
    *n_ids = s.n;
    if (s.n > cap && ids)
        return kd_fail(KD_ERR_ARG, "kd_tokenizer_encode: ids has room for %zu, the text needs %zu", cap, s.n);
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
        if (ids[i] < 0 || ids[i] >= id_count(t))
            return kd_fail(KD_ERR_ARG, "kd_tokenizer_decode: ids[%zu] (from 0) = %d is outside 0..%d", i, ids[i],
                           id_count(t) - 1);
        size_t len;
        const unsigned char *b = id_bytes(t, ids[i], &len);
        if (n + len <= cap) memcpy(out + n, b, len);
        n += len;
    }
    *n_bytes = n;
    if (n > cap && out)
        return kd_fail(KD_ERR_ARG, "kd_tokenizer_decode: out has room for %zu bytes, the ids need %zu", cap, n);
    return KD_OK;
}

kd_status kd_tokenizer_special(const kd_tokenizer *t, const char *name, int32_t *id) {
    if (!t || !name || !id) return kd_fail(KD_ERR_ARG, "kd_tokenizer_special: NULL argument");
    const int32_t s = table_find(t, &t->specials, (const unsigned char *)name, strlen(name));
    if (s >= 0) {
        *id = s;
        return KD_OK;
    }
    char q[128];
    return kd_fail(KD_ERR_ARG, "kd_tokenizer_special: \"%s\" is not a special token", kd_printable(name, q, sizeof q));
}
