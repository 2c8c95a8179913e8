/* edge_raw.c: system calls that change an fd's identity past libc's
 * wrappers (issue 21). libuv (Node.js) closes sockets with
 * syscall(SYS_close): the library must see it, or the next connection
 * that gets the fd number is taken for the old one (it answered nothing).
 *
 *   edge client IP PORT rawclose   (against "edge server": echo)
 *
 * Each step makes a connection (on the rings by the time it is used),
 * echoes through it, ends it with one raw call, and checks the fd number's
 * next user: syscall(SYS_close), close_range(fd, fd, 0),
 * syscall(SYS_close_range), and syscall(SYS_dup2) of /dev/null onto a
 * connection whose ring holds an unread byte (a read must then be
 * /dev/null's EOF, not the ring's byte). */
#include "edge.h"

#include <linux/close_range.h>
#include <sys/syscall.h>

static void on_alarm(int sig)
{
	(void)sig;
	static const char m[] = "FAIL rawclose: a new connection's server did not answer within 5 s\n";
	ssize_t r = write(1, m, sizeof m - 1);
	(void)r;
	_exit(1);
}

/* conn connects and reads the server's number for the connection (each
 * connection gets a new one): -1 if it does not come within 5 s (the
 * library sent the name into an older connection). */
static int conn(const char *ip, int port, const char *t, int *id)
{
	int fd = dial(ip, port, 0);
	if (fd < 0)
		return -1;
	char line[40];
	int n = snprintf(line, sizeof line, "%s\n", t);
	if (write(fd, line, n) != n)
		return -1;
	alarm(5);
	n = full(fd, line, 8);
	alarm(0);
	line[n > 0 ? n : 0] = 0;
	*id = n == 8 ? atoi(line) : -1;
	return fd;
}

/* echo_within: echo_ok with a deadline: a connection the library mistook
 * for an older one hangs, and the test must fail instead. */
static int echo_within(int fd, const char *msg)
{
	alarm(5);
	int ok = echo_ok(fd, msg);
	alarm(0);
	return ok;
}

int raw_fd_calls(const char *ip, int port, const char *t)
{
	signal(SIGALRM, on_alarm);
	setvbuf(stdout, NULL, _IONBF, 0);
	const char *how[] = {"syscall(SYS_close)", "close_range", "syscall(SYS_close_range)"};
	int prev = -1, id, last_id = 0;
	for (int step = 0; step < 3; step++) {
		int fd = conn(ip, port, t, &id);
		if (fd < 0)
			return fail(t, "connect");
		if (prev >= 0 && fd != prev)
			printf("note %s: the new connection got fd %d, not %d\n", t, fd, prev);
		if (id <= last_id)
			return printf("FAIL %s: fd %d (after %s): the server's number %d, want a new one after %d\n", t, fd,
				      step ? how[step - 1] : "nothing", id, last_id), 1;
		last_id = id;
		if (!echo_within(fd, step ? "after a raw close" : "first"))
			return printf("FAIL %s: echo on fd %d (after %s)\n", t, fd, step ? how[step - 1] : "nothing"), 1;
		int r = step == 0 ? (int)syscall(SYS_close, fd)
			: step == 1 ? close_range(fd, fd, 0)
				    : (int)syscall(SYS_close_range, fd, fd, 0);
		if (r)
			return fail(t, how[step]);
		prev = fd;
	}
	int fd = conn(ip, port, t, &id);
	if (fd < 0 || id <= last_id || !echo_within(fd, "after close_range"))
		return fail(t, "echo after syscall(SYS_close_range)");
	/* A byte waits in the ring; then /dev/null takes the fd number. */
	if (write(fd, "q", 1) != 1)
		return fail(t, "write");
	usleep(100000);
	int null = open("/dev/null", O_RDWR);
	if (null < 0 || syscall(SYS_dup2, null, fd) != fd)
		return fail(t, "syscall(SYS_dup2)");
	alarm(5);
	char b[4];
	int n = read(fd, b, sizeof b);
	alarm(0);
	if (n != 0)
		return printf("FAIL %s: a read of /dev/null dup2'd (raw) onto a connection's fd returned %d, want 0 (EOF)\n", t, n), 1;
	close(fd);
	close(null);
	last_id = id;
	fd = conn(ip, port, t, &id);
	if (fd < 0 || id <= last_id || !echo_within(fd, "after a raw dup2"))
		return fail(t, "echo after syscall(SYS_dup2)");
	close(fd);
	printf("PASS %s\n", t);
	return 0;
}
