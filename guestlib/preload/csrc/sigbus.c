/* sigaction and signal for SIGBUS. The core handles SIGBUS on the memory
 * of a region whose file was truncated (guestlib/c/fault.c) and chains
 * every other fault to the program's handler. A program that sets its own
 * SIGBUS handler once the core's is in place would replace it, and then
 * die of the next region fault: its handler is recorded as the one to
 * chain to instead (shunt_fault_sigaction), and the core's stays. Before
 * the core installed its handler, and for every other signal, these are
 * the real calls. */
#define _GNU_SOURCE
#include "preload.h"

#include <dlfcn.h>
#include <signal.h>
#include <string.h>

typedef int sigaction_fn(int, const struct sigaction *, struct sigaction *);

static sigaction_fn *next_sigaction(void)
{
	static sigaction_fn *real;
	sigaction_fn *f = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
	if (!f) {
		f = (sigaction_fn *)dlsym(RTLD_NEXT, "sigaction");
		__atomic_store_n(&real, f, __ATOMIC_RELEASE);
	}
	return f;
}

INTERPOSE int sigaction(int sig, const struct sigaction *act, struct sigaction *old)
{
	if (sig == SIGBUS && shunt_fault_sigaction(act, old) == 0)
		return 0;
	return next_sigaction()(sig, act, old);
}

INTERPOSE sighandler_t signal(int sig, sighandler_t h)
{
	if (sig != SIGBUS) {
		static sighandler_t (*real)(int, sighandler_t);
		if (!__atomic_load_n(&real, __ATOMIC_ACQUIRE))
			__atomic_store_n(&real, (sighandler_t(*)(int, sighandler_t))dlsym(RTLD_NEXT, "signal"), __ATOMIC_RELEASE);
		return real(sig, h);
	}
	struct sigaction sa, old;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = h;
	sa.sa_flags = SA_RESTART;
	sigemptyset(&sa.sa_mask);
	sigaddset(&sa.sa_mask, sig);
	if (sigaction(sig, &sa, &old) != 0)
		return SIG_ERR;
	return old.sa_flags & SA_SIGINFO ? (sighandler_t)(void *)old.sa_sigaction : old.sa_handler;
}
