/* libshunt core: Shunt's guest side in C, shared by the LD_PRELOAD library
 * (guestlib/preload) and the Open MPI transport (guestlib/mpi). It holds
 * the same ring format 2 (docs/region.md) and control protocol v3
 * (docs/protocol.md) as the Go packages shm/ring, shm/region and
 * internal/proto, and the session with hostd that guestlib's Client keeps
 * in Go: connect, HELLO and WELCOME, requests and their verdicts, reconnect
 * and re-announce, and in a VM the virtio-serial port, the ivshmem BAR and
 * kicks. Cross-language tests (guestlib/preload/preload_test.go, with
 * xtest/xtest.c) keep the two implementations in step. On top of the ring
 * it adds records in place (records.c; Go: shm/ring/records.go, the same bytes); their
 * tests are xtest/records.c (guestlib/preload/records_test.go).
 *
 * Everything read from shared memory is validated, as in Go: a corrupt or
 * hostile peer makes its own flow fail (SHUNT_ECORRUPT), never this process
 * read or write outside the region.
 *
 * System calls: the core never calls the libc wrappers that an LD_PRELOAD
 * library interposes (read, write, close, poll, socket, connect, send,
 * setsockopt, shutdown, sigaction, nor syscall(2) itself); it makes those
 * system calls with the syscall instruction (sys.h, sys.c: the one
 * system-call layer, with the futex helpers the preload library shares).
 * So it behaves the same inside the preload library, in an MPI transport
 * or in a plain program, needs no hook table to be filled in first, and
 * never re-enters an interposition layer whose locks its caller may hold.
 * Calls that no preload library interposes (open, stat, mmap, opendir,
 * getsockname, pthreads) go through libc. `make check` (core-syms) checks
 * with nm that the core's objects call no symbol the preload library
 * defines.
 *
 * Limits are named constants below. None is a silent cap: past each one
 * the code takes a slower path that is still correct, as its comment says. */
#ifndef SHUNT_H
#define SHUNT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Errors (negative returns). */
#define SHUNT_EAGAIN   (-11)  /* ring empty (read) or full (write) */
#define SHUNT_ECORRUPT (-74)  /* impossible shared state (EBADMSG) */
#define SHUNT_ERESET   (-104) /* flow reset: revoked or aborted (ECONNRESET) */
#define SHUNT_EPIPE    (-32)  /* the reader closed (EPIPE) */
#define SHUNT_EINVAL   (-22)
#define SHUNT_EINTR    (-4)   /* a signal handler interrupted a wait (EINTR) */
#define SHUNT_ELEFT    (-1000) /* not an errno: the ring's writer left, the stream goes on over TCP */
#define SHUNT_EVERSION (-1001) /* not an errno: a control frame of an older protocol version (an older hostd) */

/* ---- ring (shm/ring) ---- */

#define SHUNT_RING_HEADER 1024
#define SHUNT_RING_MAGIC  0x47524853u
#define SHUNT_RING_MIN    (4u << 10)
#define SHUNT_RING_MAX    (1u << 30)

enum {
	SHUNT_OFF_MAGIC = 0, SHUNT_OFF_CAPACITY = 8,
	SHUNT_OFF_TAIL = 128, SHUNT_OFF_WMSGS = 136, SHUNT_OFF_WFLAGS = 144, SHUNT_OFF_START = 152,
	SHUNT_OFF_HEAD = 256, SHUNT_OFF_RMSGS = 264,
	SHUNT_OFF_RWAIT = 384, SHUNT_OFF_WWAIT = 448,
	SHUNT_OFF_RESET = 512, SHUNT_OFF_REASON = 516, SHUNT_OFF_RFLAGS = 520,
};

/* Ring flags (shm/ring): the writer's (OFF_WFLAGS) and the reader's
 * (OFF_RFLAGS). STARTED, LEFT, READER_ATTACHED and READER_LEFT are ring
 * format 2, path switching (see shunt_ring_start below). */
enum {
	SHUNT_WF_FIN = 1, SHUNT_WF_STARTED = 2, SHUNT_WF_LEFT = 4,
	SHUNT_RF_CLOSED = 1, SHUNT_RF_ATTACHED = 2, SHUNT_RF_LEFT = 4,
};
#define SHUNT_RING_FORMAT 2
#define SHUNT_SIDE_RELAYED 0x80 /* READY's side bit: a relayed flow (docs/protocol.md) */ /* HELLO and WELCOME carry 1 << SHUNT_RING_FORMAT */

/* One end of a ring. Each end keeps its own index privately and checks the
 * peer's on every load. Not safe for concurrent use (SPSC). */
struct shunt_ring {
	uint8_t *hdr;
	uint8_t *data;
	uint64_t cap, mask;
	uint64_t own;   /* writer: tail; reader: head */
	uint64_t peer;  /* last validated peer index */
	uint64_t msgs;
	int fin;        /* writer: FIN published */
	int left;       /* writer: shunt_ring_leave called */
	void *owner;    /* the struct shunt_flow it belongs to, for kicks */
	/* This process's own, never shared, read and written atomically by
	 * any of its threads: */
	int stop;       /* shunt_ring_stop: waits on this end return at once */
	int sleepers;   /* threads asleep in shunt_ring_wait on this end */
	/* Set once at attach: the peer is a process of this kernel (a vsock
	 * stretch's daemon, stretch.c), so wakes and sleeps are futexes on
	 * the ring's words even in VM mode, where others take kicks. */
	int local;
};

/* Remote waking, for rings in a PCI BAR (a VM's ivshmem mapping): no futex
 * works there, and none would reach another VM's kernel anyway. When set,
 * a waker calls shunt_remote_wake instead of FUTEX_WAKE, and a sleeper
 * calls shunt_remote_sleep instead of FUTEX_WAIT, with the value
 * shunt_remote_seq gave before it announced itself (so a kick in between
 * is not lost). Sleeps must be bounded. A session on a port sets them to
 * the kicks below (shunt_kicks_enable); they are process-wide. */
extern void (*shunt_remote_wake)(struct shunt_ring *r);
extern uint32_t (*shunt_remote_seq)(void);
extern int (*shunt_remote_sleep)(uint32_t seq, int64_t max_ns);

/* Attaches to the ring at mem (len bytes: header + data). want (if non-zero)
 * is the capacity the directory says. Returns 0 or SHUNT_ECORRUPT. */
int shunt_ring_writer(struct shunt_ring *r, void *mem, size_t len, uint64_t want);
int shunt_ring_reader(struct shunt_ring *r, void *mem, size_t len, uint64_t want);

/* Non-blocking copy API: bytes moved, or SHUNT_EAGAIN, SHUNT_ERESET,
 * SHUNT_EPIPE (write), SHUNT_ECORRUPT; read returns 0 at EOF (FIN, drained). */
ssize_t shunt_ring_write(struct shunt_ring *w, const void *buf, size_t n);
ssize_t shunt_ring_read(struct shunt_ring *r, void *buf, size_t n);
/* Copies up to n readable bytes without consuming them: bytes, 0 at EOF, or
 * a negative error like shunt_ring_read. */
ssize_t shunt_ring_peek(struct shunt_ring *r, void *buf, size_t n);
/* Readable bytes now (FIONREAD), or a negative error. */
ssize_t shunt_ring_buffered(struct shunt_ring *r);
int shunt_ring_close_write(struct shunt_ring *w);
/* Resets the ring (as hostd's revoke does) and wakes both its ends: the
 * peer's pending and later calls fail with SHUNT_ERESET (Go: Ring.Abort). */
void shunt_ring_abort(struct shunt_ring *r);
int shunt_ring_close_read(struct shunt_ring *r);

/* Blocking: spin for spin_ns, then sleep on the futex until the ring is
 * readable (reader) or writable (writer), or stopped, or timeout_ns passes
 * (< 0: none). Returns 0 (ready, or stopped: the caller tries its read or
 * write and checks why it stopped), SHUNT_EAGAIN on timeout, or
 * SHUNT_EINTR when a signal handler ran during the sleep and the wait
 * must not go on, as for a socket call (signal(7)): an untimed wait goes
 * on after a handler with SA_RESTART and fails after one without; a timed
 * wait, which stands for a socket with SO_RCVTIMEO or SO_SNDTIMEO, fails
 * after any handler. The kernel decides: an untimed FUTEX_WAIT is
 * restarted by it when the handler has SA_RESTART, a timed one never is
 * (and shunt_kick_sleep keeps the same rule). A handler that runs while
 * the wait still spins interrupts nothing, as a signal that comes just
 * before a system call. Several threads of a process may wait on one end
 * at once. */
int shunt_ring_wait(struct shunt_ring *r, int reader, int64_t spin_ns, int64_t timeout_ns);
/* Ends the waits of this process's threads on this end (reader: the ring
 * it reads, else the ring it writes), now and later: a local shutdown or
 * close, which the ring's flags do not show to this end. shunt_ring_ready
 * reports a stopped end as ready. The peer sees nothing of it. */
void shunt_ring_stop(struct shunt_ring *r, int reader);

/* A spinning waiter yields the CPU once it has spun SHUNT_YIELD_AFTER_NS:
 * the kernel often wakes a sleeping peer on the waker's CPU, and a waiter
 * that only spins there keeps it off the CPU for the whole spin budget
 * (then both ends pay a futex wake-up per message). With nothing else
 * runnable a yield is one system call. Same rule as Go's shm/wait. */
#define SHUNT_YIELD_AFTER_NS 500
void shunt_spin_yield(int64_t spun_ns);
/* Path switching (ring format 2; Go: shm/ring/switch.go, docs/region.md).
 * Each ring carries one stretch of a direction's stream: the writer
 * announces the stream offset of its first byte (start) before writing it
 * and marks the end (leave) before its next byte goes over TCP; the reader
 * reads TCP up to the start, the ring up to the end (a read of the drained
 * ring then returns SHUNT_ELEFT), then TCP again. The writer may start only
 * once the reader attached (so no byte goes to a ring nobody reads); the
 * reader marks that it left once drained (or when hostd says the writer's
 * process is gone). After leave, writes return SHUNT_ELEFT; after the
 * reader left, SHUNT_EPIPE. */
void shunt_ring_start(struct shunt_ring *w, uint64_t off);
void shunt_ring_leave(struct shunt_ring *w);
int shunt_ring_reader_attached(const struct shunt_ring *w);
int shunt_ring_reader_left(const struct shunt_ring *w);
void shunt_ring_attach_reader(struct shunt_ring *r);
/* 1 and *off set once the writer started, else 0. */
int shunt_ring_started(const struct shunt_ring *r, uint64_t *off);
int shunt_ring_writer_left(const struct shunt_ring *r);
void shunt_ring_leave_read(struct shunt_ring *r);
/* The writer's bytes from byte index from (counted like the tail: all
 * bytes ever written) to its tail, copied into buf (at least tail - from
 * bytes), which the reader must not have freed yet: after RESUME a writer
 * resends them on TCP (Go: ring.Writer.Unfreed). The reader's head is read
 * afresh and checked. Bytes copied, SHUNT_EINVAL if from lies before the
 * head or past the tail, SHUNT_ECORRUPT if the head does, SHUNT_ERESET if
 * the region died meanwhile. */
ssize_t shunt_ring_unfreed(struct shunt_ring *w, uint64_t from, void *buf, size_t n);

/* Readable/writable/ended (for poll): 1 if a read or write would not return
 * SHUNT_EAGAIN. */
int shunt_ring_ready(struct shunt_ring *r, int reader);

/* The futex word a sleeper on this ring publishes "waiting" in (the reader's
 * or the writer's), for callers that sleep on several rings at once. */
static inline uint32_t *shunt_ring_wait_word(struct shunt_ring *r, int reader)
{
	return (uint32_t *)(r->hdr + (reader ? SHUNT_OFF_RWAIT : SHUNT_OFF_WWAIT));
}

/* ---- records: one cache line per small message (records.c) ----
 *
 * A mode of the same ring for callers that poll: records written and read
 * in place instead of copied bytes. A record is a 16-byte header and len
 * bytes of payload; every record starts on a SHUNT_REC_LINE line and never
 * wraps (a PAD fills the end), so a small record is one line: header and
 * payload arrive with one cache-line transfer, and the reader detects it
 * by the header's stamp instead of the ring's tail. Native byte order:
 * both ends share the host. The MPI transport also uses the header on its
 * leases, with kinds of its own after SHUNT_REC_PAD; in a ring a record is
 * DATA or PAD. */

#define SHUNT_REC_LINE 64

enum { SHUNT_REC_DATA = 1, SHUNT_REC_PAD = 2 }; /* kinds in a ring; callers number theirs from 3 */

struct shunt_rec {
	uint32_t len;   /* payload bytes */
	uint8_t kind;
	uint8_t tag;    /* the caller's (the MPI transport: the BTL tag) */
	uint16_t pad;   /* ring: bytes between the header and the payload (below) */
	uint64_t stamp; /* ring: epoch + record number, stored last */
};

/* Larger payloads in a ring start where the bulk of their data lands on a
 * 64-byte boundary: the header is padded so that the caller's own header
 * (of hdr bytes, at the payload's start) ends on one. Unaligned
 * destinations make the string copies that memcpy uses several times
 * slower on this kind of machine (measured: the sender copied at a fifth
 * of the receiver's speed). Small payloads are not padded, so that they
 * share the header's line. */
#define SHUNT_REC_ALIGN_FROM 1024
static inline uint16_t shunt_rec_pad(size_t hdr, size_t len)
{
	return len < SHUNT_REC_ALIGN_FROM ? 0 : (uint16_t)((SHUNT_REC_LINE - (sizeof(struct shunt_rec) + hdr) % SHUNT_REC_LINE) % SHUNT_REC_LINE);
}

/* The ring bytes of a record: header, pad and payload, to whole lines. */
static inline size_t shunt_rec_span(size_t len)
{
	return (sizeof(struct shunt_rec) + len + SHUNT_REC_LINE - 1) & ~(size_t)(SHUNT_REC_LINE - 1);
}
static inline void *shunt_rec_payload(struct shunt_rec *h) { return (uint8_t *)(h + 1) + h->pad; }

/* Records in one ring, as one end sees them: r is an attached end
 * (shunt_ring_writer or shunt_ring_reader), epoch the writer's random base
 * for stamps, which both ends must agree on (the MPI transport sends it
 * in its SWITCH mark); next starts at 0. Not safe for concurrent use
 * (SPSC), and not to be mixed with the copy API on the same ring. */
struct shunt_rec_ring {
	struct shunt_ring *r;
	uint64_t epoch; /* the writer's random base for stamps */
	uint64_t next;  /* number of the next record */
	int resv;       /* writer: a reservation is open */
	/* writer: record boundaries before this absolute position may hold
	 * payload or a fresh ring's bytes in their stamp field, so clear_ahead
	 * zeroes them; a stream of one-line records leaves none after its
	 * first lap. 0: not yet set (the first reservation sets it). */
	uint64_t dirty_until;
	uint64_t span;  /* reader: the ring bytes of the record shunt_rec_poll returned, as it checked them */
	/* The index (writer: tail; reader: head) last published in the ring
	 * header: once per stride (an eighth of the ring), and the head when
	 * the writer asks for room; a small record touches its own line only
	 * (records.c). */
	uint64_t shown;
};

/* Writer: room for a record of len bytes after its header (pad and
 * payload), in place, or NULL with *err set (SHUNT_EAGAIN: no room now;
 * SHUNT_ERESET, SHUNT_EPIPE, SHUNT_ECORRUPT, SHUNT_EINVAL: larger than
 * half the ring). At most one reservation is open; shunt_rec_commit or
 * shunt_rec_cancel ends it. */
struct shunt_rec *shunt_rec_reserve(struct shunt_rec_ring *w, size_t len, int *err);
/* Publishes the reserved record: pad bytes, then len payload bytes (pad +
 * len no more than reserved). */
void shunt_rec_commit(struct shunt_rec_ring *w, struct shunt_rec *h, size_t len, uint16_t pad, uint8_t kind, uint8_t tag);
void shunt_rec_cancel(struct shunt_rec_ring *w);
/* Reader: the next record if it has arrived, else NULL; *err is set to
 * SHUNT_ECORRUPT if the ring holds an impossible record. */
struct shunt_rec *shunt_rec_poll(struct shunt_rec_ring *r, int *err);
void shunt_rec_consume(struct shunt_rec_ring *r, const struct shunt_rec *h);
/* Whether the ring was reset (revoked) or its reader closed. */
int shunt_rec_broken(const struct shunt_rec_ring *w);
/* Why the ring was reset: the reason hostd wrote with the reset, or 0
 * (SHUNT_REASON_NONE) if it wrote none. */
uint16_t shunt_rec_reason(const struct shunt_rec_ring *w);

/* ---- region (shm/region) ---- */

#define SHUNT_REGION_HEADER 4096
#define SHUNT_SLOT_SIZE     128
#define SHUNT_CHUNK         4096

struct shunt_region {
	uint8_t *mem;
	uint64_t size, dir_off, heap_off, heap_size;
	uint32_t slots;
};

struct shunt_slot {
	uint32_t state, reason;
	uint64_t gen;
	uint32_t owner_a, owner_b;
	uint64_t ring_ab, ring_ba, capacity;
};

/* Validates the header in mem (mapped bytes) exactly as Go's DecodeHeader. */
int shunt_region_attach(struct shunt_region *g, void *mem, uint64_t mapped);
/* Reads slot i consistently (seqlock) and validates a live entry. */
int shunt_region_slot(struct shunt_region *g, uint32_t i, struct shunt_slot *s);

/* ---- control protocol (internal/proto) ---- */

#define SHUNT_PROTO_VERSION 3
#define SHUNT_PROTO_HEADER  8
#define SHUNT_PROTO_MAX     4096
/* The abstract Unix socket name (after its NUL) hostd serves inside a
 * process guest's network namespace (Go's proto.NetnsControl). */
#define SHUNT_NETNS_CONTROL "shunt/control"
/* The control channel over vsock (docs/vsock.md, "The control channel"):
 * SHUNT_CONTROL=vsock asks for it (Go's guestlib.VsockControl); a VM
 * with SHUNT_VSOCK_DEV and no control port gets it when discovering. The
 * host's port is Go's proto.VsockControlPort. */
#define SHUNT_VSOCK_CONTROL      "vsock"
#define SHUNT_VSOCK_CONTROL_PORT 1021
#define SHUNT_VSOCK_DEV          "/dev/vsock"
#define SHUNT_PROTO_STRING_MAX 1024 /* region and text; Go's maxString: longer ones are cut when encoded */

enum shunt_msg_type {
	SHUNT_HELLO = 1, SHUNT_WELCOME, SHUNT_LISTEN, SHUNT_UNLISTEN, SHUNT_INTENT, SHUNT_OPEN,
	SHUNT_READY, SHUNT_TCP, SHUNT_CLOSE, SHUNT_RELEASE, SHUNT_REVOKE, SHUNT_KICK, SHUNT_PING,
	SHUNT_PONG, SHUNT_REATTACH, SHUNT_ERROR, SHUNT_REGION, SHUNT_UNREGION, SHUNT_DOWN, SHUNT_LEFT,
	SHUNT_RESUME, SHUNT_ENDED, SHUNT_NUM_TYPES
};

/* Why a flow is on TCP or ended (proto.Reason; the same numbers). */
enum shunt_reason {
	SHUNT_REASON_NONE, SHUNT_REASON_LOOPBACK, SHUNT_REASON_NOT_LOCAL, SHUNT_REASON_NO_INTENT,
	SHUNT_REASON_NO_LISTENER, SHUNT_REASON_POLICY, SHUNT_REASON_NOT_OWNER, SHUNT_REASON_NO_CONNTRACK,
	SHUNT_REASON_NOT_ESTABLISHED, SHUNT_REASON_TIMEOUT, SHUNT_REASON_NO_SPACE, SHUNT_REASON_CROSS_GROUP,
	SHUNT_REASON_GUEST_LIMIT, SHUNT_REASON_INTERNAL, SHUNT_REASON_CONNTRACK_GONE,
	SHUNT_REASON_POLICY_RELOAD, SHUNT_REASON_PEER_GONE, SHUNT_REASON_ADMIN, SHUNT_REASON_MALFORMED,
	SHUNT_REASON_NO_HOSTD, SHUNT_REASON_DISABLED, SHUNT_REASON_GUEST_QUOTA, SHUNT_REASON_VERSION,
	SHUNT_REASON_CONTROL_LIMIT, SHUNT_REASON_FIREWALL, SHUNT_REASON_SHUTDOWN, SHUNT_REASON_MIGRATING,
	SHUNT_REASON_NOT_GUEST, SHUNT_REASON_PEER_UNREACHABLE, SHUNT_REASON_VSOCK_PAIR, SHUNT_REASON_VSOCK_DOWN,
	SHUNT_NUM_REASONS
};

/* The reason's name as Go prints it ("no-hostd"), or "?". */
const char *shunt_reason_name(unsigned reason);

/* Roles in OPEN. */
enum { SHUNT_ROLE_ACTIVE = 1, SHUNT_ROLE_PASSIVE = 2 };

struct shunt_addr {
	uint8_t ip[16]; /* IPv4 as IPv4-mapped IPv6 */
	uint16_t port;
};

/* A decoded message: only the fields of its type are meaningful. */
struct shunt_msg {
	uint8_t type;
	uint32_t req_id;
	uint8_t role, side;
	uint8_t relayed; /* READY: the ring pair's other end is the relay to a peer host (side's bit 0x80 on the wire) */
	uint16_t reason;
	struct shunt_addr local, remote;
	uint32_t slot;
	uint64_t gen;
	uint32_t capacity;
	uint64_t ring_ab, ring_ba;
	uint32_t region_id; /* 0: the region WELCOME named; others came by REGION (with an fd) */
	uint32_t guest_id;
	uint64_t region_size;
	char region[SHUNT_PROTO_STRING_MAX + 1];
	uint32_t pid;
	uint64_t nonce;
	char text[SHUNT_PROTO_STRING_MAX + 1];
	uint32_t formats; /* HELLO: ring formats read and written, a bit each; WELCOME: hostd's choice */
	uint64_t offset;  /* RESUME: the writer's next TCP byte, or SHUNT_RESUME_ALL / SHUNT_RESUME_RESET */
};

/* HELLO's formats bit 31 (proto.CapResume): this library handles RESUME.
 * A capability, not a ring format. */
#define SHUNT_CAP_RESUME (UINT32_C(1) << 31)
/* RESUME's special offsets (proto.ResumeAll, proto.ResumeReset). */
#define SHUNT_RESUME_ALL   (UINT64_MAX - 1)
#define SHUNT_RESUME_RESET UINT64_MAX

/* Encodes m into buf (at least SHUNT_PROTO_HEADER + SHUNT_PROTO_MAX bytes);
 * returns the frame length or SHUNT_EINVAL. */
ssize_t shunt_msg_encode(const struct shunt_msg *m, uint8_t *buf, size_t cap);
/* Decodes a whole frame; returns 0 or SHUNT_ECORRUPT (malformed). */
int shunt_msg_decode(const uint8_t *frame, size_t len, struct shunt_msg *m);
/* Validates a header; returns the payload length or SHUNT_ECORRUPT. */
ssize_t shunt_msg_header(const uint8_t *h, uint8_t *type);

/* ---- the session with hostd (guestlib.Client) ----
 *
 * A session is one process's control channel to hostd: a Unix socket, or
 * in a VM a virtio-serial port (docs/vm.md). It opens lazily, says HELLO,
 * maps the region WELCOME names, and keeps a reader thread that hands
 * READY, TCP and DOWN to the connections they name (by request id: the
 * conn callback, or a waiting shunt_session_request), relays REVOKE and
 * KICK, and reconnects when hostd goes away:
 *
 *   ensure --> open --> HELLO --> WELCOME --> map region --> reader
 *                                                             |  EOF or
 *     announce (LISTEN, REATTACH, OPEN) <-- HELLO <-- backoff +  ERROR(no-hostd)
 *
 * HELLO carries the ring formats (1 << SHUNT_RING_FORMAT); a WELCOME that
 * chose none, or a frame of an older protocol version (an older hostd),
 * fails the open with reason version (shunt_session_reason), retried as
 * any failed open. Requests waited on when the channel drops get
 * TCP(no-hostd) at once. A
 * session is safe for concurrent use. It lives as long as the process;
 * there is no close yet (an MPI transport that unloads will need one). In
 * a fork child, the next shunt_session_ensure opens the child's own
 * channel: the parent's reader thread and verdicts stay with the parent.
 * fork from any thread is safe: atfork handlers hold the sessions' locks
 * across it, so the child never finds one held by a thread it does not
 * have (a caller with locks of its own registers its handlers after
 * shunt_session_new, session.c). */

#define SHUNT_PATH_MAX        256          /* device and sysfs paths: longer names are not ours and are skipped */
#define SHUNT_RETRY_NS        1000000000LL /* a failed open is retried at most this often */
#define SHUNT_HELLO_TIMEOUT_S 5            /* WELCOME on a socket */
#define SHUNT_OPEN_WAIT_NS    500000000LL  /* the process's first open is waited for until this long after it began */
#define SHUNT_VSOCK_CONNECT_MS 2000        /* a vsock connect (the kernel's default, set explicitly) */
#define SHUNT_VSOCK_QUIET_NS  30000000000LL /* vsock not tried again after an open that got no answer */
#define SHUNT_PORT_HELLO_NS   200000000LL  /* HELLO again on a port after this */
#define SHUNT_PORT_HELLO_TRIES 25          /* then the port is given up (ETIMEDOUT) */
#define SHUNT_PORT_WRITE_NS   2000000000LL /* a port whose host end is gone takes no data */
#define SHUNT_KEEPALIVE_NS    500000000LL  /* PING on a port, which gives no EOF when hostd restarts */
#define SHUNT_BACKOFF_MIN_MS  50           /* reconnect backoff, doubling */
#define SHUNT_BACKOFF_MAX_MS  1000
#define SHUNT_SYNC_TIMEOUT_MS 1000         /* shunt_session_sync */

struct shunt_session;

struct shunt_session_config {
	/* The Unix socket or the port's character device (VM mode). */
	const char *control;
	/* If control does not exist, look for ports org.shunt.ctl[.N] and use
	 * the first one no other process holds. */
	int discover;
	/* The region to map instead of the one WELCOME names (NULL: WELCOME's,
	 * or on a port the ivshmem BAR). */
	const char *region;
	/* Callbacks, all optional. They run on the session's reader thread,
	 * with no session lock held, and may call shunt_session_send. */
	void *arg;
	void (*log)(void *arg, const char *line);             /* one line, no newline */
	void (*revoked)(void *arg, const struct shunt_msg *m); /* REVOKE: slot, gen, reason */
	/* READY, TCP and DOWN (and RESUME, if caps has SHUNT_CAP_RESUME) for
	 * a connection opened with shunt_session_open (any number, by req_id,
	 * for its whole life; docs/DESIGN.md, path switching). Not called for
	 * a request that shunt_session_request waits on. */
	void (*conn)(void *arg, const struct shunt_msg *m);
	/* Capabilities HELLO announces besides the ring format: SHUNT_CAP_RESUME
	 * when conn handles RESUME (hostd then may give it relayed flows;
	 * docs/protocol.md). Other bits are ignored. */
	uint32_t caps;
	/* After the channel dropped: whether this process holds listeners or
	 * flows a new hostd must hear of (if not, it reconnects only when next
	 * needed), and, once reconnected, tell it (LISTEN, REATTACH). */
	int (*holds)(void *arg);
	void (*announce)(void *arg, struct shunt_session *s);
	/* How long after the process's first open began another thread's
	 * ensure waits for it (0: SHUNT_OPEN_WAIT_NS). */
	int open_wait_ms;
};

/* Makes a session; nothing is opened yet. The strings in c are copied.
 * NULL if there is no memory. */
struct shunt_session *shunt_session_new(const struct shunt_session_config *c);
/* Opens the channel if it is not open: 0, or -1 with errno. A failed open
 * is retried at most every SHUNT_RETRY_NS, so a missing hostd costs a
 * caller nothing. The open runs without the session's lock, one at a
 * time: while another thread opens, a caller waits for that open only if
 * it is the process's first (the threads of a program that connect at
 * its start all reach hostd), until SHUNT_OPEN_WAIT_NS after it began;
 * otherwise, or after that, -1 with ENOTCONN. Sends meanwhile find no
 * channel. A fork waits for an open under way. Not a cancellation
 * point. */
int shunt_session_ensure(struct shunt_session *s);
/* Whether the channel is open now. */
int shunt_session_connected(struct shunt_session *s);
/* Whether the channel is a port (VM mode: BAR region, kicks). */
int shunt_session_vm(struct shunt_session *s);
/* Whether the channel went over vsock (set once, at its first open so):
 * the VM has no region to map, so its flows go over vsock stretches with
 * no SHUNT_VSOCK set (shunt_session_stretches), as Go's do. */
int shunt_session_vsock(struct shunt_session *s);
/* Whether a READY for a region this process has not mapped takes a
 * vsock stretch: SHUNT_VSOCK=1 (shunt_stretch_enabled) or a channel over
 * vsock. */
int shunt_session_stretches(struct shunt_session *s);
/* Sends m without waiting (what the channel does not take now is queued,
 * in order): 0, or -1 if the channel is down, or the queue is full (hostd
 * reads nothing) and m is neither CLOSE nor LEFT. */
int shunt_session_send(struct shunt_session *s, const struct shunt_msg *m);
/* Sends the request m (OPEN), giving it a req_id, and waits up to
 * timeout_ms for its READY or TCP. reply is always set: on a lost channel
 * TCP(no-hostd), on timeout TCP(timeout). Any number of requests may be in
 * flight. */
void shunt_session_request(struct shunt_session *s, struct shunt_msg *m, struct shunt_msg *reply, int timeout_ms);
/* Sends OPEN m without waiting for anything: its answers (READY, TCP,
 * DOWN) come to the config's conn callback. A zero m->req_id gets a new
 * one, unique in the session; a non-zero one is kept (the same connection
 * announced again after a reconnect). 0, or -1 if the channel is down or
 * its queue full (m->req_id is set either way). */
int shunt_session_open(struct shunt_session *s, struct shunt_msg *m);
/* A fresh request id, for a caller that must know it before OPEN goes out
 * (its answer may come at once). */
uint32_t shunt_session_new_req(struct shunt_session *s);
/* Why the channel is not open (the last open failed): SHUNT_REASON_VERSION
 * when hostd is older or shares no ring format with us (it is retried, as
 * any failed open), else SHUNT_REASON_NO_HOSTD. */
unsigned shunt_session_reason(struct shunt_session *s);
/* Waits until hostd has processed everything sent so far (PING/PONG), up
 * to SHUNT_SYNC_TIMEOUT_MS: a LISTEN is in effect before it returns. */
void shunt_session_sync(struct shunt_session *s);
/* Starts fn(arg) on a thread of the library's with all signals blocked
 * (the program's handlers never run on it): joinable into *th, or
 * detached when th is NULL; stack bytes of stack (0: the default). 0, or
 * pthread_create's error. */
int shunt_thread_start(pthread_t *th, size_t stack, void *(*fn)(void *), void *arg);

/* ---- flows ---- */

/* This end of a fast-path flow: its two rings as this end sees them. The
 * rings are SPSC: one reader and one writer at a time. */
struct shunt_flow {
	struct shunt_ring w, r;        /* this end writes w and reads r */
	uint32_t region_id;            /* its region: 0 WELCOME's, others came by REGION */
	void *hold;                    /* its hold on that region's mapping (shunt_flow_detach) */
	uint32_t slot;
	uint64_t gen;
	uint8_t side;                  /* 1: A (the connecting end), 2: B */
	uint32_t req;                  /* the connection's request id (READY's), for LEFT and CLOSE */
	struct shunt_session *session; /* for CLOSE and KICK */
	void *stretch;                 /* a vsock stretch's (stretch.c), or NULL: the rings are a region's */
};

/* Attaches f to the flow a READY names: finds the region it names (region
 * 0, or one that came by REGION), checks the READY against that region's
 * directory and attaches both rings; f holds the region's mapping until
 * shunt_flow_detach. 0, or SHUNT_ECORRUPT if READY and the region disagree
 * or the region is not mapped (then the caller sends CLOSE and stays on
 * TCP). */
int shunt_flow_attach(struct shunt_session *s, const struct shunt_msg *ready, struct shunt_flow *f);
/* Gives back f's hold on its region, once nothing will touch f's rings
 * again (the flow is freed): a region that hostd took back (UNREGION) is
 * unmapped when its last flow lets go. Idempotent. */
void shunt_flow_detach(struct shunt_flow *f);
/* vsock stretches (stretch.c; docs/vsock.md, "The C library's
 * stretches"). With SHUNT_VSOCK=1 (shunt_stretch_enabled), a READY for a
 * region this process has not mapped (a VM without ivshmem) attaches f to
 * a ring pair that shunt-vstretchd ($SHUNT_VSTRETCHD, default
 * /run/shunt/vstretchd.sock) bridges to the host over vsock; without the
 * daemon shunt_flow_attach fails as for a missing region (the caller
 * gives the READY back and stays on TCP), and says why in the log. */
int shunt_stretch_enabled(void);
/* Whether f's rings are a stretch's. */
int shunt_flow_stretch(const struct shunt_flow *f);
/* After this end's writer left f's write ring (close, shutdown): waits
 * until the daemon's bridge carried the ring's last bytes and its LEFT to
 * the host, at most about 12 s. 0 (also for a region's flow), or -1 if it
 * did not (said in the log). */
int shunt_flow_drain(struct shunt_flow *f);
/* RESUME for a stretch flow (docs/vsock.md, "Switching back"): stops its
 * bridge (which marks the read ring left where its bytes end) and sends
 * hostd ENDED with that offset (SHUNT_RESUME_ALL if nothing came). 1 if
 * f is a stretch's, 0 (nothing done) otherwise. */
int shunt_flow_stretch_end(struct shunt_flow *f, unsigned reason);

/* How many regions that came by REGION are mapped now (for tests). */
int shunt_session_regions(struct shunt_session *s);
/* Whether either ring is reset. hostd resets both, one after the other; a
 * peer that saw the first may already have closed (FIN) the other, so an
 * end that reads EOF checks both before it believes it. */
int shunt_flow_reset(const struct shunt_flow *f);
/* Tells hostd this end is done with the flow (CLOSE); hostd frees the slot
 * when both ends are. The rings are left alone: FIN first
 * (shunt_ring_close_write) if the peer should read EOF. */
int shunt_flow_close(const struct shunt_flow *f);
/* Tells hostd this end left both of f's rings (LEFT): the pair may be
 * freed once the peer left too. */
int shunt_flow_left(const struct shunt_flow *f);

/* ---- VM discovery (vhost/vserial.FindAll, vhost/ivshmem.Find) ---- */

/* The Shunt control ports of this VM in index order (org.shunt.ctl, then
 * org.shunt.ctl.1, ...): the udev link /dev/virtio-ports/NAME where there
 * is one, else /dev/vportNpM found by name under /sys/class/virtio-ports.
 * Any number; a NULL-terminated array, freed with shunt_free_ports. NULL
 * if there is no memory. */
char **shunt_find_ports(void);
void shunt_free_ports(char **ports);
/* Finds the ivshmem device (PCI 1af4:1110; the first in address order),
 * enables it unless it is already and writes the path of its memory BAR
 * (resource2) to out: 0, or -1 if there is none. docs/vm.md, "Discovery". */
int shunt_find_bar(char *out, size_t n);
/* Opens the memory BAR of the ivshmem device plugged for pair region id
 * (vm_regions = "pair"): the device whose region header names id and a
 * pair with guest gid, size bytes. Its fd (O_RDWR), or -1 if no device
 * does (yet). docs/vm.md, "Pair regions". */
int shunt_open_pair_bar(uint32_t id, uint32_t gid, uint64_t size);
/* Asks the guest kernel to rescan its PCI buses (root), for a plugged
 * device that ACPI or PCIe hotplug did not announce. */
void shunt_pci_rescan(void);

/* ---- kicks (VM mode) ----
 *
 * A process-wide count, bumped for every KICK any session receives. A
 * sleeper reads it, publishes "waiting" in its rings, and sleeps on it as a
 * futex word for at most SHUNT_KICK_MAX_SLEEP_NS: a lost kick costs
 * latency, never a hang. Spurious wake-ups (a kick for another ring) are
 * harmless: the sleeper re-checks its rings. */
#define SHUNT_KICK_MAX_SLEEP_NS 20000000LL

/* Turns on remote waking for all rings of the process (a session does this
 * when it opens a port). */
void shunt_kicks_enable(void);
int shunt_kicks_enabled(void);
uint32_t shunt_kick_seq(void);
/* The count's address, to sleep on it with other futex words (futex_waitv). */
uint32_t *shunt_kick_word(void);
/* Sleeps until the count moves from seq, max_ns passes (< 0: none) or
 * SHUNT_KICK_MAX_SLEEP_NS passes: 0, or SHUNT_EINTR as shunt_ring_wait
 * says (max_ns >= 0: after any signal handler; < 0: after one without
 * SA_RESTART, where futex_waitv exists, Linux 5.16+; before that a signal
 * only ends one sleep early). */
int shunt_kick_sleep(uint32_t seq, int64_t max_ns);
/* Bumps the count and wakes its sleepers, as a KICK does: for an event of
 * this process's own (hostd's DOWN or READY) that sleepers on the count
 * must see in VM mode. */
void shunt_kick_local(void);

/* SIGBUS on region memory (fault.c): the core handles a fault inside a
 * region it mapped and chains any other to the application's handler.
 * A program that sets its own SIGBUS handler after the core installed
 * its own (the preload library's sigaction) records it here instead:
 * 0, with the previous chained handler in *old; -1 if the core has no
 * handler installed (make the real call then). */
struct sigaction;
int shunt_fault_sigaction(const struct sigaction *act, struct sigaction *old);

#endif
