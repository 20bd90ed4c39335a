/* fuzz/safetensors.c: a safetensors file (part 0), and an index (part 1) over the tiny
 * checkpoint's two shards plus that file as a third shard, through the loader's table
 * (core/safetensors.c: header JSON, dtypes, shapes, offsets, overlaps, repeated keys). */
#include "common.h"
#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_part p[2];
    fuzz_split(data, size, p, 2);
    if (!p[0].data) p[0] = (fuzz_part){data, 0};
    fuzz_write("model-fuzz.safetensors", p[0]);
    char path[512];
    snprintf(path, sizeof path, "%s/model-fuzz.safetensors", fuzz_dir());
    kd_st_set set;
    if (kd_st_open_file(path, true, &set) == KD_OK) {
        for (int i = 0; i < set.n_tensors; i++) (void)kd_st_find(&set, set.tensors[i].name);
        kd_st_close(&set);
    }
    if (p[1].data) {
        fuzz_link("model-00001-of-00002.safetensors", "models/tiny-k2.6/model-00001-of-00002.safetensors");
        fuzz_link("model-00002-of-00002.safetensors", "models/tiny-k2.6/model-00002-of-00002.safetensors");
        fuzz_write("model.safetensors.index.json", p[1]);
        if (kd_st_open_dir(fuzz_dir(), false, &set) == KD_OK) kd_st_close(&set);
        fuzz_write("model.safetensors.index.json", (fuzz_part){NULL, 0});
    }
    return 0;
}
