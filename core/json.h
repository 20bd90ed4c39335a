/* json.h: reading a text file whole, and a JSON file into a cJSON tree, with errors that name
 * the file. */
#ifndef KD_JSON_H
#define KD_JSON_H
#include "kdtree.h"
#include <cjson/cJSON.h>
#include <stdbool.h>

/* The whole of `path` into *out (NUL-terminated, free() it), its length in *n (if n); at most
 * 256 MB. missing != NULL: a file that does not exist is not an error: *missing = true, *out = NULL. */
kd_status kd_read_text(const char *path, char **out, size_t *n, bool *missing);
/* Parse len bytes of text as one JSON value into *out (free with cJSON_Delete). `what` names
 * the text in errors ("DIR/config.json", "FILE: safetensors header"). cJSON keeps a key that
 * appears twice in one object; here that is an error naming the key and the object. */
kd_status kd_json_parse(const char *text, size_t len, const char *what, cJSON **out);
/* Parse the JSON object in `path` into *out (free with cJSON_Delete).
 * missing != NULL: a file that does not exist is not an error: *missing = true, *out = NULL. */
kd_status kd_json_load(const char *path, cJSON **out, bool *missing);
#endif
