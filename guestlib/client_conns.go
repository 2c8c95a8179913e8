package guestlib

import (
	"errors"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// The Client's side of its connections: it names each by a request id
// for the connection's whole life, routes hostd's READY, TCP, DOWN and
// REVOKE to it, and writes its OPEN, LEFT and CLOSE.

// open gives conn its request id and offers it to hostd with OPEN; with
// no session, the background reconnect offers it when hostd answers.
// Nothing waits.
func (c *Client) open(conn *Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.nextReq++
	if c.nextReq == 0 {
		c.nextReq++
	}
	conn.req = c.nextReq
	c.conns[conn.req] = conn
	if c.sess == nil {
		if c.lastErr != nil { // else the first try is under way: pending
			conn.reason = c.downReasonLocked()
			conn.ansOnce.Do(func() { close(conn.answered) }) // WaitPath: nobody to wait for
		}
		c.retryLocked()
		return
	}
	if err := c.sendLocked(conn.openMsg()); err != nil {
		conn.reason = proto.ReasonControlLimit.String() // re-offered after a reconnect
		return
	}
	conn.toldAt = time.Now()
}

// unreachable reports whether hostd is known to be out of reach now (no
// session, and the last try failed): a new connection's OPEN would only
// record why, so it is not delayed.
func (c *Client) unreachable() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sess == nil && c.lastErr != nil
}

// downReasonLocked is why connections are on TCP while there is no
// session: hostd unreachable, an older hostd, or every port of the VM
// held by other processes.
func (c *Client) downReasonLocked() string {
	if errors.Is(c.lastErr, proto.ErrVersion) {
		return proto.ReasonVersion.String()
	}
	if errors.Is(c.lastErr, errNotGuest) {
		return proto.ReasonNotGuest.String() // hostd refused this process: not in the guest's namespace
	}
	if errors.Is(c.lastErr, vserial.ErrAllBusy) {
		return proto.ReasonControlLimit.String() // more processes than the VM has ports
	}
	return proto.ReasonNoHostd.String()
}

// openMsg is conn's OPEN.
func (conn *Conn) openMsg() proto.Msg {
	return proto.Msg{Type: proto.Open, ReqID: conn.req, Role: conn.role, Local: conn.local, Remote: conn.remote}
}

// connClosed forgets conn and tells hostd with CLOSE, naming the rings it
// holds (f, or none).
func (c *Client) connClosed(conn *Conn, f *flow) {
	m := proto.Msg{Type: proto.Close, ReqID: conn.req, Side: sideOf(conn.role)}
	if f != nil {
		m.RegionID, m.Slot, m.Gen, m.Side = f.key.region, f.key.slot, f.key.gen, f.side
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conns[conn.req] == conn {
		delete(c.conns, conn.req)
	}
	_ = c.sendLocked(m)
	if !conn.toldAt.IsZero() {
		life := time.Since(conn.toldAt)
		if d, changed := c.delay.lived(life); changed {
			c.logf("shunt: open delay now %v (a connection lived %v after its OPEN)", d, life.Round(time.Millisecond))
		}
	}
}

func sideOf(r proto.Role) proto.Side {
	if r == proto.Passive {
		return proto.SideB
	}
	return proto.SideA
}

// left tells hostd that both of conn's directions left f's rings.
func (c *Client) left(conn *Conn, f *flow) {
	k := f.key
	_ = c.send(proto.Msg{Type: proto.Left, ReqID: conn.req, RegionID: k.region, Slot: k.slot, Gen: k.gen, Side: f.side})
}

// attach maps the rings of a READY and makes the flow (not yet
// registered).
func (c *Client) attach(m proto.Msg) (*flow, error) {
	out, in, reg, err := c.rings(m)
	if err != nil && m.RegionID != 0 && c.stretches() {
		return c.attachStretch(m) // a VM without the region: over vsock
	}
	if err != nil {
		return nil, err
	}
	p, k := c.opts.Wait, c.kick.Load()
	if k != nil {
		p = k.wait
	}
	f := &flow{key: keyOf(m), side: m.Side, relayed: m.Relayed, reg: reg, client: c}
	if f.w, err = ring.NewWriter(out, p); err == nil {
		f.rd, err = ring.NewReader(in, p)
	}
	if err != nil {
		c.releaseRegion(reg)
		return nil, err
	}
	if k != nil {
		peer := proto.SideB
		if m.Side == proto.SideB {
			peer = proto.SideA
		}
		or, ow := out.Waiters() // our writer ring: the peer reads it
		ir, iw := in.Waiters()  // our reader ring: the peer writes it
		k.track(f.key, peer, or, ow, ir, iw)
	}
	return f, nil
}

// register records a connection holding rings, so that REVOKE, KICK and
// a DOWN by flow reach it and a new hostd learns of it.
func (c *Client) register(k flowKey, conn *Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.flows[k] = conn
}

// unregister forgets a flow a connection let go of, and gives back its
// hold on the region (mp, nil for region 0).
func (c *Client) unregister(k flowKey, mp *mapping) {
	c.mu.Lock()
	delete(c.flows, k)
	c.mu.Unlock()
	if ks := c.kick.Load(); ks != nil {
		ks.forget(k)
	}
	c.releaseRegion(mp)
}

func (c *Client) flow(k flowKey) *Conn {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.flows[k]
}

func (c *Client) conn(req uint32) *Conn {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conns[req]
}

// ready hands a READY to its connection. Rings no connection takes (an
// unknown or closed request, rings that do not check out, rings while the
// previous ones are held) are given back here, and only here: CLOSE when
// no connection has the request, LEFT when one has it.
func (c *Client) ready(m proto.Msg) {
	conn := c.conn(m.ReqID)
	var err error = errConnClosed
	if conn != nil {
		if err = conn.ready(m); err == nil {
			return
		}
	}
	c.logf("shunt: READY %d/%d.%d for request %d not taken (%v): giving it back", m.RegionID, m.Slot, m.Gen, m.ReqID, err)
	t := proto.Close
	if conn != nil && err != errConnClosed {
		t = proto.Left
	}
	_ = c.send(proto.Msg{Type: t, ReqID: m.ReqID, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Side: m.Side})
}

// tcp hands a TCP(reason) to its connection.
func (c *Client) tcp(m proto.Msg) {
	if conn := c.conn(m.ReqID); conn != nil {
		conn.tcpAnswer(m.Reason)
	}
}

// downed hands a DOWN (or a REVOKE, which a version-3 library takes as a
// DOWN) to the connection holding the flow: by request id, or by the flow
// (a DOWN after REATTACH may name no request).
func (c *Client) downed(m proto.Msg) {
	k := keyOf(m)
	if conn := c.conn(m.ReqID); m.ReqID != 0 && conn != nil && conn.down(k, m.Reason) {
		return
	}
	if conn := c.flow(k); conn != nil {
		conn.down(k, m.Reason)
	}
}

// resumed hands a RESUME to the connection holding the flow, as downed
// does a DOWN.
func (c *Client) resumed(m proto.Msg) {
	k := keyOf(m)
	if conn := c.conn(m.ReqID); m.ReqID != 0 && conn != nil && conn.resume(k, m.Reason, m.Offset) {
		return
	}
	if conn := c.flow(k); conn != nil {
		conn.resume(k, m.Reason, m.Offset)
	}
}

// tellNoHostd tells the connections that hostd did not answer (a session
// ended or a try failed). Called without mu (Conn.fmu comes first).
func (c *Client) tellNoHostd() {
	c.mu.Lock()
	reason := c.downReasonLocked()
	conns := make([]*Conn, 0, len(c.conns))
	for _, conn := range c.conns {
		conns = append(conns, conn)
	}
	c.mu.Unlock()
	for _, conn := range conns {
		conn.noHostd(reason)
	}
}

// noHostd is the end of the session for conn, or a failed try: it keeps
// its path; the reason says why hostd does not answer.
func (conn *Conn) noHostd(reason string) {
	conn.fmu.Lock()
	if f := conn.cur.Load(); f == nil || f.down.Load() {
		conn.reason = reason
	}
	conn.fmu.Unlock()
	conn.ansOnce.Do(func() { close(conn.answered) })
}
