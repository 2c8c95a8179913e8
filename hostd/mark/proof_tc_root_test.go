//go:build linux

package mark_test

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestProofTCEgressUnseen shows what the proof chains cannot see: a tc
// egress drop on the receiving guest's host-side interface runs after
// postrouting, so the packets it drops have set their direction's bit.
func TestProofTCEgressUnseen(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "tc", "iproute2")
	r, ct, f := proofRig(t, "prt")
	g1, g2 := r.Guests[0], r.Guests[1]
	var l net.Listener
	if err := nsrig.In(g2.NSPath(), func() (err error) {
		l, err = net.Listen("tcp4", netip.AddrPortFrom(g2.Addr, 0).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got := make(chan byte, 16)
	srv := make(chan net.Conn, 1)
	defer func() {
		l.Close()
		select {
		case s := <-srv:
			s.Close()
		case <-time.After(time.Second):
		}
	}()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		srv <- c
		b := make([]byte, 1)
		for {
			if _, err := io.ReadFull(c, b); err != nil {
				return
			}
			got <- b[0]
			_, _ = c.Write(b)
		}
	}()
	c := g1.Dial(t, l.Addr().(*net.TCPAddr).AddrPort())
	defer c.Close()
	tu := ctrack.Tuple{Src: c.LocalAddr().(*net.TCPAddr).AddrPort(), Dst: c.RemoteAddr().(*net.TCPAddr).AddrPort()}
	_, _ = c.Write([]byte{1})
	<-got
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	// The operator drops everything sent to g2, with tc on g2's port (a pfifo qdisc of limit 0 drops every packet; tc egress filters and policers run at the same place).
	for _, args := range [][]string{{"qdisc", "add", "dev", g2.HostIf, "root", "pfifo", "limit", "0"}} {
		if _, err := nsrig.Run(r.HostNSPath(), "tc", args...); err != nil {
			t.Fatal(err)
		}
	}
	if err := ct.ClearMark(tu, f.Proof()); err != nil {
		t.Fatal(err)
	}
	_, _ = c.Write([]byte{2}) // dropped by tc, retransmitted, dropped
	time.Sleep(time.Second)
	select {
	case b := <-got:
		t.Fatalf("byte %d reached g2 past the tc drop", b)
	default:
	}
	e, err := ct.Lookup(tu)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("proof bits with every packet to g2 dropped by its port's qdisc: %#x (orig %#x)", e.Mark&f.Proof(), f.PassOrig())
	if e.Mark&f.PassOrig() == 0 {
		t.Fatal("the original bit stayed clear: drops on the way out are seen after all (update docs/SECURITY.md)")
	}
}
