//go:build linux

package crosshost_test

import (
	"context"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/peers"
)

// TestAcrossHostsHostdStopped: SIGTERM of either host's hostd mid-stream. A
// stopping hostd moves every connection to TCP (DOWN(shutdown)) and waits
// for its guests to leave the rings; for a relayed connection that means
// both hosts' stretches stop, the hosts exchange where their rings ended,
// and both guests resume on TCP at exact offsets: the stream (seeded,
// both ways, checksummed) goes on with no byte lost or duplicated, while
// that host has no hostd and after it is back; first h1's (the host that
// dials), then h2's.
func TestAcrossHostsHostdStopped(t *testing.T) {
	e := relayPair(t)
	g2 := e.f.Hosts[1].Guests[0]
	e.echoOn(1, 7300)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := e.hosts[0].Dial(ctx, 1, netip.AddrPortFrom(g2.Addr, 7300).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip(t, c, 1, 1<<20)
	e.relayed(7300, 10*time.Second)
	for k := range 2 {
		e.stream(c, uint64(2+k), 48<<20, 60*time.Second, func(got *atomic.Int64) {
			for end := time.Now().Add(20 * time.Second); got.Load() < 8<<20 && time.Now().Before(end); {
				time.Sleep(10 * time.Millisecond)
			}
			e.hosts[k].StopHostd()
			// Both guests left the ring pair within the grace: the
			// stretch stopped and each host learnt the other's end.
			log := e.hosts[k].Log()
			if i := strings.LastIndex(log, "connections moved to TCP"); i < 0 || !strings.Contains(strings.SplitN(log[i:], "\n", 2)[0], "rings_still_held=0") {
				t.Errorf("h%d's hostd stopped with ring pairs still held:\n%s", k+1, tail(log, 20))
			}
			// It goes on with no hostd on that host (the stream's own
			// deadline fails the test if it stops: this wait ends with it).
			for at, end := got.Load(), time.Now().Add(20*time.Second); got.Load() < at+4<<20 && time.Now().Before(end); {
				time.Sleep(10 * time.Millisecond)
			}
			if err := e.hosts[k].StartHostd(); err != nil {
				t.Error(err)
			}
		})
	}
	// A new connection is relayed again.
	e.within(20*time.Second, "both channels up again", func() bool {
		return state(e.peersOf(0)) == peers.StateUp && state(e.peersOf(1)) == peers.StateUp
	})
	e.echoOn(1, 7301)
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	c2, err := e.hosts[0].Dial(ctx2, 1, netip.AddrPortFrom(g2.Addr, 7301).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	roundTrip(t, c2, 4, 1<<20)
	e.relayed(7301, 20*time.Second)
}
