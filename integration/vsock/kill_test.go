//go:build linux

package vsock_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// TestVsockKilled: the VM's program writes to a process guest over a
// vsock stretch, 64 KiB every 10 ms, and is SIGKILLed mid-stream (it
// never reads, so the VM's kernel ends the TCP connection with a FIN).
// Its writer never left its ring, so where its stream ended is unknown:
// the process guest must read a prefix of the seeded stream and then
// ECONNRESET, never a clean EOF (a stream cut short that reads as
// whole). Before, the room's bridge marked the ring left where the
// stream died, and the process guest's read ended with io.EOF.
func TestVsockKilled(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	v := startVsockVM(t, ctx, fmt.Sprintf("gkill:%d:0:17", procPort))
	r, c := v.r, v.c
	ctx = r.ctx
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	v.onRings(ctx)
	conn := c.(interface{ Stats() guestlib.Stats })
	type got struct {
		n   int64
		err error
	}
	done := make(chan got, 1)
	var b bytes.Buffer
	go func() {
		n, err := io.Copy(&b, c)
		done <- got{n, err}
	}()
	if line, err := r.v.WaitAny(ctx, 0, "SHUNT-VSOCK KILLED", "SHUNT-VSOCK ERROR"); err != nil || !strings.HasPrefix(line, "SHUNT-VSOCK KILLED") {
		v.fail("the VM's program was not killed: %q %v", line, err)
	}
	var g got
	select {
	case g = <-done:
	case <-ctx.Done():
		v.fail("the process guest's read did not end after the VM's program was killed: %+v", conn.Stats())
	}
	want := make([]byte, g.n)
	rand.NewChaCha8(seedBytes(17)).Read(want)
	if !bytes.Equal(b.Bytes(), want) {
		v.fail("the process guest read %d bytes that are not the VM's seeded stream", g.n)
	}
	if g.n < 1<<20 || !errors.Is(g.err, syscall.ECONNRESET) {
		v.fail("the process guest read %d bytes, then %v: want at least 1 MiB, then ECONNRESET (%+v)", g.n, g.err, conn.Stats())
	}
	t.Logf("the process guest read %d bytes of the killed program's stream, then %v; %+v", g.n, g.err, conn.Stats())
	t.Logf("boot %v, whole test %v", v.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}
