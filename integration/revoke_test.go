package integration

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
)

// Every revocation is a downgrade now (docs/DESIGN.md, "Flow lifecycle:
// path switching"): hostd moves the connection to TCP and the application
// sees no error; whether the connection lives is the kernel's business.

// fastSoon reports whether every conn is on the fast path within 5 s (READY
// comes in the background: a connection starts on TCP).
func fastSoon(t testing.TB, conns ...*guestlib.Conn) bool {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		all := true
		for _, c := range conns {
			all = all && c.Path().Fast
		}
		if all {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// settled waits (5 s at most) until hostd answered for c: it is on the fast
// path, or on TCP for a reason hostd gave (not the library's own while it
// waits for hostd's answer), and returns its path.
func settled(t testing.TB, c *guestlib.Conn) guestlib.Path {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		p := c.Path()
		switch {
		case p.Fast, p.Reason != "" && p.Reason != "pending" && p.Reason != "no-hostd":
			return p
		case time.Now().After(deadline):
			return p
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// onTCP waits until no conn is on the fast path.
func onTCP(t *testing.T, what string, conns ...*guestlib.Conn) {
	t.Helper()
	eventually(t, 5*time.Second, what, func() bool {
		for _, c := range conns {
			if c.Path().Fast {
				return false
			}
		}
		return true
	})
}

// pat is byte off of stream seed: any reader can check any stretch.
func pat(seed, off uint64) byte { return byte(((off + seed) * 0x9E3779B97F4A7C15) >> 56) }

// stream writes a seeded byte stream from w to r and checks every byte at
// r, whatever path it takes, until finish.
type stream struct {
	t            *testing.T
	seed         uint64
	quit         chan struct{}
	wdone, rdone chan error
	sent, got    atomic.Int64
	w, r         *guestlib.Conn
}

// ends is both ends' counters, for a failure: which side stopped.
func (s *stream) ends() string {
	return fmt.Sprintf("sent %d, received %d\n  writer: %+v\n  reader: %+v", s.sent.Load(), s.got.Load(), s.w.Stats(), s.r.Stats())
}

func startStream(t *testing.T, w, r *guestlib.Conn, seed uint64) *stream {
	s := &stream{t: t, seed: seed, quit: make(chan struct{}), wdone: make(chan error, 1), rdone: make(chan error, 1), w: w, r: r}
	go func() {
		buf := make([]byte, 64<<10)
		var off uint64
		for i := 0; ; i++ {
			select {
			case <-s.quit:
				s.wdone <- nil
				return
			default:
			}
			n := 1 + (i*7919)%len(buf) // small and large writes
			for j := range n {
				buf[j] = pat(seed, off+uint64(j))
			}
			if _, err := w.Write(buf[:n]); err != nil {
				s.wdone <- fmt.Errorf("write at %d: %w", off, err)
				return
			}
			off += uint64(n)
			s.sent.Store(int64(off))
		}
	}()
	go func() {
		buf := make([]byte, 64<<10)
		var off uint64
		for {
			n, err := r.Read(buf)
			for j := range n {
				if buf[j] != pat(seed, off+uint64(j)) {
					s.rdone <- fmt.Errorf("byte %d is %#x, want %#x", off+uint64(j), buf[j], pat(seed, off+uint64(j)))
					return
				}
			}
			off += uint64(n)
			s.got.Store(int64(off))
			if err != nil {
				s.rdone <- fmt.Errorf("read at %d: %w", off, err)
				return
			}
		}
	}()
	return s
}

// progress waits until n more bytes arrived, intact.
func (s *stream) progress(n int64) {
	s.t.Helper()
	want := s.got.Load() + n
	deadline := time.Now().Add(20 * time.Second)
	for s.got.Load() < want {
		select {
		case err := <-s.rdone:
			s.t.Fatalf("stream %d: %v\n%s", s.seed, err, s.ends())
		case err := <-s.wdone:
			if err != nil {
				s.t.Fatalf("stream %d: %v\n%s", s.seed, err, s.ends())
			}
			s.wdone <- nil
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("stream %d: %d bytes in 20 s, want %d\n%s", s.seed, s.got.Load(), want, s.ends())
		}
	}
}

// finish stops the writer and waits until the reader checked every byte
// written.
func (s *stream) finish() {
	s.t.Helper()
	close(s.quit)
	if err := <-s.wdone; err != nil {
		s.t.Fatalf("stream %d: %v", s.seed, err)
	}
	want := s.sent.Load()
	eventually(s.t, 20*time.Second, fmt.Sprintf("stream %d: all %d bytes read", s.seed, want), func() bool {
		select {
		case err := <-s.rdone:
			s.t.Fatalf("stream %d: %v", s.seed, err)
		default:
		}
		return s.got.Load() >= want
	})
}

// both starts a stream each way between c and s.
func both(t *testing.T, c, s *guestlib.Conn, seed uint64) (*stream, *stream) {
	return startStream(t, c, s, seed), startStream(t, s, c, seed+1)
}

func progress(n int64, ss ...*stream) {
	for _, s := range ss {
		s.progress(n)
	}
}

// connOn is hostd's record of the connection to port.
func (e *env) connOn(port int) (fi struct {
	Path, Reason string
	Switches     int
	Attached     string
}, ok bool) {
	e.t.Helper()
	f, ok, err := e.ConnOn(port)
	if err != nil {
		e.t.Fatal(err)
	}
	fi.Path, fi.Reason, fi.Switches, fi.Attached = f.Path, f.Reason, f.Switches, f.Attached
	return fi, ok
}

// TestConntrackDeleteDowngrades: deleting a live connection's conntrack
// entry moves it to TCP (conntrack-gone); the streams both ways go on
// without an error, and the ring pair is freed.
func TestConntrackDeleteDowngrades(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5204)
	if !fastSoon(t, c, s) {
		t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
	}
	ab, ba := both(t, c, s, 10)
	progress(4<<20, ab, ba)
	e.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "5204")
	onTCP(t, "both ends on TCP after the conntrack entry went", c, s)
	progress(4<<20, ab, ba)
	eventually(t, 5*time.Second, "the record on TCP (conntrack-gone), rings freed", func() bool {
		r, ok := e.connOn(5204)
		return ok && r.Path == "tcp" && r.Reason == "conntrack-gone"
	})
	if got := e.counter("shunt_switches_total{reason=conntrack-gone,to=tcp}"); got != 1 {
		t.Fatalf("switches to tcp (conntrack-gone) = %v, want 1", got)
	}
	ab.finish()
	ba.finish()
	c.Close()
	s.Close()
	eventually(t, 5*time.Second, "record gone after both closed", func() bool { _, ok := e.connOn(5204); return !ok })
}

// TestPolicyFlipKeepsStreams: a reload that forbids a live connection
// moves it to TCP, by the admin command and by SIGHUP (what systemctl
// reload sends); the streams go on; new connections on that port stay on
// TCP, others keep the fast path; a reload that allows it again moves it
// back to the rings.
func TestPolicyFlipKeepsStreams(t *testing.T) {
	for _, tc := range []struct {
		name   string
		reload func(e *env)
	}{
		{"admin", func(e *env) {
			var rep map[string]int
			if err := admin.Call(e.Admin, admin.Request{Cmd: "reload"}, &rep); err != nil || rep["downgraded"] != 1 {
				e.t.Fatalf("reload: %v, downgraded %d connections, want 1", err, rep["downgraded"])
			}
		}},
		{"SIGHUP", func(e *env) {
			if err := e.Hostd.Process.Signal(syscall.SIGHUP); err != nil {
				e.t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 2, "")
			c, s := e.pair(1, 2, 5205)
			if !fastSoon(t, c, s) {
				t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
			}
			ab, ba := both(t, c, s, 20)
			progress(2<<20, ab, ba)
			e.writeConfig(`rule "no-5205" {
  action = "tcp"
  ports  = ["5205"]
}`)
			tc.reload(e)
			onTCP(t, "both ends on TCP after the reload", c, s)
			progress(2<<20, ab, ba)
			if got := e.counter("shunt_switches_total{reason=policy-reload,to=tcp}"); got != 1 {
				t.Fatalf("switches to tcp (policy-reload) %v, want 1", got)
			}
			c2, s2 := e.pair(1, 2, 5205)
			time.Sleep(100 * time.Millisecond) // time for a READY that must not come
			if p := c2.Path(); p.Fast || s2.Path().Fast {
				t.Fatalf("new connection on the forbidden port: %s / %s, want tcp on both", p, s2.Path())
			}
			c3, s3 := e.pair(1, 2, 5206)
			if !fastSoon(t, c3, s3) {
				t.Fatalf("an unrelated port lost the fast path: %s", c3.Path())
			}
			if _, err := e.SetPolicy(""); err != nil {
				t.Fatal(err)
			}
			if !fastSoon(t, c, s, c2, s2) {
				t.Fatalf("after the reload back: %s / %s, %s / %s; want all fast", c.Path(), s.Path(), c2.Path(), s2.Path())
			}
			progress(2<<20, ab, ba)
			ab.finish()
			ba.finish()
		})
	}
}

// TestPolicyFlipLoop: hostd flips the policy every few milliseconds under
// seeded streams both ways; every byte arrives, in order, and the
// connection ends on the rings once the flipping stops.
func TestPolicyFlipLoop(t *testing.T) {
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5211)
	if !fastSoon(t, c, s) {
		t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
	}
	ab, ba := both(t, c, s, 30)
	for i := range 40 {
		policy := ""
		if i%2 == 0 {
			policy = stack.PolicyTCP
		}
		if _, err := e.SetPolicy(policy); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(2+i%7) * time.Millisecond)
	}
	if _, err := e.SetPolicy(""); err != nil {
		t.Fatal(err)
	}
	progress(4<<20, ab, ba)
	if !fastSoon(t, c, s) {
		t.Fatalf("after the flips: %s / %s, want fast", c.Path(), s.Path())
	}
	ab.finish()
	ba.finish()
	r, _ := e.connOn(5211)
	t.Logf("record after the flips: %+v", r)
}

func TestReloadWithTypoKeepsPolicy(t *testing.T) {
	e := newEnv(t, 2, "")
	os.WriteFile(e.Config, []byte(strings.Replace(mustRead(t, e.Config), "pairing_timeout", "pairing_timout", 1)), 0o600)
	err := admin.Call(e.Admin, admin.Request{Cmd: "reload"}, nil)
	if err == nil || !strings.Contains(err.Error(), "hostd.hcl:") || !strings.Contains(err.Error(), "Unsupported argument") {
		t.Fatalf("reload of a config with a typo = %v; want an error naming the file and line", err)
	}
	c, _ := e.pair(1, 2, 5207)
	if !fastSoon(t, c) {
		t.Fatalf("after a failed reload the old policy should hold; path %s", c.Path())
	}
}

func mustRead(t *testing.T, path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestHostdRestart: hostd is killed mid-stream; data keeps flowing without
// it; the restarted hostd adopts the flow from the region, both guests
// reattach, and a downgrade works again (conntrack-gone) without an error.
func TestHostdRestart(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5208)
	if !fastSoon(t, c, s) {
		t.Fatalf("path %s, want fast", c.Path())
	}
	ab := startStream(t, c, s, 40)
	ab.progress(16 << 20)
	e.killHostd()
	ab.progress(64 << 20) // hostd is not on the data path
	e.startHostd()
	eventually(t, 10*time.Second, "both guests reattached to the restarted hostd", func() bool {
		fl := e.flows()
		return len(fl) == 1 && fl[0].Attached == "ab" && fl[0].Path == "rings"
	})
	ab.progress(16 << 20)
	e.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "5208")
	onTCP(t, "both ends on TCP after the conntrack entry went", c, s)
	ab.progress(4 << 20)
	ab.finish()
}

// TestHostdStopDowngrades: a hostd stopped gracefully (SIGTERM) moves every
// connection to TCP first (DOWN(shutdown)); the streams go on; the next
// hostd pairs the connections again (the libraries re-announce them) and
// they return to the rings.
func TestHostdStopDowngrades(t *testing.T) {
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5212)
	if !fastSoon(t, c, s) {
		t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
	}
	ab, ba := both(t, c, s, 50)
	progress(4<<20, ab, ba)
	start := time.Now()
	e.StopHostd()
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("hostd took %s to stop, want about its 2 s bound at most", d)
	}
	if c.Path().Fast || s.Path().Fast {
		t.Errorf("after hostd stopped: %s / %s, want both on TCP", c.Path(), s.Path())
	}
	progress(4<<20, ab, ba)
	e.startHostd()
	if !fastSoon(t, c, s) {
		t.Fatalf("after hostd came back: %s / %s, want fast again", c.Path(), s.Path())
	}
	progress(4<<20, ab, ba)
	ab.finish()
	ba.finish()
}

// TestGuestKilled: a guest process dies mid-stream; its peer reads what
// the ring held and then what the kernel reports (the dead process's
// socket had no unread data: FIN, so EOF); hostd moves the connection to
// TCP (peer-gone) and frees the ring pair once the survivor left it.
func TestGuestKilled(t *testing.T) {
	e := newEnv(t, 2, "")
	l := e.listen(2, 5209)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "SHUNT_E2E_CHILD=writer", "SHUNT_CONTROL="+e.control(e.rig.Guests[0]),
		fmt.Sprintf("SHUNT_E2E_ADDR=%s:5209", e.rig.Guests[1].Addr))
	cmd.Stderr = os.Stderr
	if err := nsrig.Start(e.rig.Guests[0].NSPath(), cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	s, err := l.AcceptShunt()
	if err != nil {
		t.Fatal(err)
	}
	if !fastSoon(t, s) {
		t.Fatalf("path %s, want fast", s.Path())
	}
	if _, err := io.CopyN(io.Discard, s, 8<<20); err != nil {
		t.Fatal(err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	if _, err = io.Copy(io.Discard, s); err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read after the peer died = %v, want EOF (or the kernel's ECONNRESET)", err)
	}
	eventually(t, 5*time.Second, "record on TCP (peer-gone), rings freed", func() bool {
		r, ok := e.connOn(5209)
		return ok && r.Path == "tcp" && r.Reason == "peer-gone"
	})
	s.Close()
	eventually(t, 5*time.Second, "record gone", func() bool { _, ok := e.connOn(5209); return !ok })
}
