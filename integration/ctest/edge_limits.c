/* edge_limits.c: a process that cannot start threads, or whose control
 * session is gone for good, keeps working on TCP and says so once (issue
 * 21: HAProxy as packaged, with a process limit of 0 and a chroot, logged
 * "cannot start the leaver thread" once per connection, 29,419 times).
 *
 *   edge client IP PORT nproc        listen (the session starts), drop to
 *                                    uid 65534 with RLIMIT_NPROC 0, then
 *                                    CONNS connections, each echoed
 *   edge client IP PORT lostsession  listen, chroot to $SHUNT_EDGE_CHROOT,
 *                                    print "ready", wait for a line on
 *                                    stdin (the test restarts hostd
 *                                    meanwhile: no way back), then CONNS
 *                                    connections, each echoed
 * (against "edge server": echo) */
#include "edge.h"

#include <grp.h>
#include <sys/resource.h>

#define CONNS 20

static void *nothing(void *arg) { return arg; }

static int listen_any(const char *t)
{
	int l = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = {.sin_family = AF_INET};
	if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 4))
		return fail(t, "listen"), -1;
	return l;
}

static int conns(const char *ip, int port, const char *t)
{
	settle_ms = 20;
	for (int i = 0; i < CONNS; i++) {
		alarm(10);
		int fd = dial(ip, port, 0);
		char name[40];
		int n = snprintf(name, sizeof name, "%s\n", t);
		if (fd < 0 || write(fd, name, n) != n || !echo_ok(fd, "still works"))
			return printf("FAIL %s: connection %d of %d: errno %d %s\n", t, i + 1, CONNS, errno, strerror(errno)), 1;
		close(fd);
	}
	alarm(0);
	printf("PASS %s (%d connections)\n", t, CONNS);
	return 0;
}

int limits_client(const char *ip, int port, const char *t)
{
	int l = listen_any(t);
	if (l < 0)
		return 1;
	if (!strcmp(t, "nproc")) {
		struct rlimit none = {0, 0};
		if (setgroups(0, NULL) || setgid(65534) || setuid(65534) || setrlimit(RLIMIT_NPROC, &none))
			return fail(t, "drop to uid 65534 with RLIMIT_NPROC 0");
		pthread_t th;
		if (pthread_create(&th, NULL, nothing, NULL) == 0)
			return fail(t, "a thread started under RLIMIT_NPROC 0");
		return conns(ip, port, t);
	}
	const char *dir = getenv("SHUNT_EDGE_CHROOT");
	if (!dir || chroot(dir) || chdir("/"))
		return fail(t, "chroot to $SHUNT_EDGE_CHROOT");
	printf("ready\n");
	fflush(stdout);
	char line[16];
	if (!fgets(line, sizeof line, stdin))
		return fail(t, "the test's go-ahead");
	return conns(ip, port, t);
}
