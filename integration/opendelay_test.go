package integration

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// shortConns is a client and server of short connections: the server
// (serve) echoes what each connection sends; the client (N connections,
// one after another) connects, sends 8 bytes, reads them back, keeps the
// connection LIFE ms, and closes it; then one long connection lives 400 ms
// (after its 8 bytes) before it closes, and N more short ones follow.
const shortConns = `
import socket, sys, time, threading
if sys.argv[1] == "serve":
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind((sys.argv[2], int(sys.argv[3]))); l.listen(64)
    def echo(c):
        while True:
            b = c.recv(4096)
            if not b: break
            c.sendall(b)
        c.close()
    while True:
        c, _ = l.accept()
        threading.Thread(target=echo, args=(c,), daemon=True).start()
host, port, n, life = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]) / 1000
def conn(keep):
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"12345678")
    got = b""
    while len(got) < 8: got += s.recv(8 - len(got))
    if got != b"12345678": raise Exception("echo: %r" % got)
    time.sleep(keep)
    s.close()
for i in range(n): conn(life)
conn(0.4)
for i in range(n): conn(life)
print("OK")
`

var openLine = regexp.MustCompile(`(?m)^shunt: fd \d+ connect .*: open \(request`)

// TestPreloadOpenDelayAdapts: connections that outlive the open delay by
// a little (30 ms, on a loaded machine the tail of a short-connection
// load) are offered to hostd at first; each that ends soon after its OPEN
// doubles the client's open delay, so that after a few of them the rest
// are not offered at all; a long-lived connection is still offered, and
// brings the delay back down. Before the delay adapted, every one of the
// 2 x 40 short connections was offered (80 OPENs).
func TestPreloadOpenDelayAdapts(t *testing.T) {
	s := newSrvEnv(t, "python3")
	dir := servedDir(t)
	script := filepath.Join(dir, "short.py")
	if err := os.WriteFile(script, []byte(shortConns), 0o644); err != nil {
		t.Fatal(err)
	}
	g2 := s.rig.Guests[1].Addr.String()
	s.start(2, s.command(2, true, nil, "/usr/bin/python3", script, "serve", g2, "7300"))
	s.waitListening(2, 7300)
	out := s.run(1, 60*time.Second, s.command(1, true, nil, "/usr/bin/python3", script, "client", g2, "7300", "40", "30"))
	if !strings.Contains(out, "OK") {
		s.fatalf("client:\n%s", tailLines(out, 30))
	}
	opens := len(openLine.FindAllString(out, -1))
	if opens > 20 {
		s.fatalf("%d of 81 connections were offered to hostd, want few (the delay should have grown past their 30 ms): %s\n%s", opens, pathSummary(out), tailLines(out, 40))
	}
	if !regexp.MustCompile(`open delay now \d+ ms`).MatchString(out) {
		s.fatalf("the client never said its open delay changed:\n%s", tailLines(out, 40))
	}
	if fastLines(out) < 1 {
		s.fatalf("the long connection did not take the rings: %s\n%s", pathSummary(out), tailLines(out, 40))
	}
	t.Logf("81 connections (80 of 30 ms, one of 400 ms): %d offered to hostd; %s", opens, pathSummary(out))
}
