//go:build !linux

package vsock

import (
	"context"
	"errors"
	"net"
)

var errHybridLinux = errors.New("vsock: hybrid forwards need Linux (O_PATH)")

func dialOwned(context.Context, string) (*net.UnixConn, error) { return nil, errHybridLinux }

func isOwnedSocket(string) bool { return false }
