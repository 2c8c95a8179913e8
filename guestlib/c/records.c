/* Records in a ring, in place (shunt.h, "records").
 *
 * The ring is the same as the copy API's (ring.c, docs/region.md): the
 * same header, the same free-running head and tail, reset and close flags,
 * so hostd's counters and revocation work unchanged. What this file adds is
 * what the copy API cannot do: write a record where it will be read (the
 * MPI transport's ob1 packs straight into the ring) and hand the reader a
 * pointer into the ring, and a reader that sees a small record with one
 * cache-line transfer:
 *
 *   - every record starts on a 64-byte line and never wraps: a PAD record
 *     fills the rest of the ring when the next one does not fit;
 *   - the header's stamp (epoch + record number) is stored last, after the
 *     payload, with release order; the reader polls the stamp at its head
 *     instead of the tail (which lives on another line), so an 8-byte
 *     message costs one line;
 *   - before it publishes a record, the writer zeroes the header line after
 *     it when that line may hold payload of this ring's own (a multi-line
 *     record or a PAD covered it within the last lap, or it is the first
 *     lap) and the reader is done with it, so the reader polling there
 *     never finds its stamp in stale bytes. A line that held a header
 *     holds an older stamp, which never matches, so a stream of one-line
 *     records clears nothing after its first lap: the zeroing store would
 *     cost a second line transfer per message (Go: shm/ring/records.go,
 *     the same rule with a bit per line);
 *   - no index is published per record: the tail and the head (and the
 *     counts beside them) are stored once per stride, an eighth of the
 *     ring, so a one-line record is the only line either end writes. A
 *     writer short of room sets the ring's "writer waiting" word (which no
 *     record end sleeps on) and looks again; a reader that sees it set
 *     publishes its head at once. hostd's byte counters lag by less than
 *     a stride, and a ring's last stretch may stay unpublished: record
 *     readers never read the tail (they poll stamps, and drain to the
 *     counts the MPI transport's DOWN carries).
 *
 * Both ends validate what they read: a stamp matches only its own record
 * number, a length must fit before the ring's end, the head may only move
 * forward and never past the writer's own count. */
#define _GNU_SOURCE
#include "internal.h"

#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SC __ATOMIC_SEQ_CST

_Static_assert(sizeof(struct shunt_rec) == 16, "struct shunt_rec is 16 bytes (shunt.h)");

static inline uint64_t *w64(const struct shunt_ring *r, int off) { return (uint64_t *)(r->hdr + off); }
static inline uint32_t *w32(const struct shunt_ring *r, int off) { return (uint32_t *)(r->hdr + off); }

/* poke wakes the peer if it published "waiting" on flag (the waker's half
 * of ring.c's wake, shm/wait). Record rings' ends never sleep (the MPI
 * transport polls them from opal_progress), so the index stores before it
 * are release stores, not the sequentially consistent ones ring.c's
 * Dekker protocol needs: a full fence per record would stall the writer on
 * the reader's copy of the line it just wrote. Should a sleeping end ever
 * read these rings, publish and shunt_rec_consume must store with
 * __ATOMIC_SEQ_CST again. */
static void poke(struct shunt_ring *r, int off)
{
	uint32_t *flag = w32(r, off), one = 1;
	if (__atomic_load_n(flag, __ATOMIC_RELAXED) == 0)
		return;
	if (__atomic_compare_exchange_n(flag, &one, 0, 0, SC, SC)) {
		if (shunt_remote_wake && !r->local)
			shunt_remote_wake(r);
		else
			shunt_futex_wake(flag, INT32_MAX);
	}
}

int shunt_rec_broken(const struct shunt_rec_ring *w)
{
	return shunt_fault_dead(w->r->hdr) || __atomic_load_n(w32(w->r, SHUNT_OFF_RESET), __ATOMIC_ACQUIRE) ||
	       (__atomic_load_n(w32(w->r, SHUNT_OFF_RFLAGS), __ATOMIC_ACQUIRE) & 1);
}

uint16_t shunt_rec_reason(const struct shunt_rec_ring *w)
{
	uint32_t r = __atomic_load_n(w32(w->r, SHUNT_OFF_REASON), __ATOMIC_ACQUIRE);
	return r < 0xffff ? (uint16_t)r : 0;
}

/* refresh loads the reader's head: 0, or SHUNT_ECORRUPT if it moved back or
 * past what this end wrote. */
static int refresh(struct shunt_ring *r)
{
	uint64_t h = __atomic_load_n(w64(r, SHUNT_OFF_HEAD), __ATOMIC_ACQUIRE);
	if (h < r->peer || h > r->own)
		return SHUNT_ECORRUPT;
	r->peer = h;
	return 0;
}

/* crossed reports whether the index moved into another stride (an eighth
 * of the ring) since it was last published. */
static inline int crossed(const struct shunt_rec_ring *e)
{
	return (e->r->own ^ e->shown) >= (e->r->cap >> 3);
}

/* show_tail stores the tail after records up to r->own, and the count. */
static void show_tail(struct shunt_rec_ring *w)
{
	struct shunt_ring *r = w->r;
	w->shown = r->own;
	__atomic_store_n(w64(r, SHUNT_OFF_TAIL), r->own, __ATOMIC_RELEASE);
	__atomic_store_n(w64(r, SHUNT_OFF_WMSGS), r->msgs, __ATOMIC_RELAXED);
}

/* publish ends a record: the tail once per stride, and a wake for a
 * reader that sleeps on the ring (a load of a line no record end writes). */
static void publish(struct shunt_rec_ring *w)
{
	struct shunt_ring *r = w->r;
	r->msgs++;
	if (crossed(w))
		show_tail(w);
	poke(r, SHUNT_OFF_RWAIT);
}

/* A record writer short of room stores WANTS_ROOM in the ring's "writer
 * waiting" word: not 1, which a sleeper stores, so that the reader
 * answers it with its head and no futex wake. */
#define WANTS_ROOM 2u

/* show_head stores the head after the records consumed, and the count,
 * then clears a writer's request for room, or wakes a writer asleep. */
static void show_head(struct shunt_rec_ring *rd)
{
	struct shunt_ring *r = rd->r;
	uint32_t want = WANTS_ROOM;
	rd->shown = r->own;
	__atomic_store_n(w64(r, SHUNT_OFF_HEAD), r->own, __ATOMIC_RELEASE);
	__atomic_store_n(w64(r, SHUNT_OFF_RMSGS), r->msgs, __ATOMIC_RELAXED);
	if (!__atomic_compare_exchange_n(w32(r, SHUNT_OFF_WWAIT), &want, 0, 0, SC, SC))
		poke(r, SHUNT_OFF_WWAIT);
}

/* wants_room reports whether the writer asked for the head. */
static inline int wants_room(const struct shunt_ring *r)
{
	return __atomic_load_n(w32(r, SHUNT_OFF_WWAIT), __ATOMIC_RELAXED) != 0;
}

/* wrote notes that the lines after the header of a record at the
 * absolute position at, span bytes long, hold payload (or, for a PAD,
 * whatever was there): a lap later they may be record boundaries. */
static void wrote(struct shunt_rec_ring *w, uint64_t at, uint64_t span)
{
	if (span > SHUNT_REC_LINE && at + span + w->r->cap > w->dirty_until)
		w->dirty_until = at + span + w->r->cap;
}

/* clear_ahead zeroes the header line that follows a record ending at the
 * absolute position end, if it may be dirty and the reader is done with
 * it (see the file comment). It is not when the reader's head is exactly
 * there: then the line holds an unread record of this ring, whose stamp is
 * older than any the reader will look for there. */
static void clear_ahead(struct shunt_rec_ring *w, uint64_t end)
{
	struct shunt_ring *r = w->r;
	if (end >= w->dirty_until)
		return;
	if (end + sizeof(struct shunt_rec) > r->peer + r->cap) {
		if (refresh(r) || end + sizeof(struct shunt_rec) > r->peer + r->cap)
			return;
	}
	struct shunt_rec *n = (struct shunt_rec *)(r->data + (end & r->mask));
	__atomic_store_n(&n->stamp, 0, __ATOMIC_RELAXED);
}

/* put_stamp stores h's stamp last: payload and header before it. memcpy
 * uses non-temporal stores, which a release store alone does not order on
 * x86, only for copies far larger than a fragment (glibc: a fraction of
 * the shared cache); an sfence covers those. */
static void put_stamp(struct shunt_rec_ring *w, struct shunt_rec *h, size_t len)
{
#if defined(__x86_64__)
	if (len >= (1u << 20))
		__builtin_ia32_sfence();
#else
	(void)len;
#endif
	__atomic_store_n(&h->stamp, w->epoch + w->next, __ATOMIC_RELEASE);
	w->next++;
}

struct shunt_rec *shunt_rec_reserve(struct shunt_rec_ring *w, size_t len, int *err)
{
	struct shunt_ring *r = w->r;
	if (shunt_rec_broken(w)) {
		*err = shunt_fault_dead(r->hdr) || __atomic_load_n(w32(r, SHUNT_OFF_RESET), __ATOMIC_RELAXED) ? SHUNT_ERESET : SHUNT_EPIPE;
		return NULL;
	}
	if (!w->dirty_until)
		w->dirty_until = r->own + r->cap; /* the first lap: a fresh ring's bytes */
	size_t span = shunt_rec_span(len);
	uint64_t off = r->own & r->mask, to_end = r->cap - off;
	uint64_t need = span <= to_end ? span : to_end + span;
	if (span > r->cap / 2) {
		*err = SHUNT_EINVAL;
		return NULL;
	}
	if (r->cap - (r->own - r->peer) < need) {
		if ((*err = refresh(r)))
			return NULL;
		if (r->cap - (r->own - r->peer) < need) {
			/* Ask the reader for its head (it publishes it once per
			 * stride otherwise), then look again: a head published
			 * before the flag was seen is found here. */
			if (w->shown != r->own)
				show_tail(w);
			__atomic_store_n(w32(r, SHUNT_OFF_WWAIT), WANTS_ROOM, SC);
			if ((*err = refresh(r)))
				return NULL;
			if (r->cap - (r->own - r->peer) < need) {
				*err = SHUNT_EAGAIN;
				return NULL;
			}
		}
	}
	if (span > to_end) {
		/* PAD to the end; published at once, so head never passes tail. */
		struct shunt_rec *pad = (struct shunt_rec *)(r->data + off);
		pad->len = to_end - sizeof(struct shunt_rec);
		pad->kind = SHUNT_REC_PAD;
		pad->tag = 0;
		pad->pad = 0;
		wrote(w, r->own, to_end);
		r->own += to_end;
		clear_ahead(w, r->own);
		put_stamp(w, pad, 0);
		publish(w);
		off = 0;
	}
	w->resv = 1;
	return (struct shunt_rec *)(r->data + off);
}

void shunt_rec_commit(struct shunt_rec_ring *w, struct shunt_rec *h, size_t len, uint16_t pad, uint8_t kind, uint8_t tag)
{
	struct shunt_ring *r = w->r;
	h->len = len;
	h->kind = kind;
	h->tag = tag;
	h->pad = pad;
	uint64_t span = shunt_rec_span(pad + len);
	wrote(w, r->own, span);
	r->own += span;
	clear_ahead(w, r->own);
	put_stamp(w, h, len);
	w->resv = 0;
	publish(w);
}

void shunt_rec_cancel(struct shunt_rec_ring *w) { w->resv = 0; }

struct shunt_rec *shunt_rec_poll(struct shunt_rec_ring *rd, int *err)
{
	struct shunt_ring *r = rd->r;
	uint64_t off = r->own & r->mask;
	struct shunt_rec *h = (struct shunt_rec *)(r->data + off);
	if (__atomic_load_n(&h->stamp, __ATOMIC_ACQUIRE) != rd->epoch + rd->next) {
		if (rd->shown != r->own && wants_room(r))
			show_head(rd);
		return NULL;
	}
	uint64_t len = (uint64_t)__atomic_load_n(&h->len, __ATOMIC_RELAXED) + h->pad;
	uint8_t kind = h->kind;
	if (len > r->cap || off + shunt_rec_span(len) > r->cap || (kind != SHUNT_REC_DATA && kind != SHUNT_REC_PAD)) {
		*err = SHUNT_ECORRUPT;
		return NULL;
	}
	/* Consume moves the head by what was checked here: the writer (a
	 * hostile peer) may rewrite the header after this check. */
	rd->span = shunt_rec_span(len);
	return h;
}

void shunt_rec_consume(struct shunt_rec_ring *rd, const struct shunt_rec *h)
{
	struct shunt_ring *r = rd->r;
	(void)h; /* its span was checked and kept by shunt_rec_poll */
	r->own += rd->span;
	r->msgs++;
	rd->next++;
	if (crossed(rd) || wants_room(r))
		show_head(rd);
}
