/* The named-session ops: session_save, session_open, session_list,
 * session_delete (ops_session.c, docs/protocol.md). */
#ifndef KVD_OPS_SESSION_H
#define KVD_OPS_SESSION_H

struct server;
struct kvmm;
struct workpool;

/* Registers the four ops. Their disk work runs on pool (the disk workers;
 * NULL without a disk tier: the ops then answer `unsupported`). mm and
 * pool must outlive the server; *out is freed with ops_session_free. */
struct ops_session;
int ops_session_register(struct server *srv, struct kvmm *mm, struct workpool *pool,
                         struct ops_session **out);
void ops_session_free(struct ops_session *os);

#endif
