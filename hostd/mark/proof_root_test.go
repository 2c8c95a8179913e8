//go:build linux

package mark_test

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestProofBits runs hostd's proof chains against a real connection
// between two guests of a rig: the handshake sets both proof bits; once
// cleared (ctnetlink), a DROP of the reply direction in the operator's
// forward chain lets only the original direction's bit come back, though
// conntrack still counts the dropped packets; the reply bit returns once
// the rule goes (TCP retransmits); ClearMarks clears every entry's bits.
func TestProofBits(t *testing.T) {
	r, ct, f := proofRig(t, "prf")
	if _, err := nsrig.Run(r.HostNSPath(), "sysctl", "-qw", "net.netfilter.nf_conntrack_acct=1", "net.netfilter.nf_conntrack_timestamp=1"); err != nil {
		t.Fatal(err)
	}
	g1, g2 := r.Guests[0], r.Guests[1]

	var l net.Listener
	if err := nsrig.In(g2.NSPath(), func() (err error) {
		l, err = net.Listen("tcp4", netip.AddrPortFrom(g2.Addr, 0).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.Copy(c, c)
	}()
	c := g1.Dial(t, l.Addr().(*net.TCPAddr).AddrPort())
	defer c.Close()
	tu := ctrack.Tuple{Src: c.LocalAddr().(*net.TCPAddr).AddrPort(), Dst: c.RemoteAddr().(*net.TCPAddr).AddrPort()}
	echo := func() {
		t.Helper()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
	}
	proof := func() (uint32, ctrack.Entry) {
		t.Helper()
		e, err := ct.Lookup(tu)
		if err != nil {
			t.Fatal(err)
		}
		return e.Mark & f.Proof(), e
	}
	waitProof := func(want uint32, what string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			got, _ := proof()
			if got == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: proof bits %#x after 10s, want %#x", what, got, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	echo()
	if got, _ := proof(); got != f.Proof() {
		t.Fatalf("after the handshake and an echo: proof bits %#x, want both %#x", got, f.Proof())
	}
	if err := ct.ClearMark(tu, f.Proof()); err != nil {
		t.Fatal(err)
	}
	got, before := proof()
	if got != 0 {
		t.Fatalf("after ClearMark: proof bits %#x, want none", got)
	}

	// The operator drops the reply direction (before the rig's
	// established-accept rule). g1's byte crosses; g2's echo and ACKs do
	// not, yet conntrack counts them (its hooks run before the filter).
	if _, err := nsrig.Run(r.HostNSPath(), "nft", "insert", "rule", "inet", "shunt_rig", "forward",
		"ip", "saddr", g2.Addr.String(), "tcp", "sport", itoa(tu.Dst.Port()), "counter", "drop"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte{2}); err != nil {
		t.Fatal(err)
	}
	waitProof(f.PassOrig(), "reply direction dropped")
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, e := proof()
		if e.PacketsReply > before.PacketsReply {
			break // a dropped reply packet was counted: counters are no proof
		}
		if time.Now().After(deadline) {
			t.Fatalf("conntrack counted no reply packet in 10s (acct off?): %+v", e)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // retransmissions meanwhile must not set the reply bit
	if got, _ := proof(); got != f.PassOrig() {
		t.Fatalf("with the reply direction dropped: proof bits %#x, want only the original's %#x", got, f.PassOrig())
	}

	// The rule goes: the retransmitted echo passes and proves the reply.
	if err := r.Firewall(""); err != nil {
		t.Fatal(err)
	}
	waitProof(f.Proof(), "after the drop rule went")
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	// An epoch that began before the connection was made spares its bits
	// (its packets all met the rules of that epoch).
	if n, err := ct.ClearMarks(f.Proof(), before.Start.Add(-time.Second)); err != nil || n != 0 {
		t.Fatalf("ClearMarks for entries made before the connection: %d, %v; want it spared", n, err)
	}
	if got, _ := proof(); got != f.Proof() {
		t.Fatalf("after a ClearMarks that should spare it: proof bits %#x", got)
	}
	// The connection falls quiet first (the echo's delayed ACK, say): a
	// packet past the filter after the clear proves passage again.
	quiet, last := time.Now(), uint64(0)
	for deadline := time.Now().Add(10 * time.Second); time.Since(quiet) < 500*time.Millisecond; time.Sleep(20 * time.Millisecond) {
		if _, e := proof(); e.PacketsOrig+e.PacketsReply != last {
			quiet, last = time.Now(), e.PacketsOrig+e.PacketsReply
		}
		if time.Now().After(deadline) {
			t.Fatal("the connection's packets did not stop for 500 ms in 10 s")
		}
	}
	n, err := ct.ClearMarks(f.Proof(), time.Now())
	if err != nil || n < 1 {
		t.Fatalf("ClearMarks: %d, %v; want at least this connection", n, err)
	}
	if got, _ := proof(); got != 0 {
		t.Fatalf("after ClearMarks: proof bits %#x", got)
	}
}

// proofRig is a rig of two guests with the rig's firewall and hostd's
// table (proof chains included) in its host namespace, and a conntrack
// client there; all go when the test ends.
func proofRig(t *testing.T, name string) (*nsrig.Rig, *ctrack.Netlink, mark.Field) {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New(name, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Destroy() })
	if err := r.Firewall(""); err != nil {
		t.Fatal(err)
	}
	ct, err := ctrack.Dial(r.HostNSPath())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ct.Close() })
	m, err := mark.Open(mark.Options{Netns: r.HostNSPath()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return r, ct, m.Field()
}

func itoa(p uint16) string {
	return netip.AddrPortFrom(netip.IPv4Unspecified(), p).String()[len("0.0.0.0:"):]
}
