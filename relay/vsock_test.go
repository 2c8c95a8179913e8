package relay

import (
	"bytes"
	"errors"
	"testing"
)

// TestHello: a Hello goes round with its flags; unknown flags, another
// magic or a short stream are refused (ErrHello). HelloSize is the wire
// size.
func TestHello(t *testing.T) {
	for _, h := range []Hello{{Region: 1, Slot: 2, Gen: 3}, {Region: 1<<32 - 1, Slot: 7, Gen: 1<<64 - 1, Flags: HelloHold}} {
		b := h.Encode()
		if len(b) != HelloSize {
			t.Fatalf("Encode: %d bytes, want %d", len(b), HelloSize)
		}
		got, err := ReadHello(bytes.NewReader(b))
		if err != nil || got != h {
			t.Fatalf("ReadHello(Encode(%+v)) = %+v, %v", h, got, err)
		}
		if got.Holds() != (h.Flags == HelloHold) {
			t.Fatalf("%+v: Holds %v", h, got.Holds())
		}
	}
	good := Hello{Region: 1, Slot: 2, Gen: 3, Flags: HelloHold}.Encode()
	flags := bytes.Clone(good)
	flags[12] |= 2
	magic := bytes.Clone(good)
	magic[0]++
	for name, b := range map[string][]byte{"unknown flag": flags, "magic": magic, "short": good[:HelloSize-1]} {
		if _, err := ReadHello(bytes.NewReader(b)); !errors.Is(err, ErrHello) {
			t.Errorf("%s: %v, want ErrHello", name, err)
		}
	}
}
