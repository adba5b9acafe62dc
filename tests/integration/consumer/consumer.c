/* Built against an installed libkvd (CMake package or pkg-config): the
 * header's version is the project's and the loaded library's, and a
 * connection to a socket nobody listens on fails with a code and a
 * message. Exits 0 when all of that holds. */
#include <stdio.h>
#include <string.h>

#include <kvd/client.h>
#include <kvd/version.h>

int main(void)
{
    char want[32];
    snprintf(want, sizeof(want), "%d.%d.%d", KVD_VERSION_MAJOR, KVD_VERSION_MINOR,
             KVD_VERSION_PATCH);
    if (strcmp(KVD_VERSION_STRING, KVD_EXPECT_VERSION) != 0 || strcmp(want, KVD_EXPECT_VERSION)) {
        fprintf(stderr, "header version %s (%s), expected %s\n", KVD_VERSION_STRING, want,
                KVD_EXPECT_VERSION);
        return 1;
    }
    if (kvd_version() != KVD_VERSION_NUMBER) {
        fprintf(stderr, "libkvd %u, header %d\n", kvd_version(), KVD_VERSION_NUMBER);
        return 1;
    }
    struct kvd_ctx *c = kvd_connect("/nonexistent/kvd.sock");
    if (!c || c->err == 0 || c->errstr[0] == '\0') {
        fprintf(stderr, "kvd_connect to nothing did not fail cleanly\n");
        return 1;
    }
    kvd_close(c);
    printf("consumer: libkvd %s ok\n", KVD_VERSION_STRING);
    return 0;
}
