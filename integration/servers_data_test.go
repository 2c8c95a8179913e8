package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// memcached as packaged (issue 21).

// memcClient is a memcached client for the memcached test: in each of its
// threads one connection that stores keys with seeded random values of up
// to 50 KB (8 x 100 of them fit memcached's 64 MB), reads them all back and checks them, and prints "OK n" with
// the count (or fails).
const memcClient = `
import socket, sys, random, threading
host, port, threads, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
errs = []
def readline(f):
    l = f.readline()
    if not l: raise Exception("EOF")
    return l
def run(t):
    try:
        s = socket.create_connection((host, port), timeout=30)
        f = s.makefile("rb")
        rnd = random.Random(t)
        vals = {}
        for k in range(keys):
            v = rnd.randbytes(rnd.randrange(1, 50000))
            key = "t%d-%d" % (t, k)
            s.sendall(b"set %s 0 0 %d\r\n" % (key.encode(), len(v)) + v + b"\r\n")
            if readline(f) != b"STORED\r\n": raise Exception("set " + key)
            vals[key] = v
        for key, v in vals.items():
            s.sendall(b"get %s\r\n" % key.encode())
            h = readline(f).split()
            if h[0] != b"VALUE" or int(h[3]) != len(v): raise Exception("get %s: %r" % (key, h))
            got = f.read(len(v) + 2)
            if got[:-2] != v or readline(f) != b"END\r\n": raise Exception("get %s: wrong value" % key)
        s.close()
    except Exception as e:
        errs.append("thread %d: %s" % (t, e))
ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
if errs:
    print("\n".join(errs)); sys.exit(1)
print("OK", threads * keys)
`

// TestServerMemcached: memcached with Debian's settings (-m 64 -p 11211
// -u memcache), listening on guest 2's address: it drops root for user
// memcache and must serve 8 concurrent connections on the rings, each
// value read back intact, and then memslap's load, with no crash.
func TestServerMemcached(t *testing.T) {
	s := newSrvEnv(t, "memcached", "memcslap")
	g2 := s.rig.Guests[1].Addr.String()
	srv := s.start(2, s.command(2, true, nil, "memcached", "-m", "64", "-p", "11211", "-u", "memcache", "-l", g2))
	s.waitListening(2, 11211)
	dir := servedDir(t)
	script := filepath.Join(dir, "memc.py")
	if err := os.WriteFile(script, []byte(memcClient), 0o644); err != nil {
		t.Fatal(err)
	}
	out := s.run(1, 60*time.Second, s.command(1, true, []string{"SHUNT_STATS=1"}, "/usr/bin/python3", script, g2, "11211", "8", "100"))
	if !strings.Contains(out, "OK 800") {
		s.fatalf("memcached client: want OK 800 (8 connections, 100 values each, read back):\n%s", tailLines(out, 30))
	}
	if ring, _ := ringBytes(out); fastLines(out) < 8 || ring == 0 {
		s.fatalf("the 8 connections to memcached (as user memcache) did not all take the rings: %s", pathSummary(out))
	}
	load := s.run(1, 60*time.Second, s.command(1, true, nil, "memcslap", "--servers="+g2+":11211", "--concurrency=8", "--execute-number=5000", "--test=set"))
	load += s.run(1, 60*time.Second, s.command(1, true, nil, "memcslap", "--servers="+g2+":11211", "--concurrency=8", "--execute-number=5000", "--test=get"))
	if srv.exited() {
		s.fatalf("memcached exited: %v", srv.err)
	}
	sout := srv.out.String()
	s.noRefusal("memcached", sout)
	if fastLines(sout) < 8 {
		s.fatalf("memcached (user memcache) took the rings for %d connections, want 8 at least: %s", fastLines(sout), pathSummary(sout))
	}
	t.Logf("memcached -u memcache: 8 x 100 values checked; client: %s; memslap: %s; memcached: %s", pathSummary(out), pathSummary(load), pathSummary(sout))
}
