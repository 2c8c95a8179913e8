/* I/O on connections: the read and write families, send and recv with
 * their flags, sendfile, splice and shutdown, through path.c's reader and
 * writer (TCP or the rings, as the connection's paths are). Every other fd
 * goes to libc. */
#include "preload.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

/* sendfile copies through a buffer of this size on the stack; a larger
 * count returns short, as sendfile(2) may. */
#define SENDFILE_CHUNK 65536

/* ---- socket timeouts ----
 *
 * SO_RCVTIMEO and SO_SNDTIMEO stay set on the kernel socket, which
 * getsockopt reads as usual; a connection keeps a copy, read back
 * from the kernel (so with the kernel's rounding) when it becomes a
 * connection (conn.c) and after each setsockopt of either. */

/* real_getsockopt, not the interposed one: open.c's tuple() calls this
 * under tab_mu, and the interposed getsockopt settles a socket first,
 * which takes settle_mu: the lock order (preload.h) puts settle_mu
 * before tab_mu. */
static int64_t timeo_ns(int fd, int opt)
{
	struct timeval tv;
	socklen_t len = sizeof tv;
	if (real_getsockopt(fd, SOL_SOCKET, opt, &tv, &len) < 0 || len != sizeof tv || tv.tv_sec < 0 || tv.tv_usec < 0)
		return 0;
	if (tv.tv_sec >= INT64_MAX / 1000000000 - 1)
		return 0; /* centuries: none */
	return (int64_t)tv.tv_sec * 1000000000 + (int64_t)tv.tv_usec * 1000;
}

void flow_timeouts(int fd, struct flow *f)
{
	__atomic_store_n(&f->rcvtimeo, timeo_ns(fd, SO_RCVTIMEO), __ATOMIC_RELAXED);
	__atomic_store_n(&f->sndtimeo, timeo_ns(fd, SO_SNDTIMEO), __ATOMIC_RELAXED);
}

static int is_timeo(int level, int name)
{
	if (level != SOL_SOCKET)
		return 0;
#ifdef SO_RCVTIMEO_NEW
	if (name == SO_RCVTIMEO_NEW || name == SO_SNDTIMEO_NEW)
		return 1;
#endif
#ifdef SO_RCVTIMEO_OLD
	if (name == SO_RCVTIMEO_OLD || name == SO_SNDTIMEO_OLD)
		return 1;
#endif
	return name == SO_RCVTIMEO || name == SO_SNDTIMEO;
}

/* The core also calls this, for its control socket: it takes no lock. */
INTERPOSE int setsockopt(int fd, int level, int name, const void *val, socklen_t len)
{
	REAL_READY();
	int r = real_setsockopt(fd, level, name, val, len);
	if (r == 0 && is_timeo(level, name)) {
		struct flow *f = flow_get(fd);
		if (f) {
			flow_timeouts(fd, f);
			flow_put(f);
		}
	}
	return r;
}

static ssize_t fast_recv(struct flow *f, int fd, void *buf, size_t n, int flags)
{
	int64_t deadline = 0;
	return conn_recv(f, fd, buf, n, flags, &deadline);
}

static ssize_t fast_send(struct flow *f, int fd, const void *buf, size_t n, int flags)
{
	int64_t deadline = 0;
	return conn_send(f, fd, buf, n, flags, &deadline);
}

/* done_with drops the call's reference to f and returns r (errno kept). */
static ssize_t done_with(struct flow *f, ssize_t r)
{
	flow_put(f);
	return r;
}

INTERPOSE ssize_t read(int fd, void *buf, size_t n)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_recv(f, fd, buf, n, 0)) : real_read(fd, buf, n);
}

INTERPOSE ssize_t write(int fd, const void *buf, size_t n)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_send(f, fd, buf, n, 0)) : real_write(fd, buf, n);
}

INTERPOSE ssize_t recv(int fd, void *buf, size_t n, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_recv(f, fd, buf, n, flags)) : real_recv(fd, buf, n, flags);
}

INTERPOSE ssize_t send(int fd, const void *buf, size_t n, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_send(f, fd, buf, n, flags)) : real_send(fd, buf, n, flags);
}

INTERPOSE ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *addr, socklen_t *len)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	if (!f)
		return real_recvfrom(fd, buf, n, flags, addr, len);
	if (addr && len)
		getpeername(fd, addr, len);
	return done_with(f, fast_recv(f, fd, buf, n, flags));
}

INTERPOSE ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *addr, socklen_t len)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_send(f, fd, buf, n, flags)) : real_sendto(fd, buf, n, flags, addr, len);
}

/* fast_readv and fast_writev take any number of iovecs, one at a time (no
 * local copy, so none is cut off); more than IOV_MAX fails with EINVAL,
 * as readv(2) and writev(2) do. A writer on TCP gives the kernel all of
 * them at once (msg: sendmsg's, or NULL for writev's). */
static ssize_t fast_readv(struct flow *f, int fd, const struct iovec *iov, int cnt, int flags)
{
	if (cnt < 0 || cnt > IOV_MAX)
		return errno = EINVAL, -1;
	ssize_t total = 0;
	int64_t deadline = 0;
	for (int i = 0; i < cnt; i++) {
		if (!iov[i].iov_len)
			continue;
		/* Block only for the first byte, as readv does. */
		ssize_t k = conn_recv(f, fd, iov[i].iov_base, iov[i].iov_len, total ? flags | MSG_DONTWAIT : flags, &deadline);
		if (k < 0)
			return total ? total : -1;
		total += k;
		if ((size_t)k < iov[i].iov_len)
			break;
	}
	return total;
}

static ssize_t fast_writev(struct flow *f, int fd, const struct iovec *iov, int cnt, int flags, const struct msghdr *msg)
{
	if (cnt < 0 || cnt > IOV_MAX)
		return errno = EINVAL, -1;
	if (f->owner == my_pid && conn_tcp_begin(f)) {
		ssize_t k = msg ? real_sendmsg(fd, msg, flags) : real_writev(fd, iov, cnt);
		int e = errno;
		conn_tcp_end(f, k);
		errno = e;
		return k;
	}
	ssize_t total = 0;
	int64_t deadline = 0;
	for (int i = 0; i < cnt; i++) {
		ssize_t k = conn_send(f, fd, iov[i].iov_base, iov[i].iov_len, flags, &deadline);
		if (k < 0)
			return total ? total : -1;
		total += k;
		if ((size_t)k < iov[i].iov_len)
			break;
	}
	return total;
}

INTERPOSE ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_readv(f, fd, iov, cnt, 0)) : real_readv(fd, iov, cnt);
}

INTERPOSE ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_writev(f, fd, iov, cnt, 0, NULL)) : real_writev(fd, iov, cnt);
}

INTERPOSE ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	if (!f)
		return real_recvmsg(fd, msg, flags);
	msg->msg_controllen = 0;
	msg->msg_flags = 0;
	return done_with(f, fast_readv(f, fd, msg->msg_iov, msg->msg_iovlen, flags));
}

INTERPOSE ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_writev(f, fd, msg->msg_iov, msg->msg_iovlen, flags, msg)) : real_sendmsg(fd, msg, flags);
}

INTERPOSE ssize_t sendfile(int out, int in, off_t *off, size_t count)
{
	REAL_READY();
	struct flow *f = flow_get(out);
	if (!f)
		return real_sendfile(out, in, off, count);
	if (f->owner == my_pid && conn_tcp_begin(f)) { /* on TCP: the kernel's, zero copy */
		ssize_t k = real_sendfile(out, in, off, count);
		int e = errno;
		conn_tcp_end(f, k);
		errno = e;
		return done_with(f, k);
	}
	/* On the ring: by copying. */
	if (conn_write_shut(f, 0))
		return done_with(f, -1);
	char buf[SENDFILE_CHUNK];
	size_t n = count < sizeof buf ? count : sizeof buf;
	ssize_t k = off ? pread(in, buf, n, *off) : real_read(in, buf, n);
	if (k <= 0)
		return done_with(f, k);
	ssize_t w = fast_send(f, out, buf, k, 0);
	if (w > 0 && off)
		*off += w;
	else if (w > 0 && w < k)
		lseek(in, w - k, SEEK_CUR);
	return done_with(f, w);
}

/* shutdown: the writer leaves its ring before the kernel's FIN, so the
 * peer reads the ring's bytes and then EOF; SHUT_RD makes reads return
 * what the ring holds and then 0. Both wake this process's threads
 * blocked on the connection, as the kernel does. Inherited across fork,
 * the connection is the parent's: ENOTCONN. */
INTERPOSE int shutdown(int fd, int how)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	if (!f)
		return real_shutdown(fd, how);
	if (how != SHUT_RD && how != SHUT_WR && how != SHUT_RDWR) {
		errno = EINVAL;
		return done_with(f, -1);
	}
	if (f->owner != my_pid) {
		errno = ENOTCONN;
		return done_with(f, -1);
	}
	share_io(f); /* a FIN is the stream's too */
	if (how == SHUT_WR || how == SHUT_RDWR) {
		__atomic_store_n(&f->wr_shut, 1, __ATOMIC_SEQ_CST);
		struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE), *done = NULL;
		if (rg)
			shunt_ring_stop(&rg->sf.w, 0); /* a writer asleep on a full ring lets go of nothing, but wakes */
		pthread_mutex_lock(&f->wmu);
		if (rg && __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) == rg) {
			done = writer_leave(f, rg);
			stretch_drain(rg);
		}
		pthread_mutex_unlock(&f->wmu);
		rings_done(f, done);
		for (;;) { /* a RESUME's resend goes before the FIN (resume.c) */
			pthread_mutex_lock(&f->wmu);
			ssize_t k = f->rs_len ? resend_step(f, fd) : 0;
			pthread_mutex_unlock(&f->wmu);
			int64_t t = __atomic_load_n(&f->sndtimeo, __ATOMIC_RELAXED);
			if (k != -EAGAIN || resend_wait(f, fd, t > 0 ? t : -1))
				break;
		}
	}
	if (how == SHUT_RD || how == SHUT_RDWR) {
		__atomic_store_n(&f->rd_shut, 1, __ATOMIC_SEQ_CST);
		struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
		if (rg)
			shunt_ring_stop(&rg->sf.r, 1);
	}
	flow_wake(f);
	return done_with(f, real_shutdown(fd, how));
}

/* sendfile64 is what programs built with 64-bit file offsets call (nginx
 * with sendfile on): the same call on 64-bit targets. */
INTERPOSE ssize_t sendfile64(int out, int in, off64_t *off, size_t count)
{
	return sendfile(out, in, (off_t *)off, count);
}

/* ---- fortified variants ----
 *
 * _FORTIFY_SOURCE builds call these instead of read, recv and recvfrom
 * when the buffer's size is known: the same calls, after the size check. */

extern void __chk_fail(void) __attribute__((noreturn));

INTERPOSE ssize_t __read_chk(int fd, void *buf, size_t n, size_t buflen)
{
	REAL_READY();
	if (n > buflen)
		__chk_fail();
	return read(fd, buf, n);
}

INTERPOSE ssize_t __recv_chk(int fd, void *buf, size_t n, size_t buflen, int flags)
{
	REAL_READY();
	if (n > buflen)
		__chk_fail();
	return recv(fd, buf, n, flags);
}

INTERPOSE ssize_t __recvfrom_chk(int fd, void *buf, size_t n, size_t buflen, int flags, struct sockaddr *addr, socklen_t *len)
{
	REAL_READY();
	if (n > buflen)
		__chk_fail();
	return recvfrom(fd, buf, n, flags, addr, len);
}

/* ---- several messages at once ----
 *
 * On a stream socket these are a loop over sendmsg and recvmsg, and so
 * here: the count of messages moved, or -1 when the first fails. Only the
 * first recvmsg may block when MSG_WAITFORONE is set; timeout is ignored
 * (as the kernel checks it only between messages). */

INTERPOSE int sendmmsg(int fd, struct mmsghdr *v, unsigned int n, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	if (!f)
		return real_sendmmsg(fd, v, n, flags);
	unsigned int i;
	for (i = 0; i < n && i < UIO_MAXIOV; i++) {
		ssize_t k = fast_writev(f, fd, v[i].msg_hdr.msg_iov, v[i].msg_hdr.msg_iovlen, flags, &v[i].msg_hdr);
		if (k < 0)
			break;
		v[i].msg_len = k;
	}
	return done_with(f, i ? (int)i : -1);
}

INTERPOSE int recvmmsg(int fd, struct mmsghdr *v, unsigned int n, int flags, struct timespec *timeout)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	if (!f)
		return real_recvmmsg(fd, v, n, flags, timeout);
	unsigned int i;
	int fl = flags & ~MSG_WAITFORONE;
	for (i = 0; i < n && i < UIO_MAXIOV; i++) {
		v[i].msg_hdr.msg_controllen = 0;
		v[i].msg_hdr.msg_flags = 0;
		ssize_t k = fast_readv(f, fd, v[i].msg_hdr.msg_iov, v[i].msg_hdr.msg_iovlen, fl);
		if (k < 0)
			break;
		v[i].msg_len = k;
		if (k == 0) { /* EOF: this message is the last */
			i++;
			break;
		}
		if (flags & MSG_WAITFORONE)
			fl |= MSG_DONTWAIT;
	}
	return done_with(f, i ? (int)i : -1);
}

/* ---- splice ----
 *
 * With a fast-path socket at either end (the other is a pipe), splice
 * copies through a buffer, as sendfile does, and never takes from one end
 * more than the other can take now: from the ring it peeks, writes, and
 * then consumes what was written; into the ring it reads at most the
 * ring's free space when the call must not block. copy_file_range and
 * vmsplice take no socket (EINVAL, EBADF from the kernel): no byte moves,
 * so they are left to libc. */

INTERPOSE ssize_t splice(int in, loff_t *off_in, int out, loff_t *off_out, size_t len, unsigned int flags)
{
	REAL_READY();
	struct flow *fi = flow_get(in), *fo = fi ? NULL : flow_get(out);
	if (!fi && !fo)
		return real_splice(in, off_in, out, off_out, len, flags);
	int nb = (flags & SPLICE_F_NONBLOCK) != 0;
	char buf[SENDFILE_CHUNK];
	size_t n = len < sizeof buf ? len : sizeof buf;
	ssize_t r;
	if (fi) { /* ring -> pipe */
		struct flow *both = flow_get(out);
		if (both) { /* both fast: a pipe must be one end (EINVAL) */
			flow_put(both);
			errno = EINVAL;
			return done_with(fi, -1);
		}
		ssize_t k = fast_recv(fi, in, buf, n, MSG_PEEK | (nb ? MSG_DONTWAIT : 0));
		if (k <= 0)
			return done_with(fi, k);
		r = off_out ? pwrite(out, buf, k, *off_out) : real_write(out, buf, k);
		if (r > 0) {
			fast_recv(fi, in, buf, r, 0); /* consume what went out */
			if (off_out)
				*off_out += r;
		}
		return done_with(fi, r);
	}
	/* pipe -> connection: on TCP the kernel's own splice */
	if (fo->owner == my_pid && conn_tcp_begin(fo)) {
		r = real_splice(in, off_in, out, off_out, len, flags);
		int e = errno;
		conn_tcp_end(fo, r);
		errno = e;
		return done_with(fo, r);
	}
	if (conn_write_shut(fo, 0))
		return done_with(fo, -1);
	/* on the ring: never take from the pipe more than the ring takes now
	 * when the call must not block */
	if (nb || fo->nonblock) {
		struct rings *rg = __atomic_load_n(&fo->rg, __ATOMIC_ACQUIRE);
		size_t space = 0;
		if (rg) {
			uint64_t head = __atomic_load_n((uint64_t *)(rg->sf.w.hdr + SHUNT_OFF_HEAD), __ATOMIC_SEQ_CST);
			uint64_t used = rg->sf.w.own - head;
			space = used < rg->sf.w.cap ? rg->sf.w.cap - used : 0;
		}
		if (!space) {
			errno = EAGAIN;
			return done_with(fo, -1);
		}
		n = n < space ? n : space;
	}
	ssize_t k = off_in ? pread(in, buf, n, *off_in) : real_read(in, buf, n);
	if (k <= 0)
		return done_with(fo, k);
	if (off_in)
		*off_in += k;
	r = fast_send(fo, out, buf, k, 0);
	if (r >= 0 && r < k)
		plog("shunt: splice: %zd of %zd bytes taken from fd %d could not go out (%s)", k - r, k, in, strerror(errno));
	return done_with(fo, r);
}
