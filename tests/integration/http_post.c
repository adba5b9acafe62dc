/* http_post: one request to kvd's HTTP API through curl (see http_post.h),
 * shared by the tests of the OpenAI endpoints. */
#include "http_post.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

char *http_post(const char *dir, const char *sock, const char *path, const char *body, int *status)
{
    char bodyfile[256], sockbuf[256], cmd[1024];
    if (!sock) {
        snprintf(sockbuf, sizeof sockbuf, "%s/http.sock", dir);
        sock = sockbuf;
    }
    snprintf(bodyfile, sizeof bodyfile, "%s/body.json", dir);
    FILE *f = fopen(bodyfile, "w");
    assert_non_null(f);
    fputs(body, f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "curl -sS -N -w '\\n%%{http_code}' -H 'Content-Type: application/json' "
             "--data-binary @%s --unix-socket %s http://localhost%s",
             bodyfile, sock, path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0, k;
    char *buf = malloc(cap);
    assert_non_null(buf);
    while ((k = fread(buf + n, 1, cap - 1 - n, p)) > 0) {
        n += k;
        if (n + 1 == cap) {
            buf = realloc(buf, cap *= 2);
            assert_non_null(buf);
        }
    }
    buf[n] = 0;
    assert_int_equal(pclose(p), 0);
    char *nl = strrchr(buf, '\n');
    assert_non_null(nl);
    *status = atoi(nl + 1);
    *nl = 0;
    return buf;
}
