/* json.c: see json.h. Config files are small; the whole text is read, then parsed. */
#include "json.h"
#include "error.h"
#include <stdbool.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the largest files read whole are a 1T-parameter checkpoint's index and a tiktoken.model:
 * a few MB each */
enum { KD_TEXT_MAX_BYTES = 256 << 20 };

kd_status kd_read_text(const char *path, char **out, size_t *n, bool *missing) {
    *out = NULL;
    if (n) *n = 0;
    if (missing) *missing = false;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (missing && errno == ENOENT) { *missing = true; return KD_OK; }
        return kd_fail(KD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    kd_status st = KD_OK;
    for (;;) {
        if (len + 65536 + 1 > cap) {
            cap = (len + 65536 + 1) * 2;
            char *nb = cap <= KD_TEXT_MAX_BYTES ? realloc(buf, cap) : NULL;
            if (!nb) { st = kd_fail(KD_ERR_NOMEM, "%s: cannot hold %zu bytes of text", path, cap); break; }
            buf = nb;
        }
        size_t r = fread(buf + len, 1, cap - len - 1, f);
        len += r;
        if (r == 0) break;
    }
    if (st == KD_OK && ferror(f)) st = kd_fail(KD_ERR_IO, "%s: read error", path);
    fclose(f);
    if (st != KD_OK) { free(buf); return st; }
    buf[len] = 0;
    *out = buf;
    if (n) *n = len;
    return KD_OK;
}

typedef struct key_ref { const char *key; } key_ref;
static int cmp_key(const void *a, const void *b) { return strcmp(((const key_ref *)a)->key, ((const key_ref *)b)->key); }

/* path[0, len): the JSON path of j ("" at the top, else "a.b[3]"), cut to cap; nesting is
 * bounded by cJSON's limit */
static kd_status check_unique(const cJSON *j, const char *what, char *path, size_t len, size_t cap) {
    if (!cJSON_IsObject(j) && !cJSON_IsArray(j)) return KD_OK;
    int n = cJSON_GetArraySize(j);
    if (cJSON_IsObject(j) && n > 1) {
        key_ref *keys = malloc((size_t)n * sizeof *keys);
        if (!keys) return kd_fail(KD_ERR_NOMEM, "%s: cannot allocate %d keys", what, n);
        int k = 0;
        for (const cJSON *e = j->child; e; e = e->next) keys[k++].key = e->string;
        qsort(keys, (size_t)n, sizeof *keys, cmp_key);
        const char *dup = NULL;
        for (int i = 1; i < n && !dup; i++)
            if (strcmp(keys[i - 1].key, keys[i].key) == 0) dup = keys[i].key;
        free(keys);
        if (dup) {
            char key[160], in[320];
            path[len] = 0;
            return kd_fail(KD_ERR_FORMAT, "%s: key '%s' appears more than once in %s%s%s", what,
                           kd_printable(dup, key, sizeof key), len ? "object '" : "the top-level object",
                           len ? kd_printable(path, in, sizeof in) : "", len ? "'" : "");
        }
    }
    int i = 0;
    for (const cJSON *e = j->child; e; e = e->next, i++) {
        int w = cJSON_IsObject(j) ? snprintf(path + len, cap - len, "%s%s", len ? "." : "", e->string)
                                  : snprintf(path + len, cap - len, "[%d]", i);
        size_t nl = w < 0 ? len : len + (size_t)w < cap ? len + (size_t)w : cap - 1;
        KD_TRY(check_unique(e, what, path, nl, cap));
    }
    return KD_OK;
}

kd_status kd_json_parse(const char *text, size_t len, const char *what, cJSON **out) {
    *out = NULL;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root)
        return kd_fail(KD_ERR_FORMAT, "%s: not valid JSON (error near byte %ld)", what, end ? (long)(end - text) : 0L);
    char path[512];
    kd_status st = check_unique(root, what, path, 0, sizeof path);
    if (st != KD_OK) { cJSON_Delete(root); return st; }
    *out = root;
    return KD_OK;
}

kd_status kd_json_load(const char *path, cJSON **out, bool *missing) {
    *out = NULL;
    char *text;
    size_t len;
    KD_TRY(kd_read_text(path, &text, &len, missing));
    if (!text) return KD_OK;                       /* missing, and the caller allows it */
    cJSON *root;
    kd_status st = kd_json_parse(text, len, path, &root);
    free(text);
    if (st == KD_OK && !cJSON_IsObject(root)) {
        st = kd_fail(KD_ERR_FORMAT, "%s: expected a JSON object", path);
        cJSON_Delete(root);
        root = NULL;
    }
    *out = root;
    return st;
}
