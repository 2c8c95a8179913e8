/* RESUME (relayed flows; docs/protocol.md, "RESUME"; Go: guestlib/resume.go):
 * hostd's DOWN for a flow whose rings the local relay shares, with the
 * stream offset from which this end's writer resends on TCP. The relay
 * frees a byte of the write ring only once the other host's ring holds
 * it, so the bytes from that offset to the end of the ring's stretch are
 * still in the ring: the writer copies them out as it leaves (writer_leave,
 * wmu held, before LEFT lets hostd free the ring) into f->resend, and they
 * go out on TCP before any new byte: in the program's next send, or from
 * the leaver thread when it sends nothing (resend_idle). Both send them
 * non-blocking under wmu, so no other byte can come between; a blocking
 * send waits for the socket to take more (resend_wait), without wmu.
 * ResumeReset, or an offset the ring does not hold, resets the connection:
 * reads and writes fail with ECONNRESET, and the kernel socket is
 * disconnected (connect to AF_UNSPEC: a RST to the peer; the fd stays the
 * program's until it closes it). Locks: resume takes tab_mu alone (to
 * find an fd of the flow), the leaver tab_mu then a flow's wmu: the
 * documented order. */
#include "preload.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* reset resets f's connection: the kernel socket first (connect to
 * AF_UNSPEC on rg->resume_fd, a dup resume made), then the flag the
 * program's calls see: a program that sees the error and closes must not
 * get a FIN out before the RST. */
static void reset(struct flow *f, struct rings *rg)
{
	struct sockaddr sa = {.sa_family = AF_UNSPEC};
	int fd = __atomic_load_n(&rg->resume_fd, __ATOMIC_SEQ_CST);
	if (fd >= 0 && sys_connect(fd, &sa, sizeof sa) < 0)
		plog("shunt: fd %d: cannot reset the kernel connection: %s", f->fd, strerror(errno));
	__atomic_store_n(&f->rst, 1, __ATOMIC_SEQ_CST);
	shunt_ring_stop(&rg->sf.r, 1); /* a reader asleep on the ring fails now */
	shunt_ring_stop(&rg->sf.w, 0);
	flow_wake(f);
}

/* resume_writer: f's writer leaves rg's ring after RESUME (wmu held);
 * started says whether it had started it (at f->wstart; the stretch ends
 * at f->sent). */
void resume_writer(struct flow *f, struct rings *rg, int started)
{
	uint64_t off = __atomic_load_n(&rg->resume_at, __ATOMIC_SEQ_CST);
	if (off == SHUNT_RESUME_RESET) {
		reset(f, rg);
		return;
	}
	if (!started)
		return; /* nothing of the stream went into the ring */
	uint64_t start = f->wstart, end = f->sent;
	if (off == SHUNT_RESUME_ALL)
		off = start;
	ssize_t k = SHUNT_EINVAL;
	size_t n = off >= start && off <= end ? end - off : 0;
	if (off >= start && off <= end && n <= rg->sf.w.cap) {
		k = 0;
		if (n > f->rs_cap) {
			uint8_t *b = realloc(f->resend, n);
			if (!b)
				k = -ENOMEM;
			else
				f->resend = b, f->rs_cap = n;
		}
		if (!k && n)
			k = shunt_ring_unfreed(&rg->sf.w, f->wtail0 + (off - start), f->resend, n);
	}
	if (k < 0) {
		plog("shunt: fd %d: RESUME (slot %u) at offset %llu: the ring's stretch is [%llu, %llu), %llu bytes freed (%s): "
		     "connection reset",
		     f->fd, rg->sf.slot, (unsigned long long)off, (unsigned long long)start, (unsigned long long)end,
		     (unsigned long long)(rg->sf.w.peer - f->wtail0),
		     k == -ENOMEM ? "no memory" : k == SHUNT_ECORRUPT ? "corrupt head" : "not held");
		reset(f, rg);
		return;
	}
	f->rs_head = 0;
	f->rs_len = (size_t)k;
	f->resent += k;
	if (k)
		__atomic_store_n(&f->resending, 1, __ATOMIC_SEQ_CST);
	if (verbose > 1)
		plog("shunt: fd %d: RESUME at %llu: %zd ring bytes to resend", f->fd, (unsigned long long)off, k);
}

/* resend_step sends what the kernel takes now of f's resend, on fd (wmu
 * held): 0 once all went, -EAGAIN if some is left, or -errno (the stream
 * is broken: the rest is dropped). */
ssize_t resend_step(struct flow *f, int fd)
{
	while (f->rs_len) {
		ssize_t k = real_send(fd, f->resend + f->rs_head, f->rs_len, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return -EAGAIN;
		if (k <= 0) {
			int e = k < 0 ? errno : EPIPE;
			f->rs_len = 0;
			__atomic_store_n(&f->resending, 0, __ATOMIC_SEQ_CST);
			return -e;
		}
		f->rs_head += k;
		f->rs_len -= k;
		f->wbytes[0] += k;
	}
	__atomic_store_n(&f->resending, 0, __ATOMIC_SEQ_CST);
	return 0;
}

/* resend_wait sleeps until fd takes more, f's event word is woken (close,
 * shutdown, a reset) or the deadline: 0, EAGAIN or EINTR. */
int resend_wait(struct flow *f, int fd, int64_t left)
{
	if (!left)
		return EAGAIN;
	struct arm a;
	arm_init(&a);
	arm_flow(&a, f);
	arm_set(&a, 1);
	int err = 0;
	if (!__atomic_load_n(&f->closed, __ATOMIC_SEQ_CST) && !__atomic_load_n(&f->rst, __ATOMIC_SEQ_CST))
		err = conn_sleep(fd, POLLOUT, &a, left);
	arm_set(&a, 0);
	arm_free(&a);
	return err;
}

/* resend_close sends what waits of f's resend before fd's kernel close
 * (the program's last close of the connection): at most SO_SNDTIMEO or
 * RESEND_CLOSE_NS, whichever is shorter, since a close must not hang on a
 * peer that reads nothing; what is left then is dropped, and said. */
#define RESEND_CLOSE_NS 5000000000LL
void resend_close(struct flow *f, int fd)
{
	int64_t t = __atomic_load_n(&f->sndtimeo, __ATOMIC_RELAXED);
	int64_t end = now_ns() + (t > 0 && t < RESEND_CLOSE_NS ? t : RESEND_CLOSE_NS);
	for (;;) {
		pthread_mutex_lock(&f->wmu);
		ssize_t k = f->rs_len ? resend_step(f, fd) : 0;
		size_t rest = f->rs_len;
		pthread_mutex_unlock(&f->wmu);
		int64_t left = end - now_ns();
		if (k != -EAGAIN)
			return;
		if (left <= 0) {
			plog("shunt: fd %d: closed with %zu bytes of a RESUME's resend the kernel did not take: dropped", fd, rest);
			return;
		}
		sys_poll1(fd, POLLOUT, (int)(left / 1000000) + 1);
	}
}

/* socket_dup returns a dup of f's kernel socket (close-on-exec), or -1:
 * found among its fds under tab_mu, so it is f's, and usable without the
 * lock (the program may close its fds meanwhile). */
static int socket_dup(struct flow *f)
{
	pthread_mutex_lock(&tab_mu);
	int fd = f->fd >= 0 && f->fd < FD_MAX && fds[f->fd] == f ? f->fd : -1;
	for (int i = 0; i < FD_MAX && fd < 0; i++)
		if (fds[i] == f)
			fd = i;
	int d = fd >= 0 ? (int)shunt_sys(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 0, 0, 0, 0) : -1;
	pthread_mutex_unlock(&tab_mu);
	return d < 0 ? -1 : d;
}

void resume(struct flow *f, const struct shunt_msg *m)
{
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (!rg || m->slot != rg->sf.slot || m->gen != rg->sf.gen || m->region_id != rg->sf.region_id)
		return; /* an older pair's, already left */
	__atomic_store_n(&rg->resume_fd, socket_dup(f), __ATOMIC_SEQ_CST);
	if (!__atomic_load_n(&rg->down, __ATOMIC_SEQ_CST)) {
		__atomic_store_n(&rg->resume_at, m->offset, __ATOMIC_SEQ_CST);
		__atomic_store_n(&rg->resumed, 1, __ATOMIC_SEQ_CST); /* before down: the writer reads it when it leaves */
	}
	/* A vsock stretch's (docs/vsock.md, "Switching back"): its bridge
	 * stops, marking the read ring left where the bytes it wrote end, and
	 * hostd hears that offset (ENDED), from which the other end's writer
	 * resends; the reader here drains the ring to that mark. wmu keeps
	 * the stretch attached meanwhile (Go: Conn.stretchEnded). */
	if (shunt_flow_stretch(&rg->sf)) {
		shunt_ring_stop(&rg->sf.w, 0); /* a writer spinning on a full ring (which no bridge empties now) lets go of wmu */
		pthread_mutex_lock(&f->wmu);
		if (__atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) == rg)
			shunt_flow_stretch_end(&rg->sf, m->reason);
		pthread_mutex_unlock(&f->wmu);
	}
	if (m->offset == SHUNT_RESUME_RESET) {
		plog("shunt: fd %d: RESUME (slot %u, %s): where the other host's ring ended is unknown: connection reset", f->fd,
		     m->slot, shunt_reason_name(m->reason));
		reset(f, rg);
	}
	struct shunt_msg d = *m;
	d.type = SHUNT_DOWN;
	conn_down(f, &d); /* the writer leaves here (wmu): f->rst or f->resend are set after it */
	int fd = __atomic_exchange_n(&rg->resume_fd, -1, __ATOMIC_SEQ_CST);
	if (fd >= 0)
		sys_close(fd);
	if (__atomic_load_n(&f->resending, __ATOMIC_SEQ_CST))
		leaver_kick(); /* it sends them if the program does not */
}

/* resume_down: a DOWN for a relayed ring pair that had no RESUME. A
 * relayed pair leaves by RESUME, which says where the other host's ring
 * ended; a DOWN means nobody knows (a restarted hostd that did not adopt
 * the pair), and going on over TCP from this ring's end could skip or
 * repeat bytes: the connection is reset instead (Go: Conn.down). Not a
 * vsock stretch's (two vsock VMs' pairs are relayed too): hostd sends
 * one DOWN(peer-gone) only once the rooms' bridges carried the gone
 * end's last bytes into this VM's ring (docs/vsock.md, "VM to VM"). It
 * reports whether it took the DOWN. */
int resume_down(struct flow *f, const struct shunt_msg *m)
{
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (!rg || !rg->relayed || shunt_flow_stretch(&rg->sf) || __atomic_load_n(&rg->resumed, __ATOMIC_SEQ_CST) || __atomic_load_n(&rg->down, __ATOMIC_SEQ_CST) ||
	    m->slot != rg->sf.slot || m->gen != rg->sf.gen || m->region_id != rg->sf.region_id)
		return 0;
	struct shunt_msg r = *m;
	r.type = SHUNT_RESUME;
	r.offset = SHUNT_RESUME_RESET;
	resume(f, &r);
	return 1;
}

/* resend_idle sends the resends of connections whose program does not
 * send (the leaver thread, tab_mu then wmu): how many still wait. */
int resend_idle(void)
{
	int waiting = 0;
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = fds[fd];
		if (!f || f->owner != my_pid || !__atomic_load_n(&f->resending, __ATOMIC_SEQ_CST))
			continue;
		if (pthread_mutex_trylock(&f->wmu)) { /* a send under way sends them itself */
			waiting++;
			continue;
		}
		if (resend_step(f, fd) == -EAGAIN)
			waiting++;
		pthread_mutex_unlock(&f->wmu);
	}
	pthread_mutex_unlock(&tab_mu);
	return waiting;
}
