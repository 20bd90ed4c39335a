/* fuzz/drafter.c: a DFlash drafter's config.json (part 0) and model.safetensors (part 1)
 * through kd_drafter_open without a target (config, RoPE, every weight's name, dtype and
 * shape from the header; nothing is loaded) and kd_drafter_get_info. */
#include "common.h"
#include "kdtree.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_two_files(data, size, "config.json", "model.safetensors");
    kd_drafter *d;
    if (kd_drafter_open(fuzz_dir(), NULL, &d) != KD_OK) return 0;
    kd_drafter_info info;
    (void)kd_drafter_get_info(d, &info);
    kd_drafter_close(d);
    return 0;
}
