package guestlib

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/guesttest"
)

// TestUnreachableSaidOnce: a Client that cannot reach hostd says why
// once, with what to do, not at every retry.
func TestUnreachableSaidOnce(t *testing.T) {
	h := guesttest.Start(t)
	var mu sync.Mutex
	var lines []string
	c := newClient(t, h, Options{Logf: func(f string, a ...any) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, fmt.Sprintf(f, a...))
	}})
	c.opts.Control = h.Control + ".missing"
	for range 3 {
		c.mu.Lock()
		c.lastTry = time.Time{} // retry at once
		c.mu.Unlock()
		if err := c.ensure(); !errors.Is(err, errNoHostd) {
			t.Fatalf("ensure without hostd = %v, want errNoHostd", err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	n := 0
	for _, l := range lines {
		if strings.Contains(l, "cannot reach hostd") {
			n++
			if !strings.Contains(l, "netns in hostd.hcl") || !strings.Contains(l, "(no-hostd)") {
				t.Errorf("line %q: want the reason and the fix", l)
			}
		}
	}
	if n != 1 {
		t.Fatalf("said %d times in 3 tries, want once: %q", n, lines)
	}
}
