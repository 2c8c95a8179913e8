package broker

import (
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
)

// fwWait is a connection's wait after a ruleset change: it goes back to
// the rings only once its lease (the kernel connection) carried packets
// both ways under the new ruleset, seen in conntrack's accounting
// counters, which must have risen in both directions past base.
type fwWait struct {
	have       bool   // base read
	noAcct     bool   // the entry has no counters: on TCP until the next policy reload
	orig, repl uint64 // packets per direction at base
	// An idle lease may wait long: its checks back off, from every
	// FirewallPoll up to fwPollMax, so that many idle connections cost
	// few lookups.
	next  time.Time
	every time.Duration
}

// fwPollMax bounds the back-off of one connection's counter checks.
const fwPollMax = 5 * time.Second

// RulesetChanged is the firewall's ruleset watch (hostd/ruleset): any
// change may drop a connection's packets, which the rings would not see.
// Every connection on the rings moves to TCP (firewall); every connection
// waits, before it may go (back) to the rings, until its lease carried
// packets both ways under the new ruleset. A poller reads the counters.
func (b *Broker) RulesetChanged() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	n := 0
	for c := range b.records {
		if c.a.done || c.b.done || !c.indexed {
			continue
		}
		if c.path == PathRings {
			b.downgradeLocked(c, proto.ReasonFirewall)
			n++
		} else if c.path == PathTCP && c.reason == proto.ReasonNone {
			c.reason = proto.ReasonFirewall
		}
		c.fw = &fwWait{}
	}
	if n > 0 {
		b.log.Info("firewall ruleset changed: connections moved to TCP until their lease carries packets both ways", "moved", n)
	}
	if !b.fwPolling {
		b.fwPolling = true
		b.wg.Add(1)
		go b.pollFirewall()
	}
}

// pollFirewall reads the counters of the connections waiting after a
// ruleset change, every FirewallPoll, until none waits or the broker
// closes. Lookups run without the lock.
func (b *Broker) pollFirewall() {
	defer b.wg.Done()
	t := time.NewTicker(b.opts.FirewallPoll)
	defer t.Stop()
	type check struct {
		c    *Conn
		w    *fwWait
		orig ctrack.Tuple
	}
	for first := true; ; first = false {
		if !first {
			select {
			case <-b.stop:
				return
			case <-t.C:
			}
		}
		b.mu.Lock()
		var checks []check
		waiting := 0
		now := time.Now()
		for c := range b.records {
			if c.fw == nil || c.fw.noAcct {
				continue
			}
			waiting++
			if !c.fw.next.After(now) {
				checks = append(checks, check{c, c.fw, c.orig})
			}
		}
		if waiting == 0 || b.closed {
			b.fwPolling = false
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		for _, k := range checks {
			e, err := b.ct.Lookup(k.orig)
			b.mu.Lock()
			c, w := k.c, k.w
			switch {
			case c.fw != w || !b.records[c]:
				// moved on meanwhile (another change, conntrack gone, closed)
			case err != nil:
				// gone: ConntrackDestroyed or Resync handles it
			case !e.Counted():
				w.noAcct = true
				b.log.Info("connection has no conntrack counters (is net.netfilter.nf_conntrack_acct on?): it stays on TCP until the next policy reload", "conn", c.Name())
			case !w.have:
				w.have, w.orig, w.repl = true, e.PacketsOrig, e.PacketsReply
			case e.PacketsOrig > w.orig && e.PacketsReply > w.repl:
				c.fw = nil
				if c.path == PathTCP && c.reason == proto.ReasonFirewall && c.live() {
					b.upgradeLocked(c, time.Now())
				}
			default:
				w.every = min(max(2*w.every, b.opts.FirewallPoll), fwPollMax)
				w.next = time.Now().Add(w.every)
			}
			b.mu.Unlock()
		}
	}
}
