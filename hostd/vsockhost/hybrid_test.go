//go:build linux

package vsockhost

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// TestHybrid: for a hybrid vsock (Firecracker, Cloud Hypervisor), the
// room listens at <hybrid>_<port>, mode 0600, where the hypervisor
// connects for each of the guest's connections to the host: the control
// port's listener hands out the connections, and a stretch on the
// stretches' port is checked and bridged as on hostd's own device (a bad
// Hello refused and counted, the right one carried to the flow's ring).
// Close removes the sockets.
func TestHybrid(t *testing.T) {
	dir := t.TempDir()
	hy := filepath.Join(dir, "fc.vsock")
	r, err := Start(hclog.NewNullLogger(), []Spec{{Guest: "fc", ID: 3, Hybrid: hy}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Device(3) != nil || !r.Has(3) || r.Has(4) {
		t.Fatalf("hybrid guest: device %v, has one %v; guest 4 has one %v", r.Device(3), r.Has(3), r.Has(4))
	}
	ctl, err := r.ListenControl(3)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	ctlPath, strPath := fmt.Sprintf("%s_%d", hy, proto.VsockControlPort), fmt.Sprintf("%s_%d", hy, relay.VsockPort)
	if st, err := os.Stat(ctlPath); err != nil || st.Mode().Perm() != 0o600 || st.Mode()&os.ModeSocket == 0 {
		t.Fatalf("control socket %s: %v %v", ctlPath, st, err)
	}
	go func() {
		if c, err := net.Dial("unix", ctlPath); err == nil {
			c.Write([]byte("hello"))
			c.Close()
		}
	}()
	c, err := ctl.Accept()
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 5)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(got); err != nil || string(got) != "hello" {
		t.Fatalf("control connection: %q %v", got, err)
	}
	c.Close()

	f := newFlowsFake(t, 64<<10)
	if err := r.ServeStretches(3, f, nil); err != nil {
		t.Fatal(err)
	}
	bad, err := net.Dial("unix", strPath)
	if err != nil {
		t.Fatal(err)
	}
	bad.Write(relay.Hello{Region: 1}.Encode())
	bad.SetReadDeadline(time.Now().Add(10 * time.Second))
	if k, err := bad.Read(make([]byte, 1)); k != 0 || err == nil {
		t.Fatalf("a Hello of no flow: stream not closed: %d %v", k, err)
	}
	bad.Close()
	vmc, err := net.Dial("unix", strPath)
	if err != nil {
		t.Fatal(err)
	}
	s, err := vstretch.Open(vmc, f.hello, 64<<10, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	deadline := time.Now().Add(30 * time.Second)
	procGot := shmtest.ReadSum(f.ab, nil, deadline)
	if _, err := shmtest.WriteStream(s.W, nil, 5, seeded(9, 1<<20), deadline); err != nil {
		t.Fatal(err)
	}
	if g := <-procGot; g.Err != nil || g.Start != 5 || g.N != 1<<20 || !bytes.Equal(g.Sum, sum(seeded(9, 1<<20))) {
		t.Fatalf("the process guest's ring got start %d, %d bytes, err %v (sum ok %v)", g.Start, g.N, g.Err, bytes.Equal(g.Sum, sum(seeded(9, 1<<20))))
	}
	var stat Stat
	for _, x := range r.Stats() {
		stat = x
	}
	if stat.Hybrid != hy || stat.BadHellos != 1 || stat.Bridged != 1 {
		t.Fatalf("stat %+v: want the hybrid path, 1 refused, 1 bridged", stat)
	}
	s.Close()
	r.Close()
	if _, err := os.Stat(strPath); !os.IsNotExist(err) {
		t.Fatalf("%s after Close: %v", strPath, err)
	}
}

// TestHybridAcceptRetries: an accept error on a hybrid VM's stretch socket
// (EMFILE: any guest can push hostd to its descriptor limit) is retried
// with backoff; the accept loop ended at the first one, and that VM's
// flows were never bridged again (found by review).
func TestHybridAcceptRetries(t *testing.T) {
	dir := t.TempDir()
	hy := filepath.Join(dir, "fc.vsock")
	r, err := Start(hclog.NewNullLogger(), []Spec{{Guest: "fc", ID: 3, Hybrid: hy}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	f := newFlowsFake(t, 64<<10)
	if err := r.ServeStretches(3, f, nil); err != nil {
		t.Fatal(err)
	}
	strPath := fmt.Sprintf("%s_%d", hy, relay.VsockPort)
	var old syscall.Rlimit
	syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old)
	ents, _ := os.ReadDir("/proc/self/fd")
	lim := old
	lim.Cur = uint64(len(ents) + 20)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	defer syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old)
	var fill []*os.File
	for {
		x, err := os.Open("/dev/null")
		if err != nil {
			break
		}
		fill = append(fill, x)
	}
	// leave one fd for the client side of a dial
	fill[len(fill)-1].Close()
	fill = fill[:len(fill)-1]
	c1, err := net.Dial("unix", strPath)
	if err != nil {
		t.Fatalf("dial under the limit: %v", err)
	}
	time.Sleep(300 * time.Millisecond) // the accept loop meets EMFILE
	for _, x := range fill {
		x.Close()
	}
	syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old)
	c1.Close()
	time.Sleep(100 * time.Millisecond)
	c2, err := net.Dial("unix", strPath)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	c2.Write(relay.Hello{Region: 1}.Encode())
	c2.SetReadDeadline(time.Now().Add(7 * time.Second))
	_, err = c2.Read(make([]byte, 1))
	st := r.Stats()[0]
	if ne, ok := err.(net.Error); ok && ne.Timeout() || st.BadHellos == 0 {
		t.Fatalf("after the descriptor pressure: read %v, bad Hellos %d: a new stretch stream was not served (want it refused for its Hello and closed, and counted)", err, st.BadHellos)
	}
}

// TestChmodSocketNoFollow: the mode is set on the socket itself, and a
// socket swapped for a symlink after bind is refused, not followed.
func TestChmodSocketNoFollow(t *testing.T) {
	dir := t.TempDir()
	l, err := listen(filepath.Join(dir, "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if st, err := os.Stat(filepath.Join(dir, "s")); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket: %v %v", st, err)
	}
	victim := filepath.Join(dir, "victim")
	if err := os.WriteFile(victim, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(victim, link); err != nil {
		t.Fatal(err)
	}
	if err := chmodSocket(link, 0o600); err == nil {
		t.Fatal("chmodSocket followed a symlink")
	}
	if st, _ := os.Stat(victim); st.Mode().Perm() != 0o644 {
		t.Fatalf("the link's target's mode changed to %v", st.Mode().Perm())
	}
}
