/* dtype.c: sizes and names of the activation / tensor dtypes of backend.h. */
#include "backend.h"

size_t kd_dtype_size(kd_dtype t) {
    switch (t) {
    case KD_F32: return 4;
    case KD_F16: return 2;
    case KD_BF16: return 2;
    case KD_I32: return 4;
    case KD_I64: return 8;
    }
    return 0;
}

const char *kd_dtype_name(kd_dtype t) {
    switch (t) {
    case KD_F32: return "f32";
    case KD_F16: return "f16";
    case KD_BF16: return "bf16";
    case KD_I32: return "i32";
    case KD_I64: return "i64";
    }
    return "unknown";
}
