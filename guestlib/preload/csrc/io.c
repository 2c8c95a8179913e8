/* I/O on fast-path fds: the read and write families, send and recv with
 * their flags, sendfile and shutdown, all through the rings. Every other
 * fd goes to libc. */
#include "preload.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

/* sendfile copies through a buffer of this size on the stack; a larger
 * count returns short, as sendfile(2) may. */
#define SENDFILE_CHUNK 65536
/* A blocking call spins at most this long with the flow's lock held (see
 * blocking); a longer SHUNT_SPIN_NS spins the rest without it. */
#define LOCKED_SPIN_NS 50000

static int map_err(ssize_t e)
{
	switch (e) {
	case SHUNT_EAGAIN: return EAGAIN;
	case SHUNT_EPIPE: return EPIPE;
	default: return ECONNRESET; /* reset, or a corrupt ring: the flow is over */
	}
}

/* inherited reports (and fails with ENOTCONN) use of a flow inherited
 * across fork(): flows stay with the parent (docs/preload.md). */
static int inherited(struct flow *f)
{
	if (f->owner == my_pid)
		return 0;
	errno = ENOTCONN;
	return 1;
}

/* ---- socket timeouts ----
 *
 * SO_RCVTIMEO and SO_SNDTIMEO stay set on the kernel socket, which
 * getsockopt reads as usual; a fast-path flow keeps a copy, read back
 * from the kernel (so with the kernel's rounding) when READY comes
 * (socket.c) and after each setsockopt of either. */

static int64_t timeo_ns(int fd, int opt)
{
	struct timeval tv;
	socklen_t len = sizeof tv;
	if (getsockopt(fd, SOL_SOCKET, opt, &tv, &len) < 0 || len != sizeof tv || tv.tv_sec < 0 || tv.tv_usec < 0)
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

/* ---- blocking ----
 *
 * A blocking call that finds its ring empty (read) or full (write) first
 * spins with the flow's lock held, for spin_ns but at most LOCKED_SPIN_NS:
 * data usually comes within that, and then the lock is never let go on
 * the way. Then it lets go of the lock, spins the rest of spin_ns and
 * sleeps (shunt_ring_wait), takes the lock again and retries. So another
 * thread's call on the same end (a second reader, a non-blocking read)
 * waits at most LOCKED_SPIN_NS, never for a sleeper.
 * The wait ends, as the kernel's would:
 *
 *   - when the ring is ready, or reset (ECONNRESET), or the peer closed;
 *   - on shutdown from another thread: SHUT_RD makes a read return 0,
 *     SHUT_WR makes a write fail with EPIPE (shunt_ring_stop);
 *   - on close of the last fd from another thread: EBADF;
 *   - at the socket's SO_RCVTIMEO or SO_SNDTIMEO: EAGAIN;
 *   - on a signal while it sleeps: EINTR, unless the handler has
 *     SA_RESTART and the socket has no timeout, when the sleep goes on
 *     (shunt_ring_wait: the kernel makes that choice, in the futex call).
 *
 * Bytes already moved are returned instead of an error, as the kernel
 * returns a partial count. deadline is the call's: 0 until it first
 * waits, then the time it ends (-1: none); readv and writev share one. */

/* left_ns is the time left before the call's deadline: -1 without one. */
static int64_t left_ns(struct flow *f, int reader, int64_t *deadline)
{
	if (!*deadline) {
		int64_t t = __atomic_load_n(reader ? &f->rcvtimeo : &f->sndtimeo, __ATOMIC_RELAXED);
		*deadline = t > 0 ? now_ns() + t : -1;
	}
	if (*deadline < 0)
		return -1;
	int64_t left = *deadline - now_ns();
	return left > 0 ? left : 0;
}

/* ended: this end was closed or shut down by this process (its waits
 * return at once, so they must not be retried). */
static int ended(struct flow *f, int reader)
{
	return __atomic_load_n(&f->closed, __ATOMIC_SEQ_CST) ||
	       __atomic_load_n(reader ? &f->rd_shut : &f->wr_shut, __ATOMIC_SEQ_CST);
}

/* spin is the first part of a wait, under the flow's lock: 1 if the ring
 * became ready (or this end stopped). */
static int spin(struct flow *f, int reader, int64_t *deadline)
{
	int64_t left = left_ns(f, reader, deadline), s = spin_ns < LOCKED_SPIN_NS ? spin_ns : LOCKED_SPIN_NS;
	if (left >= 0 && left < s)
		s = left;
	return shunt_ring_wait(reader ? &f->sf.r : &f->sf.w, reader, s, s) == 0;
}

/* sleep_ring is the rest, without the lock: 0, or EAGAIN, EINTR. */
static int sleep_ring(struct flow *f, int reader, int64_t *deadline)
{
	int64_t left = left_ns(f, reader, deadline);
	if (!left)
		return EAGAIN;
	int64_t rest = spin_ns > LOCKED_SPIN_NS ? spin_ns - LOCKED_SPIN_NS : 0;
	int r = shunt_ring_wait(reader ? &f->sf.r : &f->sf.w, reader, rest, left);
	return r == SHUNT_EINTR ? EINTR : r == SHUNT_EAGAIN ? EAGAIN : 0;
}

static ssize_t recv_ring(struct flow *f, void *buf, size_t n, int flags, int64_t *deadline)
{
	if (inherited(f))
		return -1;
	int nb = f->nonblock || (flags & MSG_DONTWAIT);
	size_t done = 0;
	int err = 0;
	for (;;) {
		ssize_t k;
		int spun = 0;
		pthread_mutex_lock(&f->rmu);
		for (;;) {
			k = (flags & MSG_PEEK) ? shunt_ring_peek(&f->sf.r, (uint8_t *)buf + done, n - done)
					       : shunt_ring_read(&f->sf.r, (uint8_t *)buf + done, n - done);
			if (k > 0) {
				done += k;
				if (!(flags & MSG_WAITALL) || done == n || (flags & MSG_PEEK))
					break;
				spun = 0;
				continue;
			}
			if (k != SHUNT_EAGAIN || n == 0 || nb || spun || ended(f, 1))
				break;
			spun = 1;
			if (!spin(f, 1, deadline))
				break;
		}
		pthread_mutex_unlock(&f->rmu);
		if (k > 0 || n == 0)
			break;
		if (k == 0 && !done && shunt_flow_reset(&f->sf)) {
			err = ECONNRESET;
			break;
		}
		if (k == 0)
			break; /* EOF */
		if (k != SHUNT_EAGAIN) {
			err = map_err(k);
			break;
		}
		if (__atomic_load_n(&f->closed, __ATOMIC_SEQ_CST)) {
			err = EBADF;
			break;
		}
		if (__atomic_load_n(&f->rd_shut, __ATOMIC_SEQ_CST))
			break; /* shut down for reading, and drained: EOF */
		if (nb) {
			err = EAGAIN;
			break;
		}
		if ((err = sleep_ring(f, 1, deadline)))
			break;
	}
	if (verbose > 1)
		plog("shunt: recv %zu flags %#x -> %zu (%s)", n, flags, done, err ? strerror(err) : "ok");
	if (err && !done) {
		errno = err;
		return -1;
	}
	return done;
}

static ssize_t send_ring(struct flow *f, const void *buf, size_t n, int flags, int64_t *deadline)
{
	if (inherited(f))
		return -1;
	int nb = f->nonblock || (flags & MSG_DONTWAIT);
	size_t done = 0;
	int err = 0;
	for (;;) {
		ssize_t k;
		int spun = 0;
		pthread_mutex_lock(&f->wmu);
		for (;;) {
			k = shunt_ring_write(&f->sf.w, (const uint8_t *)buf + done, n - done);
			if (k > 0) {
				done += k;
				if (done == n)
					break;
				spun = 0;
				continue;
			}
			if (k != SHUNT_EAGAIN || nb || spun || ended(f, 0))
				break;
			spun = 1;
			if (!spin(f, 0, deadline))
				break;
		}
		pthread_mutex_unlock(&f->wmu);
		if (k >= 0)
			break; /* all of it (or n == 0) */
		if (k != SHUNT_EAGAIN) {
			err = map_err(k);
			break;
		}
		if (__atomic_load_n(&f->closed, __ATOMIC_SEQ_CST)) {
			err = EBADF;
			break;
		}
		if (__atomic_load_n(&f->wr_shut, __ATOMIC_SEQ_CST)) {
			err = EPIPE;
			break;
		}
		if (nb) {
			err = EAGAIN;
			break;
		}
		if ((err = sleep_ring(f, 0, deadline)))
			break;
	}
	if (verbose > 1)
		plog("shunt: send %zu flags %#x -> %zu (%s)", n, flags, done, err ? strerror(err) : "ok");
	if (err && !done) {
		if (err == EPIPE && !(flags & MSG_NOSIGNAL))
			raise(SIGPIPE);
		errno = err;
		return -1;
	}
	return done;
}

ssize_t fast_recv(struct flow *f, void *buf, size_t n, int flags)
{
	int64_t deadline = 0;
	return recv_ring(f, buf, n, flags, &deadline);
}

ssize_t fast_send(struct flow *f, const void *buf, size_t n, int flags)
{
	int64_t deadline = 0;
	return send_ring(f, buf, n, flags, &deadline);
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
	return f ? done_with(f, fast_recv(f, buf, n, 0)) : real_read(fd, buf, n);
}

INTERPOSE ssize_t write(int fd, const void *buf, size_t n)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_send(f, buf, n, 0)) : real_write(fd, buf, n);
}

INTERPOSE ssize_t recv(int fd, void *buf, size_t n, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_recv(f, buf, n, flags)) : real_recv(fd, buf, n, flags);
}

INTERPOSE ssize_t send(int fd, const void *buf, size_t n, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_send(f, buf, n, flags)) : real_send(fd, buf, n, flags);
}

INTERPOSE ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *addr, socklen_t *len)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	if (!f)
		return real_recvfrom(fd, buf, n, flags, addr, len);
	if (addr && len)
		getpeername(fd, addr, len);
	return done_with(f, fast_recv(f, buf, n, flags));
}

INTERPOSE ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *addr, socklen_t len)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_send(f, buf, n, flags)) : real_sendto(fd, buf, n, flags, addr, len);
}

/* fast_readv and fast_writev take any number of iovecs, one at a time (no
 * local copy, so none is cut off); more than IOV_MAX fails with EINVAL,
 * as readv(2) and writev(2) do. */
static ssize_t fast_readv(struct flow *f, const struct iovec *iov, int cnt, int flags)
{
	if (cnt < 0 || cnt > IOV_MAX)
		return errno = EINVAL, -1;
	ssize_t total = 0;
	int64_t deadline = 0;
	for (int i = 0; i < cnt; i++) {
		if (!iov[i].iov_len)
			continue;
		/* Block only for the first byte, as readv does. */
		ssize_t k = recv_ring(f, iov[i].iov_base, iov[i].iov_len, total ? flags | MSG_DONTWAIT : flags, &deadline);
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
	if (cnt < 0 || cnt > IOV_MAX)
		return errno = EINVAL, -1;
	ssize_t total = 0;
	int64_t deadline = 0;
	for (int i = 0; i < cnt; i++) {
		ssize_t k = send_ring(f, iov[i].iov_base, iov[i].iov_len, flags, &deadline);
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
	return f ? done_with(f, fast_readv(f, iov, cnt, 0)) : real_readv(fd, iov, cnt);
}

INTERPOSE ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_writev(f, iov, cnt, 0)) : real_writev(fd, iov, cnt);
}

INTERPOSE ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	if (!f)
		return real_recvmsg(fd, msg, flags);
	msg->msg_controllen = 0;
	msg->msg_flags = 0;
	return done_with(f, fast_readv(f, msg->msg_iov, msg->msg_iovlen, flags));
}

INTERPOSE ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	REAL_READY();
	struct flow *f = flow_get(fd);
	return f ? done_with(f, fast_writev(f, msg->msg_iov, msg->msg_iovlen, flags)) : real_sendmsg(fd, msg, flags);
}

INTERPOSE ssize_t sendfile(int out, int in, off_t *off, size_t count)
{
	REAL_READY();
	struct flow *f = flow_get(out);
	if (!f)
		return real_sendfile(out, in, off, count);
	/* By copying: the bytes go through the ring. */
	char buf[SENDFILE_CHUNK];
	size_t n = count < sizeof buf ? count : sizeof buf;
	ssize_t k = off ? pread(in, buf, n, *off) : real_read(in, buf, n);
	if (k <= 0)
		return done_with(f, k);
	ssize_t w = fast_send(f, buf, k, 0);
	if (w > 0 && off)
		*off += w;
	else if (w > 0 && w < k)
		lseek(in, w - k, SEEK_CUR);
	return done_with(f, w);
}

/* shutdown ends this end's use of the rings; the kernel socket, the lease,
 * is left as it is. As with the kernel, it wakes this process's threads
 * blocked on the flow: a read returns what is buffered and then 0 after
 * SHUT_RD, a write fails with EPIPE after SHUT_WR. Inherited across fork,
 * the flow is the parent's: ENOTCONN. */
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
	if (inherited(f))
		return done_with(f, -1);
	if (how == SHUT_WR || how == SHUT_RDWR) {
		/* Stop first: a writer spinning under wmu lets go of it. */
		__atomic_store_n(&f->wr_shut, 1, __ATOMIC_SEQ_CST);
		shunt_ring_stop(&f->sf.w, 0);
		pthread_mutex_lock(&f->wmu);
		shunt_ring_close_write(&f->sf.w);
		pthread_mutex_unlock(&f->wmu);
	}
	if (how == SHUT_RD || how == SHUT_RDWR) {
		__atomic_store_n(&f->rd_shut, 1, __ATOMIC_SEQ_CST);
		shunt_ring_close_read(&f->sf.r);
		shunt_ring_stop(&f->sf.r, 1);
	}
	return done_with(f, 0);
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
		ssize_t k = fast_writev(f, v[i].msg_hdr.msg_iov, v[i].msg_hdr.msg_iovlen, flags);
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
		ssize_t k = fast_readv(f, v[i].msg_hdr.msg_iov, v[i].msg_hdr.msg_iovlen, fl);
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

static size_t ring_space(struct flow *f)
{
	uint64_t head = __atomic_load_n((uint64_t *)(f->sf.w.hdr + SHUNT_OFF_HEAD), __ATOMIC_SEQ_CST);
	uint64_t used = f->sf.w.own - head;
	return used < f->sf.w.cap ? f->sf.w.cap - used : 0;
}

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
		ssize_t k = fast_recv(fi, buf, n, MSG_PEEK | (nb ? MSG_DONTWAIT : 0));
		if (k <= 0)
			return done_with(fi, k);
		r = off_out ? pwrite(out, buf, k, *off_out) : real_write(out, buf, k);
		if (r > 0) {
			fast_recv(fi, buf, r, 0); /* consume what went out */
			if (off_out)
				*off_out += r;
		}
		return done_with(fi, r);
	}
	/* pipe -> ring */
	if (nb || fo->nonblock) {
		size_t space = ring_space(fo);
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
	r = fast_send(fo, buf, k, 0);
	if (r >= 0 && r < k)
		plog("shunt: splice: %zd of %zd bytes taken from fd %d could not go out (%s)", k - r, k, in, strerror(errno));
	return done_with(fo, r);
}
