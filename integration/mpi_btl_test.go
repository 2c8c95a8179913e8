package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/mpirig"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/testenv"
)

// btl/shunt, the Open MPI transport (guestlib/mpi, docs/mpi.md): MPI jobs
// across the two namespace guests of the rig, mpirun in the rig's host
// namespace starting orted in each guest (as TestPreloadMPI does). Every
// job checks every byte it receives (mpi/btlcheck.c); the tests assert
// which path the ranks' traffic took, from hostd's side (flows listed) and
// from the BTL's own lines (btl_shunt_verbose=1), and what happens when
// hostd, the firewall or the policy say otherwise. On failure a test prints
// the job's output (both ranks') and hostd's flows.

// btlPorts is the range the BTL's lease listeners take in these tests, so
// that firewall and policy rules can name them.
const btlPorts = "7800-7899"

var btlBuild struct {
	sync.Once
	dir string
	err error
}

// needBTL builds mca_btl_shunt.so (make mpi) and the MPI programs once per
// test binary, into the directory TestMain removes at the end.
func needBTL(t testing.TB) string {
	t.Helper()
	testenv.NeedTool(t, "mpicc", "libopenmpi-dev openmpi-bin")
	testenv.NeedTool(t, "mpirun", "openmpi-bin")
	btlBuild.Do(func() {
		dir := filepath.Join(filepath.Dir(hostdBin), "btl")
		if btlBuild.err = mpirig.Build("..", dir, "btlcheck", "mpibench", "stencil"); btlBuild.err == nil {
			btlBuild.dir = dir
		}
	})
	if btlBuild.err != nil {
		testenv.Missing(t, "cannot build btl/shunt: "+btlBuild.err.Error(), "apt-get install make gcc libopenmpi-dev openmpi-bin")
	}
	return btlBuild.dir
}

// mpiJob is one mpirun across the rig's two guests.
type mpiJob struct {
	np      int      // ranks, half in each guest (0: 2)
	btl     string   // --mca btl (default self,vader,shunt)
	preload bool     // ranks under the preload library (shunt-run)
	sameNS  bool     // both ranks in guest 1 (vader's comparisons)
	mca     []string // "--mca", name, value triples (replacing the defaults)
	prog    string   // a program in needBTL's directory
	args    []string
	timeout time.Duration // default 2 minutes
}

// mpiRun is a started job.
type mpiRun struct {
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan error
	job  mpiJob
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// startMPI starts j with mpirun in the rig's host namespace; orted runs in
// each guest's namespace with that guest's SHUNT_CONTROL.
func (e *env) startMPI(t testing.TB, j mpiJob) *mpiRun {
	t.Helper()
	dir := needBTL(t)
	if j.np == 0 {
		j.np = 2
	}
	if j.btl == "" {
		j.btl = "self,vader,shunt"
	}
	if j.timeout == 0 {
		j.timeout = 2 * time.Minute
	}
	var guests []mpirig.Guest
	for _, g := range e.rig.Guests {
		guests = append(guests, mpirig.Guest{Addr: g.Addr.String(), NS: g.NS, Control: e.control(g)})
	}
	preload := ""
	if j.preload {
		needPreload(t)
		preload = "LD_PRELOAD=" + preloadLib + " SHUNT_VERBOSE=1"
	}
	rsh, err := mpirig.WriteAgent(t.TempDir(), guests, preload)
	if err != nil {
		t.Fatal(err)
	}
	g1, g2 := e.rig.Guests[0].Addr, e.rig.Guests[1].Addr
	hosts := fmt.Sprintf("%s:%d,%s:%d", g1, j.np/2, g2, j.np-j.np/2)
	if j.sameNS {
		hosts = fmt.Sprintf("%s:%d", g1, j.np)
	}
	// Open MPI refuses a parameter named twice: j.mca replaces defaults.
	mca := [][2]string{{"routed", "direct"}, {"plm_rsh_agent", rsh}, {"pml", "ob1"}, {"btl", j.btl},
		{"btl_tcp_if_include", "10.77.0.0/16"}, {"oob_tcp_if_include", "10.77.0.0/16"},
		// Two orteds on one machine: no hwloc shared-memory topology
		// (it crashes when both map it), no binding.
		{"rtc", "^hwloc"},
		{"mca_component_path", mpirig.SysComponents() + ":" + dir},
		{"btl_shunt_if_include", "10.77.0.0/16"}, {"btl_shunt_port_min", "7800"}, {"btl_shunt_port_max", "7899"},
		{"btl_shunt_verbose", "1"}}
	for i := 0; i+1 < len(j.mca); i += 2 {
		name, val, found := strings.TrimPrefix(j.mca[i], "--mca"), j.mca[i+1], false
		if name == "" { // "--mca", "name", "value"
			i++
			name, val = j.mca[i], j.mca[i+1]
		}
		for k := range mca {
			if mca[k][0] == name {
				mca[k][1], found = val, true
			}
		}
		if !found {
			mca = append(mca, [2]string{name, val})
		}
	}
	args := []string{"--allow-run-as-root", "-np", fmt.Sprint(j.np), "--host", hosts, "--bind-to", "none"}
	for _, kv := range mca {
		args = append(args, "--mca", kv[0], kv[1])
	}
	args = append(args, filepath.Join(dir, j.prog))
	cmd := exec.Command("mpirun", append(args, j.args...)...)
	r := &mpiRun{cmd: cmd, out: &lockedBuffer{}, done: make(chan error, 1), job: j}
	cmd.Stdout, cmd.Stderr = r.out, r.out
	if err := nsrig.Start(e.rig.HostNSPath(), cmd); err != nil {
		t.Fatal(err)
	}
	go func() { r.done <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})
	return r
}

// wait waits for the job within its deadline; on failure it fails t with
// the job's output and hostd's flows.
func (r *mpiRun) wait(t testing.TB, e *env) string {
	t.Helper()
	select {
	case err := <-r.done:
		if err != nil {
			t.Fatalf("mpirun: %v\n%s\nhostd flows: %s", err, r.out.String(), e.flowsJSON())
		}
	case <-time.After(r.job.timeout):
		r.cmd.Process.Kill()
		<-r.done
		t.Fatalf("the job did not finish in %s\n%s\nhostd flows: %s", r.job.timeout, r.out.String(), e.flowsJSON())
	}
	return r.out.String()
}

// runMPI runs j to its end and returns its output.
func (e *env) runMPI(t testing.TB, j mpiJob) string {
	t.Helper()
	return e.startMPI(t, j).wait(t, e)
}

func (e *env) flowsJSON() string {
	var fl []broker.FlowInfo
	if err := admin.Call(e.Admin, admin.Request{Cmd: "flows"}, &fl); err != nil {
		return "(hostd does not answer: " + err.Error() + ")"
	}
	b, _ := json.MarshalIndent(fl, "", "  ")
	return string(b)
}

// nflows is how many of hostd's connection records are on their rings now
// (-1 if it does not answer). hostd lists a record for every paired
// connection, on the rings or not (protocol v3).
func (e *env) nflows() int {
	fl, err := e.Conns()
	if err != nil {
		return -1
	}
	return len(onRings(fl))
}

// onRings returns the names of the records in fl that are on their rings.
func onRings(fl []broker.FlowInfo) []string {
	var names []string
	for _, f := range fl {
		if f.Path == "rings" {
			names = append(names, f.Conn)
		}
	}
	sort.Strings(names)
	return names
}

// vethBytes is what crossed guest 1's link to the host, both ways.
func (e *env) vethBytes(t testing.TB) uint64 {
	t.Helper()
	out, err := nsrig.Run(e.rig.HostNSPath(), "ip", "-j", "-s", "link", "show", "dev", e.rig.Guests[0].HostIf)
	if err != nil {
		t.Fatal(err)
	}
	var links []struct {
		Stats struct {
			RX struct{ Bytes uint64 } `json:"rx"`
			TX struct{ Bytes uint64 } `json:"tx"`
		} `json:"stats64"`
	}
	if err := json.Unmarshal([]byte(out), &links); err != nil || len(links) != 1 {
		t.Fatalf("ip -j -s link: %v\n%s", err, out)
	}
	return links[0].Stats.RX.Bytes + links[0].Stats.TX.Bytes
}

// ringLines counts the BTL's lines saying a direction moved to a ring.
func ringLines(out string) int { return strings.Count(out, ": ring (slot ") }

// logBTL logs the BTL's own lines of a job (go test -v shows them).
func logBTL(t testing.TB, out string) {
	t.Helper()
	var b strings.Builder
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "btl/shunt: ") {
			b.WriteString(l + "\n")
		}
	}
	t.Logf("the BTL said:\n%s", b.String())
}

func mustContain(t *testing.T, out string, e *env, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Fatalf("the job's output lacks %q\n%s\nhostd flows: %s", w, out, e.flowsJSON())
		}
	}
}

// TestMPIBTLPointToPoint: two ranks, one per guest. Every size from 0 B to
// 4 MiB (powers of two, their neighbours, odd sizes), non-blocking and
// wildcard receives, collectives; data checked. Both directions move to a
// ring (hostd counts both moves; the BTL says so), and
// the guest's link carries a small fraction of the data (the leases'
// setup, mpirun's own traffic): the bytes went through shared memory.
func TestMPIBTLPointToPoint(t *testing.T) {
	e := newEnv(t, 2, "")
	before := e.vethBytes(t)
	var out string
	flows := e.ringsMoved(func() { out = e.runMPI(t, mpiJob{prog: "btlcheck"}) })
	moved := e.vethBytes(t) - before
	mustContain(t, out, e, "data ok")
	if ringLines(out) != 2 || flows != 2 {
		t.Fatalf("%d directions moved to a ring and hostd counted %d moves to rings; want 2 and 2\n%s", ringLines(out), flows, out)
	}
	const data = 2 * 50 << 20 // p2p alone sends more than 50 MiB each way
	if moved > data/10 {
		t.Fatalf("%d bytes crossed the guest's link for more than %d bytes of MPI data: the data did not take the rings", moved, data)
	}
	t.Logf("guest 1's link carried %d KiB during the job", moved>>10)
	logBTL(t, out)
}

// TestMPIBTLFourRanks: four ranks, two per guest: the pairs across guests
// take rings (four directions), the pairs within a guest stay on vader
// (the BTL declines them); collectives and point-to-point are checked.
func TestMPIBTLFourRanks(t *testing.T) {
	e := newEnv(t, 2, "")
	var out string
	flows := e.ringsMoved(func() {
		out = e.runMPI(t, mpiJob{np: 4, prog: "btlcheck", args: []string{"-m", "1048576"}, mca: []string{"--mca", "btl_shunt_verbose", "2"}})
	})
	mustContain(t, out, e, "data ok")
	if got := ringLines(out); got != 8 || flows != 8 {
		t.Fatalf("%d directions moved to a ring, hostd counted %d moves to rings; want 8 and 8 (2 ranks x 2 peers in the other guest x 2 directions)\n%s", got, flows, out)
	}
	for _, pair := range [][2]int{{0, 1}, {1, 0}, {2, 3}, {3, 2}} {
		if w := fmt.Sprintf("rank %d: rank %d is in this guest: left to vader", pair[0], pair[1]); !strings.Contains(out, w) {
			t.Fatalf("no %q: a pair within a guest did not stay on vader\n%s", w, out)
		}
	}
}

// TestMPIBTLFirewallReject: the firewall rejects the BTL's lease ports, so
// the leases cannot connect: the BTL leaves the peers to the TCP BTL at
// once (ob1 fixes reachability when it adds a peer), says why, and the job
// completes over kernel TCP with its data checked; hostd lists no flow.
func TestMPIBTLFirewallReject(t *testing.T) {
	e := newEnv(t, 2, "")
	if err := e.rig.Firewall("tcp dport " + btlPorts + " reject with tcp reset"); err != nil {
		t.Fatal(err)
	}
	var out string
	flows := e.ringsMoved(func() {
		out = e.runMPI(t, mpiJob{btl: "self,vader,shunt,tcp", prog: "btlcheck", args: []string{"-m", "1048576"}})
	})
	mustContain(t, out, e, "data ok", "the lease connect was refused (a firewall REJECT?): left to the next BTL (tcp)")
	if flows != 0 || ringLines(out) != 0 {
		t.Fatalf("hostd counted %d moves to rings and %d directions took a ring through a rejecting firewall\n%s", flows, ringLines(out), out)
	}
}

// TestMPIBTLPolicyDenied: hostd's policy keeps the BTL's ports on TCP: the
// leases carry the job, each direction says tcp (policy) once.
func TestMPIBTLPolicyDenied(t *testing.T) {
	e := newEnv(t, 2, `rule "mpi-tcp" {
  action = "tcp"
  ports  = ["`+btlPorts+`"]
}`)
	out := e.runMPI(t, mpiJob{prog: "btlcheck", args: []string{"-m", "1048576"}})
	mustContain(t, out, e, "data ok", ": tcp (policy)")
	if ringLines(out) != 0 {
		t.Fatalf("a direction took a ring against the policy\n%s", out)
	}
}

// TestMPIBTLPolicyAllowsLater: the job starts while hostd's policy keeps
// the BTL's ports on TCP (each direction says tcp (policy) and runs on its
// lease); a reload that allows them makes hostd send READY for the same
// leases, whose requests got TCP first: both directions move to a ring
// with no new lease, and the data is checked across the switch.
func TestMPIBTLPolicyAllowsLater(t *testing.T) {
	tcp := `rule "mpi-tcp" {
  action = "tcp"
  ports  = ["` + btlPorts + `"]
}`
	e := newEnv(t, 2, tcp)
	r := e.startMPI(t, mpiJob{prog: "btlcheck", args: []string{"-t", "8", "-m", "262144"}})
	deadline := time.Now().Add(30 * time.Second)
	for strings.Count(r.out.String(), ": tcp (policy)") < 2 || !strings.Contains(r.out.String(), "ok at ") {
		if time.Now().After(deadline) {
			t.Fatalf("the job did not run on its leases with tcp (policy) within 30s\n%s\nhostd flows: %s", r.out.String(), e.flowsJSON())
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.writeConfig("")
	var rep map[string]int
	if err := admin.Call(e.Admin, admin.Request{Cmd: "reload"}, &rep); err != nil {
		t.Fatalf("reload: %v", err)
	}
	e.waitFlows(t, r, 2, "both directions on rings after the reload")
	out := r.wait(t, e)
	mustContain(t, out, e, "data ok")
	if got := ringLines(out); got != 2 {
		t.Fatalf("%d moves to a ring, want 2\n%s", got, out)
	}
	if strings.Contains(out, "a new lease") {
		t.Fatalf("the BTL opened new leases; hostd should have moved the first ones\n%s", out)
	}
	logBTL(t, out)
}

// TestMPIBTLNoHostd: no hostd at all: every direction stays on its lease,
// says tcp (no-hostd), and the job completes.
func TestMPIBTLNoHostd(t *testing.T) {
	e := newEnv(t, 2, "")
	e.StopHostd()
	out := e.runMPI(t, mpiJob{prog: "btlcheck", args: []string{"-m", "1048576"}})
	mustContain(t, out, e, "data ok", ": tcp (no-hostd)")
	if ringLines(out) != 0 {
		t.Fatalf("a direction took a ring without hostd\n%s", out)
	}
}

// waitFlows waits until hostd lists want flows.
func (e *env) waitFlows(t *testing.T, r *mpiRun, want int, what string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for e.nflows() != want {
		select {
		case err := <-r.done:
			t.Fatalf("%s: the job ended first (%v)\n%s", what, err, r.out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: hostd lists %d flows, want %d, after 30s\n%s\nhostd flows: %s", what, e.nflows(), want, r.out.String(), e.flowsJSON())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestMPIBTLPolicyFlip: while a job runs on the rings, a reload forbids the
// BTL's ports: hostd sends DOWN for both leases, each sender marks the
// ring's end on its lease (DOWN) and its reader drains the ring exactly
// that far, both ends say LEFT and hostd frees the ring pairs; the job goes
// on over the leases. A reload that allows them again makes hostd send
// READY for the same leases (the same records, by name): both directions
// go back to rings (SWITCH on the same lease). The job's data is checked
// across both switches, and it spends time on each path (rounds counted).
func TestMPIBTLPolicyFlip(t *testing.T) {
	e := newEnv(t, 2, "")
	r := e.startMPI(t, mpiJob{prog: "btlcheck", args: []string{"-t", "20", "-m", "262144"}})
	e.waitFlows(t, r, 2, "both directions on rings")
	fl, err := e.Conns()
	if err != nil {
		t.Fatal(err)
	}
	before := onRings(fl)
	reload := func(policy string) {
		e.writeConfig(policy)
		var rep map[string]int
		if err := admin.Call(e.Admin, admin.Request{Cmd: "reload"}, &rep); err != nil {
			t.Fatalf("reload: %v", err)
		}
	}
	rounds := func() int { return strings.Count(r.out.String(), "ok at ") }
	waitRounds := func(what string) {
		t.Helper()
		want := rounds() + 2
		deadline := time.Now().Add(30 * time.Second)
		for rounds() < want {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the job made no progress in 30s\n%s\nhostd flows: %s", what, r.out.String(), e.flowsJSON())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitRounds("on the rings")
	reload(`rule "mpi-tcp" {
  action = "tcp"
  ports  = ["` + btlPorts + `"]
}`)
	e.waitFlows(t, r, 0, "both directions off the rings")
	// Both ends LEFT: hostd freed the ring pairs (leaving -> tcp).
	deadline := time.Now().Add(30 * time.Second)
	for {
		fl, err = e.Conns()
		if err != nil {
			t.Fatal(err)
		}
		freed := len(fl) == 2
		for _, f := range fl {
			freed = freed && f.Path == "tcp" && f.Ring == 0
		}
		if freed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("30s after the reload to tcp the ring pairs are not freed (both ends LEFT)\n%s\nhostd flows: %s", r.out.String(), e.flowsJSON())
		}
		time.Sleep(20 * time.Millisecond)
	}
	lease := e.vethBytes(t)
	waitRounds("on the leases")
	if moved := e.vethBytes(t) - lease; moved < 1<<20 {
		t.Fatalf("the job made rounds on tcp but only %d bytes crossed the guest's link: the data did not take the leases", moved)
	}
	reload("")
	e.waitFlows(t, r, 2, "both directions back on rings")
	fl, err = e.Conns()
	if err != nil {
		t.Fatal(err)
	}
	if after := onRings(fl); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Fatalf("records on the rings were %v and are %v after the flip back: want the same leases back on rings\n%s", before, after, e.flowsJSON())
	}
	for _, f := range fl {
		if f.Switches < 3 {
			t.Fatalf("record %s switched %d times, want at least 3 (rings, tcp, rings)\n%s", f.Conn, f.Switches, e.flowsJSON())
		}
	}
	ring := e.vethBytes(t)
	waitRounds("back on the rings")
	if moved := e.vethBytes(t) - ring; moved > 1<<20 {
		t.Fatalf("back on the rings, %d bytes crossed the guest's link for two rounds", moved)
	}
	out := r.wait(t, e)
	mustContain(t, out, e, "data ok", "ring ended, back on the lease (policy-reload)")
	if got := ringLines(out); got != 4 {
		t.Fatalf("%d moves to a ring, want 4 (2 directions, twice)\n%s", got, out)
	}
	if strings.Contains(out, "a new lease") {
		t.Fatalf("the BTL opened new leases; hostd should have moved the same ones back\n%s", out)
	}
	logBTL(t, out)
}

// TestMPIBTLBarrierFirst: a job whose first operation is a barrier (both
// ranks connect their leases to each other at the same moment) gets the
// fast path: both directions move to a ring (the BTL says so, and hostd
// lists both records on their rings), with the data checked after it.
func TestMPIBTLBarrierFirst(t *testing.T) {
	e := newEnv(t, 2, "")
	var out string
	flows := e.ringsMoved(func() { out = e.runMPI(t, mpiJob{prog: "btlcheck", args: []string{"-b", "-t", "2", "-m", "262144"}}) })
	mustContain(t, out, e, "data ok")
	if ringLines(out) != 2 || flows != 2 {
		t.Fatalf("after a barrier first, %d directions moved to a ring and hostd counted %d moves to rings; want 2 and 2\n%s", ringLines(out), flows, out)
	}
	if strings.Contains(out, ": tcp (") {
		t.Fatalf("a direction went to tcp\n%s", out)
	}
	logBTL(t, out)
}

// TestMPIBTLHostdRestart: hostd is killed and restarted while a job runs on
// the rings: the rings go on (hostd is off the data path), the ranks'
// sessions reconnect and REATTACH their flows, which the new hostd keeps,
// and the job completes with its data checked.
func TestMPIBTLHostdRestart(t *testing.T) {
	e := newEnv(t, 2, "")
	r := e.startMPI(t, mpiJob{prog: "btlcheck", args: []string{"-t", "8", "-m", "262144"},
		mca: []string{"--mca", "btl_shunt_retry_ms", "200", "--mca", "btl_shunt_retry_max_ms", "500"}})
	e.waitFlows(t, r, 2, "both directions on rings")
	e.killHostd()
	time.Sleep(500 * time.Millisecond) // the job runs without hostd meanwhile
	e.startHostd()
	// The reattach grace is 3 s: flows still listed after it were reattached.
	time.Sleep(4 * time.Second)
	if n := e.nflows(); n != 2 {
		select {
		case <-r.done:
		default:
			t.Fatalf("after the restart and the reattach grace hostd lists %d flows, want 2\n%s\nhostd flows: %s", n, r.out.String(), e.flowsJSON())
		}
	}
	out := r.wait(t, e)
	mustContain(t, out, e, "data ok", "reconnected to hostd")
	logBTL(t, out)
}

// TestMPIBTLHostdRestartOnTCP: hostd is restarted while the job runs on
// its leases (policy tcp): each rank's session reconnects and OPENs its
// leases again with their request ids, the new hostd pairs them again, and
// a reload that allows the BTL's ports then moves both directions to rings
// (no new lease); the data is checked throughout.
func TestMPIBTLHostdRestartOnTCP(t *testing.T) {
	e := newEnv(t, 2, `rule "mpi-tcp" {
  action = "tcp"
  ports  = ["`+btlPorts+`"]
}`)
	r := e.startMPI(t, mpiJob{prog: "btlcheck", args: []string{"-t", "12", "-m", "262144"}})
	waitOut := func(what, s string, n int) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for strings.Count(r.out.String(), s) < n {
			if time.Now().After(deadline) {
				t.Fatalf("%s: no %d lines %q within 30s\n%s\nhostd flows: %s", what, n, s, r.out.String(), e.flowsJSON())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitOut("on the leases", ": tcp (policy)", 2)
	e.killHostd()
	e.startHostd()
	waitOut("after the restart", "ring pairs and 2 leases on tcp", 2)
	e.writeConfig("")
	var rep map[string]int
	if err := admin.Call(e.Admin, admin.Request{Cmd: "reload"}, &rep); err != nil {
		t.Fatalf("reload: %v", err)
	}
	e.waitFlows(t, r, 2, "both directions on rings after the reload")
	out := r.wait(t, e)
	mustContain(t, out, e, "data ok", "reconnected to hostd")
	if got := ringLines(out); got != 2 {
		t.Fatalf("%d moves to a ring, want 2\n%s", got, out)
	}
	if strings.Contains(out, "a new lease") {
		t.Fatalf("the BTL opened new leases; the new hostd should have moved the first ones\n%s", out)
	}
	logBTL(t, out)
}

// TestMPIBTLPeerDies: a rank is killed mid-job: the other rank's BTL names
// it, and the job ends (it does not hang).
func TestMPIBTLPeerDies(t *testing.T) {
	e := newEnv(t, 2, "")
	r := e.startMPI(t, mpiJob{prog: "btlcheck", args: []string{"-t", "60", "-m", "65536"}, timeout: time.Minute})
	e.waitFlows(t, r, 2, "both directions on rings")
	// The rank is the btlcheck process in guest 2's namespace (by pid:
	// the rank in guest 1 has the same name).
	pids, err := exec.Command("ip", "netns", "pids", e.rig.Guests[1].NS).Output()
	if err != nil {
		t.Fatalf("ip netns pids: %v", err)
	}
	killed := 0
	for _, pid := range strings.Fields(string(pids)) {
		if comm, _ := os.ReadFile("/proc/" + pid + "/comm"); strings.TrimSpace(string(comm)) == "btlcheck" {
			n, _ := strconv.Atoi(pid)
			if p, err := os.FindProcess(n); err == nil && p.Kill() == nil {
				killed++
			}
		}
	}
	if killed != 1 {
		t.Fatalf("killed %d ranks in guest 2, want 1", killed)
	}
	select {
	case <-r.done:
	case <-time.After(time.Minute):
		r.cmd.Process.Kill()
		t.Fatalf("the job did not end after a rank died\n%s", r.out.String())
	}
	o := r.out.String()
	if !strings.Contains(o, "rank 1") || strings.Contains(o, "data ok") {
		t.Fatalf("after rank 1 died the output should name it and not claim success:\n%s", o)
	}
	t.Logf("the job's output:\n%s", o)
}

// TestVMMPIBTL: an MPI job across two QEMU (TCG) VMs with btl/shunt. The
// VMs see the host's /usr over 9p (Open MPI runs in them unchanged); the
// component and the program go into the image at their host paths, so
// mca_component_path is the same inside. mpirun runs on the host and starts
// orted in each VM through the agent's exec server (as TestVMMPI). Each
// rank finds a free control port of its VM and the ivshmem BAR on its own;
// both directions move to rings in the BAR, and the data is checked.
func TestVMMPIBTL(t *testing.T) {
	dir := needBTL(t)
	v := newVMEnv(t, 2)
	tmp := t.TempDir()
	rsh := filepath.Join(tmp, "rsh")
	script := fmt.Sprintf("#!/bin/sh\n# plm_rsh_agent: rsh HOST CMD -> CMD in that VM\nexec %s rsh 7777 \"$@\"\n", v.agent)
	if err := os.WriteFile(rsh, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	prog := filepath.Join(dir, "btlcheck")
	initrd := filepath.Join(tmp, "initramfs-mpi")
	if err := vm.BuildInitramfsFiles(initrd, v.kernel, v.agent, prog, filepath.Join(dir, "mca_btl_shunt.so"), rsh); err != nil {
		t.Fatal(err)
	}
	v.initrd = initrd
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for i := 1; i <= 2; i++ {
		mustWait(t, ctx, v.bootWith(i, vm.Options{ShareUsr: true}, "exec-server", "7777"), "SHUNT-VM LISTENING")
	}
	a1, _ := vmAddr(1)
	a2, _ := vmAddr(2)
	args := []string{"--allow-run-as-root", "-np", "2", "--host", a1.String() + ":1," + a2.String() + ":1",
		"--mca", "routed", "direct", "--mca", "plm_rsh_agent", rsh, "--mca", "pml", "ob1", "--mca", "btl", "self,vader,shunt",
		"--mca", "oob_tcp_if_include", "10.77.0.0/16", "--mca", "rtc", "^hwloc", "--bind-to", "none",
		"--mca", "mca_component_path", mpirig.SysComponents() + ":" + dir,
		"--mca", "btl_shunt_if_include", "10.77.0.0/16", "--mca", "btl_shunt_verbose", "1",
		prog, "-m", "262144"}
	var out string
	flows := v.env.ringsMoved(func() {
		out = runIn(t, v.rig.HostNSPath(), exec.Command("mpirun", args...), 4*time.Minute)
	})
	if !strings.Contains(out, "data ok") || ringLines(out) != 2 || flows != 2 {
		t.Fatalf("MPI between the VMs with btl/shunt: %d directions on rings, hostd counted %d moves to rings, want 2 and 2:\n%s", ringLines(out), flows, out)
	}
	logBTL(t, out)
}
