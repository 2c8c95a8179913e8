/* share: a young connection held by several processes after a fork
 * (docs/preload.md, Rules: fork).
 *
 * A connection hostd has not heard of yet (in the open delay: no OPEN,
 * no ring) is kept by both processes at a fork, on TCP, and counted in a
 * slot of a MAP_SHARED page that the whole process tree sees: which
 * processes hold it, and which did I/O on it since the fork. A process
 * may offer it to hostd (OPEN) only when it is the only holder left, it
 * used the connection since the fork, and no other holder did. Then its
 * own stream offsets are exact (what came before the fork both copies
 * counted), no other process can write past the rings, and it is not a
 * child about to exec with the connection on its stdin (inetd, sshd's
 * re-exec), which does not touch it before. So an accept-then-fork
 * server's child takes the fast path once the parent closed its copy, a
 * parent keeps it when a helper child exits without touching it, and a
 * connection two processes used stays on TCP for good.
 *
 * A holder leaves the slot at its last close of the connection, and at
 * exit; one that died without (a kill, _exit) is found gone by kill(pid,
 * 0) and swept. A child is counted from before it runs (a placeholder the
 * prepare handler writes and the child's handler replaces by its pid), so
 * the parent never sees itself alone while a child is being born. A
 * holder that execs with the connection open, or lets it go to the
 * kernel, poisons the slot: no process takes it any more. What is not
 * sure is never taken: a full page, a slot of full holders, a fork that
 * failed (its placeholder stays) all keep the connection on TCP.
 *
 * Slots are claimed and freed with atomics only: any process of the tree
 * may take a free one, and a slot is freed by the holder that leaves it
 * empty, or taken over by a claim once every holder it names has died
 * (the last did not leave it: an exec that kept the connection, a kill). */
#include "preload.h"

#include <errno.h>
#include <signal.h>
#include <sys/mman.h>

#define SHARE_SLOTS 1024
#define SHARE_HOLDERS 8
#define UNBORN INT32_MIN /* a child the prepare handler counted, not yet running its child handler */
#define POISONED -1      /* io: more than one process did I/O, or one let the kernel have it */

struct share {
	uint32_t used;                  /* bit 0: claimed; the rest counts claims, so that a leaver's free never frees a later claim */
	int32_t io;                     /* 0: no holder did I/O since the first fork; a pid: only it; POISONED */
	int32_t holder[SHARE_HOLDERS];  /* pids, 0 for none, UNBORN */
	uint32_t pad[6];                /* one slot, one cache line */
};

static struct share *page; /* made at the first fork that shares, inherited by the children */

/* gone: pid is no process any more (a zombie still counts). */
static int gone(int32_t pid) { return pid > 0 && kill(pid, 0) < 0 && errno == ESRCH; }

/* sweep clears the entries of holders that died without leaving. */
static void sweep(struct share *s)
{
	int e = errno;
	for (int i = 0; i < SHARE_HOLDERS; i++) {
		int32_t p = __atomic_load_n(&s->holder[i], __ATOMIC_SEQ_CST);
		if (p != my_pid && gone(p))
			__atomic_compare_exchange_n(&s->holder[i], &p, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
	}
	errno = e;
}

/* put writes v into a free entry of s: 0, or -1 if there is none. */
static int put(struct share *s, int32_t v)
{
	for (int pass = 0; pass < 2; pass++) {
		for (int i = 0; i < SHARE_HOLDERS; i++) {
			int32_t z = 0;
			if (__atomic_compare_exchange_n(&s->holder[i], &z, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
				return 0;
		}
		sweep(s);
	}
	return -1;
}

/* orphaned: no holder of s is alive any more, and none is being born:
 * those that died without leaving it (an exec that kept the connection
 * open, inetd's or sshd's child; a kill; _exit) are swept, and nobody
 * refers to s. Without this, each such connection would keep its slot
 * for good, and after SHARE_SLOTS of them no fork would share any more. */
static int orphaned(struct share *s)
{
	/* At least one holder that died: a slot with no entry at all is
	 * being claimed (its claimer has not written its pid yet) or freed. */
	int dead = 0;
	for (int i = 0; i < SHARE_HOLDERS; i++) {
		int32_t p = __atomic_load_n(&s->holder[i], __ATOMIC_SEQ_CST);
		if (p && !gone(p))
			return 0;
		dead += p != 0;
	}
	if (!dead)
		return 0;
	sweep(s);
	return 1;
}

static struct share *claim(void)
{
	if (!page) {
		void *m = mmap(NULL, SHARE_SLOTS * sizeof *page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED)
			return NULL;
		page = m;
	}
	/* A free slot first; then one whose holders all died (the second
	 * pass costs a kill(pid, 0) per entry, only when the page is full). */
	for (int pass = 0; pass < 2; pass++) {
		for (int i = 0; i < SHARE_SLOTS; i++) {
			struct share *s = &page[i];
			uint32_t u = __atomic_load_n(&s->used, __ATOMIC_SEQ_CST);
			if ((u & 1) && (!pass || !orphaned(s)))
				continue;
			if (!__atomic_compare_exchange_n(&s->used, &u, (u & ~1u) + 3, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
				continue;
			for (int j = 0; j < SHARE_HOLDERS; j++)
				__atomic_store_n(&s->holder[j], 0, __ATOMIC_SEQ_CST);
			__atomic_store_n(&s->io, 0, __ATOMIC_SEQ_CST);
			__atomic_store_n(&s->holder[0], my_pid, __ATOMIC_SEQ_CST);
			return s;
		}
	}
	return NULL;
}

/* release_slot frees s if no entry is left (the caller just left it);
 * the claim count read before the check makes the free fail if s was
 * claimed again meanwhile (an orphan taken over, claim). */
static void release_slot(struct share *s)
{
	uint32_t u = __atomic_load_n(&s->used, __ATOMIC_SEQ_CST);
	for (int i = 0; i < SHARE_HOLDERS; i++)
		if (__atomic_load_n(&s->holder[i], __ATOMIC_SEQ_CST))
			return;
	__atomic_compare_exchange_n(&s->used, &u, u & ~1u, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

int share_prepare(struct flow *f)
{
	int fresh = !f->share;
	if (fresh && !(f->share = claim()))
		return -1;
	if (put(f->share, UNBORN) == 0) {
		if (fresh)
			f->share_io = 0;
		/* A call of this process already inside f (users beyond the
		 * fds' one: a read or write blocked in the kernel without its
		 * lock, or past its share_io and waiting for the lock the
		 * prepare handler holds) moves bytes after the fork that no
		 * share_io will note: it counts as this process's I/O now, so
		 * that the child, whose offsets miss those bytes, never OPENs. */
		if (!f->share_io && __atomic_load_n(&f->users, __ATOMIC_ACQUIRE) > 1) {
			f->share_io = 1;
			int32_t none = 0;
			if (!__atomic_compare_exchange_n(&f->share->io, &none, my_pid, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST) &&
			    none != my_pid)
				__atomic_store_n(&f->share->io, POISONED, __ATOMIC_SEQ_CST);
		}
		return 0;
	}
	if (fresh)
		share_leave(f);
	return -1;
}

void share_child(struct flow *f)
{
	struct share *s = f->share;
	f->share_io = 0;
	f->share_tries = 0;
	for (int i = 0; i < SHARE_HOLDERS; i++) {
		int32_t u = UNBORN;
		if (__atomic_compare_exchange_n(&s->holder[i], &u, my_pid, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
			return;
	}
	__atomic_store_n(&s->io, POISONED, __ATOMIC_SEQ_CST); /* cannot happen: then nobody may take it */
}

void share_note_io(struct flow *f)
{
	struct share *s = f->share;
	if (!s || f->share_io)
		return;
	f->share_io = 1;
	int32_t none = 0;
	if (!__atomic_compare_exchange_n(&s->io, &none, my_pid, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST) && none != my_pid)
		__atomic_store_n(&s->io, POISONED, __ATOMIC_SEQ_CST);
	/* A fork child's leaver starts with its first use of a shared
	 * connection: the child that serves it is the one to OPEN it. */
	if (leaver_start() == 0)
		leaver_wake();
}

int share_alone(struct flow *f)
{
	struct share *s = f->share;
	int others = 0;
	sweep(s);
	for (int i = 0; i < SHARE_HOLDERS; i++) {
		int32_t p = __atomic_load_n(&s->holder[i], __ATOMIC_SEQ_CST);
		others += p && p != my_pid;
	}
	/* After the holders: a holder that did I/O and left marked io first. */
	int32_t io = __atomic_load_n(&s->io, __ATOMIC_SEQ_CST);
	if (io != 0 && io != my_pid)
		return -1;
	return !others && io == my_pid; /* not before it uses it: an exec may be on its way (sshd, inetd) */
}

void share_leave(struct flow *f)
{
	struct share *s = f->share;
	if (!s)
		return;
	f->share = NULL;
	for (int i = 0; i < SHARE_HOLDERS; i++) {
		int32_t p = my_pid;
		if (__atomic_compare_exchange_n(&s->holder[i], &p, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
			break;
	}
	release_slot(s);
}

void share_poison(struct flow *f)
{
	if (f->share)
		__atomic_store_n(&f->share->io, POISONED, __ATOMIC_SEQ_CST);
}

void share_exec(struct flow *f)
{
	struct share *s = f->share;
	share_leave(f);
	f->exec_share = s; /* not freed by a process that may come back: see share_exec_failed */
}

void share_exec_failed(struct flow *f)
{
	struct share *s = f->exec_share;
	f->exec_share = NULL;
	if (!s || f->share)
		return;
	/* The slot may have been freed and claimed for another connection
	 * meanwhile: poisoning that one too only costs it the fast path. */
	__atomic_store_n(&s->io, POISONED, __ATOMIC_SEQ_CST);
	if (put(s, my_pid) == 0)
		f->share = s;
}
