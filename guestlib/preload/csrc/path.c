/* The reader and the writer of a connection (docs/DESIGN.md, path
 * switching): each direction's bytes go over TCP or through a ring, and
 * move between them at exact stream offsets.
 *
 * Writer, under wmu: on TCP with a ring whose reader attached (and no
 * DOWN), it marks the ring's start at its stream offset (sent) and writes
 * the ring from then on; after DOWN, or when its ring says left or the
 * reader left, it marks the ring left and goes back to TCP. Kernel sends
 * run without wmu (winflight counts them, and no ring starts meanwhile),
 * so a blocked send holds nothing that shutdown, close or a non-blocking
 * call needs, and the kernel keeps its own semantics (signals, timeouts,
 * SIGPIPE).
 *
 * Reader, under rmu: on TCP it reads at most up to a started ring's start,
 * then the ring until its writer's mark (SHUNT_ELEFT), then TCP again.
 * TCP bytes read past a start that came between its check and its read
 * (the writer started, left and wrote TCP again) wait in the stash for the
 * ring's end; so does a kernel EOF or error seen then. A reader with no
 * ring blocks in the kernel's recv itself (READY then waits for it to come
 * back before the ring is marked attached, conn.c); one with a ring that
 * has not started sleeps on the kernel socket and the ring at once
 * (wait.c's helper), so the writer's start wakes it.
 *
 * A ring whose writer left (or died) while TCP bytes before its start are
 * still due is copied aside and left at once (aside.c, reader_ahead: a
 * firewall's drops can hold those bytes back for long, and the ring's
 * memory may not outlive hostd's grace): until the TCP stream reaches that
 * start, every kernel read stops there (ahead_lim; the blocking recv is
 * not used), and an EOF before it is a broken stream (ECONNRESET). */
#include "preload.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A ring wait spins at most this long with the flow's lock held (see
 * spin); a longer SHUNT_SPIN_NS spins the rest without it. */
#define LOCKED_SPIN_NS 50000

enum { W_NONE, W_KERNEL, W_BOTH, W_RING, W_RESEND };

static int inherited(struct flow *f)
{
	if (f->owner == my_pid)
		return 0;
	errno = ENOTCONN;
	return 1;
}

/* left_ns is the time left before the call's deadline: -1 without one.
 * deadline is 0 until the call first waits, then its end (-1: none). */
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

static int ended(struct flow *f, int reader)
{
	return __atomic_load_n(&f->closed, __ATOMIC_SEQ_CST) ||
	       __atomic_load_n(reader ? &f->rd_shut : &f->wr_shut, __ATOMIC_SEQ_CST);
}

/* ---- waits ---- */

/* ring_spin is the first part of a ring wait, under the flow's lock: 1 if
 * the ring became ready (or this end stopped). */
static int ring_spin(struct flow *f, struct shunt_ring *r, int reader, int64_t *deadline)
{
	int64_t left = left_ns(f, reader, deadline), s = spin_ns < LOCKED_SPIN_NS ? spin_ns : LOCKED_SPIN_NS;
	if (left >= 0 && left < s)
		s = left;
	return shunt_ring_wait(r, reader, s, s) == 0;
}

/* ring_sleep is the rest, without the lock: 0, or EAGAIN, EINTR. The ring
 * pair stays mapped meanwhile: the caller holds a reference to the flow,
 * and a pair is let go only under both locks (rings_done) or at the last
 * reference. */
static int ring_sleep(struct flow *f, struct shunt_ring *r, int reader, int64_t *deadline)
{
	int64_t left = left_ns(f, reader, deadline);
	if (!left)
		return EAGAIN;
	int64_t rest = spin_ns > LOCKED_SPIN_NS ? spin_ns - LOCKED_SPIN_NS : 0;
	int e = shunt_ring_wait(r, reader, rest, left);
	return e == SHUNT_EINTR ? EINTR : e == SHUNT_EAGAIN ? EAGAIN : 0;
}

/* changed: whether a reader asleep on the kernel socket must look again:
 * closed or shut down, other rings (READY, or the pair given back), a
 * reset, and, when it watches rg's start (watch), the start, the
 * writer's leave or its death. */
static int changed(struct flow *f, struct rings *rg, int watch)
{
	if (ended(f, 1) || __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) != rg)
		return 1;
	if (!rg)
		return 0;
	if (__atomic_load_n((uint32_t *)(rg->sf.r.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST))
		return 1;
	uint64_t start;
	return watch && (shunt_ring_started(&rg->sf.r, &start) || shunt_ring_writer_left(&rg->sf.r) ||
			 __atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST));
}

/* kernel_wait sleeps until fd is readable, f->ev is woken, rg's reader
 * ring starts or its writer leaves (watch: the reader has not reached a
 * start yet), or the deadline: 0, EAGAIN or EINTR (sleep.c: as the kernel
 * decides for a blocking recv). */
static int kernel_wait(struct flow *f, int fd, struct rings *rg, int watch, int64_t *deadline)
{
	int64_t left = left_ns(f, 1, deadline);
	if (!left)
		return EAGAIN;
	struct arm a;
	arm_init(&a);
	arm_flow(&a, f);
	if (rg)
		arm_word(&a, shunt_ring_wait_word(&rg->sf.r, 1)); /* also woken by a reset */
	arm_set(&a, 1);
	int err = 0;
	if (!changed(f, rg, watch))
		err = conn_sleep(fd, POLLIN, &a, left);
	arm_set(&a, 0);
	arm_free(&a);
	if (err)
		return err;
	return left_ns(f, 1, deadline) == 0 ? EAGAIN : 0;
}

/* ---- the reader ---- */

/* tcp_take reads the TCP side of the stream without blocking: the stash
 * first, then a remembered EOF or error, then the kernel. *kernel says
 * whether the bytes came from the kernel. Bytes, 0 at EOF, or -errno. */
static ssize_t tcp_take(struct flow *f, int fd, uint8_t *buf, size_t n, int flags, int *kernel)
{
	*kernel = 0;
	if (f->slen) {
		size_t k = n < f->slen ? n : f->slen;
		memcpy(buf, f->stash + f->shead, k);
		if (!(flags & MSG_PEEK)) {
			f->shead += k;
			f->slen -= k;
			if (!f->slen)
				f->shead = 0;
		}
		return k;
	}
	if (f->seof) {
		int e = f->seof;
		if (e < 0 && !(flags & MSG_PEEK))
			f->seof = 1; /* an error is reported once, then EOF */
		return e > 0 ? 0 : e;
	}
	*kernel = 1;
	size_t lim = ahead_lim(f);
	ssize_t k = real_recv(fd, buf, n < lim ? n : lim, (flags & (MSG_PEEK | MSG_OOB)) | MSG_DONTWAIT);
	if (k == 0 && n && f->alen) {
		plog("shunt: fd %d: the TCP stream ended at %llu, before the ring's stretch held ahead at %llu: reset", fd,
		     (unsigned long long)f->roff, (unsigned long long)f->ahead_at);
		return -ECONNRESET;
	}
	return k < 0 ? -errno : k;
}

/* took_tcp counts k bytes read from the TCP side (rmu held, not a peek):
 * those of the stash's first sring bytes came from a ring. */
static void took_tcp(struct flow *f, size_t k, int kernel)
{
	size_t ring = 0;
	if (!kernel) {
		ring = k < f->sring ? k : f->sring;
		f->sring -= ring;
	}
	f->roff += k;
	f->rbytes[0] += k - ring;
	f->rbytes[1] += ring;
}

/* stash keeps n bytes read past a ring's start for after its stretch.
 * The stash is empty here: bytes come from the kernel only when it is. */
static int stash(struct flow *f, const uint8_t *p, size_t n)
{
	if (n > f->scap) {
		uint8_t *s = realloc(f->stash, n);
		if (!s)
			return -1;
		f->stash = s;
		f->scap = n;
	}
	memcpy(f->stash, p, n);
	f->shead = 0;
	f->slen = n;
	f->stashed++;
	return 0;
}

/* to_ring moves the reader to rg's ring (rmu held). The kernel's FIN or
 * RST already there while the ring's writer has not left means the
 * writer died (a live one leaves first): the reader then drains the ring
 * without waiting for its mark (guard.c sees the ones that come later).
 * Not on a relayed ring: the relay writes it, and the other guest's FIN
 * outruns its ring bytes; the relay marks the ring left in any case. */
static void to_ring(struct flow *f, int fd, struct rings *rg)
{
	f->rring = 1;
	f->rswitch++;
	if (shunt_ring_writer_left(&rg->sf.r) || rg->bridged)
		return;
	int e = errno;
	ssize_t k = kernel_peek(f, fd);
	if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
		__atomic_store_n(&rg->peer_gone, 1, __ATOMIC_SEQ_CST);
	errno = e;
}

ssize_t kernel_peek(struct flow *f, int fd)
{
	char c;
	ssize_t k = real_recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
	if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && !f->seof)
		__atomic_store_n(&f->seof, -errno, __ATOMIC_RELAXED); /* after the ring's stretch, as read_step's */
	return k;
}

/* RELAY_HOLD_NS bounds how long a relayed ring's reader holds a kernel
 * EOF or error (Go: relayedEOFWait): the relays end every stretch by
 * marking the ring left, within their resume timeout (60 s). */
#define RELAY_HOLD_NS 65000000000LL

/* relay_holds: the kernel reported the peer's FIN or RST while rg's read
 * ring, which the relay writes, has neither started nor been left (rmu
 * held). The other guest wrote its last bytes into its ring before it
 * closed, but they cross the relays, slower than the kernel's FIN: so
 * the reader holds the EOF (f->seof, after the ring's stretch if it
 * starts) and waits on the ring, for at most RELAY_HOLD_NS. */
static int relay_holds(struct flow *f, struct rings *rg)
{
	uint64_t start;
	if (!rg->bridged || shunt_ring_started(&rg->sf.r, &start) || shunt_ring_writer_left(&rg->sf.r) ||
	    __atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST))
		return 0;
	int64_t now = now_ns();
	if (!f->rhold)
		__atomic_store_n(&f->rhold, now + RELAY_HOLD_NS, __ATOMIC_RELAXED);
	return now < f->rhold;
}

/* relay_eof: a blocking kernel recv came back with the peer's EOF or an
 * error (k) while READY gave the connection a relayed ring meanwhile,
 * which the reader has now marked attached: the other guest's bytes may
 * already be on their way into it (its relay attached to its writer's
 * ring at once), so the EOF is held for the ring as in read_step (rmu
 * held). 1 if held. */
static int relay_eof(struct flow *f, ssize_t k, int peek)
{
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (k > 0 || k == -EAGAIN || k == -EWOULDBLOCK || k == -EINTR || !rg || rg->rleft || !relay_holds(f, rg))
		return 0;
	if (!peek)
		f->seof = k ? (int)k : 1;
	return 1;
}

/* waitall_short: the kernel's MSG_WAITALL recv came back short (the
 * peer's FIN, or a signal or time-out) with bytes, while READY gave the
 * connection a ring meanwhile: the stream's rest may come on the ring
 * (a relayed one's after the kernel's FIN), so the call goes on with
 * read_step instead of returning short (rmu held). */
static int waitall_short(struct flow *f, int all, ssize_t k, size_t got, size_t n)
{
	return all && k > 0 && got < n && __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
}

/* read_step moves what it can without blocking (rmu held): bytes, 0 at
 * EOF, or -errno; at -EAGAIN, *wait says what to wait for. *done is a
 * ring pair to give back (rings_done) once rmu is let go. */
static ssize_t read_step(struct flow *f, int fd, uint8_t *buf, size_t n, int flags, int *wait, struct rings **done)
{
	int peek = (flags & MSG_PEEK) != 0;
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	*wait = W_NONE;
	if (__atomic_load_n(&f->rst, __ATOMIC_SEQ_CST))
		return -ECONNRESET; /* RESUME reset the connection (resume.c) */
	for (;;) {
		if (f->rring && rg) {
			struct shunt_ring *r = &rg->sf.r;
			ssize_t k = peek ? shunt_ring_peek(r, buf, n) : shunt_ring_read(r, buf, n);
			if (k > 0) {
				if (!peek) {
					f->roff += k;
					f->rbytes[1] += k;
				}
				return k;
			}
			if (k == SHUNT_EAGAIN && __atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST))
				k = SHUNT_ELEFT; /* the writer is gone: what the ring held is all */
			if (k == SHUNT_EAGAIN && __atomic_load_n(&f->rd_shut, __ATOMIC_SEQ_CST))
				return 0;
			if (k == SHUNT_EAGAIN) {
				*wait = W_RING;
				return -EAGAIN;
			}
			if (k != SHUNT_ELEFT && k != 0) /* reset or corrupt: the stream is broken */
				return -ECONNRESET;
			*done = reader_leave(f, rg); /* left (or an old-style FIN): TCP again */
			continue;
		}
		f->rring = 0;
		if (ahead_due(f)) {
			plog("shunt: fd %d: out of memory for the ring's stretch held ahead: reset", fd);
			return -ECONNRESET;
		}
		uint64_t start;
		int att = rg && !rg->rleft, kernel;
		if (att && __atomic_load_n((uint32_t *)(rg->sf.r.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST))
			return -ECONNRESET; /* the safety net reset the connection (guard.c) */
		if (att && shunt_ring_writer_left(&rg->sf.r) && !shunt_ring_started(&rg->sf.r, &start)) {
			/* The writer left without a stretch (the mark is read
			 * first: a start always comes before it). */
			*done = reader_leave(f, rg);
			att = 0;
		}
		if (att && shunt_ring_started(&rg->sf.r, &start)) {
			if (start < f->roff || (f->alen && start < f->ahead_at + f->alen)) {
				plog("shunt: fd %d: the peer started a ring at %llu, behind %llu already read: reset", fd,
				     (unsigned long long)start, (unsigned long long)(f->alen ? f->ahead_at + f->alen : f->roff));
				return -ECONNRESET;
			}
			if (f->roff == start) {
				to_ring(f, fd, rg);
				continue;
			}
			/* The mark is read after the start: the stretch is whole. */
			if ((shunt_ring_writer_left(&rg->sf.r) || __atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST)) &&
			    !reader_ahead(f, rg, start, done))
				continue; /* left, the stretch held ahead: TCP up to it */
			size_t lim = start - f->roff;
			ssize_t k = tcp_take(f, fd, buf, n < lim ? n : lim, flags, &kernel);
			if (k == -EAGAIN)
				*wait = W_KERNEL;
			if (k > 0 && !peek)
				took_tcp(f, k, kernel);
			return k;
		}
		if (att && test_stash_delay_ns && !f->slen) { /* widen the window a stash is for (tests) */
			struct timespec ts = {0, test_stash_delay_ns % 1000000000};
			nanosleep(&ts, NULL);
		}
		ssize_t k = tcp_take(f, fd, buf, n, flags, &kernel);
		if (k == -EAGAIN) {
			*wait = att ? W_BOTH : W_KERNEL;
			return k;
		}
		if (att && k <= 0 && relay_holds(f, rg)) {
			if (kernel && !peek)
				f->seof = k ? (int)k : 1; /* after the ring's stretch, if it starts */
			*wait = W_RING;
			return -EAGAIN;
		}
		if (att && kernel && shunt_ring_started(&rg->sf.r, &start)) {
			/* The writer moved to the ring meanwhile. */
			if (k <= 0) { /* EOF or error after the ring's stretch */
				if (!peek)
					f->seof = k ? (int)k : 1;
				if (!shunt_ring_writer_left(&rg->sf.r) && !rg->bridged) /* a live writer leaves first: it died (guard.c) */
					__atomic_store_n(&rg->peer_gone, 1, __ATOMIC_SEQ_CST);
				if (f->roff == start)
					to_ring(f, fd, rg);
				if (!peek || f->rring)
					continue;
				return k;
			}
			if (f->roff + k > start) {
				size_t keep = start - f->roff;
				if (!peek && stash(f, buf + keep, k - keep)) {
					plog("shunt: fd %d: out of memory for %zd bytes past a ring's start: reset", fd, k - (ssize_t)keep);
					return -ECONNRESET;
				}
				k = keep;
				if (!k) {
					to_ring(f, fd, rg);
					continue;
				}
			}
		}
		if (k > 0 && !peek)
			took_tcp(f, k, kernel);
		return k;
	}
}

/* kernel_recv blocks in the kernel's recv (the connection holds no
 * ring): the kernel's own semantics for signals, timeouts, MSG_WAITALL. A
 * READY meanwhile is marked attached only once it is back (conn.c). */
static ssize_t kernel_recv(struct flow *f, int fd, uint8_t *buf, size_t n, int flags)
{
	f->rblocked++; /* rmu held */
	pthread_mutex_unlock(&f->rmu);
	ssize_t k = real_recv(fd, buf, n, flags);
	int e = errno;
	pthread_mutex_lock(&f->rmu);
	if (k > 0 && !(flags & MSG_PEEK)) {
		f->roff += k;
		f->rbytes[0] += k;
	}
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (--f->rblocked == 0 && f->attach_due && rg) {
		f->attach_due = 0;
		shunt_ring_attach_reader(&rg->sf.r);
	}
	errno = e;
	return k < 0 ? -e : k;
}

ssize_t conn_recv(struct flow *f, int fd, void *buf, size_t n, int flags, int64_t *deadline)
{
	if (inherited(f))
		return -1;
	if (__atomic_load_n(&f->rst, __ATOMIC_SEQ_CST)) {
		errno = ECONNRESET; /* RESUME reset the connection (resume.c) */
		return -1;
	}
	share_io(f);
	int nb = f->nonblock || (flags & MSG_DONTWAIT), peek = (flags & MSG_PEEK) != 0;
	int all = (flags & MSG_WAITALL) && !peek && !nb;
	size_t got = 0;
	int err = 0;
	for (;;) {
		int wait = W_NONE, spun = 0, final = 0;
		struct rings *done = NULL, *rg;
		ssize_t k;
		pthread_mutex_lock(&f->rmu);
		for (;;) {
			rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
			if (!rg && !f->rring && !f->slen && !f->seof && !f->alen && !nb && !got && n && !ended(f, 1)) {
				/* No ring and nothing kept aside: the kernel's own
				 * blocking recv at once, one system call as without
				 * the library (not a non-blocking try first). With a
				 * stretch held ahead, the kernel's recv could read
				 * past its start: read_step's, which stops there. */
				k = kernel_recv(f, fd, buf, n, flags);
				if (k > 0)
					got += k;
				if (relay_eof(f, k, peek)) {
					k = -EAGAIN, wait = W_RING, rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
					break;
				}
				if (waitall_short(f, all, k, got, n))
					continue;
				final = 1;
				break;
			}
			k = read_step(f, fd, (uint8_t *)buf + got, n - got, flags, &wait, &done);
			rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
			if (k > 0) {
				got += k;
				if (all && got < n) {
					spun = 0;
					continue;
				}
				break;
			}
			if (k != -EAGAIN || n == 0 || nb || (got && !all) || ended(f, 1))
				break;
			if (wait == W_KERNEL && !rg && !f->slen && !f->seof && !f->alen) {
				/* No ring: the kernel's own blocking recv. */
				k = kernel_recv(f, fd, (uint8_t *)buf + got, n - got, flags);
				if (k > 0)
					got += k;
				if (relay_eof(f, k, peek)) {
					k = -EAGAIN, wait = W_RING, rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
					break;
				}
				if (waitall_short(f, all, k, got, n))
					continue;
				final = 1;
				break;
			}
			if (wait != W_RING || spun)
				break;
			spun = 1;
			if (!ring_spin(f, &rg->sf.r, 1, deadline))
				break;
		}
		pthread_mutex_unlock(&f->rmu);
		rings_done(f, done);
		if (final) {
			err = k < 0 ? (int)-k : 0;
			break;
		}
		if (k >= 0 && (k == 0 || !all || got == n))
			break; /* bytes, or EOF */
		if (k < 0 && k != -EAGAIN) {
			err = -k;
			break;
		}
		if (k > 0)
			continue; /* MSG_WAITALL */
		if (__atomic_load_n(&f->closed, __ATOMIC_SEQ_CST)) {
			err = EBADF;
			break;
		}
		if (__atomic_load_n(&f->rd_shut, __ATOMIC_SEQ_CST))
			break; /* shut down for reading, and drained: EOF */
		if (nb || (got && !all)) {
			err = EAGAIN;
			break;
		}
		if (wait == W_RING && rg)
			err = ring_sleep(f, &rg->sf.r, 1, deadline);
		else
			err = kernel_wait(f, fd, rg, wait == W_BOTH, deadline);
		if (err)
			break;
	}
	if (verbose > 1)
		plog("shunt: recv %zu flags %#x -> %zu (%s)", n, flags, got, err ? strerror(err) : "ok");
	if (err && !got) {
		errno = err;
		return -1;
	}
	return got;
}

/* ---- the writer ---- */

/* write_step writes what the ring takes now, or says to go to the kernel
 * (W_KERNEL), with wmu held. */
/* writer_moves starts the ring when the writer may (wmu held): on TCP, no
 * kernel send under way, no RESUME resend waiting, a ring whose reader
 * attached, no DOWN. It returns whether the writer is on the ring; after
 * DOWN it leaves it. */
static int writer_moves(struct flow *f, struct rings *rg, struct rings **done)
{
	if (!f->wring && rg && !rg->wleft && !f->winflight && !f->rs_len && !__atomic_load_n(&rg->down, __ATOMIC_SEQ_CST) &&
	    !__atomic_load_n(&f->wr_shut, __ATOMIC_SEQ_CST) && shunt_ring_reader_attached(&rg->sf.w)) {
		f->wstart = f->sent;
		f->wtail0 = rg->sf.w.own;
		shunt_ring_start(&rg->sf.w, f->sent);
		f->wring = 1;
		f->wswitch++;
		if (verbose > 1)
			plog("shunt: fd %d: writer started the ring at %llu", f->fd, (unsigned long long)f->sent);
	}
	/* After DOWN it leaves, on the ring or not: a writer that never
	 * started counts as left too (its mark says: no stretch). */
	if (rg && !rg->wleft && __atomic_load_n(&rg->down, __ATOMIC_SEQ_CST))
		*done = writer_leave(f, rg);
	return f->wring && rg;
}

int conn_tcp_begin(struct flow *f)
{
	struct rings *done = NULL;
	share_io(f);
	pthread_mutex_lock(&f->wmu);
	int ring = writer_moves(f, __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE), &done);
	/* A resend waiting (or a reset): the copying path, conn_send, deals
	 * with it first. */
	int tcp = !ring && !f->rs_len && !__atomic_load_n(&f->rst, __ATOMIC_SEQ_CST) &&
		  !__atomic_load_n(&f->wr_shut, __ATOMIC_SEQ_CST);
	if (tcp)
		f->winflight++;
	pthread_mutex_unlock(&f->wmu);
	rings_done(f, done);
	return tcp;
}

void conn_tcp_end(struct flow *f, ssize_t k)
{
	pthread_mutex_lock(&f->wmu);
	f->winflight--;
	if (k > 0) {
		f->sent += k;
		f->wbytes[0] += k;
	}
	pthread_mutex_unlock(&f->wmu);
}

static ssize_t write_step(struct flow *f, int fd, const uint8_t *buf, size_t n, int *wait, struct rings **done)
{
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	*wait = W_NONE;
	if (__atomic_load_n(&f->rst, __ATOMIC_SEQ_CST))
		return -ECONNRESET; /* RESUME reset the connection (resume.c) */
	if (__atomic_load_n(&f->wr_shut, __ATOMIC_SEQ_CST))
		return -EPIPE; /* not the kernel: its FIN may not be out yet (shutdown) */
	writer_moves(f, rg, done);
	for (;;) {
		if (!f->wring || !rg) {
			/* On TCP: a RESUME's resend goes before any new byte. */
			ssize_t k = f->rs_len ? resend_step(f, fd) : 0;
			if (k < 0) {
				*wait = k == -EAGAIN ? W_RESEND : W_NONE;
				return k;
			}
			*wait = W_KERNEL;
			return -EAGAIN;
		}
		if (__atomic_load_n(&rg->down, __ATOMIC_SEQ_CST)) {
			*done = writer_leave(f, rg);
			continue;
		}
		ssize_t k = shunt_ring_write(&rg->sf.w, buf, n);
		if (k > 0) {
			f->sent += k;
			f->wbytes[1] += k;
			return k;
		}
		if (k == SHUNT_EAGAIN || (k == 0 && n == 0)) {
			*wait = W_RING;
			return k ? -EAGAIN : 0;
		}
		if (k == SHUNT_ELEFT || k == SHUNT_EPIPE) { /* left, or the reader left: TCP */
			*done = writer_leave(f, rg);
			continue;
		}
		return -ECONNRESET;
	}
}

ssize_t conn_send(struct flow *f, int fd, const void *buf, size_t n, int flags, int64_t *deadline)
{
	if (inherited(f))
		return -1;
	share_io(f);
	int nb = f->nonblock || (flags & MSG_DONTWAIT);
	size_t put = 0;
	int err = 0, shut = 0;
	for (;;) {
		int wait, spun = 0;
		struct rings *done = NULL, *rg;
		ssize_t k;
		pthread_mutex_lock(&f->wmu);
		for (;;) {
			k = write_step(f, fd, (const uint8_t *)buf + put, n - put, &wait, &done);
			rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
			if (k > 0) {
				put += k;
				if (put == n)
					break;
				spun = 0;
				continue;
			}
			if (wait == W_KERNEL) {
				f->winflight++;
				break;
			}
			if (k == 0 || wait != W_RING || nb || spun || ended(f, 0))
				break;
			spun = 1;
			if (!ring_spin(f, &rg->sf.w, 0, deadline))
				break;
		}
		pthread_mutex_unlock(&f->wmu);
		rings_done(f, done);
		if (wait == W_KERNEL) {
			/* Without wmu: the kernel blocks as it would without us. */
			k = real_send(fd, (const uint8_t *)buf + put, n - put, flags);
			int e = errno;
			pthread_mutex_lock(&f->wmu);
			f->winflight--;
			if (k > 0) {
				f->sent += k;
				f->wbytes[0] += k;
				put += k;
			}
			pthread_mutex_unlock(&f->wmu);
			err = k < 0 ? e : 0;
			break;
		}
		if (k >= 0 && (put == n || k == 0))
			break;
		if (k < 0 && k != -EAGAIN) {
			err = -k;
			shut = k == -EPIPE;
			break;
		}
		if (__atomic_load_n(&f->closed, __ATOMIC_SEQ_CST)) {
			err = EBADF;
			break;
		}
		if (nb) {
			err = put ? 0 : EAGAIN;
			break;
		}
		if (wait == W_RESEND)
			err = resend_wait(f, fd, left_ns(f, 0, deadline));
		else
			err = ring_sleep(f, &rg->sf.w, 0, deadline);
		if (err)
			break;
	}
	if (verbose > 1)
		plog("shunt: send %zu flags %#x -> %zu (%s)", n, flags, put, err ? strerror(err) : "ok");
	if (err && !put) {
		if (err == EPIPE && shut && !(flags & MSG_NOSIGNAL))
			raise(SIGPIPE); /* as the kernel does for a send after shutdown */
		errno = err;
		return -1;
	}
	return put;
}

int conn_write_shut(struct flow *f, int flags)
{
	if (!__atomic_load_n(&f->wr_shut, __ATOMIC_SEQ_CST))
		return 0;
	if (!(flags & MSG_NOSIGNAL))
		raise(SIGPIPE);
	errno = EPIPE;
	return 1;
}

/* conn_buffered is FIONREAD: what a read would return now, on the path it
 * would read. */
ssize_t conn_buffered(struct flow *f, int fd)
{
	pthread_mutex_lock(&f->rmu);
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	ssize_t n = 0;
	uint64_t start;
	if (f->rring && rg) {
		n = shunt_ring_buffered(&rg->sf.r);
	} else if (f->slen) {
		n = f->slen;
	} else if (f->alen && f->roff == f->ahead_at) {
		n = f->alen; /* the next read moves them to the stash */
	} else if (rg && !rg->rleft && shunt_ring_started(&rg->sf.r, &start) && f->roff == start) {
		n = shunt_ring_buffered(&rg->sf.r);
	} else {
		int k = 0;
		if (real_ioctl(fd, FIONREAD, &k) == 0)
			n = k;
		if (rg && !rg->rleft && shunt_ring_started(&rg->sf.r, &start) && start > f->roff && (uint64_t)n > start - f->roff)
			n = start - f->roff;
		if (n > 0 && (size_t)n > ahead_lim(f)) /* not the bytes held ahead, nor any after them */
			n = (ssize_t)ahead_lim(f);
	}
	pthread_mutex_unlock(&f->rmu);
	return n > 0 ? n : 0;
}
