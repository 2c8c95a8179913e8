package vserial

import (
	"os"
	"testing"
)

// SetOpenPort replaces how Open opens one port until t ends: a test's
// stand-in can answer EBUSY, which no plain file does.
func SetOpenPort(t *testing.T, f func(path string) (*os.File, error)) {
	old := openPort
	openPort = f
	t.Cleanup(func() { openPort = old })
}
