package guestlib

import (
	"testing"
	"time"
)

// TestOpenDelayAdapts: connections offered to hostd that end soon after
// their OPEN double the open delay, up to maxOpenDelay; ones that live
// long halve it, down to the configured delay; a delay of 0 (at once)
// never changes.
func TestOpenDelayAdapts(t *testing.T) {
	d := newOpenDelay(5 * time.Millisecond)
	for _, want := range []time.Duration{10, 20, 40, 80, 160, 200, 200} {
		if got, _ := d.lived(2 * time.Millisecond); got != want*time.Millisecond {
			t.Fatalf("after a short connection: delay %v, want %v", got, want*time.Millisecond)
		}
	}
	for _, want := range []time.Duration{100 * time.Millisecond, 50 * time.Millisecond, 25 * time.Millisecond, 12500 * time.Microsecond, 6250 * time.Microsecond, 5 * time.Millisecond, 5 * time.Millisecond} {
		if got, _ := d.lived(time.Second); got != want {
			t.Fatalf("after a long connection: delay %v, want %v", got, want)
		}
	}
	// A connection that lived less than four delays did not pay for its
	// OPEN, even past openPays.
	d.cur.Store(int64(100 * time.Millisecond))
	if got, _ := d.lived(300 * time.Millisecond); got != 200*time.Millisecond {
		t.Fatalf("300 ms after OPEN with a 100 ms delay: %v, want 200ms", got)
	}
	at := newOpenDelay(-1)
	if got, changed := at.lived(time.Microsecond); changed || got != -1 {
		t.Fatalf("OPEN at once: %v (changed %v)", got, changed)
	}
}
