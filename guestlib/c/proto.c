/* Control protocol v3 frames, field for field as Go's internal/proto. A
 * guest library speaks only the newest version; a frame of an older one
 * from hostd (an older hostd) is SHUNT_EVERSION, and the session stays on
 * TCP with reason version. */
#define _GNU_SOURCE
#include "shunt.h"

#include <string.h>

enum f { F_REQ, F_ROLE, F_SIDE, F_REASON, F_LOCAL, F_REMOTE, F_SLOT, F_GEN, F_CAP, F_RAB, F_RBA,
	 F_RID, F_GUEST, F_RSIZE, F_REGION, F_PID, F_NONCE, F_TEXT, F_FORMATS, F_OFFSET, F_END };

static const signed char layouts[SHUNT_NUM_TYPES][9] = {
	[SHUNT_HELLO] = {F_PID, F_FORMATS, F_END},
	[SHUNT_WELCOME] = {F_GUEST, F_GEN, F_RSIZE, F_REGION, F_FORMATS, F_END},
	[SHUNT_LISTEN] = {F_LOCAL, F_END},
	[SHUNT_UNLISTEN] = {F_LOCAL, F_END},
	[SHUNT_INTENT] = {F_LOCAL, F_REMOTE, F_END},
	[SHUNT_OPEN] = {F_REQ, F_ROLE, F_LOCAL, F_REMOTE, F_END},
	[SHUNT_READY] = {F_REQ, F_RID, F_SLOT, F_GEN, F_CAP, F_RAB, F_RBA, F_SIDE, F_END},
	[SHUNT_TCP] = {F_REQ, F_REASON, F_END},
	[SHUNT_CLOSE] = {F_REQ, F_RID, F_SLOT, F_GEN, F_SIDE, F_END},
	[SHUNT_RELEASE] = {F_RID, F_SLOT, F_GEN, F_END},
	[SHUNT_REVOKE] = {F_RID, F_SLOT, F_GEN, F_REASON, F_END},
	[SHUNT_KICK] = {F_RID, F_SLOT, F_GEN, F_SIDE, F_END},
	[SHUNT_PING] = {F_NONCE, F_END},
	[SHUNT_PONG] = {F_NONCE, F_END},
	[SHUNT_REATTACH] = {F_REQ, F_RID, F_SLOT, F_GEN, F_SIDE, F_LOCAL, F_REMOTE, F_END},
	[SHUNT_ERROR] = {F_REASON, F_TEXT, F_END},
	[SHUNT_REGION] = {F_RID, F_RSIZE, F_END},
	[SHUNT_UNREGION] = {F_RID, F_END},
	[SHUNT_DOWN] = {F_REQ, F_RID, F_SLOT, F_GEN, F_REASON, F_END},
	[SHUNT_LEFT] = {F_REQ, F_RID, F_SLOT, F_GEN, F_SIDE, F_END},
	[SHUNT_RESUME] = {F_REQ, F_RID, F_SLOT, F_GEN, F_REASON, F_OFFSET, F_END},
	/* guest -> hostd, after RESUME for a vsock stretch (docs/vsock.md;
	 * stretch.c, shunt_flow_stretch_end) */
	[SHUNT_ENDED] = {F_REQ, F_RID, F_SLOT, F_GEN, F_SIDE, F_OFFSET, F_END},
};

struct out { uint8_t *p; size_t n, cap; int bad; };

static void put(struct out *o, const void *b, size_t n)
{
	if (o->n + n > o->cap) {
		o->bad = 1;
		return;
	}
	memcpy(o->p + o->n, b, n);
	o->n += n;
}
static void put_le(struct out *o, uint64_t v, int bytes)
{
	uint8_t b[8];
	for (int i = 0; i < bytes; i++)
		b[i] = v >> (8 * i);
	put(o, b, bytes);
}
static void put_addr(struct out *o, const struct shunt_addr *a) { put(o, a->ip, 16); put_le(o, a->port, 2); }
static void put_str(struct out *o, const char *s)
{
	size_t n = strnlen(s, SHUNT_PROTO_STRING_MAX);
	put_le(o, n, 2);
	put(o, s, n);
}

ssize_t shunt_msg_encode(const struct shunt_msg *m, uint8_t *buf, size_t cap)
{
	if (m->type == 0 || m->type >= SHUNT_NUM_TYPES || cap < SHUNT_PROTO_HEADER)
		return SHUNT_EINVAL;
	struct out o = {buf, 0, cap, 0};
	uint8_t hdr[8] = {SHUNT_PROTO_VERSION, m->type, 0, 0, 0, 0, 0, 0};
	put(&o, hdr, 8);
	for (const signed char *f = layouts[m->type]; *f != F_END; f++) {
		switch (*f) {
		case F_REQ: put_le(&o, m->req_id, 4); break;
		case F_ROLE: put_le(&o, m->role, 1); break;
		case F_SIDE: put_le(&o, m->side, 1); break;
		case F_REASON: put_le(&o, m->reason, 2); break;
		case F_LOCAL: put_addr(&o, &m->local); break;
		case F_REMOTE: put_addr(&o, &m->remote); break;
		case F_SLOT: put_le(&o, m->slot, 4); break;
		case F_GEN: put_le(&o, m->gen, 8); break;
		case F_CAP: put_le(&o, m->capacity, 4); break;
		case F_RAB: put_le(&o, m->ring_ab, 8); break;
		case F_RBA: put_le(&o, m->ring_ba, 8); break;
		case F_RID: put_le(&o, m->region_id, 4); break;
		case F_GUEST: put_le(&o, m->guest_id, 4); break;
		case F_RSIZE: put_le(&o, m->region_size, 8); break;
		case F_REGION: put_str(&o, m->region); break;
		case F_PID: put_le(&o, m->pid, 4); break;
		case F_NONCE: put_le(&o, m->nonce, 8); break;
		case F_TEXT: put_str(&o, m->text); break;
		case F_FORMATS: put_le(&o, m->formats, 4); break;
		case F_OFFSET: put_le(&o, m->offset, 8); break;
		}
	}
	if (o.bad || o.n - 8 > SHUNT_PROTO_MAX)
		return SHUNT_EINVAL;
	uint32_t n = o.n - 8;
	for (int i = 0; i < 4; i++)
		buf[4 + i] = n >> (8 * i);
	return o.n;
}

ssize_t shunt_msg_header(const uint8_t *h, uint8_t *type)
{
	if (h[0] != SHUNT_PROTO_VERSION)
		return h[0] >= 1 && h[0] < SHUNT_PROTO_VERSION ? SHUNT_EVERSION : SHUNT_ECORRUPT;
	if (h[1] == 0 || h[1] >= SHUNT_NUM_TYPES || h[2] || h[3])
		return SHUNT_ECORRUPT;
	uint32_t n = h[4] | h[5] << 8 | h[6] << 16 | (uint32_t)h[7] << 24;
	if (n > SHUNT_PROTO_MAX)
		return SHUNT_ECORRUPT;
	*type = h[1];
	return n;
}

struct in { const uint8_t *p; size_t n; int bad; };

static const uint8_t *take(struct in *in, size_t n)
{
	static const uint8_t zero[SHUNT_PROTO_STRING_MAX + 16]; /* the longest field */
	if (in->bad || in->n < n) {
		in->bad = 1;
		return zero;
	}
	const uint8_t *p = in->p;
	in->p += n;
	in->n -= n;
	return p;
}
static uint64_t get_le(struct in *in, int bytes)
{
	const uint8_t *b = take(in, bytes);
	uint64_t v = 0;
	for (int i = 0; i < bytes; i++)
		v |= (uint64_t)b[i] << (8 * i);
	return v;
}
static void get_addr(struct in *in, struct shunt_addr *a)
{
	memcpy(a->ip, take(in, 16), 16);
	a->port = get_le(in, 2);
}
static void get_str(struct in *in, char *dst)
{
	size_t n = get_le(in, 2);
	if (n > SHUNT_PROTO_STRING_MAX) {
		in->bad = 1;
		n = 0;
	}
	memcpy(dst, take(in, n), n);
	dst[n] = 0;
}

int shunt_msg_decode(const uint8_t *frame, size_t len, struct shunt_msg *m)
{
	uint8_t type;
	if (len < SHUNT_PROTO_HEADER)
		return SHUNT_ECORRUPT;
	ssize_t n = shunt_msg_header(frame, &type);
	if (n < 0)
		return n;
	if ((size_t)n != len - SHUNT_PROTO_HEADER)
		return SHUNT_ECORRUPT;
	memset(m, 0, sizeof *m);
	m->type = type;
	struct in in = {frame + 8, n, 0};
	for (const signed char *f = layouts[type]; *f != F_END; f++) {
		switch (*f) {
		case F_REQ: m->req_id = get_le(&in, 4); break;
		case F_ROLE:
			m->role = get_le(&in, 1);
			if (m->role != 1 && m->role != 2)
				in.bad = 1;
			break;
		case F_SIDE:
			m->side = get_le(&in, 1);
			m->relayed = (m->side & SHUNT_SIDE_RELAYED) != 0;
			m->side &= (uint8_t)~SHUNT_SIDE_RELAYED;
			if (m->side != 1 && m->side != 2)
				in.bad = 1;
			break;
		case F_REASON: m->reason = get_le(&in, 2); break;
		case F_LOCAL: get_addr(&in, &m->local); break;
		case F_REMOTE: get_addr(&in, &m->remote); break;
		case F_SLOT: m->slot = get_le(&in, 4); break;
		case F_GEN: m->gen = get_le(&in, 8); break;
		case F_CAP: m->capacity = get_le(&in, 4); break;
		case F_RAB: m->ring_ab = get_le(&in, 8); break;
		case F_RBA: m->ring_ba = get_le(&in, 8); break;
		case F_RID: m->region_id = get_le(&in, 4); break;
		case F_GUEST: m->guest_id = get_le(&in, 4); break;
		case F_RSIZE: m->region_size = get_le(&in, 8); break;
		case F_REGION: get_str(&in, m->region); break;
		case F_PID: m->pid = get_le(&in, 4); break;
		case F_NONCE: m->nonce = get_le(&in, 8); break;
		case F_TEXT: get_str(&in, m->text); break;
		case F_FORMATS: m->formats = get_le(&in, 4); break;
		case F_OFFSET: m->offset = get_le(&in, 8); break;
		}
	}
	return in.bad || in.n ? SHUNT_ECORRUPT : 0;
}

static const char *const reason_names[SHUNT_NUM_REASONS] = {
	"none", "loopback", "not-local", "no-intent", "no-listener", "policy", "not-owner",
	"no-conntrack", "not-established", "timeout", "no-space", "cross-group", "guest-limit",
	"internal", "conntrack-gone", "policy-reload", "peer-gone", "admin", "malformed",
	"no-hostd", "disabled", "guest-quota", "version", "control-limit", "firewall", "shutdown",
	"migrating", "not-guest", "peer-unreachable", "vsock-pair", "vsock-down"};

const char *shunt_reason_name(unsigned r) { return r < SHUNT_NUM_REASONS ? reason_names[r] : "?"; }
