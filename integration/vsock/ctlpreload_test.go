//go:build linux

package vsock_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// ctlLen is TestVsockPreloadControl's stream each way: paced at both ends
// (10 ms after a write call of 48 KB on average), so it lasts about
// 2 s on the rings, long enough for `hostd flows` to be asked while it
// is there.
const ctlLen = 8 << 20

// The VM's nginx (TestVsockPreloadControl): its port, and /blob's length,
// read by the process guest at most 64 KiB every 10 ms (at least 1.3 s).
const (
	ngxPort = 8080
	ngxLen  = 8 << 20
	ngxSeed = 9
)

// TestVsockPreloadControl: the C library's control channel over vsock
// (docs/vsock.md, "The control channel"). The VM of TestVsockPreload,
// but as TestVsockControlOverVsock's: no virtio-serial device at all and
// no control socket in hostd's config, so hostd serves the VM's control
// channel on its vsock device (port 1021) only. In it, shunt-edge's
// checksummed stream under shunt-run -v, with no SHUNT_VSOCK and no
// SHUNT_CONTROL (the library finds no port but /dev/vsock, as Go's does)
// and as uid 65534 (a server's worker after setuid: vsock needs no file
// permission), to shunt-edge's server under shunt-run in a process
// guest. It asserts both ends' PASS (8 MiB each way, checked byte for
// byte), the VM's library log saying its control went over vsock and its
// connection over a stretch (which the channel over vsock turned on by
// itself), `hostd flows` showing the connection on the rings via vsock
// while the stream lasts, shunt-vstretchd's count at BYE (bytes each
// way) and hostd's device at least as much, the control stream and the
// stretch both accepted on the device. Then Debian's nginx under
// shunt-run -v in the VM (its own nginx.conf: `user nobody`, as the
// package's drops to www-data), from which the process guest (guestlib)
// reads an 8 MiB file: its SHA-256 must match, the process guest's
// connection must have read from the rings, `hostd flows` must show it
// on the rings via vsock, and the VM's log must show sessions over vsock
// of nginx's master and of its worker (nobody). After 120 s it fails
// with hostd's flows, counters and log, the server's output and the VM's
// console.
func TestVsockPreloadControl(t *testing.T) {
	preloadControl(t, vmHow{noPort: true})
}

// TestVsockPreloadControlHybrid: the same with the VM's vsock device this
// test's, exposed to hostd as a hybrid vsock socket (TestVsockHybrid's
// stand-in for Firecracker's or Cloud Hypervisor's device): hostd serves
// the control channel and the stretches at <socket>_<port>, as it would
// for Firecracker, whose guests have no virtio-serial. The device's own
// counters stand for hostd's.
func TestVsockPreloadControlHybrid(t *testing.T) {
	preloadControl(t, vmHow{noPort: true, hybrid: true})
}

// preloadControl runs TestVsockPreloadControl with the VM set up as how
// says (noPort, and hybrid or not).
func preloadControl(t *testing.T, how vmHow) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	dir, bin := buildCSide(t)
	var edgeOut lockedBuffer
	var v *vsockVM
	how.files = cSideFiles(bin)
	how.before = func(vm *vsockVM) {
		v = vm
		v.more = func() string {
			return fmt.Sprintf("process guest's shunt-edge server:\n%s", edgeOut.String())
		}
		addr := v.s.Rig.Guests[0].Addr.String()
		v.serveC(ctx, bin, &edgeOut, edgePort, []string{"SHUNT_EDGE_PACE_US=10000"}, bin("shunt-edge"), "server", addr, fmt.Sprint(edgePort))
	}
	startVsockVMHow(t, ctx, how, "cdir:"+dir+":0:0", "vstretchd:0:0:0", fmt.Sprintf("cedgectl:%d:%d:8", edgePort, ctlLen), fmt.Sprintf("cnginx:%d:%d:%d", ngxPort, ngxLen, ngxSeed), "pause:100000:0:0")
	ctx = v.r.ctx

	// hostd's end: the connection on the rings via vsock, while it lasts.
	v.waitOn(ctx, edgePort, "rings")
	t.Logf("hostd flows: the connection to port %d on the rings via vsock, %v after the start", edgePort, time.Since(start).Round(time.Millisecond))

	// The checksummed stream, both ends.
	line, err := v.r.v.WaitAny(ctx, 0, "SHUNT-VSOCK cedgectl port=", "SHUNT-VSOCK ERROR")
	if err != nil || !strings.Contains(line, "err=<nil> PASS") {
		v.fail("the VM's shunt-edge stream (uid 65534, control over vsock): %q %v", line, err)
	}
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(edgeOut.String(), "PASS stream"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			v.fail("the process guest's shunt-edge server did not pass its end of the stream")
		}
	}

	// The VM library's end: control over vsock, the connection on a
	// stretch's rings, nothing said of SHUNT_VSOCK.
	console := v.r.v.Console()
	for _, want := range []string{"SHUNT-VSOCK C shunt: control over vsock (CID 2 port 1021)", "over vsock (shunt-vstretchd)", ": shunt (slot"} {
		if !strings.Contains(console, want) {
			v.fail("the VM's library never logged %q", want)
		}
	}
	if strings.Contains(console, "SHUNT-VSOCK C shunt: hostd unreachable") {
		v.fail("the VM's library said hostd was unreachable")
	}
	if !strings.Contains(edgeOut.String(), ": shunt (slot") {
		v.fail("the process guest's library never put the connection on rings")
	}

	// What the stretch carried (shunt-vstretchd's count at BYE), and the
	// device at least that: the bytes really crossed vsock.
	var closed string
	for {
		if c := v.r.v.Console(); strings.Contains(c, " closed: {BytesIn:") {
			closed = c[strings.Index(c, " closed: {BytesIn:")+len(" closed: "):]
			break
		}
		if ctx.Err() != nil {
			v.fail("shunt-vstretchd never said the stretch closed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	var in, out float64
	if _, err := fmt.Sscanf(closed, "{BytesIn:%g Freed:%g BytesOut:%g", &in, new(float64), &out); err != nil || in <= 0 || out <= 0 {
		v.fail("the stretch carried %v bytes from the VM and %v to it (%q, %v)", in, out, closed, err)
	}
	// The device (hostd's, or on a hybrid vsock this test's): at least
	// what the stretch carried, and the control stream and the stretch
	// each a connection the VM made to a listener on it.
	rx, tx, accepted := "shunt_vsock_bytes_total{direction=rx,guest=vm}", "shunt_vsock_bytes_total{direction=tx,guest=vm}", "shunt_vsock_accepted_total{guest=vm}"
	cs := counters(v.hostd, v.s.Admin)
	dev := map[string]float64{rx: counterValue(cs, rx), tx: counterValue(cs, tx), accepted: counterValue(cs, accepted)}
	if how.hybrid {
		ds := v.r.dev.Stats()
		dev = map[string]float64{rx: float64(ds.RxBytes.Load()), tx: float64(ds.TxBytes.Load()), accepted: float64(ds.Accepted.Load())}
	}
	for key, n := range map[string]float64{rx: in, tx: out, accepted: 2} {
		if dev[key] < n {
			v.fail("the device's %s = %v after the stream: want at least %v (the stretch's bytes; the control channel and the stretch)", key, dev[key], n)
		}
	}
	t.Logf("the stretch carried %.0f bytes of the VM's stream and %.0f of the process guest's", in, out)
	t.Logf("shunt-edge stream, control over vsock, uid 65534: %s", line)
	before := strings.Count(v.r.v.Console(), "SHUNT-VSOCK C shunt: control over vsock")

	// nginx, its worker as nobody: the process guest reads /blob.
	if l, err := v.r.v.WaitAny(ctx, 0, "SHUNT-VSOCK cnginx port=", "SHUNT-VSOCK ERROR"); err != nil || !strings.HasSuffix(l, "listening") {
		v.fail("the VM's nginx: %q %v", l, err)
	}
	ngxRead(ctx, v)
	if n := strings.Count(v.r.v.Console(), "SHUNT-VSOCK C shunt: control over vsock") - before; n < 2 {
		v.fail("the VM's log shows %d sessions over vsock since nginx started: want nginx's master's and its worker's", n)
	}
	t.Logf("boot %v, whole test %v", v.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// ngxRead reads /blob from the VM's nginx through the process guest's
// guestlib, at most 64 KiB every 10 ms, and checks its SHA-256 and that
// the connection went on the rings (via vsock in `hostd flows`, and the
// process guest's bytes read from its ring).
func ngxRead(ctx context.Context, v *vsockVM) {
	v.t.Helper()
	c, err := v.s.Dial(ctx, 1, fmt.Sprintf("%s:%d", vsockVMAddr, ngxPort))
	if err != nil {
		v.fail("dial the VM's nginx: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(60 * time.Second))
	type got struct {
		status int
		n      int64
		sum    string
		err    error
	}
	done := make(chan got, 1)
	go func() {
		var g got
		defer func() { done <- g }()
		if _, g.err = c.Write([]byte("GET /blob HTTP/1.0\r\nHost: vm\r\n\r\n")); g.err != nil {
			return
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if g.err = err; err != nil {
			return
		}
		defer resp.Body.Close()
		g.status = resp.StatusCode
		h := sha256.New()
		for {
			k, err := io.CopyN(h, resp.Body, 64<<10)
			g.n += k
			if err == io.EOF {
				break
			}
			if g.err = err; err != nil {
				return
			}
			time.Sleep(10 * time.Millisecond) // a slow reader: the body outlives the switch to the rings
		}
		g.sum = fmt.Sprintf("%x", h.Sum(nil))
	}()
	v.waitOn(ctx, ngxPort, "rings")
	var g got
	select {
	case g = <-done:
	case <-ctx.Done():
		v.fail("the process guest's GET /blob did not end")
	}
	if want := seededSum(ngxSeed, ngxLen); g.err != nil || g.status != 200 || g.n != ngxLen || g.sum != want {
		v.fail("GET /blob from the VM's nginx: status %d, %d bytes, sha256 %s, %v: want 200, %d bytes, %s", g.status, g.n, g.sum, g.err, ngxLen, want)
	}
	st := c.Stats()
	if st.RingReceived == 0 {
		v.fail("the process guest read none of nginx's reply from the rings: %+v", st)
	}
	v.t.Logf("GET /blob from the VM's nginx (worker as nobody): %d bytes, SHA-256 equal; process guest read %d from the rings, %d by TCP", g.n, st.RingReceived, st.TCPReceived)
}
