//go:build !linux

package guesttest

import "errors"

const ptySupported = false

func ptyRaw(int) (int, error) { return 0, errors.New("pseudo-terminals as ports: Linux only") }
