/* A real kvd for the client tests: started from $KVD_BIN in store mode on a
 * socket in a fresh temporary directory, stopped (and reaped) at the end.
 * Header-only so each test program stays one .c file. */
#ifndef KVD_TEST_CLIENT_KVD_H
#define KVD_TEST_CLIENT_KVD_H

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct ckvd {
    pid_t pid;    /* 0 once reaped */
    char dir[64]; /* the temporary directory */
    char sock[128];
    char log[128]; /* the daemon's stdout+stderr */
};

static void ckvd_sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Reaps the daemon if it exited; true once it has. */
static int ckvd_reaped(struct ckvd *d, int *status)
{
    if (!d->pid)
        return 1;
    if (waitpid(d->pid, status, WNOHANG) == d->pid) {
        d->pid = 0;
        return 1;
    }
    return 0;
}

/* Waits up to `secs` for the daemon to exit by itself; 0 when it exited
 * with status 0. */
static int ckvd_wait_exit(struct ckvd *d, int secs)
{
    int status = 0;
    for (int i = 0; i < secs * 100; i++) {
        if (!d->pid)
            return 0;
        if (ckvd_reaped(d, &status))
            return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
        ckvd_sleep_ms(10);
    }
    return -1;
}

/* SIGKILL, for tests of a daemon that dies. */
static void ckvd_kill(struct ckvd *d)
{
    int status;
    if (!d->pid)
        return;
    kill(d->pid, SIGKILL);
    waitpid(d->pid, &status, 0);
    d->pid = 0;
}

static void ckvd_dump_log(const struct ckvd *d)
{
    char line[512];
    FILE *f = fopen(d->log, "r");
    if (!f)
        return;
    fprintf(stderr, "---- kvd log (%s) ----\n", d->log);
    while (fgets(line, sizeof(line), f))
        fputs(line, stderr);
    fclose(f);
}

/* Starts kvd with --socket and --backend cpu, plus extra_args (NULL-terminated, may be NULL). Waits
 * until the socket accepts. NULL (with the log on stderr) on failure. */
static struct ckvd *ckvd_start(const char *const *extra_args)
{
    const char *bin = getenv("KVD_BIN");
    struct ckvd *d = calloc(1, sizeof(*d));
    const char *argv[32];
    int n = 0;

    if (!bin || !d) {
        fprintf(stderr, "ckvd_start: KVD_BIN not set\n");
        free(d);
        return NULL;
    }
    snprintf(d->dir, sizeof(d->dir), "/tmp/kvd-ctest.XXXXXX");
    if (!mkdtemp(d->dir)) {
        fprintf(stderr, "ckvd_start: mkdtemp: %s\n", strerror(errno));
        free(d);
        return NULL;
    }
    snprintf(d->sock, sizeof(d->sock), "%s/kvd.sock", d->dir);
    snprintf(d->log, sizeof(d->log), "%s/kvd.log", d->dir);
    argv[n++] = bin;
    argv[n++] = "--socket";
    argv[n++] = d->sock;
    argv[n++] = "--backend";
    argv[n++] = "cpu";
    for (int i = 0; extra_args && extra_args[i] && n < 31; i++)
        argv[n++] = extra_args[i];
    argv[n] = NULL;

    d->pid = fork();
    if (d->pid < 0) {
        free(d);
        return NULL;
    }
    if (d->pid == 0) {
        FILE *lf = freopen(d->log, "w", stdout);
        if (lf)
            dup2(fileno(stdout), 2);
        execv(bin, (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    for (int i = 0; i < 1000; i++) { /* up to 10 s: a loaded machine is slow */
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        int fd, status, ok;
        if (ckvd_reaped(d, &status))
            break;
        fd = socket(AF_UNIX, SOCK_STREAM, 0);
        memcpy(sa.sun_path, d->sock, strlen(d->sock) + 1);
        ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        if (fd >= 0)
            close(fd);
        if (ok)
            return d;
        ckvd_sleep_ms(10);
    }
    fprintf(stderr, "ckvd_start: kvd did not start listening on %s\n", d->sock);
    ckvd_dump_log(d);
    ckvd_kill(d);
    free(d);
    return NULL;
}

/* SIGTERM (a clean drain), then SIGKILL after 10 s; removes the directory. */
static void ckvd_stop(struct ckvd *d)
{
    char path[192];
    if (!d)
        return;
    if (d->pid) {
        kill(d->pid, SIGCONT); /* in case a test stopped it */
        kill(d->pid, SIGTERM);
        if (ckvd_wait_exit(d, 10) != 0 && d->pid) {
            fprintf(stderr, "ckvd_stop: kvd did not exit on SIGTERM\n");
            ckvd_dump_log(d);
            ckvd_kill(d);
        }
    }
    snprintf(path, sizeof(path), "%s", d->sock);
    unlink(path);
    snprintf(path, sizeof(path), "%s", d->log);
    unlink(path);
    rmdir(d->dir);
    free(d);
}

#endif
