//go:build linux

package vsock_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// TestVsockHostdKilled: the VM of TestVsockProcessGuest and the process
// guest stream seeded bytes both ways at once (64 KiB every 10 ms each)
// on the rings via vsock; hostd is SIGKILLed mid-stream, with its room's
// bridge and the VM's vhost-user device, and started again. The new
// hostd adopts the pair region and, once both ends reattached, resumes
// the connection on TCP at exact offsets (docs/vsock.md, "hostd
// restarts"): the VM at where the dead bridge stopped writing the ring
// toward the process guest, the process guest at where the VM's read
// ring ended (its ENDED). Each writer resends from its own ring what the
// other's ring lacks. Then the process guest ends its stream, the VM its
// own once it read that end: both directions' lengths and SHA-256 must
// match at both ends, both must have resent bytes from their rings, and
// hostd's log must show the adoption and the resume. Before, the new
// hostd moved the adopted flow to TCP by DOWN, as a region's rings, and
// both readers waited for leave marks no bridge would write: the stream
// stalled until the deadline.
func TestVsockHostdKilled(t *testing.T) {
	hostdKilled(t, vmHow{})
}

// TestVsockHostdKilledHybrid: TestVsockHostdKilled for the VM of
// TestVsockHybrid, whose vsock device (the hypervisor's, here this
// test's stand-in) outlives hostd, its control channel over vsock: after
// the resume on TCP the connection must return to the rings (a fresh
// ring pair and stretch, the process guest's second READY) and carry
// 1 MiB more there before the end.
func TestVsockHostdKilledHybrid(t *testing.T) {
	hostdKilled(t, vmHow{noPort: true, hybrid: true})
}

// TestVsockHostdKilledQEMU: TestVsockHostdKilled with the QEMU VM's
// device served by shunt-vsockd (hostd's vsockd_socket), which outlives
// hostd: the restarted hostd names the device again, the daemon keeps it
// (the same QEMU session, never re-served), and after the resume on TCP
// the connection returns to the rings through it, as on a hybrid device,
// and carries 1 MiB more there before the end.
func TestVsockHostdKilledQEMU(t *testing.T) {
	hostdKilled(t, vmHow{vsockd: true})
}

// TestVsockHostdKilledQEMUVsockControl: TestVsockHostdKilledQEMU for a
// VM with no virtio-serial port, whose control channel too goes through
// shunt-vsockd (port 1021 forwarded to hostd): after the kill the VM's
// library reconnects to the new hostd through the daemon.
func TestVsockHostdKilledQEMUVsockControl(t *testing.T) {
	hostdKilled(t, vmHow{vsockd: true, noPort: true})
}

// hostdKilled runs TestVsockHostdKilled with the VM set up as how says.
func hostdKilled(t *testing.T, how vmHow) {
	kept := how.hybrid || how.vsockd // the device outlives hostd
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	v := startVsockVMHow(t, ctx, how, fmt.Sprintf("gflip:%d:0:11", procPort), "pause:5000:0:0")
	r, c := v.r, v.c
	ctx = r.ctx
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	v.onRings(ctx)
	p := procDuplex(c.(halfCloser), 13)
	conn := c.(interface{ Stats() guestlib.Stats })
	for conn.Stats().RingReceived < 1<<20 {
		if ctx.Err() != nil {
			v.fail("the process guest read less than 1 MiB on the rings: %+v", conn.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// shunt-vsockd's device's rx and tx bytes just before the kill: every
	// byte of the stretch after the return crosses it after this.
	var dev0 [2]float64
	if how.vsockd {
		out := counters(v.hostd, v.s.Admin)
		for i, d := range []string{"rx", "tx"} {
			dev0[i] = counterValue(out, fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=vm}", d))
		}
	}
	v.s.KillHostd()
	t.Logf("hostd killed; process guest's connection %+v", conn.Stats())
	if err := v.s.StartHostd(); err != nil {
		v.fail("start hostd again: %v", err)
	}

	// The new hostd adopts the pair region and RESUMEs both ends once
	// they reattached (its log says so: a line stays, a path may not).
	for _, want := range []string{"adopted a vsock VM's stretch", "resuming an adopted vsock stretch on TCP"} {
		for !strings.Contains(v.s.Log(), want) {
			if ctx.Err() != nil {
				v.fail("hostd's log does not say %q", want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// Bytes on TCP after the resume (the VM's resend among them): 1 MiB
	// on QEMU, where the connection stays on TCP; on a hybrid device it
	// may return to the rings sooner (the end's checks ask for TCP bytes
	// both ways).
	least := uint64(1 << 20)
	if kept {
		least = 1
	}
	waitBytes(ctx, v, least, "on TCP after the resume", func(s guestlib.Stats) uint64 { return s.TCPReceived })
	if kept {
		// Back on the rings: a second READY, hostd's flows say so, and
		// 1 MiB more read there.
		for conn.Stats().Readies < 2 {
			if ctx.Err() != nil {
				v.fail("the connection did not return to the rings: %+v", conn.Stats())
			}
			time.Sleep(10 * time.Millisecond)
		}
		v.waitPath(ctx, "rings")
		waitBytes(ctx, v, 1<<20, "on the rings after the return", func(s guestlib.Stats) uint64 { return s.RingReceived })
		if how.vsockd {
			vsockdKept(v, dev0)
		}
	} else {
		// On QEMU it stays on TCP (a state that lasts: waited for).
		v.waitPath(ctx, "tcp")
		if fi, ok, err := v.s.ConnOn(procPort); err != nil || !ok || fi.Path != "tcp" || fi.Reason != "shutdown" {
			v.fail("hostd's flows: %+v %v %v: want the connection on tcp (shutdown): QEMU's device died with hostd", fi, ok, err)
		}
	}
	t.Logf("process guest's connection %+v", conn.Stats())
	ps, f, line, vmSent := finishGflip(ctx, v, p)
	st := conn.Stats()
	vmResent, _ := strconv.ParseInt(f["resent"], 10, 64)
	if st.Resent == 0 || vmResent == 0 || st.TCPSent == 0 || st.TCPReceived == 0 {
		v.fail("the resume resent nothing from the rings (process guest %+v; VM %q)", st, line)
	}
	t.Logf("VM -> process guest %d bytes, process guest -> VM %d bytes, checksums equal; resent from the rings: VM %d, process guest %d; process guest %+v",
		vmSent, ps.n, vmResent, st.Resent, st)
	t.Logf("boot %v, whole test %v", v.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// finishGflip ends the process guest's side p of the VM's gflip stream
// (seed 11 from the VM) and waits for both its directions and the VM's
// line; both directions' lengths and SHA-256 must match at both ends. It
// returns what the process guest sent, the VM's fields and line, and
// how many bytes the VM sent.
func finishGflip(ctx context.Context, v *vsockVM, p duplex) (ps duplexGot, f map[string]string, line string, vmSent int64) {
	v.t.Helper()
	conn := v.c.(interface{ Stats() guestlib.Stats })
	close(p.end)
	var pr duplexGot
	select {
	case ps = <-p.sent:
	case <-ctx.Done():
		v.fail("the process guest's writer did not end: %+v", conn.Stats())
	}
	select {
	case pr = <-p.recv:
	case <-ctx.Done():
		v.fail("the process guest did not read the VM's stream to its end: %+v", conn.Stats())
	}
	if ps.err != nil || pr.err != nil {
		v.fail("process guest: write %d bytes: %v; read %d bytes: %v; %+v", ps.n, ps.err, pr.n, pr.err, conn.Stats())
	}
	line, err := v.r.v.WaitAny(ctx, 0, fmt.Sprintf("SHUNT-VSOCK gflip port=%d ", procPort), "SHUNT-VSOCK ERROR")
	if err != nil || !strings.HasPrefix(line, "SHUNT-VSOCK gflip") {
		v.fail("the VM's stream: %q %v", line, err)
	}
	f = fields(line)
	// The VM's stream is seeded, so its sum is known from its length.
	vmSent, _ = strconv.ParseInt(f["sentbytes"], 10, 64)
	h := sha256.New()
	io.CopyN(h, rand.NewChaCha8(seedBytes(11)), vmSent)
	if want := fmt.Sprintf("%x", h.Sum(nil)); f["sent"] != want || fmt.Sprintf("%x", pr.sum) != want || pr.n != vmSent {
		v.fail("VM to process guest: the VM sent %d bytes (sum %s, seeded %s), the process guest got %d (sum %x)", vmSent, f["sent"], want, pr.n, pr.sum)
	}
	if f["recv"] != fmt.Sprintf("%x", ps.sum) || f["bytes"] != strconv.FormatInt(ps.n, 10) {
		v.fail("process guest to VM: sent %d bytes (sum %x), the VM got %s (sum %s)", ps.n, ps.sum, f["bytes"], f["recv"])
	}
	return ps, f, line, vmSent
}

// waitBytes waits until the process guest's connection counted least
// bytes more by count (what) than when called.
func waitBytes(ctx context.Context, v *vsockVM, least uint64, what string, count func(guestlib.Stats) uint64) {
	v.t.Helper()
	conn := v.c.(interface{ Stats() guestlib.Stats })
	for n := count(conn.Stats()); count(conn.Stats()) < n+least; {
		if ctx.Err() != nil {
			v.fail("the process guest read less than %d bytes %s: %+v", least, what, conn.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// halfCloser is a connection that can end its writes alone.
type halfCloser interface {
	io.ReadWriter
	CloseWrite() error
}

// duplexGot is one direction of procDuplex: its length, SHA-256, and how
// it ended.
type duplexGot struct {
	n   int64
	sum []byte
	err error
}

// duplex is the process guest's end of a paced duplex stream.
type duplex struct {
	end        chan struct{} // close: the writer half-closes
	sent, recv chan duplexGot
}

// procDuplex reads c to EOF and writes seed's bytes to it, 64 KiB every
// 10 ms, until end is closed.
func procDuplex(c halfCloser, seed uint64) duplex {
	d := duplex{end: make(chan struct{}), sent: make(chan duplexGot, 1), recv: make(chan duplexGot, 1)}
	go func() {
		h := sha256.New()
		n, err := io.Copy(h, c)
		d.recv <- duplexGot{n, h.Sum(nil), err}
	}()
	go func() {
		h := sha256.New()
		src := rand.NewChaCha8(seedBytes(seed))
		buf := make([]byte, 64<<10)
		var n int64
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-d.end:
				d.sent <- duplexGot{n, h.Sum(nil), c.CloseWrite()}
				return
			case <-tick.C:
			}
			src.Read(buf)
			k, err := c.Write(buf)
			h.Write(buf[:k])
			n += int64(k)
			if err != nil {
				d.sent <- duplexGot{n, h.Sum(nil), err}
				return
			}
		}
	}()
	return d
}

// vsockdKept checks, after the return to the rings, that shunt-vsockd
// kept the device through hostd's restart: still running, its QEMU
// served by the one session it has had, the new hostd told so, and the
// device carrying, since just before the kill (dev0: its rx and tx bytes
// then), at least the 1 MiB the process guest read on the rings from the
// VM after the return, and bytes to the VM.
func vsockdKept(v *vsockVM, dev0 [2]float64) {
	v.t.Helper()
	if v.vsockd.cmd.ProcessState != nil {
		v.fail("shunt-vsockd exited: %v", v.vsockd.cmd.ProcessState)
	}
	out := counters(v.hostd, v.s.Admin)
	if n := counterValue(out, "shunt_vsock_frontends_total{guest=vm}"); n != 1 {
		v.fail("shunt_vsock_frontends_total %v: want 1 (one QEMU session across the restart)", n)
	}
	if n := counterValue(out, "shunt_vsock_frontend_connected{guest=vm}"); n != 1 {
		v.fail("shunt_vsock_frontend_connected %v: want 1", n)
	}
	var dev [2]float64
	for i, d := range []string{"rx", "tx"} {
		dev[i] = counterValue(out, fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=vm}", d))
	}
	if dev0[0] < 0 || dev[0]-dev0[0] < 1<<20 || dev[1] <= dev0[1] {
		v.fail("shunt_vsock_bytes_total rx %v then %v, tx %v then %v: want at least 1 MiB from the VM and bytes to it through shunt-vsockd's device since the kill", dev0[0], dev[0], dev0[1], dev[1])
	}
	if !strings.Contains(v.s.Log(), "kept=true qemu_connected=true") {
		v.fail("the restarted hostd's log does not say shunt-vsockd kept the device with its QEMU")
	}
	v.t.Logf("shunt-vsockd kept the device: one QEMU session; since hostd's kill %.0f bytes from the VM and %.0f to it through it", dev[0]-dev0[0], dev[1]-dev0[1])
}
