/* A JSON value (jansson) packed as the msgpack value of the same shape
 * (objects as maps, arrays, strings, integers, reals, booleans, null). */
#pragma once

#include <jansson.h>
#include <msgpack.h>

void pack_json(msgpack_packer *pk, const json_t *v);
