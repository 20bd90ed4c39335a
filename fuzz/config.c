/* fuzz/config.c: config.json (part 0) and generation_config.json (part 1; absent when the
 * input has one part) through kd_config_load, then kd_inspect over the tiny checkpoint's
 * shards and index with that config (the per-kind plan and every weight's name and shape). */
#include "common.h"
#include "model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_two_files(data, size, "config.json", "generation_config.json");
    kd_config cfg;
    if (kd_config_load(fuzz_dir(), &cfg) != KD_OK) return 0;
    float inv[2048];
    if (cfg.qk_rope_dim <= 4096) kd_rope_inv_freq(&cfg, cfg.qk_rope_dim, inv);
    kd_config_free(&cfg);
    fuzz_link("model-00001-of-00002.safetensors", "models/tiny-k2.6/model-00001-of-00002.safetensors");
    fuzz_link("model-00002-of-00002.safetensors", "models/tiny-k2.6/model-00002-of-00002.safetensors");
    fuzz_link("model.safetensors.index.json", "models/tiny-k2.6/model.safetensors.index.json");
    kd_inspect_report r;
    (void)kd_inspect(fuzz_dir(), &r);
    return 0;
}
