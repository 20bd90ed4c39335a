/* safetensors.h: memory-mapped safetensors files (single file or sharded with
 * model.safetensors.index.json) and their tensor table. Headers are validated
 * (JSON, dtypes, shapes vs byte sizes, offsets in range and not overlapping)
 * before any tensor is used; data stays in the mapping until a backend takes it. */
#ifndef KD_SAFETENSORS_H
#define KD_SAFETENSORS_H
#include "kdtree.h"
#include <stdbool.h>

typedef enum kd_st_dtype { KD_ST_F32, KD_ST_F16, KD_ST_BF16, KD_ST_I32, KD_ST_I64, KD_ST_OTHER } kd_st_dtype;

typedef struct kd_st_tensor {
    char *name;              /* as written in the file */
    kd_st_dtype dtype;
    char dtype_name[8];      /* as written ("BF16", "F8_E4M3", ...) */
    int ndim;
    int64_t shape[8];
    const void *data;        /* inside the mapping (NULL after kd_st_open_headers_only) */
    uint64_t nbytes;
    int file;                /* index into files */
} kd_st_tensor;

typedef struct kd_st_file {
    char *path;
    void *map;
    size_t size;
} kd_st_file;

typedef struct kd_st_set {
    kd_st_file *files;
    int n_files;
    kd_st_tensor *tensors;   /* sorted by name */
    int n_tensors;
} kd_st_set;

/* Open DIR/model.safetensors or the shards DIR/model.safetensors.index.json names.
 * map = false reads the headers only (for inspect on checkpoints too large to map usefully). */
kd_status kd_st_open_dir(const char *dir, bool map, kd_st_set *set);
/* whether DIR holds model.safetensors or model.safetensors.index.json */
bool kd_st_dir_has_weights(const char *dir);
/* Open one file (used by the drafter and by tests). */
kd_status kd_st_open_file(const char *path, bool map, kd_st_set *set);
void kd_st_close(kd_st_set *set);
const kd_st_tensor *kd_st_find(const kd_st_set *set, const char *name);
const char *kd_st_dtype_name(kd_st_dtype t);
#endif
