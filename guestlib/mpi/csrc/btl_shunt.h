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
 *   conn.c       connections: accept, HELLO, lease I/O, the path state
 *                machine (lease, ring, handover, downgrade, re-lease)
 *   hostd.c      the session with hostd: INTENT, OPEN and its verdict,
 *                REVOKE, LISTEN and REATTACH after a hostd restart
 *   records.c    records in a ring: reserve and commit in place, poll and
 *                consume in place (what shunt.h's copy API lacks)
 *
 * Paths. Between two ranks each direction has its own kernel TCP
 * connection, the lease, opened by the sender on its first send (ob1's
 * add_procs): simultaneous connects need no tie-break and neither side ever
 * waits for the other. A direction's data is one ordered stream of records
 * that moves between places, each move marked in the stream itself:
 *
 *   lease k --SWITCH--> ring k --DOWN(bytes)--> lease k --MOVE--> lease k+1 ...
 *
 * SWITCH is written on the lease once hostd said READY to both ends and the
 * reader said RING_OK (it attached the ring); DOWN once the ring is reset
 * (revoked) or broken, with the ring's final byte count, so the reader
 * drains the ring exactly that far; MOVE when a newer lease (a retry after
 * a TCP verdict or a revocation) got READY. Every DATA record carries its
 * number in the stream's count (leases) or a stamp (rings), and every mark
 * carries the count so far: a gap is a fatal error naming the peer, never
 * wrong data.
 *
 * Threads: ob1 calls in from any MPI thread; everything here runs under the
 * module's recursive lock when opal_using_threads() (a no-op otherwise).
 * The session's reader thread and the verdict threads only touch the
 * registry (hostd.c, its own mutex) and atomics. */
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
#include <sys/uio.h>

/* ---- records: the unit on leases and rings ----
 *
 * A record is a 16-byte header and len bytes of payload. On a lease they
 * follow each other unaligned. In a ring every record starts on a 64-byte
 * line and never wraps (a PAD fills the end), so a small fragment is one
 * line: header and payload arrive with one cache-line transfer, and the
 * reader detects it by the header's stamp instead of the ring's tail
 * (records.c). Native byte order: both ends share the host. */
enum rec_kind {
	REC_DATA = 1, /* an ob1 fragment: tag, payload */
	REC_PAD,      /* ring only: skip to the end of the ring */
	REC_HELLO,    /* first on a lease, from the connecting end: who it is */
	REC_SWITCH,   /* the stream goes on in this lease's ring (struct rec_switch) */
	REC_DOWN,     /* the ring ended (struct rec_down); the stream goes on here */
	REC_MOVE,     /* the stream goes on on another lease (struct rec_move) */
	REC_RING_OK,  /* either direction: this end attached the ring */
	REC_RING_NO,  /* either direction: this end will not use the ring (reason) */
	REC_BYE,      /* this end closes the lease on purpose */
	REC_KINDS
};

struct rec {
	uint32_t len;   /* payload bytes */
	uint8_t kind;
	uint8_t tag;    /* REC_DATA: the BTL tag */
	uint16_t pad;   /* ring: bytes between the header and the payload (below); lease: 0 */
	uint64_t stamp; /* ring: epoch + record number, stored last; lease: frag number (DATA) */
};
#define REC_LINE 64

/* Larger payloads in a ring start where the bulk of their data lands on a
 * 64-byte boundary: the header is padded so that ob1's own header (of
 * hdr bytes) ends on one. Unaligned destinations make the string copies
 * that memcpy uses several times slower on this kind of machine (measured:
 * the sender copied at a fifth of the receiver's speed). Small payloads are
 * not padded, so that they share the header's line. */
#define REC_ALIGN_FROM 1024
static inline uint16_t rec_pad(size_t hdr, size_t len)
{
	return len < REC_ALIGN_FROM ? 0 : (uint16_t)((REC_LINE - (sizeof(struct rec) + hdr) % REC_LINE) % REC_LINE);
}

#define SHUNT_BTL_MAGIC   0x42534853u /* "SHSB" */
#define SHUNT_BTL_VERSION 1

struct rec_hello { uint32_t magic; uint16_t version, zero; uint32_t jobid, vpid, lease, zero2; };
struct rec_switch { uint64_t epoch, frags; };
struct rec_down { uint64_t bytes, records, frags; };
struct rec_move { uint32_t lease, zero; uint64_t frags; };
struct rec_no { uint16_t reason, zero[3]; };
struct rec_bye { uint64_t frags; };

/* The ring bytes of a record: header, pad and payload, to whole lines. */
static inline size_t rec_span(size_t len) { return (sizeof(struct rec) + len + REC_LINE - 1) & ~(size_t)(REC_LINE - 1); }
static inline void *rec_payload(struct rec *h) { return (uint8_t *)(h + 1) + h->pad; }

/* Records in one ring, as one end sees them (records.c). SPSC. */
struct rring {
	struct shunt_ring *r;
	uint64_t epoch; /* the writer's random base for stamps (from SWITCH) */
	uint64_t next;  /* number of the next record */
	int resv;       /* writer: a reservation is open */
	uint64_t resv_at;
};

/* Writer: room for a record of len bytes after its header (pad and
 * payload), in place, or NULL with *err set (SHUNT_EAGAIN: no room now;
 * SHUNT_ERESET, SHUNT_EPIPE, SHUNT_ECORRUPT, SHUNT_EINVAL: larger than
 * half the ring). At most one reservation is open; rr_commit or rr_cancel
 * ends it. */
struct rec *rr_reserve(struct rring *w, size_t len, int *err);
/* Publishes the reserved record: pad bytes, then len payload bytes (pad +
 * len no more than reserved). */
void rr_commit(struct rring *w, struct rec *h, size_t len, uint16_t pad, uint8_t kind, uint8_t tag);
void rr_cancel(struct rring *w);
/* Reader: the next record if it has arrived, else NULL; *err is set to
 * SHUNT_ECORRUPT if the ring holds an impossible record. */
struct rec *rr_poll(struct rring *r, int *err);
void rr_consume(struct rring *r, const struct rec *h);
/* Whether the ring was reset (revoked) or its reader closed. */
int rr_broken(const struct rring *w);
/* Why the ring was reset: the reason hostd wrote with the reset, else
 * R_RING_BROKEN. */
uint16_t rr_reason(const struct rring *w);

/* ---- fragments: ob1's descriptors ---- */

enum { FRAG_HEAP, FRAG_RING };

struct frag {
	mca_btl_base_descriptor_t base;
	mca_btl_base_segment_t seg;
	struct frag *next;                   /* in a queue or a free list */
	struct mca_btl_base_endpoint_t *ep;
	struct rec hdr;                      /* the record header on a lease */
	size_t done;                         /* bytes of header + payload written to a lease */
	uint8_t where;                       /* FRAG_HEAP: buf; FRAG_RING: reserved in the ring */
	uint8_t internal;                    /* our own record: no callback; freed once written */
	uint8_t large;                       /* from the large pool */
	size_t cap;                          /* bytes buf holds */
	uint8_t *buf;
	struct rec *rh;                      /* FRAG_RING: the reserved record */
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

/* ---- connections (conn.c) ---- */

enum { F_NONE, F_ASKING, F_READY, F_TCP, F_CLOSED }; /* a connection's standing with hostd */

struct verdict; /* hostd.c */

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
	struct verdict *v;
	int fstate;
	uint16_t reason;      /* why it is on TCP, or why the ring ended */
	int revoked;          /* REVOKE came (atomic; hostd.c) */
	uint16_t revoke_reason;
	uint32_t region_id;
	struct shunt_flow sf;
	int peer_ok, peer_no; /* the other end's RING_OK / RING_NO */
	uint16_t peer_reason;
	struct rring rr;      /* out: writer of sf.w; in: reader of sf.r */
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
	int connect_ms, verdict_ms, retry_ms, retry_max_ms;
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
void lease_push(struct conn *c, struct frag *f); /* append and try to write */
int lease_flush(struct conn *c);                 /* write what can be; 1 if the queue is empty */
void conn_event(struct conn *c, uint32_t events);
void accept_all(void);
void paths_step(struct mca_btl_base_endpoint_t *ep); /* handover, downgrade, re-lease */
int ring_rx_poll(struct mca_btl_base_endpoint_t *ep);
void say_path(struct mca_btl_base_endpoint_t *ep, uint16_t reason, const char *what);
void conn_set_pollout(struct conn *c, int on);
void rx_step(struct conn *c); /* the receiver answers its verdict (RING_OK, RING_NO) */
const char *reason_name(uint16_t r);

/* Reasons of our own, after proto's (shunt_reason_name says "?" for them). */
enum {
	R_REFUSED = 1000, /* the lease connect was refused (a firewall REJECT?) */
	R_UNREACHABLE,    /* the lease connect failed or timed out */
	R_RING_SMALL,     /* the ring cannot hold two fragments of btl_shunt_max_send_size */
	R_RING_BROKEN,    /* the ring was reset or closed (no REVOKE seen) */
	R_LEASE_ONLY,     /* btl_shunt_ring = 0 */
	R_PEER,           /* the peer's end said no */
};

/* hostd.c */
int hostd_init(void);
int hostd_ready(void);       /* the session is open (ensures it; rate limited) */
void hostd_listen(void);     /* LISTEN our address if hostd has not heard it */
void hostd_intent(struct conn *c);
void hostd_open(struct conn *c, uint8_t role);
void hostd_take(struct conn *c); /* apply c's verdict if it arrived */
void hostd_close(struct conn *c); /* CLOSE c's flow once */
void hostd_fini(void);
int conn_revoked(struct conn *c, uint16_t *reason);

#endif
