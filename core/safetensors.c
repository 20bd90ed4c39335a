/* safetensors.c: safetensors files, single or sharded, memory-mapped read-only.
 *
 * A file is: u64 little-endian header length N, N bytes of JSON, then the data
 * section. The JSON object maps tensor names to {dtype, shape, data_offsets: [begin, end]}
 * (offsets relative to the data section) and may hold "__metadata__" (ignored).
 * Every header is validated before a tensor is used: the file holds the 8 length bytes
 * and the whole header, the header is a JSON object, each entry's shape times its dtype
 * size equals its byte range, ranges lie inside the data section and do not overlap.
 * An unknown dtype is kept (KD_ST_OTHER with its name): it is only an error when the
 * model asks for that tensor.
 *
 * map = false reads the headers only (pread, nothing mapped, data = NULL): that is how
 * kd_inspect reports on checkpoints too large to load here. In that mode a data range may
 * lie past the end of the file (a test may write header-only shards); only the header must
 * be complete.
 */
#include "safetensors.h"
#include "error.h"

#include "json.h"
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The safetensors format caps the header at 100 MB; we allow a little more for
 * very large shard headers, and refuse absurd lengths before allocating. */
enum { ST_HEADER_MAX = 256 * 1024 * 1024 };

const char *kd_st_dtype_name(kd_st_dtype t) {
    switch (t) {
    case KD_ST_F32: return "F32";
    case KD_ST_F16: return "F16";
    case KD_ST_BF16: return "BF16";
    case KD_ST_I32: return "I32";
    case KD_ST_I64: return "I64";
    case KD_ST_OTHER: return "other";
    }
    return "?";
}

/* dtype string -> enum and element size in bytes (0 = size unknown: sizes not checked) */
static kd_st_dtype parse_dtype(const char *s, int *size) {
    static const struct { const char *name; kd_st_dtype t; int size; } known[] = {
        {"F32", KD_ST_F32, 4}, {"F16", KD_ST_F16, 2}, {"BF16", KD_ST_BF16, 2},
        {"I32", KD_ST_I32, 4}, {"I64", KD_ST_I64, 8},
        /* kept as KD_ST_OTHER, but their sizes are known so the byte ranges are checked */
        {"F64", KD_ST_OTHER, 8}, {"I8", KD_ST_OTHER, 1}, {"U8", KD_ST_OTHER, 1},
        {"BOOL", KD_ST_OTHER, 1}, {"I16", KD_ST_OTHER, 2}, {"U16", KD_ST_OTHER, 2},
        {"U32", KD_ST_OTHER, 4}, {"U64", KD_ST_OTHER, 8}, {"F8_E4M3", KD_ST_OTHER, 1},
        {"F8_E5M2", KD_ST_OTHER, 1}, {"F8_E8M0", KD_ST_OTHER, 1},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(s, known[i].name) == 0) { *size = known[i].size; return known[i].t; }
    *size = 0;
    return KD_ST_OTHER;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const kd_st_tensor *)a)->name, ((const kd_st_tensor *)b)->name);
}

void kd_st_close(kd_st_set *set) {
    if (!set) return;
    for (int i = 0; i < set->n_tensors; i++) free(set->tensors[i].name);
    free(set->tensors);
    for (int i = 0; i < set->n_files; i++) {
        if (set->files[i].map) munmap(set->files[i].map, set->files[i].size);
        free(set->files[i].path);
    }
    free(set->files);
    memset(set, 0, sizeof *set);
}

const kd_st_tensor *kd_st_find(const kd_st_set *set, const char *name) {
    if (!set || !name || set->n_tensors == 0) return NULL;
    kd_st_tensor key;
    key.name = (char *)name;
    return bsearch(&key, set->tensors, (size_t)set->n_tensors, sizeof key, cmp_tensor_name);
}

/* ---- reading one file ---- */

static kd_status read_exact(int fd, void *buf, size_t n, uint64_t off, const char *path) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = pread(fd, (char *)buf + done, n - done, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return kd_fail(KD_ERR_IO, "%s: read failed at byte %llu: %s", path,
                           (unsigned long long)(off + done), strerror(errno));
        }
        if (r == 0)
            return kd_fail(KD_ERR_IO, "%s: truncated: expected %zu bytes at offset %llu, file ends after %zu",
                           path, n, (unsigned long long)off, done);
        done += (size_t)r;
    }
    return KD_OK;
}

typedef struct range { uint64_t begin, end; int idx; } range;
static int cmp_range(const void *a, const void *b) {
    const range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* a JSON number that is a non-negative integer fitting in 2^53 */
static bool json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return false;
    double d = j->valuedouble;
    if (!(d >= 0) || d > 9007199254740992.0 || d != (double)(uint64_t)d) return false;
    *out = (uint64_t)d;
    return true;
}

static kd_status grow_tensors(kd_st_set *set, int extra) {
    int need = set->n_tensors + extra;
    kd_st_tensor *t = realloc(set->tensors, (size_t)(need > 0 ? need : 1) * sizeof *t);
    if (!t) return kd_fail(KD_ERR_NOMEM, "safetensors: cannot allocate the table of %d tensors", need);
    set->tensors = t;
    return KD_OK;
}

/* Parse the header JSON of file `fi` (data section of data_len bytes, or unknown when
 * !check_range) and append its tensors to set->tensors. */
static kd_status parse_header(kd_st_set *set, int fi, const char *json, size_t json_len,
                              const char *data, uint64_t data_len, bool check_range) {
    const char *path = set->files[fi].path;
    char what[4200];
    snprintf(what, sizeof what, "%s: safetensors header (%zu bytes)", path, json_len);
    cJSON *root;
    kd_status st = kd_json_parse(json, json_len, what, &root);
    if (st != KD_OK) return st;
    range *ranges = NULL;
    int first = set->n_tensors;
    if (!cJSON_IsObject(root)) {
        st = kd_fail(KD_ERR_FORMAT, "%s: safetensors header: expected a JSON object, got %s", path,
                     cJSON_IsArray(root) ? "an array" : "a scalar");
        goto done;
    }
    int n = cJSON_GetArraySize(root);
    if ((st = grow_tensors(set, n)) != KD_OK) goto done;
    ranges = malloc((size_t)(n > 0 ? n : 1) * sizeof *ranges);
    if (!ranges) { st = kd_fail(KD_ERR_NOMEM, "%s: cannot allocate %d ranges", path, n); goto done; }
    int nr = 0;
    for (cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) continue;
        /* names are quoted in later messages: only printable text (kd_printable leaves it as is) */
        char qname[256];
        const char *name = kd_printable(e->string, qname, sizeof qname);
        if (strcmp(name, e->string) != 0) {
            st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected a name of printable UTF-8 (no control bytes, "
                         "quotes or backslashes)", path, name);
            goto done;
        }
        if (!cJSON_IsObject(e)) {
            st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected an object {dtype, shape, data_offsets}", path, name);
            goto done;
        }
        const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
        const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
        if (!cJSON_IsString(jd)) {
            st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': field 'dtype': expected a string", path, name);
            goto done;
        }
        if (!cJSON_IsArray(js) || cJSON_GetArraySize(js) > 8) {
            st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': field 'shape': expected an array of at most 8 integers",
                         path, name);
            goto done;
        }
        if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2) {
            st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': field 'data_offsets': expected [begin, end]", path, name);
            goto done;
        }
        kd_st_tensor t;
        memset(&t, 0, sizeof t);
        int esize = 0;
        t.dtype = parse_dtype(jd->valuestring, &esize);
        kd_printable(jd->valuestring, t.dtype_name, sizeof t.dtype_name);
        t.file = fi;
        uint64_t count = 1;
        bool overflow = false;
        for (const cJSON *d = js->child; d; d = d->next) {
            uint64_t v;
            if (!json_uint(d, &v)) {
                st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': shape: expected non-negative integers", path, name);
                goto done;
            }
            if (v != 0 && count > UINT64_MAX / 16 / v) overflow = true;
            count *= v;
            t.shape[t.ndim++] = (int64_t)v;
        }
        uint64_t b, en;
        if (!json_uint(jo->child, &b) || !json_uint(jo->child->next, &en) || en < b) {
            st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': data_offsets: expected integers 0 <= begin <= end",
                         path, name);
            goto done;
        }
        t.nbytes = en - b;
        if (esize > 0 && (overflow || count * (uint64_t)esize != t.nbytes)) {
            char shp[160];
            int o = 0;
            shp[0] = 0;
            for (int k = 0; k < t.ndim && o < (int)sizeof shp - 24; k++)
                o += snprintf(shp + o, sizeof shp - (size_t)o, "%s%lld", k ? ", " : "", (long long)t.shape[k]);
            st = kd_fail(KD_ERR_FORMAT,
                         "%s: tensor '%s': shape [%s] of %s needs %llu bytes, but data_offsets [%llu, %llu] hold %llu",
                         path, name, shp, t.dtype_name, overflow ? 0ull : (unsigned long long)(count * (uint64_t)esize),
                         (unsigned long long)b, (unsigned long long)en, (unsigned long long)t.nbytes);
            goto done;
        }
        if (check_range && en > data_len) {
            st = kd_fail(KD_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets [%llu, %llu] out of range: the data section holds %llu bytes",
                         path, name, (unsigned long long)b, (unsigned long long)en, (unsigned long long)data_len);
            goto done;
        }
        t.data = data ? data + b : NULL;
        t.name = strdup(name);
        if (!t.name) { st = kd_fail(KD_ERR_NOMEM, "%s: out of memory", path); goto done; }
        ranges[nr].begin = b;
        ranges[nr].end = en;
        ranges[nr].idx = set->n_tensors;
        nr++;
        set->tensors[set->n_tensors++] = t;
    }
    /* overlapping data ranges (empty tensors overlap nothing) */
    qsort(ranges, (size_t)nr, sizeof *ranges, cmp_range);
    uint64_t prev_end = 0;
    int prev = -1;
    for (int i = 0; i < nr; i++) {
        if (ranges[i].begin == ranges[i].end) continue;
        if (prev >= 0 && ranges[i].begin < prev_end) {
            const kd_st_tensor *a = &set->tensors[prev], *c = &set->tensors[ranges[i].idx];
            st = kd_fail(KD_ERR_FORMAT, "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", path,
                         a->name, (unsigned long long)(prev_end - a->nbytes), (unsigned long long)prev_end, c->name,
                         (unsigned long long)ranges[i].begin, (unsigned long long)ranges[i].end);
            goto done;
        }
        prev_end = ranges[i].end;
        prev = ranges[i].idx;
    }
done:
    if (st != KD_OK) {   /* drop the entries of this file */
        for (int i = first; i < set->n_tensors; i++) free(set->tensors[i].name);
        set->n_tensors = first;
    }
    free(ranges);
    cJSON_Delete(root);
    return st;
}

/* open `path` as file number set->n_files and append its tensors */
static kd_status open_one(kd_st_set *set, const char *path, bool map) {
    kd_st_file *nf = realloc(set->files, (size_t)(set->n_files + 1) * sizeof *nf);
    if (!nf) return kd_fail(KD_ERR_NOMEM, "%s: out of memory", path);
    set->files = nf;
    int fi = set->n_files;
    kd_st_file *f = &set->files[fi];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) return kd_fail(KD_ERR_NOMEM, "%s: out of memory", path);
    set->n_files++;   /* from here kd_st_close frees it */

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kd_fail(KD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    kd_status st = KD_OK;
    char *hdr = NULL;
    struct stat sb;
    if (fstat(fd, &sb) != 0) { st = kd_fail(KD_ERR_IO, "%s: cannot stat: %s", path, strerror(errno)); goto out; }
    if (!S_ISREG(sb.st_mode)) { st = kd_fail(KD_ERR_IO, "%s: not a regular file", path); goto out; }
    uint64_t size = (uint64_t)sb.st_size;
    if (size < 8) {
        st = kd_fail(KD_ERR_IO, "%s: truncated: %llu bytes, shorter than the 8-byte safetensors header length",
                     path, (unsigned long long)size);
        goto out;
    }
    unsigned char lenb[8];
    if ((st = read_exact(fd, lenb, 8, 0, path)) != KD_OK) goto out;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lenb[i];
    if (hlen > size - 8) {
        st = kd_fail(KD_ERR_IO, "%s: truncated: the header declares %llu bytes but only %llu follow the length",
                     path, (unsigned long long)hlen, (unsigned long long)(size - 8));
        goto out;
    }
    if (hlen > ST_HEADER_MAX) {
        st = kd_fail(KD_ERR_FORMAT, "%s: header length %llu exceeds the %d-byte limit", path,
                     (unsigned long long)hlen, ST_HEADER_MAX);
        goto out;
    }
    const char *json;
    const char *data = NULL;
    if (map) {
        void *p = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) { st = kd_fail(KD_ERR_IO, "%s: mmap failed: %s", path, strerror(errno)); goto out; }
        f->map = p;
        f->size = (size_t)size;
        json = (const char *)p + 8;
        data = json + hlen;
    } else {
        hdr = malloc(hlen ? hlen : 1);
        if (!hdr) { st = kd_fail(KD_ERR_NOMEM, "%s: cannot allocate the %llu-byte header", path, (unsigned long long)hlen); goto out; }
        if ((st = read_exact(fd, hdr, hlen, 8, path)) != KD_OK) goto out;
        f->size = (size_t)size;
        json = hdr;
    }
    st = parse_header(set, fi, json, (size_t)hlen, data, size - 8 - hlen, map);
out:
    free(hdr);
    close(fd);
    return st;
}

/* sort the table by name; the same name twice is an error naming both files */
static kd_status finish_table(kd_st_set *set) {
    qsort(set->tensors, (size_t)set->n_tensors, sizeof *set->tensors, cmp_tensor_name);
    for (int i = 1; i < set->n_tensors; i++)
        if (strcmp(set->tensors[i - 1].name, set->tensors[i].name) == 0)
            return kd_fail(KD_ERR_FORMAT, "tensor '%s' appears twice: in %s and in %s", set->tensors[i].name,
                           set->files[set->tensors[i - 1].file].path, set->files[set->tensors[i].file].path);
    return KD_OK;
}

kd_status kd_st_open_file(const char *path, bool map, kd_st_set *set) {
    if (!path || !set) return kd_fail(KD_ERR_ARG, "kd_st_open_file: path and set must not be NULL");
    memset(set, 0, sizeof *set);
    kd_status st = open_one(set, path, map);
    if (st == KD_OK) st = finish_table(set);
    if (st != KD_OK) kd_st_close(set);
    return st;
}

typedef struct index_entry { const char *name; const char *shard; } index_entry;
static int cmp_index_entry(const void *a, const void *b) {
    return strcmp(((const index_entry *)a)->name, ((const index_entry *)b)->name);
}
static int cmp_cstr(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* open the shards model.safetensors.index.json names; check every entry is in its shard */
static kd_status open_index(const char *dir, const char *ipath, bool map, kd_st_set *set) {
    cJSON *root;
    kd_status st = kd_json_load(ipath, &root, NULL);
    if (st != KD_OK) return st;
    index_entry *ents = NULL;
    const char **shards = NULL;
    int n = 0, ns = 0;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        st = kd_fail(KD_ERR_FORMAT, "%s: field 'weight_map': expected an object {tensor: shard file}", ipath);
        goto done;
    }
    n = cJSON_GetArraySize(wm);
    if (n == 0) { st = kd_fail(KD_ERR_FORMAT, "%s: 'weight_map' is empty", ipath); goto done; }
    ents = malloc((size_t)n * sizeof *ents);
    shards = malloc((size_t)n * sizeof *shards);
    if (!ents || !shards) { st = kd_fail(KD_ERR_NOMEM, "%s: out of memory", ipath); goto done; }
    int k = 0;
    for (const cJSON *e = wm->child; e; e = e->next, k++) {
        char qn[256], qs[256];
        kd_printable(e->string, qn, sizeof qn);
        if (!cJSON_IsString(e) || !e->valuestring[0] || strchr(e->valuestring, '/') ||
            strcmp(e->valuestring, "..") == 0 || strcmp(kd_printable(e->valuestring, qs, sizeof qs), e->valuestring)) {
            st = kd_fail(KD_ERR_FORMAT, "%s: weight_map['%s']: expected a shard file name of printable UTF-8 in the "
                         "same directory", ipath, qn);
            goto done;
        }
        if (strcmp(qn, e->string) != 0) {   /* names are quoted in later messages: printable text only */
            st = kd_fail(KD_ERR_FORMAT, "%s: weight_map['%s']: expected a tensor name of printable UTF-8 (no control "
                         "bytes, quotes or backslashes)", ipath, qn);
            goto done;
        }
        ents[k].name = e->string;
        ents[k].shard = e->valuestring;
        shards[k] = e->valuestring;
    }
    /* unique shard names, opened in sorted order (model-00001-of-... first) */
    qsort(shards, (size_t)n, sizeof *shards, cmp_cstr);
    for (int i = 0; i < n; i++)
        if (ns == 0 || strcmp(shards[ns - 1], shards[i]) != 0) shards[ns++] = shards[i];
    for (int i = 0; i < ns; i++) {
        char path[4096];
        if (snprintf(path, sizeof path, "%s/%s", dir, shards[i]) >= (int)sizeof path) {
            st = kd_fail(KD_ERR_ARG, "%s: path too long", dir);
            goto done;
        }
        if ((st = open_one(set, path, map)) != KD_OK) goto done;
    }
    if ((st = finish_table(set)) != KD_OK) goto done;
    /* every indexed tensor must be in the shard the index names (both lists sorted: one merge pass) */
    qsort(ents, (size_t)n, sizeof *ents, cmp_index_entry);
    int j = 0;
    for (int i = 0; i < n; i++) {
        while (j < set->n_tensors && strcmp(set->tensors[j].name, ents[i].name) < 0) j++;
        const char *fpath = NULL;
        if (j < set->n_tensors && strcmp(set->tensors[j].name, ents[i].name) == 0) {
            fpath = set->files[set->tensors[j].file].path;
            size_t lp = strlen(fpath), ls = strlen(ents[i].shard);
            if (lp > ls && fpath[lp - ls - 1] == '/' && strcmp(fpath + lp - ls, ents[i].shard) == 0) continue;
        }
        if (fpath)
            st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s' is listed in shard %s but found in %s", ipath,
                         ents[i].name, ents[i].shard, fpath);
        else
            st = kd_fail(KD_ERR_FORMAT, "%s: tensor '%s' is listed in the index but missing from shard %s/%s",
                         ipath, ents[i].name, dir, ents[i].shard);
        goto done;
    }
    st = KD_OK;
done:
    free(ents);
    free(shards);
    cJSON_Delete(root);
    return st;
}

bool kd_st_dir_has_weights(const char *dir) {
    char path[4096];
    struct stat sb;
    const char *names[] = {"model.safetensors.index.json", "model.safetensors"};
    for (int i = 0; i < 2; i++)
        if (snprintf(path, sizeof path, "%s/%s", dir, names[i]) < (int)sizeof path && stat(path, &sb) == 0) return true;
    return false;
}

kd_status kd_st_open_dir(const char *dir, bool map, kd_st_set *set) {
    if (!dir || !set) return kd_fail(KD_ERR_ARG, "kd_st_open_dir: dir and set must not be NULL");
    memset(set, 0, sizeof *set);
    char ipath[4096], spath[4096];
    if (snprintf(ipath, sizeof ipath, "%s/model.safetensors.index.json", dir) >= (int)sizeof ipath ||
        snprintf(spath, sizeof spath, "%s/model.safetensors", dir) >= (int)sizeof spath)
        return kd_fail(KD_ERR_ARG, "%s: path too long", dir);
    kd_status st;
    struct stat sb;
    if (stat(ipath, &sb) == 0) {
        st = open_index(dir, ipath, map, set);
    } else if (stat(spath, &sb) == 0) {
        st = open_one(set, spath, map);
        if (st == KD_OK) st = finish_table(set);
    } else {
        struct stat db;
        if (stat(dir, &db) != 0 || !S_ISDIR(db.st_mode))
            return kd_fail(KD_ERR_IO, "%s: not a directory", dir);
        return kd_fail(KD_ERR_IO, "%s: neither model.safetensors nor model.safetensors.index.json found", dir);
    }
    if (st != KD_OK) kd_st_close(set);
    return st;
}
