/* libshunt-preload.so: Shunt's fast path for unmodified programs.
 *
 * The program keeps its kernel socket fds; this library maps an fd to its
 * flow. Around connect() and accept() it talks to hostd (control protocol
 * v3, through the core's session) exactly as the Go guestlib does,
 * without waiting for it, once the connection has lived the open delay
 * (open.c): a connection's bytes go over TCP until hostd
 * sends READY, then through the rings, and back to TCP at DOWN, per
 * direction and at exact stream offsets (path.c, conn.c). Every fd this library does
 * not own goes straight to libc.
 *
 * Waiting: a blocking read or write spins for SHUNT_SPIN_NS (default
 * 25 us), then sleeps on the ring's futex. poll, select and epoll_wait on
 * sets that mix fast-path and kernel fds first check the rings, spin, and
 * then block in the kernel call with a per-thread eventfd added; helper
 * threads sleep on the rings' futexes (futex_waitv) and write that eventfd,
 * so one wake-up covers both worlds and an idle program burns no CPU
 * (wait.c).
 *
 * Rules (docs/preload.md): fork() lets go to the kernel, in both
 * processes, the connections no ring has carried yet, and leaves those on
 * the rings with the parent (fork.c); exec() resets connections on rings
 * whose fds stay open; exit() leaves the rings before the kernel's FIN
 * (lifetime.c).
 *
 * This file: the libc symbols, configuration, logging, the fd table and
 * the process's session with hostd. preload.h lists the other files. */
#include "preload.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- libc ---- */

#define REAL(name) __typeof__(name) *real_##name
REAL(socket); REAL(connect); REAL(listen); REAL(accept4); REAL(close);
REAL(read); REAL(write); REAL(recv); REAL(send); REAL(recvfrom); REAL(sendto);
REAL(recvmsg); REAL(sendmsg); REAL(readv); REAL(writev); REAL(shutdown);
REAL(dup); REAL(dup2); REAL(dup3); REAL(fcntl); REAL(ioctl); REAL(poll); REAL(ppoll);
REAL(epoll_create); REAL(epoll_create1); REAL(epoll_ctl);
REAL(epoll_wait); REAL(epoll_pwait); REAL(sendfile); REAL(execve); REAL(execvp); REAL(execvpe);
REAL(setsockopt); REAL(getsockopt); REAL(recvmmsg); REAL(sendmmsg); REAL(splice);
REAL(posix_spawn); REAL(posix_spawnp); REAL(system); REAL(popen);
#undef REAL

static void resolve(void)
{
#define R(name) __atomic_store_n(&real_##name, (__typeof__(real_##name))dlsym(RTLD_NEXT, #name), __ATOMIC_RELEASE)
	R(socket); R(connect); R(listen); R(accept4); R(close); R(read); R(write);
	R(recv); R(send); R(recvfrom); R(sendto); R(recvmsg); R(sendmsg); R(readv); R(writev);
	R(shutdown); R(dup); R(dup2); R(dup3); R(fcntl); R(ioctl); R(poll); R(ppoll);
	R(epoll_create); R(epoll_create1); R(epoll_ctl); R(epoll_wait); R(epoll_pwait);
	R(sendfile); R(execve); R(execvp); R(execvpe); R(setsockopt); R(getsockopt);
	R(recvmmsg); R(sendmmsg); R(splice); R(posix_spawn); R(posix_spawnp); R(system); R(popen);
#undef R
}

/* Wrappers can run before this library's constructor: another shared
 * library's constructor (OpenSSH's sshd through libcap-ng calls read() at
 * load time), or a signal handler or atexit handler of an early caller.
 * So every wrapper resolves the real symbols on first use, once. */
static pthread_once_t resolved = PTHREAD_ONCE_INIT;
int real_ready;

void resolve_real(void)
{
	pthread_once(&resolved, resolve);
	__atomic_store_n(&real_ready, 1, __ATOMIC_RELEASE);
}

/* ---- configuration and logging ---- */

#define DEFAULT_CONTROL "/run/shunt/guest.sock"
#define DEFAULT_SPIN_NS 25000
#define LOG_MAX         512 /* a log line; longer ones are cut */

int verbose, disabled, stats, loopback;
int64_t test_stash_delay_ns, test_settle_delay_ns;
int64_t spin_ns = DEFAULT_SPIN_NS;
pid_t my_pid;

static void log_write(const char *line, size_t n)
{
	if (real_write) {
		ssize_t r = real_write(2, line, n); /* a log line that cannot be written is dropped */
		(void)r;
	}
}

static void vlog(const char *fmt, va_list ap)
{
	char buf[LOG_MAX];
	int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
	if (n < 0)
		return;
	if (n > (int)sizeof buf - 2)
		n = sizeof buf - 2;
	buf[n++] = '\n';
	log_write(buf, n);
}

void plog(const char *fmt, ...)
{
	if (!verbose)
		return;
	va_list ap;
	va_start(ap, fmt);
	vlog(fmt, ap);
	va_end(ap);
}

void pstat(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vlog(fmt, ap);
	va_end(ap);
}

int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- the fd table ---- */

struct flow *fds[FD_MAX];
uint8_t kind[FD_MAX];
uint8_t nonblk[FD_MAX];
uint32_t fd_gen[FD_MAX];
pthread_mutex_t tab_mu = PTHREAD_MUTEX_INITIALIZER; /* after settle_mu, before a flow's locks (preload.h, Locks) */

/* ---- the session: the core calls these back from its reader thread ---- */

struct shunt_session *session;

static void session_log(void *arg, const char *line)
{
	(void)arg;
	plog("%s", line);
}

__attribute__((constructor)) static void init(void)
{
	resolve_real();
	const char *s, *control = DEFAULT_CONTROL;
	if ((s = getenv("SHUNT_VERBOSE")) && *s >= '1' && *s <= '9')
		verbose = *s - '0';
	if ((s = getenv("SHUNT_TEST_LOOPBACK")) && *s == '1')
		loopback = 1;
	if ((s = getenv("SHUNT_TEST_STASH_DELAY_US")) && *s)
		test_stash_delay_ns = atoll(s) * 1000;
	if ((s = getenv("SHUNT_TEST_SETTLE_DELAY_US")) && *s)
		test_settle_delay_ns = atoll(s) * 1000;
	if ((s = getenv("SHUNT_STATS")) && *s == '1')
		stats = 1;
	if ((s = getenv("SHUNT_DISABLE")) && *s == '1')
		disabled = 1;
	if ((s = getenv("SHUNT_OPEN_DELAY_MS")) && *s) {
		/* 0: OPEN at once; at most a minute; anything else keeps the
		 * default, and says so with -v. */
		char *end;
		errno = 0;
		long long ms = strtoll(s, &end, 10);
		if (errno || *end || ms < 0 || ms > 60000)
			plog("shunt: SHUNT_OPEN_DELAY_MS=%s is not a number of milliseconds from 0 to 60000: %lld ms", s,
			     (long long)(open_delay_ns / 1000000));
		else
			open_delay_ns = ms * 1000000;
	}
	if ((s = getenv("SHUNT_OPEN_DELAY_ADAPT")) && *s == '0')
		open_delay_adapt = 0;
	if ((s = getenv("SHUNT_SPIN_NS")) && *s)
		spin_ns = atoll(s);
	if ((s = getenv("SHUNT_WAIT")) && !strcmp(s, "block"))
		spin_ns = 0;
	if (s && !strcmp(s, "spin"))
		spin_ns = INT64_MAX;
	my_pid = getpid();
	const char *env_control = getenv("SHUNT_CONTROL");
	if (env_control && *env_control)
		control = env_control;
	const char *region = getenv("SHUNT_REGION");
	struct shunt_session_config c = {
		.control = control,
		.discover = !env_control, /* ports are looked for only when SHUNT_CONTROL is unset */
		.region = region && *region ? region : NULL,
		.log = verbose ? session_log : NULL,
		.revoked = conn_revoked,
		.conn = conn_cb,
		.caps = SHUNT_CAP_RESUME, /* resume.c */
		.holds = conn_holds,
		.announce = conn_announce,
	};
	session = shunt_session_new(&c);
	if (!session) {
		plog("shunt: out of memory: everything stays on TCP");
		disabled = 1;
	}
	fork_init();
}
