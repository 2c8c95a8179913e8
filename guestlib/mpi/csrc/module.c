/* The BTL module (btl_shunt.h): ob1's entry points.
 *
 * Reachability (add_procs): a peer in another guest is reachable once its
 * lease connected; the lease is opened right here, when ob1 first needs the
 * peer (Open MPI adds peers lazily, at the first send), and never blocks on
 * the peer's accept (the kernel completes the handshake). A refused or
 * timed-out connect leaves the peer to the next BTL in the list (tcp) and
 * says why. Peers in this guest are left to vader (OPAL_PROC_ON_LOCAL_NODE,
 * as vader decides). Once reachable, a peer stays reachable: hostd's READY
 * and DOWN only move its stream between lease and ring.
 *
 * Sending: sendi writes ob1's header and the packed data straight into the
 * ring as one record (for a small message, one cache line), with no lock
 * and no allocation; prepare_src reserves the record in the ring and lets
 * ob1 pack into it (send commits it); fragments that cannot go into the
 * ring now wait in the endpoint's queue, in order, and progress moves them.
 * On a lease, fragments are written with writev and the rest waits for
 * EPOLLOUT. Large messages use ob1's send protocols (rendezvous, then
 * fragments of btl_max_send_size): the BTL has no put or get. */
#include "btl_shunt.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "opal/class/opal_bitmap.h"
#include "opal/mca/hwloc/hwloc-internal.h"

/* ---- fragments ---- */

struct frag *frag_get(size_t size)
{
	int large = size > SMALL_FRAG;
	struct frag **pool = large ? &shunt_btl.free_large : &shunt_btl.free_small, *f = *pool;
	if (f) {
		*pool = f->next;
	} else {
		size_t cap = large ? shunt_btl.super.btl_max_send_size : SMALL_FRAG;
		if (size > cap || !(f = malloc(sizeof *f + cap)))
			return NULL;
		memset(f, 0, sizeof *f);
		OBJ_CONSTRUCT(&f->base, mca_btl_base_descriptor_t);
		f->buf = (uint8_t *)(f + 1);
		f->cap = cap;
		f->large = large;
	}
	f->base.des_segments = &f->seg;
	f->base.des_segment_count = 1;
	f->base.des_flags = 0;
	f->base.des_cbfunc = NULL;
	f->base.order = MCA_BTL_NO_ORDER;
	f->seg.seg_addr.pval = f->buf;
	f->seg.seg_len = size;
	f->next = NULL;
	f->ep = NULL;
	f->hdr = (struct shunt_rec){0};
	f->done = 0;
	f->where = FRAG_HEAP;
	f->internal = 0;
	f->raw = 0;
	f->rh = NULL;
	return f;
}

void frag_put(struct frag *f)
{
	struct frag **pool = f->large ? &shunt_btl.free_large : &shunt_btl.free_small;
	f->next = *pool;
	*pool = f;
}

struct frag *frag_control(uint8_t kind, const void *payload, size_t len)
{
	struct frag *f = frag_get(len);
	if (!f)
		return NULL;
	if (len)
		memcpy(f->buf, payload, len);
	f->internal = 1;
	f->hdr = (struct shunt_rec){.len = len, .kind = kind};
	return f;
}

void frag_done(struct frag *f)
{
	if (f->base.des_flags & MCA_BTL_DES_SEND_ALWAYS_CALLBACK)
		f->base.des_cbfunc(&shunt_btl.super, f->ep, &f->base, OPAL_SUCCESS);
	if (f->base.des_flags & MCA_BTL_DES_FLAGS_BTL_OWNERSHIP)
		frag_put(f);
}

/* done_now completes a fragment inside btl_send: return 1 tells ob1 the
 * send completed (its callback ran only if it asked for it). */
static int done_now(struct frag *f)
{
	frag_done(f);
	return 1;
}

void peer_failed(struct mca_btl_base_endpoint_t *ep, const char *why)
{
	static int failed;
	if (!ep || shunt_btl.finalizing)
		return;
	char msg[256];
	snprintf(msg, sizeof msg, "btl/shunt: %s: %s", ep->who, why);
	say(0, "ERROR: %s: %s", ep->who, why);
	if (failed++)
		return;
	if (shunt_btl.error_cb)
		shunt_btl.error_cb(&shunt_btl.super, MCA_BTL_ERROR_FLAGS_FATAL,
				   ep->proc ? ep->proc : (opal_proc_t *)opal_proc_local_get(), msg);
}

/* ---- the ring ---- */

/* ring_put copies f into ep's ring: 1, or 0 if it must wait (no room, or
 * the ring broke: paths_step moves the stream back to the lease). */
static int ring_put(struct mca_btl_base_endpoint_t *ep, struct frag *f)
{
	struct conn *c = ep->tx;
	int err;
	if (c->relayed)
		return relay_put(ep, f->hdr.tag, f->seg.seg_addr.pval, f->seg.seg_len);
	uint16_t pad = shunt_rec_pad(0, f->seg.seg_len);
	struct shunt_rec *h = shunt_rec_reserve(&c->rr, pad + f->seg.seg_len, &err);
	if (!h)
		return 0;
	memcpy((uint8_t *)(h + 1) + pad, f->seg.seg_addr.pval, f->seg.seg_len);
	shunt_rec_commit(&c->rr, h, f->seg.seg_len, pad, REC_DATA, f->hdr.tag);
	ep->tx_frags++;
	return 1;
}

void tx_flush(struct mca_btl_base_endpoint_t *ep)
{
	struct frag *f;
	while (ep->tx_ring && (f = ep->q.head) && !ep->tx->rr.resv && ring_put(ep, f)) {
		fq_pop(&ep->q);
		frag_done(f);
	}
}

/* ---- endpoints ---- */

struct mca_btl_base_endpoint_t *ep_of(uint32_t vpid)
{
	if (vpid >= (1u << 24))
		return NULL;
	if (vpid >= shunt_btl.neps) {
		uint32_t n = vpid + 1 > 2 * shunt_btl.neps ? vpid + 1 : 2 * shunt_btl.neps;
		void *eps = realloc(shunt_btl.eps, n * sizeof *shunt_btl.eps);
		if (!eps)
			return NULL;
		shunt_btl.eps = eps;
		memset(shunt_btl.eps + shunt_btl.neps, 0, (n - shunt_btl.neps) * sizeof *shunt_btl.eps);
		shunt_btl.neps = n;
	}
	struct mca_btl_base_endpoint_t *ep = shunt_btl.eps[vpid];
	if (!ep && (ep = calloc(1, sizeof *ep))) {
		ep->name.jobid = OPAL_PROC_MY_NAME.jobid;
		ep->name.vpid = vpid;
		ep->rx_index = -1;
		snprintf(ep->who, sizeof ep->who, "rank %u", vpid);
		shunt_btl.eps[vpid] = ep;
	}
	return ep;
}

/* ---- ob1's calls ---- */

/* tcp_listed reports whether the job's btl list lets the TCP BTL carry a
 * peer whose lease cannot connect: no list (every BTL), a list naming
 * tcp, or an exclusion list (^...) that does not. */
static int tcp_listed(void)
{
	int idx = mca_base_var_find("opal", "btl", NULL, NULL);
	char **v = NULL;
	if (idx < 0 || mca_base_var_get_value(idx, &v, NULL, NULL) != OPAL_SUCCESS || !v || !*v || !**v)
		return 1;
	const char *s = *v;
	int exclude = *s == '^';
	if (exclude)
		s++;
	int found = 0;
	for (const char *p = s; *p;) {
		size_t n = strcspn(p, ",");
		if (n == 3 && !strncmp(p, "tcp", 3))
			found = 1;
		p += n;
		if (*p == ',')
			p++;
	}
	return exclude ? !found : found;
}

static int shunt_add_procs(struct mca_btl_base_module_t *btl, size_t nprocs, struct opal_proc_t **procs,
			   struct mca_btl_base_endpoint_t **peers, opal_bitmap_t *reachable)
{
	(void)btl;
	SHUNT_LOCK();
	opal_proc_t *me = opal_proc_local_get();
	for (size_t i = 0; i < nprocs; i++) {
		opal_proc_t *p = procs[i];
		peers[i] = NULL;
		if (p == me || p->proc_name.jobid != me->proc_name.jobid)
			continue;
		if (OPAL_PROC_ON_LOCAL_NODE(p->proc_flags)) {
			say(2, "rank %u is in this guest: left to vader", p->proc_name.vpid);
			continue;
		}
		uint32_t vpid = p->proc_name.vpid;
		struct mca_btl_base_endpoint_t *ep = ep_of(vpid);
		if (!ep)
			continue;
		ep->name = p->proc_name;
		ep->proc = p;
		if (!ep->reachable) {
			uint8_t *blob = NULL;
			size_t size = 0;
			int rc;
			OPAL_MODEX_RECV(rc, &mca_btl_shunt_component.super.btl_version, &p->proc_name, &blob, &size);
			struct wire_addr *a = (struct wire_addr *)blob;
			if (rc != OPAL_SUCCESS || size != sizeof *a || a->version != SHUNT_BTL_VERSION) {
				say(0, "rank %u published no btl/shunt address: left to the next BTL", vpid);
				free(a);
				continue;
			}
			ep->addr = *a;
			free(a);
			char ip[INET6_ADDRSTRLEN];
			static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
			if (!memcmp(ep->addr.ip, v4, 12))
				inet_ntop(AF_INET, ep->addr.ip + 12, ip, sizeof ip);
			else
				inet_ntop(AF_INET6, ep->addr.ip, ip, sizeof ip);
			if (p->proc_hostname && strcmp(p->proc_hostname, ip))
				snprintf(ep->who, sizeof ep->who, "rank %u on %s (%s:%u)", vpid, p->proc_hostname, ip, ep->addr.port);
			else
				snprintf(ep->who, sizeof ep->who, "rank %u (%s:%u)", vpid, ip, ep->addr.port);
			int r = lease_open(ep, mca_btl_shunt_component.connect_ms);
			if (r < 0) {
				const char *next = tcp_listed() ? "left to the next BTL (tcp)"
								: "no BTL of the job reaches it (tcp is not in the btl list)";
				if (r == -ECONNREFUSED)
					say(0, "to %s: the lease connect was refused (a firewall REJECT?): %s", ep->who, next);
				else
					say(0, "to %s: the lease connect failed (%s): %s", ep->who, strerror(-r), next);
				continue;
			}
			ep->reachable = 1;
			say(2, "to %s: lease connected", ep->who);
		}
		peers[i] = ep;
		if (reachable)
			opal_bitmap_set_bit(reachable, i);
	}
	SHUNT_UNLOCK();
	return OPAL_SUCCESS;
}

static int shunt_del_procs(struct mca_btl_base_module_t *btl, size_t nprocs, struct opal_proc_t **procs,
			   struct mca_btl_base_endpoint_t **peers)
{
	(void)btl, (void)nprocs, (void)procs, (void)peers;
	/* Only MPI_Finalize removes procs; the module's finalize closes. */
	__atomic_store_n(&shunt_btl.finalizing, 1, __ATOMIC_RELAXED);
	return OPAL_SUCCESS;
}

static int shunt_register_error(struct mca_btl_base_module_t *btl, mca_btl_base_module_error_cb_fn_t cb)
{
	(void)btl;
	shunt_btl.error_cb = cb;
	return OPAL_SUCCESS;
}

static mca_btl_base_descriptor_t *shunt_alloc(struct mca_btl_base_module_t *btl, struct mca_btl_base_endpoint_t *ep,
					      uint8_t order, size_t size, uint32_t flags)
{
	(void)btl, (void)order;
	if (size > shunt_btl.super.btl_max_send_size)
		return NULL;
	SHUNT_LOCK();
	struct frag *f = frag_get(size);
	SHUNT_UNLOCK();
	if (!f)
		return NULL;
	f->ep = ep;
	f->base.des_flags = flags;
	return &f->base;
}

static int shunt_free(struct mca_btl_base_module_t *btl, mca_btl_base_descriptor_t *des)
{
	(void)btl;
	struct frag *f = (struct frag *)des;
	SHUNT_LOCK();
	if (f->where == FRAG_RING && f->ep && f->ep->tx)
		shunt_rec_cancel(&f->ep->tx->rr);
	frag_put(f);
	SHUNT_UNLOCK();
	return OPAL_SUCCESS;
}

static int pack(struct opal_convertor_t *cv, uint8_t *dst, size_t *size)
{
	if (!*size)
		return 0;
	struct iovec iov = {.iov_base = dst, .iov_len = *size};
	uint32_t n = 1;
	return opal_convertor_pack(cv, &iov, &n, size) < 0 ? -1 : 0;
}

static mca_btl_base_descriptor_t *shunt_prepare_src(struct mca_btl_base_module_t *btl,
						    struct mca_btl_base_endpoint_t *ep, struct opal_convertor_t *cv,
						    uint8_t order, size_t reserve, size_t *size, uint32_t flags)
{
	(void)btl, (void)order;
	size_t max = shunt_btl.super.btl_max_send_size;
	if (reserve > max)
		return NULL;
	if (reserve + *size > max)
		*size = max - reserve;
	SHUNT_LOCK();
	struct frag *f;
	struct conn *c = ep->tx;
	if (ep->tx_ring && c && !c->relayed && !ep->q.head && !c->rr.resv) {
		int err;
		uint16_t pad = shunt_rec_pad(reserve, *size);
		struct shunt_rec *h = shunt_rec_reserve(&c->rr, pad + reserve + *size, &err);
		if (h && (f = frag_get(0))) {
			f->where = FRAG_RING;
			f->rh = h;
			f->rpad = pad;
			f->seg.seg_addr.pval = (uint8_t *)(h + 1) + pad;
			goto packed;
		}
		if (h)
			shunt_rec_cancel(&c->rr);
		if (err == SHUNT_EAGAIN) {
			/* The ring is full: ob1 keeps the request and asks again
			 * from its own progress, rather than packing into a buffer
			 * that would be copied once more into the ring. */
			SHUNT_UNLOCK();
			return NULL;
		}
	}
	if (!(f = frag_get(reserve + *size))) {
		SHUNT_UNLOCK();
		return NULL;
	}
packed:
	f->ep = ep;
	f->base.des_flags = flags;
	if (pack(cv, (uint8_t *)f->seg.seg_addr.pval + reserve, size)) {
		if (f->where == FRAG_RING)
			shunt_rec_cancel(&c->rr);
		frag_put(f);
		SHUNT_UNLOCK();
		return NULL;
	}
	f->seg.seg_len = reserve + *size;
	SHUNT_UNLOCK();
	return &f->base;
}

static int shunt_send(struct mca_btl_base_module_t *btl, struct mca_btl_base_endpoint_t *ep,
		      mca_btl_base_descriptor_t *des, mca_btl_base_tag_t tag)
{
	(void)btl;
	struct frag *f = (struct frag *)des;
	int r;
	f->ep = ep;
	f->hdr = (struct shunt_rec){.len = f->seg.seg_len, .kind = REC_DATA, .tag = tag};
	SHUNT_LOCK();
	if (f->where == FRAG_RING) { /* packed in place: publish it */
		shunt_rec_commit(&ep->tx->rr, f->rh, f->seg.seg_len, f->rpad, REC_DATA, tag);
		ep->tx_frags++;
		r = done_now(f);
	} else if (ep->tx_ring && ep->tx) {
		if (!ep->q.head && ring_put(ep, f)) {
			r = done_now(f);
		} else {
			f->base.des_flags |= MCA_BTL_DES_SEND_ALWAYS_CALLBACK;
			fq_push(&ep->q, f);
			shunt_btl.queued = 1; /* progress moves it when there is room */
			r = OPAL_SUCCESS;
		}
	} else if (!ep->tx) {
		r = OPAL_ERR_UNREACH;
	} else {
		/* The lease: completed at once if the socket took it all, else
		 * completed (with the callback) when EPOLLOUT lets the rest go. */
		struct conn *c = ep->tx;
		if (!c->lq.head) {
			f->hdr.stamp = ep->tx_frags;
			struct iovec iov[2] = {{&f->hdr, sizeof f->hdr}, {f->seg.seg_addr.pval, f->seg.seg_len}};
			ssize_t n = lease_writev(c->fd, iov, 2);
			if (n == (ssize_t)(sizeof f->hdr + f->seg.seg_len)) {
				ep->tx_frags++;
				r = done_now(f);
				SHUNT_UNLOCK();
				return r;
			}
			if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
				SHUNT_UNLOCK();
				peer_failed(ep, "its lease failed on write");
				return OPAL_ERR_UNREACH;
			}
			ep->tx_frags++;
			f->done = n > 0 ? n : 0;
			f->base.des_flags |= MCA_BTL_DES_SEND_ALWAYS_CALLBACK;
			fq_push(&c->lq, f);
			conn_set_pollout(c, 1);
			shunt_btl.lease_busy = 1;
		} else {
			f->base.des_flags |= MCA_BTL_DES_SEND_ALWAYS_CALLBACK;
			lease_push(c, f);
		}
		r = OPAL_SUCCESS;
	}
	SHUNT_UNLOCK();
	return r;
}

static int shunt_sendi(struct mca_btl_base_module_t *btl, struct mca_btl_base_endpoint_t *ep,
		       struct opal_convertor_t *cv, void *header, size_t hsize, size_t psize, uint8_t order,
		       uint32_t flags, mca_btl_base_tag_t tag, mca_btl_base_descriptor_t **descriptor)
{
	(void)btl, (void)order, (void)flags;
	if (descriptor)
		*descriptor = NULL;
	if (hsize + psize > shunt_btl.super.btl_max_send_size)
		return OPAL_ERR_OUT_OF_RESOURCE;
	SHUNT_LOCK();
	struct conn *c = ep->tx;
	int r = OPAL_ERR_OUT_OF_RESOURCE;
	if (ep->tx_ring && c && c->relayed) {
		/* A relayed ring (relayed.c): the record in a buffer, then copied
		 * into the ring, if it has room for it now. */
		struct frag *f;
		size_t n = psize;
		if (!ep->q.head && relay_fits(ep, hsize + psize) && (f = frag_get(hsize + psize))) {
			memcpy(f->buf, header, hsize);
			if (pack(cv, f->buf + hsize, &n) == 0 && relay_put(ep, tag, f->buf, hsize + n))
				r = OPAL_SUCCESS;
			frag_put(f);
		}
	} else if (ep->tx_ring && c) {
		/* The fast path: one record, built in the ring. */
		int err;
		struct shunt_rec *h;
		uint16_t pad = shunt_rec_pad(hsize, psize);
		if (!ep->q.head && !c->rr.resv && (h = shunt_rec_reserve(&c->rr, pad + hsize + psize, &err))) {
			uint8_t *p = (uint8_t *)(h + 1) + pad;
			memcpy(p, header, hsize);
			size_t n = psize;
			void *data = NULL;
			if (psize && !opal_convertor_need_buffers(cv)) { /* contiguous: no convertor */
				opal_convertor_get_current_pointer(cv, &data);
				memcpy(p + hsize, data, psize);
			}
			if (data || pack(cv, p + hsize, &n) == 0) {
				shunt_rec_commit(&c->rr, h, hsize + n, pad, REC_DATA, tag);
				ep->tx_frags++;
				r = OPAL_SUCCESS;
			} else {
				shunt_rec_cancel(&c->rr);
			}
		}
	} else if (c) {
		/* The lease: our own fragment, freed once written. */
		struct frag *f = frag_get(hsize + psize);
		size_t n = psize;
		if (f) {
			memcpy(f->buf, header, hsize);
			if (pack(cv, f->buf + hsize, &n) == 0) {
				f->seg.seg_len = hsize + n;
				f->internal = 1;
				f->ep = ep;
				f->hdr = (struct shunt_rec){.len = hsize + n, .kind = REC_DATA, .tag = tag};
				lease_push(c, f);
				r = OPAL_SUCCESS;
			} else {
				frag_put(f);
			}
		}
	}
	if (r != OPAL_SUCCESS && descriptor && c) {
		/* No room in the ring now: ob1 packs into this descriptor and
		 * sends it, and it waits in the endpoint's queue (btl.h's rule:
		 * a busy sendi returns a descriptor, else ob1 retries forever). */
		struct frag *f = frag_get(hsize + psize);
		if (f) {
			f->ep = ep;
			f->base.des_flags = flags;
			*descriptor = &f->base;
			r = OPAL_ERR_RESOURCE_BUSY;
		}
	}
	SHUNT_UNLOCK();
	return r;
}

struct shunt_btl shunt_btl = {
	.super = {
		.btl_component = &mca_btl_shunt_component.super,
		.btl_add_procs = shunt_add_procs,
		.btl_del_procs = shunt_del_procs,
		.btl_register = NULL,
		.btl_finalize = NULL, /* set by component.c */
		.btl_alloc = shunt_alloc,
		.btl_free = shunt_free,
		.btl_prepare_src = shunt_prepare_src,
		.btl_send = shunt_send,
		.btl_sendi = shunt_sendi,
		.btl_dump = mca_btl_base_dump,
		.btl_register_error = shunt_register_error,
	},
	.lfd = -1,
	.efd = -1,
};
