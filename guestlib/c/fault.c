/* Regions that vanish under their mappings (docs/region.md, "Revocation").
 *
 * A pair region is a memfd that either guest can shrink, and that hostd
 * truncates to nothing to take the memory back from both guests when a
 * flow loses its permission. An access to a page past the file's end
 * raises SIGBUS, which would kill the application. The core registers
 * every region mapping here (shunt_fault_guard), and a SIGBUS handler, for
 * a fault inside one, maps anonymous zero memory over the whole region
 * (MAP_FIXED, so the faulting access completes harmlessly when it is
 * retried) and marks it dead. The ring calls then fail the region's flows
 * with SHUNT_ERESET (ring.c: shunt_fault_dead), so the application gets
 * an error (ECONNRESET) for those connections, never a signal.
 *
 * A fault anywhere else is the application's: it goes to the handler that
 * was installed before ours (or that the application installs through
 * shunt_fault_sigaction, which the preload library's sigaction calls), or
 * the default action kills the process as it would have.
 *
 * The registry is a fixed table of atomics, so that the handler takes no
 * lock and calls nothing but mmap. */
#define _GNU_SOURCE
#include "internal.h"

#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define FAULT_SLOTS 1024

static struct guarded {
	uintptr_t lo, hi; /* [lo, hi); lo == 0: free */
	int dead;
} guarded[FAULT_SLOTS];

/* How many regions died in this process: ring calls look at it first (one
 * load), and look a region up only when it is not 0. */
unsigned long shunt_faults;

static pthread_mutex_t install_mu = PTHREAD_MUTEX_INITIALIZER;
static int installed;
static struct sigaction chained; /* the handler for every other SIGBUS */

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
	uintptr_t a = (uintptr_t)si->si_addr;
	for (int i = 0; i < FAULT_SLOTS; i++) {
		uintptr_t lo = __atomic_load_n(&guarded[i].lo, __ATOMIC_ACQUIRE);
		uintptr_t hi = __atomic_load_n(&guarded[i].hi, __ATOMIC_ACQUIRE);
		if (!lo || a < lo || a >= hi)
			continue;
		/* The region's file was truncated: its memory is gone for
		 * every process that maps it. Zeros in its place, then the
		 * faulting access is retried and completes. */
		if (mmap((void *)lo, hi - lo, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
			break;
		__atomic_store_n(&guarded[i].dead, 1, __ATOMIC_RELEASE);
		__atomic_add_fetch(&shunt_faults, 1, __ATOMIC_RELEASE);
		return;
	}
	struct sigaction c = chained;
	if (c.sa_flags & SA_SIGINFO) {
		c.sa_sigaction(sig, si, uc);
		return;
	}
	if (c.sa_handler != SIG_DFL && c.sa_handler != SIG_IGN) {
		c.sa_handler(sig);
		return;
	}
	/* The default action: restore it (the raw call: the preload
	 * library's sigaction would only record it); the access faults
	 * again and the kernel ends the process as it would have. */
	struct {
		void *handler;
		unsigned long flags;
		void *restorer;
		uint64_t mask;
	} dfl = {SIG_DFL, 0, NULL, 0};
	shunt_sys(SYS_rt_sigaction, SIGBUS, (long)&dfl, 0, sizeof dfl.mask, 0, 0);
}

/* install puts the handler in place once, keeping the one it replaces.
 * The call is made outside install_mu, through glibc's own name for
 * sigaction (sys_sigaction), which the preload library's sigaction does
 * not catch: before installed is set it would pass the call on anyway. */
static pthread_once_t install_once = PTHREAD_ONCE_INIT;

static void install_now(void)
{
	struct sigaction sa, prev;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_sigbus;
	sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
	sigemptyset(&sa.sa_mask);
	if (sys_sigaction(SIGBUS, &sa, &prev) != 0)
		return;
	pthread_mutex_lock(&install_mu);
	chained = prev;
	installed = 1;
	pthread_mutex_unlock(&install_mu);
}

static void install(void) { pthread_once(&install_once, install_now); }

void shunt_fault_guard(void *mem, size_t size)
{
	install();
	for (int i = 0; i < FAULT_SLOTS; i++) {
		uintptr_t zero = 0;
		if (__atomic_load_n(&guarded[i].lo, __ATOMIC_RELAXED) == 0) {
			__atomic_store_n(&guarded[i].dead, 0, __ATOMIC_RELAXED);
			__atomic_store_n(&guarded[i].hi, (uintptr_t)mem + size, __ATOMIC_RELEASE);
			if (__atomic_compare_exchange_n(&guarded[i].lo, &zero, (uintptr_t)mem, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
				return;
		}
	}
	/* Table full: this region is not guarded (a fault in it kills). */
}

void shunt_fault_unguard(void *mem)
{
	for (int i = 0; i < FAULT_SLOTS; i++)
		if (__atomic_load_n(&guarded[i].lo, __ATOMIC_RELAXED) == (uintptr_t)mem) {
			__atomic_store_n(&guarded[i].lo, 0, __ATOMIC_RELEASE);
			return;
		}
}

int shunt_fault_dead_slow(const void *p)
{
	uintptr_t a = (uintptr_t)p;
	for (int i = 0; i < FAULT_SLOTS; i++) {
		uintptr_t lo = __atomic_load_n(&guarded[i].lo, __ATOMIC_ACQUIRE);
		if (lo && a >= lo && a < __atomic_load_n(&guarded[i].hi, __ATOMIC_ACQUIRE))
			return __atomic_load_n(&guarded[i].dead, __ATOMIC_ACQUIRE);
	}
	return 0;
}

int shunt_fault_sigaction(const struct sigaction *act, struct sigaction *old)
{
	pthread_mutex_lock(&install_mu);
	if (!installed) {
		pthread_mutex_unlock(&install_mu);
		return -1; /* not ours: the caller makes the real call */
	}
	if (old)
		*old = chained;
	if (act)
		chained = *act;
	pthread_mutex_unlock(&install_mu);
	return 0;
}
