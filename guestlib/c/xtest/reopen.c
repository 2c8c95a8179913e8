/* shunt-xtest reopen CONTROL: a program thread's send and ensure while the
 * session's reader reopens the channel (guestlib/preload/reopen_test.go).
 *
 * Opens the session (the test's fake hostd answers WELCOME) and says
 * "open". The test then closes that channel; the reader reopens it, and
 * the fake accepts and says nothing. At each "go" line on stdin, the main
 * thread calls shunt_session_ensure and sends a CLOSE, and says what they
 * returned: "ensure R send R". Once reconnected (the announce callback)
 * it says "announced". It ends at EOF on stdin. Lines on stdout, the
 * core's log on stderr.
 *
 * shunt-xtest together CONTROL: two threads that need the channel at
 * once, as a program's threads that connect at its start. Thread a
 * opens it (the fake holds WELCOME back); at "go" on stdin the main
 * thread says "b calls ensure" and calls it during a's open. Each says
 * "a ensure R" and "b ensure R".
 *
 * shunt-xtest forkopen CONTROL: a fork during another thread's open.
 * Thread a opens; at "go" the main thread says "forking" and forks; the
 * child says "child sockets N" (its socket descriptors: 0 unless the
 * half-open channel came along) and exits. */
#define _GNU_SOURCE
#include "shunt.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <pthread.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

int reopen_test(const char *control);
int together_test(const char *control);
int forkopen_test(const char *control);

static void logline(void *arg, const char *line)
{
	(void)arg;
	fprintf(stderr, "%s\n", line);
}

/* holds: the program holds something, so the reader reopens at once. */
static int holds(void *arg)
{
	(void)arg;
	return 1;
}

static void announce(void *arg, struct shunt_session *s)
{
	(void)arg;
	(void)s;
	printf("announced\n");
	fflush(stdout);
}

int reopen_test(const char *control)
{
	struct shunt_session_config c = {.control = control, .log = logline, .holds = holds, .announce = announce};
	struct shunt_session *s = shunt_session_new(&c);
	if (!s || shunt_session_ensure(s))
		return perror("session"), 1;
	printf("open\n");
	fflush(stdout);
	char line[64];
	while (fgets(line, sizeof line, stdin)) {
		if (strcmp(line, "go\n"))
			continue;
		int e = shunt_session_ensure(s);
		int en = e ? errno : 0;
		struct shunt_msg m = {.type = SHUNT_CLOSE, .req_id = 1, .slot = 0, .gen = 1, .side = 1};
		int r = shunt_session_send(s, &m);
		printf("ensure %d (%s) send %d\n", e, en ? strerror(en) : "ok", r);
		fflush(stdout);
	}
	return 0;
}

static void *opener(void *arg)
{
	int e = shunt_session_ensure(arg);
	printf("a ensure %d (%s)\n", e, e ? strerror(errno) : "ok");
	fflush(stdout);
	return NULL;
}

/* open_in_thread makes the session and has thread a open it (the test's
 * fake then holds WELCOME back), and waits for "go" on stdin. */
static struct shunt_session *open_in_thread(const char *control, pthread_t *a)
{
	struct shunt_session_config c = {.control = control, .log = logline, .open_wait_ms = 60000};
	struct shunt_session *s = shunt_session_new(&c);
	if (!s || pthread_create(a, NULL, opener, s))
		return NULL;
	char line[64];
	while (fgets(line, sizeof line, stdin) && strcmp(line, "go\n"))
		;
	return s;
}

int together_test(const char *control)
{
	pthread_t a;
	struct shunt_session *s = open_in_thread(control, &a);
	if (!s)
		return perror("session"), 1;
	printf("b calls ensure\n");
	fflush(stdout);
	int e = shunt_session_ensure(s);
	printf("b ensure %d (%s)\n", e, e ? strerror(errno) : "ok");
	fflush(stdout);
	pthread_join(a, NULL);
	return 0;
}

/* sockets counts this process's socket descriptors above stderr. */
static int sockets(void)
{
	int n = 0;
	struct stat st;
	for (int fd = 3; fd < 1024; fd++)
		if (fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode))
			n++;
	return n;
}

int forkopen_test(const char *control)
{
	pthread_t a;
	struct shunt_session *s = open_in_thread(control, &a);
	if (!s)
		return perror("session"), 1;
	printf("forking\n");
	fflush(stdout);
	pid_t c = fork();
	if (c == 0) {
		printf("child sockets %d\n", sockets());
		fflush(stdout);
		_exit(0);
	}
	int st;
	if (c < 0 || waitpid(c, &st, 0) != c)
		return perror("fork"), 1;
	pthread_join(a, NULL);
	return 0;
}
