//go:build linux

package vsock_test

import (
	"context"
	"fmt"
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
	p := procDuplex(c.(halfCloser), 13)
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
	ps, f, line, vmSent := finishGflip(ctx, v, p)
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
