/* One HTTP request to kvd's OpenAI endpoints through curl, for the tests of
 * the HTTP API that compare its replies with the msgpack protocol's. */
#pragma once

/* POSTs body (JSON) to path (e.g. "/v1/chat/completions") on the HTTP Unix
 * socket sock (NULL: DIR/http.sock), the body written to a file in dir;
 * curl runs unbuffered (-N), so a stream arrives whole. Returns the reply's
 * body (malloc'd, NUL-terminated) and its HTTP status in *status; a test
 * fails where curl cannot run. */
char *http_post(const char *dir, const char *sock, const char *path, const char *body, int *status);
