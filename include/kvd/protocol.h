/* kvd wire protocol v1: the public constants shared by the daemon, libkvd and
 * kvctl (version, socket paths, frame and argument limits, op names). The
 * full reference is docs/protocol.md. No msgpack or libevent types here. */
#ifndef KVD_PROTOCOL_H
#define KVD_PROTOCOL_H

#ifdef __cplusplus
extern "C" {
#endif

/* Protocol version a hello reports and expects. */
#define KVD_PROTOCOL_VERSION 1

/* Where the daemon listens unless told otherwise. A non-root daemon that
 * cannot write /run/kvd falls back to $XDG_RUNTIME_DIR/kvd.sock, then to
 * /tmp/kvd-<uid>/kvd.sock (proto_socket_fallback() in client/proto.h computes
 * the same path). $KVD_SOCKET overrides the default for clients. */
#define KVD_DEFAULT_SOCKET "/run/kvd/kvd.sock"
#define KVD_SOCKET_DIR "/run/kvd"
#define KVD_SOCKET_NAME "kvd.sock"
#define KVD_SOCKET_ENV "KVD_SOCKET"

/* Framing: a 4-byte big-endian length, then that many bytes of one msgpack
 * map. Frames longer than max_frame (default 64 MiB, --max-frame) are
 * refused with too_large; a zero length is bad_request. */
#define KVD_FRAME_HEADER_BYTES 4u
#define KVD_MAX_FRAME_DEFAULT (64u << 20)
#define KVD_MAX_FRAME_MIN 4096u           /* smallest value --max-frame accepts */
#define KVD_MAX_FRAME_LIMIT (1024u << 20) /* largest value --max-frame accepts */

/* Limits checked by the codec before anything is allocated. */
#define KVD_MAX_ARRAY 1048576u   /* elements in any one array (tokens, stop) */
#define KVD_MAX_OBJECTS 4194304u /* msgpack objects in one frame, all levels */
#define KVD_MAX_DEPTH 16u        /* nesting of maps and arrays */
#define KVD_MAX_NAME 63u         /* bytes in a tenant or namespace name */
#define KVD_MAX_CLIENT_NAME 255u /* bytes in hello's `client` */
#define KVD_MAX_EXPORT_FDS 253u  /* descriptors one kv_export reply carries (Linux SCM_MAX_FD) */

/* Op names (the `op` key of a request). */
#define KVD_OP_HELLO "hello"
#define KVD_OP_STATS "stats"
#define KVD_OP_SEQ_OPEN "seq_open"
#define KVD_OP_SEQ_MATCH "seq_match"
#define KVD_OP_SEQ_EXTEND "seq_extend"
#define KVD_OP_KV_WRITE "kv_write"
#define KVD_OP_KV_READ "kv_read"
#define KVD_OP_SEQ_COMMIT "seq_commit"
#define KVD_OP_SEQ_FORK "seq_fork"
#define KVD_OP_SEQ_INFO "seq_info"
#define KVD_OP_SEQ_OFFLOAD "seq_offload"
#define KVD_OP_SEQ_RESTORE "seq_restore"
#define KVD_OP_SEQ_CLOSE "seq_close"
#define KVD_OP_KV_EXPORT "kv_export"
#define KVD_OP_KV_EXPORT_RELEASE "kv_export_release"
#define KVD_OP_GENERATE "generate"
#define KVD_OP_CANCEL "cancel"
#define KVD_OP_TOKENIZE "tokenize"
#define KVD_OP_DETOKENIZE "detokenize"
#define KVD_OP_SESSION_SAVE "session_save"
#define KVD_OP_SESSION_OPEN "session_open"
#define KVD_OP_SESSION_LIST "session_list"
#define KVD_OP_SESSION_DELETE "session_delete"
#define KVD_OP_ADMIN_EVICT "admin_evict"
#define KVD_OP_ADMIN_CHECK "admin_check"
#define KVD_OP_ADMIN_SHUTDOWN "admin_shutdown"

/* Event names (the `event` key of a streamed event). */
#define KVD_EVENT_TOKENS "tokens"

#ifdef __cplusplus
}
#endif
#endif
