package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"github.com/shuntnet/shunt/internal/edgegen"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// Path switching under the preload library (issue 11): streams across
// switches between C ends, and between a C end and a Go end.

// buildEdgeSwitch builds the edge suite, switch tests included
// (edge_switch.c), through the Makefile's shunt-edge target.
func buildEdgeSwitch(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	edge := filepath.Join(dir, "shunt-edge")
	if err := makeC(dir, edge); err != nil {
		testenv.Missing(t, "cannot build the edge suite: "+err.Error(), "apt-get install make gcc libc6-dev")
	}
	return edge
}

var switchStats = regexp.MustCompile(`stats: read (\d+) tcp \+ (\d+) ring = (\d+), wrote (\d+) tcp \+ (\d+) ring = (\d+)`)

// TestPreloadSwitch: seeded random streams both ways between C ends under
// the library (blocking, and non-blocking with epoll level and edge, and
// poll), and between a Go end (guestlib) and a C end, while hostd's
// policy for their port flips between fastpath and tcp every few
// milliseconds (a reload each time): every switch lands somewhere in a
// call, and each stream ends with a half-close while the flips go on.
// Every byte is checked, and the bytes the library counted per path add
// up. hostd's flows and log are shown on failure.
func TestPreloadSwitch(t *testing.T) {
	rule := func(action string) string {
		return `rule "switch" {
  action = "` + action + `"
  ports  = ["7702"]
}`
	}
	e := newEnv(t, 2, rule("fastpath"))
	needPreload(t)
	edge := buildEdgeSwitch(t)
	g2 := e.rig.Guests[1].Addr.String()
	env := func(cmd *exec.Cmd, i int) *exec.Cmd {
		cmd.Env = append(os.Environ(), "SHUNT_CONTROL="+e.control(e.rig.Guests[i-1]), "SHUNT_PRELOAD="+preloadLib, "SHUNT_STATS=1")
		return cmd
	}
	srvOut := e.start(2, env(exec.Command(shuntRun, "-v", edge, "server", g2, "7702"), 2))
	e.waitListening(2, 7702)

	stop, done := make(chan struct{}), make(chan struct{})
	flips := 0
	var hold atomic.Bool // the flips pause with the policy at fastpath
	go func() {
		defer close(done)
		fast := true
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(3+flips%7) * time.Millisecond):
			}
			if hold.Load() && fast {
				continue
			}
			fast = !fast
			action := "tcp"
			if fast {
				action = "fastpath"
			}
			if err := e.WriteConfig(rule(action)); err != nil {
				t.Errorf("write config: %v", err)
				return
			}
			var rep map[string]int
			if err := admin.Call(e.Admin, admin.Request{Cmd: "reload"}, &rep); err != nil {
				t.Errorf("reload: %v", err)
				return
			}
			flips++
		}
	}()
	defer func() { close(stop); <-done }()
	failf := func(t *testing.T, format string, args ...any) {
		t.Helper()
		fl, _ := json.Marshal(e.flows())
		t.Fatalf(format+"\nserver:\n%s\nhostd flows: %s", append(args, srvOut.String(), fl)...)
	}

	const size = 32 << 20
	for i, test := range []string{"stream", "streamnb", "streamet", "streampoll"} {
		t.Run(test, func(t *testing.T) {
			cmd := env(exec.Command(shuntRun, "-v", edge, "client", g2, "7702", test), 1)
			cmd.Env = append(cmd.Env, fmt.Sprintf("SHUNT_EDGE_SEED=%d", 7+i), fmt.Sprintf("SHUNT_EDGE_BYTES=%d", size))
			out := e.runT(t, 1, cmd)
			if !strings.Contains(out, "PASS "+test) {
				failf(t, "client:\n%s", out)
			}
			eventually(t, 10*time.Second, "the server's verdict", func() bool {
				return strings.Contains(srvOut.String(), test+"-server")
			})
			if !strings.Contains(srvOut.String(), "PASS "+test+"-server") {
				failf(t, "client:\n%s", out)
			}
			var rd, wr [2]uint64
			for _, m := range switchStats.FindAllStringSubmatch(out, -1) {
				var v [6]uint64
				for j := range v {
					v[j], _ = strconv.ParseUint(m[j+1], 10, 64)
				}
				if v[0]+v[1] != v[2] || v[3]+v[4] != v[5] {
					failf(t, "per-path counts do not add up: %s\nclient:\n%s", m[0], out)
				}
				rd[0], rd[1], wr[0], wr[1] = rd[0]+v[0], rd[1]+v[1], wr[0]+v[3], wr[1]+v[4]
			}
			if rd[0]+rd[1] != size {
				failf(t, "the client counted %d+%d bytes read, want %d\nclient:\n%s", rd[0], rd[1], size, out)
			}
			t.Logf("%s: read %d tcp + %d ring, wrote %d tcp + %d ring; %d flips so far", test, rd[0], rd[1], wr[0], wr[1], flips)
		})
	}
	t.Run("nbconnect", func(t *testing.T) {
		out := e.runT(t, 1, env(exec.Command(shuntRun, "-v", edge, "client", g2, "7702", "nbconnect"), 1))
		if !strings.Contains(out, "PASS nbconnect") {
			failf(t, "client:\n%s", out)
		}
	})
	// A peer killed mid-stream: hostd's DOWN(peer-gone) lets the reader
	// drain the ring and go back to the kernel socket, which reports the
	// end (EOF or ECONNRESET; or the writer's EPIPE first): every byte
	// read is in order, and nothing hangs.
	killed := func(t *testing.T) {
		before := strings.Count(srvOut.String(), " stream-server")
		cmd := env(exec.Command(shuntRun, "-v", edge, "client", g2, "7702", "stream"), 1)
		cmd.Env = append(cmd.Env, "SHUNT_EDGE_SEED=77", fmt.Sprintf("SHUNT_EDGE_BYTES=%d", 1<<40))
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := nsrig.Start(e.rig.Guests[0].NSPath(), cmd); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond)
		cmd.Process.Kill()
		cmd.Wait()
		for end := time.Now().Add(15 * time.Second); strings.Count(srvOut.String(), " stream-server") == before; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(end) {
				failf(t, "no verdict from the server 15 s after its peer was killed")
			}
		}
		v := srvOut.String()
		v = v[strings.LastIndex(v, " stream-server")-4:]
		if strings.Contains(v, " is 0x") || strings.Contains(v, "other bytes") || strings.Contains(v, "and more came") {
			failf(t, "the server's reader after its peer was killed: %q\nclient:\n%s", v[:min(len(v), 200)], out.String())
		}
		all := srvOut.String()
		t.Logf("server: %s (so far: %d DOWN(peer-gone), %d peers found gone by the library)", v[:strings.IndexByte(v+"\n", '\n')],
			strings.Count(all, "down (peer-gone)"), strings.Count(all, "peer gone"))
	}
	t.Run("killed", killed)
	t.Run("killed-on-rings", func(t *testing.T) { // no flips: killed while on the rings
		hold.Store(true)
		defer hold.Store(false)
		time.Sleep(50 * time.Millisecond)
		killed(t)
	})
	// A Go end (guestlib) against a C end: the same stream, the same
	// switches, each library with its own algorithms.
	t.Run("go-c", func(t *testing.T) {
		before, passed := strings.Count(srvOut.String(), " stream-server"), strings.Count(srvOut.String(), "PASS stream-server")
		c, err := e.dial(1, g2+":7702")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		const seed, n = 99, size
		fmt.Fprintf(c, "stream %d %d\n", seed, n)
		werr := make(chan error, 1)
		go func() {
			g, buf, left := edgegen.New(seed, 0), make([]byte, 300000), n
			for k := 1; left > 0; k = k*7%300000 + 1 {
				m := min(k, left)
				g.Fill(buf[:m])
				if _, err := c.Write(buf[:m]); err != nil {
					werr <- err
					return
				}
				left -= m
			}
			werr <- c.CloseWrite()
		}()
		c.SetReadDeadline(time.Now().Add(2 * time.Minute))
		g, buf, want, got := edgegen.New(seed, 1), make([]byte, 65536), make([]byte, 65536), 0
		for {
			k, err := c.Read(buf)
			g.Fill(want[:k])
			if !bytes.Equal(buf[:k], want[:k]) {
				failf(t, "the Go end read wrong bytes at %d", got)
			}
			got += k
			if err != nil {
				if got != n || err.Error() != "EOF" {
					failf(t, "the Go end read %d of %d bytes: %v", got, n, err)
				}
				break
			}
		}
		if err := <-werr; err != nil {
			failf(t, "the Go end's writes: %v", err)
		}
		eventually(t, 10*time.Second, "the server's verdict", func() bool { return strings.Count(srvOut.String(), " stream-server") > before })
		if strings.Count(srvOut.String(), "PASS stream-server") <= passed {
			failf(t, "the C end's verdict")
		}
		t.Logf("go-c: %d flips so far; Go end stats %+v", flips, c.Stats())
	})
}
