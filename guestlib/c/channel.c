/* The control channel: opening it (a Unix socket, a virtio-serial port in
 * a VM, or in a VM without a port an AF_VSOCK stream to the host), HELLO
 * and WELCOME, and framed reads and writes (docs/protocol.md, docs/vm.md,
 * docs/vsock.md). The session (session.c) holds the state around it. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <linux/vm_sockets.h>

/* read_full reads n bytes; on a (non-blocking) port it waits for them
 * until `until` (shunt_now_ns; 0: for good, the reader between frames),
 * then fails with ETIMEDOUT: an open must not wait for good on the rest
 * of a frame an earlier user of the port left half-read. */
static int read_full(int fd, int port, void *buf, size_t n, int64_t until)
{
	uint8_t *p = buf;
	while (n) {
		ssize_t k = sys_read(fd, p, n);
		if (k < 0 && errno == EAGAIN && port) { /* a port is non-blocking (see open_port) */
			int64_t left = until ? until - shunt_now_ns() : 0;
			if (until && (left <= 0 || sys_poll1(fd, POLLIN, (int)(left / 1000000) + 1) == 0)) {
				errno = ETIMEDOUT;
				return -1;
			}
			if (!until)
				sys_poll1(fd, POLLIN, -1);
			continue;
		}
		if (k <= 0) {
			if (k < 0 && errno == EINTR)
				continue;
			return -1; /* EOF, an error, or a socket's SO_RCVTIMEO */
		}
		p += k;
		n -= k;
	}
	return 0;
}

/* recv_full reads n bytes from socket fd with recvmsg, keeping the
 * descriptors that come along in q (close-on-exec). */
static int recv_full(int fd, void *buf, size_t n, struct shunt_fdq *q)
{
	uint8_t *p = buf;
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(SHUNT_FDQ_MAX * sizeof(int))];
	} cm;
	while (n) {
		struct iovec iov = {.iov_base = p, .iov_len = n};
		struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof cm.b};
		ssize_t k = sys_recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
		if (k > 0 || (k == 0 && mh.msg_controllen > 0)) {
			for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
				if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
					continue;
				size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
				for (size_t i = 0; i < nfd; i++) {
					int x;
					memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof x);
					if (q->n < SHUNT_FDQ_MAX)
						q->fd[q->n++] = x;
					else
						sys_close(x);
				}
			}
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

int channel_recv(int fd, int port, struct shunt_msg *m, struct shunt_fdq *q)
{
	if (port)
		return channel_read(fd, port, m);
	uint8_t buf[SHUNT_PROTO_HEADER + SHUNT_PROTO_MAX], type;
	if (recv_full(fd, buf, SHUNT_PROTO_HEADER, q))
		return -1;
	ssize_t n = shunt_msg_header(buf, &type);
	if (n == SHUNT_EVERSION)
		errno = EPROTONOSUPPORT;
	if (n < 0 || recv_full(fd, buf + SHUNT_PROTO_HEADER, n, q))
		return -1;
	return shunt_msg_decode(buf, SHUNT_PROTO_HEADER + n, m) ? -1 : 0;
}

/* read_frame is channel_read, waiting on a port until `until` (read_full). */
static int read_frame(int fd, int port, struct shunt_msg *m, int64_t until)
{
	uint8_t buf[SHUNT_PROTO_HEADER + SHUNT_PROTO_MAX], type;
	if (read_full(fd, port, buf, SHUNT_PROTO_HEADER, until))
		return -1;
	ssize_t n = shunt_msg_header(buf, &type);
	if (n == SHUNT_EVERSION)
		errno = EPROTONOSUPPORT; /* an older hostd: the session says "version" */
	if (n < 0 || read_full(fd, port, buf + SHUNT_PROTO_HEADER, n, until))
		return -1;
	return shunt_msg_decode(buf, SHUNT_PROTO_HEADER + n, m) ? -1 : 0;
}

int channel_read(int fd, int port, struct shunt_msg *m) { return read_frame(fd, port, m, 0); }

/* write_all writes all of buf: to a socket without SIGPIPE; to a
 * (non-blocking) port waiting at most SHUNT_PORT_WRITE_NS for room, since
 * a port whose host end is gone takes no data. */
static int write_all(int fd, int port, const uint8_t *buf, size_t n)
{
	int64_t until = shunt_now_ns() + SHUNT_PORT_WRITE_NS;
	while (n) {
		ssize_t k = port ? sys_write(fd, buf, n) : sys_send(fd, buf, n, MSG_NOSIGNAL);
		if (k > 0) {
			buf += k;
			n -= k;
			continue;
		}
		if (k < 0 && errno != EAGAIN && errno != EINTR)
			return -1;
		int64_t left = until - shunt_now_ns();
		if (left <= 0 || sys_poll1(fd, POLLOUT, (int)(left / 1000000) + 1) < 0) {
			errno = ETIMEDOUT;
			return -1;
		}
	}
	return 0;
}

int channel_write(int fd, int port, const struct shunt_msg *m)
{
	uint8_t buf[SHUNT_PROTO_HEADER + SHUNT_PROTO_MAX];
	ssize_t n = shunt_msg_encode(m, buf, sizeof buf);
	if (n < 0) {
		errno = EINVAL;
		return -1;
	}
	return write_all(fd, port, buf, n);
}

/* welcome_ok checks that hostd chose our ring format: a WELCOME with
 * none in common (formats 0) leaves every connection on TCP, so the
 * session is not kept (reason version, retried later). */
static int welcome_ok(const struct shunt_msg *m)
{
	if (m->formats & (1u << SHUNT_RING_FORMAT))
		return 0;
	errno = EPROTONOSUPPORT;
	return -1;
}

/* hello is this library's HELLO: its pid, the ring format it reads and
 * writes, and the capabilities its user handles (SHUNT_CAP_RESUME). */
static struct shunt_msg hello(const struct shunt_session *s)
{
	return (struct shunt_msg){.type = SHUNT_HELLO, .pid = getpid(),
				  .formats = 1u << SHUNT_RING_FORMAT | (s->c.caps & SHUNT_CAP_RESUME)};
}

/* port_hello says HELLO on a port until WELCOME comes: the port drops what
 * is written before both ends are open, and it may still hold what hostd
 * sent to an earlier user of the port, which is skipped. */
static int port_hello(const struct shunt_session *s, int fd, struct shunt_msg *m)
{
	for (int try = 0; try < SHUNT_PORT_HELLO_TRIES; try++) {
		struct shunt_msg h = hello(s);
		if (channel_write(fd, 1, &h))
			return -1;
		int64_t until = shunt_now_ns() + SHUNT_PORT_HELLO_NS;
		for (;;) {
			int64_t left = until - shunt_now_ns();
			if (left <= 0 || sys_poll1(fd, POLLIN, (int)(left / 1000000) + 1) <= 0)
				break;
			if (read_frame(fd, 1, m, shunt_now_ns() + SHUNT_PORT_WRITE_NS))
				return -1;
			if (m->type == SHUNT_WELCOME)
				return welcome_ok(m);
			if (m->type == SHUNT_ERROR && m->reason != SHUNT_REASON_NO_HOSTD)
				return -1;
		}
	}
	errno = ETIMEDOUT;
	return -1;
}

/* open_port opens one control port and gets WELCOME on it: VM mode from
 * then on. -1 with errno EBUSY if another process has the port. */
static int open_port(struct shunt_session *s, const char *path, struct shunt_msg *m)
{
	/* Non-blocking, as the Go library uses it (through the poller): with
	 * blocking I/O, a write from the keepalive thread never returned while
	 * the reader thread sat in read() (seen in TestVMPreloadHostdRestart). */
	int fd = open(path, O_RDWR | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0)
		return -1;
	if (port_hello(s, fd, m)) {
		int e = errno;
		sys_close(fd);
		errno = e;
		return -1;
	}
	/* A WELCOME without region 0 is a VM of a pair-region group: its
	 * devices are pair regions, found when REGION names them (regions.c). */
	if (!s->region_path && m->region_size && shunt_find_bar(s->bar, sizeof s->bar) == 0)
		s->region_path = s->bar;
	__atomic_store_n(&s->guest_id, m->guest_id, __ATOMIC_RELAXED);
	__atomic_store_n(&s->vm, 1, __ATOMIC_SEQ_CST);
	shunt_kicks_enable();
	shunt_logf(s, "shunt: control port %s", path);
	return fd;
}

/* connect_hello connects a socket of family to sa (len bytes) and gets
 * WELCOME in m, every step bounded: a vsock connect by
 * SHUNT_VSOCK_CONNECT_MS (the kernel's default bound, said here), HELLO's
 * write and WELCOME's read by SHUNT_HELLO_TIMEOUT_S. ERROR(not-guest),
 * hostd refusing a process outside the guest's network namespace, is
 * EPERM, its text in m. */
static int connect_hello(struct shunt_session *s, int family, const struct sockaddr *sa, socklen_t len, struct shunt_msg *m)
{
	errno = 0;
	int fd = sys_socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct shunt_msg h = hello(s);
	struct timeval tv = {.tv_sec = SHUNT_HELLO_TIMEOUT_S};
	struct timeval ct = {.tv_sec = SHUNT_VSOCK_CONNECT_MS / 1000, .tv_usec = SHUNT_VSOCK_CONNECT_MS % 1000 * 1000};
	/* Only says the kernel's default, so a refusal is no failure: a
	 * 32-bit userland with a 64-bit time_t passes a struct timeval of
	 * another size than the kernel's old option takes. */
	if (fd >= 0 && family == AF_VSOCK && sys_setsockopt(fd, AF_VSOCK, SO_VM_SOCKETS_CONNECT_TIMEOUT, &ct, sizeof ct) < 0) {
		shunt_logf(s, "shunt: vsock connect timeout not set (%s): the kernel's default bounds the connect", strerror(errno));
		errno = 0;
	}
	if (fd < 0 || sys_connect(fd, sa, len) < 0 || sys_setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0 ||
	    sys_setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0 || channel_write(fd, 0, &h) ||
	    channel_read(fd, 0, m) ||
	    (m->type == SHUNT_ERROR && m->reason == SHUNT_REASON_NOT_GUEST && (errno = EPERM)) ||
	    (m->type != SHUNT_WELCOME && (errno = EPROTO)) || welcome_ok(m)) {
		int e = errno;
		if (fd >= 0)
			sys_close(fd);
		errno = e ? e : EPROTO;
		return -1;
	}
	tv.tv_sec = 0;
	sys_setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	sys_setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
	return fd;
}

/* open_vsock opens the control channel over vsock: a stream to the host
 * (CID 2) on SHUNT_VSOCK_CONTROL_PORT, where hostd serves every vsock VM's
 * channel (Go's proto.VsockControlPort; docs/vsock.md, "The control
 * channel"). The same framing as a Unix socket's, one HELLO (a stream
 * loses nothing, unlike a port), no descriptors: a REGION comes without
 * one, and its flows go over vsock stretches (stretch.c). It needs no
 * file and no permission, so a process after setuid or chroot reaches it
 * as root's does. Sets s->vsock. */
static int open_vsock(struct shunt_session *s, struct shunt_msg *m)
{
	if (s->vsock_quiet && shunt_now_ns() < s->vsock_quiet) {
		errno = ETIMEDOUT;
		return -1;
	}
	struct sockaddr_vm sa = {.svm_family = AF_VSOCK, .svm_cid = VMADDR_CID_HOST, .svm_port = SHUNT_VSOCK_CONTROL_PORT};
	int fd = connect_hello(s, AF_VSOCK, (const struct sockaddr *)&sa, sizeof sa, m);
	if (fd < 0) {
		/* No answer at all (the connect or WELCOME timed out): a device
		 * nobody serves, as a QEMU VM's once its hostd died. The open
		 * runs in a program's connect(), so it is not tried again for
		 * SHUNT_VSOCK_QUIET_NS; a reset (nothing listens) is cheap and
		 * retried as any failed open. */
		if (errno == ETIMEDOUT || errno == EAGAIN || errno == EWOULDBLOCK) {
			s->vsock_quiet = shunt_now_ns() + SHUNT_VSOCK_QUIET_NS;
			errno = ETIMEDOUT;
		}
		return -1;
	}
	s->vsock_quiet = 0;
	__atomic_store_n(&s->guest_id, m->guest_id, __ATOMIC_RELAXED);
	__atomic_store_n(&s->vsock, 1, __ATOMIC_SEQ_CST);
	shunt_logf(s, "shunt: control over vsock (CID 2 port %d)", SHUNT_VSOCK_CONTROL_PORT);
	return fd;
}

/* open_socket opens the control socket at path, and if that fails (no
 * permission after a privilege drop, no such file after a chroot, no
 * hostd behind it, or hostd refusing this process), the abstract socket
 * SHUNT_NETNS_CONTROL that hostd serves inside a process guest's network
 * namespace: it needs no path and no permission, and reaching it proves
 * the namespace. -1 with the path's errno if neither answers (m then
 * holds hostd's ERROR text, if it sent one). */
static int open_socket(struct shunt_session *s, const char *path, struct shunt_msg *m)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = -1, e = ENAMETOOLONG;
	if (strlen(path) < sizeof sa.sun_path) {
		strcpy(sa.sun_path, path);
		if ((fd = connect_hello(s, AF_UNIX, (const struct sockaddr *)&sa, sizeof sa, m)) >= 0)
			return fd;
		e = errno;
	}
	struct sockaddr_un an = {.sun_family = AF_UNIX};
	memcpy(an.sun_path + 1, SHUNT_NETNS_CONTROL, sizeof SHUNT_NETNS_CONTROL - 1);
	struct shunt_msg am;
	fd = connect_hello(s, AF_UNIX, (const struct sockaddr *)&an, offsetof(struct sockaddr_un, sun_path) + sizeof SHUNT_NETNS_CONTROL,
			   &am);
	if (fd >= 0) {
		*m = am;
		return fd;
	}
	errno = e;
	return -1;
}

int channel_open(struct shunt_session *s, struct shunt_msg *m)
{
	struct stat st;
	const char *path = s->c.control;
	s->vsock_err = 0;
	if (!strcmp(path, SHUNT_VSOCK_CONTROL))
		return open_vsock(s, m);
	if (stat(path, &st) == 0 && S_ISCHR(st.st_mode))
		return open_port(s, path, m);
	if (stat(path, &st) < 0 && s->c.discover) {
		char **ports = shunt_find_ports();
		int n = 0;
		for (; ports && ports[n]; n++) {
			int fd = open_port(s, ports[n], m);
			if (fd >= 0 || errno != EBUSY) {
				int e = errno;
				shunt_free_ports(ports);
				errno = e;
				return fd;
			}
		}
		shunt_free_ports(ports);
		if (n > 0) {
			shunt_logf(s, "shunt: all %d control ports are in use by other processes (a VM needs one per process)", n);
			errno = EBUSY;
			return -1;
		}
		/* A VM with vsock and no control port (Firecracker has no
		 * virtio-serial): hostd serves its channel on vsock, as Go's
		 * dialControl finds it. No hostd there: a reset at once, and the
		 * socket is tried as without vsock. */
		if (stat(SHUNT_VSOCK_DEV, &st) == 0) {
			int fd = open_vsock(s, m);
			if (fd >= 0)
				return fd;
			s->vsock_err = errno;
		}
	}
	return open_socket(s, path, m);
}
