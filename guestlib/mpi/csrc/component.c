/* The btl/shunt component (btl_shunt.h): parameters, init (the lease
 * listener and the address published through the modex), progress,
 * finalize, and the lines it writes to the job's output. */
#include "btl_shunt.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "opal/runtime/opal_progress.h"
#include "opal/util/proc.h"

#define LINE_MAX_ 512

int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* say writes one line to stderr (the job's output) if level is at most
 * btl_shunt_verbose: 0 fallbacks and errors, 1 every path change, 2 debug. */
void say(int level, const char *fmt, ...)
{
	if (level > mca_btl_shunt_component.verbose)
		return;
	char buf[LINE_MAX_];
	opal_proc_t *me = opal_proc_local_get();
	int n = snprintf(buf, sizeof buf, "btl/shunt: rank %u: ", me ? me->proc_name.vpid : 0);
	va_list ap;
	va_start(ap, fmt);
	n += vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof buf - 2)
		n = sizeof buf - 2;
	buf[n++] = '\n';
	ssize_t w = write(2, buf, n); /* one write: lines of ranks do not interleave */
	(void)w;
}

/* ---- parameters ---- */

static int reg(const char *name, const char *help, mca_base_var_type_t type, void *v, int level)
{
	return mca_base_component_var_register(&mca_btl_shunt_component.super.btl_version, name, help, type, NULL, 0,
					       MCA_BASE_VAR_FLAG_SETTABLE, level, MCA_BASE_VAR_SCOPE_LOCAL, v);
}

static int reg_int(const char *name, const char *help, int *v, int level)
{
	return reg(name, help, MCA_BASE_VAR_TYPE_INT, v, level);
}

static int reg_string(const char *name, const char *help, char **v, int level)
{
	return reg(name, help, MCA_BASE_VAR_TYPE_STRING, v, level);
}

static int shunt_register(void)
{
	struct shunt_btl_component *c = &mca_btl_shunt_component;
	mca_base_var_group_component_register(&c->super.btl_version, "Shunt: shared-memory rings between guests, set up over kernel TCP");
	c->verbose = 0;
	reg_int("verbose", "0: say fallbacks and errors; 1: every path change (lease, ring); 2: debug", &c->verbose, OPAL_INFO_LVL_4);
	c->if_include = NULL;
	reg_string("if_include", "CIDR of the address to listen on and publish (default: the first non-loopback IPv4 address)",
		   &c->if_include, OPAL_INFO_LVL_4);
	c->port_min = 0;
	reg_int("port_min", "lowest port of the lease listener (0: any); several ranks per guest take the next free", &c->port_min,
		OPAL_INFO_LVL_4);
	c->port_max = 0;
	reg_int("port_max", "highest port of the lease listener (0: port_min + 255)", &c->port_max, OPAL_INFO_LVL_4);
	c->control = NULL;
	reg_string("control", "hostd's control socket (default: $SHUNT_CONTROL, else /run/shunt/guest.sock; in a VM the virtio-serial port is found, or without one vsock; \"vsock\": over vsock)",
		   &c->control, OPAL_INFO_LVL_4);
	c->connect_ms = 2000;
	reg_int("connect_timeout_ms", "how long a lease connect may take before the peer is left to the next BTL", &c->connect_ms,
		OPAL_INFO_LVL_5);
	c->retry_ms = 1000;
	reg_int("retry_ms", "first wait before a new lease when hostd keeps no record to upgrade (no hostd, a pairing timeout, the peer's session gone; doubles)", &c->retry_ms, OPAL_INFO_LVL_5);
	c->retry_max_ms = 8000;
	reg_int("retry_max_ms", "longest wait between new leases", &c->retry_max_ms, OPAL_INFO_LVL_5);
	c->ring = 1;
	reg_int("ring", "1: move to rings when hostd allows; 0: stay on the leases (kernel TCP)", &c->ring, OPAL_INFO_LVL_5);
	c->poll_every = 4096;
	reg_int("poll_every", "progress calls between checks of the leases while every peer is on a ring (rounded up to a power of two)", &c->poll_every,
		OPAL_INFO_LVL_9);

	mca_btl_base_module_t *m = &shunt_btl.super;
	m->btl_exclusivity = MCA_BTL_EXCLUSIVITY_DEFAULT; /* above tcp (100), below vader and self */
	m->btl_eager_limit = 32 * 1024; /* one record, packed in the ring by sendi */
	m->btl_rndv_eager_limit = 32 * 1024;
	m->btl_max_send_size = 32 * 1024;
	m->btl_rdma_pipeline_send_length = m->btl_eager_limit;
	m->btl_rdma_pipeline_frag_size = m->btl_eager_limit;
	m->btl_min_rdma_pipeline_size = INT_MAX;
	m->btl_flags = MCA_BTL_FLAGS_SEND;
	m->btl_latency = 1;
	m->btl_bandwidth = 10000;
	return mca_btl_base_param_register(&c->super.btl_version, m);
}

/* ---- the address ---- */

static int in_cidr(const struct sockaddr *sa, const char *cidr)
{
	char buf[64];
	snprintf(buf, sizeof buf, "%s", cidr);
	char *slash = strchr(buf, '/');
	int bits = slash ? atoi(slash + 1) : -1;
	if (slash)
		*slash = 0;
	uint8_t want[16], have[16];
	int len;
	if (sa->sa_family == AF_INET && inet_pton(AF_INET, buf, want) == 1) {
		memcpy(have, &((const struct sockaddr_in *)sa)->sin_addr, 4);
		len = 4;
	} else if (sa->sa_family == AF_INET6 && inet_pton(AF_INET6, buf, want) == 1) {
		memcpy(have, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
		len = 16;
	} else {
		return 0;
	}
	if (bits < 0 || bits > 8 * len)
		bits = 8 * len;
	for (int i = 0; i < bits; i++)
		if ((want[i / 8] ^ have[i / 8]) & (0x80 >> (i % 8)))
			return 0;
	return 1;
}

static int matches(const struct sockaddr *sa, const char *list)
{
	char buf[256];
	snprintf(buf, sizeof buf, "%s", list);
	for (char *save, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
		if (in_cidr(sa, t))
			return 1;
	return 0;
}

/* pick_address finds the address to listen on: the first up interface
 * address in btl_shunt_if_include, else the first non-loopback IPv4. */
static int pick_address(struct sockaddr_storage *out)
{
	struct ifaddrs *ifs;
	if (getifaddrs(&ifs) < 0)
		return -1;
	const char *inc = mca_btl_shunt_component.if_include;
	int found = -1;
	for (struct ifaddrs *i = ifs; i && found < 0; i = i->ifa_next) {
		if (!i->ifa_addr || !(i->ifa_flags & IFF_UP) || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
			continue;
		if (inc && *inc ? !matches(i->ifa_addr, inc) : (i->ifa_flags & IFF_LOOPBACK) || i->ifa_addr->sa_family != AF_INET)
			continue;
		memset(out, 0, sizeof *out);
		memcpy(out, i->ifa_addr, i->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6));
		found = 0;
	}
	freeifaddrs(ifs);
	return found;
}

static int listen_on(struct sockaddr_storage *ss)
{
	int lo = mca_btl_shunt_component.port_min, hi = mca_btl_shunt_component.port_max;
	if (lo <= 0)
		lo = hi = 0;
	else if (hi < lo)
		hi = lo + 255 > 65535 ? 65535 : lo + 255;
	socklen_t len = ss->ss_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
	for (int port = lo; port <= hi; port++) {
		int fd = socket(ss->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -1;
		int one = 1;
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		if (ss->ss_family == AF_INET)
			((struct sockaddr_in *)ss)->sin_port = htons(port);
		else
			((struct sockaddr_in6 *)ss)->sin6_port = htons(port);
		if (bind(fd, (struct sockaddr *)ss, len) == 0 && listen(fd, 128) == 0 &&
		    getsockname(fd, (struct sockaddr *)ss, &len) == 0)
			return fd;
		close(fd);
	}
	errno = EADDRINUSE;
	return -1;
}

/* ---- module init and finalize ---- */

static int module_finalize(struct mca_btl_base_module_t *btl);

int module_init(void)
{
	struct sockaddr_storage ss;
	if (pick_address(&ss)) {
		say(1, "no address to listen on (btl_shunt_if_include=%s): not used",
		    mca_btl_shunt_component.if_include ? mca_btl_shunt_component.if_include : "");
		return -1;
	}
	if ((shunt_btl.lfd = listen_on(&ss)) < 0) {
		say(0, "cannot listen (ports %d-%d): %s: not used", mca_btl_shunt_component.port_min,
		    mca_btl_shunt_component.port_max, strerror(errno));
		return -1;
	}
	struct shunt_addr *a = &shunt_btl.laddr;
	memset(a, 0, sizeof *a);
	if (ss.ss_family == AF_INET) {
		a->ip[10] = a->ip[11] = 0xff;
		memcpy(a->ip + 12, &((struct sockaddr_in *)&ss)->sin_addr, 4);
		a->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
	} else {
		memcpy(a->ip, &((struct sockaddr_in6 *)&ss)->sin6_addr, 16);
		a->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
	}
	shunt_btl.efd = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
	if (shunt_btl.efd < 0 || epoll_ctl(shunt_btl.efd, EPOLL_CTL_ADD, shunt_btl.lfd, &ev) < 0) {
		say(0, "epoll: %s: not used", strerror(errno));
		close(shunt_btl.lfd);
		return -1;
	}
	OBJ_CONSTRUCT(&shunt_btl.lock, opal_recursive_mutex_t);
	struct wire_addr w = {.port = a->port, .version = SHUNT_BTL_VERSION};
	memcpy(w.ip, a->ip, 16);
	int rc;
	OPAL_MODEX_SEND(rc, OPAL_PMIX_GLOBAL, &mca_btl_shunt_component.super.btl_version, &w, sizeof w);
	if (rc != OPAL_SUCCESS) {
		say(0, "cannot publish the address (modex): not used");
		return -1;
	}
	if (hostd_init() == 0)
		hostd_listen();
	shunt_btl.super.btl_finalize = module_finalize;
	/* Progress from the start: a peer may connect before ob1 adds it. */
	opal_progress_register(shunt_btl_progress);
	char ip[INET6_ADDRSTRLEN];
	inet_ntop(ss.ss_family, ss.ss_family == AF_INET ? (void *)&((struct sockaddr_in *)&ss)->sin_addr
							 : (void *)&((struct sockaddr_in6 *)&ss)->sin6_addr,
		  ip, sizeof ip);
	say(2, "listening on %s:%u", ip, a->port);
	return 0;
}

/* drain_socket reads and drops what c's socket holds, so that close sends
 * FIN rather than RST (which would drop the peer's unread bytes). */
static void drain_socket(struct conn *c)
{
	char buf[4096];
	while (read(c->fd, buf, sizeof buf) > 0)
		;
}

static int module_finalize(struct mca_btl_base_module_t *btl)
{
	(void)btl;
	__atomic_store_n(&shunt_btl.finalizing, 1, __ATOMIC_RELAXED);
	opal_progress_unregister(shunt_btl_progress);
	SHUNT_LOCK();
	for (uint32_t i = 0; i < shunt_btl.neps; i++) {
		struct mca_btl_base_endpoint_t *ep = shunt_btl.eps[i];
		if (ep && ep->tx && !ep->tx->closing) {
			struct frag *b = frag_control(REC_BYE, NULL, 0);
			if (b)
				lease_push(ep->tx, b);
		}
	}
	for (struct conn *c = shunt_btl.conns; c; c = c->next)
		if (!c->out && !c->closing) {
			struct frag *b = frag_control(REC_BYE, NULL, 0);
			if (b)
				lease_push(c, b);
		}
	/* Let the BYEs go (bounded: a peer that is gone takes nothing). */
	int64_t end = now_ns() + 1000000000;
	for (;;) {
		int pending = 0;
		for (struct conn *c = shunt_btl.conns; c; c = c->next)
			if (c->lq.head && lease_flush(c) == 0)
				pending = 1;
		if (!pending || now_ns() > end)
			break;
		struct epoll_event evs[16];
		epoll_wait(shunt_btl.efd, evs, 16, 10);
	}
	while (shunt_btl.conns) {
		struct conn *c = shunt_btl.conns;
		drain_socket(c);
		c->closing = 1;
		conn_free(c);
	}
	for (uint32_t i = 0; i < shunt_btl.neps; i++)
		free(shunt_btl.eps[i]);
	free(shunt_btl.eps);
	shunt_btl.eps = NULL;
	shunt_btl.neps = 0;
	free(shunt_btl.ring_rx);
	shunt_btl.ring_rx = NULL;
	shunt_btl.nring_rx = 0;
	struct frag *f;
	while ((f = shunt_btl.free_small)) {
		shunt_btl.free_small = f->next;
		free(f);
	}
	while ((f = shunt_btl.free_large)) {
		shunt_btl.free_large = f->next;
		free(f);
	}
	if (shunt_btl.lfd >= 0)
		close(shunt_btl.lfd);
	if (shunt_btl.efd >= 0)
		close(shunt_btl.efd);
	shunt_btl.lfd = shunt_btl.efd = -1;
	hostd_fini();
	SHUNT_UNLOCK();
	OBJ_DESTRUCT(&shunt_btl.lock);
	return OPAL_SUCCESS;
}

/* ---- progress ---- */

/* flush_queues moves fragments that waited for ring room. */
static int flush_queues(void)
{
	int queued = 0, n = 0;
	for (uint32_t i = 0; i < shunt_btl.neps; i++) {
		struct mca_btl_base_endpoint_t *ep = shunt_btl.eps[i];
		if (!ep || !ep->q.head)
			continue;
		struct frag *was = ep->q.head;
		tx_flush(ep);
		n += ep->q.head != was;
		queued |= ep->q.head != NULL;
	}
	shunt_btl.queued = queued;
	return n;
}

/* lease_work: sockets (accepts, lease records, writes), hostd's word, path
 * changes, retries; then dead connections go. Returns events handled. */
static int lease_work(int events)
{
	struct epoll_event evs[64];
	int n = epoll_wait(shunt_btl.efd, evs, 64, 0), busy = 0;
	for (int i = 0; i < n; i++) {
		if (!evs[i].data.ptr)
			accept_all();
		else
			conn_event(evs[i].data.ptr, evs[i].events);
	}
	if (events) /* READY, TCP, DOWN from hostd: receivers take theirs here */
		for (struct conn *c = shunt_btl.conns; c; c = c->next)
			if (!c->out && c->hello)
				hostd_take(c);
	for (struct conn *c = shunt_btl.conns; c; c = c->next)
		if (!c->out && c->relayed && !c->dead) {
			/* relayed.c: a pair the relay left unstarted goes; a SWITCH
			 * that waits for its ring is read again. */
			relay_rx_idle(c);
			if (c->in_len && c->ep && c->ep->rx == c && !c->ep->rx_ring)
				lease_take_back(c, NULL, 0);
		}
	for (uint32_t i = 0; i < shunt_btl.neps; i++) {
		struct mca_btl_base_endpoint_t *ep = shunt_btl.eps[i];
		if (!ep)
			continue;
		paths_step(ep);
		if (ep->q.head)
			shunt_btl.queued = 1;
		if ((ep->tx && !ep->tx_ring) || (ep->rx && !ep->rx_ring) || ep->tx_next)
			busy = 1;
	}
	for (struct conn *c = shunt_btl.conns, *next; c; c = next) {
		next = c->next;
		if (c->dead)
			conn_free(c);
		else if (c->lq.head || c->fstate == F_ASKING || c->closing || (!c->out && !c->hello))
			busy = 1;
	}
	int64_t now = now_ns();
	if (now > shunt_btl.next_timer) {
		shunt_btl.next_timer = now + 1000000000;
		hostd_listen(); /* hostd was away at init, or restarted: LISTEN again */
	}
	shunt_btl.lease_busy = busy;
	return n;
}

int shunt_btl_progress(void)
{
	if (__atomic_load_n(&shunt_btl.in_progress, __ATOMIC_RELAXED) || shunt_btl.efd < 0)
		return 0;
	SHUNT_LOCK();
	if (shunt_btl.in_progress || shunt_btl.efd < 0) { /* re-entered from a callback */
		SHUNT_UNLOCK();
		return 0;
	}
	shunt_btl.in_progress = 1;
	int n = 0;
	for (int i = 0; i < shunt_btl.nring_rx; i++)
		n += ring_rx_poll(shunt_btl.ring_rx[i]);
	if (shunt_btl.queued) /* fragments waiting for ring room: no system call */
		n += flush_queues();
	int events = hostd_pending();
	if (events || shunt_btl.lease_busy || (++shunt_btl.tick & shunt_btl.tick_mask) == 0)
		n += lease_work(events);
	shunt_btl.in_progress = 0;
	SHUNT_UNLOCK();
	return n;
}

/* ---- the component ---- */

static mca_btl_base_module_t **shunt_init(int *num, bool progress_threads, bool mpi_threads)
{
	(void)progress_threads, (void)mpi_threads;
	*num = 0;
	/* A power of two, as a mask: no division on the polling path. */
	unsigned every = 1;
	while (every < (unsigned)mca_btl_shunt_component.poll_every && every < (1u << 30))
		every <<= 1;
	shunt_btl.tick_mask = every - 1;
	if (module_init())
		return NULL;
	mca_btl_base_module_t **m = malloc(sizeof *m);
	if (!m)
		return NULL;
	m[0] = &shunt_btl.super;
	*num = 1;
	return m;
}

__attribute__((visibility("default"))) struct shunt_btl_component mca_btl_shunt_component = {
	.super = {
		.btl_version = {
			MCA_BTL_DEFAULT_VERSION("shunt"),
			.mca_register_component_params = shunt_register,
		},
		.btl_data = {.param_field = MCA_BASE_METADATA_PARAM_NONE},
		.btl_init = shunt_init,
		.btl_progress = shunt_btl_progress,
	},
};
