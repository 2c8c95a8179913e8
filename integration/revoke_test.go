package integration

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// blockedReads starts a blocked Read on each conn and returns a channel that
// yields each one's error and how long after `since()` it came.
func blockedReads(conns ...*guestlib.Conn) chan error {
	errc := make(chan error, len(conns))
	for _, c := range conns {
		go func() {
			buf := make([]byte, 64<<10)
			for {
				if _, err := c.Read(buf); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	return errc
}

// expectResets waits for n ECONNRESETs and logs how long they took.
func expectResets(t *testing.T, errc chan error, n int, start time.Time) {
	t.Helper()
	for range n {
		select {
		case err := <-errc:
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("blocked read ended with %v, want ECONNRESET", err)
			}
			t.Logf("ECONNRESET after %s", time.Since(start))
		case <-time.After(5 * time.Second):
			t.Fatal("a blocked read did not see ECONNRESET within 5s of the revocation")
		}
	}
}

func TestConntrackDeleteRevokes(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5204)
	if !c.Path().Fast || !s.Path().Fast {
		t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
	}
	errc := blockedReads(c, s)
	start := time.Now()
	e.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "5204")
	expectResets(t, errc, 2, start)
	if _, err := c.Write([]byte("x")); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("write after revocation = %v, want ECONNRESET", err)
	}
	if got := e.counter("shunt_revocations_total{reason=conntrack-gone}"); got != 1 {
		t.Fatalf("conntrack-gone revocations = %v, want 1", got)
	}
	c.Close()
	s.Close()
	eventually(t, 5*time.Second, "ring pair reclaimed after both closed", func() bool { return len(e.flows()) == 0 })
}

// TestPolicyReloadRevokes: a reload that forbids a live flow revokes it,
// by the admin command and by SIGHUP (what systemctl reload sends); new
// connections on that port stay on TCP, others keep the fast path.
func TestPolicyReloadRevokes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		reload func(e *env)
	}{
		{"admin", func(e *env) {
			var rep map[string]int
			if err := admin.Call(e.Admin, admin.Request{Cmd: "reload"}, &rep); err != nil || rep["revoked"] != 1 {
				e.t.Fatalf("reload: %v, revoked %d flows, want 1", err, rep["revoked"])
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
			if !c.Path().Fast {
				t.Fatalf("path %s, want fast", c.Path())
			}
			errc := blockedReads(c, s)
			e.writeConfig(`rule "no-5205" {
  action = "tcp"
  ports  = ["5205"]
}`)
			start := time.Now()
			tc.reload(e)
			expectResets(t, errc, 2, start)
			if got := e.counter("shunt_revocations_total{reason=policy-reload}"); got != 1 {
				t.Fatalf("policy-reload revocations %v, want 1", got)
			}
			c2, s2 := e.pair(1, 2, 5205)
			if p := c2.Path(); p.Fast || p.Reason != "policy" || s2.Path().Reason != "policy" {
				t.Fatalf("new connection on the forbidden port: %s / %s, want tcp(policy) on both", p, s2.Path())
			}
			c3, _ := e.pair(1, 2, 5206)
			if !c3.Path().Fast {
				t.Fatalf("an unrelated port lost the fast path: %s", c3.Path())
			}
		})
	}
}

func TestReloadWithTypoKeepsPolicy(t *testing.T) {
	e := newEnv(t, 2, "")
	os.WriteFile(e.Config, []byte(strings.Replace(mustRead(t, e.Config), "pairing_timeout", "pairing_timout", 1)), 0o600)
	err := admin.Call(e.Admin, admin.Request{Cmd: "reload"}, nil)
	if err == nil || !strings.Contains(err.Error(), "hostd.hcl:") || !strings.Contains(err.Error(), "Unsupported argument") {
		t.Fatalf("reload of a config with a typo = %v; want an error naming the file and line", err)
	}
	c, _ := e.pair(1, 2, 5207)
	if !c.Path().Fast {
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
// reattach, and revocation works again.
func TestHostdRestart(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5208)
	if !c.Path().Fast {
		t.Fatalf("path %s, want fast", c.Path())
	}
	stop := make(chan struct{})
	werr := make(chan error, 1)
	go func() {
		buf := make([]byte, 256<<10)
		for {
			select {
			case <-stop:
				werr <- nil
				return
			default:
			}
			if _, err := c.Write(buf); err != nil {
				werr <- err
				return
			}
		}
	}()
	readMiB := func(n int) {
		t.Helper()
		if _, err := io.CopyN(io.Discard, s, int64(n)<<20); err != nil {
			t.Fatalf("read while hostd is %s: %v", map[bool]string{true: "up", false: "down"}[e.Hostd != nil], err)
		}
	}
	readMiB(16)
	e.killHostd()
	readMiB(256) // hostd is not on the data path
	e.startHostd()
	eventually(t, 10*time.Second, "both guests reattached to the restarted hostd", func() bool {
		fl := e.flows()
		return len(fl) == 1 && fl[0].Attached == "ab" && fl[0].State == "ready"
	})
	readMiB(16)
	close(stop)
	errc := blockedReads(s)
	start := time.Now()
	e.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "5208")
	expectResets(t, errc, 1, start)
	if err := <-werr; err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("writer: %v", err)
	}
}

// TestGuestKilled: a guest process dies mid-stream; its peer gets
// ECONNRESET and the ring pair is reclaimed.
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
	if !s.Path().Fast {
		t.Fatalf("path %s, want fast", s.Path())
	}
	if _, err := io.CopyN(io.Discard, s, 8<<20); err != nil {
		t.Fatal(err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	_, err = io.Copy(io.Discard, s)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read after the peer died = %v, want ECONNRESET", err)
	}
	if fl := e.flows(); len(fl) != 1 || fl[0].State != "revoked" || fl[0].Reason != "peer-gone" {
		t.Fatalf("flows after the peer died = %+v, want one revoked (peer-gone)", fl)
	}
	s.Close()
	eventually(t, 5*time.Second, "ring pair reclaimed", func() bool { return len(e.flows()) == 0 })
}
