/* edge_vfork.c: a server hands each connection to a child that shares its
 * memory (issue 21): vfork(), as CPython's subprocess does, or
 * clone(CLONE_VM | CLONE_VFORK), as glibc's posix_spawn does inside. The
 * child dup2s the connection onto its fds 0 and 1 and execs /bin/cat;
 * the parent keeps its own copy for KEEP_MS (0: closes it at once). The
 * child's dup2 once marked the parent's stdio as connections, and the
 * parent then failed on its own stdout (ENOTSOCK); with a copy kept past
 * the open delay, the peer's bytes went to a ring only the parent read.
 *
 *   edge vforkserver IP PORT vfork|clonevm KEEP_MS
 *       after each connection: "PASS vforkserver-parent" if its own
 *       stdout (a pipe) still takes a write(2), else FAIL
 *   edge client IP PORT bulk4m
 *       4 MiB through the connection, each byte checked, back through cat */
#include "edge.h"

#include <sched.h>
#include <sys/stat.h>

#define BULK (4 << 20)

struct child {
	int c;
};

static int child_main(void *arg)
{
	int c = ((struct child *)arg)->c;
	if (dup2(c, 0) != 0 || dup2(c, 1) != 1)
		_exit(126);
	close(c);
	execl("/bin/cat", "cat", (char *)NULL);
	_exit(127);
}

int vfork_server(const char *ip, int port, const char *how, int keep_ms)
{
	signal(SIGPIPE, SIG_IGN);
	int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	inet_pton(AF_INET, ip, &a.sin_addr);
	if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 16))
		return perror("listen"), 1;
	static char stack[256 << 10];
	for (;;) {
		int c = accept(l, NULL, NULL);
		if (c < 0)
			continue;
		struct child ch = {.c = c};
		pid_t pid;
		if (!strcmp(how, "vfork")) {
			pid = vfork();
			if (pid == 0)
				child_main(&ch);
		} else {
			pid = clone(child_main, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &ch);
		}
		if (pid < 0) {
			perror("spawn");
			close(c);
			continue;
		}
		if (keep_ms)
			usleep(keep_ms * 1000);
		close(c);
		int st;
		waitpid(pid, &st, 0);
		/* The parent's own stdout: a pipe, never a connection. */
		struct stat sb;
		char line[160];
		int n = snprintf(line, sizeof line, "PASS vforkserver-parent (%s, kept %d ms; cat exit %d)\n", how, keep_ms,
				 WIFEXITED(st) ? WEXITSTATUS(st) : -1);
		if (fstat(1, &sb) || S_ISSOCK(sb.st_mode) || write(1, line, n) != n) {
			n = snprintf(line, sizeof line, "FAIL vforkserver-parent: its stdout: errno %d %s\n", errno, strerror(errno));
			ssize_t r = write(2, line, n);
			(void)r;
		}
	}
}

static void *bulk_writer(void *arg)
{
	int fd = (int)(intptr_t)arg;
	static char buf[65536];
	long sent = 0;
	while (sent < BULK) {
		for (int i = 0; i < (int)sizeof buf; i++)
			buf[i] = (char)((sent + i) * 7 + ((sent + i) >> 16));
		int k = write(fd, buf, sizeof buf);
		if (k <= 0)
			return (void *)1;
		sent += k; /* a short write: the next buffer starts where it ended */
	}
	shutdown(fd, SHUT_WR);
	return NULL;
}

int bulk_client(const char *ip, int port, const char *t)
{
	alarm(30);
	int fd = dial(ip, port, 0);
	if (fd < 0)
		return fail(t, "connect");
	pthread_t th;
	pthread_create(&th, NULL, bulk_writer, (void *)(intptr_t)fd);
	static char buf[65536];
	long got = 0;
	for (;;) {
		int k = read(fd, buf, sizeof buf);
		if (k < 0)
			return printf("FAIL %s: read after %ld of %d bytes: %s\n", t, got, BULK, strerror(errno)), 1;
		if (k == 0)
			break;
		for (int i = 0; i < k; i++)
			if (buf[i] != (char)((got + i) * 7 + ((got + i) >> 16)))
				return printf("FAIL %s: byte %ld differs\n", t, got + i), 1;
		got += k;
	}
	void *res;
	pthread_join(th, &res);
	if (res || got != BULK)
		return printf("FAIL %s: %ld of %d bytes came back%s\n", t, got, BULK, res ? " (a write failed)" : ""), 1;
	close(fd);
	printf("PASS %s (%ld bytes)\n", t, got);
	return 0;
}
