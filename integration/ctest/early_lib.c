/* early_lib: a shared library whose constructor uses sockets' I/O calls
 * before any preload library's own constructor may have run, as OpenSSH's
 * sshd does through libcap-ng (read at load time). Under shunt-run these
 * calls go through the preload library's wrappers, which must work then. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <unistd.h>

int early_ok;

__attribute__((constructor)) static void early(void)
{
	int p[2];
	char c = 0;
	if (pipe(p) < 0)
		return;
	if (write(p[1], "e", 1) == 1 && read(p[0], &c, 1) == 1 && c == 'e' &&
	    fcntl(p[0], F_GETFL) >= 0)
		early_ok = 1;
	close(p[0]);
	close(p[1]);
}
