/* The tokenize and detokenize ops (ops_text.c). */
#ifndef KVD_OPS_TEXT_H
#define KVD_OPS_TEXT_H

struct server;
struct text;

/* Registers both ops over tx (NULL in store mode: they answer
 * `unsupported`). tx must outlive the server. */
struct workpool;
int ops_text_register(struct server *srv, const struct text *tx, struct workpool *pool);

#endif
