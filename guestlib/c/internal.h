/* Shared by the core's files; not part of the API (shunt.h).
 *
 * The system calls that an LD_PRELOAD library interposes are made through
 * sys.h (the syscall instruction itself), never through their libc
 * wrappers nor syscall(2), which the preload library interposes too:
 * errno is set as the wrappers set it. */
#ifndef SHUNT_INTERNAL_H
#define SHUNT_INTERNAL_H

#include "shunt.h"
#include "sys.h"

#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Region mappings whose file may be truncated under them (fault.c). */
struct sigaction;
void shunt_fault_guard(void *mem, size_t size);
void shunt_fault_unguard(void *mem);
int shunt_fault_dead_slow(const void *p);
extern unsigned long shunt_faults;

/* shunt_fault_dead reports whether p lies in a region whose memory is
 * gone (truncated, now zeros): one load while no region died. */
static inline int shunt_fault_dead(const void *p)
{
	return __atomic_load_n(&shunt_faults, __ATOMIC_RELAXED) && shunt_fault_dead_slow(p);
}

static inline int64_t shunt_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A request waiting for its verdict. It lives on the requester's stack
 * while it is on the session's list, so any number can be in flight. */
struct pending {
	uint32_t id;
	int done;
	struct shunt_msg *reply;
	struct pending *next;
};

struct shunt_session {
	struct shunt_session_config c; /* its strings are the session's copies */
	/* The region to map: c.region, or once a port is open the BAR (bar). */
	const char *region_path;
	char bar[SHUNT_PATH_MAX];
	int vm; /* a port: set once, read atomically */
	int vsock; /* the channel went over vsock (open_vsock): set once, read atomically */
	int vsock_err; /* when discovering: why vsock failed before the socket was tried (0: not tried) */
	int64_t vsock_quiet; /* vsock is not tried before this (open_vsock), or 0 */
	uint32_t guest_id; /* a VM's id, from WELCOME: the pair regions that name it are its own */

	pthread_mutex_t mu; /* guards the fields below, and writes to fd */
	pthread_cond_t cv;  /* verdicts, PONGs, a lost channel, an open's end; CLOCK_MONOTONIC */
	int fd;             /* the channel, or -1; stored atomically (read without mu) */
	unsigned chan;      /* the channel's generation: bumped at each change of fd (a reopen may reuse the number) */
	pid_t pid;          /* the process fd belongs to (see fork in shunt.h); likewise */
	int64_t tried;      /* when an open last failed (its end) */
	/* An open runs without mu (opening.c), one at a time: when it began
	 * (shunt_now_ns) while one does, else 0. The fields channel_open
	 * writes (vm, vsock, vsock_err, vsock_quiet, guest_id, region_path,
	 * bar) are the opener's alone. */
	int64_t opening;
	unsigned opens;     /* opens begun in this process: only its first is waited for */
	uint8_t *region;    /* region 0: mapped once per process, at the first WELCOME that names one */
	struct shunt_region reg;
	struct shunt_mapping **maps; /* the regions that came by REGION (regions.c) */
	size_t nmaps, cmaps;
	uint32_t next_req;
	unsigned why;       /* why the last open failed: SHUNT_REASON_VERSION, NOT_GUEST or NO_HOSTD (shunt_session_reason) */
	int said;           /* the errno of the last open failure logged (each is said once, not at every retry) */
	struct pending *pend;
	uint64_t nonce, pong;
	/* What the channel has not taken yet: encoded frames, in order (a
	 * write never waits for hostd; session.c, write_locked). A writer
	 * thread drains it while writer is set. */
	uint8_t *outq;
	size_t outlen, outcap;
	int writer;
};

/* The session's parts that opening.c shares (session.c): this process's
 * pid (kept current across fork without a system call), the channel
 * changed (mu held), the reader and keepalive threads started for a new
 * channel (the reader: 0, or -1 without a thread; a missing keepalive is
 * logged), and the announce callback. */
pid_t session_self(void);
void session_set_fd(struct shunt_session *s, int fd);
int session_start_reader(struct shunt_session *s, int fd);
void session_start_keepalive(struct shunt_session *s, int fd);
void session_announce(struct shunt_session *s);
/* session_reconnect (opening.c) reopens the channel for the reader after
 * hostd went away: the new fd, or -1 to end the reader. */
int session_reconnect(struct shunt_session *s);

/* The channel (channel.c). channel_open opens it (socket, port or vsock,
 * found as the config says) and returns its fd with WELCOME in m, or -1
 * with errno; on a port it sets s->vm and s->region_path and turns on
 * kicks, over vsock s->vsock (a socket's framing: vm stays 0). It runs
 * without s->mu, in the session's one opener (s->opening, opening.c).
 * The rest are framed I/O on an open channel (port: is it a port). */
int channel_open(struct shunt_session *s, struct shunt_msg *m);
int channel_read(int fd, int port, struct shunt_msg *m);
int channel_write(int fd, int port, const struct shunt_msg *m);

/* Descriptors that came with the channel's bytes (SCM_RIGHTS), in order:
 * hostd sends one with each REGION, on its frame's first byte. At most
 * SHUNT_FDQ_MAX wait; more are closed. */
#define SHUNT_FDQ_MAX 16
struct shunt_fdq {
	int fd[SHUNT_FDQ_MAX];
	int n;
};
/* channel_recv is channel_read that, on a socket, keeps the descriptors
 * that come along in q (channel.c). */
int channel_recv(int fd, int port, struct shunt_msg *m, struct shunt_fdq *q);
int shunt_fdq_take(struct shunt_fdq *q); /* the oldest, or -1 */
void shunt_fdq_close(struct shunt_fdq *q);

/* The region table's own lock across fork, taken after the sessions'. */
void regions_fork_prepare(void);
void regions_fork_parent(void);
void regions_fork_child(void);

/* Regions by id (regions.c). shunt_region_msg handles REGION (taking a
 * descriptor from q) and UNREGION, without the session lock held.
 * shunt_region_hold copies region id's layout to g and holds its mapping
 * for a flow (*hold, NULL for region 0): 0, or SHUNT_EINVAL if the
 * session has no such region; shunt_region_release gives the hold back. */
struct shunt_mapping;
void shunt_region_msg(struct shunt_session *s, const struct shunt_msg *m, struct shunt_fdq *q);
int shunt_region_hold(struct shunt_session *s, uint32_t id, struct shunt_region *g, void **hold);
void shunt_region_release(struct shunt_session *s, void *hold);

/* Stretches (stretch.c): shunt_flow_attach's fallback for a region this
 * process has not mapped, and shunt_flow_detach's part (BYE, unmap). */
int shunt_stretch_attach(struct shunt_session *s, const struct shunt_msg *v, struct shunt_flow *f);
/* Maps fd's first size bytes shared, in a spare range if there is one
 * (MAP_FAILED on failure); shunt_mem_let_go replaces the pages by
 * anonymous ones and keeps the range for reuse, never unmapping it
 * (regions.c: the preload library looks at ring words without locks). */
void *shunt_mem_map(int fd, uint64_t size);
void shunt_mem_let_go(void *mem, uint64_t size);
void shunt_stretch_detach(struct shunt_flow *f);

/* The session's log callback, formatted (session.c). */
void shunt_logf(struct shunt_session *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Bumps the kick count and wakes its sleepers (kick.c; the reader calls it
 * for every KICK). */
void shunt_kicked(void);

#endif
