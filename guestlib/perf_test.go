package guestlib

import (
	"io"
	"syscall"
	"testing"
	"time"
)

// cpuTime is this process's user and system CPU so far.
func cpuTime(t testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestIdleReadOnStartedRing: a Read that waits on a ring the writer has
// already used sleeps after its spin, as one on a fresh ring does: it
// burns well under a tenth of a core over 400 ms (before the fix it spun
// without pause and without end, a whole core).
func TestIdleReadOnStartedRing(t *testing.T) {
	p := newPair(t)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	b := make([]byte, 8)
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(s, b); err != nil {
		t.Fatal(err)
	}
	if !s.Stats().ReadOnRing {
		t.Fatalf("not on the ring: %s", ends(c, s))
	}
	rb := make([]byte, 8) // not b, which the writer reads meanwhile
	read := async(func() error { _, err := s.Read(rb); return err })
	time.Sleep(50 * time.Millisecond) // past the spin
	const idle = 400 * time.Millisecond
	before := cpuTime(t)
	time.Sleep(idle)
	used := cpuTime(t) - before
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := await(t, read, "Read"); err != nil {
		t.Fatal(err)
	}
	if used > idle/10 {
		t.Fatalf("a Read waiting on an idle started ring used %v of CPU in %v, want under %v", used, idle, idle/10)
	}
	t.Logf("CPU while idle: %v in %v", used, idle)
}
