/* fuzz_proto: libFuzzer target for the wire codec and the server's request
 * handling. The input is a byte stream as a connection would read it
 * (frames of 4-byte length + msgpack map); the first byte picks the
 * connection (two tenants). Each frame is parsed by proto_msg_parse and run
 * through the real op handlers on a store-mode memory manager; oracles:
 * exactly one well-formed reply per request, kvmm_check after the stream,
 * and nothing left in use once the connections close. The same bytes are
 * also read as a reply by the client side of the codec. */
#include <stdint.h>
#include <stdlib.h>

#include "fuzz_env.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct fuzz_env env;
static int env_ready;

/* The client side: the same bytes as a reply frame. */
static void as_reply(const uint8_t *data, size_t size)
{
    size_t n = 0;
    if (proto_frame_peek(data, size, 1u << 20, &n) != PROTO_FRAME_READY)
        return;
    struct proto_msg m;
    struct kvd_error err = {0};
    if (proto_msg_parse(&m, data + 4, n, &err) != 0) {
        FUZZ_ASSERT(err.code == KVD_EBADREQ || err.code == KVD_ETOOLARGE);
        return;
    }
    int code = proto_reply_status(m.root, &err);
    FUZZ_ASSERT(code >= 0 && code < KVD_ERR_COUNT);
    (void)proto_msg_id(&m);
    proto_msg_free(&m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!env_ready) {
        if (fuzz_env_new(&env) != 0)
            abort();
        env_ready = 1;
    }
    if (size < 1)
        return 0;
    fuzz_env_begin(&env);
    as_reply(data + 1, size - 1);
    fuzz_stream(&env, data[0] % FUZZ_CONNS, data + 1, size - 1);
    /* No memory manager: no frame reached a handler, nothing was built or
     * touched, and there is nothing of this input's to check. */
    if (env.mm) {
        fuzz_check_mm(&env);
        fuzz_close_all(&env);
    }
    fuzz_env_end(&env);
    return 0;
}
