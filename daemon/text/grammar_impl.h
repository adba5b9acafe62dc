/* The compiled grammar's layout, shared by the compiler (grammar.c) and
 * the matcher (grammar_match.c). */
#ifndef KVD_GRAMMAR_IMPL_H
#define KVD_GRAMMAR_IMPL_H

#include <stdint.h>

#include "grammar.h"

enum gr_type {
    GR_END = 0,        /* end of a rule's last alternative */
    GR_ALT,            /* end of an alternative, another follows */
    GR_RULE_REF,       /* value: rule id */
    GR_CHAR,           /* value: code point; starts a character class */
    GR_CHAR_NOT,       /* value: code point; starts a negated class */
    GR_CHAR_RNG_UPPER, /* value: inclusive upper end of the range before it */
    GR_CHAR_ALT,       /* value: one more code point (or range start) of the class */
    GR_CHAR_ANY,       /* "." */
};

struct gr_elem {
    uint32_t type;
    uint32_t value;
};

struct grammar {
    struct gr_elem *elems; /* every rule's elements, one after another */
    uint32_t n_elems;
    uint32_t *rule_start; /* rule id -> index of its first element */
    uint32_t n_rules;
    uint32_t root;
};

static inline int gr_is_end_of_sequence(const struct gr_elem *e)
{
    return e->type == GR_END || e->type == GR_ALT;
}

#endif
