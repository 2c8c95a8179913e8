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
 * once, as a program's threads that connect at its start. Thread A
 * opens it (the fake waits before WELCOME); at "go" on stdin the main
 * thread says "b waits" and calls ensure during A's open. Each says
 * "a ensure R" and "b ensure R". */
#define _GNU_SOURCE
#include "shunt.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <pthread.h>

int reopen_test(const char *control);
int together_test(const char *control);

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

int together_test(const char *control)
{
	struct shunt_session_config c = {.control = control, .log = logline};
	struct shunt_session *s = shunt_session_new(&c);
	pthread_t a;
	if (!s || pthread_create(&a, NULL, opener, s))
		return perror("session"), 1;
	char line[64];
	while (fgets(line, sizeof line, stdin) && strcmp(line, "go\n"))
		;
	printf("b waits\n");
	fflush(stdout);
	int e = shunt_session_ensure(s);
	printf("b ensure %d (%s)\n", e, e ? strerror(errno) : "ok");
	fflush(stdout);
	pthread_join(a, NULL);
	return 0;
}
