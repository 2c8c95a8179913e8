package integration

import (
	"hash/crc32"
	"io"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// steady opens a fast-path connection from guest a to guest b's listener on
// port and moves checksummed data over it, beside an attack, until the
// returned stop is called. stop waits until at least warm bytes have moved
// (so the stream spans the attack), then checks that every byte arrived
// intact and that both ends stayed on the fast path. It also returns the
// client's end, to find the flow.
func (e *env) steady(t testing.TB, a, b, port int, warm int64) (c *guestlib.Conn, stop func()) {
	t.Helper()
	c, s := e.pair(a, b, port)
	if !fastSoon(t, c, s) {
		t.Fatalf("honest flow %d->%d: paths %s and %s, want the fast path", a, b, c.Path(), s.Path())
	}
	quit, warmed, werr := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	var sent uint32
	var n int64
	go func() {
		src := rand.NewChaCha8([32]byte{byte(a), byte(b), byte(port), byte(port >> 8)})
		buf := make([]byte, 32<<10)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for first := true; ; first = false {
			if !first {
				select {
				case <-quit:
					werr <- c.CloseWrite()
					return
				case <-tick.C:
				}
			}
			src.Read(buf)
			sent = crc32.Update(sent, crc32.IEEETable, buf)
			if _, err := c.Write(buf); err != nil {
				werr <- err
				return
			}
			if n += int64(len(buf)); n >= warm && n-int64(len(buf)) < warm || warm == 0 && first {
				close(warmed)
			}
		}
	}()
	type result struct {
		n   int64
		sum uint32
		err error
	}
	rc := make(chan result, 1)
	go func() {
		h := crc32.NewIEEE()
		k, err := io.Copy(h, s)
		rc <- result{k, h.Sum32(), err}
	}()
	return c, func() {
		t.Helper()
		select {
		case <-warmed:
		case <-time.After(30 * time.Second):
			t.Fatalf("honest flow %d->%d: not %d bytes moved in 30s", a, b, warm)
		}
		close(quit)
		if err := <-werr; err != nil {
			t.Errorf("honest flow %d->%d: writer: %v", a, b, err)
			return
		}
		var r result
		select {
		case r = <-rc:
		case <-time.After(30 * time.Second):
			t.Fatalf("honest flow %d->%d: the reader did not finish in 30s", a, b)
		}
		if r.err != nil || r.n != n || r.sum != sent || n == 0 {
			t.Errorf("honest flow %d->%d: received %d bytes crc %08x (%v); sent %d crc %08x", a, b, r.n, r.sum, r.err, n, sent)
		}
		if !fastSoon(t, c, s) {
			t.Errorf("honest flow %d->%d left the fast path: %s, %s", a, b, c.Path(), s.Path())
		}
	}
}
