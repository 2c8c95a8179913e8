package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
)

// An accept-then-fork server (socat fork), and short connections against
// redis (redis-benchmark -k 0: a connection per request), under shunt-run.

// TestServerSocatFork: socat accepts in its parent and forks a child per
// connection, which runs cat and relays between it and the connection:
// the connection is served by a process that did not accept it, on the
// fast path. Several clients at once each send their own 4 MiB and must
// read them back.
func TestServerSocatFork(t *testing.T) {
	s := newSrvEnv(t, "socat")
	dir := t.TempDir()
	g2 := s.rig.Guests[1].Addr.String()
	const port, clients = 7000, 6
	srv := s.start(2, s.command(2, true, []string{"SHUNT_STATS=1"}, "socat", fmt.Sprintf("TCP-LISTEN:%d,bind=%s,fork,reuseaddr", port, g2), "EXEC:cat"))
	s.waitListening(2, port)
	type client struct {
		p        *guestProc
		sum, got string
	}
	var cs []client
	watch := s.watchRings()
	for k := range clients {
		src, got := filepath.Join(dir, fmt.Sprintf("c%d.in", k)), filepath.Join(dir, fmt.Sprintf("c%d.out", k))
		sum := writeRandom(t, src, 4<<20, uint64(10+k))
		in, err := os.Open(src)
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		out, err := os.Create(got)
		if err != nil {
			t.Fatal(err)
		}
		defer out.Close()
		// -t 30: after its stdin's EOF, socat waits up to 30 s for the
		// echo's EOF instead of its default 0.5 s.
		cmd := s.command(1, true, []string{"SHUNT_STATS=1"}, "socat", "-t", "30", "-", fmt.Sprintf("TCP:%s:%d", g2, port))
		cmd.Stdin, cmd.Stdout = in, out
		cs = append(cs, client{s.start(1, cmd), sum, got})
	}
	deadline := time.After(60 * time.Second)
	for k, c := range cs {
		select {
		case <-c.p.done:
		case <-deadline:
			s.fatalf("client %d did not finish within 60 s", k)
		}
		if c.p.err != nil {
			s.fatalf("client %d: %v", k, c.p.err)
		}
		if sum, n := fileSHA256(t, c.got); sum != c.sum {
			s.fatalf("client %d read back %d bytes with SHA-256 %s, want its 4 MiB with %s", k, n, sum, c.sum)
		}
	}
	seen := watch()
	var clientOut strings.Builder // the clients' -v lines
	for _, c := range cs {
		clientOut.WriteString(c.p.out.String())
	}
	// socat exits with its connection open, so its library prints no
	// stats line: the paths are the -v lines' and hostd's.
	// Each connection is young at socat's fork: parent and child hold it
	// (docs/preload.md, Rules: fork), the parent closes its copy, and the
	// child, alone with it and serving it, OPENs it; its own child (cat)
	// gets no copy, so it does not count. Each child must take its
	// connection; the rings must carry bytes. (A child that ends its
	// connection before hostd's READY reaches it never says "shunt
	// (slot": so the -v lines are not counted one for one.)
	cf, sf := fastLines(clientOut.String()), fastLines(srv.out.String())
	taken := strings.Count(srv.out.String(), "the only process holding the connection since a fork: this one")
	if taken != clients || cf == 0 || sf == 0 || seen.ringBytes == 0 {
		s.fatalf("socat's forked children took %d connections (want %d); the clients took the rings %d times, the children %d times, hostd saw %s on rings:\nsocat:\n%s\nclients:\n%s",
			taken, clients, cf, sf, mib(seen.ringBytes), srv.out.String(), clientOut.String())
	}
	t.Logf("%d clients, 4 MiB each way each, checked; hostd saw %d flows on rings, %s written to one; clients: %s; socat (server): %s",
		clients, seen.onRings, mib(seen.ringBytes), pathSummary(clientOut.String()), pathSummary(srv.out.String()))
}

// TestServerRedisShortConns: redis-benchmark -k 0 opens a connection per
// request; 20 clients, 5000 requests of each of SET and INCR, both ends
// under shunt-run. Every request must succeed within the deadline, and
// what they wrote must be read back. (Two tests, 10,000 connections: from
// about 14,000 in a minute on, plain TCP too slows to a few hundred a
// second here, as connect() runs out of the even local ports that have
// no connection in TIME_WAIT.)
func TestServerRedisShortConns(t *testing.T) {
	s := newSrvEnv(t, "redis-server", "redis-benchmark", "redis-cli")
	g2 := s.rig.Guests[1].Addr.String()
	const port = "6392"
	srv := s.start(2, s.command(2, true, nil, "redis-server", "--bind", g2, "--port", port, "--save", "", "--appendonly", "no", "--protected-mode", "no"))
	s.waitListening(2, 6392)
	start := time.Now()
	out := s.run(1, 60*time.Second, s.command(1, true, nil, "redis-benchmark", "-h", g2, "-p", port, "-k", "0", "-n", "5000", "-c", "20", "-t", "set,incr", "-q"))
	took := time.Since(start)
	var rates []string
	for _, op := range []string{"SET", "INCR"} {
		m := regexp.MustCompile(op + `: ([0-9.]+) requests per second`).FindStringSubmatch(out)
		if m == nil {
			s.fatalf("redis-benchmark -k 0 did not finish %s", op)
		}
		rates = append(rates, op+" "+m[1]+"/s")
	}
	if m := regexp.MustCompile(`(?i).*\berr(or)?\b.*`).FindString(out); m != "" {
		s.fatalf("redis-benchmark -k 0: %s", m)
	}
	// Each request counted once: the INCR test's 5000 requests, each on
	// its own connection, leave counter:__rand_int__ at 5000, and the SET
	// test leaves a 3-byte value (-d 3).
	for _, c := range []struct{ cmd, want string }{{"get counter:__rand_int__", "5000"}, {"strlen key:__rand_int__", "3"}} {
		got := s.run(1, 30*time.Second, s.command(1, false, nil, "redis-cli", append([]string{"-h", g2, "-p", port}, strings.Fields(c.cmd)...)...))
		if strings.TrimSpace(got) != c.want {
			s.fatalf("redis-cli %s after the benchmark: %q, want %s", c.cmd, got, c.want)
		}
	}
	t.Logf("redis-benchmark -k 0: 2 x 5000 connections in %s (%s), counter checked; client: %s; redis-server: %s",
		took.Round(time.Millisecond), strings.Join(rates, ", "), pathSummary(out), pathSummary(srv.out.String()))
}

// TestServerRedisTupleReuse: connections that reuse their tuples while
// the old conntrack entries live on. The client's namespace reuses ports
// at once from a range of 300 (tcp_tw_reuse=1, and no TIME_WAIT sockets
// at all, tcp_max_tw_buckets=0, so that nothing has to wait the second
// tw_reuse asks), so 2,000 connections through it must reuse tuples: the
// router's conntrack still holds each old entry (TIME_WAIT), kills it at
// the new SYN (its DESTROY comes) and makes a new one while the new
// connection on the same tuple is being made. With the open delay off every connection reaches hostd,
// which must never take an old entry's DESTROY for the new connection's:
// no connection is moved to TCP for conntrack-gone, and every request
// succeeds.
func TestServerRedisTupleReuse(t *testing.T) {
	s := newSrvEnv(t, "redis-server", "redis-benchmark", "redis-cli")
	for _, kv := range []string{"net.ipv4.tcp_tw_reuse=1", "net.ipv4.tcp_max_tw_buckets=0", "net.ipv4.ip_local_port_range=41000 41299"} {
		if out, err := nsrig.Run(s.rig.Guests[0].NSPath(), "sysctl", "-w", kv); err != nil {
			t.Fatalf("sysctl -w %s in the client's namespace: %v\n%s", kv, err, out)
		}
	}
	g2 := s.rig.Guests[1].Addr.String()
	const port, conns = "6393", 2000
	now := []string{"SHUNT_OPEN_DELAY_MS=0"}
	srv := s.start(2, s.command(2, true, now, "redis-server", "--bind", g2, "--port", port, "--save", "", "--appendonly", "no", "--protected-mode", "no"))
	s.waitListening(2, 6393)
	start := time.Now()
	out := s.run(1, 90*time.Second, s.command(1, true, now, "redis-benchmark", "-h", g2, "-p", port, "-k", "0", "-n", fmt.Sprint(conns), "-c", "20", "-t", "incr", "-q"))
	took := time.Since(start)
	if !regexp.MustCompile(`INCR: [0-9.]+ requests per second`).MatchString(out) {
		s.fatalf("redis-benchmark -k 0 did not finish INCR:\n%s", out)
	}
	if got := strings.TrimSpace(s.run(1, 30*time.Second, s.command(1, false, nil, "redis-cli", "-h", g2, "-p", port, "get", "counter:__rand_int__"))); got != fmt.Sprint(conns) {
		s.fatalf("counter after %d INCRs, each on its own connection: %q", conns, got)
	}
	if n := s.counter("shunt_switches_total{reason=conntrack-gone,to=tcp}"); n != 0 {
		s.fatalf("%v connections were moved to TCP for conntrack-gone: an old entry's DESTROY reached a new connection on its tuple", n)
	}
	opens := s.counter("shunt_opens_total{role=active}")
	t.Logf("%d connections through 300 client ports in %s, counter checked, none moved for conntrack-gone; hostd heard %v active OPENs; client: %s; redis-server: %s",
		conns, took.Round(time.Millisecond), opens, pathSummary(out), pathSummary(srv.out.String()))
}
