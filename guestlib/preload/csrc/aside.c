/* What the reader keeps aside of a ring in its own memory (rmu held;
 * docs/DESIGN.md, downgrade), so that the ring can be left, and hostd
 * free it, before the program reads those bytes:
 *
 *   reader_drain   at DOWN, the rest of a ring the reader is at (its
 *                  writer left or gone), to the front of the stash;
 *   reader_ahead   a ring's whole stretch while TCP bytes before its start
 *                  are still due: a firewall that caused the DOWN may drop
 *                  them, and their retransmissions, until its rule goes,
 *                  longer than hostd's grace for the retired region. Held
 *                  at its start (f->ahead, f->ahead_at), one at a time, at
 *                  most a ring's capacity: every kernel read stops there
 *                  (ahead_lim, path.c), and there the bytes move to the
 *                  front of the stash (ahead_due).
 *
 * Go: guestlib/conn_read.go, drainLocked and aheadLocked. */
#include "preload.h"

#include <stdlib.h>
#include <string.h>

/* ring_out reads up to b bytes that r holds, its writer left or gone,
 * into s: how many, or -1 with the ring reset or corrupt (then the reader
 * stays on it, where its next read reports it: a reset flow drops what it
 * holds, and leaving would hand it the kernel's bytes). */
static ssize_t ring_out(struct shunt_ring *r, uint8_t *s, size_t b)
{
	size_t got = 0;
	while (got < b) {
		ssize_t k = shunt_ring_read(r, s + got, b - got);
		if (k < 0 && k != SHUNT_EAGAIN && k != SHUNT_ELEFT)
			return -1;
		if (k <= 0)
			break;
		got += (size_t)k;
	}
	return (ssize_t)got;
}

int reader_drain(struct flow *f, struct shunt_ring *r)
{
	ssize_t b = shunt_ring_buffered(r);
	if (b <= 0)
		return 0;
	size_t need = (size_t)b + f->slen;
	uint8_t *s = malloc(need);
	if (!s)
		return -1;
	ssize_t got = ring_out(r, s, (size_t)b);
	if (got < 0) {
		free(s);
		return -1;
	}
	if (f->slen)
		memcpy(s + got, f->stash + f->shead, f->slen);
	free(f->stash);
	f->stash = s;
	f->scap = need;
	f->shead = 0;
	f->slen += (size_t)got;
	f->sring += (size_t)got;
	f->stashed++;
	if (verbose > 1)
		plog("shunt: fd %d: %zd bytes left in the ring kept for the reader", f->fd, got);
	return 0;
}

int reader_ahead(struct flow *f, struct rings *rg, uint64_t start, struct rings **done)
{
	struct shunt_ring *r = &rg->sf.r;
	/* One at a time (a second ring given and left before the first's
	 * TCP bytes came waits for them as before), at most a ring's
	 * capacity (what the ring holds: shunt_ring_buffered checks it). */
	if (f->alen || start <= f->roff)
		return -1;
	ssize_t b = shunt_ring_buffered(r);
	if (b < 0)
		return -1;
	uint8_t *s = b ? malloc((size_t)b) : NULL;
	if (b && !s)
		return -1;
	ssize_t got = b ? ring_out(r, s, (size_t)b) : 0;
	if (got < 0) {
		free(s);
		return -1;
	}
	if (got) {
		f->ahead = s;
		f->ahead_at = start;
		__atomic_store_n(&f->alen, (size_t)got, __ATOMIC_RELEASE);
		f->aheads++;
	} else {
		free(s);
	}
	plog("shunt: fd %d: reader left the ring with its stretch [%llu, %llu) copied aside: TCP bytes from %llu are still due",
	     f->fd, (unsigned long long)start, (unsigned long long)(start + (uint64_t)got), (unsigned long long)f->roff);
	*done = reader_leave(f, rg);
	return 0;
}

size_t ahead_lim(struct flow *f)
{
	return f->alen ? (size_t)(f->ahead_at - f->roff) : SIZE_MAX;
}

int ahead_due(struct flow *f)
{
	if (!f->alen || f->roff != f->ahead_at)
		return 0;
	size_t n = f->alen;
	if (f->slen) { /* not expected (a stash holds bytes before it), but kept in order */
		uint8_t *s = malloc(n + f->slen);
		if (!s)
			return -1;
		memcpy(s, f->ahead, n);
		memcpy(s + n, f->stash + f->shead, f->slen);
		free(f->ahead);
		f->ahead = s;
		n += f->slen;
	}
	free(f->stash);
	f->stash = f->ahead;
	f->scap = n;
	f->shead = 0;
	f->slen = n;
	f->sring += f->alen;
	f->ahead = NULL;
	__atomic_store_n(&f->alen, 0, __ATOMIC_RELEASE);
	if (verbose > 1)
		plog("shunt: fd %d: the TCP stream reached the stretch held ahead at %llu", f->fd, (unsigned long long)f->roff);
	return 0;
}
