/* libshunt-preload.so: Shunt's fast path for unmodified programs.
 *
 * The program keeps its kernel socket fds; this library maps an fd to its
 * flow. Around connect() and accept() it talks to hostd (control protocol
 * v1) exactly as the Go guestlib does; when hostd answers READY, the
 * connection's bytes move through the rings, otherwise everything goes to
 * libc unchanged. Every fd this library does not own goes straight to libc.
 *
 * Waiting: a blocking read or write spins for SHUNT_SPIN_NS (default
 * 25 us), then sleeps on the ring's futex. poll, select and epoll_wait on
 * sets that mix fast-path and kernel fds first check the rings, spin, and
 * then block in the kernel call with a per-thread eventfd added; a helper
 * thread sleeps on the rings' futexes (futex_waitv) and writes that eventfd,
 * so one wake-up covers both worlds and an idle program burns no CPU.
 *
 * Rules (docs/preload.md): after fork() fast-path flows stay with the
 * parent; in the child, inherited copies fail with ENOTCONN and close()
 * only forgets them (the fork-for-a-helper pattern: popen, system, redis'
 * BGSAVE). The child's own new connections work normally (it reconnects to
 * hostd on its own).
 * exec() drops the library's state with the process image; a flow whose
 * fd stays open across exec is reset first, so both sides see an error
 * rather than losing bytes (see before_exec). */
#define _GNU_SOURCE
#include "shunt.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- libc ---- */

#define REAL(name) static __typeof__(name) *real_##name
REAL(socket); REAL(connect); REAL(listen); REAL(accept); REAL(accept4); REAL(close);
REAL(read); REAL(write); REAL(recv); REAL(send); REAL(recvfrom); REAL(sendto);
REAL(recvmsg); REAL(sendmsg); REAL(readv); REAL(writev); REAL(shutdown);
REAL(dup); REAL(dup2); REAL(dup3); REAL(fcntl); REAL(ioctl); REAL(poll); REAL(ppoll);
REAL(select); REAL(pselect); REAL(epoll_create); REAL(epoll_create1); REAL(epoll_ctl);
REAL(epoll_wait); REAL(epoll_pwait); REAL(sendfile); REAL(execve); REAL(execvp); REAL(execvpe);

static void resolve(void)
{
#define R(name) real_##name = dlsym(RTLD_NEXT, #name)
	R(socket); R(connect); R(listen); R(accept); R(accept4); R(close); R(read); R(write);
	R(recv); R(send); R(recvfrom); R(sendto); R(recvmsg); R(sendmsg); R(readv); R(writev);
	R(shutdown); R(dup); R(dup2); R(dup3); R(fcntl); R(ioctl); R(poll); R(ppoll); R(select);
	R(pselect); R(epoll_create); R(epoll_create1); R(epoll_ctl); R(epoll_wait); R(epoll_pwait);
	R(sendfile); R(execve); R(execvp); R(execvpe);
#undef R
}

/* ---- configuration and logging ---- */

static int verbose, disabled;
static pid_t my_pid; /* getpid() is a system call; this is kept current across fork */
static int64_t spin_ns = 25000;
static const char *control_path = "/run/shunt/guest.sock";
static const char *region_override;

static void logf_(const char *fmt, ...)
{
	if (!verbose)
		return;
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if (n > (int)sizeof buf - 2)
		n = sizeof buf - 2;
	buf[n++] = '\n';
	if (real_write)
		real_write(2, buf, n);
}

static const char *reason_names[] = {
	"none", "loopback", "not-local", "no-intent", "no-listener", "policy", "not-owner",
	"no-conntrack", "not-established", "timeout", "no-space", "cross-group", "guest-limit",
	"internal", "conntrack-gone", "policy-reload", "peer-gone", "admin", "malformed",
	"no-hostd", "disabled"};
static const char *reason(unsigned r) { return r < sizeof reason_names / sizeof *reason_names ? reason_names[r] : "?"; }

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- flows and the fd table ---- */

struct flow {
	int refs; /* fds (dup) pointing here; guarded by tab_mu */
	pid_t owner; /* the process that may use it (see fork) */
	int nonblock;
	struct shunt_ring w, r;
	uint32_t slot;
	uint64_t gen;
	uint8_t side;
	int revoked, closed_wr;
	int finished; /* FIN and CLOSE sent at exit (fini) */
	pthread_mutex_t rmu, wmu;
};

#define FD_MAX 65536
static struct flow *fds[FD_MAX];
static uint8_t kind[FD_MAX]; /* 1 tcp socket, 2 registered listener */
static uint8_t nonblk[FD_MAX]; /* O_NONBLOCK of candidate sockets before a verdict */
static pthread_mutex_t tab_mu = PTHREAD_MUTEX_INITIALIZER;

/* epoll interest in fast-path fds, per epoll fd (see epoll_ctl). */
struct epi { int fd; struct epoll_event ev; uint64_t seen; int nested; };
struct ep { pthread_mutex_t mu; struct epi *it; int n, cap; int efd_added; int64_t kernel_at; };
static struct ep *eps[FD_MAX];
static int eps_top; /* one past the highest epoll fd seen; guarded by tab_mu */

static struct flow *flow_of(int fd) { return fd >= 0 && fd < FD_MAX ? __atomic_load_n(&fds[fd], __ATOMIC_ACQUIRE) : NULL; }

/* ---- the session with hostd ---- */

static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int fd;
	int64_t tried;
	uint8_t *region;
	struct shunt_region reg;
	uint32_t next_req;
	struct { uint32_t id; int done; struct shunt_msg m; } pend[64];
	uint64_t nonce, pong;
	pid_t pid;
} ctl = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .fd = -1};

static int vm_mode;       /* see "VM mode" below */
static uint32_t kick_seq; /* bumped per KICK; shared futex ops (futex_waitv uses them) */
static void vm_kicked(void);
static int ctl_send(const struct shunt_msg *m);
static int ctl_open(struct shunt_msg *m);
static int local_of(int fd, struct shunt_addr *a);
static int remote_of(int fd, struct shunt_addr *a);

static int read_full(int fd, void *buf, size_t n)
{
	uint8_t *p = buf;
	while (n) {
		ssize_t k = real_read(fd, p, n);
		if (k < 0 && errno == EAGAIN) { /* a port: non-blocking, see open_port */
			struct pollfd pf = {.fd = fd, .events = POLLIN};
			real_poll(&pf, 1, -1);
			continue;
		}
		if (k <= 0) {
			if (k < 0 && errno == EINTR)
				continue;
			return -1;
		}
		p += k;
		n -= k;
	}
	return 0;
}

static int ctl_read(int fd, struct shunt_msg *m)
{
	uint8_t buf[SHUNT_PROTO_HEADER + SHUNT_PROTO_MAX], type;
	if (read_full(fd, buf, SHUNT_PROTO_HEADER))
		return -1;
	ssize_t n = shunt_msg_header(buf, &type);
	if (n < 0 || read_full(fd, buf + SHUNT_PROTO_HEADER, n))
		return -1;
	return shunt_msg_decode(buf, SHUNT_PROTO_HEADER + n, m) ? -1 : 0;
}

/* port_write writes all of buf to a (non-blocking) port, waiting at most
 * 2 s for room: a port whose host end is gone does not take data. */
static int port_write(int fd, const uint8_t *buf, size_t n)
{
	int64_t until = now_ns() + 2000000000LL;
	while (n) {
		ssize_t k = real_write(fd, buf, n);
		if (k > 0) {
			buf += k;
			n -= k;
			continue;
		}
		if (k < 0 && errno != EAGAIN && errno != EINTR)
			return -1;
		int64_t left = until - now_ns();
		struct pollfd pf = {.fd = fd, .events = POLLOUT};
		if (left <= 0 || real_poll(&pf, 1, (int)(left / 1000000) + 1) < 0) {
			errno = ETIMEDOUT;
			return -1;
		}
	}
	return 0;
}

static int ctl_write_locked(const struct shunt_msg *m)
{
	uint8_t buf[SHUNT_PROTO_HEADER + SHUNT_PROTO_MAX];
	ssize_t n = shunt_msg_encode(m, buf, sizeof buf);
	if (ctl.fd < 0 || n < 0)
		return -1;
	if (vm_mode)
		return port_write(ctl.fd, buf, n);
	return real_send(ctl.fd, buf, n, MSG_NOSIGNAL) == n ? 0 : -1;
}

static void on_revoke(const struct shunt_msg *m)
{
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = fds[fd];
		if (f && f->slot == m->slot && f->gen == m->gen && !f->revoked) {
			f->revoked = 1;
			logf_("shunt: fd %d revoked: %s", fd, reason(m->reason));
		}
	}
	pthread_mutex_unlock(&tab_mu);
}

/* announce tells a new hostd what this process holds: LISTEN for each
 * listener and REATTACH for each live flow (the new hostd adopted the flows
 * from the region and waits a grace for their owners). Called without
 * ctl.mu: it takes tab_mu first, as close() does. */
static void announce(void)
{
	int cap = 16, n = 0;
	struct shunt_msg *ms = malloc(cap * sizeof *ms);
	if (!ms)
		return;
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct shunt_msg m = {0};
		struct flow *f = fds[fd];
		if (kind[fd] == 2) {
			m.type = SHUNT_LISTEN;
			if (local_of(fd, &m.local))
				continue;
		} else if (f && f->owner == my_pid && !f->revoked) {
			int dup = 0;
			for (int i = 0; i < n && !dup; i++)
				dup = ms[i].type == SHUNT_REATTACH && ms[i].slot == f->slot && ms[i].gen == f->gen;
			if (dup)
				continue;
			m = (struct shunt_msg){.type = SHUNT_REATTACH, .slot = f->slot, .gen = f->gen, .side = f->side};
			if (local_of(fd, &m.local) || remote_of(fd, &m.remote))
				continue;
		} else {
			continue;
		}
		if (n == cap) {
			struct shunt_msg *more = realloc(ms, 2 * cap * sizeof *ms);
			if (!more)
				break;
			ms = more;
			cap *= 2;
		}
		ms[n++] = m;
	}
	pthread_mutex_unlock(&tab_mu);
	for (int i = 0; i < n; i++)
		ctl_send(&ms[i]);
	if (n)
		logf_("shunt: told hostd of %d listeners and flows", n);
	free(ms);
}

/* holds reports whether this process has listeners or flows that a new
 * hostd must hear of. */
static int holds(void)
{
	for (int fd = 0; fd < FD_MAX; fd++)
		if (kind[fd] == 2 || (fds[fd] && fds[fd]->owner == my_pid))
			return 1;
	return 0;
}

static void *keepalive(void *arg);

/* reconnect reopens the control channel after hostd went away, for a
 * process that holds something (an idle one reconnects at its next
 * connection instead), and returns the new fd, or -1 to end the reader:
 * another thread reconnected first (announce is then done here too), the
 * process forked, or it holds nothing. */
static int reconnect(void)
{
	pid_t pid = getpid();
	for (int delay = 50;; delay = delay < 1000 ? 2 * delay : 1000) {
		if (!holds())
			return -1;
		struct timespec ts = {delay / 1000, (delay % 1000) * 1000000L};
		nanosleep(&ts, NULL);
		pthread_mutex_lock(&ctl.mu);
		if (ctl.pid != pid) {
			pthread_mutex_unlock(&ctl.mu);
			return -1;
		}
		if (ctl.fd >= 0) {
			pthread_mutex_unlock(&ctl.mu);
			announce();
			return -1;
		}
		struct shunt_msg w;
		int fd = ctl_open(&w);
		if (fd >= 0) {
			ctl.fd = fd;
			if (vm_mode) {
				pthread_t th;
				pthread_attr_t at;
				pthread_attr_init(&at);
				pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
				pthread_create(&th, &at, keepalive, (void *)(intptr_t)fd);
			}
		}
		pthread_mutex_unlock(&ctl.mu);
		if (fd >= 0) {
			logf_("shunt: reconnected to hostd");
			announce();
			return fd;
		}
	}
}

static void *ctl_reader(void *arg)
{
	int fd = (int)(intptr_t)arg;
	struct shunt_msg m;
	for (;;) {
		/* The session ends at EOF, or at ERROR(no-hostd): a new hostd
		 * behind a port that QEMU reconnected before we read EOF, which
		 * knows nothing of this session. Either way: reconnect. */
		while (ctl_read(fd, &m) == 0 && !(m.type == SHUNT_ERROR && m.reason == 19 /* no-hostd */)) {
			pthread_mutex_lock(&ctl.mu);
			if (m.type == SHUNT_READY || m.type == SHUNT_TCP) {
				for (int i = 0; i < 64; i++)
					if (ctl.pend[i].id == m.req_id && !ctl.pend[i].done) {
						ctl.pend[i].m = m;
						ctl.pend[i].done = 1;
					}
			} else if (m.type == SHUNT_PONG) {
				ctl.pong = m.nonce;
			} else if (m.type == SHUNT_KICK) {
				vm_kicked();
			} else if (m.type == SHUNT_ERROR) {
				logf_("shunt: hostd closed the control channel: %s", m.text);
			}
			pthread_cond_broadcast(&ctl.cv);
			pthread_mutex_unlock(&ctl.mu);
			if (m.type == SHUNT_REVOKE)
				on_revoke(&m);
		}
		/* Requests in flight go to TCP now rather than at their timeout. */
		pthread_mutex_lock(&ctl.mu);
		if (ctl.fd == fd) {
			real_close(fd);
			ctl.fd = -1;
		}
		for (int i = 0; i < 64; i++)
			if (ctl.pend[i].id && !ctl.pend[i].done) {
				ctl.pend[i].m.type = SHUNT_TCP;
				ctl.pend[i].m.reason = 19; /* no-hostd */
				ctl.pend[i].done = 1;
			}
		pthread_cond_broadcast(&ctl.cv);
		pthread_mutex_unlock(&ctl.mu);
		logf_("shunt: lost hostd");
		if ((fd = reconnect()) < 0)
			return NULL;
	}
}

/* ---- VM mode: the control channel is a virtio-serial port, the region a
 * PCI BAR (docs/vm.md). No futex works on a BAR, and none would reach
 * another VM: a waker sends KICK through hostd, and a sleeper sleeps on a
 * process-local word that the control reader bumps for every KICK, never
 * longer than 20 ms (a lost kick costs latency, not a hang). ---- */

#define VM_FALLBACK_NS 20000000LL

static void vm_wake(struct shunt_ring *r)
{
	struct flow *f = r->owner;
	if (f) {
		struct shunt_msg k = {.type = SHUNT_KICK, .slot = f->slot, .gen = f->gen, .side = f->side};
		ctl_send(&k);
	}
}

static uint32_t vm_seq(void) { return __atomic_load_n(&kick_seq, __ATOMIC_SEQ_CST); }

static void vm_sleep(uint32_t seq, int64_t max_ns)
{
	int64_t d = max_ns >= 0 && max_ns < VM_FALLBACK_NS ? max_ns : VM_FALLBACK_NS;
	struct timespec ts = {d / 1000000000, d % 1000000000};
	syscall(SYS_futex, &kick_seq, FUTEX_WAIT, seq, &ts, NULL, 0);
}

static void vm_kicked(void)
{
	__atomic_add_fetch(&kick_seq, 1, __ATOMIC_SEQ_CST);
	syscall(SYS_futex, &kick_seq, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

/* read_small reads a small sysfs file into buf (NUL-terminated, without
 * its newline). */
static int read_small(const char *path, char *buf, size_t n)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t k = real_read(fd, buf, n - 1);
	real_close(fd);
	if (k <= 0)
		return -1;
	buf[k] = 0;
	buf[strcspn(buf, "\n")] = 0;
	return 0;
}

/* find_ports lists the Shunt control ports (org.shunt.ctl, then
 * org.shunt.ctl.1, ...) as vhost/vserial.FindAll does: by the udev link,
 * else by name under sysfs (guests without udev). A VM has one port per
 * process that may use Shunt at once. Returns how many it found. */
#define MAX_PORTS 31
static int find_ports(char out[][96], int max)
{
	char byidx[MAX_PORTS][96] = {{0}};
	DIR *dir = opendir("/sys/class/virtio-ports");
	for (struct dirent *e; dir && (e = readdir(dir));) {
		char p[128], name[64];
		snprintf(p, sizeof p, "/sys/class/virtio-ports/%.64s/name", e->d_name);
		if (e->d_name[0] == '.' || read_small(p, name, sizeof name) < 0)
			continue;
		int idx = -1;
		if (!strcmp(name, "org.shunt.ctl"))
			idx = 0;
		else if (!strncmp(name, "org.shunt.ctl.", 14) && name[14] >= '1' && name[14] <= '9')
			idx = atoi(name + 14);
		if (idx >= 0 && idx < MAX_PORTS)
			snprintf(byidx[idx], sizeof byidx[idx], "/dev/%.80s", e->d_name);
	}
	if (dir)
		closedir(dir);
	int n = 0;
	for (int i = 0; i < MAX_PORTS && n < max; i++) {
		char link[96];
		struct stat st;
		if (i == 0)
			snprintf(link, sizeof link, "/dev/virtio-ports/org.shunt.ctl");
		else
			snprintf(link, sizeof link, "/dev/virtio-ports/org.shunt.ctl.%d", i);
		const char *p = stat(link, &st) == 0 ? link : byidx[i][0] ? byidx[i] : NULL;
		if (p) {
			memcpy(out[n], p, 96);
			out[n++][95] = 0;
		}
	}
	return n;
}

/* find_bar finds the ivshmem device (1af4:1110), enables it and names its
 * memory BAR, as vhost/ivshmem.Find does. */
static int find_bar(char *out, size_t n)
{
	int found = -1;
	DIR *dir = opendir("/sys/bus/pci/devices");
	for (struct dirent *e; found && dir && (e = readdir(dir));) {
		char base[96], p[128], v[16], d[16];
		snprintf(base, sizeof base, "/sys/bus/pci/devices/%.64s", e->d_name);
		snprintf(p, sizeof p, "%s/vendor", base);
		if (e->d_name[0] == '.' || read_small(p, v, sizeof v) < 0 || strcmp(v, "0x1af4"))
			continue;
		snprintf(p, sizeof p, "%s/device", base);
		if (read_small(p, d, sizeof d) < 0 || strcmp(d, "0x1110"))
			continue;
		snprintf(p, sizeof p, "%s/enable", base);
		int fd = open(p, O_WRONLY | O_CLOEXEC);
		if (fd >= 0) {
			real_write(fd, "1", 1);
			real_close(fd);
		}
		snprintf(out, n, "%s/resource2", base);
		found = 0;
	}
	if (dir)
		closedir(dir);
	return found;
}

/* port_hello says HELLO on a port until WELCOME comes: the port drops what
 * is written before both ends are open, and it may still hold what hostd
 * sent to an earlier user of the port, which is skipped. */
static int port_hello(int fd, struct shunt_msg *m)
{
	for (int try = 0; try < 25; try++) {
		struct shunt_msg h = {.type = SHUNT_HELLO, .pid = getpid()};
		uint8_t buf[64];
		ssize_t n = shunt_msg_encode(&h, buf, sizeof buf);
		if (n < 0 || port_write(fd, buf, n))
			return -1;
		int64_t until = now_ns() + 200000000;
		for (;;) {
			int64_t left = until - now_ns();
			struct pollfd p = {.fd = fd, .events = POLLIN};
			if (left <= 0 || real_poll(&p, 1, (int)(left / 1000000) + 1) <= 0)
				break;
			if (ctl_read(fd, m))
				return -1;
			if (m->type == SHUNT_WELCOME)
				return 0;
			if (m->type == SHUNT_ERROR && m->reason != 19 /* no-hostd */)
				return -1;
		}
	}
	errno = ETIMEDOUT;
	return -1;
}

/* keepalive PINGs hostd every 500 ms on a port, as the Go library does: a
 * restarted hostd gets no EOF through QEMU, and answers the first PING
 * before HELLO with ERROR(no-hostd), which makes the reader say HELLO and
 * announce the listeners again. It ends with the session (or a fork). */
static void *keepalive(void *arg)
{
	int fd = (int)(intptr_t)arg;
	pid_t pid = getpid();
	for (;;) {
		struct timespec ts = {0, 500000000};
		nanosleep(&ts, NULL);
		pthread_mutex_lock(&ctl.mu);
		if (ctl.fd != fd || ctl.pid != pid) {
			pthread_mutex_unlock(&ctl.mu);
			return NULL;
		}
		struct shunt_msg p = {.type = SHUNT_PING, .nonce = ++ctl.nonce};
		ctl_write_locked(&p);
		pthread_mutex_unlock(&ctl.mu);
	}
}

/* open_port opens one control port and gets WELCOME on it; VM mode from
 * then on. -1 with errno EBUSY if another process has the port. */
static int open_port(const char *path, struct shunt_msg *m)
{
	/* Non-blocking, as the Go library uses it (through the poller): with
	 * blocking I/O, a write from the keepalive thread never returned while
	 * the reader thread sat in read() (seen in TestVMPreloadHostdRestart). */
	int fd = open(path, O_RDWR | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0)
		return -1;
	if (port_hello(fd, m)) {
		int e = errno;
		real_close(fd);
		errno = e;
		return -1;
	}
	if (!region_override) {
		static char bar[128];
		if (find_bar(bar, sizeof bar) == 0)
			region_override = bar;
	}
	vm_mode = 1;
	shunt_remote_wake = vm_wake;
	shunt_remote_seq = vm_seq;
	shunt_remote_sleep = vm_sleep;
	logf_("shunt: control port %s", path);
	return fd;
}

/* ctl_open opens the control channel and gets WELCOME. A character device,
 * or no socket but ports named org.shunt.ctl[.N], means a VM: the first
 * port no other process holds. */
static int ctl_open(struct shunt_msg *m)
{
	struct stat st;
	const char *path = control_path;
	if (stat(path, &st) == 0 && S_ISCHR(st.st_mode))
		return open_port(path, m);
	if (stat(path, &st) < 0 && !getenv("SHUNT_CONTROL")) {
		char ports[MAX_PORTS][96];
		int n = find_ports(ports, MAX_PORTS);
		for (int i = 0; i < n; i++) {
			int fd = open_port(ports[i], m);
			if (fd >= 0 || errno != EBUSY)
				return fd;
		}
		if (n > 0) {
			logf_("shunt: all %d control ports are in use by other processes (a VM needs one per process)", n);
			errno = EBUSY;
			return -1;
		}
	}
	int fd = real_socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	strncpy(sa.sun_path, path, sizeof sa.sun_path - 1);
	struct shunt_msg h = {.type = SHUNT_HELLO, .pid = getpid()};
	uint8_t buf[64];
	ssize_t n = shunt_msg_encode(&h, buf, sizeof buf);
	struct timeval tv = {.tv_sec = 5};
	if (fd < 0 || real_connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0 ||
	    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0 ||
	    real_send(fd, buf, n, MSG_NOSIGNAL) != n || ctl_read(fd, m) || m->type != SHUNT_WELCOME) {
		if (fd >= 0)
			real_close(fd);
		return -1;
	}
	tv.tv_sec = 0;
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	return fd;
}

static int map_region(const char *path)
{
	int fd = open(path, O_RDWR | O_CLOEXEC);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) < 0) {
		if (fd >= 0)
			real_close(fd);
		return -1;
	}
	void *mem = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	real_close(fd);
	if (mem == MAP_FAILED)
		return -1;
	if (shunt_region_attach(&ctl.reg, mem, st.st_size)) {
		munmap(mem, st.st_size);
		return -1;
	}
	ctl.region = mem;
	return 0;
}

/* ctl_ensure connects to hostd if needed; a failed attempt is retried at
 * most once a second, so a missing hostd costs a connect() nothing. */
static int ctl_ensure(void)
{
	pthread_mutex_lock(&ctl.mu);
	if (ctl.pid != getpid()) { /* forked: the parent's session is not ours */
		ctl.fd = -1;
		ctl.pid = getpid();
		ctl.tried = 0;
	}
	if (ctl.fd >= 0) {
		pthread_mutex_unlock(&ctl.mu);
		return 0;
	}
	int64_t now = now_ns();
	if (ctl.tried && now - ctl.tried < 1000000000) {
		pthread_mutex_unlock(&ctl.mu);
		return -1;
	}
	ctl.tried = now;
	struct shunt_msg m;
	int fd = ctl_open(&m);
	if (fd < 0) {
		logf_("shunt: hostd unreachable at %s: %s", control_path, strerror(errno));
		pthread_mutex_unlock(&ctl.mu);
		return -1;
	}
	if (!ctl.region && map_region(region_override ? region_override : m.region)) {
		logf_("shunt: cannot map the region %s", region_override ? region_override : m.region);
		real_close(fd);
		pthread_mutex_unlock(&ctl.mu);
		return -1;
	}
	ctl.fd = fd;
	pthread_t th;
	pthread_attr_t at;
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old); /* the reader takes no signals */
	pthread_create(&th, &at, ctl_reader, (void *)(intptr_t)fd);
	if (vm_mode)
		pthread_create(&th, &at, keepalive, (void *)(intptr_t)fd);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_mutex_unlock(&ctl.mu);
	return 0;
}

static int ctl_send(const struct shunt_msg *m)
{
	pthread_mutex_lock(&ctl.mu);
	int r = ctl_write_locked(m);
	pthread_mutex_unlock(&ctl.mu);
	return r;
}

/* ctl_request sends an OPEN and waits for its READY or TCP. */
static void ctl_request(struct shunt_msg *m, struct shunt_msg *reply, int timeout_ms)
{
	struct timespec dl;
	clock_gettime(CLOCK_REALTIME, &dl);
	dl.tv_sec += timeout_ms / 1000;
	dl.tv_nsec += (timeout_ms % 1000) * 1000000L;
	if (dl.tv_nsec >= 1000000000) {
		dl.tv_sec++;
		dl.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&ctl.mu);
	int slot = -1;
	for (int i = 0; i < 64 && slot < 0; i++)
		if (!ctl.pend[i].id)
			slot = i;
	memset(reply, 0, sizeof *reply);
	reply->type = SHUNT_TCP;
	reply->reason = 13; /* internal */
	if (slot < 0) {
		pthread_mutex_unlock(&ctl.mu);
		return;
	}
	m->req_id = ++ctl.next_req ? ctl.next_req : ++ctl.next_req;
	ctl.pend[slot].id = m->req_id;
	ctl.pend[slot].done = 0;
	if (ctl_write_locked(m) == 0) {
		while (!ctl.pend[slot].done)
			if (pthread_cond_timedwait(&ctl.cv, &ctl.mu, &dl) == ETIMEDOUT)
				break;
		if (ctl.pend[slot].done)
			*reply = ctl.pend[slot].m;
		else
			reply->reason = 9; /* timeout */
	} else {
		reply->reason = 19; /* no-hostd */
	}
	ctl.pend[slot].id = 0;
	pthread_mutex_unlock(&ctl.mu);
}

/* ctl_sync waits until hostd processed what we sent (PING/PONG): a LISTEN
 * is in effect before a peer's OPEN can arrive on another session. */
static void ctl_sync(void)
{
	pthread_mutex_lock(&ctl.mu);
	struct shunt_msg m = {.type = SHUNT_PING, .nonce = ++ctl.nonce};
	if (ctl_write_locked(&m) == 0) {
		struct timespec dl;
		clock_gettime(CLOCK_REALTIME, &dl);
		dl.tv_sec += 1;
		while (ctl.pong < m.nonce && ctl.fd >= 0)
			if (pthread_cond_timedwait(&ctl.cv, &ctl.mu, &dl) == ETIMEDOUT)
				break;
	}
	pthread_mutex_unlock(&ctl.mu);
}

/* ---- addresses ---- */

static int to_addr(const struct sockaddr *sa, struct shunt_addr *a)
{
	memset(a, 0, sizeof *a);
	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *s4 = (const void *)sa;
		a->ip[10] = a->ip[11] = 0xff;
		memcpy(a->ip + 12, &s4->sin_addr, 4);
		a->port = ntohs(s4->sin_port);
		return 0;
	}
	if (sa->sa_family == AF_INET6) {
		const struct sockaddr_in6 *s6 = (const void *)sa;
		memcpy(a->ip, &s6->sin6_addr, 16);
		a->port = ntohs(s6->sin6_port);
		return 0;
	}
	return -1;
}

static int is_loopback(const struct shunt_addr *a)
{
	static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	static const uint8_t v6lo[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
	if (!memcmp(a->ip, v4, 12))
		return a->ip[12] == 127;
	return !memcmp(a->ip, v6lo, 16);
}

static int local_of(int fd, struct shunt_addr *a)
{
	struct sockaddr_storage ss;
	socklen_t len = sizeof ss;
	return getsockname(fd, (struct sockaddr *)&ss, &len) < 0 ? -1 : to_addr((struct sockaddr *)&ss, a);
}

static int remote_of(int fd, struct shunt_addr *a)
{
	struct sockaddr_storage ss;
	socklen_t len = sizeof ss;
	return getpeername(fd, (struct sockaddr *)&ss, &len) < 0 ? -1 : to_addr((struct sockaddr *)&ss, a);
}

/* ---- verdicts ---- */

/* adopt applies hostd's verdict for fd: READY attaches the rings. */
static void adopt(int fd, const struct shunt_msg *v, const char *who)
{
	char ip[64];
	struct shunt_addr r;
	remote_of(fd, &r);
	inet_ntop(AF_INET6, r.ip, ip, sizeof ip);
	if (v->type != SHUNT_READY) {
		logf_("shunt: fd %d %s [%s]:%u: tcp (%s)", fd, who, ip, r.port, reason(v->reason));
		return;
	}
	struct shunt_slot s;
	struct flow *f = calloc(1, sizeof *f);
	if (!f || shunt_region_slot(&ctl.reg, v->slot, &s) || s.gen != v->gen || s.capacity != v->capacity) {
		logf_("shunt: fd %d: READY does not match the region; tcp", fd);
		struct shunt_msg c = {.type = SHUNT_CLOSE, .slot = v->slot, .gen = v->gen, .side = v->side};
		ctl_send(&c);
		free(f);
		return;
	}
	size_t len = SHUNT_RING_HEADER + s.capacity;
	uint8_t *out = ctl.region + (v->side == 1 ? s.ring_ab : s.ring_ba);
	uint8_t *in = ctl.region + (v->side == 1 ? s.ring_ba : s.ring_ab);
	if (shunt_ring_writer(&f->w, out, len, s.capacity) || shunt_ring_reader(&f->r, in, len, s.capacity)) {
		logf_("shunt: fd %d: corrupt rings; tcp", fd);
		free(f);
		return;
	}
	f->slot = v->slot;
	f->gen = v->gen;
	f->side = v->side;
	f->refs = 1;
	f->owner = my_pid;
	f->nonblock = nonblk[fd];
	f->w.owner = f->r.owner = f;
	pthread_mutex_init(&f->rmu, NULL);
	pthread_mutex_init(&f->wmu, NULL);
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one); /* the lease */
	__atomic_store_n(&fds[fd], f, __ATOMIC_RELEASE);
	logf_("shunt: fd %d %s [%s]:%u: shunt (slot %u, ring %llu bytes)", fd, who, ip, r.port, v->slot,
	      (unsigned long long)s.capacity);
}

static void open_side(int fd, uint8_t role, const char *who)
{
	struct shunt_msg m = {.type = SHUNT_OPEN, .role = role}, v;
	if (local_of(fd, &m.local) || remote_of(fd, &m.remote))
		return;
	ctl_request(&m, &v, 5000);
	adopt(fd, &v, who);
}

/* ---- sockets ---- */

struct helper;
static __thread struct helper *me;

static void after_fork(void)
{
	my_pid = getpid();
	/* The parent's helper thread did not come along. */
	me = NULL;
}

__attribute__((constructor)) static void init(void)
{
	resolve();
	const char *s;
	if ((s = getenv("SHUNT_CONTROL")) && *s)
		control_path = s;
	if ((s = getenv("SHUNT_REGION")) && *s)
		region_override = s;
	if ((s = getenv("SHUNT_VERBOSE")) && *s >= '1' && *s <= '9')
		verbose = *s - '0';
	if ((s = getenv("SHUNT_DISABLE")) && *s == '1')
		disabled = 1;
	if ((s = getenv("SHUNT_SPIN_NS")) && *s)
		spin_ns = atoll(s);
	if ((s = getenv("SHUNT_WAIT")) && !strcmp(s, "block"))
		spin_ns = 0;
	if (s && !strcmp(s, "spin"))
		spin_ns = INT64_MAX;
	ctl.pid = my_pid = getpid();
	pthread_atfork(NULL, NULL, after_fork);
}

/* At exit() the kernel sends FIN on every socket the program left open.
 * Do the same for fast-path flows: FIN on the ring and CLOSE to hostd, so
 * the peer reads what was sent and then EOF, instead of ECONNRESET when the
 * session ends (or nothing, on a VM port that gives hostd no sign). The
 * flows are not freed: other threads may still be inside them. A process
 * killed by a signal gets no such exit; its peers see ECONNRESET. */
static int flow_reset(struct flow *f);

__attribute__((destructor)) static void fini(void)
{
	if (!real_write || ctl.fd < 0)
		return;
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = fds[fd];
		if (!f || f->owner != getpid() || f->finished)
			continue;
		f->finished = 1; /* once per flow, though dup'd fds share it */
		if (!f->revoked && !flow_reset(f))
			shunt_ring_close_write(&f->w);
		struct shunt_msg m = {.type = SHUNT_CLOSE, .slot = f->slot, .gen = f->gen, .side = f->side};
		ctl_send(&m);
	}
	pthread_mutex_unlock(&tab_mu);
}

int socket(int domain, int type, int protocol)
{
	int fd = real_socket(domain, type, protocol);
	if (fd >= 0 && fd < FD_MAX && (domain == AF_INET || domain == AF_INET6) && (type & 0xf) == SOCK_STREAM) {
		kind[fd] = 1;
		nonblk[fd] = (type & SOCK_NONBLOCK) != 0;
	}
	return fd;
}

/* source_for asks the kernel which source address it would use (a
 * connected UDP socket sends nothing). */
static int source_for(const struct sockaddr *dst, socklen_t len, struct sockaddr_storage *src)
{
	int u = real_socket(dst->sa_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (u < 0)
		return -1;
	struct sockaddr_storage d;
	memcpy(&d, dst, len);
	if (d.ss_family == AF_INET && ((struct sockaddr_in *)&d)->sin_port == 0)
		((struct sockaddr_in *)&d)->sin_port = htons(9);
	socklen_t sl = sizeof *src;
	int r = real_connect(u, (struct sockaddr *)&d, len) < 0 || getsockname(u, (struct sockaddr *)src, &sl) < 0 ? -1 : 0;
	real_close(u);
	if (src->ss_family == AF_INET)
		((struct sockaddr_in *)src)->sin_port = 0;
	else
		((struct sockaddr_in6 *)src)->sin6_port = 0;
	return r;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len)
{
	struct shunt_addr remote, local;
	if (fd < 0 || fd >= FD_MAX || kind[fd] != 1 || disabled || !addr || to_addr(addr, &remote))
		return real_connect(fd, addr, len);
	if (is_loopback(&remote)) {
		logf_("shunt: fd %d connect: tcp (loopback)", fd);
		return real_connect(fd, addr, len);
	}
	if (ctl_ensure()) {
		logf_("shunt: fd %d connect: tcp (no-hostd)", fd);
		return real_connect(fd, addr, len);
	}
	/* Bind first to learn the tuple, announce it, then connect. */
	struct sockaddr_storage src;
	if (local_of(fd, &local) == 0 && local.port == 0 && source_for(addr, len, &src) == 0)
		bind(fd, (struct sockaddr *)&src, src.ss_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6));
	if (local_of(fd, &local) == 0) {
		struct shunt_msg in = {.type = SHUNT_INTENT, .local = local, .remote = remote};
		ctl_send(&in);
	}
	int r = real_connect(fd, addr, len);
	if (r == 0) {
		open_side(fd, 1, "connect");
		return 0;
	}
	if (errno != EINPROGRESS)
		return r;
	/* Non-blocking connect: a connection to a guest on this host completes
	 * in well under a millisecond, so wait for it (bounded) and take the
	 * verdict now; the program sees an immediate success, which
	 * non-blocking connect may always report. A slower connection is not
	 * to a local guest: it stays on TCP, as EINPROGRESS. */
	struct pollfd p = {.fd = fd, .events = POLLOUT};
	if (real_poll(&p, 1, 200) != 1) {
		logf_("shunt: fd %d connect: tcp (slow non-blocking connect)", fd);
		errno = EINPROGRESS;
		return -1;
	}
	int err = 0;
	socklen_t el = sizeof err;
	getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
	if (err) {
		errno = err;
		return -1;
	}
	open_side(fd, 1, "connect");
	return 0;
}

int listen(int fd, int backlog)
{
	int r = real_listen(fd, backlog);
	if (r == 0 && fd >= 0 && fd < FD_MAX && kind[fd] == 1 && !disabled && ctl_ensure() == 0) {
		struct shunt_msg m = {.type = SHUNT_LISTEN};
		if (local_of(fd, &m.local) == 0 && ctl_send(&m) == 0) {
			ctl_sync();
			kind[fd] = 2;
		}
	}
	return r;
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags)
{
	int c = real_accept4(fd, addr, len, flags);
	if (c >= 0 && c < FD_MAX && fd >= 0 && fd < FD_MAX && kind[fd] == 2) {
		kind[c] = 1;
		nonblk[c] = (flags & SOCK_NONBLOCK) != 0;
		struct shunt_addr r;
		if (remote_of(c, &r) == 0 && !is_loopback(&r))
			open_side(c, 2, "accept");
	}
	return c;
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) { return accept4(fd, addr, len, 0); }

/* ---- data ---- */

static int map_err(ssize_t e)
{
	switch (e) {
	case SHUNT_EAGAIN: return EAGAIN;
	case SHUNT_EPIPE: return EPIPE;
	default: return ECONNRESET; /* reset, or a corrupt ring: the flow is over */
	}
}

/* inherited reports (and fails with ENOTCONN) use of a flow inherited
 * across fork(): flows stay with the parent (see the rules above). */
static int inherited(struct flow *f)
{
	if (f->owner == my_pid)
		return 0;
	errno = ENOTCONN;
	return 1;
}

/* flow_reset reports whether either ring of the flow was reset. hostd
 * resets both, one after the other; a peer that saw the first may already
 * have closed (FIN) the other, so an end that reads EOF checks both before
 * it believes it (otherwise a revocation could look like a clean close). */
static int flow_reset(struct flow *f)
{
	return __atomic_load_n((uint32_t *)(f->r.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST) ||
	       __atomic_load_n((uint32_t *)(f->w.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST);
}

static ssize_t fast_recv(struct flow *f, void *buf, size_t n, int flags)
{
	if (inherited(f))
		return -1;
	int nb = f->nonblock || (flags & MSG_DONTWAIT);
	size_t done = 0;
	pthread_mutex_lock(&f->rmu);
	for (;;) {
		ssize_t k = (flags & MSG_PEEK) ? shunt_ring_peek(&f->r, (uint8_t *)buf + done, n - done)
					       : shunt_ring_read(&f->r, (uint8_t *)buf + done, n - done);
		if (k > 0) {
			done += k;
			if (!(flags & MSG_WAITALL) || done == n || (flags & MSG_PEEK))
				break;
			continue;
		}
		if (k == 0 && n > 0 && !done && flow_reset(f)) {
			pthread_mutex_unlock(&f->rmu);
			errno = ECONNRESET;
			return -1;
		}
		if (k == 0 || n == 0)
			break; /* EOF */
		if (k != SHUNT_EAGAIN || nb || (done && !(flags & MSG_WAITALL))) {
			if (done)
				break;
			pthread_mutex_unlock(&f->rmu);
			errno = map_err(k);
			return -1;
		}
		shunt_ring_wait(&f->r, 1, spin_ns, -1);
	}
	pthread_mutex_unlock(&f->rmu);
	if (verbose > 1)
		logf_("shunt: recv %zu flags %#x -> %zu", n, flags, done);
	return done;
}

static ssize_t fast_send(struct flow *f, const void *buf, size_t n, int flags)
{
	if (inherited(f))
		return -1;
	int nb = f->nonblock || (flags & MSG_DONTWAIT);
	size_t done = 0;
	pthread_mutex_lock(&f->wmu);
	while (done < n || n == 0) {
		ssize_t k = shunt_ring_write(&f->w, (const uint8_t *)buf + done, n - done);
		if (k >= 0) {
			done += k;
			if (n == 0)
				break;
			continue;
		}
		if (k == SHUNT_EAGAIN && !nb) {
			shunt_ring_wait(&f->w, 0, spin_ns, -1);
			continue;
		}
		if (done && k == SHUNT_EAGAIN)
			break;
		pthread_mutex_unlock(&f->wmu);
		if (k == SHUNT_EPIPE && !(flags & MSG_NOSIGNAL))
			raise(SIGPIPE);
		errno = map_err(k);
		return -1;
	}
	pthread_mutex_unlock(&f->wmu);
	if (verbose > 1)
		logf_("shunt: send %zu flags %#x -> %zu", n, flags, done);
	return done;
}

ssize_t read(int fd, void *buf, size_t n)
{
	struct flow *f = flow_of(fd);
	return f ? fast_recv(f, buf, n, 0) : real_read(fd, buf, n);
}

ssize_t write(int fd, const void *buf, size_t n)
{
	struct flow *f = flow_of(fd);
	return f ? fast_send(f, buf, n, 0) : real_write(fd, buf, n);
}

ssize_t recv(int fd, void *buf, size_t n, int flags)
{
	struct flow *f = flow_of(fd);
	return f ? fast_recv(f, buf, n, flags) : real_recv(fd, buf, n, flags);
}

ssize_t send(int fd, const void *buf, size_t n, int flags)
{
	struct flow *f = flow_of(fd);
	return f ? fast_send(f, buf, n, flags) : real_send(fd, buf, n, flags);
}

ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *addr, socklen_t *len)
{
	struct flow *f = flow_of(fd);
	if (!f)
		return real_recvfrom(fd, buf, n, flags, addr, len);
	if (addr && len)
		getpeername(fd, addr, len);
	return fast_recv(f, buf, n, flags);
}

ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *addr, socklen_t len)
{
	struct flow *f = flow_of(fd);
	return f ? fast_send(f, buf, n, flags) : real_sendto(fd, buf, n, flags, addr, len);
}

static ssize_t fast_readv(struct flow *f, const struct iovec *iov, int cnt, int flags)
{
	ssize_t total = 0;
	for (int i = 0; i < cnt; i++) {
		if (!iov[i].iov_len)
			continue;
		/* Block only for the first byte, as readv does. */
		ssize_t k = fast_recv(f, iov[i].iov_base, iov[i].iov_len, total ? flags | MSG_DONTWAIT : flags);
		if (k < 0)
			return total ? total : -1;
		total += k;
		if ((size_t)k < iov[i].iov_len)
			break;
	}
	return total;
}

static ssize_t fast_writev(struct flow *f, const struct iovec *iov, int cnt, int flags)
{
	ssize_t total = 0;
	for (int i = 0; i < cnt; i++) {
		ssize_t k = fast_send(f, iov[i].iov_base, iov[i].iov_len, flags);
		if (k < 0)
			return total ? total : -1;
		total += k;
		if ((size_t)k < iov[i].iov_len)
			break;
	}
	return total;
}

ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
	struct flow *f = flow_of(fd);
	return f ? fast_readv(f, iov, cnt, 0) : real_readv(fd, iov, cnt);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
	struct flow *f = flow_of(fd);
	return f ? fast_writev(f, iov, cnt, 0) : real_writev(fd, iov, cnt);
}

ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
	struct flow *f = flow_of(fd);
	if (!f)
		return real_recvmsg(fd, msg, flags);
	msg->msg_controllen = 0;
	msg->msg_flags = 0;
	return fast_readv(f, msg->msg_iov, msg->msg_iovlen, flags);
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	struct flow *f = flow_of(fd);
	return f ? fast_writev(f, msg->msg_iov, msg->msg_iovlen, flags) : real_sendmsg(fd, msg, flags);
}

ssize_t sendfile(int out, int in, off_t *off, size_t count)
{
	struct flow *f = flow_of(out);
	if (!f)
		return real_sendfile(out, in, off, count);
	/* By copying: the bytes go through the ring. */
	char buf[65536];
	size_t n = count < sizeof buf ? count : sizeof buf;
	ssize_t k = off ? pread(in, buf, n, *off) : real_read(in, buf, n);
	if (k <= 0)
		return k;
	ssize_t w = fast_send(f, buf, k, 0);
	if (w > 0 && off)
		*off += w;
	else if (w > 0 && w < k)
		lseek(in, w - k, SEEK_CUR);
	return w;
}

/* ---- lifetime ---- */

static void release(struct flow *f)
{
	if (f->owner != my_pid) { /* a fork child's copy: only forget it */
		free(f);
		return;
	}
	if (!f->revoked && !flow_reset(f))
		shunt_ring_close_write(&f->w);
	shunt_ring_close_read(&f->r);
	struct shunt_msg m = {.type = SHUNT_CLOSE, .slot = f->slot, .gen = f->gen, .side = f->side};
	ctl_send(&m);
	free(f);
}

/* forget drops fd's reference to its flow; the last one releases it. */
static void forget(int fd)
{
	if (fd < 0 || fd >= FD_MAX)
		return;
	pthread_mutex_lock(&tab_mu);
	struct flow *f = fds[fd];
	fds[fd] = NULL;
	int last = f && --f->refs == 0;
	if (kind[fd] == 2) {
		struct shunt_msg m = {.type = SHUNT_UNLISTEN};
		if (local_of(fd, &m.local) == 0)
			ctl_send(&m);
	}
	kind[fd] = 0;
	for (int i = 0; i < eps_top && f; i++) /* drop its epoll interests */
		if (eps[i]) {
			pthread_mutex_lock(&eps[i]->mu);
			for (int j = 0; j < eps[i]->n; j++)
				if (eps[i]->it[j].fd == fd)
					eps[i]->it[j--] = eps[i]->it[--eps[i]->n];
			pthread_mutex_unlock(&eps[i]->mu);
		}
	if (eps[fd]) { /* an epoll fd */
		free(eps[fd]->it);
		free(eps[fd]);
		eps[fd] = NULL;
	}
	pthread_mutex_unlock(&tab_mu);
	if (last)
		release(f);
}

int close(int fd)
{
	forget(fd);
	return real_close(fd);
}

int shutdown(int fd, int how)
{
	struct flow *f = flow_of(fd);
	if (!f)
		return real_shutdown(fd, how);
	/* The kernel socket is the lease and stays as it is. */
	if (how == SHUT_WR || how == SHUT_RDWR) {
		pthread_mutex_lock(&f->wmu);
		shunt_ring_close_write(&f->w);
		pthread_mutex_unlock(&f->wmu);
	}
	if (how == SHUT_RD || how == SHUT_RDWR)
		shunt_ring_close_read(&f->r);
	return 0;
}

static void share(int old, int fd)
{
	if (fd < 0 || fd >= FD_MAX || old < 0 || old >= FD_MAX || fd == old)
		return;
	forget(fd);
	pthread_mutex_lock(&tab_mu);
	struct flow *f = fds[old];
	if (f)
		f->refs++;
	fds[fd] = f;
	kind[fd] = kind[old] == 2 ? 1 : kind[old]; /* the listener registration stays with old */
	nonblk[fd] = nonblk[old];
	pthread_mutex_unlock(&tab_mu);
}

int dup(int old)
{
	int fd = real_dup(old);
	if (fd >= 0)
		share(old, fd);
	return fd;
}

int dup2(int old, int fd)
{
	if (old != fd)
		forget(fd);
	int r = real_dup2(old, fd);
	if (r >= 0)
		share(old, r);
	return r;
}

int dup3(int old, int fd, int flags)
{
	forget(fd);
	int r = real_dup3(old, fd, flags);
	if (r >= 0)
		share(old, r);
	return r;
}

static void set_nonblock(int fd, int on)
{
	if (fd < 0 || fd >= FD_MAX)
		return;
	nonblk[fd] = on;
	struct flow *f = flow_of(fd);
	if (f)
		f->nonblock = on;
}

int fcntl(int fd, int cmd, ...)
{
	va_list ap;
	va_start(ap, cmd);
	long arg = va_arg(ap, long);
	va_end(ap);
	int r = real_fcntl(fd, cmd, arg);
	if (r >= 0 && cmd == F_SETFL)
		set_nonblock(fd, (arg & O_NONBLOCK) != 0);
	if (r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC))
		share(fd, r);
	return r;
}

int ioctl(int fd, unsigned long req, ...)
{
	va_list ap;
	va_start(ap, req);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	struct flow *f = flow_of(fd);
	if (f && req == FIONREAD) {
		ssize_t n = shunt_ring_buffered(&f->r);
		*(int *)arg = n > 0 ? (int)n : 0;
		return 0;
	}
	int r = real_ioctl(fd, req, arg);
	if (r == 0 && req == FIONBIO)
		set_nonblock(fd, *(int *)arg != 0);
	return r;
}

/* ---- waiting on sets: poll, select, epoll ---- */

#ifndef FUTEX_32
#define FUTEX_32 2
#endif
struct waitv { uint64_t val, uaddr; uint32_t flags, reserved; };

/* helper is a thread's sleeper: it waits on ring futex words with
 * futex_waitv and writes efd when one is woken, so a poll/epoll that
 * includes efd wakes up for ring traffic as well as kernel events. */
struct helper {
	int efd, ok;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	struct waitv w[65];
	int n, req;
	uint32_t cancel;
};
static void *helper_loop(void *arg)
{
	struct helper *h = arg;
	for (;;) {
		pthread_mutex_lock(&h->mu);
		while (!h->req)
			pthread_cond_wait(&h->cv, &h->mu);
		int n = h->n;
		pthread_mutex_unlock(&h->mu);
		struct timespec until, *up = NULL;
		if (vm_mode) { /* kicks can be lost: wake at least every 20 ms */
			clock_gettime(CLOCK_MONOTONIC, &until);
			until.tv_nsec += VM_FALLBACK_NS;
			until.tv_sec += until.tv_nsec / 1000000000;
			until.tv_nsec %= 1000000000;
			up = &until;
		}
		long r = syscall(SYS_futex_waitv, h->w, n, 0, up, CLOCK_MONOTONIC);
		(void)r;
		if (!__atomic_load_n(&h->cancel, __ATOMIC_SEQ_CST)) {
			uint64_t one = 1;
			real_write(h->efd, &one, 8);
		}
		pthread_mutex_lock(&h->mu);
		h->req = 0;
		pthread_cond_broadcast(&h->cv);
		pthread_mutex_unlock(&h->mu);
	}
	return NULL;
}

static struct helper *helper(void)
{
	if (me)
		return me->ok ? me : NULL;
	me = calloc(1, sizeof *me);
	if (!me)
		return NULL;
	pthread_mutex_init(&me->mu, NULL);
	pthread_cond_init(&me->cv, NULL);
	me->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	pthread_t th;
	pthread_attr_t at;
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	me->ok = me->efd >= 0 && pthread_create(&th, &at, helper_loop, me) == 0;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return me->ok ? me : NULL;
}

/* A set of futex words to sleep on (the rings' waiting flags); seq is the
 * kick count from before they were set (VM mode). */
struct arm { uint32_t *flag[64]; int n; uint32_t seq; };

static void arm_add(struct arm *a, struct flow *f, int reader)
{
	if (a->n < 64)
		a->flag[a->n++] = (uint32_t *)((reader ? f->r.hdr : f->w.hdr) + (reader ? SHUNT_OFF_RWAIT : SHUNT_OFF_WWAIT));
}

static void arm_set(struct arm *a, uint32_t v)
{
	if (v)
		a->seq = vm_seq();
	for (int i = 0; i < a->n; i++)
		__atomic_store_n(a->flag[i], v, __ATOMIC_SEQ_CST);
}

static void helper_start(struct helper *h, struct arm *a)
{
	pthread_mutex_lock(&h->mu);
	__atomic_store_n(&h->cancel, 0, __ATOMIC_SEQ_CST);
	h->w[0] = (struct waitv){.val = 0, .uaddr = (uintptr_t)&h->cancel, .flags = FUTEX_32};
	if (vm_mode) { /* the flags sit in a BAR: sleep on the kick count instead */
		h->w[1] = (struct waitv){.val = a->seq, .uaddr = (uintptr_t)&kick_seq, .flags = FUTEX_32};
		h->n = 2;
	} else {
		for (int i = 0; i < a->n; i++)
			h->w[i + 1] = (struct waitv){.val = 1, .uaddr = (uintptr_t)a->flag[i], .flags = FUTEX_32};
		h->n = a->n + 1;
	}
	h->req = 1;
	pthread_cond_broadcast(&h->cv);
	pthread_mutex_unlock(&h->mu);
}

static void helper_stop(struct helper *h)
{
	__atomic_store_n(&h->cancel, 1, __ATOMIC_SEQ_CST);
	syscall(SYS_futex, &h->cancel, FUTEX_WAKE, 1, NULL, NULL, 0);
	pthread_mutex_lock(&h->mu);
	while (h->req)
		pthread_cond_wait(&h->cv, &h->mu);
	pthread_mutex_unlock(&h->mu);
	uint64_t v;
	while (real_read(h->efd, &v, 8) == 8)
		;
}

/* fast_events returns the poll events a fast-path fd has for interest ev. */
static short fast_events(struct flow *f, short ev)
{
	short r = 0;
	if (f->revoked || __atomic_load_n((uint32_t *)(f->r.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST))
		return POLLIN | POLLOUT | POLLERR | POLLHUP;
	if ((ev & POLLIN) && shunt_ring_ready(&f->r, 1))
		r |= POLLIN | (__atomic_load_n((uint32_t *)(f->r.hdr + SHUNT_OFF_WFLAGS), __ATOMIC_SEQ_CST) & 1 ? POLLRDHUP & ev : 0);
	if ((ev & POLLOUT) && shunt_ring_ready(&f->w, 0))
		r |= POLLOUT;
	return r;
}

static int remaining_ms(int64_t deadline)
{
	if (deadline < 0)
		return -1;
	int64_t left = deadline - now_ns();
	return left <= 0 ? 0 : (int)((left + 999999) / 1000000);
}

/* do_poll is poll(2) over a set that may contain fast-path fds. */
static int do_poll(struct pollfd *p, nfds_t n, int64_t timeout_ns, const sigset_t *mask)
{
	int fast = 0;
	for (nfds_t i = 0; i < n; i++)
		fast += flow_of(p[i].fd) != NULL;
	if (!fast) {
		struct timespec ts = {timeout_ns / 1000000000, timeout_ns % 1000000000};
		return real_ppoll(p, n, timeout_ns < 0 ? NULL : &ts, mask);
	}
	struct pollfd stack[64], *kp = n + 1 <= 64 ? stack : malloc((n + 1) * sizeof *kp);
	if (!kp)
		return errno = ENOMEM, -1;
	int64_t start = now_ns(), deadline = timeout_ns < 0 ? -1 : start + timeout_ns;
	int result;
	/* While spinning, the rings are checked on every turn but the kernel
	 * fds (a syscall) only every kernel_every turns. */
	const unsigned kernel_every = 16;
	for (unsigned turn = 0;; turn++) {
		int ready = 0;
		for (nfds_t i = 0; i < n; i++) {
			struct flow *f = flow_of(p[i].fd);
			kp[i] = p[i];
			kp[i].revents = 0;
			if (f) {
				p[i].revents = fast_events(f, p[i].events);
				kp[i].fd = -1;
			} else {
				p[i].revents = 0;
			}
		}
		int k = 0;
		if (turn % kernel_every == 0)
			k = real_poll(kp, n, 0);
		for (nfds_t i = 0; i < n; i++) {
			if (kp[i].fd >= 0)
				p[i].revents = kp[i].revents;
			ready += p[i].revents != 0;
		}
		if (ready || k < 0) {
			result = k < 0 ? k : ready;
			break;
		}
		int64_t now = now_ns();
		if (deadline >= 0 && now >= deadline) {
			result = 0;
			break;
		}
		if (now - start < spin_ns)
			continue;
		/* Block: publish "waiting" in every fast ring, re-check, sleep. */
		struct arm a = {.n = 0};
		for (nfds_t i = 0; i < n; i++) {
			struct flow *f = flow_of(p[i].fd);
			if (f && (p[i].events & POLLIN))
				arm_add(&a, f, 1);
			if (f && (p[i].events & POLLOUT))
				arm_add(&a, f, 0);
		}
		arm_set(&a, 1);
		int again = 0;
		for (nfds_t i = 0; i < n; i++) {
			struct flow *f = flow_of(p[i].fd);
			if (f && fast_events(f, p[i].events))
				again = 1;
		}
		struct helper *h = again ? NULL : helper();
		if (!again && h) {
			helper_start(h, &a);
			kp[n] = (struct pollfd){.fd = h->efd, .events = POLLIN};
			int64_t left = deadline < 0 ? -1 : deadline - now_ns();
			struct timespec ts = {left / 1000000000, left % 1000000000};
			real_ppoll(kp, n + 1, left < 0 ? NULL : &ts, mask);
			helper_stop(h);
		} else if (!again) {
			/* No futex_waitv (kernel < 5.16): sleep in short slices. */
			int ms = remaining_ms(deadline);
			real_poll(kp, n, ms < 0 || ms > 1 ? 1 : ms);
		}
		arm_set(&a, 0);
	}
	if (kp != stack)
		free(kp);
	return result;
}

int poll(struct pollfd *p, nfds_t n, int timeout)
{
	return do_poll(p, n, timeout < 0 ? -1 : (int64_t)timeout * 1000000, NULL);
}

int ppoll(struct pollfd *p, nfds_t n, const struct timespec *ts, const sigset_t *mask)
{
	return do_poll(p, n, ts ? (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec : -1, mask);
}

static int do_select(int nfds, fd_set *r, fd_set *w, fd_set *e, int64_t timeout_ns, const sigset_t *mask)
{
	struct pollfd p[FD_SETSIZE];
	int n = 0;
	for (int fd = 0; fd < nfds && fd < FD_SETSIZE; fd++) {
		short ev = (r && FD_ISSET(fd, r) ? POLLIN : 0) | (w && FD_ISSET(fd, w) ? POLLOUT : 0) |
			   (e && FD_ISSET(fd, e) ? POLLPRI : 0);
		if (ev)
			p[n++] = (struct pollfd){.fd = fd, .events = ev};
	}
	int k = do_poll(p, n, timeout_ns, mask);
	if (k < 0)
		return k;
	if (r)
		FD_ZERO(r);
	if (w)
		FD_ZERO(w);
	if (e)
		FD_ZERO(e);
	int count = 0;
	for (int i = 0; i < n; i++) {
		short re = p[i].revents;
		if (r && (re & (POLLIN | POLLHUP | POLLERR)) && (p[i].events & POLLIN))
			FD_SET(p[i].fd, r), count++;
		if (w && (re & (POLLOUT | POLLERR)) && (p[i].events & POLLOUT))
			FD_SET(p[i].fd, w), count++;
		if (e && (re & POLLPRI))
			FD_SET(p[i].fd, e), count++;
	}
	return count;
}

int select(int nfds, fd_set *r, fd_set *w, fd_set *e, struct timeval *tv)
{
	int64_t t = tv ? (int64_t)tv->tv_sec * 1000000000 + tv->tv_usec * 1000 : -1;
	return do_select(nfds, r, w, e, t, NULL);
}

int pselect(int nfds, fd_set *r, fd_set *w, fd_set *e, const struct timespec *ts, const sigset_t *mask)
{
	return do_select(nfds, r, w, e, ts ? (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec : -1, mask);
}

/* epoll: interest in fast-path fds is kept here, not in the kernel (their
 * kernel sockets stay idle); everything else is the kernel's. */
#define EFD_MAGIC 0x5348554e54454644ull /* "SHUNTEFD" */

static struct ep *ep_of(int epfd, int create)
{
	if (epfd < 0 || epfd >= FD_MAX)
		return NULL;
	pthread_mutex_lock(&tab_mu);
	if (!eps[epfd] && create) {
		eps[epfd] = calloc(1, sizeof **eps);
		if (eps[epfd])
			pthread_mutex_init(&eps[epfd]->mu, NULL);
		if (epfd >= eps_top)
			eps_top = epfd + 1;
	}
	struct ep *e = eps[epfd];
	pthread_mutex_unlock(&tab_mu);
	return e;
}

static int ep_add_nested(int epfd, int op, int fd, struct epoll_event *ev);

int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
	if (fd >= 0 && fd < FD_MAX && eps[fd]) /* an epoll set inside another */
		return ep_add_nested(epfd, op, fd, ev);
	struct flow *f = flow_of(fd);
	struct ep *e = ep_of(epfd, f != NULL);
	if (e) {
		pthread_mutex_lock(&e->mu);
		int at = -1;
		for (int i = 0; i < e->n; i++)
			if (e->it[i].fd == fd)
				at = i;
		if (f || at >= 0) {
			int r = 0;
			if (op == EPOLL_CTL_ADD && at >= 0)
				r = -1, errno = EEXIST;
			else if (op != EPOLL_CTL_ADD && at < 0)
				r = -1, errno = ENOENT;
			else if (op == EPOLL_CTL_DEL)
				e->it[at] = e->it[--e->n];
			else if (op == EPOLL_CTL_MOD)
				e->it[at].ev = *ev, e->it[at].seen = 0;
			else {
				if (e->n == e->cap) {
					int cap = e->cap ? 2 * e->cap : 8;
					struct epi *it = realloc(e->it, cap * sizeof *it);
					if (!it) {
						pthread_mutex_unlock(&e->mu);
						return errno = ENOMEM, -1;
					}
					e->it = it, e->cap = cap;
				}
				e->it[e->n++] = (struct epi){.fd = fd, .ev = *ev};
			}
			pthread_mutex_unlock(&e->mu);
			return r;
		}
		pthread_mutex_unlock(&e->mu);
	}
	return real_epoll_ctl(epfd, op, fd, ev);
}

/* ep_add_nested registers an inner epoll fd with the kernel as usual and
 * also here, so the outer set sees the inner set's fast-path readiness. */
static int ep_add_nested(int epfd, int op, int fd, struct epoll_event *ev)
{
	int r = real_epoll_ctl(epfd, op, fd, ev);
	struct ep *e = ep_of(epfd, 1);
	if (r < 0 || !e)
		return r;
	pthread_mutex_lock(&e->mu);
	int at = -1;
	for (int i = 0; i < e->n; i++)
		if (e->it[i].fd == fd)
			at = i;
	if (op == EPOLL_CTL_DEL && at >= 0)
		e->it[at] = e->it[--e->n];
	else if (op == EPOLL_CTL_MOD && at >= 0)
		e->it[at].ev = *ev;
	else if (op == EPOLL_CTL_ADD && at < 0) {
		if (e->n == e->cap) {
			int cap = e->cap ? 2 * e->cap : 8;
			struct epi *it = realloc(e->it, cap * sizeof *it);
			if (it)
				e->it = it, e->cap = cap;
		}
		if (e->n < e->cap)
			e->it[e->n++] = (struct epi){.fd = fd, .ev = *ev, .nested = 1};
	}
	pthread_mutex_unlock(&e->mu);
	return r;
}

static uint32_t ep_from_poll(short r)
{
	return (r & POLLIN ? EPOLLIN : 0) | (r & POLLOUT ? EPOLLOUT : 0) | (r & POLLERR ? EPOLLERR : 0) |
	       (r & POLLHUP ? EPOLLHUP : 0) | (r & POLLRDHUP ? EPOLLRDHUP : 0);
}

static int ep_collect(struct ep *e, struct epoll_event *out, int max, struct arm *a);

/* ep_peek reports whether a set has a ready fast-path interest, without
 * consuming edge-triggered or one-shot state (for nested sets). */
static int ep_peek(struct ep *e)
{
	int ready = 0;
	pthread_mutex_lock(&e->mu);
	for (int i = 0; i < e->n && !ready; i++) {
		struct flow *f = e->it[i].nested ? NULL : flow_of(e->it[i].fd);
		uint32_t ev = e->it[i].ev.events;
		if (f && fast_events(f, (ev & EPOLLIN ? POLLIN : 0) | (ev & EPOLLOUT ? POLLOUT : 0)))
			ready = 1;
	}
	pthread_mutex_unlock(&e->mu);
	return ready;
}

/* ep_collect reports ready fast-path interests (level-triggered; EPOLLET
 * reports once per new tail; EPOLLONESHOT disarms). */
static int ep_collect(struct ep *e, struct epoll_event *out, int max, struct arm *a)
{
	int k = 0;
	pthread_mutex_lock(&e->mu);
	for (int i = 0; i < e->n && k < max; i++) {
		struct epi *x = &e->it[i];
		if (x->nested) {
			struct ep *in = x->fd >= 0 && x->fd < FD_MAX ? eps[x->fd] : NULL;
			if (!in || in == e || !(x->ev.events & EPOLLIN))
				continue;
			pthread_mutex_unlock(&e->mu);
			struct epoll_event tmp[1];
			int ready = a ? (ep_collect(in, NULL, 1 << 30, a), 0) : ep_peek(in);
			(void)tmp;
			pthread_mutex_lock(&e->mu);
			if (ready && k < max) {
				out[k].events = EPOLLIN;
				out[k].data = x->ev.data;
				k++;
			}
			continue;
		}
		struct flow *f = flow_of(x->fd);
		if (!f || !(x->ev.events & ~(EPOLLET | EPOLLONESHOT)))
			continue;
		short want = (x->ev.events & EPOLLIN ? POLLIN : 0) | (x->ev.events & EPOLLOUT ? POLLOUT : 0) |
			     (x->ev.events & EPOLLRDHUP ? POLLRDHUP : 0);
		if (a) {
			if (want & POLLIN)
				arm_add(a, f, 1);
			if (want & POLLOUT)
				arm_add(a, f, 0);
			continue;
		}
		uint32_t got = ep_from_poll(fast_events(f, want)) & (x->ev.events | EPOLLERR | EPOLLHUP);
		if (!got)
			continue;
		if (x->ev.events & EPOLLET) {
			uint64_t mark = __atomic_load_n((uint64_t *)(f->r.hdr + SHUNT_OFF_TAIL), __ATOMIC_SEQ_CST) ^
					__atomic_load_n((uint64_t *)(f->w.hdr + SHUNT_OFF_HEAD), __ATOMIC_SEQ_CST) << 1;
			if (mark + 1 == x->seen)
				continue;
			x->seen = mark + 1;
		}
		if (x->ev.events & EPOLLONESHOT)
			x->ev.events &= EPOLLET | EPOLLONESHOT;
		out[k].events = got;
		out[k].data = x->ev.data;
		k++;
	}
	pthread_mutex_unlock(&e->mu);
	return k;
}

static int do_epoll_wait(int epfd, struct epoll_event *ev, int max, int timeout, const sigset_t *mask)
{
	struct ep *e = ep_of(epfd, 0);
	if (!e || !e->n)
		return real_epoll_pwait(epfd, ev, max, timeout, mask);
	int64_t start = now_ns(), deadline = timeout < 0 ? -1 : start + (int64_t)timeout * 1000000;
	for (unsigned turn = 0;; turn++) {
		int k = ep_collect(e, ev, max, NULL);
		/* Non-blocking progress loops (MPI) call epoll_wait(0) back to
		 * back: ask the kernel at most every 5 us then, not every call. */
		int64_t t = now_ns();
		int ask = timeout == 0 ? t - e->kernel_at >= 5000 : turn % 16 == 0;
		if (k < max && (k || ask)) {
			e->kernel_at = t;
			int r = real_epoll_wait(epfd, ev + k, max - k, 0);
			if (r < 0 && !k)
				return r;
			int base = k;
			for (int i = 0; i < r; i++)
				if (ev[base + i].data.u64 != EFD_MAGIC)
					ev[k++] = ev[base + i];
		}
		if (k)
			return k;
		int64_t now = now_ns();
		if (deadline >= 0 && now >= deadline)
			return 0;
		if (now - start < spin_ns)
			continue;
		struct arm a = {.n = 0};
		ep_collect(e, NULL, 1 << 30, &a);
		arm_set(&a, 1);
		struct epoll_event tmp[1];
		if (ep_collect(e, tmp, 1, NULL)) {
			arm_set(&a, 0);
			continue;
		}
		struct helper *h = helper();
		if (h && !e->efd_added) {
			struct epoll_event m = {.events = EPOLLIN, .data.u64 = EFD_MAGIC};
			if (real_epoll_ctl(epfd, EPOLL_CTL_ADD, h->efd, &m) == 0 || errno == EEXIST)
				e->efd_added = 1;
		}
		if (h && e->efd_added) {
			helper_start(h, &a);
			int r = real_epoll_pwait(epfd, ev, max, remaining_ms(deadline), mask);
			helper_stop(h);
			arm_set(&a, 0);
			int kept = 0;
			for (int i = 0; i < r; i++)
				if (ev[i].data.u64 != EFD_MAGIC)
					ev[kept++] = ev[i];
			if (kept || r < 0)
				return r < 0 ? r : kept;
		} else {
			int ms = remaining_ms(deadline);
			int r = real_epoll_pwait(epfd, ev, max, ms < 0 || ms > 1 ? 1 : ms, mask);
			arm_set(&a, 0);
			if (r != 0)
				return r;
		}
	}
}

int epoll_wait(int epfd, struct epoll_event *ev, int max, int timeout) { return do_epoll_wait(epfd, ev, max, timeout, NULL); }

int epoll_pwait(int epfd, struct epoll_event *ev, int max, int timeout, const sigset_t *mask)
{
	return do_epoll_wait(epfd, ev, max, timeout, mask);
}

/* ---- exec ----
 *
 * The library's state does not survive exec, but fds without FD_CLOEXEC
 * do: in the new image a fast-path fd would be a plain kernel socket, and
 * bytes written to it would go where the peer does not read. So before
 * exec, every flow this process owns on an fd that stays open is reset
 * (the peer sees ECONNRESET) and its kernel socket shut down (the new image
 * sees EPIPE / EOF): an error on both sides, never silent loss. */
static void before_exec(void)
{
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = flow_of(fd);
		if (!f || f->owner != my_pid)
			continue;
		int fl = real_fcntl(fd, F_GETFD, 0);
		if (fl < 0 || (fl & FD_CLOEXEC))
			continue;
		/* Both reset flags first, then the wake-ups (as hostd does). */
		__atomic_store_n((uint32_t *)(f->w.hdr + SHUNT_OFF_RESET), 1, __ATOMIC_SEQ_CST);
		__atomic_store_n((uint32_t *)(f->r.hdr + SHUNT_OFF_RESET), 1, __ATOMIC_SEQ_CST);
		shunt_ring_abort(&f->w);
		shunt_ring_abort(&f->r);
		real_shutdown(fd, SHUT_RDWR);
		logf_("shunt: fd %d stays open across exec: flow reset", fd);
		struct shunt_msg m = {.type = SHUNT_CLOSE, .slot = f->slot, .gen = f->gen, .side = f->side};
		ctl_send(&m);
	}
}

int execve(const char *path, char *const argv[], char *const envp[])
{
	before_exec();
	return real_execve(path, argv, envp);
}

int execv(const char *path, char *const argv[])
{
	extern char **environ;
	return execve(path, argv, environ);
}

/* glibc's execl family calls its internal execve, which no preload can
 * see, so each is interposed here too. */
static char **argv_from(const char *first, va_list ap, char ***envp)
{
	size_t n = 1;
	va_list cp;
	va_copy(cp, ap);
	while (va_arg(cp, char *))
		n++;
	va_end(cp);
	char **argv = malloc((n + 1) * sizeof *argv);
	if (!argv)
		return NULL;
	argv[0] = (char *)first;
	for (size_t i = 1; i <= n; i++)
		argv[i] = i < n ? va_arg(ap, char *) : NULL;
	if (envp)
		*envp = va_arg(ap, char **);
	return argv;
}

int execl(const char *path, const char *arg, ...)
{
	extern char **environ;
	va_list ap;
	va_start(ap, arg);
	char **argv = argv_from(arg, ap, NULL);
	va_end(ap);
	if (!argv)
		return errno = ENOMEM, -1;
	int r = execve(path, argv, environ);
	free(argv);
	return r;
}

int execle(const char *path, const char *arg, ...)
{
	char **envp;
	va_list ap;
	va_start(ap, arg);
	char **argv = argv_from(arg, ap, &envp);
	va_end(ap);
	if (!argv)
		return errno = ENOMEM, -1;
	int r = execve(path, argv, envp);
	free(argv);
	return r;
}

int execlp(const char *file, const char *arg, ...)
{
	va_list ap;
	va_start(ap, arg);
	char **argv = argv_from(arg, ap, NULL);
	va_end(ap);
	if (!argv)
		return errno = ENOMEM, -1;
	int r = execvp(file, argv);
	free(argv);
	return r;
}

int execvpe(const char *file, char *const argv[], char *const envp[])
{
	before_exec();
	return real_execvpe(file, argv, envp);
}

int execvp(const char *file, char *const argv[])
{
	before_exec();
	return real_execvp(file, argv);
}

/* Every epoll set is known here from its creation, so that one nested in
 * another is recognized even before it holds fast-path fds. */
int epoll_create1(int flags)
{
	int fd = real_epoll_create1(flags);
	if (fd >= 0)
		ep_of(fd, 1);
	return fd;
}

int epoll_create(int size)
{
	int fd = real_epoll_create(size);
	if (fd >= 0)
		ep_of(fd, 1);
	return fd;
}
