package vstretch

import (
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Dial opens an AF_VSOCK stream to the host (CID 2) on port, as a
// net.Conn with deadlines (the fd is non-blocking, in Go's poller).
func Dial(port uint32) (net.Conn, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("vsock: socket: %w", err)
	}
	if err := unix.Connect(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_HOST, Port: port}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("vsock: connect to 2:%d: %w", port, err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &conn{File: os.NewFile(uintptr(fd), "vsock"), fd: fd, port: port}, nil
}

// conn is an AF_VSOCK stream as a net.Conn (package net has no vsock).
type conn struct {
	*os.File
	fd   int
	port uint32
}

// Addr is a vsock address.
type Addr struct{ CID, Port uint32 }

func (a Addr) Network() string { return "vsock" }
func (a Addr) String() string  { return fmt.Sprintf("%d:%d", a.CID, a.Port) }

func (c *conn) LocalAddr() net.Addr {
	if sa, err := unix.Getsockname(c.fd); err == nil {
		if vm, ok := sa.(*unix.SockaddrVM); ok {
			return Addr{CID: vm.CID, Port: vm.Port}
		}
	}
	return Addr{}
}

func (c *conn) RemoteAddr() net.Addr { return Addr{CID: unix.VMADDR_CID_HOST, Port: c.port} }

func (c *conn) SetDeadline(t time.Time) error      { return c.File.SetDeadline(t) }
func (c *conn) SetReadDeadline(t time.Time) error  { return c.File.SetReadDeadline(t) }
func (c *conn) SetWriteDeadline(t time.Time) error { return c.File.SetWriteDeadline(t) }

// CloseWrite half-closes the stream.
func (c *conn) CloseWrite() error { return unix.Shutdown(c.fd, unix.SHUT_WR) }
