/* error.c: the thread-local last-error message and status names. */
#include "error.h"
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum { KD_ERROR_MAX = 1024 };
static _Thread_local char last_error[KD_ERROR_MAX];

const char *kd_last_error(void) { return last_error; }

kd_status kd_fail(kd_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return st;
}

kd_status kd_fail_context(kd_status st, const char *fmt, ...) {
    char prefix[KD_ERROR_MAX], old[KD_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, last_error, sizeof old);
    /* a message too long for the buffer is cut, never overflowed */
    int n = snprintf(last_error, sizeof last_error, "%s: ", prefix);
    if (n > 0 && (size_t)n < sizeof last_error) snprintf(last_error + n, sizeof last_error - (size_t)n, "%s", old);
    return st;
}

const char *kd_status_name(kd_status s) {
    switch (s) {
    case KD_OK: return "ok";
    case KD_ERR_IO: return "io";
    case KD_ERR_FORMAT: return "format";
    case KD_ERR_CONFIG: return "config";
    case KD_ERR_ARG: return "argument";
    case KD_ERR_STATE: return "state";
    case KD_ERR_NOMEM: return "out of memory";
    case KD_ERR_CAPACITY: return "capacity";
    case KD_ERR_BACKEND: return "backend";
    case KD_ERR_UNSUPPORTED: return "unsupported";
    }
    return "unknown";
}

const char *kd_version(void) { return "0.1.0"; }

#include <time.h>
uint64_t kd_time_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
