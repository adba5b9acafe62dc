/* A JSON value (jansson) packed as the msgpack value of the same shape, for
 * tests that send JSON-built requests (schemas, tools, messages) over the
 * msgpack socket. */
#include "json_pack.h"

#include "proto.h"

void pack_json(msgpack_packer *pk, const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        proto_pack_map(pk, json_object_size(v));
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)v, k, x)
        {
            proto_pack_str(pk, k);
            pack_json(pk, x);
        }
        break;
    }
    case JSON_ARRAY:
        proto_pack_array(pk, json_array_size(v));
        for (size_t i = 0; i < json_array_size(v); i++)
            pack_json(pk, json_array_get(v, i));
        break;
    case JSON_STRING:
        msgpack_pack_str(pk, json_string_length(v));
        msgpack_pack_str_body(pk, json_string_value(v), json_string_length(v));
        break;
    case JSON_INTEGER:
        msgpack_pack_int64(pk, json_integer_value(v));
        break;
    case JSON_REAL:
        msgpack_pack_double(pk, json_real_value(v));
        break;
    case JSON_TRUE:
        msgpack_pack_true(pk);
        break;
    case JSON_FALSE:
        msgpack_pack_false(pk);
        break;
    default:
        msgpack_pack_nil(pk);
    }
}
