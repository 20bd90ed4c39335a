/* fuzz/encode.c: text through the shipped tiny tokenizer: encode (with and without special
 * tokens) then decode gives the same bytes for every valid UTF-8 input (invalid UTF-8 is an
 * error), and the input's bytes read as ids decode or fail cleanly. */
#include "common.h"
#include "kdtree.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static kd_tokenizer *t;
    if (!t && kd_tokenizer_open("models/tiny-k2.6", &t) != KD_OK) {
        fprintf(stderr, "fuzz: %s\n", kd_last_error());
        abort();
    }
    size_t cap = size + 1, n = 0, nb = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    char *back = malloc(size + 1);
    for (int special = 0; special <= 1; special++) {
        if (kd_tokenizer_encode(t, (const char *)data, size, special, ids, cap, &n) != KD_OK) continue;
        if (kd_tokenizer_decode(t, ids, n, back, size + 1, &nb) != KD_OK || nb != size ||
            (size && memcmp(back, data, size) != 0))
            abort();
    }
    size_t n_ids = size / 4;
    char out[4096];
    (void)kd_tokenizer_decode(t, (const int32_t *)(const void *)data, n_ids > 64 ? 64 : n_ids, out, sizeof out, &nb);
    free(ids);
    free(back);
    return 0;
}
