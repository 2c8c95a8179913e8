//go:build linux

package nsrig_test

import (
	"os"
	"strings"
	"testing"

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
	if err != nil || !strings.Contains(rules, "ct mark set") {
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
