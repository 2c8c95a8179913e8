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
	"github.com/shuntnet/shunt/integration/stack"
)

// vsockFlips is how many times TestVsockPolicyFlips moves the connection
// to TCP and back.
const vsockFlips = 6

// TestVsockPolicyFlips: a VM over vsock (as TestVsockProcessGuest) and a
// process guest stream seeded bytes both ways at once (64 KiB every
// 10 ms each) while the policy flips the connection to TCP and back
// vsockFlips times, each switch waited for in `hostd flows`. Each
// downgrade stops both stretch bridges and moves the ends by RESUME: the
// room says where the ring the VM writes ended, the VM where the ring it
// reads ended (ENDED), and each writer resends the rest on TCP
// (docs/vsock.md, "Switching back"). Then the process guest ends its
// stream, the VM ends its own once it read to that end: both directions'
// lengths and SHA-256 must match at both ends, and both ends must have
// moved bytes on the rings and on TCP and taken a READY per stretch.
func TestVsockPolicyFlips(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Second)
	defer cancel()
	v := startVsockVM(t, ctx, fmt.Sprintf("gflip:%d:0:11", procPort), "pause:5000:0:0")
	r, c := v.r, v.c
	ctx = r.ctx
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	v.onRings(ctx)

	// The process guest's end: reads to EOF, writes until told to end.
	type got struct {
		n   int64
		sum []byte
		err error
	}
	recv := make(chan got, 1)
	go func() {
		h := sha256.New()
		n, err := io.Copy(h, c)
		recv <- got{n, h.Sum(nil), err}
	}()
	end := make(chan struct{})
	sent := make(chan got, 1)
	go func() {
		h := sha256.New()
		src := rand.NewChaCha8(seedBytes(13))
		buf := make([]byte, 64<<10)
		var n int64
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-end:
				sent <- got{n, h.Sum(nil), c.(interface{ CloseWrite() error }).CloseWrite()}
				return
			case <-tick.C:
			}
			src.Read(buf)
			k, err := c.Write(buf)
			h.Write(buf[:k])
			n += int64(k)
			if err != nil {
				sent <- got{n, h.Sum(nil), err}
				return
			}
		}
	}()
	conn := c.(interface{ Stats() guestlib.Stats })
	for i := range vsockFlips {
		t0 := time.Now()
		if _, err := v.s.SetPolicy(stack.PolicyTCP); err != nil {
			v.fail("flip %d: %v", i, err)
		}
		v.waitPath(ctx, "tcp")
		t1 := time.Now()
		if _, err := v.s.SetPolicy(""); err != nil {
			v.fail("flip %d: %v", i, err)
		}
		v.waitPath(ctx, "rings")
		t.Logf("flip %d: to tcp in %v, back on the rings in %v; process guest's connection %+v", i, t1.Sub(t0).Round(time.Millisecond), time.Since(t1).Round(time.Millisecond), conn.Stats())
		time.Sleep(300 * time.Millisecond) // bytes on the rings between flips
	}
	close(end)
	var ps, pr got
	select {
	case ps = <-sent:
	case <-ctx.Done():
		v.fail("the process guest's writer did not end")
	}
	select {
	case pr = <-recv:
	case <-ctx.Done():
		v.fail("the process guest did not read the VM's stream to its end: %+v", conn.Stats())
	}
	if ps.err != nil || pr.err != nil {
		v.fail("process guest: write %d bytes: %v; read %d bytes: %v; %+v", ps.n, ps.err, pr.n, pr.err, conn.Stats())
	}
	line, err := r.v.WaitAny(ctx, 0, fmt.Sprintf("SHUNT-VSOCK gflip port=%d ", procPort), "SHUNT-VSOCK ERROR")
	if err != nil || !strings.HasPrefix(line, "SHUNT-VSOCK gflip") {
		v.fail("the VM's stream: %q %v", line, err)
	}
	f := fields(line)
	// The VM's stream is seeded, so its sum is known from its length.
	vmSent, _ := strconv.ParseInt(f["sentbytes"], 10, 64)
	h := sha256.New()
	io.CopyN(h, rand.NewChaCha8(seedBytes(11)), vmSent)
	if want := fmt.Sprintf("%x", h.Sum(nil)); f["sent"] != want || fmt.Sprintf("%x", pr.sum) != want || pr.n != vmSent {
		v.fail("VM to process guest: the VM sent %d bytes (sum %s, seeded %s), the process guest got %d (sum %x)", vmSent, f["sent"], want, pr.n, pr.sum)
	}
	if f["recv"] != fmt.Sprintf("%x", ps.sum) || f["bytes"] != strconv.FormatInt(ps.n, 10) {
		v.fail("process guest to VM: sent %d bytes (sum %x), the VM got %s (sum %s)", ps.n, ps.sum, f["bytes"], f["recv"])
	}
	// Both ends moved bytes on both paths, and took a READY per stretch.
	st := conn.Stats()
	vmRing, vmTCP, vmReadies := strings.Split(f["ring"], "/"), strings.Split(f["tcp"], "/"), f["readies"]
	if st.RingSent == 0 || st.RingReceived == 0 || st.TCPSent == 0 || st.TCPReceived == 0 || st.Readies < vsockFlips+1 ||
		len(vmRing) != 2 || vmRing[0] == "0" || vmRing[1] == "0" || len(vmTCP) != 2 || vmTCP[0] == "0" || vmTCP[1] == "0" ||
		atoi(vmReadies) < vsockFlips+1 {
		v.fail("per-path counts: process guest %+v; VM %q", st, line)
	}
	t.Logf("VM -> process guest %d bytes, process guest -> VM %d bytes, checksums equal; process guest %+v; VM: ring %s tcp %s readies %s downs %s resent %s",
		vmSent, ps.n, st, f["ring"], f["tcp"], f["readies"], f["downs"], f["resent"])
	t.Logf("boot %v, whole test %v", v.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

func atoi(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return -1
	}
	return n
}

// fields is a SHUNT-VSOCK line's key=value fields.
func fields(line string) map[string]string {
	m := map[string]string{}
	for _, f := range strings.Fields(line) {
		if k, val, ok := strings.Cut(f, "="); ok {
			m[k] = val
		}
	}
	return m
}

func seedBytes(seed uint64) (b [32]byte) {
	for i := range b {
		b[i] = byte(seed >> (8 * (i % 8)))
	}
	return b
}
