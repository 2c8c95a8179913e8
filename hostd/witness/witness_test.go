//go:build linux

package witness_test

import (
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"go.uber.org/goleak"

	"github.com/shuntnet/shunt/hostd/witness"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// The sweeper is the package's goroutine: Close must stop it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// rig makes a rig of n guests with the witness on each guest's host-side
// interface; it returns the interfaces' indexes.
func rig(t *testing.T, name string, n int, o witness.Options) (*nsrig.Rig, *witness.Witness, []int) {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New(name, n)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Destroy() })
	w, err := witness.LoadWith(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	var idx []int
	for _, g := range r.Guests {
		err = nsrig.In(r.HostNSPath(), func() error {
			l, err := netlink.LinkByName(g.HostIf)
			if err != nil {
				return err
			}
			idx = append(idx, l.Attrs().Index)
			return w.Attach(l.Attrs().Index)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return r, w, idx
}

// dialFrom opens a connection from src in guest g (nothing need listen:
// the SYN is what counts).
func dialFrom(g *nsrig.Guest, src, dst netip.AddrPort) {
	nsrig.In(g.NSPath(), func() error {
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(src), Timeout: time.Second}
		network := "tcp4"
		if dst.Addr().Is6() {
			network = "tcp6"
		}
		if c, err := d.Dial(network, dst.String()); err == nil {
			c.Close()
		}
		return nil
	})
}

// TestRecordsSYNOrigin: the program, attached to the host side of a
// guest's veth, records the SYN of a connection the guest opens, with that
// interface; an unrelated tuple is not there.
func TestRecordsSYNOrigin(t *testing.T) {
	r, w, idx := rig(t, "wit", 1, witness.Options{})
	g := r.Guests[0]
	src := netip.AddrPortFrom(g.Addr, 40123)
	dst := netip.AddrPortFrom(g.HostAddr, 9)
	dialFrom(g, src, dst)
	got, err := w.Origin(src, dst)
	if err != nil || got != idx[0] {
		t.Fatalf("Origin(%s -> %s) = %d, %v; want ifindex %d", src, dst, got, err, idx[0])
	}
	// The same tuple named in IPv4-mapped IPv6 form (as an AF_INET6
	// socket names it) is the same record.
	mapped := func(a netip.AddrPort) netip.AddrPort {
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr().As16()), a.Port())
	}
	if got, err := w.Origin(mapped(src), mapped(dst)); err != nil || got != idx[0] {
		t.Fatalf("Origin(%s -> %s) = %d, %v; want ifindex %d", mapped(src), mapped(dst), got, err, idx[0])
	}
	if _, err := w.Origin(netip.MustParseAddrPort("10.9.9.9:1"), dst); !errors.Is(err, witness.ErrNoSYN) {
		t.Fatalf("Origin of an unseen tuple = %v, want ErrNoSYN", err)
	}
	if st := w.Stats(); st.Recorded != 1 {
		t.Fatalf("stats %+v, want 1 recorded", st)
	}
}

// TestRecordsSYNOriginIPv6: the same over IPv6: the SYN of a connection
// the guest opens from its IPv6 address is recorded with its interface,
// apart from the IPv4 tuple with the same ports; a spoofed IPv6 SYN with
// that tuple from another guest changes nothing (the first SYN wins); an
// IPv6 SYN with IPv4-mapped addresses is not recorded, so it cannot take
// an IPv4 tuple's record first.
func TestRecordsSYNOriginIPv6(t *testing.T) {
	r, w, idx := rig(t, "wit6", 2, witness.Options{})
	g1, g2 := r.Guests[0], r.Guests[1]
	src := netip.AddrPortFrom(g1.Addr6, 40125)
	dst := netip.AddrPortFrom(g1.HostAddr6, 9)
	dialFrom(g1, src, dst)
	if got, err := w.Origin(src, dst); err != nil || got != idx[0] {
		t.Fatalf("Origin(%s -> %s) = %d, %v; want ifindex %d", src, dst, got, err, idx[0])
	}
	if _, err := w.Origin(netip.AddrPortFrom(g1.Addr, 40125), netip.AddrPortFrom(g1.HostAddr, 9)); !errors.Is(err, witness.ErrNoSYN) {
		t.Fatalf("Origin of the IPv4 tuple with the same ports = %v, want ErrNoSYN", err)
	}
	if _, err := w.Origin(netip.AddrPortFrom(g1.Addr, 40125), dst); !errors.Is(err, witness.ErrNoSYN) {
		t.Fatalf("Origin of a mixed tuple = %v, want ErrNoSYN", err)
	}
	if err := nsrig.SendTCP(g2.NSPath(), "", src, dst, 0x02, 1); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for w.Stats().Conflicts == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the spoofed IPv6 SYN was not seen within 5s: %+v", w.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got, err := w.Origin(src, dst); err != nil || got != idx[0] {
		t.Fatalf("after g2's SYN, Origin = %d, %v; want g1's ifindex %d", got, err, idx[0])
	}
	if st := w.Stats(); st.Recorded != 1 || st.Conflicts != 1 {
		t.Fatalf("stats %+v, want 1 recorded and 1 conflict", st)
	}
	// g2 sends an IPv6 SYN with IPv4-mapped addresses, g1's next IPv4
	// tuple in the form the map keys it: not recorded, so g1's own SYN
	// for that tuple is the first.
	src4, dst4 := netip.AddrPortFrom(g1.Addr, 40126), netip.AddrPortFrom(g1.HostAddr, 9)
	mapped := func(a netip.AddrPort) netip.AddrPort {
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr().As16()), a.Port())
	}
	if err := nsrig.SendTCP(g2.NSPath(), "", mapped(src4), mapped(dst4), 0x02, 1); err != nil {
		t.Fatal(err)
	}
	// A plain IPv6 SYN after it, on the same link, is recorded: once it
	// is, the program has seen the mapped one.
	marker := netip.AddrPortFrom(g2.Addr6, 40127)
	if err := nsrig.SendTCP(g2.NSPath(), "", marker, dst, 0x02, 1); err != nil {
		t.Fatal(err)
	}
	for !countOf(w, marker, dst) {
		if time.Now().After(deadline) {
			t.Fatalf("g2's marker SYN was not seen within 5s: %+v", w.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
	dialFrom(g1, src4, dst4)
	if got, err := w.Origin(src4, dst4); err != nil || got != idx[0] {
		t.Fatalf("after a mapped IPv6 SYN from g2, Origin(%s -> %s) = %d, %v; want g1's ifindex %d", src4, dst4, got, err, idx[0])
	}
	if st := w.Stats(); st.Recorded != 3 || st.Conflicts != 1 {
		t.Fatalf("stats %+v, want 3 recorded (g1's two, g2's marker) and still 1 conflict", st)
	}
}

// TestFirstSYNWins: a later SYN with a recorded tuple, sent by another
// guest through its own interface, does not overwrite the record; it is
// counted as a conflict. A SYN-ACK records nothing, and the owner's own
// retransmitted SYN is no conflict.
func TestFirstSYNWins(t *testing.T) {
	r, w, idx := rig(t, "witfirst", 2, witness.Options{})
	g1, g2 := r.Guests[0], r.Guests[1]
	src := netip.AddrPortFrom(g1.Addr, 40124)
	dst := netip.AddrPortFrom(g1.HostAddr, 9)
	dialFrom(g1, src, dst)
	// g2 spoofs g1's tuple: a SYN, then a SYN-ACK, both via g2's veth.
	if err := nsrig.SendTCP(g2.NSPath(), "", src, dst, 0x02, 1); err != nil {
		t.Fatal(err)
	}
	if err := nsrig.SendTCP(g2.NSPath(), "", netip.MustParseAddrPort("10.77.9.9:7"), dst, 0x12, 1); err != nil {
		t.Fatal(err)
	}
	// Wait for the spoofed SYN to be seen (the program counts it).
	deadline := time.Now().Add(5 * time.Second)
	for w.Stats().Conflicts == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the spoofed SYN was not seen within 5s: %+v", w.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got, err := w.Origin(src, dst); err != nil || got != idx[0] {
		t.Fatalf("after g2's SYN, Origin = %d, %v; want g1's ifindex %d", got, err, idx[0])
	}
	// g1 retransmits (same tuple, same interface): still g1's, no conflict.
	if err := nsrig.SendTCP(g1.NSPath(), "", src, dst, 0x02, 2); err != nil {
		t.Fatal(err)
	}
	if got, _ := w.Origin(src, dst); got != idx[0] {
		t.Fatalf("after g1's retransmission, Origin = %d", got)
	}
	if _, err := w.Origin(netip.MustParseAddrPort("10.77.9.9:7"), dst); !errors.Is(err, witness.ErrNoSYN) {
		t.Fatalf("a SYN-ACK was recorded: %v", err)
	}
	if st := w.Stats(); st.Recorded != 1 || st.Conflicts != 1 {
		t.Fatalf("stats %+v, want 1 recorded and 1 conflict", st)
	}
}

// TestBoundedRecords: a SYN flood from one guest fills at most its share
// of the map (refused beyond it, counted), never evicts another guest's
// record, and a full map refuses new records instead of evicting; the
// sweeper's pass deletes records older than the TTL and frees the share.
func TestBoundedRecords(t *testing.T) {
	r, w, idx := rig(t, "witbound", 2, witness.Options{MaxRecords: 32, PerInterface: 24, TTL: 200 * time.Millisecond, SweepEvery: -1})
	g1, g2 := r.Guests[0], r.Guests[1]
	dst := netip.AddrPortFrom(g1.HostAddr, 9)
	first := netip.AddrPortFrom(g1.Addr, 41000)
	if err := nsrig.SendTCP(g1.NSPath(), "", first, dst, 0x02, 1); err != nil {
		t.Fatal(err)
	}
	flood := func(g *nsrig.Guest, port0 uint16, n int) {
		t.Helper()
		for i := range n {
			if err := nsrig.SendTCP(g.NSPath(), "", netip.AddrPortFrom(g.Addr, port0+uint16(i)), dst, 0x02, 1); err != nil {
				t.Fatal(err)
			}
		}
	}
	seen := func(n uint64) witness.Stats {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			st := w.Stats()
			if st.Recorded+st.Full+st.OverQuota+st.Conflicts >= n {
				return st
			}
			if time.Now().After(deadline) {
				t.Fatalf("only %+v of %d SYNs seen within 5s", st, n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	flood(g2, 42000, 30)
	if st := seen(31); st.Recorded != 25 || st.OverQuota != 6 {
		t.Fatalf("after g2's flood: %+v; want 25 recorded (g1's 1, g2's share of 24), 6 over quota", st)
	}
	flood(g1, 43000, 10)
	if st := seen(41); st.Recorded != 32 || st.Full != 3 {
		t.Fatalf("after g1's burst: %+v; want 32 recorded (the map is full), 3 refused", st)
	}
	if got, err := w.Origin(first, dst); err != nil || got != idx[0] {
		t.Fatalf("g1's first record after the floods: %d, %v; want ifindex %d", got, err, idx[0])
	}
	// The records age out; then g2 may record again.
	deadline := time.Now().Add(5 * time.Second)
	for w.Sweep() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no record aged out within 5s of a 200ms TTL")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Until a sweep deletes nothing and the newest records of both floods
	// are gone too: g2's were recorded after first, and a sweep between
	// their expiries left g2 at its quota (a run failed so).
	newest := []netip.AddrPort{first, netip.AddrPortFrom(g2.Addr, 42023), netip.AddrPortFrom(g1.Addr, 43006)}
	anyLeft := func() bool {
		for _, src := range newest {
			if countOf(w, src, dst) {
				return true
			}
		}
		return false
	}
	for w.Sweep() != 0 || anyLeft() {
		if time.Now().After(deadline) {
			t.Fatal("records left after 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	st := w.Stats()
	before := st.Recorded
	flood(g2, 44000, 1)
	seen(st.Recorded + st.Full + st.OverQuota + st.Conflicts + 1)
	if got := w.Stats().Recorded; got != before+1 {
		t.Fatalf("after the sweep g2's new SYN was not recorded: %+v", w.Stats())
	}
}

func countOf(w *witness.Witness, src, dst netip.AddrPort) bool {
	_, err := w.Origin(src, dst)
	return err == nil
}
