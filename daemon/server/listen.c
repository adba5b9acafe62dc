/* listen: the Unix listener of the msgpack protocol: the socket systemd
 * passes, the one --socket names, or the default (/run/kvd/kvd.sock, else
 * the per-user fallback); the stale-socket check; and accept(), paused
 * briefly when it fails (out of descriptors). Accepted sockets go to
 * server_accept (server.c). */
#include "listen.h"

#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "kvd/protocol.h"
#include "log.h"
#include "proto.h"

/* How long accepting pauses after accept() fails (out of descriptors). */
#define LISTEN_ACCEPT_PAUSE_MS 100

static void accept_cb(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int salen,
                      void *arg)
{
    struct server *srv = arg;
    if (server_accept(srv, fd) != 0)
        log_err("accept: out of memory; connection dropped");
}

static void accept_resume_cb(evutil_socket_t fd, short what, void *arg)
{
    struct server *srv = arg;
    if (srv->listener)
        evconnlistener_enable(srv->listener);
}

static void accept_error_cb(struct evconnlistener *l, void *arg)
{
    struct server *srv = arg;
    /* EMFILE, ENFILE, ENOBUFS: the pending connection stays queued and the
     * listener stays readable, so retrying at once would spin. Pause
     * accepting briefly; connections already open keep being served. */
    log_warn("accept: %s; pausing new connections for %d ms", strerror(errno),
             LISTEN_ACCEPT_PAUSE_MS);
    evconnlistener_disable(l);
    struct timeval tv = {0, LISTEN_ACCEPT_PAUSE_MS * 1000};
    evtimer_add(srv->ev_accept, &tv);
}

/* Binds a new Unix socket at path with mode 0660 (group: opts.socket_group).
 * A stale socket file is removed only if it is a socket and nobody answers
 * on it. */
static int listen_path(struct server *srv, const char *path, int *out_fd, char *err, size_t errlen)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct stat st;
    int fd = -1;

    if (strlen(path) >= sizeof(sa.sun_path)) {
        snprintf(err, errlen, "socket path '%s' is too long", path);
        return KVD_EBADREQ;
    }
    strcpy(sa.sun_path, path);
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            snprintf(err, errlen, "'%s' exists and is not a socket; not touching it", path);
            return KVD_EBADREQ;
        }
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
            close(probe);
            snprintf(err, errlen, "another server is listening on '%s'", path);
            return KVD_EBUSY;
        }
        if (probe >= 0)
            close(probe);
        if (unlink(path) != 0) {
            snprintf(err, errlen, "cannot remove stale socket '%s': %s", path, strerror(errno));
            return KVD_EPERM;
        }
        log_info("removed stale socket %s", path);
    }
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return KVD_EINTERNAL;
    }
    /* umask makes the file 0660 from the moment it exists. */
    mode_t old = umask(0117);
    int brc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (brc != 0) {
        snprintf(err, errlen, "bind %s: %s", path, strerror(errno));
        goto fail;
    }
    if (srv->opts.socket_group[0]) {
        struct group *gr = getgrnam(srv->opts.socket_group);
        if (!gr) {
            snprintf(err, errlen, "socket-group '%s' does not exist", srv->opts.socket_group);
            goto fail_unlink;
        }
        if (chown(path, (uid_t)-1, gr->gr_gid) != 0) {
            snprintf(err, errlen, "chown %s to group %s: %s", path, srv->opts.socket_group,
                     strerror(errno));
            goto fail_unlink;
        }
    }
    if (chmod(path, 0660) != 0 || listen(fd, 128) != 0) {
        snprintf(err, errlen, "listen %s: %s", path, strerror(errno));
        goto fail_unlink;
    }
    *out_fd = fd;
    return 0;

fail_unlink:
    unlink(path);
fail:
    close(fd);
    return KVD_EPERM;
}

/* The default socket: /run/kvd/kvd.sock when /run/kvd is (or can be made)
 * writable, else the per-user fallback, whose directory must be the
 * daemon's own (another user could pre-create /tmp/kvd-<uid> and
 * receive the clients' prompts). */
static int pick_default_socket(char *path, size_t cap, char *err, size_t errlen)
{
    if (mkdir(KVD_SOCKET_DIR, 0755) == 0 || errno == EEXIST) {
        if (access(KVD_SOCKET_DIR, W_OK | X_OK) == 0) {
            snprintf(path, cap, "%s", KVD_DEFAULT_SOCKET);
            log_info("socket: %s (default)", path);
            return 0;
        }
    }
    if (proto_socket_fallback(path, cap) != 0) {
        snprintf(err, errlen, "cannot find a place for the socket");
        return KVD_ETOOLARGE;
    }
    char dir[108];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        if (mkdir(dir, 0700) != 0 && errno != EEXIST)
            log_warn("cannot create %s: %s", dir, strerror(errno));
    }
    char why[400];
    if (proto_socket_path_check(path, geteuid(), true, why, sizeof(why)) != 0) {
        snprintf(err, errlen, "default socket: %s (remove it, or give --socket)", why);
        return KVD_EPERM;
    }
    log_notice("socket: %s (%s is not writable for uid %u)", path, KVD_SOCKET_DIR,
               (unsigned)geteuid());
    return 0;
}

int listen_start(struct server *srv, char *err, size_t errlen)
{
    int fd = -1;
    srv->ev_accept = evtimer_new(srv->base, accept_resume_cb, srv);
    if (!srv->ev_accept) {
        snprintf(err, errlen, "out of memory");
        return KVD_ENOMEM;
    }
    int n = sd_listen_fds(1);

    if (n > 1) {
        snprintf(err, errlen, "systemd passed %d sockets; kvd takes exactly one", n);
        return KVD_EBADREQ;
    }
    if (n == 1) {
        fd = SD_LISTEN_FDS_START;
        if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) <= 0) {
            snprintf(err, errlen, "the socket systemd passed is not a listening Unix stream");
            return KVD_EBADREQ;
        }
        evutil_make_socket_nonblocking(fd);
        evutil_make_socket_closeonexec(fd);
        srv->activated = true;
        struct sockaddr_un sa;
        socklen_t sl = sizeof(sa);
        if (getsockname(fd, (struct sockaddr *)&sa, &sl) == 0 && sl > sizeof(sa_family_t))
            snprintf(srv->socket_path, sizeof(srv->socket_path), "%s", sa.sun_path);
        log_info("socket: %s (from systemd)", srv->socket_path);
    } else {
        if (srv->opts.socket_path[0]) {
            snprintf(srv->socket_path, sizeof(srv->socket_path), "%s", srv->opts.socket_path);
        } else {
            int prc = pick_default_socket(srv->socket_path, sizeof(srv->socket_path), err, errlen);
            if (prc)
                return prc;
        }
        int rc = listen_path(srv, srv->socket_path, &fd, err, errlen);
        if (rc)
            return rc;
        srv->own_socket = true;
    }
    srv->listener = evconnlistener_new(srv->base, accept_cb, srv,
                                       LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC, -1, fd);
    if (!srv->listener) {
        close(fd);
        snprintf(err, errlen, "cannot watch the listening socket");
        return KVD_ENOMEM;
    }
    evconnlistener_set_error_cb(srv->listener, accept_error_cb);
    return 0;
}

void listen_stop(struct server *srv)
{
    if (srv->listener) {
        evconnlistener_free(srv->listener);
        srv->listener = NULL;
    }
    if (srv->own_socket) {
        unlink(srv->socket_path);
        srv->own_socket = false;
    }
    if (srv->ev_accept) {
        event_free(srv->ev_accept);
        srv->ev_accept = NULL;
    }
}
