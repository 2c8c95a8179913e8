//go:build linux

package nsrig_test

import (
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestCreateIdempotentAndClean: creating a rig twice works (leftovers are
// replaced), the guests reach each other through the host, and Destroy
// leaves no namespace behind, twice over.
func TestCreateIdempotentAndClean(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New("idem", 2)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := r.Create(); err != nil {
			t.Fatalf("create: %v", err)
		}
	}
	out, err := nsrig.Run(r.Guests[0].NSPath(), "ip", "route", "get", r.Guests[1].Addr.String())
	if err != nil || !strings.Contains(out, "via "+r.Guests[0].HostAddr.String()) {
		t.Fatalf("guest 1's route to guest 2: %q, %v", out, err)
	}
	rules, err := nsrig.Run(r.HostNSPath(), "nft", "list", "table", "inet", "shunt_rig")
	if err != nil || !strings.Contains(rules, "ct state established,related accept") {
		t.Fatalf("host ruleset: %q, %v", rules, err)
	}
	for range 2 {
		if err := r.Destroy(); err != nil {
			t.Fatalf("destroy: %v", err)
		}
	}
	for _, ns := range []string{r.HostNS, r.Guests[0].NS, r.Guests[1].NS} {
		if _, err := os.Stat("/run/netns/" + ns); err == nil {
			t.Errorf("namespace %s left behind", ns)
		}
	}
}

func TestNewRejectsBadNames(t *testing.T) {
	for _, name := range []string{"", "much-too-long", "a b", "a/b"} {
		if _, err := nsrig.New(name, 2); err == nil {
			t.Errorf("New(%q) succeeded", name)
		}
	}
	if _, err := nsrig.New("ok", 0); err == nil {
		t.Error("New with 0 guests succeeded")
	}
}

// TestCoexistsWithIproute2: after nsrig, `ip netns add` must not hide
// nsrig's namespaces (iproute2 makes /run/netns a shared mount point the
// first time; nsrig now does the same first), so both tools can delete
// each other's namespaces afterwards.
func TestCoexistsWithIproute2(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	testenv.NeedTool(t, "ip", "iproute2")
	r, err := nsrig.New("ipr", 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatalf("create: %v", err)
	}
	defer r.Destroy()
	if !sharedMount(t, "/run/netns") {
		t.Fatal("/run/netns is not a shared mount point after nsrig created namespaces")
	}
	ipNS := "shunt-ipr-ip"
	if out, err := exec.Command("ip", "netns", "add", ipNS).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	defer exec.Command("ip", "netns", "del", ipNS).Run()
	list, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil || !strings.Contains(string(list), r.HostNS) || !strings.Contains(string(list), ipNS) {
		t.Fatalf("ip netns list does not show both tools' namespaces: %v\n%s", err, list)
	}
	if _, err := nsrig.Run(r.Guests[0].NSPath(), "true"); err != nil {
		t.Fatalf("nsrig's namespace unusable after ip netns add: %v", err)
	}
	if err := r.Destroy(); err != nil {
		t.Fatalf("nsrig destroy after ip netns add: %v", err)
	}
	if out, err := exec.Command("ip", "netns", "del", ipNS).CombinedOutput(); err != nil {
		t.Fatalf("ip netns del: %v: %s", err, out)
	}
	for _, ns := range []string{r.HostNS, r.Guests[0].NS, ipNS} {
		if _, err := os.Stat("/run/netns/" + ns); err == nil {
			t.Errorf("namespace %s left behind", ns)
		}
	}
}

// sharedMount reports whether path is a mount point with shared
// propagation, from /proc/self/mountinfo.
func sharedMount(t *testing.T, path string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 6 && f[4] == path {
			for _, opt := range f[6:] {
				if opt == "-" {
					break
				}
				if strings.HasPrefix(opt, "shared:") {
					return true
				}
			}
		}
	}
	return false
}

// TestTCPSegmentChecksums: SendTCP's hand-made segments carry correct IPv4
// and TCP checksums (conntrack drops segments with wrong ones).
func TestTCPSegmentChecksums(t *testing.T) {
	src, dst := netip.MustParseAddrPort("10.77.1.2:40000"), netip.MustParseAddrPort("10.77.2.2:5201")
	b := nsrig.TCPSegment(src, dst, 0x02, 12345)
	if got := nsrig.Checksum(b[:20], 0); got != 0 {
		t.Fatalf("IPv4 header checksum does not verify: %#04x", got)
	}
	pseudo := uint32(6 + 20)
	for _, a := range [][]byte{b[12:14], b[14:16], b[16:18], b[18:20]} {
		pseudo += uint32(a[0])<<8 | uint32(a[1])
	}
	if got := nsrig.Checksum(b[20:], pseudo); got != 0 {
		t.Fatalf("TCP checksum does not verify: %#04x", got)
	}
	if b[33] != 0x02 || b[9] != 6 {
		t.Fatalf("flags %#x protocol %d", b[33], b[9])
	}
}

// TestDualStack: every guest has an IPv6 address as well, usable at once
// (no tentative address), and the guests reach each other over IPv6
// through the host, which forwards it, as they do over IPv4.
func TestDualStack(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New("dual", 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatalf("create: %v", err)
	}
	defer r.Destroy()
	g1, g2 := r.Guests[0], r.Guests[1]
	if want := netip.MustParseAddr("fd00:77:2::2"); g2.Addr6 != want || g2.HostAddr6 != netip.MustParseAddr("fd00:77:2::1") {
		t.Fatalf("g2's IPv6 addresses %s, %s; want %s and fd00:77:2::1", g2.Addr6, g2.HostAddr6, want)
	}
	out, err := nsrig.Run(g1.NSPath(), "ip", "-6", "addr", "show", "dev", "eth0")
	if err != nil || !strings.Contains(out, g1.Addr6.String()+"/64") || strings.Contains(out, "tentative") {
		t.Fatalf("g1's IPv6 address: %q, %v", out, err)
	}
	for _, to := range []netip.Addr{g2.Addr, g2.Addr6} {
		l := g2.ListenOn(t, to)
		c := g1.Dial(t, l)
		buf := make([]byte, 1)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		// The listener closes what it accepts: EOF proves the round trip.
		if n, err := c.Read(buf); n != 0 || err == nil {
			t.Fatalf("g1 -> %s: read %d, %v; want EOF", l, n, err)
		}
		c.Close()
	}
}

// TestTCPSegment6Checksum: SendTCP's hand-made IPv6 segments carry a
// correct TCP checksum over the IPv6 pseudo header.
func TestTCPSegment6Checksum(t *testing.T) {
	src, dst := netip.MustParseAddrPort("[fd00:77:1::2]:40000"), netip.MustParseAddrPort("[fd00:77:2::2]:5201")
	b := nsrig.TCPSegment6(src, dst, 0x02, 12345)
	if len(b) != 60 || b[0]>>4 != 6 || b[6] != 6 || b[5] != 20 {
		t.Fatalf("IPv6 header % x", b[:40])
	}
	pseudo := uint32(6 + 20)
	for i := 8; i < 40; i += 2 {
		pseudo += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if got := nsrig.Checksum(b[40:], pseudo); got != 0 {
		t.Fatalf("TCP checksum does not verify: %#04x", got)
	}
	if b[53] != 0x02 {
		t.Fatalf("flags %#x", b[53])
	}
}
