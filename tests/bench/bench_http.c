/* bench_http: a 1-token completion (prompt [1,2,3], greedy) sent N times,
 * one at a time on one kept-alive connection, over kvd's HTTP Unix socket
 * (POST /v1/completions) and over the msgpack socket (generate): prints
 * requests/s and the p50/p99 time to the reply's first byte for each. A
 * program that prints numbers, not a test (docs/performance.md).
 *
 *   bench_http HTTP_SOCKET MSGPACK_SOCKET [N]   (N default 2000) */
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int connect_unix(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        perror(path);
        exit(1);
    }
    return fd;
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k <= 0)
            return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

/* One HTTP exchange: returns the first-byte time (us) or -1. */
static double http_one(int fd, const char *req, size_t len, char *buf, size_t cap)
{
    double t0 = now_us(), t1 = 0;
    if (write_all(fd, req, len))
        return -1;
    size_t n = 0;
    for (;;) {
        ssize_t k = read(fd, buf + n, cap - n - 1);
        if (k <= 0)
            return -1;
        if (!t1)
            t1 = now_us();
        n += (size_t)k;
        buf[n] = 0;
        char *hdr_end = strstr(buf, "\r\n\r\n");
        char *cl = strstr(buf, "Content-Length: ");
        if (hdr_end && cl && n >= (size_t)(hdr_end + 4 - buf) + (size_t)atol(cl + 16))
            break;
    }
    return t1 - t0;
}

/* One msgpack generate: returns the first-byte time (us) or -1. */
static double msgpack_one(int fd, const char *frame, size_t len, char *buf, size_t cap)
{
    double t0 = now_us(), t1 = 0;
    if (write_all(fd, frame, len))
        return -1;
    size_t n = 0, want = 0;
    for (;;) {
        ssize_t k = read(fd, buf + n, cap - n);
        if (k <= 0)
            return -1;
        if (!t1)
            t1 = now_us();
        n += (size_t)k;
        if (n >= 4 && !want) {
            uint32_t be;
            memcpy(&be, buf, 4);
            want = 4 + ntohl(be);
        }
        if (want && n >= want)
            break;
    }
    return t1 - t0;
}

static void report(const char *what, double *ttfb, int n, double total_us)
{
    qsort(ttfb, (size_t)n, sizeof(double), cmp_double);
    printf("%-22s %8.0f req/s   ttfb p50 %7.1f us   p99 %7.1f us\n", what, n / (total_us * 1e-6),
           ttfb[n / 2], ttfb[(int)(n * 0.99)]);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_http HTTP_SOCKET MSGPACK_SOCKET [N]\n");
        return 2;
    }
    int n = argc > 3 ? atoi(argv[3]) : 2000;
    if (n < 10)
        n = 10;
    double *t = malloc(sizeof(double) * (size_t)n);
    static char buf[1 << 16];
    if (!t)
        return 1;

    static const char body[] = "{\"prompt\":[1,2,3],\"max_tokens\":1,\"temperature\":0}";
    char req[512];
    int rl = snprintf(req, sizeof(req),
                      "POST /v1/completions HTTP/1.1\r\nHost: kvd\r\nContent-Type: "
                      "application/json\r\nContent-Length: %zu\r\n\r\n%s",
                      strlen(body), body);
    int fd = connect_unix(argv[1]);
    for (int i = 0; i < 50; i++) /* warm-up */
        http_one(fd, req, (size_t)rl, buf, sizeof(buf));
    double t0 = now_us();
    for (int i = 0; i < n; i++)
        if ((t[i] = http_one(fd, req, (size_t)rl, buf, sizeof(buf))) < 0) {
            fprintf(stderr, "http: the connection failed\n");
            return 1;
        }
    report("http (unix socket)", t, n, now_us() - t0);
    close(fd);

    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_sbuffer_write(&sb, "\0\0\0\0", 4);
    msgpack_pack_map(&pk, 5);
    msgpack_pack_str_with_body(&pk, "op", 2);
    msgpack_pack_str_with_body(&pk, "generate", 8);
    msgpack_pack_str_with_body(&pk, "id", 2);
    msgpack_pack_uint64(&pk, 1);
    msgpack_pack_str_with_body(&pk, "tokens", 6);
    msgpack_pack_array(&pk, 3);
    for (unsigned k = 1; k <= 3; k++)
        msgpack_pack_uint32(&pk, k);
    msgpack_pack_str_with_body(&pk, "max_tokens", 10);
    msgpack_pack_uint32(&pk, 1);
    msgpack_pack_str_with_body(&pk, "temperature", 11);
    msgpack_pack_double(&pk, 0);
    uint32_t be = htonl((uint32_t)(sb.size - 4));
    memcpy(sb.data, &be, 4);
    fd = connect_unix(argv[2]);
    for (int i = 0; i < 50; i++)
        msgpack_one(fd, sb.data, sb.size, buf, sizeof(buf));
    t0 = now_us();
    for (int i = 0; i < n; i++)
        if ((t[i] = msgpack_one(fd, sb.data, sb.size, buf, sizeof(buf))) < 0) {
            fprintf(stderr, "msgpack: the connection failed\n");
            return 1;
        }
    report("msgpack (unix socket)", t, n, now_us() - t0);
    close(fd);
    msgpack_sbuffer_destroy(&sb);
    free(t);
    return 0;
}
