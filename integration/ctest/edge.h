/* edge.h: what the edge suite's files share (edge.c: the server, the
 * client's basic tests and main; edge_blocking.c: many connections in one
 * wait set, blocked calls acted on from another thread, fork loops;
 * edge_fork.c: servers' fork models). */
#ifndef SHUNT_EDGE_H
#define SHUNT_EDGE_H

#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>


/* epollmany, pollmany: fast-path connections in one wait set. More than a
 * wait once watched (64 rings; data on the others slept until the
 * timeout), and more than one futex_waitv call takes (127 rings). */
#define MANY 200

int fail(const char *t, const char *why);
int full(int fd, char *buf, int n);
void drain(int fd);
int dial(const char *ip, int port, int nonblock);
extern int settle_ms;
int echo_ok(int fd, const char *msg);

/* edge_blocking.c */
int many(const char *ip, int port, const char *t);
int signals(const char *ip, int port, const char *t);
int forkloop(const char *ip, int port, const char *t);

/* edge_fork.c */
int forkserver(const char *ip, int port, const char *mode);
int spawnserver(const char *ip, int port, int shell);
int prefork(const char *ip, int port, int reuseport);
int fork_client(const char *ip, int port, const char *t);
int idle_ok(const char *t);

/* edge_epoll.c */
int apache_event(const char *ip, int port, const char *t);

/* edge_raw.c */
int raw_fd_calls(const char *ip, int port, const char *t);

/* edge_vfork.c */
int vfork_server(const char *ip, int port, const char *how, int keep_ms);
int bulk_client(const char *ip, int port, const char *t);

/* edge_locks.c */
int settle_storm(const char *ip, int port, const char *t);

/* edge_limits.c */
int limits_client(const char *ip, int port, const char *t);

#endif
