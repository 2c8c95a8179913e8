package broker

import (
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
)

// The firewall's authority over time (docs/SECURITY.md, "Proof of
// passage"). hostd's proof chains (hostd/mark) set one bit per direction
// in a connection's conntrack mark when one of its packets went past the
// operator's filter. hostd clears the bits, and reads them back:
//
//   - epochs: every ruleset change, and hostd's start, begins an epoch
//     whose first act is clearing every entry's bits (ClearMarks), but
//     those of entries made since the epoch began (conntrack timestamps:
//     their packets all met the new ruleset). A
//     connection may go (back) to the rings only with both bits seen in a
//     lookup that began after that clear completed: its proof's epoch is
//     the current one. Until the clear is done, nothing upgrades.
//   - freshness: proof older than ProofMaxAge does not open the rings; a
//     waiting connection's bits are cleared, then read until both are set.
//   - the sweep: a connection on the rings has its bits cleared, read and
//     cleared again, round after round (every ProofMaxAge/4); one that
//     shows no passage both ways for ProofMaxAge moves to TCP (firewall).
//     That covers what sends no ruleset event: dynamic sets, ipset, tc
//     ingress, a link down, routes (not tc egress, which drops after
//     postrouting, where the packet already set its bit).

// fwState is the broker's epoch of the ruleset, guarded by Broker.mu.
type fwState struct {
	epoch    uint64    // ruleset changes seen, hostd's start the first
	since    time.Time // when the epoch began: entries made later keep their bits
	cleared  uint64    // the epoch whose clear of every entry's bits completed
	clearing bool      // a clear runs (clearAll)
	polling  bool      // the poller runs (pollProof)
}

// proofOK reports whether a lookup that began in epoch ep (0: during a
// clear) may count as proof now.
func (s *fwState) proofOK(ep uint64) bool {
	return ep != 0 && ep == s.epoch && s.cleared == s.epoch
}

// lookupEpoch is the epoch a lookup that begins now belongs to: 0 while
// the epoch's clear is under way (bits read then may predate it).
func (b *Broker) lookupEpoch() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.lookupEpochLocked()
}

func (b *Broker) lookupEpochLocked() uint64 {
	if b.fw.cleared != b.fw.epoch {
		return 0
	}
	return b.fw.epoch
}

// leaseProof is one connection's proof of passage.
type leaseProof struct {
	epoch uint64 // the epoch of the last lookup that showed both bits (0: none)
	// seenAt is the earliest time the bits that lookup showed may have
	// been set: the rule sets a bit once per clearing, so they prove
	// passage only since the later of the epoch's start, the entry's
	// making and hostd's last clear of this entry (ownClear), however
	// recent the lookup.
	seenAt    time.Time
	ownClear  time.Time // when hostd last cleared this entry's bits (the sweep, a stale wait)
	clearedAt time.Time // when the sweep last cleared its bits (zero: not yet, on this stretch of rings)
	sweptAt   time.Time // when the sweep last looked
}

// passed reports whether an entry's mark shows both directions past the
// filter. Without proof bits (no ruleset watch), everything passes.
func (b *Broker) passed(mark uint32) bool {
	p := b.opts.ProofOrig | b.opts.ProofReply
	return mark&p == p
}

// provenLocked reports whether c may use the rings as far as the firewall
// goes: proof of passage both ways in the current epoch, fresh enough.
func (b *Broker) provenLocked(c *Conn, now time.Time) bool {
	if !b.proofOn() {
		return true
	}
	return b.fw.proofOK(c.pf.epoch) && now.Sub(c.pf.seenAt) <= b.opts.ProofMaxAge
}

func (b *Broker) proofOn() bool { return b.opts.ProofOrig != 0 }

// sawLocked records a lookup of c's entry that began in epoch ep, at at.
// Its bits date from no earlier than the epoch's start, the entry's start
// and hostd's last clear of them: that is the proof's age, not at (bits
// set by a handshake long ago, with nothing passing since, are no fresh
// proof for a late OPEN).
func (b *Broker) sawLocked(c *Conn, e ctrack.Entry, ep uint64, at time.Time) {
	if !b.passed(e.Mark) || !b.fw.proofOK(ep) {
		return
	}
	since := b.fw.since
	for _, t := range []time.Time{e.Start, c.pf.ownClear} {
		if t.After(since) {
			since = t
		}
	}
	if since.After(at) {
		since = at
	}
	if c.pf.epoch == ep && c.pf.seenAt.After(since) {
		return // an earlier lookup knew better
	}
	c.pf.epoch, c.pf.seenAt = ep, since
}

// fwWait is a connection's wait for proof of passage, on TCP: the poller
// reads its entry's bits until both are set. Bits set since the epoch's
// clear prove passage in the epoch; only a connection whose proof is of
// this epoch but too old has its own bits cleared first.
type fwWait struct {
	stale bool // its bits must be cleared before they count
	// revokeAt, if set, is when the memory of the rings c was moved off
	// by an epoch (a ruleset change, hostd's start) is taken away if c
	// has not shown passage by then: the change may not concern it at
	// all, so its region is not retired at once (revoke.go).
	revokeAt time.Time
	// An idle lease may wait long: its checks back off, from every
	// FirewallPoll up to fwPollMax, so that many idle connections cost
	// few lookups.
	next  time.Time
	every time.Duration
}

// fwPollMax bounds the back-off of one connection's checks.
const fwPollMax = 5 * time.Second

// waitProofLocked makes c wait for proof, and starts the poller.
func (b *Broker) waitProofLocked(c *Conn) {
	if c.fw == nil {
		c.fw = &fwWait{stale: c.pf.epoch != 0 && c.pf.epoch == b.fw.epoch}
	}
	b.pollLocked()
}

func (b *Broker) pollLocked() {
	if !b.fw.polling && !b.closed {
		b.fw.polling = true
		b.wg.Add(1)
		go b.pollProof()
	}
}

// FirewallEpoch returns the current firewall epoch and whether its clear
// of every entry's proof bits completed (for listings and tests).
func (b *Broker) FirewallEpoch() (epoch uint64, cleared bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.fw.epoch, b.fw.cleared == b.fw.epoch
}

// Start begins hostd's first epoch: whatever the firewall did while no
// hostd watched, every connection needs proof from now on. Adopted flows
// leave the rings (firewall) until their leases show it. hostd calls it
// before it serves control channels: the epoch's clear is tried once here,
// so that no OPEN races with it (a connection made meanwhile would lose
// its handshake's bits and wait for more packets).
func (b *Broker) Start() {
	began := time.Now() // the epoch's start: before its clear, so that no bit it spares predates it
	if b.proofOn() {
		if _, err := b.ct.ClearMarks(b.opts.ProofOrig|b.opts.ProofReply, began); err != nil {
			b.log.Warn("cannot clear the conntrack proof bits at start; retrying in the background", "error", err)
		} else {
			b.mu.Lock()
			b.fw.cleared = b.fw.epoch + 1 // the epoch newEpochLocked begins below
			b.mu.Unlock()
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.proofOn() {
		return
	}
	n := 0
	for c := range b.records {
		if b.epochDowngradeLocked(c) {
			n++
		}
	}
	if n > 0 {
		b.log.Info("adopted flows moved to TCP until their leases show packets past the firewall (it may have changed while no hostd watched)", "moved", n)
	}
	b.newEpochLocked()
	b.fw.since = began
}

// RulesetChanged is the firewall's ruleset watch (hostd/ruleset): any
// change may drop a connection's packets, which the rings would not see.
// Every connection on the rings moves to TCP (firewall), and every
// connection, paired or not yet, needs proof of passage under the new
// ruleset before it may go (back) to the rings.
func (b *Broker) RulesetChanged() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || !b.proofOn() {
		return
	}
	n := 0
	for c := range b.records {
		switch {
		case b.epochDowngradeLocked(c):
			n++
			continue // waits for proof (epochDowngradeLocked)
		case c.path == PathTCP && c.reason == proto.ReasonNone:
			c.reason = proto.ReasonFirewall
		case c.path == PathTCP && c.reason != proto.ReasonFirewall:
			// Kept on TCP by something else (policy, limits, a gone
			// end): polling its entry would cost a lookup every few
			// seconds for as long as it lives. It waits for proof
			// once that is over (mayUpgradeLocked: its proof is of an
			// older epoch now).
			c.fw = nil
			continue
		}
		c.fw = &fwWait{}
	}
	if n > 0 {
		b.log.Info("firewall ruleset changed: connections moved to TCP until their leases show packets past the new rules both ways", "moved", n)
	}
	b.newEpochLocked()
}

// epochDowngradeLocked moves c off the rings for a new epoch (DOWN
// firewall) and makes it wait for proof; it reports whether c was on the
// rings. Its region is retired only if c shows no passage within the
// revoke grace (checkWait): most ruleset changes concern other traffic.
func (b *Broker) epochDowngradeLocked(c *Conn) bool {
	w := &fwWait{}
	f := b.leaveRingsLocked(c, proto.ReasonFirewall)
	if f != nil {
		w.revokeAt = time.Now().Add(b.revokeGrace())
		c.fwRegion = f.Region
	}
	c.fw = w
	return f != nil
}

// heldByEpochLocked reports whether a connection that an epoch moved off
// pair region r still waits to show passage (until its revoke grace): r
// then keeps lingering, so that the connection comes back to the same
// region (a VM pair's device stays plugged across a hostd restart).
func (b *Broker) heldByEpochLocked(r *Region) bool {
	for c := range b.records {
		if c.fwRegion == r && c.fw != nil && !c.fw.revokeAt.IsZero() {
			return true
		}
	}
	return false
}

// newEpochLocked begins an epoch and clears every entry's proof bits.
func (b *Broker) newEpochLocked() {
	b.fw.epoch++
	b.fw.since = time.Now()
	b.m.ProofEpochs.Inc()
	if !b.fw.clearing {
		b.fw.clearing = true
		b.wg.Add(1)
		go b.clearAll()
	}
	b.pollLocked()
}

// clearAll clears every entry's proof bits for the current epoch, again
// if the epoch moved meanwhile, and retries a failed clear (nothing
// upgrades until one completes).
func (b *Broker) clearAll() {
	defer b.wg.Done()
	retry := 100 * time.Millisecond
	for {
		b.mu.Lock()
		ep, since := b.fw.epoch, b.fw.since
		if b.closed || b.fw.cleared == ep {
			b.fw.clearing = false
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		start := time.Now()
		n, err := b.ct.ClearMarks(b.opts.ProofOrig|b.opts.ProofReply, since)
		if err != nil {
			b.log.Warn("cannot clear the conntrack proof bits: no connection goes to the rings until it succeeds", "error", err)
			select {
			case <-b.stop:
				b.mu.Lock()
				b.fw.clearing = false
				b.mu.Unlock()
				return
			case <-time.After(retry):
			}
			retry = min(2*retry, 5*time.Second)
			continue
		}
		b.mu.Lock()
		if b.fw.epoch == ep {
			b.fw.cleared = ep
		}
		b.mu.Unlock()
		b.log.Debug("proof bits cleared", "epoch", ep, "entries", n, "took", time.Since(start))
	}
}

// pollProof serves the connections that wait for proof (on TCP) and
// sweeps those on the rings, until neither is left or the broker closes.
// Lookups and clears run without the lock.
func (b *Broker) pollProof() {
	defer b.wg.Done()
	every := b.opts.FirewallPoll
	t := time.NewTicker(every)
	defer t.Stop()
	for first := true; ; first = false {
		if !first {
			select {
			case <-b.stop:
				return
			case <-t.C:
			}
		}
		waits, sweeps, left := b.dueLocked(time.Now())
		if !left {
			return
		}
		for _, c := range waits {
			b.checkWait(c)
		}
		for _, c := range sweeps {
			b.sweep(c)
		}
	}
}

// dueLocked lists the connections whose check is due; left reports
// whether the poller still has work (else it stops, marked so under the
// lock).
func (b *Broker) dueLocked(now time.Time) (waits, sweeps []*Conn, left bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		b.fw.polling = false
		return nil, nil, false
	}
	for c := range b.records {
		switch {
		case c.fw != nil:
			left = true
			if !c.fw.next.After(now) {
				waits = append(waits, c)
			}
		case c.path == PathRings && b.proofOn():
			left = true
			if now.Sub(c.pf.sweptAt) >= b.sweepEvery() {
				sweeps = append(sweeps, c)
			}
		}
	}
	if !left && b.fw.cleared == b.fw.epoch {
		b.fw.polling = false
		return nil, nil, false
	}
	return waits, sweeps, true
}

// sweepEvery is how often a connection on the rings has its proof read.
func (b *Broker) sweepEvery() time.Duration { return max(b.opts.ProofMaxAge/4, b.opts.FirewallPoll) }

// checkWait reads the proof of c, a connection waiting on TCP (a stale
// one's bits are cleared first: packets seen long ago prove nothing now);
// once both bits are set, c goes to the rings if nothing else holds it on
// TCP.
func (b *Broker) checkWait(c *Conn) {
	b.mu.Lock()
	w, orig := c.fw, c.orig
	ep := b.lookupEpochLocked()
	b.mu.Unlock()
	if w == nil || ep == 0 {
		return // not yet: the epoch's clear is under way
	}
	if w.stale {
		at := time.Now()
		err := b.ct.ClearMark(orig, b.opts.ProofOrig|b.opts.ProofReply)
		b.mu.Lock()
		if c.fw == w && err == nil {
			w.stale = false
			w.every, w.next = 0, time.Time{}
			c.pf.ownClear = at
		}
		b.mu.Unlock()
		return // gone (err): ConntrackDestroyed or Resync handles it
	}
	e, err := b.ct.Lookup(orig)
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case c.fw != w || !b.records[c]:
		// moved on meanwhile (another change, conntrack gone, closed)
	case err != nil:
		// gone: ConntrackDestroyed or Resync handles it
	case b.passed(e.Mark) && b.fw.proofOK(ep):
		b.sawLocked(c, e, ep, now)
		c.fw = nil
		if c.path == PathTCP && c.reason == proto.ReasonFirewall && c.live() {
			b.upgradeLocked(c, now)
		}
	default:
		if !w.revokeAt.IsZero() && now.After(w.revokeAt) {
			w.revokeAt = time.Time{}
			if f := c.flow; f != nil { // its ends have not both left: take the memory away
				b.log.Info("no passage past the firewall within the revoke grace: the ring's memory is taken away", "conn", c.Name(), "region", f.Region.Name())
				b.revokeMemoryLocked(f.Region, proto.ReasonFirewall)
			}
		}
		w.every = min(max(2*w.every, b.opts.FirewallPoll), fwPollMax)
		if !w.revokeAt.IsZero() {
			w.every = min(w.every, max(time.Until(w.revokeAt), b.opts.FirewallPoll))
		}
		w.next = now.Add(w.every)
	}
}

// sweep reads the proof of c, a connection on the rings: both bits set
// since the last clear renew it (and clear them again); none for
// ProofMaxAge since the last clear move c to TCP (firewall): its lease's
// packets no longer pass, whatever dropped them.
func (b *Broker) sweep(c *Conn) {
	bits := b.opts.ProofOrig | b.opts.ProofReply
	b.mu.Lock()
	orig, cleared := c.orig, c.pf.clearedAt
	ep := b.lookupEpochLocked()
	c.pf.sweptAt = time.Now()
	b.mu.Unlock()
	if ep == 0 {
		return
	}
	// Looked up on a new stretch of rings too: the bits its TCP stretch
	// set since hostd's last clear are proof, and a connection that
	// policy flips faster than sweepEvery has no other renewal.
	e, err := b.ct.Lookup(orig)
	if err != nil {
		return // gone: ConntrackDestroyed or Resync handles it
	}
	seen := b.passed(e.Mark)
	now := time.Now()
	if cleared.IsZero() || seen {
		if err := b.ct.ClearMark(orig, bits); err != nil {
			return
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.records[c] || c.path != PathRings || c.pf.clearedAt != cleared {
		return // moved meanwhile
	}
	switch {
	case !seen && !c.pf.seenAt.IsZero() && now.Sub(c.pf.seenAt) > b.opts.ProofMaxAge+b.sweepEvery():
		// No passage since its proof, however new this stretch of rings:
		// a rejoin (a new session's OPEN) or a late upgrade starts a new
		// stretch whose own clock would give it ProofMaxAge more. (A
		// flow adopted at start has no proof in this hostd's life: its
		// stretch's clock is all there is, and a relayed one waits on
		// the rings for its peer's stop: TestAcrossHostsHostdKilled.)
		b.staleLocked(c, now.Sub(c.pf.seenAt))
	case cleared.IsZero():
		if seen {
			b.sawLocked(c, e, ep, now)
		}
		c.pf.clearedAt, c.pf.ownClear = now, now
	case seen:
		if cleared.After(c.pf.ownClear) {
			c.pf.ownClear = cleared
		}
		b.sawLocked(c, e, ep, now)
		c.pf.clearedAt, c.pf.ownClear = now, now
	case now.Sub(cleared) > b.opts.ProofMaxAge:
		b.staleLocked(c, now.Sub(cleared))
	}
}

// staleLocked moves c, on the rings with no passage past the firewall
// both ways for the given time, to TCP until its lease shows passage.
func (b *Broker) staleLocked(c *Conn, none time.Duration) {
	b.m.ProofStale.Inc()
	b.log.Info("lease shows no packets past the firewall both ways: moved to TCP until it does", "conn", c.Name(), "tuple", c.orig, "for", none.Round(time.Millisecond))
	b.downgradeLocked(c, proto.ReasonFirewall)
	c.fw = &fwWait{}
}
