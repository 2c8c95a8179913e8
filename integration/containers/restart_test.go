//go:build linux

package containers

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
)

// TestContainerHostdRestart: hostd is killed while two containers stream
// on the rings. The restarted hostd has both run-time guests again (same
// names and ids, from state_dir), the containers' libraries reach it on
// the new container socket (the CDI device mounts its directory), the
// stream is on the rings again, and every byte arrives in order.
func TestContainerHostdRestart(t *testing.T) {
	w := newWorld(t)
	dev := []string{"--device", w.device}
	chunk := randomBytes(t, 1<<20)
	w.writeData("chunk.bin", chunk)
	rcv := w.run("rcv", dev, "/usr/bin/socat", "-u", "TCP-LISTEN:5000,reuseaddr,fork", "CREATE:/data/recv.bin")
	rg := w.waitGuest(rcv)
	w.waitListening(rg.Name)
	snd := w.run("snd", dev, "/bin/sh", "-c", "while :; do cat /data/chunk.bin; done | /usr/bin/socat -u STDIN TCP:"+rg.Addresses[0]+":5000")
	w.waitGuest(snd)
	onRings := func(min uint64) func() bool {
		return func() bool {
			return slices.ContainsFunc(w.flows(), func(f broker.FlowInfo) bool { return f.Path == "rings" && f.RingsAB+f.RingsBA > min })
		}
	}
	w.waitFor(20*time.Second, "the stream on the rings", onRings(4<<20))
	before := w.guests()

	w.stopHostd(true)
	w.startHostd()
	after := w.guests()
	if len(after) != 2 || !slices.EqualFunc(before, after, func(a, b admin.GuestSpec) bool { return a.Name == b.Name && a.ID == b.ID && a.Netns == b.Netns }) {
		t.Fatalf("after a restart hostd has guests %+v, want %+v", after, before)
	}
	// Whatever the restarted hostd adopted: 4 MiB more must cross the
	// rings after it came up.
	var base uint64
	for _, f := range w.flows() {
		base = max(base, f.RingsAB+f.RingsBA)
	}
	w.waitFor(30*time.Second, "the stream on the rings after the restart", onRings(base+4<<20))
	size := func() int { st, _ := os.Stat(filepath.Join(w.dir, "data", "recv.bin")); return int(st.Size()) }
	n := size()
	w.waitFor(20*time.Second, "the stream going on", func() bool { return size() > n+(8<<20) })

	w.podman("rm", "-f", "-t", "0", snd)
	w.waitFor(30*time.Second, "the receiver's end of stream", func() bool {
		out, err := w.podmanCmd(ctxT(t), "top", rcv, "args").Output()
		return err == nil && strings.Count(string(out), "socat") == 1
	})
	got := w.readData("recv.bin")
	for off := 0; off < len(got); off += len(chunk) {
		end := min(off+len(chunk), len(got))
		if !bytes.Equal(got[off:end], chunk[:end-off]) {
			t.Fatalf("receiver's bytes %d-%d are not the stream's: a gap or corruption across the restart\n%s", off, end, w.logsOf(rcv))
		}
	}
	t.Logf("receiver: %d bytes in order across the restart", len(got))
}
