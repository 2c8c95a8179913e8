package integration

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
)

// Unmodified programs under shunt-run while hostd moves their connections
// between the rings and TCP every flipEvery (a policy reload each time) and
// is killed and restarted once in the middle (issue 11): each tool must end
// without an error, with its data checked where it checks it, and hostd's
// records must show the connections switched.

const flipEvery = 40 * time.Millisecond

// flipper flips hostd's policy between everything on the rings and
// everything on TCP until stopped, and SIGKILLs and restarts hostd once
// after restartAfter. stop returns how many reloads moved something and
// the most switches a connection record showed.
type flipper struct {
	e     *env
	stopc chan struct{}
	wg    sync.WaitGroup

	mu              sync.Mutex // the flipping goroutine's record, read by enough
	moved, switches int
	restarted       bool
	errs            []string
}

func flipDuring(e *env, restartAfter time.Duration) *flipper {
	f := &flipper{e: e, stopc: make(chan struct{})}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		start := time.Now()
		for tcp := true; ; tcp = !tcp {
			select {
			case <-f.stopc:
				if _, err := e.SetPolicy(""); err != nil {
					f.errs = append(f.errs, "final reload: "+err.Error())
				}
				return
			case <-time.After(flipEvery):
			}
			f.mu.Lock()
			restart := !f.restarted && time.Since(start) > restartAfter
			f.mu.Unlock()
			if restart {
				e.KillHostd()
				err := e.StartHostd()
				f.mu.Lock()
				f.restarted = true
				if err != nil {
					f.errs = append(f.errs, "restart: "+err.Error())
				}
				f.mu.Unlock()
				if err != nil {
					return
				}
			}
			policy := ""
			if tcp {
				policy = stack.PolicyTCP
			}
			n, err := e.SetPolicy(policy)
			recs, rerr := e.Conns()
			f.mu.Lock()
			if err != nil {
				f.errs = append(f.errs, err.Error())
			} else if n > 0 {
				f.moved++
			}
			if rerr == nil {
				for _, r := range recs {
					f.switches = max(f.switches, r.Switches)
				}
			}
			f.mu.Unlock()
		}
	}()
	return f
}

// enough reports whether the flips so far meet stop's bar (a restart,
// and 3 reloads and switches after it too): a tool whose run can end
// before that (redis-benchmark's 100000 requests took under a second in a
// CI run) runs again until then.
func (f *flipper) enough(movedAtRestart *int) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.restarted {
		*movedAtRestart = f.moved
		return false
	}
	return f.moved >= *movedAtRestart+3 && f.switches >= 3
}

func (f *flipper) stop(t *testing.T) {
	t.Helper()
	close(f.stopc)
	f.wg.Wait()
	if len(f.errs) > 0 {
		t.Fatalf("flipping hostd: %s", strings.Join(f.errs, "; "))
	}
	if !f.restarted || f.moved < 3 || f.switches < 3 {
		recs, _ := f.e.Conns()
		t.Fatalf("hostd's records: %+v\nhostd restarted %v, %d reloads moved connections, at most %d switches on one: want a restart and at least 3 each", recs, f.restarted, f.moved, f.switches)
	}
	t.Logf("%d reloads moved connections; up to %d switches on one connection; hostd restarted once", f.moved, f.switches)
}

func TestPreloadToolsUnderFlips(t *testing.T) {
	t.Run("iperf3", func(t *testing.T) {
		e := newEnv(t, 2, "")
		g2 := e.rig.Guests[1].Addr.String()
		srv := e.startLog(2, e.guestCmd(2, "iperf3", "-s", "-1", "-B", g2, "-p", "5311"))
		e.waitListening(2, 5311)
		f := flipDuring(e, 2*time.Second)
		out := e.run(1, e.guestCmd(1, "iperf3", "-c", g2, "-p", "5311", "-t", "5", "--bidir", "-J"))
		f.stop(t)
		res, err := parseIperf3(out)
		if err != nil || res.Error != "" || res.Bytes == 0 {
			t.Fatalf("iperf3 under flips: %v %q\nclient:\n%s\nserver:\n%s", err, res.Error, out, srv.String())
		}
		t.Logf("iperf3 --bidir: %.0f MB received under flips", res.Bytes/1e6)
	})
	t.Run("redis-benchmark", func(t *testing.T) {
		e := newEnv(t, 2, "")
		g2 := e.rig.Guests[1].Addr.String()
		e.start(2, e.guestCmd(2, "redis-server", "--bind", g2, "--port", "6391", "--save", "", "--appendonly", "no", "--protected-mode", "no"))
		e.waitListening(2, 6391)
		f := flipDuring(e, time.Second)
		// Runs of 100000 requests until the flips met their bar (at
		// most 20: the flipper's own errors or records say why not).
		movedAtRestart := 0
		for run := 1; ; run++ {
			out := e.run(1, e.guestCmd(1, "redis-benchmark", "-h", g2, "-p", "6391", "-n", "100000", "-c", "4", "-t", "set,get", "-q"))
			if !regexp.MustCompile(`GET: [0-9.]+ requests per second`).MatchString(out) || strings.Contains(out, "Error") {
				f.stop(t)
				t.Fatalf("redis-benchmark under flips (run %d):\n%s", run, out)
			}
			if f.enough(&movedAtRestart) || run == 20 {
				t.Logf("redis-benchmark: %d runs of 100000 requests", run)
				break
			}
		}
		f.stop(t)
		// The values redis hands back are checked: what was set is got.
		set := e.run(1, e.guestCmd(1, "redis-cli", "-h", g2, "-p", "6391", "set", "flips", "survived"))
		get := e.run(1, e.guestCmd(1, "redis-cli", "-h", g2, "-p", "6391", "get", "flips"))
		if !strings.Contains(set, "OK") || !strings.Contains(get, "survived") {
			t.Fatalf("redis-cli after the flips: set %q, get %q", set, get)
		}
	})
	t.Run("sockperf", func(t *testing.T) {
		e := newEnv(t, 2, "")
		g2 := e.rig.Guests[1].Addr.String()
		srv := e.start(2, e.guestCmd(2, "sockperf", "server", "--tcp", "-i", g2, "-p", "11112"))
		e.waitListening(2, 11112)
		f := flipDuring(e, 2*time.Second)
		out := e.run(1, e.guestCmd(1, "sockperf", "ping-pong", "--tcp", "-i", g2, "-p", "11112", "-t", "5", "-m", "14", "--mps", "5000000"))
		defer func() { // the library's lines (-v) show each end's READY, DOWN and leave
			if t.Failed() {
				t.Logf("client:\n%s\nserver:\n%s", out, srv.String())
			}
		}()
		f.stop(t)
		if !regexp.MustCompile(`percentile 50\.000 =\s+[0-9.]+`).MatchString(out) || strings.Contains(out, "ERROR") {
			t.Fatal("sockperf under flips")
		}
	})
	t.Run("openmpi-tcp", func(t *testing.T) {
		// Open MPI's own TCP BTL (not btl/shunt) with both ranks under
		// the library: its connections are ordinary sockets that move
		// with the flips; btlcheck checks every byte of every phase.
		testenv.NeedTool(t, "mpicc", "libopenmpi-dev openmpi-bin")
		testenv.NeedTool(t, "mpirun", "openmpi-bin")
		e := newEnv(t, 2, "")
		needPreload(t)
		dir := t.TempDir()
		prog := filepath.Join(dir, "btlcheck")
		if out, err := exec.Command("mpicc", "-O2", "-o", prog, "mpi/btlcheck.c").CombinedOutput(); err != nil {
			t.Fatalf("mpicc: %v\n%s", err, out)
		}
		f := flipDuring(e, 2*time.Second)
		out := e.mpirun(t, dir, prog, true, "-t", "5", "-m", "262144")
		f.stop(t)
		if !strings.Contains(out, "data ok") || strings.Contains(out, "MISMATCH") {
			t.Fatalf("Open MPI's TCP BTL under flips:\n%s", out)
		}
	})
}
