/* The tokenize and detokenize ops (ops_text.c). */
#ifndef KVD_OPS_TEXT_H
#define KVD_OPS_TEXT_H

struct server;
struct text;
struct workpool;

/* Registers both ops over tx (NULL in store mode: they answer
 * `unsupported`); their work runs on pool (NULL: on the loop). tx and pool
 * must outlive the server; *out is freed with ops_text_free after it. */
struct ops_text;
int ops_text_register(struct server *srv, const struct text *tx, struct workpool *pool,
                      struct ops_text **out);
void ops_text_free(struct ops_text *ot);

#endif
