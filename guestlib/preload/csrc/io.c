/* I/O on fast-path fds: the read and write families, send and recv with
 * their flags, sendfile and shutdown, all through the rings. Every other
 * fd goes to libc. */
#include "preload.h"

#include <errno.h>
#include <stdlib.h>

/* sendfile copies through a buffer of this size on the stack; a larger
 * count returns short, as sendfile(2) may. */
#define SENDFILE_CHUNK 65536

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

ssize_t fast_recv(struct flow *f, void *buf, size_t n, int flags)
{
	if (inherited(f))
		return -1;
	int nb = f->nonblock || (flags & MSG_DONTWAIT);
	size_t done = 0;
	pthread_mutex_lock(&f->rmu);
	for (;;) {
		ssize_t k = (flags & MSG_PEEK) ? shunt_ring_peek(&f->sf.r, (uint8_t *)buf + done, n - done)
					       : shunt_ring_read(&f->sf.r, (uint8_t *)buf + done, n - done);
		if (k > 0) {
			done += k;
			if (!(flags & MSG_WAITALL) || done == n || (flags & MSG_PEEK))
				break;
			continue;
		}
		if (k == 0 && n > 0 && !done && shunt_flow_reset(&f->sf)) {
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
		shunt_ring_wait(&f->sf.r, 1, spin_ns, -1);
	}
	pthread_mutex_unlock(&f->rmu);
	if (verbose > 1)
		plog("shunt: recv %zu flags %#x -> %zu", n, flags, done);
	return done;
}

ssize_t fast_send(struct flow *f, const void *buf, size_t n, int flags)
{
	if (inherited(f))
		return -1;
	int nb = f->nonblock || (flags & MSG_DONTWAIT);
	size_t done = 0;
	pthread_mutex_lock(&f->wmu);
	while (done < n || n == 0) {
		ssize_t k = shunt_ring_write(&f->sf.w, (const uint8_t *)buf + done, n - done);
		if (k >= 0) {
			done += k;
			if (n == 0)
				break;
			continue;
		}
		if (k == SHUNT_EAGAIN && !nb) {
			shunt_ring_wait(&f->sf.w, 0, spin_ns, -1);
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
		plog("shunt: send %zu flags %#x -> %zu", n, flags, done);
	return done;
}

INTERPOSE ssize_t read(int fd, void *buf, size_t n)
{
	struct flow *f = flow_of(fd);
	return f ? fast_recv(f, buf, n, 0) : real_read(fd, buf, n);
}

INTERPOSE ssize_t write(int fd, const void *buf, size_t n)
{
	struct flow *f = flow_of(fd);
	return f ? fast_send(f, buf, n, 0) : real_write(fd, buf, n);
}

INTERPOSE ssize_t recv(int fd, void *buf, size_t n, int flags)
{
	struct flow *f = flow_of(fd);
	return f ? fast_recv(f, buf, n, flags) : real_recv(fd, buf, n, flags);
}

INTERPOSE ssize_t send(int fd, const void *buf, size_t n, int flags)
{
	struct flow *f = flow_of(fd);
	return f ? fast_send(f, buf, n, flags) : real_send(fd, buf, n, flags);
}

INTERPOSE ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *addr, socklen_t *len)
{
	struct flow *f = flow_of(fd);
	if (!f)
		return real_recvfrom(fd, buf, n, flags, addr, len);
	if (addr && len)
		getpeername(fd, addr, len);
	return fast_recv(f, buf, n, flags);
}

INTERPOSE ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *addr, socklen_t len)
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

INTERPOSE ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
	struct flow *f = flow_of(fd);
	return f ? fast_readv(f, iov, cnt, 0) : real_readv(fd, iov, cnt);
}

INTERPOSE ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
	struct flow *f = flow_of(fd);
	return f ? fast_writev(f, iov, cnt, 0) : real_writev(fd, iov, cnt);
}

INTERPOSE ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
	struct flow *f = flow_of(fd);
	if (!f)
		return real_recvmsg(fd, msg, flags);
	msg->msg_controllen = 0;
	msg->msg_flags = 0;
	return fast_readv(f, msg->msg_iov, msg->msg_iovlen, flags);
}

INTERPOSE ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	struct flow *f = flow_of(fd);
	return f ? fast_writev(f, msg->msg_iov, msg->msg_iovlen, flags) : real_sendmsg(fd, msg, flags);
}

INTERPOSE ssize_t sendfile(int out, int in, off_t *off, size_t count)
{
	struct flow *f = flow_of(out);
	if (!f)
		return real_sendfile(out, in, off, count);
	/* By copying: the bytes go through the ring. */
	char buf[SENDFILE_CHUNK];
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

INTERPOSE int shutdown(int fd, int how)
{
	struct flow *f = flow_of(fd);
	if (!f)
		return real_shutdown(fd, how);
	/* The kernel socket is the lease and stays as it is. */
	if (how == SHUT_WR || how == SHUT_RDWR) {
		pthread_mutex_lock(&f->wmu);
		shunt_ring_close_write(&f->sf.w);
		pthread_mutex_unlock(&f->wmu);
	}
	if (how == SHUT_RD || how == SHUT_RDWR)
		shunt_ring_close_read(&f->sf.r);
	return 0;
}
