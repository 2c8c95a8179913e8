//go:build linux

package ruleset

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"
)

// TestWatch (root, nft): a table added by someone else is reported once
// per transaction; hostd's own table is not.
func TestWatch(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (netfilter netlink in a new network namespace): run as root")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("needs nft: apt-get install nftables")
	}
	ns := "shunt-rstest"
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Skipf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	nft := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", append([]string{"netns", "exec", ns, "nft"}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("nft %v: %v: %s", args, err, out)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	changed := make(chan struct{}, 16)
	done := make(chan error, 1)
	go func() {
		done <- Watch(ctx, "/run/netns/"+ns, "mine", func() { changed <- struct{}{} })
	}()
	time.Sleep(200 * time.Millisecond) // the watch joins the group
	nft("add", "table", "inet", "mine")
	nft("add", "chain", "inet", "mine", "c")
	select {
	case <-changed:
		t.Fatal("a change to the ignored table was reported")
	case <-time.After(300 * time.Millisecond):
	}
	nft("add", "table", "inet", "theirs")
	select {
	case <-changed:
	case <-time.After(2 * time.Second):
		t.Fatal("a new table was not reported")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Watch: %v", err)
	}
}
