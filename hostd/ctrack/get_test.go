//go:build linux

package ctrack

import (
	"encoding/binary"
	"testing"
)

// FuzzParseMessages: the ctnetlink reply splitter never panics, and every
// message it returns lies inside the input.
func FuzzParseMessages(f *testing.F) {
	msg := make([]byte, 20)
	binary.NativeEndian.PutUint32(msg, 20)
	f.Add(msg)
	f.Add(append(msg, msg...))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		msgs, err := parseMessages(b)
		if err != nil {
			return
		}
		total := 0
		for _, m := range msgs {
			total += 16 + len(m.Data)
		}
		if total > len(b) {
			t.Fatalf("messages cover %d bytes of a %d-byte buffer", total, len(b))
		}
	})
}
