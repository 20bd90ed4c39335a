/* error.c: the thread-local last-error message and status names. */
#include "error.h"
#include <stdarg.h>
#include <stdbool.h>
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

/* the length of the valid UTF-8 sequence at s (n bytes left), 0 when it is not one */
static size_t utf8_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (!len || len > n) return 0;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};   /* overlong forms are invalid */
    if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

/* the character at u[i]: its length in bytes (1 for a byte written as \xNN: *escape) */
static size_t printable_step(const unsigned char *u, size_t i, size_t n, bool *escape) {
    size_t len = utf8_len(u + i, n - i);
    *escape = len == 0 || (len == 1 && (u[i] < 0x20 || u[i] == 0x7f || u[i] == '"' || u[i] == '\'' || u[i] == '\\'));
    return *escape ? 1 : len;
}

const char *kd_printable_n(const char *s, size_t n, char *buf, size_t cap) {
    const unsigned char *u = (const unsigned char *)s;
    size_t total = 0;
    bool escape;
    for (size_t i = 0; i < n;) {
        size_t len = printable_step(u, i, n, &escape);
        total += escape ? 4 : len;
        i += len;
    }
    size_t room = total < cap ? cap - 1 : cap - 4;   /* cut: keep room for "..." */
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t len = printable_step(u, i, n, &escape), out = escape ? 4 : len;
        if (o + out > room) break;
        if (escape) snprintf((char *)buf + o, 5, "\\x%02X", u[i]);
        else memcpy(buf + o, u + i, len);
        o += out;
        i += len;
    }
    if (total >= cap) { memcpy(buf + o, "...", 3); o += 3; }
    buf[o] = 0;
    return buf;
}

const char *kd_printable(const char *s, char *buf, size_t cap) { return kd_printable_n(s, strlen(s), buf, cap); }

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
