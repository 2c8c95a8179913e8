//go:build rdma && cgo && linux

// shim.c: see shim.h. Errors return -errno (or -1) with a message in err
// where there is one; the Go side (ibv_rdma.go) turns them into errors.
#include "shim.h"

#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

struct shim {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_comp_channel *ch;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *smr, *rmr;
	char *sbuf, *rbuf;
	uint32_t size;
	int depth;
	uint8_t port;
	int gid_index;
	enum ibv_mtu mtu;
	uint32_t psn;
	uint64_t peer_ring;
	uint32_t peer_rkey;
	int max_sge; /* scatter entries a write may gather (the queue pair's) */
	char dev_path[256]; /* the device's uverbs node in sysfs: gone once its removal begins */
	char dev_name[64];
	struct shim_wc stash[SHIM_STASH];
	int nstash;
};

#define FAIL(...) do { snprintf(err, errlen, __VA_ARGS__); goto fail; } while (0)

int shim_open(const char *dev, int port, int gid_index, uint32_t size, int depth, uint32_t psn,
              struct shim **out, struct shim_info *info, char *err, int errlen)
{
	struct shim *s = calloc(1, sizeof *s);
	struct ibv_device **list = NULL;
	int n = 0;
	if (!s) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	s->size = size;
	s->depth = depth;
	s->port = (uint8_t)port;
	s->gid_index = gid_index;
	s->psn = psn & 0xffffff;
	list = ibv_get_device_list(&n);
	if (!list || n == 0)
		FAIL("no RDMA device (ibv_get_device_list: %s)", list ? "none" : strerror(errno));
	for (int i = 0; i < n; i++) {
		if (dev[0] == 0 || strcmp(ibv_get_device_name(list[i]), dev) == 0) {
			s->ctx = ibv_open_device(list[i]);
			snprintf(s->dev_path, sizeof s->dev_path, "%s", list[i]->dev_path);
			snprintf(s->dev_name, sizeof s->dev_name, "%s", ibv_get_device_name(list[i]));
			break;
		}
	}
	if (!s->ctx)
		FAIL("device %s: not found or not opened", dev[0] ? dev : "(first)");
	ibv_free_device_list(list);
	list = NULL;

	struct ibv_port_attr pa;
	if (ibv_query_port(s->ctx, s->port, &pa))
		FAIL("query port %d: %s", port, strerror(errno));
	if (pa.state != IBV_PORT_ACTIVE)
		FAIL("port %d is not active (state %d)", port, pa.state);
	s->mtu = pa.active_mtu;
	union ibv_gid gid;
	memset(&gid, 0, sizeof gid);
	if (gid_index >= 0 && ibv_query_gid(s->ctx, s->port, gid_index, &gid))
		FAIL("query gid %d: %s", gid_index, strerror(errno));

	if (!(s->pd = ibv_alloc_pd(s->ctx)))
		FAIL("alloc pd: %s", strerror(errno));
	if (!(s->ch = ibv_create_comp_channel(s->ctx)))
		FAIL("completion channel: %s", strerror(errno));
	int fl = fcntl(s->ch->fd, F_GETFL);
	if (fl < 0 || fcntl(s->ch->fd, F_SETFL, fl | O_NONBLOCK) < 0)
		FAIL("completion channel nonblocking: %s", strerror(errno));
	if (!(s->cq = ibv_create_cq(s->ctx, 4 * depth + 8, NULL, s->ch, 0)))
		FAIL("create cq: %s", strerror(errno));
	if (posix_memalign((void **)&s->sbuf, 4096, size + SHIM_CREDIT) ||
	    posix_memalign((void **)&s->rbuf, 4096, size + SHIM_CREDIT))
		FAIL("buffers of %u bytes: out of memory", size);
	memset(s->sbuf, 0, size + SHIM_CREDIT);
	memset(s->rbuf, 0, size + SHIM_CREDIT);
	/* The send buffer is read by this NIC only; the ring and its credit
	 * area are the one region the peer may write. */
	if (!(s->smr = ibv_reg_mr(s->pd, s->sbuf, size + SHIM_CREDIT, IBV_ACCESS_LOCAL_WRITE)))
		FAIL("register send buffer: %s", strerror(errno));
	if (!(s->rmr = ibv_reg_mr(s->pd, s->rbuf, size + SHIM_CREDIT, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)))
		FAIL("register ring: %s", strerror(errno));

	struct ibv_qp_init_attr ia;
	memset(&ia, 0, sizeof ia);
	ia.send_cq = s->cq;
	ia.recv_cq = s->cq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = 2 * depth + 4;
	ia.cap.max_recv_wr = depth + 1;
	/* Gathers from guests' rings (shim_write_sg): as many entries as the
	 * device gives, up to SHIM_MAX_SGE. */
	struct ibv_device_attr da;
	int want_sge = 1;
	if (ibv_query_device(s->ctx, &da) == 0 && da.max_sge > 1)
		want_sge = da.max_sge < SHIM_MAX_SGE ? da.max_sge : SHIM_MAX_SGE;
	ia.cap.max_send_sge = want_sge;
	ia.cap.max_recv_sge = 1;
	ia.cap.max_inline_data = 16;
	if (!(s->qp = ibv_create_qp(s->pd, &ia)))
		FAIL("create qp: %s", strerror(errno));
	s->max_sge = (int)ia.cap.max_send_sge < want_sge ? (int)ia.cap.max_send_sge : want_sge;

	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = s->port;
	a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		FAIL("qp to INIT: %s", strerror(errno));

	memset(info, 0, sizeof *info);
	info->qpn = s->qp->qp_num;
	info->psn = s->psn;
	info->lid = pa.lid;
	info->mtu = (uint8_t)s->mtu;
	memcpy(info->gid, gid.raw, 16);
	info->ring = (uint64_t)(uintptr_t)s->rbuf;
	info->rkey = s->rmr->rkey;
	*out = s;
	return 0;
fail:
	if (list)
		ibv_free_device_list(list);
	shim_close(s);
	return -1;
}

int shim_connect(struct shim *s, const struct shim_info *peer, char *err, int errlen)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = peer->mtu < s->mtu ? (enum ibv_mtu)peer->mtu : s->mtu;
	a.dest_qp_num = peer->qpn;
	a.rq_psn = peer->psn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = peer->lid;
	a.ah_attr.port_num = s->port;
	if (s->gid_index >= 0) {
		a.ah_attr.is_global = 1;
		memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
		a.ah_attr.grh.sgid_index = (uint8_t)s->gid_index;
		a.ah_attr.grh.hop_limit = 64;
	}
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
	                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
		snprintf(err, errlen, "qp to RTR: %s", strerror(errno));
		return -1;
	}
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	/* The ACK timeout: 4.096 us * 2^18, about 1 s. Loss is rare on RoCE
	 * and InfiniBand fabrics, so a slow recovery costs little, while a
	 * retransmission of a write whose ACK is merely late costs more:
	 * under TCG, SoftRoCE's ACKs come tens of ms late when the machine is
	 * busy, and a write retransmitted mid-message once failed with
	 * "remote invalid request" (rxe in Debian's 6.1). */
	a.timeout = 18;
	/* 6, not 7: SoftRoCE (rxe) takes a retry_cnt of 7 as "retry for
	 * ever", as the spec has it for rnr_retry only, so a fabric that
	 * silently drops the link's packets never ended it (TestRDMAHostd:
	 * the RoCE packets dropped, 67 retries in a minute, no error). With 6
	 * the link ends some 7 s after the last ACK, on every device. */
	a.retry_cnt = 6;
	a.rnr_retry = 6; /* finite: a peer that stops posting receives errors the link */
	a.sq_psn = s->psn;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
	                                 IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) {
		snprintf(err, errlen, "qp to RTS: %s", strerror(errno));
		return -1;
	}
	s->peer_ring = peer->ring;
	s->peer_rkey = peer->rkey;
	return 0;
}

void *shim_send_buf(struct shim *s) { return s->sbuf; }
void *shim_recv_buf(struct shim *s) { return s->rbuf; }

int shim_write(struct shim *s, uint32_t off, uint32_t n)
{
	if ((uint64_t)off + n > s->size)
		return -EINVAL;
	struct ibv_sge sge = {.addr = (uintptr_t)(s->sbuf + off), .length = n, .lkey = s->smr->lkey};
	struct ibv_send_wr wr, *bad;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = SHIM_OP_WRITE;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.imm_data = htonl(n);
	wr.wr.rdma.remote_addr = s->peer_ring + off;
	wr.wr.rdma.rkey = s->peer_rkey;
	return -ibv_post_send(s->qp, &wr, &bad);
}

int shim_max_sge(struct shim *s) { return s->max_sge; }
uint32_t shim_send_lkey(struct shim *s) { return s->smr->lkey; }

/* shim_reg registers guest memory for this NIC to read: access 0 is
 * local read only (no remote key is ever handed out for it). The pages
 * stay pinned until shim_dereg. */
void *shim_reg(struct shim *s, void *addr, size_t len, uint32_t *lkey, char *err, int errlen)
{
	struct ibv_mr *mr = ibv_reg_mr(s->pd, addr, len, 0);
	if (!mr) {
		snprintf(err, errlen, "register %zu bytes for local read: %s", len, strerror(errno));
		return NULL;
	}
	*lkey = mr->lkey;
	return mr;
}

int shim_dereg(void *mr) { return -ibv_dereg_mr((struct ibv_mr *)mr); }

/* shim_write_sg is shim_write gathering from k entries (n bytes in all)
 * into the peer's ring at off. */
int shim_write_sg(struct shim *s, uint32_t off, uint32_t n, const struct shim_sge *sg, int k)
{
	if ((uint64_t)off + n > s->size || k < 1 || k > s->max_sge)
		return -EINVAL;
	struct ibv_sge sge[SHIM_MAX_SGE];
	uint64_t total = 0;
	for (int i = 0; i < k; i++) {
		sge[i].addr = sg[i].addr;
		sge[i].length = sg[i].len;
		sge[i].lkey = sg[i].lkey;
		total += sg[i].len;
	}
	if (total != n)
		return -EINVAL;
	struct ibv_send_wr wr, *bad;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = SHIM_OP_WRITE;
	wr.sg_list = sge;
	wr.num_sge = k;
	wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.imm_data = htonl(n);
	wr.wr.rdma.remote_addr = s->peer_ring + off;
	wr.wr.rdma.rkey = s->peer_rkey;
	return -ibv_post_send(s->qp, &wr, &bad);
}

int shim_write_credit(struct shim *s, uint64_t bytes, uint64_t batches)
{
	uint64_t *c = (uint64_t *)(s->sbuf + s->size);
	c[0] = htole64(bytes); /* the wire's order, as the frames' */
	c[1] = htole64(batches);
	struct ibv_sge sge = {.addr = (uintptr_t)c, .length = 16, .lkey = s->smr->lkey};
	struct ibv_send_wr wr, *bad;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = SHIM_OP_CREDIT;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_RDMA_WRITE;
	wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	wr.wr.rdma.remote_addr = s->peer_ring + s->size;
	wr.wr.rdma.rkey = s->peer_rkey;
	return -ibv_post_send(s->qp, &wr, &bad);
}

int shim_post_recv(struct shim *s, int k)
{
	for (int i = 0; i < k; i++) {
		struct ibv_recv_wr wr, *bad;
		memset(&wr, 0, sizeof wr);
		wr.wr_id = SHIM_OP_RECV;
		int rc = ibv_post_recv(s->qp, &wr, &bad);
		if (rc)
			return -rc;
	}
	return 0;
}

static int reap(struct shim *s, struct shim_wc *out, int n)
{
	struct ibv_wc wc[SHIM_STASH];
	if (n > SHIM_STASH)
		n = SHIM_STASH;
	int got = ibv_poll_cq(s->cq, n, wc);
	if (got < 0)
		return -EIO;
	for (int i = 0; i < got; i++) {
		out[i].op = (uint8_t)wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].imm = 0;
		if (wc[i].status == IBV_WC_SUCCESS && wc[i].wr_id == SHIM_OP_RECV) {
			/* Only a write with immediate may take a receive: a send
			 * from the peer is a protocol error. */
			if (wc[i].opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc[i].wc_flags & IBV_WC_WITH_IMM))
				out[i].status = -1;
			else
				out[i].imm = ntohl(wc[i].imm_data);
		}
	}
	return got;
}

int shim_poll(struct shim *s, struct shim_wc *wcs, int n)
{
	int k = 0;
	if (s->nstash) {
		k = s->nstash < n ? s->nstash : n;
		memcpy(wcs, s->stash, k * sizeof *wcs);
		memmove(s->stash, s->stash + k, (s->nstash - k) * sizeof *wcs);
		s->nstash -= k;
		return k;
	}
	return reap(s, wcs, n);
}

/* shim_sleep arms the completion queue, reaps what came meanwhile into
 * the stash (then it returns at once), else waits on the channel. */
int shim_sleep(struct shim *s, int timeout_ms)
{
	if (s->nstash)
		return 0;
	if (ibv_req_notify_cq(s->cq, 0))
		return -EIO;
	int got = reap(s, s->stash, SHIM_STASH);
	if (got < 0)
		return got;
	s->nstash = got;
	if (got)
		return 0;
	struct pollfd p = {.fd = s->ch->fd, .events = POLLIN};
	int rc = poll(&p, 1, timeout_ms);
	if (rc < 0)
		return errno == EINTR ? 0 : -errno;
	if (rc == 0)
		return 0;
	struct ibv_cq *cq;
	void *ctx;
	if (ibv_get_cq_event(s->ch, &cq, &ctx) == 0)
		ibv_ack_cq_events(cq, 1);
	return 0;
}

/* shim_break moves the queue pair to the error state (a fault for tests:
 * its work requests flush in error, the peer's writes fail). */
int shim_break(struct shim *s)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_ERR;
	return -ibv_modify_qp(s->qp, &a, IBV_QP_STATE);
}

const char *shim_dev_path(struct shim *s) { return s->dev_path; }
const char *shim_dev_name(struct shim *s) { return s->dev_name; }

void shim_close(struct shim *s)
{
	if (!s)
		return;
	if (s->qp)
		ibv_destroy_qp(s->qp);
	if (s->smr)
		ibv_dereg_mr(s->smr);
	if (s->rmr)
		ibv_dereg_mr(s->rmr);
	if (s->cq)
		ibv_destroy_cq(s->cq);
	if (s->ch)
		ibv_destroy_comp_channel(s->ch);
	if (s->pd)
		ibv_dealloc_pd(s->pd);
	if (s->ctx)
		ibv_close_device(s->ctx);
	free(s->sbuf);
	free(s->rbuf);
	free(s);
}
