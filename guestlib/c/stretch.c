/* vsock stretches (docs/vsock.md, "The C library's stretches"): in a VM
 * without a Shunt ivshmem device, a flow whose pair region the process
 * cannot map goes over vsock. The C library does not carry the stream
 * itself: shunt-vstretchd (cmd/shunt-vstretchd, Go) owns each flow's
 * AF_VSOCK stream and its relay bridge, and hands this process the flow's
 * ring pair as a memfd, which is mapped here and read and written as a
 * region's rings. One SOCK_SEQPACKET connection to the daemon per
 * stretch (guestlib/vstretch/wire.go): OPEN (the READY's flow), DRAIN
 * (close: did the last bytes and LEFT cross?), STOP (RESUME: where did
 * the read ring end?), BYE (the flow is freed). A process that dies, or
 * execs, without BYE ends its connection otherwise, which the daemon
 * takes for a break (the other end reads a reset). Every wait on the
 * daemon is bounded; whatever it sends is checked as a region's header
 * is. */
#include "internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/un.h>

#define SV_REQ   64
#define SV_REPLY 192
#define SV_TEXT  64
enum { SV_OPEN = 1, SV_DRAIN = 2, SV_STOP = 3, SV_BYE = 4 };

/* Bounds: an OPEN is a vsock connect and a Hello (the host answers at
 * once); a DRAIN waits up to the daemon's 10 s (vstretch.StretchDrain),
 * plus slack; a STOP stops a bridge. */
#define SV_OPEN_MS  10000
#define SV_DRAIN_MS 12000
#define SV_STOP_MS  10000

struct shunt_stretch {
	int fd;       /* the daemon connection (close-on-exec) */
	uint8_t *mem; /* the ring pair: W at 0, R at span */
	size_t size;
};

int shunt_stretch_enabled(void)
{
	const char *v = getenv("SHUNT_VSOCK");
	return v && strcmp(v, "1") == 0;
}

static const char *daemon_path(void)
{
	const char *p = getenv("SHUNT_VSTRETCHD");
	return p && *p ? p : "/run/shunt/vstretchd.sock";
}

static void put32(uint8_t *b, uint32_t v) { memcpy(b, &v, 4); }
static void put64(uint8_t *b, uint64_t v) { memcpy(b, &v, 8); }
static uint64_t get64(const uint8_t *b)
{
	uint64_t v;
	memcpy(&v, b, 8);
	return v;
}

/* ask sends request op and reads its reply within ms, with the fd that
 * comes along in *fdp (if fdp): 0, or -1 with why in err. */
static int ask(int fd, uint8_t op, uint8_t reason, const struct shunt_msg *v, uint8_t *rep, int *fdp, int ms, char *err,
	       size_t errn)
{
	uint8_t req[SV_REQ] = {'S', 'V', 'S', 'D', op, reason};
	if (v) {
		put32(req + 8, v->region_id);
		put32(req + 12, v->slot);
		put64(req + 16, v->gen);
		put32(req + 24, (uint32_t)v->capacity);
	}
	if (sys_send(fd, req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req) {
		snprintf(err, errn, "send to shunt-vstretchd: %s", strerror(errno));
		return -1;
	}
	if (op == SV_BYE)
		return 0;
	int64_t end = shunt_now_ns() + (int64_t)ms * 1000000;
	for (;;) {
		int left = (int)((end - shunt_now_ns()) / 1000000);
		if (left <= 0) {
			snprintf(err, errn, "shunt-vstretchd did not answer within %d ms", ms);
			return -1;
		}
		int r = sys_poll1(fd, POLLIN, left);
		if (r < 0 && errno != EINTR) {
			snprintf(err, errn, "poll shunt-vstretchd: %s", strerror(errno));
			return -1;
		}
		if (r > 0)
			break;
	}
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int))];
	} cm;
	struct iovec io = {rep, SV_REPLY};
	struct msghdr mh = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof cm.b};
	ssize_t n = sys_recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
	int got = -1;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
			memcpy(&got, CMSG_DATA(c), sizeof got);
	if (fdp)
		*fdp = got;
	else if (got >= 0)
		sys_close(got);
	if (n != SV_REPLY || memcmp(rep, "SVSD", 4) != 0 || rep[4] != op || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
		snprintf(err, errn, "shunt-vstretchd: %s", n < 0 ? strerror(errno) : n == 0 ? "closed" : "a reply that is not one");
		if (fdp && got >= 0)
			sys_close(got), *fdp = -1;
		return -1;
	}
	rep[SV_REPLY - 1] = 0;
	if (rep[5]) {
		snprintf(err, errn, "shunt-vstretchd: %s", (char *)rep + SV_TEXT);
		if (fdp && got >= 0)
			sys_close(got), *fdp = -1;
		return -1;
	}
	return 0;
}

/* open_daemon connects to the daemon: the fd, or -1 with why in err. */
static int open_daemon(char *err, size_t errn)
{
	const char *path = daemon_path();
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof a.sun_path) {
		snprintf(err, errn, "SHUNT_VSTRETCHD %s: path too long", path);
		return -1;
	}
	strcpy(a.sun_path, path);
	int fd = sys_socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		snprintf(err, errn, "socket: %s", strerror(errno));
		return -1;
	}
	if (sys_connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
		snprintf(err, errn, "no shunt-vstretchd at %s (%s): start it in the VM, or set SHUNT_VSTRETCHD", path, strerror(errno));
		sys_close(fd);
		return -1;
	}
	return fd;
}

int shunt_stretch_attach(struct shunt_session *s, const struct shunt_msg *v, struct shunt_flow *f)
{
	char err[200];
	uint8_t rep[SV_REPLY] = {0};
	int mfd = -1;
	struct shunt_stretch *st = NULL;
	uint8_t *mem = MAP_FAILED;
	uint64_t cap = v->capacity, span = (SHUNT_RING_HEADER + cap + 4095) & ~(uint64_t)4095;
	struct stat sb;
	memset(f, 0, sizeof *f);
	if ((v->side != 1 && v->side != 2) || cap == 0 || (cap & (cap - 1)) || cap > (1u << 30)) {
		shunt_logf(s, "shunt: READY %u/%u.%llu: ring capacity %llu: not a stretch's; stays on TCP", v->region_id, v->slot,
			   (unsigned long long)v->gen, (unsigned long long)cap);
		return SHUNT_ECORRUPT;
	}
	int fd = open_daemon(err, sizeof err);
	if (fd < 0)
		goto fail;
	if (ask(fd, SV_OPEN, 0, v, rep, &mfd, SV_OPEN_MS, err, sizeof err))
		goto fail;
	/* Checked as a region is: the memfd must hold the two rings the READY
	 * names, laid out as the protocol says. */
	if (mfd < 0 || get64(rep + 8) != span || get64(rep + 24) != 2 * span || fstat(mfd, &sb) < 0 ||
	    (uint64_t)sb.st_size != 2 * span) {
		snprintf(err, sizeof err, "shunt-vstretchd's rings do not match the READY (span %llu, size %llu, fd %d)",
			 (unsigned long long)get64(rep + 8), (unsigned long long)get64(rep + 24), mfd);
		goto fail;
	}
	mem = shunt_mem_map(mfd, 2 * span);
	sys_close(mfd);
	mfd = -1;
	if (mem == MAP_FAILED || !(st = calloc(1, sizeof *st))) {
		snprintf(err, sizeof err, "map the stretch's rings: %s", strerror(errno));
		goto fail;
	}
	uint8_t *out = mem, *in = mem + span;
	if (shunt_ring_writer(&f->w, out, SHUNT_RING_HEADER + cap, cap) || shunt_ring_reader(&f->r, in, SHUNT_RING_HEADER + cap, cap)) {
		snprintf(err, sizeof err, "the stretch's rings are not rings of %llu bytes", (unsigned long long)cap);
		goto fail;
	}
	/* The daemon's bridge is the peer: a futex reaches it (not a kick). */
	f->w.local = f->r.local = 1;
	st->fd = fd;
	st->mem = mem;
	st->size = 2 * span;
	f->stretch = st;
	f->region_id = v->region_id;
	f->slot = v->slot;
	f->gen = v->gen;
	f->side = v->side;
	f->req = v->req_id;
	f->session = s;
	f->w.owner = f->r.owner = f;
	shunt_logf(s, "shunt: rings %u/%u.%llu over vsock (shunt-vstretchd)", v->region_id, v->slot, (unsigned long long)v->gen);
	return 0;
fail:
	shunt_logf(s, "shunt: READY %u/%u.%llu: no region, and no vsock stretch: %s; stays on TCP", v->region_id, v->slot,
		   (unsigned long long)v->gen, err);
	if (mfd >= 0)
		sys_close(mfd);
	if (mem != MAP_FAILED)
		shunt_mem_let_go(mem, 2 * span);
	free(st);
	if (fd >= 0)
		sys_close(fd);
	memset(f, 0, sizeof *f);
	return SHUNT_ECORRUPT;
}

int shunt_flow_stretch(const struct shunt_flow *f) { return f->stretch != NULL; }

int shunt_flow_drain(struct shunt_flow *f)
{
	struct shunt_stretch *st = f->stretch;
	if (!st)
		return 0;
	char err[200];
	uint8_t rep[SV_REPLY] = {0};
	if (ask(st->fd, SV_DRAIN, 0, NULL, rep, NULL, SV_DRAIN_MS, err, sizeof err)) {
		shunt_logf(f->session, "shunt: stretch %u/%u: drain: %s", f->region_id, f->slot, err);
		return -1;
	}
	shunt_logf(f->session, "shunt: stretch %u/%u: %s the write ring's last bytes (%s)", f->region_id, f->slot,
		   rep[6] ? "the host took" : "the host did not take all of", (char *)rep + SV_TEXT);
	return rep[6] ? 0 : -1;
}

int shunt_flow_stretch_end(struct shunt_flow *f, unsigned reason)
{
	struct shunt_stretch *st = f->stretch;
	if (!st)
		return 0;
	char err[200];
	uint8_t rep[SV_REPLY] = {0};
	uint64_t off = SHUNT_RESUME_ALL;
	if (ask(st->fd, SV_STOP, (uint8_t)reason, NULL, rep, NULL, SV_STOP_MS, err, sizeof err)) {
		shunt_logf(f->session, "shunt: stretch %u/%u: stop: %s; ENDED says all", f->region_id, f->slot, err);
		rep[SV_TEXT] = 0;
	} else if (rep[6]) {
		off = get64(rep + 16);
	}
	shunt_logf(f->session, "shunt: stretch %u/%u.%llu stopped (%s): read ring ended at %llu (%s)", f->region_id, f->slot,
		   (unsigned long long)f->gen, shunt_reason_name(reason), (unsigned long long)off, (char *)rep + SV_TEXT);
	struct shunt_msg m = {.type = SHUNT_ENDED, .req_id = f->req, .region_id = f->region_id, .slot = f->slot, .gen = f->gen,
			      .side = f->side, .offset = off};
	shunt_session_send(f->session, &m);
	return 1;
}

void shunt_stretch_detach(struct shunt_flow *f)
{
	struct shunt_stretch *st = f->stretch;
	if (!st)
		return;
	f->stretch = NULL;
	char err[200];
	ask(st->fd, SV_BYE, 0, NULL, NULL, NULL, 0, err, sizeof err);
	sys_close(st->fd);
	shunt_mem_let_go(st->mem, st->size); /* anonymous pages, the range kept: no reader faults on it */
	free(st);
}
