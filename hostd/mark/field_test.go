package mark

import (
	"errors"
	"testing"
)

func TestParseMask(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want uint32
		ok   bool
	}{
		{"0xffff0000", 0xffff0000, true},
		{"0x0000ff00", 0xff00, true},
		{" 0xf0000000 ", 0xf0000000, true},
		{"0xe0000000", 0, false}, // three bits: proof bits and one id
		{"4294901760", 0xffff0000, true},
		{"0", 0, false},
		{"0x80000000", 0, false}, // one bit: one guest
		{"0xff00ff00", 0, false}, // two runs
		{"0x1ffffffff", 0, false},
		{"high", 0, false},
	} {
		got, err := ParseMask(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseMask(%q) = %#x, %v; want %#x, ok %v", tt.in, got, err, tt.want, tt.ok)
		}
	}
}

func TestFieldValueAndID(t *testing.T) {
	f := Field{DefaultMask}
	if f.MaxID() != 0x3fff || f.Value(5) != 0x50000 || f.ID(0x50007) != 5 || f.ID(0x7) != 0 || f.ID(0xc0050000) != 5 {
		t.Fatalf("max %#x value(5) %#x id(0x50007) %d id(7) %d id(0xc0050000) %d", f.MaxID(), f.Value(5), f.ID(0x50007), f.ID(7), f.ID(0xc0050000))
	}
	if f.PassOrig() != 0x80000000 || f.PassReply() != 0x40000000 || f.IDMask() != 0x3fff0000 {
		t.Fatalf("proof bits %#x %#x, id mask %#x", f.PassOrig(), f.PassReply(), f.IDMask())
	}
	if !f.Passed(0xc0050007) || f.Passed(0x80050007) || f.Passed(0x40000000) {
		t.Fatal("Passed wants both proof bits")
	}
	g := Field{0x0ff0}
	if g.MaxID() != 0x3f || g.Value(0x1ab) != 0x2b0 || g.ID(0xfabf) != 0x2b || g.Proof() != 0xc00 {
		t.Fatalf("mask 0xff0: max %#x value(0x1ab) %#x id(0xfabf) %#x proof %#x", g.MaxID(), g.Value(0x1ab), g.ID(0xfabf), g.Proof())
	}
}

// TestIDs: a guest gets its own id if it fits and is free, else its id
// from before, else the next free one counting down from the top; ids
// run out with a clear error.
func TestIDs(t *testing.T) {
	a := newIDs(7)
	take := func(name string, want, expect uint32) {
		t.Helper()
		got, err := a.take(name, want)
		if err != nil || got != expect {
			t.Fatalf("take(%s, %d) = %d, %v; want %d", name, want, got, err, expect)
		}
	}
	take("a", 1, 1)    // its own id
	take("b", 1000, 7) // too big: from the top
	take("c", 1, 6)    // 1 is a's
	a.give(7)          // b goes
	take("d", 2000, 5) // 7 was just freed: not reused yet
	take("b", 1000, 7) // b comes back: its id from before
	a.give(1)          // a goes
	take("e", 0, 4)    // no id of its own
	take("a2", 1, 1)   // a new guest with id 1 gets 1
	take("f", 9, 3)    // countdown goes on
	take("g", 9, 2)
	if _, err := a.take("h", 9); !errors.Is(err, ErrNoIDs) {
		t.Fatalf("take with every id used: %v, want ErrNoIDs", err)
	}
	a.give(5)
	take("h", 9, 5)
}
