/* client: the unmodified program of the package test (deb_test.go), run
 * under the installed shunt-run. It connects to IP PORT, writes "ping",
 * reads "pong" and says so, then reads until the connection ends (the test
 * revokes the flow) and prints how: "closed: errno N" or "closed: eof".
 * Sockets are used through read and write only: glibc's stdio on a socket
 * would bypass the library (docs/preload.md); stdout is a pipe. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: client IP PORT\n");
		return 2;
	}
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
	if (inet_pton(AF_INET, argv[1], &a.sin_addr) != 1) {
		fprintf(stderr, "client: bad address %s\n", argv[1]);
		return 2;
	}
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
		perror("client: connect");
		return 1;
	}
	if (write(fd, "ping\n", 5) != 5) {
		perror("client: write");
		return 1;
	}
	char buf[64];
	size_t got = 0;
	while (got < 5) {
		ssize_t n = read(fd, buf + got, 5 - got);
		if (n <= 0) {
			perror("client: read");
			return 1;
		}
		got += (size_t)n;
	}
	if (memcmp(buf, "pong\n", 5) != 0) {
		fprintf(stderr, "client: read %.5s, want pong\n", buf);
		return 1;
	}
	printf("got pong\n");
	fflush(stdout);
	ssize_t n = read(fd, buf, sizeof buf);
	if (n < 0)
		printf("closed: errno %d\n", errno);
	else if (n == 0)
		printf("closed: eof\n");
	else
		printf("closed: %zd more bytes\n", n);
	return 0;
}
