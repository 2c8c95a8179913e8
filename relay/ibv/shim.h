//go:build rdma && cgo && linux

// shim.h: the RDMA link's C shim over libibverbs: one RC queue pair, its
// completion queue and channel, a send buffer and a receive ring (each
// followed by a 64-byte credit area), and the few verbs the link posts.
#ifndef SHUNT_IBV_SHIM_H
#define SHUNT_IBV_SHIM_H
#include <stdint.h>
#include <stddef.h>

#define SHIM_CREDIT 64 /* the credit area after each buffer */
#define SHIM_STASH 64  /* completions reaped while arming */

enum { SHIM_OP_WRITE = 1, SHIM_OP_CREDIT = 2, SHIM_OP_RECV = 3 };

struct shim_wc {
	uint8_t op;
	int status;     /* enum ibv_wc_status; -1: an incoming operation other than write with immediate */
	uint32_t imm;   /* host order */
};

struct shim_info {
	uint32_t qpn, psn;
	uint16_t lid;
	uint8_t mtu;
	uint8_t gid[16];
	uint64_t ring;
	uint32_t rkey;
};

struct shim;

/* One scatter entry of shim_write_sg: len bytes at addr of memory whose
 * registration's local key is lkey (checked by the Go side against the
 * registration's bounds; the NIC checks them again). */
struct shim_sge {
	uint64_t addr;
	uint32_t len;
	uint32_t lkey;
};

#define SHIM_MAX_SGE 16 /* scatter entries a write may gather, at most */

int shim_open(const char *dev, int port, int gid_index, uint32_t size, int depth, uint32_t psn,
              struct shim **out, struct shim_info *info, char *err, int errlen);
int shim_connect(struct shim *s, const struct shim_info *peer, char *err, int errlen);
void *shim_send_buf(struct shim *s);
void *shim_recv_buf(struct shim *s);
int shim_write(struct shim *s, uint32_t off, uint32_t n);
/* Zero copy, sending side: guest memory registered for the local NIC to
 * read (no remote access), and a write that gathers from it. */
int shim_max_sge(struct shim *s);
uint32_t shim_send_lkey(struct shim *s);
void *shim_reg(struct shim *s, void *addr, size_t len, uint32_t *lkey, char *err, int errlen);
int shim_dereg(void *mr);
int shim_write_sg(struct shim *s, uint32_t off, uint32_t n, const struct shim_sge *sg, int k);
int shim_write_credit(struct shim *s, uint64_t bytes, uint64_t batches);
int shim_post_recv(struct shim *s, int k);
int shim_poll(struct shim *s, struct shim_wc *wcs, int n);
int shim_sleep(struct shim *s, int timeout_ms);
int shim_break(struct shim *s);
/* The device's uverbs node in sysfs (/sys/class/infiniband_verbs/uverbsN)
 * and name: the kernel deletes the node first when the device's removal
 * begins, then waits for every process that holds it to close it. */
const char *shim_dev_path(struct shim *s);
const char *shim_dev_name(struct shim *s);
void shim_close(struct shim *s);
#endif
