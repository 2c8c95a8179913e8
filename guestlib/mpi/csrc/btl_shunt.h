/* btl/shunt: an Open MPI byte transfer layer (BTL) that moves ob1's
 * fragments between guests through Shunt rings (docs/mpi.md).
 *
 * Built out of tree against the Open MPI the distribution ships (4.1, BTL
 * interface 3.1) as mca_btl_shunt.so, with the shared C core (guestlib/c,
 * shunt.h) compiled in. Files:
 *
 *   btl_shunt.h  this header: records, fragments, connections, endpoints
 *   component.c  the component: parameters, init (listener, modex),
 *                progress, finalize, messages to the job's output
 *   module.c     the module: add_procs (the lease connect), alloc, free,
 *                prepare_src, send, sendi, the error callback
 *   conn.c       connections: new and freed, the lease connect, accept,
 *                HELLO
 *   lease.c      lease I/O: the write queue, reading and parsing records
 *   handover.c   the path state machine of each direction (lease, ring,
 *                handover, downgrade, re-lease) and the ring's receiver
 *   hostd.c      the session with hostd: OPEN, the READY, TCP, DOWN and
 *                RESUME that come for it, LEFT, CLOSE; LISTEN, REATTACH
 *                and OPEN again after a hostd restart
 *   relayed.c    a ring pair whose other end is the relay to another host
 *                (READY's Relayed): the stream in lease framing, as bytes,
 *                and RESUME
 *
 * Records in a ring, in place, are the core's (shunt.h, records.c).
 *
 * Paths. Between two ranks each direction has its own kernel TCP
 * connection, the lease, opened by the sender on its first send (ob1's
 * add_procs): simultaneous connects need no tie-break and neither side ever
 * waits for the other. A direction's data is one ordered stream of records
 * that moves between places, each move marked in the stream itself:
 *
 *   lease k --SWITCH--> ring --DOWN(bytes)--> lease k --SWITCH--> ring' ...
 *                                            lease k --MOVE--> lease k+1 ...
 *
 * SWITCH is written on the lease once hostd said READY to both ends and the
 * reader said RING_OK for that ring pair (it attached the ring); DOWN once
 * hostd said DOWN (or the ring broke), with the ring's final byte count, so
 * the reader drains the ring exactly that far; each end then tells hostd it
 * LEFT the pair, and hostd may give the same lease a fresh pair later
 * (READY again: SWITCH again). MOVE when a newer lease (a retry where hostd
 * keeps no record to upgrade: no hostd, a pairing timeout, the peer's
 * session gone) got READY. Every DATA record carries its
 * number in the stream's count (leases) or a stamp (rings), and every mark
 * carries the count so far: a gap is a fatal error naming the peer, never
 * wrong data.
 *
 * Threads: ob1 calls in from any MPI thread; everything here runs under the
 * module's recursive lock when opal_using_threads() (a no-op otherwise).
 * The session's reader thread only touches the registry (hostd.c, its own
 * mutex) and atomics. */
#ifndef BTL_SHUNT_H
#define BTL_SHUNT_H

#define _GNU_SOURCE
#include "opal_config.h"
#include "opal/datatype/opal_convertor.h"
#include "opal/mca/btl/base/base.h"
#include "opal/mca/btl/btl.h"
#include "opal/mca/pmix/pmix.h"
#include "opal/threads/mutex.h"
#include "opal/util/proc.h"

#include "shunt.h"

#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

/* ---- records: the unit on leases and rings ----
 *
 * A record is the core's (shunt.h, "records"): a 16-byte header (struct
 * shunt_rec) and len bytes of payload. On a lease they follow each other
 * unaligned, the header's pad is 0 and its stamp is the fragment's number
 * (DATA); in a ring they are the core's records in place (records.c), one
 * 64-byte line for a small fragment. The kinds after DATA and PAD are
 * marks and control records, which travel on leases only. */
enum rec_kind {
	REC_DATA = SHUNT_REC_DATA, /* an ob1 fragment: tag, payload */
	REC_PAD = SHUNT_REC_PAD,   /* ring only: skip to the end of the ring */
	REC_HELLO,    /* first on a lease, from the connecting end: who it is */
	REC_SWITCH,   /* the stream goes on in this lease's ring (struct rec_switch) */
	REC_DOWN,     /* the ring ended (struct rec_down); the stream goes on here */
	REC_MOVE,     /* the stream goes on on another lease (struct rec_move) */
	REC_RING_OK,  /* receiver to sender: it attached the ring pair (struct rec_ring) */
	REC_RING_NO,  /* sender to receiver: it will not use the ring pair (struct rec_ring) */
	REC_BYE,      /* this end closes the lease on purpose */
	REC_KINDS
};

#define SHUNT_BTL_MAGIC   0x42534853u /* "SHSB" */
#define SHUNT_BTL_VERSION 2 /* 2: ring pairs named in SWITCH, RING_OK, RING_NO (protocol v3) */

struct rec_hello { uint32_t magic; uint16_t version, zero; uint32_t jobid, vpid, lease, zero2; };
struct rec_switch { uint64_t epoch, frags, gen; uint32_t region, slot; };
struct rec_down { uint64_t bytes, records, frags; };
struct rec_move { uint32_t lease, zero; uint64_t frags; };
struct rec_ring { uint64_t gen; uint32_t region, slot; uint16_t reason, zero[3]; };
struct rec_bye { uint64_t frags; };

/* ---- fragments: ob1's descriptors ---- */

enum { FRAG_HEAP, FRAG_RING };

struct frag {
	mca_btl_base_descriptor_t base;
	mca_btl_base_segment_t seg;
	struct frag *next;                   /* in a queue or a free list */
	struct mca_btl_base_endpoint_t *ep;
	struct shunt_rec hdr;                      /* the record header on a lease */
	size_t done;                         /* bytes of header + payload written to a lease */
	uint8_t where;                       /* FRAG_HEAP: buf; FRAG_RING: reserved in the ring */
	uint8_t internal;                    /* our own record: no callback; freed once written */
	uint8_t large;                       /* from the large pool */
	uint8_t raw;                         /* internal: bytes of the stream as they are, no header (relayed.c's resend) */
	size_t cap;                          /* bytes buf holds */
	uint8_t *buf;
	struct shunt_rec *rh;                      /* FRAG_RING: the reserved record */
	uint16_t rpad;                       /* FRAG_RING: its pad */
};

struct fragq { struct frag *head, *tail; };

static inline void fq_push(struct fragq *q, struct frag *f)
{
	f->next = NULL;
	if (q->tail)
		q->tail->next = f;
	else
		q->head = f;
	q->tail = f;
}

static inline struct frag *fq_pop(struct fragq *q)
{
	struct frag *f = q->head;
	if (f && !(q->head = f->next))
		q->tail = NULL;
	return f;
}

/* ---- connections (conn.c, lease.c, handover.c) ---- */

/* A connection's standing with hostd (hostd.c): never announced (no hostd,
 * btl_shunt_ring=0), OPEN sent and no answer yet, on TCP by hostd's word
 * (READY may still come), holding an attached ring pair, CLOSE sent. */
enum { F_NONE, F_ASKING, F_TCP, F_READY, F_CLOSED };

struct held; /* hostd.c */

struct conn {
	struct conn *next;                  /* the module's list */
	struct mca_btl_base_endpoint_t *ep; /* NULL until HELLO (accepted) */
	int fd;
	uint8_t out;     /* 1: our lease (we send data), 0: accepted (we receive) */
	uint8_t hello;   /* accepted: HELLO read */
	uint8_t eof, bye, closing, dead;
	uint32_t lease;  /* the sender's number for this lease */
	/* socket, read side: bytes not yet parsed */
	uint8_t *in;
	size_t in_len, in_cap;
	/* socket, write side: records in order, the head maybe partly written */
	struct fragq lq;
	int pollout;
	/* hostd */
	struct shunt_addr local, remote;
	struct held *h;       /* its registry entry while announced (hostd.c) */
	int fstate;
	uint16_t reason;      /* why it is on TCP, or why the ring ended */
	int told;             /* out: a TCP verdict not yet said (handover.c) */
	int down;             /* hostd said DOWN for the pair held (sf) */
	uint16_t down_reason;
	struct shunt_flow sf; /* the ring pair while F_READY; sf.region_id names its region */
	struct rec_ring ok;   /* out: the receiver's last RING_OK */
	struct rec_ring no;   /* in: the sender's last RING_NO */
	struct shunt_rec_ring rr;      /* out: writer of sf.w; in: reader of sf.r */
	/* relayed.c: the pair held is relayed (READY's Relayed): the stream
	 * goes into its ring as bytes in lease framing, not records */
	uint8_t relayed;
	uint64_t resume_at;   /* RESUME's offset (valid while down, relayed) */
	uint8_t gone;         /* out: the DOWN was a vsock stretch's peer-gone (relayed.c: nothing to resend) */
	uint64_t wtail0;      /* out: sf.w's tail when the stretch started */
	uint64_t token;       /* out: the stretch's start offset, random: SWITCH names the stretch by it */
	uint8_t *rb;          /* in: ring bytes read, not yet whole records */
	size_t rb_len, rb_cap;
};

/* ---- endpoints: one per peer rank ---- */

struct wire_addr { uint8_t ip[16]; uint16_t port, zero; uint32_t version; };

struct mca_btl_base_endpoint_t {
	opal_process_name_t name;
	opal_proc_t *proc;   /* set by add_procs */
	struct wire_addr addr;
	char who[96];        /* "rank N (host addr:port)" for messages */
	int reachable;
	/* send direction */
	struct conn *tx;      /* the lease our data goes on (and its ring once switched) */
	int tx_ring;          /* our data goes into tx's ring now */
	struct conn *tx_next; /* a newer lease being set up */
	uint32_t leases;      /* leases opened so far */
	uint64_t tx_frags;    /* DATA records put in the stream */
	struct fragq q;       /* ring mode: DATA waiting for ring room */
	int64_t retry_at;     /* when to try a new lease (ns, 0: no) */
	int retry_ms;
	int said;             /* a reason was said (it is said once per change) */
	uint16_t said_reason;
	/* receive direction */
	struct conn *rx;      /* where our peer's stream goes on */
	int rx_ring;          /* reading rx's ring */
	int rx_index;         /* in the module's ring reader list, or -1 */
	uint64_t rx_frags;
	int bye;              /* the peer closed on purpose */
};

/* ---- the component and its module ---- */

struct shunt_btl_component {
	mca_btl_base_component_3_0_0_t super;
	int verbose;       /* 0: fallbacks and errors; 1: every path change; 2: debug */
	char *if_include;  /* CIDR of the address to publish */
	int port_min, port_max;
	char *control;     /* hostd's socket; "" = $SHUNT_CONTROL or /run/shunt/guest.sock */
	int connect_ms, retry_ms, retry_max_ms;
	int ring;          /* 0: never use rings (lease only, for comparisons) */
	int poll_every;    /* progress calls between lease checks when all is on rings */
};

struct shunt_btl {
	mca_btl_base_module_t super;
	mca_btl_base_module_error_cb_fn_t error_cb;
	opal_recursive_mutex_t lock;
	int lfd, efd;
	struct shunt_addr laddr;
	struct conn *conns;
	struct mca_btl_base_endpoint_t **eps; /* by vpid, own job */
	uint32_t neps;
	struct mca_btl_base_endpoint_t **ring_rx; /* endpoints reading a ring */
	int nring_rx, ring_rx_cap;
	int lease_busy;     /* something moves on a lease: check sockets on every call */
	int queued;         /* some endpoint has fragments waiting for ring room */
	unsigned tick, tick_mask;
	int in_progress;
	int64_t next_timer;
	struct frag *free_small, *free_large;
	int finalizing;
	struct conn *reparse; /* became where a stream goes on, with records buffered */
};

extern struct shunt_btl_component mca_btl_shunt_component;
extern struct shunt_btl shunt_btl;

#define SMALL_FRAG 1024

#define SHUNT_LOCK()   OPAL_THREAD_LOCK(&shunt_btl.lock)
#define SHUNT_UNLOCK() OPAL_THREAD_UNLOCK(&shunt_btl.lock)

/* component.c */
void say(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int64_t now_ns(void);
int shunt_btl_progress(void);

/* module.c */
struct frag *frag_get(size_t size);
void frag_put(struct frag *f);
void frag_done(struct frag *f); /* a sent DATA frag left: callback, ownership */
struct frag *frag_control(uint8_t kind, const void *payload, size_t len);
void peer_failed(struct mca_btl_base_endpoint_t *ep, const char *why);
void tx_flush(struct mca_btl_base_endpoint_t *ep);
int module_init(void);
/* The endpoint of rank vpid of this job, made if new; NULL without memory. */
struct mca_btl_base_endpoint_t *ep_of(uint32_t vpid);

/* conn.c */
struct conn *conn_new(int fd, int out);
void conn_free(struct conn *c);
int lease_open(struct mca_btl_base_endpoint_t *ep, int wait_ms); /* tx lease; 0 or -errno */
void accept_all(void);
void conn_set_pollout(struct conn *c, int on);
/* An accepted lease's first record, which must be HELLO (lease.c's parser
 * calls it): 1, or -1 if it is not or names no rank of this job. */
int conn_hello(struct conn *c, const struct shunt_rec *h, const uint8_t *p);

/* lease.c */
void lease_push(struct conn *c, struct frag *f); /* append and try to write */
ssize_t lease_writev(int fd, struct iovec *iov, int n); /* writev without SIGPIPE */
int lease_flush(struct conn *c);                 /* write what can be; 1 if the queue is empty */
void conn_event(struct conn *c, uint32_t events);
/* A record of our own on c (HELLO, marks, RING_OK/NO, BYE), in order with
 * its data; a lack of memory fails the peer (conn.c, handover.c). */
void push_control(struct conn *c, uint8_t kind, const void *p, size_t n);
/* Ends our use of c: BYE, then shutdown once written (lease_flush), then
 * close at EOF (handover.c, when a lease is replaced or given up). */
void finish(struct conn *c);

/* handover.c */
void paths_step(struct mca_btl_base_endpoint_t *ep); /* handover, downgrade, re-lease */

int ring_rx_poll(struct mca_btl_base_endpoint_t *ep);
void ring_rx_add(struct mca_btl_base_endpoint_t *ep); /* ep reads its ring from now on */
/* Takes ep off the module's ring reader list (conn.c when its rx conn goes,
 * lease.c at BYE). */
void ring_rx_del(struct mca_btl_base_endpoint_t *ep);
/* The marks that move ep's incoming stream onto c's ring (SWITCH) and back
 * (DOWN), as lease.c's parser reads them on c: 1, or -1 (the peer failed
 * or the record is out of order). */
int rx_switch(struct mca_btl_base_endpoint_t *ep, struct conn *c, const struct shunt_rec *h, const uint8_t *p);
int rx_down(struct mca_btl_base_endpoint_t *ep, struct conn *c, const struct shunt_rec *h, const uint8_t *p);
/* RING_NO on an accepted lease c: the sender will not use the pair it
 * names (1, or -1 if malformed). */
int rx_refused(struct conn *c, const struct shunt_rec *h, const uint8_t *p);
void say_path(struct mca_btl_base_endpoint_t *ep, uint16_t reason, const char *what);
const char *reason_name(uint16_t r);

/* deliver hands a received fragment to ob1's callback for its tag (lease.c
 * from a lease, handover.c from a ring). */
static inline void deliver(uint8_t tag, void *p, size_t len)
{
	mca_btl_active_message_callback_t *reg = mca_btl_base_active_message_trigger + tag;
	mca_btl_base_segment_t seg = {.seg_addr.pval = p, .seg_len = len};
	mca_btl_base_descriptor_t d;
	memset(&d, 0, sizeof d);
	d.des_segments = &seg;
	d.des_segment_count = 1;
	reg->cbfunc(&shunt_btl.super, tag, &d, reg->cbdata);
}

/* relayed.c: a ring pair whose other end is the relay (conn.relayed). */
int relay_put(struct mca_btl_base_endpoint_t *ep, uint8_t tag, const void *p, size_t len); /* 1 written, 0 not now */
int relay_fits(struct mca_btl_base_endpoint_t *ep, size_t len); /* relay_put of len bytes would write now */
int relay_rx_poll(struct mca_btl_base_endpoint_t *ep);
/* RESUME on ep's relayed ring (its tx lease c): leaves the ring, resends
 * its bytes from hostd's offset on the lease, LEFT: 0, or -1 when the
 * stream cannot go on (the peer failed). */
int relay_resume(struct mca_btl_base_endpoint_t *ep, struct conn *c);

/* Whether the sender may switch to c's relayed pair: the receiver
 * attached the ring this stretch's bytes go into on its host. */
int relay_ready(struct conn *c);
/* SWITCH of a relayed stretch on ep's lease c (rx_switch): 1 done (on the
 * ring, or the stretch never reached this host: the lease carries it),
 * 0 not yet (the ring may still start), -1 the peer failed. */
int relay_rx_switch(struct mca_btl_base_endpoint_t *ep, struct conn *c, uint64_t token);
/* The receiver's relayed pair that the relay left without starting it:
 * let it go, so that hostd can offer the next stretch (lease_work). */
void relay_rx_idle(struct conn *c);

/* lease.c: bytes read from a relayed ring that are not a whole record
 * come before c's lease bytes (the writer resent the rest there); parses. */
void lease_take_back(struct conn *c, const uint8_t *p, size_t n);
size_t max_record(void);

/* Reasons of our own, after proto's (shunt_reason_name says "?" for them). */
enum {
	R_REFUSED = 1000, /* the lease connect was refused (a firewall REJECT?) */
	R_UNREACHABLE,    /* the lease connect failed or timed out */
	R_RING_SMALL,     /* the ring cannot hold two fragments of btl_shunt_max_send_size */
	R_RING_BROKEN,    /* the ring was reset or its reader closed (no DOWN came) */
	R_LEASE_ONLY,     /* btl_shunt_ring = 0 */
	R_NOT_RELAYED,    /* a vsock stretch whose pair hostd does not mark relayed (the peer is not a vsock VM) */
};

/* hostd.c */
int hostd_init(void);
int hostd_ready(void);       /* the session is open (ensures it; rate limited) */
void hostd_listen(void);     /* LISTEN our address if hostd has not heard it */
void hostd_open(struct conn *c, uint8_t role); /* OPEN, answered later (hostd_take) */
/* Whether READY, TCP or DOWN came for some connection since the last call
 * (then the progress loop takes them: hostd_take). */
int hostd_pending(void);
void hostd_take(struct conn *c); /* apply what hostd said for c, in order */
/* c leaves its ring pair: LEFT to hostd, the pair let go; c is on TCP
 * for reason and may get READY again. */
void hostd_left(struct conn *c, uint16_t reason);
void hostd_close(struct conn *c); /* CLOSE c once: hostd forgets it */
void hostd_fini(void);
/* Whether r names the pair c holds. */
static inline int holds_pair(const struct conn *c, const struct rec_ring *r)
{
	return c->fstate == F_READY && r->gen == c->sf.gen && r->slot == c->sf.slot && r->region == c->sf.region_id;
}

#endif
