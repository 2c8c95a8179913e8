/* shunt-xtest fault: the core's SIGBUS handling (fault.c), without root or
 * hostd (guestlib/preload/fault_test.go runs it). A ring in a memfd that
 * is truncated under it (what a hostile peer, or hostd taking the memory
 * back, does): the next write and read fail with SHUNT_ERESET and the
 * process lives. A SIGBUS outside any region still reaches the handler
 * the program installed (through shunt_fault_sigaction, as the preload
 * library's sigaction does). Exit 0 if all holds, else 1 and why. */
#define _GNU_SOURCE
#include "shunt.h"

#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

void shunt_fault_guard(void *mem, size_t size); /* internal.h */

static sigjmp_buf jb;
static volatile sig_atomic_t app_handler_ran;

static void app_handler(int sig, siginfo_t *si, void *uc)
{
	(void)sig, (void)si, (void)uc;
	app_handler_ran = 1;
	siglongjmp(jb, 1);
}

static uint8_t *memfd_map(size_t size, int *fd)
{
	*fd = memfd_create("xtest-fault", MFD_CLOEXEC);
	if (*fd < 0 || ftruncate(*fd, size) < 0)
		return NULL;
	void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
	return m == MAP_FAILED ? NULL : m;
}

int fault_test(void)
{
	const size_t size = 1 << 20, cap = 64 << 10;
	int fd;
	uint8_t *mem = memfd_map(size, &fd);
	if (!mem)
		return perror("memfd"), 1;
	shunt_fault_guard(mem, size);
	/* A ring header as hostd formats it: magic and capacity. */
	memcpy(mem, "SHRG", 4);
	*(uint64_t *)(mem + 8) = cap;
	struct shunt_ring w, r;
	if (shunt_ring_writer(&w, mem, SHUNT_RING_HEADER + cap, cap) || shunt_ring_reader(&r, mem, SHUNT_RING_HEADER + cap, cap))
		return fprintf(stderr, "attach failed\n"), 1;
	char buf[100] = "before";
	if (shunt_ring_write(&w, buf, sizeof buf) != sizeof buf)
		return fprintf(stderr, "write before truncation failed\n"), 1;
	if (ftruncate(fd, 0) < 0)
		return perror("ftruncate"), 1;
	ssize_t n = shunt_ring_write(&w, buf, sizeof buf);
	if (n != SHUNT_ERESET)
		return fprintf(stderr, "write after truncation: %zd, want SHUNT_ERESET\n", n), 1;
	if ((n = shunt_ring_read(&r, buf, sizeof buf)) != SHUNT_ERESET)
		return fprintf(stderr, "read after truncation: %zd, want SHUNT_ERESET\n", n), 1;
	if (!shunt_ring_ready(&r, 1))
		return fprintf(stderr, "a waiter on a dead ring would sleep\n"), 1;

	/* The program's own handler, set after the core's, for a fault that
	 * is not in a region. */
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = app_handler;
	sa.sa_flags = SA_SIGINFO;
	if (shunt_fault_sigaction(&sa, NULL))
		return fprintf(stderr, "the core has no SIGBUS handler installed\n"), 1;
	int fd2;
	volatile uint8_t *other = memfd_map(1 << 16, &fd2);
	if (!other || ftruncate(fd2, 0) < 0)
		return perror("memfd"), 1;
	if (!sigsetjmp(jb, 1))
		(void)other[100];
	if (!app_handler_ran)
		return fprintf(stderr, "a fault outside any region did not reach the program's handler\n"), 1;
	printf("fault ok\n");
	return 0;
}
