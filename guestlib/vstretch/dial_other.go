//go:build !linux

package vstretch

import (
	"errors"
	"net"
)

// Dial: AF_VSOCK is Linux's.
func Dial(port uint32) (net.Conn, error) { return nil, errors.New("vsock: not on this system") }
