//go:build linux

package containers

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
)

var statsLine = regexp.MustCompile(`stats: read (\d+) tcp \+ (\d+) ring = \d+, wrote (\d+) tcp \+ (\d+) ring`)

// ringBytes sums what the library's SHUNT_STATS lines in out say went
// over the rings and over TCP (read and written).
func ringBytes(out string) (ring, tcp int64) {
	for _, m := range statsLine.FindAllStringSubmatch(out, -1) {
		rt, _ := strconv.ParseInt(m[1], 10, 64)
		rr, _ := strconv.ParseInt(m[2], 10, 64)
		wt, _ := strconv.ParseInt(m[3], 10, 64)
		wr, _ := strconv.ParseInt(m[4], 10, 64)
		ring += rr + wr
		tcp += rt + wt
	}
	return ring, tcp
}

func (w *world) writeData(name string, b []byte) {
	w.t.Helper()
	if err := os.WriteFile(filepath.Join(w.dir, "data", name), b, 0o644); err != nil {
		w.t.Fatal(err)
	}
}

func (w *world) readData(name string) []byte {
	w.t.Helper()
	b, err := os.ReadFile(filepath.Join(w.dir, "data", name))
	if err != nil {
		w.t.Fatalf("%s: %v\n%s", name, err, w.state())
	}
	return b
}

func randomBytes(t *testing.T, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestPodmanIperf3Redis: two containers on one network, each given the
// preload library by the CDI device, with iperf3, a file sent with socat
// (compared byte for byte) and redis (redis-benchmark, then a 1 MiB
// value set and read back): the bytes go over the rings (SHUNT_STATS), and
// both containers are hostd's guests while they run.
func TestPodmanIperf3Redis(t *testing.T) {
	w := newWorld(t)
	dev := []string{"--device", w.device, "-e", "SHUNT_STATS=1"}

	// iperf3: 32 MiB, which should go over the rings. Its server's -F
	// file is no check of the data: with the partial reads of a veth it
	// writes bytes that were never sent, over plain TCP in these
	// containers too (seen here: 4 runs in 4 differ from the sent file).
	data := randomBytes(t, 64<<20)
	w.writeData("in.bin", data)
	srv := w.run("iperf-s", dev, "/usr/bin/iperf3", "-s", "-1")
	g := w.waitGuest(srv)
	w.waitListening(g.Name)
	out := w.podman(append(append([]string{"run", "--rm", "--label", "shunt-test=" + w.name, "--network", w.name}, dev...),
		w.image, "/usr/bin/iperf3", "-c", g.Addresses[0], "-t", "2")...)
	w.podman("wait", srv)
	ring, tcp := ringBytes(out)
	t.Logf("iperf3 client (2 s): %d bytes on the rings, %d on TCP", ring, tcp)
	// The first bytes go on TCP until both ends' OPENs paired (the open
	// delay, then hostd's checks), which on this busy 2-core host took up
	// to a few hundred ms: hence 2 s, of which most must be on the rings.
	if ring < tcp {
		t.Errorf("iperf3: %d bytes on the rings and %d on TCP, want most of them on the rings\nclient:\n%s\nserver:\n%s\n%s", ring, tcp, out, w.logsOf(srv), w.state())
	}

	// The data check: the same file through socat, compared byte for byte.
	rcv := w.run("socat-r", dev, "/usr/bin/socat", "-u", "TCP-LISTEN:5000,reuseaddr,fork", "CREATE:/data/out.bin")
	g = w.waitGuest(rcv)
	w.waitListening(g.Name)
	out = w.podman(append(append([]string{"run", "--rm", "--label", "shunt-test=" + w.name, "--network", w.name, "-v", filepath.Join(w.dir, "data") + ":/data", "-e", "SHUNT_VERBOSE=1"}, dev...),
		w.image, "/usr/bin/socat", "-u", "OPEN:/data/in.bin", "TCP:"+g.Addresses[0]+":5000")...)
	w.waitFor(20*time.Second, "socat's receiver wrote the file", func() bool {
		b, _ := os.ReadFile(filepath.Join(w.dir, "data", "out.bin"))
		return len(b) >= len(data)
	})
	if got := w.readData("out.bin"); !bytes.Equal(got, data) {
		t.Fatalf("socat: the receiver wrote %d bytes, not the %d sent (first difference at %d)\nsender:\n%s\nreceiver:\n%s", len(got), len(data), firstDiff(data, got), out, w.logsOf(rcv))
	}
	// socat exits without closing, so its library prints no stats: its
	// -v lines say that the connection took the rings.
	if !strings.Contains(out, "shunt (slot") {
		t.Errorf("socat: the sender's connection did not take the rings:\n%s", out)
	}

	// redis: the benchmark, then a value set and read back.
	rs := w.run("redis-s", dev, "/usr/bin/redis-server", "--port", "6379", "--save", "", "--appendonly", "no", "--protected-mode", "no")
	g = w.waitGuest(rs)
	w.waitListening(g.Name)
	value := hex.EncodeToString(randomBytes(t, 512<<10))
	w.writeData("value.txt", []byte(value))
	script := "redis-benchmark -h " + g.Addresses[0] + " -c 4 -n 20000 -t set,get -d 256 -q && " +
		"redis-cli -h " + g.Addresses[0] + " -x set big < /data/value.txt && " +
		"redis-cli -h " + g.Addresses[0] + " --raw get big > /data/value.out"
	out = w.podman(append(append([]string{"run", "--rm", "--label", "shunt-test=" + w.name, "--network", w.name, "-v", filepath.Join(w.dir, "data") + ":/data"}, dev...),
		w.image, "/bin/sh", "-c", script)...)
	if got := strings.TrimSuffix(string(w.readData("value.out")), "\n"); got != value {
		t.Fatalf("redis: read back %d bytes, not the %d set (or they differ)\n%s", len(got), len(value), out)
	}
	ring, tcp = ringBytes(out)
	t.Logf("redis clients: %d bytes on the rings, %d on TCP", ring, tcp)
	if ring == 0 || ring < tcp {
		t.Errorf("redis: %d bytes on the rings and %d on TCP: want most on the rings\n%s\n%s", ring, tcp, out, w.state())
	}
	if !strings.Contains(out, "GET:") || !strings.Contains(out, "SET:") {
		t.Errorf("redis-benchmark printed no results:\n%s", out)
	}
}

// firstDiff is the offset of the first byte where a and b differ.
func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// logsOf is container id's output so far ("" if it is gone).
func (w *world) logsOf(id string) string {
	ctx, cancel := context.WithTimeout(context.Background(), step)
	defer cancel()
	out, _ := w.podmanCmd(ctx, "logs", id).CombinedOutput()
	return string(out)
}

// waitGuest waits until container id is hostd's guest, and returns it.
func (w *world) waitGuest(id string) *admin.GuestSpec {
	w.t.Helper()
	var g *admin.GuestSpec
	w.waitFor(10*time.Second, "container "+id[:12]+" a guest", func() bool {
		g = w.guestOf(id)
		return g != nil
	})
	return g
}

// waitListening waits until guest name has a listener registered with
// hostd (its server is up and on Shunt).
func (w *world) waitListening(name string) {
	w.t.Helper()
	w.waitFor(20*time.Second, "guest "+name+" listening", func() bool {
		for _, gi := range w.allGuests() {
			if gi.Name == name && len(gi.Listening) > 0 {
				return true
			}
		}
		return false
	})
}

// TestPodmanRemoveMidStream: a container removed while it sends: the
// receiver drains what the rings held and then sees what the kernel
// reports (end of stream), with every byte it got in order; hostd frees the
// guest, its regions and its mark rule.
func TestPodmanRemoveMidStream(t *testing.T) {
	w := newWorld(t)
	dev := []string{"--device", w.device, "-e", "SHUNT_STATS=1"}
	chunk := randomBytes(t, 1<<20)
	w.writeData("chunk.bin", chunk)
	// fork: socat without it closes its listener at the accept, before
	// the connection's OPEN, and hostd then finds no listener for it.
	rcv := w.run("rcv", append([]string{"-e", "SHUNT_VERBOSE=1"}, dev...), "/usr/bin/socat", "-u", "TCP-LISTEN:5000,reuseaddr,fork", "CREATE:/data/recv.bin")
	rg := w.waitGuest(rcv)
	w.waitListening(rg.Name)
	snd := w.run("snd", dev, "/bin/sh", "-c", "while :; do cat /data/chunk.bin; done | /usr/bin/socat -u STDIN TCP:"+rg.Addresses[0]+":5000")
	w.waitGuest(snd)
	w.onFail = func() string { return "sender:\n" + w.logsOf(snd) + "\nreceiver:\n" + w.logsOf(rcv) }
	w.waitFor(20*time.Second, "the stream on the rings", func() bool {
		for _, f := range w.flows() {
			if f.Path == "rings" && f.RingsAB+f.RingsBA > 8<<20 {
				return true
			}
		}
		return false
	})
	w.podman("rm", "-f", "-t", "0", snd)
	// The receiver's child (socat forks per connection) ends by itself at
	// the kernel's end of stream: then only the listening parent is left.
	w.waitFor(30*time.Second, "the receiver's end of stream", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), step)
		defer cancel()
		out, err := w.podmanCmd(ctx, "top", rcv, "args").Output()
		return err == nil && strings.Count(string(out), "socat") == 1
	})
	logs := w.logsOf(rcv)
	got := w.readData("recv.bin")
	if len(got) < 8<<20 {
		t.Fatalf("receiver got %d bytes, want more than the 8 MiB hostd saw on the rings\n%s", len(got), logs)
	}
	for off := 0; off < len(got); off += len(chunk) {
		end := min(off+len(chunk), len(got))
		if !bytes.Equal(got[off:end], chunk[:end-off]) {
			t.Fatalf("receiver's bytes %d-%d are not the stream's: a gap or corruption\n%s", off, end, logs)
		}
	}
	t.Logf("receiver: %d bytes in order; its library said:\n%s", len(got), logs)
	if !strings.Contains(logs, "shunt (slot") || !strings.Contains(logs, "left the rings") {
		t.Errorf("the receiver's library did not take the rings and then leave them at the end of the stream:\n%s", logs)
	}
	if strings.Contains(logs, "E ") || strings.Contains(logs, "SIGBUS") {
		t.Errorf("the receiver reported an error:\n%s", logs)
	}
	w.waitFor(10*time.Second, "the sender's guest gone", func() bool { return w.guestOf(snd) == nil })
	w.podman("rm", "-f", "-t", "0", rcv)
	w.waitFor(10*time.Second, "the receiver's guest gone", func() bool { return w.guestOf(rcv) == nil })
	w.waitFor(10*time.Second, "regions and mark rules freed", func() bool { return len(w.regionFiles()) == 0 && w.markRules() == 0 && len(w.flows()) == 0 })
}
