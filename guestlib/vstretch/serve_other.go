//go:build !linux

package vstretch

import (
	"errors"
	"net"
	"time"

	"github.com/shuntnet/shunt/shm/wait"
)

// StretchDrain and StretchEnd: see serve_linux.go.
const (
	StretchDrain = 10 * time.Second
	StretchEnd   = time.Minute
)

// ServeOptions: see serve_linux.go.
type ServeOptions struct {
	Dial                      func() (net.Conn, error)
	Wait                      *wait.Policy
	MaxCapacity, MaxStretches int
	Logf                      func(format string, args ...any)
}

// Serve: memfds and AF_VSOCK are Linux's.
func Serve(l *net.UnixListener, o ServeOptions) error {
	return errors.New("shunt-vstretchd: not on this system")
}
