/* Shunt's shared-memory data path and control protocol in C: the same ring
 * format v1 (docs/region.md) and control protocol v1 (docs/protocol.md) as
 * the Go packages shm/ring, shm/region and internal/proto, for the
 * LD_PRELOAD library. Cross-language tests (preload_test.go) keep the two
 * implementations in step.
 *
 * Everything read from shared memory is validated, as in Go: a corrupt or
 * hostile peer makes its own flow fail (SHUNT_ECORRUPT), never this process
 * read or write outside the region. */
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

/* ---- ring (shm/ring) ---- */

#define SHUNT_RING_HEADER 1024
#define SHUNT_RING_MAGIC  0x47524853u
#define SHUNT_RING_MIN    (4u << 10)
#define SHUNT_RING_MAX    (1u << 30)

enum {
	SHUNT_OFF_MAGIC = 0, SHUNT_OFF_CAPACITY = 8,
	SHUNT_OFF_TAIL = 128, SHUNT_OFF_WMSGS = 136, SHUNT_OFF_WFLAGS = 144,
	SHUNT_OFF_HEAD = 256, SHUNT_OFF_RMSGS = 264,
	SHUNT_OFF_RWAIT = 384, SHUNT_OFF_WWAIT = 448,
	SHUNT_OFF_RESET = 512, SHUNT_OFF_REASON = 516, SHUNT_OFF_RFLAGS = 520,
};

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
	void *owner;    /* the library's flow, for the remote hooks */
};

/* Remote waking, for rings in a PCI BAR (a VM's ivshmem mapping): no futex
 * works there, and none would reach another VM's kernel anyway. When set,
 * a waker calls shunt_remote_wake instead of FUTEX_WAKE (the library sends
 * KICK through hostd), and a sleeper calls shunt_remote_sleep instead of
 * FUTEX_WAIT, with the value shunt_remote_seq gave before it announced
 * itself (so a kick in between is not lost). Sleeps must be bounded. */
extern void (*shunt_remote_wake)(struct shunt_ring *r);
extern uint32_t (*shunt_remote_seq)(void);
extern void (*shunt_remote_sleep)(uint32_t seq, int64_t max_ns);

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
 * readable (reader) or writable (writer), or timeout_ns passes (< 0: none).
 * Returns 0 or SHUNT_EAGAIN on timeout. */
int shunt_ring_wait(struct shunt_ring *r, int reader, int64_t spin_ns, int64_t timeout_ns);
/* Readable/writable/ended (for poll): 1 if a read or write would not return
 * SHUNT_EAGAIN. */
int shunt_ring_ready(struct shunt_ring *r, int reader);

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

#define SHUNT_PROTO_VERSION 1
#define SHUNT_PROTO_HEADER  8
#define SHUNT_PROTO_MAX     4096

enum shunt_msg_type {
	SHUNT_HELLO = 1, SHUNT_WELCOME, SHUNT_LISTEN, SHUNT_UNLISTEN, SHUNT_INTENT, SHUNT_OPEN,
	SHUNT_READY, SHUNT_TCP, SHUNT_CLOSE, SHUNT_RELEASE, SHUNT_REVOKE, SHUNT_KICK, SHUNT_PING,
	SHUNT_PONG, SHUNT_REATTACH, SHUNT_ERROR, SHUNT_NUM_TYPES
};

struct shunt_addr {
	uint8_t ip[16]; /* IPv4 as IPv4-mapped IPv6 */
	uint16_t port;
};

/* A decoded message: only the fields of its type are meaningful. */
struct shunt_msg {
	uint8_t type;
	uint32_t req_id;
	uint8_t role, side;
	uint16_t reason;
	struct shunt_addr local, remote;
	uint32_t slot;
	uint64_t gen;
	uint32_t capacity;
	uint64_t ring_ab, ring_ba;
	uint32_t guest_id;
	uint64_t region_size;
	char region[1025];
	uint32_t pid;
	uint64_t nonce;
	char text[1025];
};

/* Encodes m into buf (at least SHUNT_PROTO_HEADER + SHUNT_PROTO_MAX bytes);
 * returns the frame length or SHUNT_EINVAL. */
ssize_t shunt_msg_encode(const struct shunt_msg *m, uint8_t *buf, size_t cap);
/* Decodes a whole frame; returns 0 or SHUNT_ECORRUPT (malformed). */
int shunt_msg_decode(const uint8_t *frame, size_t len, struct shunt_msg *m);
/* Validates a header; returns the payload length or SHUNT_ECORRUPT. */
ssize_t shunt_msg_header(const uint8_t *h, uint8_t *type);

#endif
