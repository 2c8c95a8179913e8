//go:build linux

package crosshost_test

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/perf"
)

// TestAcrossHostsHalfClose: a stream through the relays that ends with
// the writer's half-close, and the sink's answer after its EOF (the
// sink then closes): the answer's bytes, written just before the sink's
// close, reach the writer every time.
func TestAcrossHostsHalfClose(t *testing.T) {
	e := relayPair(t)
	ln, err := e.hosts[1].Listen(1, 7300)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go perf.Serve(ln, 8, false)
	at := netip.AddrPortFrom(e.f.Hosts[1].Guests[0].Addr, 7300).String()
	for i := range 8 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, err := e.hosts[0].Dial(ctx, 1, at)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			e.relayed(c.LocalAddr().(*net.TCPAddr).Port, 10*time.Second)
		}
		c.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := perf.RemoteStreamSized(c, 64<<10, 8<<10, 4<<20); err != nil {
			t.Fatalf("stream %d: %v\n%s", i, err, e.flows())
		}
		c.Close()
	}
}

// TestAcrossHostsCloseEnds: a relayed connection that both guests close
// while on the rings is forgotten on both hosts within seconds: the
// stretch stops after carrying each guest's last bytes and the relay ends
// close (before, the relay's wait for a closed guest's last bytes
// re-armed itself forever: the record stayed, and hostd spun at a third
// of a core per such connection).
func TestAcrossHostsCloseEnds(t *testing.T) {
	e := relayPair(t)
	e.echoOn(1, 7310)
	at := netip.AddrPortFrom(e.f.Hosts[1].Guests[0].Addr, 7310).String()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := e.hosts[0].Dial(ctx, 1, at)
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, c, 1, 1<<20)
	port := c.LocalAddr().(*net.TCPAddr).Port
	e.relayed(port, 10*time.Second)
	roundTrip(t, c, 2, 1<<20)
	c.Close()
	deadline := time.Now().Add(15 * time.Second)
	for {
		_, a := e.connOn(0, port)
		_, b := e.connOn(1, port)
		if !a && !b {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the closed connection is still recorded 15 s later\n%s", e.flows())
		}
		time.Sleep(100 * time.Millisecond)
	}
}
