//go:build linux

package containers

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
)

// loopCount is how many containers TestPodmanLoop creates and removes: 50
// with SHUNT_TEST_LONG=1 (the count), 10 otherwise (CI's budget).
func loopCount() int {
	if os.Getenv("SHUNT_TEST_LONG") == "1" {
		return 50
	}
	return 10
}

// TestPodmanLoop creates and removes containers in batches of 5: while
// they run, hostd's run-time guests are exactly podman's running
// containers, and each container's process is welcomed as its own guest;
// at the end no guest, session socket, region, spec or nftables rule is
// left.
func TestPodmanLoop(t *testing.T) {
	w := newWorld(t)
	baseSockets := w.hostdSockets()
	n := loopCount()
	start := time.Now()
	for done := 0; done < n; {
		var ids []string
		for range min(5, n-done) {
			done++
			ids = append(ids, w.run("loop"+strconv.Itoa(done), []string{"--device", w.sdevice}, "/bin/sh", "-c", "/bin/probe; exec sleep 600"))
		}
		w.checkMatches()
		for _, id := range ids {
			g := w.guestOf(id)
			var out string
			w.waitFor(10*time.Second, "container "+id[:12]+"'s probe", func() bool {
				out = w.logsOf(id)
				return strings.Contains(out, "\n") || strings.Contains(out, "ERROR")
			})
			if want := "WELCOME " + strconv.FormatUint(uint64(g.ID), 10); strings.TrimSpace(out) != want {
				t.Fatalf("container %s's probe: %q, want %q (its own guest)\n%s", id[:12], out, want, w.state())
			}
		}
		w.podman(append([]string{"rm", "-f", "-t", "0"}, ids...)...)
		w.checkMatches()
	}
	took := time.Since(start)
	t.Logf("%d containers created, checked and removed in %s (%s each)", n, took.Round(time.Millisecond), (took / time.Duration(n)).Round(time.Millisecond))
	w.waitFor(10*time.Second, "nothing left", func() bool {
		specs, _ := os.ReadDir(filepath.Join(w.dir, "state", "guests"))
		return len(w.guests()) == 0 && len(w.regionFiles()) == 0 && w.markRules() == 0 && len(specs) == 0 && w.hostdSockets() <= baseSockets
	})
}

// checkMatches checks that hostd's run-time guests are podman's running
// containers of this test, by container id.
func (w *world) checkMatches() {
	w.t.Helper()
	ps := strings.Fields(w.podman("ps", "-q", "--no-trunc", "--filter", "label=shunt-test="+w.name))
	// hostd guest list, as an operator runs it.
	out := w.must(bin.hostd, "guest", "list", "-json", "-admin", w.admin)
	var specs []admin.GuestSpec
	if err := json.Unmarshal([]byte(out), &specs); err != nil {
		w.t.Fatalf("hostd guest list -json: %v: %s", err, out)
	}
	var gs []string
	for _, g := range specs {
		gs = append(gs, g.Container)
	}
	slices.Sort(ps)
	slices.Sort(gs)
	if !slices.Equal(ps, gs) {
		w.t.Fatalf("hostd guest list has containers %v, podman ps %v\n%s", gs, ps, w.state())
	}
}
