//go:build linux

package server

import (
	"net"

	"github.com/shuntnet/shunt/internal/nsexec"
	"github.com/shuntnet/shunt/internal/proto"
)

// listenIn listens on the abstract socket proto.NetnsControl inside the
// network namespace at nsPath: the socket belongs to the namespace it was
// made in, wherever it is accepted on later.
func listenIn(nsPath string) (net.Listener, error) {
	var l net.Listener
	err := nsexec.In(nsPath, func() error {
		var err error
		l, err = net.Listen("unix", "@"+proto.NetnsControl)
		return err
	})
	return l, err
}
