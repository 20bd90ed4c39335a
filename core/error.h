/* error.h: how library code reports failure.
 * kd_fail() records the message in the thread-local buffer kd_last_error()
 * returns and hands the status back, so failure sites read
 *     return kd_fail(KD_ERR_FORMAT, "%s: tensor '%s': expected bf16, got %s", file, name, dt);
 * KD_TRY propagates a failing status unchanged (the message is already set). */
#ifndef KD_ERROR_H
#define KD_ERROR_H
#include "kdtree.h"

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
kd_status kd_fail(kd_status st, const char *fmt, ...);
/* prefix the current message with more context: "loading DIR: <old message>" */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
kd_status kd_fail_context(kd_status st, const char *fmt, ...);

/* text from a file, fit for an error message: printable UTF-8 kept; control bytes, quotes
 * (both kinds), backslashes and bytes that are not valid UTF-8 written as \xNN; cut with
 * "..." to fit cap (>= 8). Returns buf. */
const char *kd_printable(const char *s, char *buf, size_t cap);
/* the same for the first n bytes of s (s need not be NUL-terminated) */
const char *kd_printable_n(const char *s, size_t n, char *buf, size_t cap);

#define KD_TRY(expr) do { kd_status kd_try_st_ = (expr); if (kd_try_st_ != KD_OK) return kd_try_st_; } while (0)

#endif
