/* fuzz/tokenizer.c: tiktoken.model (part 0) and tokenizer_config.json (part 1) through
 * kd_tokenizer_open; a tokenizer that opens encodes and decodes a text with special tokens,
 * and must give the text back. */
#include "common.h"
#include "kdtree.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_two_files(data, size, "tiktoken.model", "tokenizer_config.json");
    kd_tokenizer *t;
    if (kd_tokenizer_open(fuzz_dir(), &t) != KD_OK) return 0;
    static const char text[] = "Hello <|im_end|> world 123 \xe4\xbd\xa0\xe5\xa5\xbd!!";
    int32_t ids[256];
    size_t n = 0, nb = 0;
    char back[512];
    if (kd_tokenizer_encode(t, text, sizeof text - 1, 1, ids, 256, &n) == KD_OK &&
        kd_tokenizer_decode(t, ids, n, back, sizeof back, &nb) == KD_OK &&
        (nb != sizeof text - 1 || memcmp(back, text, nb) != 0))
        abort();   /* every byte has a rank (the loader checks): encode then decode is the identity */
    kd_tokenizer_close(t);
    return 0;
}
