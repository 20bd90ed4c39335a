/* fuzz/common.h: what the libFuzzer harnesses share. Each harness writes the input's parts
 * as files into its own scratch directory (in TMPDIR, /dev/shm when there is one) and calls
 * the loader on that directory, as a user's checkpoint would be read. An input holds up to
 * four files separated by FUZZ_SEP; the seed corpora (fuzz/seeds.sh) are built that way from
 * the shipped fixtures. Every call must return a status (errors are fine: they are the point),
 * never crash, leak or touch memory it does not own: the sanitizers check that. */
#ifndef KD_FUZZ_COMMON_H
#define KD_FUZZ_COMMON_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FUZZ_SEP "\n--8<--\n"

typedef struct fuzz_part { const uint8_t *data; size_t size; } fuzz_part;

/* split data at FUZZ_SEP into at most n parts; the missing ones are empty */
static inline int fuzz_split(const uint8_t *data, size_t size, fuzz_part *parts, int n) {
    const size_t sl = sizeof FUZZ_SEP - 1;
    int k = 0;
    size_t start = 0;
    for (size_t i = 0; k < n - 1 && i + sl <= size; i++)
        if (memcmp(data + i, FUZZ_SEP, sl) == 0) {
            parts[k++] = (fuzz_part){data + start, i - start};
            start = i + sl;
            i += sl - 1;
        }
    parts[k++] = (fuzz_part){data + start, size - start};
    for (int j = k; j < n; j++) parts[j] = (fuzz_part){NULL, 0};
    return k;
}

static char fuzz_dir_path[256];
static inline void fuzz_dir_remove(void) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", fuzz_dir_path);
    if (system(cmd) != 0) fprintf(stderr, "fuzz: could not remove %s\n", fuzz_dir_path);
}

/* the harness's scratch directory, made once, removed at exit */
static inline const char *fuzz_dir(void) {
    char *dir = fuzz_dir_path;
    if (!dir[0]) {
        const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        snprintf(dir, sizeof fuzz_dir_path, "%s/kdtree-fuzz-%d", base, (int)getpid());
        char cmd[300];
        snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
        if (system(cmd) != 0) abort();
        atexit(fuzz_dir_remove);
    }
    return dir;
}

/* dir/name <- the part (a NULL part removes the file: "missing" is an input too) */
static inline void fuzz_write(const char *name, fuzz_part p) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", fuzz_dir(), name);
    if (!p.data) { unlink(path); return; }
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (p.size && fwrite(p.data, 1, p.size, f) != p.size) abort();
    fclose(f);
}

/* the input as two files: dir/name0 <- part 0 (the whole input when it has no FUZZ_SEP),
 * dir/name1 <- part 1 (removed when absent) */
static inline void fuzz_two_files(const uint8_t *data, size_t size, const char *name0, const char *name1) {
    fuzz_part p[2];
    fuzz_split(data, size, p, 2);
    if (!p[0].data) p[0] = (fuzz_part){data, 0};
    fuzz_write(name0, p[0]);
    fuzz_write(name1, p[1]);
}

/* dir/name -> a symlink to a shipped file (the parts the input does not vary) */
static inline void fuzz_link(const char *name, const char *target) {
    char path[512], abs_target[4096];
    snprintf(path, sizeof path, "%s/%s", fuzz_dir(), name);
    if (!realpath(target, abs_target)) { fprintf(stderr, "fuzz: %s is missing (run from the repository root)\n", target); abort(); }
    unlink(path);
    if (symlink(abs_target, path) != 0) abort();
}
#endif
