/* Test hooks of chat_template.c; not for the daemon. */
#ifndef KVD_CHAT_TEMPLATE_IMPL_H
#define KVD_CHAT_TEMPLATE_IMPL_H

#include <time.h>

/* When non-zero, strftime_now formats this time (local time) instead of now. */
extern time_t chat_template_fixed_now;

#endif
