/* json.c: see json.h. Config files are small; the whole text is read, then parsed. */
#include "json.h"
#include "error.h"
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

kd_status kd_json_load(const char *path, cJSON **out, bool *missing) {
    *out = NULL;
    char *text;
    KD_TRY(kd_read_text(path, &text, NULL, missing));
    if (!text) return KD_OK;                       /* missing, and the caller allows it */
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 0);
    kd_status st = KD_OK;
    if (!root)
        st = kd_fail(KD_ERR_FORMAT, "%s: not valid JSON (error near byte %ld)", path, end ? (long)(end - text) : 0L);
    else if (!cJSON_IsObject(root))
        st = kd_fail(KD_ERR_FORMAT, "%s: expected a JSON object", path);
    free(text);
    if (st != KD_OK) { cJSON_Delete(root); return st; }
    *out = root;
    return KD_OK;
}
