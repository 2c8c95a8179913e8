package integration

import (
	"bytes"
	"io"
	"regexp"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
)

// Slow readers across a revocation. A firewall change moves every
// connection to TCP, and hostd then takes the rings' memory away from
// both guests (a retired pair region is truncated once its grace ends):
// a reader that has not read what its peer wrote must lose nothing. Its
// library copies what the ring still holds, once the writer left it, into
// its own memory and leaves at once (docs/SECURITY.md).

// TestRevokeSlowReaderKeepsBytes: the Go library.
func TestRevokeSlowReaderKeepsBytes(t *testing.T) {
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5271)
	if !fastSoon(t, c, s) {
		t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
	}
	msg := make([]byte, 16<<10)
	for i := range msg {
		msg[i] = pat(5271, uint64(i))
	}
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	// A ruleset change that drops nothing of this connection.
	e.hostCmd("nft", "add table inet shunt_test_unrelated")
	t.Cleanup(func() { nsrig.Run(e.rig.HostNSPath(), "nft", "delete table inet shunt_test_unrelated") })
	time.Sleep(6 * time.Second) // revoke_grace (3 s) + the truncation's delay (1 s), and slack
	got := make([]byte, len(msg))
	_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.ReadFull(s, got); err != nil {
		t.Fatalf("the slow reader, after a firewall change: read %d of %d bytes: %v (paths %s / %s)\nflows: %+v", n, len(msg), err, c.Path(), s.Path(), e.flows())
	}
	if !bytes.Equal(got, msg) {
		t.Fatal("the bytes written before the change arrived changed")
	}
}

// slowPy is a Python server (under the preload library) that accepts one
// connection, sleeps, then reads everything and prints its length and a
// checksum; slowClient writes 64 KiB of a pattern once the connection
// had time to reach the rings, and closes after a while.
const (
	slowServerPy = `import socket,sys,time,zlib
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); s.bind((sys.argv[1],int(sys.argv[2]))); s.listen(1)
c,_=s.accept(); time.sleep(float(sys.argv[3])); b=b''
while True:
    d=c.recv(65536)
    if not d: break
    b+=d
print(len(b), zlib.crc32(b), flush=True)`
	slowClientPy = `import socket,sys,time
c=socket.create_connection((sys.argv[1],int(sys.argv[2]))); time.sleep(1.5)
b=bytes((i*7+3)%251 for i in range(65536)); c.sendall(b); time.sleep(float(sys.argv[3])); c.close()`
)

// TestPreloadRevokeSlowReader: the same under the preload library (C),
// both ends Python programs: the reader sleeps through a firewall change
// and hostd's revoke grace, then reads all 64 KiB intact.
func TestPreloadRevokeSlowReader(t *testing.T) {
	e := newEnv(t, 2, "")
	g2 := e.rig.Guests[1].Addr.String()
	srv := e.start(2, e.toolCmd(t, true, 2, "python3", "-c", slowServerPy, g2, "5272", "8"))
	e.waitListening(2, 5272)
	cli := e.start(1, e.toolCmd(t, true, 1, "python3", "-c", slowClientPy, g2, "5272", "10"))
	eventually(t, 10*time.Second, "the connection on the rings", func() bool {
		r, ok := e.connOn(5272)
		return ok && r.Path == "rings"
	})
	time.Sleep(2500 * time.Millisecond) // the client's 64 KiB into the ring, at 1.5 s
	e.hostCmd("nft", "add table inet shunt_test_unrelated")
	t.Cleanup(func() { nsrig.Run(e.rig.HostNSPath(), "nft", "delete table inet shunt_test_unrelated") })
	// zlib.crc32 of the client's 64 KiB pattern.
	const want = "65536 3846310720"
	line := regexp.MustCompile(`(?m)^\d+ \d+$`)
	eventually(t, 20*time.Second, "the slow reader's line", func() bool { return line.MatchString(srv.String()) })
	if got := line.FindString(srv.String()); got != want {
		t.Fatalf("the slow reader got %q, want %q\nserver:\n%s\nclient:\n%s\nflows: %+v", got, want, srv.String(), cli.String(), e.flows())
	}
}
