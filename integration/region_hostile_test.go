package integration

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/ring"
)

// Attacks on a process pair's region as memory (docs/SECURITY.md,
// "Regions"): a guest that holds its pair region's descriptor truncates,
// grows or fallocates it (as another user of the guest, uid 65534), or
// two colluding guests keep their mapping after hostd revoked the flow.

// fdRogue is a raw control session that keeps the descriptors hostd
// sends (REGION, SCM_RIGHTS).
type fdRogue struct {
	t   *testing.T
	c   *net.UnixConn
	buf []byte
	fds []int
}

func dialFdRogue(t *testing.T, sock string) *fdRogue {
	t.Helper()
	c, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	r := &fdRogue{t: t, c: c.(*net.UnixConn)}
	t.Cleanup(func() {
		c.Close()
		for _, fd := range r.fds {
			unix.Close(fd)
		}
	})
	r.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: 1 << ring.FormatVersion})
	if m := r.next(); m.Type != proto.Welcome {
		t.Fatalf("answer to HELLO: %+v", m)
	}
	return r
}

// Read reads the session, keeping any descriptor that comes along.
func (r *fdRogue) Read(p []byte) (int, error) {
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := r.c.ReadMsgUnix(p, oob)
	if oobn > 0 {
		if cms, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
			for _, cm := range cms {
				if fds, ferr := unix.ParseUnixRights(&cm); ferr == nil {
					r.fds = append(r.fds, fds...)
				}
			}
		}
	}
	return n, err
}

func (r *fdRogue) send(m proto.Msg) {
	r.t.Helper()
	_ = r.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if err := proto.Write(r.c, &m); err != nil {
		r.t.Fatal(err)
	}
}

// next reads one message, answering PINGs.
func (r *fdRogue) next() proto.Msg {
	r.t.Helper()
	for {
		_ = r.c.SetReadDeadline(time.Now().Add(10 * time.Second))
		m, buf, err := proto.Read(r, r.buf)
		r.buf = buf
		if err != nil {
			r.t.Fatalf("hostile session: %v", err)
		}
		if m.Type != proto.Ping {
			return m
		}
		r.send(proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
	}
}

// ready waits for the READY of request req and returns it with the
// region's descriptor (from the REGION before it).
func (r *fdRogue) ready(req uint32) (proto.Msg, *os.File) {
	r.t.Helper()
	var f *os.File
	var last proto.Msg
	for deadline := time.Now().Add(15 * time.Second); ; {
		if time.Now().After(deadline) { // PINGs alone keep next from timing out
			r.t.Fatalf("no READY for request %d within 15 s; last message %+v", req, last)
		}
		m := r.next()
		last = m
		switch {
		case m.Type == proto.RegionMsg && len(r.fds) > 0:
			fd := r.fds[len(r.fds)-1]
			r.fds = r.fds[:len(r.fds)-1]
			f = os.NewFile(uintptr(fd), fmt.Sprintf("region %d", m.RegionID))
			r.t.Cleanup(func() { f.Close() })
		case m.Type == proto.Ready && m.ReqID == req:
			if f == nil {
				r.t.Fatalf("READY %+v without a REGION descriptor before it", m)
			}
			return m, f
		}
		// TCP(no-listener) may come first and READY after it (the
		// passive end's LISTEN was on its way): wait on, within next's
		// deadline.
	}
}

// rogueConnect opens a kernel connection from guest a (port sport) to
// dst and claims it (OPEN active) on r.
func (e *env) rogueConnect(t *testing.T, r *fdRogue, a int, sport uint16, dst netip.AddrPort) (net.Conn, netip.AddrPort) {
	t.Helper()
	src := netip.AddrPortFrom(e.rig.Guests[a-1].Addr, sport)
	kc := kernelDial(t, e.rig.Guests[a-1], src, dst)
	r.send(proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Active, Local: src, Remote: dst})
	return kc, src
}

// asNobody runs a tool as uid 65534 (another user of the guest) with f as
// its descriptor 3, and returns its output and error.
func asNobody(f *os.File, name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	cmd.ExtraFiles = []*os.File{f}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// shmem is the kernel's shared-memory use (Shmem in /proc/meminfo).
func shmem(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		var kb int64
		if _, err := fmt.Sscanf(l, "Shmem: %d kB", &kb); err == nil {
			return kb << 10
		}
	}
	t.Fatal("no Shmem in /proc/meminfo")
	return 0
}

// TestHostileRegionTruncate: guest 3, on the rings with an honest Go end
// in guest 2, hands its pair region's descriptor to a process of another
// user (uid 65534), which tries to grow it to 1 TiB (ftruncate and
// fallocate) and to add a seal, then truncates it to nothing. Growing and
// sealing fail (the memfd is sealed), /dev/shm use stays bounded; the
// honest end's calls fail with guestlib.ErrRegionLost (before: SIGBUS in
// ring.readerCond.Ready); hostd stays up when the attacker closes (before:
// SIGBUS in Pool.Release), and guests 1 and 2 keep their flow and get new
// ones; the pair gets a fresh region for its next connection.
func TestHostileRegionTruncate(t *testing.T) {
	testenv.NeedTool(t, "truncate", "coreutils")
	testenv.NeedTool(t, "fallocate", "util-linux")
	e := rgEnv(t, 3, false, "")
	_, stop := e.rgSteady(t, 1, 2, 7500)
	dst := netip.AddrPortFrom(e.rig.Guests[1].Addr, 7501)
	acc := acceptOne(e.listen(2, 7501))
	r := dialFdRogue(t, e.Control(e.rig.Guests[2]))
	kc, _ := e.rogueConnect(t, r, 3, 41501, dst)
	honest := accepted(t, acc)
	_, f := r.ready(1)
	if !fastSoon(t, honest) {
		t.Fatalf("the honest end: %s, want the rings", honest.Path())
	}
	before := shmem(t)
	for _, try := range [][]string{
		{"truncate", "-s", "1T", "/dev/fd/3"},
		{"fallocate", "-o", "0", "-l", "1T", "/dev/fd/3"},
	} {
		if out, err := asNobody(f, try[0], try[1:]...); err == nil || !strings.Contains(out, "Operation not permitted") {
			t.Fatalf("%v as uid 65534: %v, %q; want Operation not permitted (sealed against growth)", try, err, out)
		}
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); !errors.Is(err, unix.EPERM) {
		t.Fatalf("adding F_SEAL_SHRINK (to keep hostd from taking the memory back): %v, want EPERM", err)
	}
	if grown := shmem(t) - before; grown > 64<<20 {
		t.Fatalf("shared memory grew by %d bytes during the attempts to grow the region", grown)
	}
	if out, err := asNobody(f, "truncate", "-s", "0", "/dev/fd/3"); err != nil {
		t.Fatalf("shrinking (allowed: it harms only the pair): %v, %s", err, out)
	}
	// The honest end: an error, nothing worse.
	if _, err := kc.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	_ = honest.SetDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 16)
	_, rerr := honest.Read(buf)
	_, werr := honest.Write(buf)
	if !errors.Is(rerr, guestlib.ErrRegionLost) && !errors.Is(werr, guestlib.ErrRegionLost) {
		t.Fatalf("honest end after the truncation: read %v, write %v; want ErrRegionLost", rerr, werr)
	}
	honest.Close()
	// The attacker closes: hostd releases the flow from its own record.
	r.send(proto.Msg{Type: proto.Close, ReqID: 1, Side: proto.SideA})
	kc.Close()
	r.send(proto.Msg{Type: proto.Ping, Nonce: 7})
	for r.next().Type != proto.Pong {
	}
	e.flows() // hostd answers
	stop()    // guests 1 and 2 moved their data intact on the rings
	e.rgRoundTrip(t, 1, 2, 7502)
	e.rgRoundTrip(t, 3, 2, 7503) // the pair's next connection: a fresh region
}

// TestHostileRegionKeptAfterRevoke: two colluding raw guests (1 and 2)
// on the rings map their pair region and pass bytes through it. The
// operator deletes the connection's conntrack entry (conntrack-gone);
// both ignore DOWN and keep their mappings. Within the grace plus a
// second hostd truncates the region: both mappings reach nothing (an
// access faults, recovered here), mapping the descriptor again gets
// nothing, and it cannot be grown back. While they were on the rings, a
// tail they wrote as 2^62 was listed as guest-reported and dropped, never
// as bytes moved.
func TestHostileRegionKeptAfterRevoke(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	e := rgEnv(t, 2, false, "")
	g2 := e.rig.Guests[1]
	dst := netip.AddrPortFrom(g2.Addr, 7510)
	rb := dialFdRogue(t, e.Control(g2))
	rb.send(proto.Msg{Type: proto.Listen, Local: dst})
	var ln net.Listener
	if err := nsrig.In(g2.NSPath(), func() (err error) { ln, err = net.Listen("tcp4", dst.String()); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ra := dialFdRogue(t, e.Control(e.rig.Guests[0]))
	kc, src := e.rogueConnect(t, ra, 1, 41510, dst)
	sc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	rb.send(proto.Msg{Type: proto.Open, ReqID: 2, Role: proto.Passive, Local: dst, Remote: src})
	ma, fa := ra.ready(1)
	_, fb := rb.ready(2)
	size := func(f *os.File) int64 {
		st, err := f.Stat()
		if err != nil {
			t.Fatal(err)
		}
		return st.Size()
	}
	n := int(size(fa))
	memA, err := sys.Map(fa, n)
	if err != nil {
		t.Fatal(err)
	}
	defer sys.Unmap(memA)
	memB, err := sys.Map(fb, n)
	if err != nil {
		t.Fatal(err)
	}
	defer sys.Unmap(memB)
	// Bytes cross through the shared memory, past hostd.
	data := int(ma.RingAB) + ring.HeaderSize
	copy(memA[data:], "collusion")
	if string(memB[data:data+9]) != "collusion" {
		t.Fatal("the two mappings do not share memory")
	}
	// A made-up counter is never shown as bytes moved.
	binary.LittleEndian.PutUint64(memA[int(ma.RingAB)+ring.OffTail:], 1<<62)
	fl := e.flows()
	if len(fl) != 1 || fl[0].RingsAB >= 1<<62 || !strings.Contains(fl[0].Counters, "guest-reported") || !strings.Contains(fl[0].Counters, "implausible") {
		t.Fatalf("hostd flows after a tail of 2^62: %+v; want it dropped and labelled guest-reported", fl)
	}
	// Revoked: the conntrack entry goes. Neither end leaves.
	revoked := time.Now()
	e.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "7510")
	eventually(t, 10*time.Second, "hostd took the region's memory back", func() bool { return size(fa) == 0 })
	took := time.Since(revoked)
	t.Logf("memory taken back %v after the revocation", took.Round(time.Millisecond))
	if took > 3*time.Second+2*time.Second {
		t.Errorf("memory taken back %v after the revocation; want within the grace (revoke_grace = 3s, integration/stack) plus 1 s", took)
	}
	for i, mem := range [][]byte{memA, memB} {
		var got byte
		if err := fault.Do(func() { got = mem[data] }); !errors.Is(err, fault.ErrFault) {
			t.Fatalf("guest %d's kept mapping after the revocation: read %q (%v); want a fault: nothing reachable", i+1, got, err)
		}
	}
	if m, err := unix.Mmap(int(fb.Fd()), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		var got byte
		ferr := fault.Do(func() { got = m[data] })
		unix.Munmap(m)
		if !errors.Is(ferr, fault.ErrFault) {
			t.Fatalf("a fresh mapping of the revoked region reads %q (%v); want nothing", got, ferr)
		}
	}
	if err := fa.Truncate(int64(n)); !errors.Is(err, unix.EPERM) {
		t.Fatalf("growing the revoked region back: %v, want EPERM (sealed)", err)
	}
	// Bytes no longer cross: the lease, on TCP, is the kernel's.
	_ = kc.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := kc.Write([]byte("k")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(sc, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
}

// TestHostileRegionTruncateC: the same truncation with an unmodified C
// program as the honest end (socat under shunt-run, passive): it gets an
// error or the kernel's verdict on the connection and ends normally,
// never by SIGBUS (before: exit 135), and hostd stays up.
func TestHostileRegionTruncateC(t *testing.T) {
	testenv.NeedTool(t, "truncate", "coreutils")
	testenv.NeedTool(t, "socat", "socat")
	e := rgEnv(t, 3, false, "")
	// The hostile guest (3) listens; socat connects to it. (socat as the
	// listener closes its listening socket at accept, which can reach
	// hostd before the other side's OPEN: the pair then stays on TCP.)
	g3 := e.rig.Guests[2]
	dst := netip.AddrPortFrom(g3.Addr, 7520)
	r := dialFdRogue(t, e.Control(g3))
	r.send(proto.Msg{Type: proto.Listen, Local: dst})
	var ln net.Listener
	if err := nsrig.In(g3.NSPath(), func() (err error) { ln, err = net.Listen("tcp4", dst.String()); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cmd := e.toolCmd(t, true, 2, "socat", "-u", "TCP4:"+dst.String(), "STDOUT")
	out := e.startLog(2, cmd)
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
	kc, err := ln.Accept()
	if err != nil {
		t.Fatalf("socat did not connect: %v\n%s", err, out)
	}
	defer kc.Close()
	src := kc.RemoteAddr().(*net.TCPAddr).AddrPort()
	r.send(proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Passive, Local: dst, Remote: netip.AddrPortFrom(src.Addr().Unmap(), src.Port())})
	_, f := r.ready(1)
	if !out.waitCount(": shunt (slot", 1, 10*time.Second) {
		t.Fatalf("socat's end did not take the rings:\n%s", out)
	}
	if o, err := asNobody(f, "truncate", "-s", "0", "/dev/fd/3"); err != nil {
		t.Fatalf("truncate as uid 65534: %v, %s", err, o)
	}
	_ = kc.SetDeadline(time.Now().Add(5 * time.Second))
	_, _ = kc.Write([]byte("after\n"))
	r.send(proto.Msg{Type: proto.Close, ReqID: 1, Side: proto.SideB})
	kc.Close()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				t.Fatalf("socat died of %v after its peer truncated the region:\n%s", ws.Signal(), out)
			}
		}
		t.Logf("socat ended: %v", err)
	case <-time.After(15 * time.Second):
		cmd.Process.Kill()
		<-done // before the cleanup's Wait
		t.Fatalf("socat did not end 15 s after its peer truncated the region and closed:\n%s", out)
	}
	e.flows() // hostd answers
	e.rgRoundTrip(t, 1, 2, 7521)
}
