/* Regions by id (docs/protocol.md, docs/region.md). Region 0 is the one
 * WELCOME names, or a VM's BAR: mapped once per process, at the first
 * WELCOME, and kept (session.c). A process guest's other regions are the
 * regions of its guest pairs, which hostd hands over as descriptors
 * (REGION, SCM_RIGHTS) and takes back (UNREGION): each is mapped here,
 * held by the flows attached to its rings, and let go once hostd took it
 * back and no flow holds it. A flow names its region in every message.
 *
 * Letting go never unmaps: a thread may still look at a released flow's
 * rings (a poll that found the flow before it was released; flows are
 * reused, never freed, for that reason). The file's pages are replaced by
 * anonymous zero pages at the same addresses instead, which gives the
 * memory back (the file is unlinked by then) and keeps a late look
 * harmless; the address range is kept and reused for the next region of
 * the same size, so the mappings do not grow with the regions a long-lived
 * process went through. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct shunt_mapping {
	uint32_t id;
	uint8_t *mem;
	uint64_t size;
	struct shunt_region reg;
	uint64_t dev, ino; /* the file: a new region under a reused id is another file */
	int refs;          /* flows attached to its rings */
	int done;          /* UNREGION came, or another region took its id */
};

/* find_locked returns the live mapping of id, or NULL. */
static struct shunt_mapping *find_locked(struct shunt_session *s, uint32_t id)
{
	for (size_t i = 0; i < s->nmaps; i++)
		if (s->maps[i]->id == id && !s->maps[i]->done)
			return s->maps[i];
	return NULL;
}

/* Address ranges of regions let go, for reuse (see above); the process's,
 * not a session's. */
static pthread_mutex_t spare_mu = PTHREAD_MUTEX_INITIALIZER;
static struct spare {
	uint8_t *mem;
	uint64_t size;
	struct spare *next;
} *spares;

/* Fork: spare_mu is taken after the session locks (session.c's handlers
 * call these), so a fork while another thread holds it cannot leave it
 * held in the child. */
void regions_fork_prepare(void) { pthread_mutex_lock(&spare_mu); }
void regions_fork_parent(void) { pthread_mutex_unlock(&spare_mu); }
void regions_fork_child(void) { pthread_mutex_init(&spare_mu, NULL); }

/* spare_take returns a spare range of size bytes, or NULL. */
static void *spare_take(uint64_t size)
{
	pthread_mutex_lock(&spare_mu);
	void *mem = NULL;
	for (struct spare **p = &spares; *p; p = &(*p)->next)
		if ((*p)->size == size) {
			struct spare *x = *p;
			*p = x->next;
			mem = x->mem;
			free(x);
			break;
		}
	pthread_mutex_unlock(&spare_mu);
	return mem;
}

/* spare_put keeps a range of anonymous memory for reuse; without memory
 * for the record, the range just stays mapped. */
static void spare_put(uint8_t *mem, uint64_t size)
{
	struct spare *x = malloc(sizeof *x);
	if (!x)
		return;
	*x = (struct spare){mem, size, NULL};
	pthread_mutex_lock(&spare_mu);
	x->next = spares;
	spares = x;
	pthread_mutex_unlock(&spare_mu);
}

/* let_go replaces a region's pages by anonymous ones and keeps the range. */
static void let_go(uint8_t *mem, uint64_t size)
{
	shunt_fault_unguard(mem);
	if (mmap(mem, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED)
		spare_put(mem, size);
}

/* Stretches' ring pairs (stretch.c) go the same way as regions: the
 * preload library reads ring words without its locks (a stale view only
 * makes it look again) and its set sleepers write their wait flags, so a
 * range once given to rings must stay mapped. */
void *shunt_mem_map(int fd, uint64_t size)
{
	void *spare = spare_take(size), *mem;
	if (spare) {
		mem = mmap(spare, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
		if (mem == MAP_FAILED)
			spare_put(spare, size);
		return mem;
	}
	return mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
}

void shunt_mem_let_go(void *mem, uint64_t size) { let_go(mem, size); }

/* unmap_locked lets mp go and forgets it if it is done and unheld. */
static void unmap_locked(struct shunt_session *s, struct shunt_mapping *mp)
{
	if (!mp->done || mp->refs > 0)
		return;
	for (size_t i = 0; i < s->nmaps; i++)
		if (s->maps[i] == mp) {
			s->maps[i] = s->maps[--s->nmaps];
			break;
		}
	let_go(mp->mem, mp->size);
	free(mp);
}

/* How long a VM waits for the device hostd plugged for a pair region to
 * show up (ACPI or PCIe hotplug), and when it rescans the PCI buses once;
 * the Go library's barWait and barRescan (guestlib/bar.go). */
#define BAR_WAIT_MS   10000
#define BAR_RESCAN_MS 500
#define BAR_POLL_MS   10

/* bar_wait opens the BAR of the device plugged for the pair region of
 * REGION m (which came without a descriptor on a VM's port): its fd, or
 * -1 after BAR_WAIT_MS. It runs on the session's reader, so the READY
 * that follows finds the mapping. */
static int bar_wait(struct shunt_session *s, const struct shunt_msg *m)
{
	uint32_t gid = __atomic_load_n(&s->guest_id, __ATOMIC_RELAXED);
	int64_t start = shunt_now_ns();
	for (int rescanned = 0;;) {
		int fd = shunt_open_pair_bar(m->region_id, gid, m->region_size);
		int64_t ms = (shunt_now_ns() - start) / 1000000;
		if (fd >= 0) {
			shunt_logf(s, "shunt: region %u mapped from the device plugged for it (found %lld ms after REGION)", m->region_id, (long long)ms);
			return fd;
		}
		if (!rescanned && ms > BAR_RESCAN_MS) {
			rescanned = 1;
			shunt_pci_rescan();
		}
		if (ms > BAR_WAIT_MS) {
			shunt_logf(s, "shunt: REGION %u: no ivshmem device names it after %d ms; its flows stay on TCP", m->region_id, BAR_WAIT_MS);
			return -1;
		}
		usleep(BAR_POLL_MS * 1000);
	}
}

/* region_given maps the region of a REGION message from descriptor fd
 * (which it closes), or in a VM from the device plugged for it. A region
 * already mapped under the id is kept if it is the same file; another
 * file replaces it. */
static void region_given(struct shunt_session *s, const struct shunt_msg *m, int fd)
{
	struct stat st;
	/* A VM that carries flows over vsock stretches has no device plugged
	 * for a pair region (hostd hot-plugs only for VMs of a group with pair
	 * regions, which have no stretches): waiting would hold the READY
	 * behind it for BAR_WAIT_MS (Go: guestlib/bar.go). */
	if (fd < 0 && shunt_session_vm(s) && m->region_id != 0 && !shunt_session_stretches(s))
		fd = bar_wait(s, m);
	if (fd < 0 && shunt_session_stretches(s)) {
		shunt_logf(s, "shunt: REGION %u came without its descriptor: its flows go over vsock stretches", m->region_id);
		return;
	}
	if (fd < 0) {
		shunt_logf(s, "shunt: REGION %u came without its descriptor; its flows stay on TCP", m->region_id);
		return;
	}
	if (m->region_id == 0 || fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
		shunt_logf(s, "shunt: REGION %u: not a region file; ignored", m->region_id);
		sys_close(fd);
		return;
	}
	pthread_mutex_lock(&s->mu);
	struct shunt_mapping *old = find_locked(s, m->region_id);
	if (old && old->dev == (uint64_t)st.st_dev && old->ino == (uint64_t)st.st_ino) {
		pthread_mutex_unlock(&s->mu);
		sys_close(fd);
		return;
	}
	pthread_mutex_unlock(&s->mu);
	struct shunt_mapping *mp = calloc(1, sizeof *mp);
	void *mem = MAP_FAILED, *spare = mp ? spare_take(st.st_size) : NULL;
	if (spare) {
		mem = mmap(spare, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
		if (mem == MAP_FAILED)
			spare_put(spare, st.st_size);
	} else if (mp) {
		mem = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	}
	sys_close(fd);
	if (mem == MAP_FAILED || shunt_region_attach(&mp->reg, mem, st.st_size)) {
		shunt_logf(s, "shunt: REGION %u: cannot map it as a region; its flows stay on TCP", m->region_id);
		if (mem != MAP_FAILED)
			let_go(mem, st.st_size);
		free(mp);
		return;
	}
	/* Either guest, or hostd taking the memory back, may truncate it. */
	shunt_fault_guard(mem, st.st_size);
	mp->id = m->region_id;
	mp->mem = mem;
	mp->size = st.st_size;
	mp->dev = st.st_dev;
	mp->ino = st.st_ino;
	pthread_mutex_lock(&s->mu);
	if (s->nmaps == s->cmaps) {
		size_t c = s->cmaps ? 2 * s->cmaps : 4;
		struct shunt_mapping **more = realloc(s->maps, c * sizeof *more);
		if (!more) {
			pthread_mutex_unlock(&s->mu);
			shunt_logf(s, "shunt: REGION %u: out of memory; its flows stay on TCP", m->region_id);
			let_go(mem, st.st_size);
			free(mp);
			return;
		}
		s->maps = more;
		s->cmaps = c;
	}
	if ((old = find_locked(s, m->region_id))) {
		old->done = 1;
		unmap_locked(s, old);
	}
	s->maps[s->nmaps++] = mp;
	pthread_mutex_unlock(&s->mu);
}

/* region_taken is UNREGION: the region goes once no flow holds it. */
static void region_taken(struct shunt_session *s, uint32_t id)
{
	pthread_mutex_lock(&s->mu);
	struct shunt_mapping *mp = find_locked(s, id);
	if (mp) {
		mp->done = 1;
		unmap_locked(s, mp);
	}
	pthread_mutex_unlock(&s->mu);
}

void shunt_region_msg(struct shunt_session *s, const struct shunt_msg *m, struct shunt_fdq *q)
{
	if (m->type == SHUNT_REGION)
		region_given(s, m, shunt_fdq_take(q));
	else
		region_taken(s, m->region_id);
}

int shunt_region_hold(struct shunt_session *s, uint32_t id, struct shunt_region *g, void **hold)
{
	int err = 0;
	*hold = NULL;
	pthread_mutex_lock(&s->mu);
	if (id == 0) {
		if (s->region)
			*g = s->reg;
		else
			err = SHUNT_EINVAL;
	} else {
		struct shunt_mapping *mp = find_locked(s, id);
		if (mp) {
			mp->refs++;
			*g = mp->reg;
			*hold = mp;
		} else {
			err = SHUNT_EINVAL;
		}
	}
	pthread_mutex_unlock(&s->mu);
	return err;
}

void shunt_region_release(struct shunt_session *s, void *hold)
{
	struct shunt_mapping *mp = hold;
	if (!mp)
		return;
	pthread_mutex_lock(&s->mu);
	mp->refs--;
	unmap_locked(s, mp);
	pthread_mutex_unlock(&s->mu);
}

int shunt_session_regions(struct shunt_session *s)
{
	pthread_mutex_lock(&s->mu);
	int n = (int)s->nmaps;
	pthread_mutex_unlock(&s->mu);
	return n;
}

int shunt_fdq_take(struct shunt_fdq *q)
{
	if (q->n == 0)
		return -1;
	int fd = q->fd[0];
	for (int i = 1; i < q->n; i++)
		q->fd[i - 1] = q->fd[i];
	q->n--;
	return fd;
}

void shunt_fdq_close(struct shunt_fdq *q)
{
	for (int i = 0; i < q->n; i++)
		sys_close(q->fd[i]);
	q->n = 0;
}
